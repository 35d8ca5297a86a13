"""Where does loading time go? Per-stage time per sample: read, decode, transforms, collate, host-to-device copy.

Measured in this process, one thread, stage by stage on the same samples, for an image folder (torchvision's
``ImageFolder`` with the standard transforms) and for a database made by ``lightning-fastdata convert`` (the batch
path ``FastImageDataModule`` trains with: :class:`~lightning_fastdata.pipeline.kernel.BatchReader`'s stages, one at a
time).

Profiling reads a folder as a training run would, and a folder may hold files that are not images (an empty file, a
truncated JPEG): those are skipped and listed (:attr:`PipelineProfile.skipped`), as ``lightning-fastdata convert``
skips and lists them, and other files are timed in their place. A database is profiled from its records alone; its
source folder (from its metadata) is profiled beside it only when it is still there and can be read.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from lightning_fastdata.errors import FastDataError, SourceLayoutError
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.store.summary import SkippedFile, image_error_reason
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, RandomResizedCropFlip, crop_resize_into

log = logging.getLogger(__name__)

#: skipped files listed by :meth:`PipelineProfile.format_table` (all of them are in :attr:`PipelineProfile.skipped`)
MAX_LISTED = 20
_END = object()


@dataclass
class PipelineProfile:
    """Milliseconds per sample of each stage of one loading pipeline."""

    name: str
    path: str
    stages: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    #: milliseconds per sample of the loader's own ``read_batch`` on the same samples, every stage at once (databases)
    batch_path_ms: float | None = None
    #: files met while sampling that cannot be read as images (a folder's), left out of the timings
    skipped: list[SkippedFile] = field(default_factory=list)
    #: a folder's: its database, profiled beside it (``--db``, or the DataModule's conversion in the cache), and what
    #: that database changes (:func:`conversion_advice`); ``None``: there is none, and the advice is to convert
    database: str | None = None
    converted: str | None = None

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
            + (
                ""
                if database
                else f", or train from the database {self.database}"
                if self.database is not None
                else ", or convert it to one LMDB file (`lightning-fastdata convert`)"
            ),
            "decode": (
                "decode dominates: `--encoding raw` removes it (10x the disk)"
                + (", or `decode='device'` moves it to the GPU" if gpu else "")
                if database
                else f"decoding full-size files dominates; {self.converted}"
                if self.converted is not None
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
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} file(s) that cannot be read as images (not timed):")
            lines += [f"  skipped {item.path}: {item.reason}" for item in self.skipped[:MAX_LISTED]]
            if len(self.skipped) > MAX_LISTED:
                lines.append(f"  ... and {len(self.skipped) - MAX_LISTED} more")
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


class _BadFile(Exception):
    """A sampled file that cannot be read as an image: it is skipped, listed, and its time left out."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.skipped = SkippedFile(path, reason)


def _sample_order(n: int, k: int, seed: int) -> Iterator[int]:
    """``k`` indices of ``range(n)`` drawn at random, then, for those a caller skips, the others in random order."""
    rng = random.Random(seed)
    drawn = rng.sample(range(n), min(k, n))
    yield from drawn
    rest = sorted(set(range(n)).difference(drawn))
    rng.shuffle(rest)
    yield from rest


def _device(device: str | torch.device | None) -> torch.device:
    """The training device profiled: as given, else CUDA when there is one."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _profile_samples(
    items: Iterable[Any],
    count: int,
    stages: list[tuple[str, Callable[[Any], Any]]],
    batch_size: int,
    device: torch.device,
    skipped: list[SkippedFile],
) -> tuple[dict[str, float], int]:
    """Per-sample milliseconds of each stage, then of collation and, on CUDA, the copy to the device.

    Takes ``items`` until ``count`` went through every stage; one a stage rejects (:class:`_BadFile`) is added to
    ``skipped`` and its time is left out. Returns the stages' times and the number of samples timed.
    """
    items = iter(items)

    def through(item: Any, clock: _StageClock | None) -> Any:
        """``item`` through every stage: timed into ``clock`` if the item is good, else :class:`_BadFile`."""
        trial = _StageClock()
        for stage, fn in stages:
            item = trial.run(stage, fn, item)
        if clock is not None:
            for stage, ms in trial.ms.items():
                clock.ms[stage] = clock.ms.get(stage, 0.0) + ms
        return item

    for item in items:  # warm-up: first-call costs (opening files, lazy imports) are not per-sample costs
        try:
            through(item, None)
        except _BadFile as bad:
            skipped.append(bad.skipped)
            continue
        items = itertools.chain([item], items)  # then timed as well
        break
    clock = _StageClock()
    timed = 0

    def finish(pending: list[Any]) -> None:  # every batch, the last partial one too: its samples count in the mean
        batch = clock.run("collate", default_collate, pending)
        if device.type == "cuda":
            clock.run("to_device", lambda x: _synchronized(x.pin_memory().to(device, non_blocking=True)), batch[0])

    pending: list[Any] = []
    while timed < count:  # drawing no item beyond those needed
        item = next(items, _END)
        if item is _END:
            break
        try:
            pending.append(through(item, clock))
        except _BadFile as bad:
            skipped.append(bad.skipped)
            continue
        timed += 1
        if len(pending) == batch_size:
            finish(pending)
            pending = []
    if pending:
        finish(pending)
    return {stage: ms / timed for stage, ms in clock.ms.items()} if timed else {}, timed


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
    copy to the device. A file that cannot be read as an image (empty, truncated, not an image) is skipped, listed
    in :attr:`PipelineProfile.skipped`, and another file is timed in its place.

    Raises:
        SourceLayoutError: ``root`` is not an image folder, or none of its files can be read as an image.

    """
    from PIL import Image
    from torchvision import transforms

    from lightning_fastdata.store.sources import image_folder, train_folder

    train = train_folder(root)
    dataset = image_folder(train)
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
        try:
            with open(path, "rb") as fh:
                return fh.read(), label, index
        except OSError as err:
            raise _BadFile(path, f"cannot read file: {err.strerror or err}") from None

    def decode(read: tuple[bytes, int, int]) -> tuple[Image.Image, int]:
        data, label, index = read
        if not data:
            raise _BadFile(dataset.samples[index][0], "empty file (0 bytes)")
        try:  # as ImageFolder's loader, whose errors would end the profile
            return Image.open(io.BytesIO(data)).convert("RGB"), label
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            reason = image_error_reason(err, f"not a readable image: {type(err).__name__}: {err}")
            raise _BadFile(dataset.samples[index][0], reason) from None

    stages = [("read", read), ("decode", decode), ("transforms", lambda pair: (augment(pair[0]), pair[1]))]
    skipped: list[SkippedFile] = []
    order = _sample_order(len(dataset), samples, seed)
    stages_ms, timed = _profile_samples(order, samples, stages, batch_size, _device(device), skipped)
    if not timed:
        raise SourceLayoutError(
            f"none of the {len(skipped)} image files of {str(train)!r} can be read as an image (first:"
            f" {skipped[0].path}: {skipped[0].reason}). Fix the files, or pass another folder."
        )
    return PipelineProfile("folder", str(train), stages_ms, timed, skipped=skipped)


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


def conversion_advice(folder: str, database: str, image_size: int, given: bool) -> str:
    """What the conversion ``database`` of ``folder`` changes for training at ``image_size``, as advice.

    Converting again is advised only when its stored short side is smaller than the crops need (or it keeps original
    sizes): into the same database when the user named it (``given``, ``--db``), else through the DataModule's
    ``short_side``. ``str(database)`` is named either way, never a new conversion elsewhere.
    """
    from lightning_fastdata.datamodule import FastImageDataModule

    stored = _environments.read_meta(database).get("encoding", {}).get("short_side")
    datamodule = FastImageDataModule(folder, image_size=image_size)
    needed, right = math.ceil(image_size / datamodule.crop_fraction), datamodule.store_short_side()
    again = (
        f"`lightning-fastdata convert {folder} {database} --short-side {right} --force`"
        if given
        else f"`FastImageDataModule({folder!r}, short_side={right})` (a new conversion in the cache)"
    )
    if stored is None:
        return f"the database {database} keeps the original sizes too; {again} stores a short side of {right} px"
    if not isinstance(stored, int) or stored < needed:
        return (
            f"the database {database} stores a short side of {stored} px, less than the {needed} px that"
            f" {image_size} px crops need (they would be upsampled): convert again with {again}"
        )
    return f"the database {database} stores a short side of {stored} px already: train from it (its profile follows)"


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
    the conversion ``FastImageDataModule`` would use (under the default cache directory). A database is profiled
    from its records alone: its source folder, when it is gone, moved, or not an image folder any more, is left out
    (with a logged warning) and never fails the database's profile. Files of a folder that cannot be read as images
    are skipped and listed in the folder's :attr:`PipelineProfile.skipped`.
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
            source = _environments.read_meta(path).get("source", {}).get("path")
            if source and Path(source).is_dir():
                try:  # only a comparison: the database's profile stands without it
                    profiles.insert(0, profile_folder(source, samples, batch_size, image_size, device=device))
                except (FastDataError, OSError) as err:
                    log.warning("profile: the source folder %s is left out: %s", source, err)
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
        given = database is not None
        if database is None:
            from lightning_fastdata.datamodule import FastImageDataModule

            database = FastImageDataModule(str(path)).database_path
        if (Path(database) / _format.DATA_FILE).is_file():
            profiles[0].database = str(database)
            profiles[0].converted = conversion_advice(str(path), str(database), image_size, given)
            profiles.append(profile_database(database, samples, batch_size, image_size, device=device))
        return profiles
    finally:
        torch.set_num_threads(torch_threads)
