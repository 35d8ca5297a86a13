"""Input-fast image training for PyTorch Lightning."""

from lightning_fastdata import presets
from lightning_fastdata.__about__ import __version__
from lightning_fastdata._format import read_meta
from lightning_fastdata.convert import ConversionSummary, SkippedFile, convert, convert_dataset
from lightning_fastdata.cpus import usable_cpu_count
from lightning_fastdata.datamodule import FastImageDataModule
from lightning_fastdata.dataset import LmdbImageDataset
from lightning_fastdata.errors import (
    ConversionError,
    CorruptRecordError,
    DatasetFormatError,
    FastDataError,
    SampleError,
    SourceLayoutError,
)
from lightning_fastdata.monitor import LoaderMonitor
from lightning_fastdata.prefetch import DevicePrefetchLoader
from lightning_fastdata.synthetic import make_image_folder

__all__ = [
    "ConversionError",
    "ConversionSummary",
    "CorruptRecordError",
    "DatasetFormatError",
    "DevicePrefetchLoader",
    "FastDataError",
    "FastImageDataModule",
    "LmdbImageDataset",
    "LoaderMonitor",
    "SampleError",
    "SkippedFile",
    "SourceLayoutError",
    "__version__",
    "convert",
    "convert_dataset",
    "make_image_folder",
    "presets",
    "read_meta",
    "usable_cpu_count",
]
