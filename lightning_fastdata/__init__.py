"""Input-fast image training for PyTorch Lightning.

Names other than the conversion functions are imported on first use (PEP 562), so ``lightning-fastdata --help``
starts without importing torch or Lightning. Importing any Lightning-facing name also registers the
``ddp_fastdata`` strategies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_fastdata.__about__ import __version__
from lightning_fastdata.store.conversion import ConversionSummary, SkippedFile, convert, convert_dataset  # numpy, lmdb

if TYPE_CHECKING:
    from lightning_fastdata import presets
    from lightning_fastdata.cpus import usable_cpu_count
    from lightning_fastdata.datamodule import FastImageDataModule
    from lightning_fastdata.errors import (
        ConversionError,
        CorruptRecordError,
        DatasetFormatError,
        DestinationError,
        FastDataError,
        InvalidArgumentError,
        MissingSplitError,
        ReadOnlyDestinationError,
        RemoteStorageError,
        SampleError,
        SourceLayoutError,
    )
    from lightning_fastdata.monitor import LoaderMonitor
    from lightning_fastdata.pipeline.views import ViewGroup
    from lightning_fastdata.prediction import PredictionWriter
    from lightning_fastdata.prefetch import DevicePrefetchLoader
    from lightning_fastdata.presets import ResumeCheckpoint
    from lightning_fastdata.store.environments import read_meta, read_sources
    from lightning_fastdata.store.reader import LmdbImageDataset
    from lightning_fastdata.synthetic import make_image_folder

#: public name -> the module that defines it
_HOMES = {
    "ConversionError": "errors",
    "CorruptRecordError": "errors",
    "DatasetFormatError": "errors",
    "DestinationError": "errors",
    "DevicePrefetchLoader": "prefetch",
    "FastDataError": "errors",
    "FastImageDataModule": "datamodule",
    "InvalidArgumentError": "errors",
    "LmdbImageDataset": "store.reader",
    "LoaderMonitor": "monitor",
    "MissingSplitError": "errors",
    "PredictionWriter": "prediction",
    "ReadOnlyDestinationError": "errors",
    "RemoteStorageError": "errors",
    "ResumeCheckpoint": "presets",
    "SampleError": "errors",
    "SourceLayoutError": "errors",
    "ViewGroup": "pipeline.views",
    "make_image_folder": "synthetic",
    "read_meta": "store.environments",
    "read_sources": "store.environments",
    "usable_cpu_count": "cpus",
}
_LIGHTNING_MODULES = ("datamodule", "monitor", "prediction", "prefetch")

__all__ = [
    "ConversionError",
    "ConversionSummary",
    "CorruptRecordError",
    "DatasetFormatError",
    "DestinationError",
    "DevicePrefetchLoader",
    "FastDataError",
    "FastImageDataModule",
    "InvalidArgumentError",
    "LmdbImageDataset",
    "LoaderMonitor",
    "MissingSplitError",
    "PredictionWriter",
    "ReadOnlyDestinationError",
    "RemoteStorageError",
    "ResumeCheckpoint",
    "SampleError",
    "SkippedFile",
    "SourceLayoutError",
    "ViewGroup",
    "__version__",
    "convert",
    "convert_dataset",
    "make_image_folder",
    "presets",
    "read_meta",
    "read_sources",
    "usable_cpu_count",
]


def __getattr__(name: str) -> Any:
    if name == "presets":
        return importlib.import_module("lightning_fastdata.presets")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_fastdata' has no attribute {name!r}")
    if home in _LIGHTNING_MODULES:
        importlib.import_module("lightning_fastdata.presets")  # registers the ddp_fastdata strategies, as before
    value = getattr(importlib.import_module(f"lightning_fastdata.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
