"""Where does loading time go? Per-stage time per sample: read, decode, transforms, collate, host-to-device copy.

Measured in this process, one thread, stage by stage on the same samples, for an image folder (torchvision's
``ImageFolder`` with the standard transforms) and for a database made by ``lightning-fastdata convert`` (the batch
path ``FastImageDataModule`` trains with: :class:`~lightning_fastdata.pipeline.kernel.BatchReader`'s stages, one at a
time).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from lightning_fastdata.store import format as _format
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, RandomResizedCropFlip, crop_resize_into


@dataclass
class PipelineProfile:
    """Milliseconds per sample of each stage of one loading pipeline."""

    name: str
    path: str
    stages: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    #: milliseconds per sample of the loader's own ``read_batch`` on the same samples, every stage at once (databases)
    batch_path_ms: float | None = None

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
        if self.batch_path_ms is not None:
            lines.append(f"the loader's read_batch, every stage at once: {self.batch_path_ms:.3f} ms / sample")
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


def _device(device: str | torch.device | None) -> torch.device:
    """The training device profiled: as given, else CUDA when there is one."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _profile_samples(
    items: list[Any], stages: list[tuple[str, Callable[[Any], Any]]], batch_size: int, device: torch.device
) -> dict[str, float]:
    """Per-sample milliseconds of each stage, then of collation and, on CUDA, the copy to the device."""
    value = items[0]  # warm-up: first-call costs (opening files, lazy imports) are not per-sample costs
    for _, fn in stages:
        value = fn(value)
    clock = _StageClock()

    def finish(pending: list[Any]) -> None:  # every batch, the last partial one too: its samples count in the mean
        batch = clock.run("collate", default_collate, pending)
        if device.type == "cuda":
            clock.run("to_device", lambda x: _synchronized(x.pin_memory().to(device, non_blocking=True)), batch[0])

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


def _normalize_into(normalizer: Any, images: np.ndarray, out: np.ndarray) -> None:
    """Normalize a uint8 NHWC batch into a float32 NCHW one, image by image, as the loader threads do."""
    for image, slot in zip(images, out, strict=True):
        normalizer.into(image, slot)


def _synchronized(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for the device's work on ``tensor`` (so the stage's time is the device's, not the launch's)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return tensor


def profile_folder(
    root: str | os.PathLike[str],
    samples: int = 200,
    batch_size: int = 64,
    image_size: int = 224,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> PipelineProfile:
    """Profile torchvision ``ImageFolder`` with RandomResizedCrop, flip, ToTensor and Normalize.

    Stages: read, decode, transforms, collate, and on CUDA (``device``; default: CUDA when there is one) the pinned
    copy to the device.
    """
    from torchvision import transforms

    from lightning_fastdata.store.sources import image_folder, open_image_file, train_folder

    train = train_folder(root)
    dataset = image_folder(train)
    indices = random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset)))
    augment = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
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
    stages_ms = _profile_samples(indices, stages, batch_size, _device(device))
    return PipelineProfile("folder", str(train), stages_ms, len(indices))


def profile_database(
    path: str | os.PathLike[str],
    samples: int = 200,
    batch_size: int = 64,
    image_size: int = 224,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> PipelineProfile:
    """Profile the batch path ``FastImageDataModule`` trains with on a database, stage by stage.

    The stages of :class:`~lightning_fastdata.pipeline.kernel.BatchReader`'s fused path, with the DataModule's
    transforms at ``image_size``, run one at a time on each batch: ``read`` (the batch's records in one LMDB
    transaction, checksums verified), ``decode`` (libjpeg-turbo with its fast DCT, into a reused buffer), ``transforms``
    (the batch's crop boxes, then crop, resize and flip into the image's slot of the uint8 batch); then, training on the
    CPU, ``normalize`` (to float32, as the loader threads do), or on CUDA (``device``; default: CUDA when there is one)
    ``to_device`` (the pinned batch copied) and ``normalize`` (on the device). The loader's own ``read_batch`` is timed
    on the same samples too (:attr:`PipelineProfile.batch_path_ms`), to show the stages add up to it.
    """
    from lightning_fastdata.datamodule import FastImageDataModule
    from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices

    target = _device(device)
    datamodule = FastImageDataModule(str(path), image_size=image_size, val_fraction=0)
    dataset = LmdbImageDataset(path, split="train", transform=datamodule.train_transform())
    transform = dataset.transform
    assert isinstance(transform, RandomResizedCropFlip)
    normalizer, size, key = datamodule.normalizer, image_size, (seed, 0)
    indices = random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset)))
    dataset.read_record(indices[0])  # warm-up: opening the database is not a per-sample cost
    clock = _StageClock()
    device_stages = ["to_device", "normalize"] if target.type == "cuda" else ["normalize"]
    clock.ms = dict.fromkeys(["read", "decode", "transforms", *device_stages], 0.0)  # the table's order
    decoded = np.empty(1 << 20, np.uint8)
    scratch = np.empty(1 << 20, np.uint8)
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        out = np.empty((len(batch), size, size, 3), np.uint8)
        with dataset.records() as read:
            found = clock.run("read", lambda batch: [(i, *read(i)) for i in batch], batch)
            boxes, flips = clock.run(
                "transforms",
                transform.boxes,
                [f[1].height for f in found],
                [f[1].width for f in found],
                None,
                key,
                batch,
            )
            for k, ((index, header, payload), box, flip) in enumerate(zip(found, boxes, flips, strict=True)):
                nbytes = header.height * header.width * 3
                if decoded.size < nbytes:
                    decoded, scratch = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
                image = clock.run("decode", dataset.decode_hwc, index, header, payload, decoded, True)
                clock.run("transforms", crop_resize_into, image, box, size, flip, out[k], scratch)
        if target.type == "cuda":
            pinned = torch.from_numpy(out).pin_memory()
            on_device = clock.run("to_device", lambda x: _synchronized(x.to(target, non_blocking=True)), pinned)
            clock.run("normalize", lambda x: _synchronized(normalizer.batch(x.permute(0, 3, 1, 2))), on_device)
        else:
            floats = np.empty((len(batch), 3, size, size), np.float32)
            clock.run("normalize", _normalize_into, normalizer, out, floats)
    stages = {stage: ms / len(indices) for stage, ms in clock.ms.items()}
    reader = BatchReader(
        dataset, output="uint8" if target.type == "cuda" else "float", normalizer=normalizer, pin_memory=True
    )
    start_time = time.perf_counter()
    for start in range(0, len(indices), batch_size):
        reader.read_batch(KeyedIndices(indices[start : start + batch_size], key))
    fused_ms = 1000.0 * (time.perf_counter() - start_time) / len(indices)
    return PipelineProfile("database", str(path), stages, len(indices), batch_path_ms=fused_ms)


def profile(
    data: str | os.PathLike[str],
    database: str | os.PathLike[str] | None = None,
    samples: int = 200,
    batch_size: int = 64,
    image_size: int = 224,
    device: str | torch.device | None = None,
) -> list[PipelineProfile]:
    """Profile ``data`` (a folder or a database) and, when it exists, its counterpart, for training on ``device``.

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
            profiles = [profile_database(path, samples, batch_size, image_size, device=device)]
            source = _format.read_meta(path).get("source", {}).get("path")
            if source and Path(source).is_dir():
                profiles.insert(0, profile_folder(source, samples, batch_size, image_size, device=device))
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
        profiles = [profile_folder(path, samples, batch_size, image_size, device=device)]
        if database is None:
            from lightning_fastdata.datamodule import FastImageDataModule

            database = FastImageDataModule(str(path)).database_path
        if (Path(database) / _format.DATA_FILE).is_file():
            profiles.append(profile_database(database, samples, batch_size, image_size, device=device))
        return profiles
    finally:
        torch.set_num_threads(torch_threads)
