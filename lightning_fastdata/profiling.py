"""Where does loading time go? Per-stage time per sample: read, decode, transforms, collate, host-to-device copy.

Measured in this process, one thread, stage by stage on the same samples, for an image folder (torchvision's
``ImageFolder`` with the standard transforms) and for a database made by ``lightning-fastdata convert`` (the
``FastImageDataModule`` pipeline).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from lightning_fastdata import _format
from lightning_fastdata.dataset import LmdbImageDataset
from lightning_fastdata.transforms import RandomResizedCropFlip, normalize_batch

_IMAGENET = (torch.tensor((0.485, 0.456, 0.406)), torch.tensor((0.229, 0.224, 0.225)))


@dataclass
class PipelineProfile:
    """Milliseconds per sample of each stage of one loading pipeline."""

    name: str
    path: str
    stages: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    @property
    def total_ms(self) -> float:
        """Milliseconds per sample, all stages."""
        return sum(self.stages.values())

    @property
    def dominant(self) -> str:
        """The stage that costs the most."""
        return max(self.stages, key=self.stages.__getitem__)

    def conclusion(self) -> str:
        """One line: which stage dominates and what would cut it."""
        stage = self.dominant
        share = self.stages[stage] / self.total_ms if self.total_ms else 0.0
        database = self.name == "database"
        gpu = torch.cuda.is_available()
        advice = {
            "read": "storage is the bottleneck: put the data on a local SSD or in the page cache"
            + ("" if database else ", or convert it to one LMDB file (`lightning-fastdata convert`)"),
            "decode": (
                "decode dominates: `--encoding raw` removes it (10x the disk)"
                + (", or `decode='device'` moves it to the GPU" if gpu else "")
                if database
                else "decoding full-size files dominates: convert with `lightning-fastdata convert --short-side 256`"
                " to decode ~3x fewer pixels"
            ),
            "transforms": (
                "the crop/resize dominates: a smaller `image_size`"
                + (", or `decode='device'` to do it on the GPU" if gpu else "")
                if database
                else "PIL transforms and float conversion dominate: FastImageDataModule crops uint8 before it resizes"
                " and normalizes on the device"
            ),
            "collate": "collation dominates: keep batches uint8 (4x fewer bytes than float32)",
            "normalize": "normalizing on the CPU dominates: train on a GPU, where it runs on the device, or use"
            " channels_last and fewer, larger steps",
            "to_device": "the host-to-device copy dominates: pin_memory=True and prefetch_to_device overlap it",
        }[stage]
        return f"{self.name}: {stage} takes {share:.0%} of {self.total_ms:.2f} ms per sample; {advice}"

    def format_table(self) -> str:
        """The stages as a Markdown table."""
        lines = [
            f"{self.name} ({self.path}), {self.samples} samples",
            "| stage | ms / sample | share |",
            "|---|---:|---:|",
        ]
        for stage, ms in self.stages.items():
            lines.append(f"| {stage} | {ms:.3f} | {ms / self.total_ms:.0%} |")
        lines.append(f"| total | {self.total_ms:.3f} | 100% |")
        return "\n".join(lines)


class _StageClock:
    """Accumulates the time of each stage while samples go through the stages one at a time, as in a worker."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def run(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self.ms[stage] = self.ms.get(stage, 0.0) + 1000.0 * (time.perf_counter() - start)
        return out


def _profile_samples(
    items: list[Any], stages: list[tuple[str, Callable[[Any], Any]]], batch_size: int, normalize: bool
) -> dict[str, float]:
    """Per-sample milliseconds of each stage, then of collation, the copy to CUDA (if any) and normalization."""
    value = items[0]  # warm-up: first-call costs (opening files, lazy imports) are not per-sample costs
    for _, fn in stages:
        value = fn(value)
    clock = _StageClock()
    device = torch.device("cuda") if torch.cuda.is_available() else None

    def finish(pending: list[Any]) -> None:  # every batch, the last partial one too: its samples count in the mean
        batch = clock.run("collate", default_collate, pending)
        images = batch[0]
        if device is not None:
            images = clock.run("to_device", lambda x: x.pin_memory().to(device, non_blocking=True), images)
        if normalize:
            clock.run("normalize", normalize_batch, images, *_IMAGENET)
        if device is not None:
            clock.run("to_device", torch.cuda.synchronize)

    pending: list[Any] = []
    for item in items:
        for stage, fn in stages:
            item = clock.run(stage, fn, item)
        pending.append(item)
        if len(pending) == batch_size:
            finish(pending)
            pending = []
    if pending:
        finish(pending)
    return {stage: ms / len(items) for stage, ms in clock.ms.items()}


def profile_folder(
    root: str | os.PathLike[str], samples: int = 200, batch_size: int = 64, image_size: int = 224, seed: int = 0
) -> PipelineProfile:
    """Profile torchvision ``ImageFolder`` with RandomResizedCrop, flip, ToTensor and Normalize."""
    from torchvision import transforms

    from lightning_fastdata.convert import image_folder, open_image_file, train_folder

    train = train_folder(root)
    dataset = image_folder(train)
    indices = random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset)))
    augment = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(*(t.tolist() for t in _IMAGENET)),
        ]
    )

    def read(index: int) -> tuple[bytes, int, int]:
        path, label = dataset.samples[index]
        with open(path, "rb") as fh:
            return fh.read(), label, index

    stages = [
        ("read", read),
        ("decode", lambda read: (open_image_file(dataset.samples[read[2]][0], read[0]), read[1])),
        ("transforms", lambda pair: (augment(pair[0]), pair[1])),
    ]
    return PipelineProfile("folder", str(train), _profile_samples(indices, stages, batch_size, False), len(indices))


def profile_database(
    path: str | os.PathLike[str], samples: int = 200, batch_size: int = 64, image_size: int = 224, seed: int = 0
) -> PipelineProfile:
    """Profile the FastImageDataModule pipeline on a database: LMDB read, decode, uint8 crop, collate, normalize."""
    dataset = LmdbImageDataset(path, split="train")
    indices = random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset)))
    crop = RandomResizedCropFlip(image_size)
    stages = [
        ("read", lambda i: (i, *dataset.read_record(i))),
        ("decode", lambda rec: (dataset.decode(*rec), rec[1].label)),
        ("transforms", lambda pair: (crop(pair[0]), pair[1])),
    ]
    return PipelineProfile("database", str(path), _profile_samples(indices, stages, batch_size, True), len(indices))


def profile(
    data: str | os.PathLike[str],
    database: str | os.PathLike[str] | None = None,
    samples: int = 200,
    batch_size: int = 64,
    image_size: int = 224,
) -> list[PipelineProfile]:
    """Profile ``data`` (a folder or a database) and, when it exists, its counterpart.

    The counterpart of a database is its source folder (from its metadata); of a folder, ``database`` if given, else
    the conversion ``FastImageDataModule`` would use (under the default cache directory).
    """
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"`data` {str(path)!r} does not exist. Pass an image folder or a database made by"
            " `lightning-fastdata convert`."
        )
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's view: one thread per process
    try:
        if (path / _format.DATA_FILE).is_file():
            profiles = [profile_database(path, samples, batch_size, image_size)]
            source = _format.read_meta(path).get("source", {}).get("path")
            if source and Path(source).is_dir():
                profiles.insert(0, profile_folder(source, samples, batch_size, image_size))
            return profiles
        if database is not None and not Path(database).expanduser().exists():
            raise FileNotFoundError(
                f"`database` (`--db`) {str(database)!r} does not exist. Pass a database made by `lightning-fastdata"
                " convert`, or leave it out to use the folder's conversion in the default cache."
            )
        if database is not None and not (Path(database).expanduser() / _format.DATA_FILE).is_file():
            raise FileNotFoundError(
                f"`database` {str(database)!r} is not a database made by `lightning-fastdata convert`."
            )
        profiles = [profile_folder(path, samples, batch_size, image_size)]
        if database is None:
            from lightning_fastdata.datamodule import FastImageDataModule

            database = FastImageDataModule(str(path)).database_path
        if (Path(database) / _format.DATA_FILE).is_file():
            profiles.append(profile_database(database, samples, batch_size, image_size))
        return profiles
    finally:
        torch.set_num_threads(torch_threads)
