"""Tests for ``lightning_fastdata.prefetch``: the side-stream handshake (CUDA patched), the loader, the DataModule."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from fakes import FakeEvent, copied_to_device, fake_trainer
from lightning.pytorch import LightningModule, Trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torchvision.transforms import v2

from lightning_fastdata import DevicePrefetchLoader, FastImageDataModule
from lightning_fastdata.pipeline import DeviceStage, FastLoader
from lightning_fastdata.pipeline import device as device_module
from lightning_fastdata.pipeline import streams as streams_module
from lightning_fastdata.pipeline.device import prefetch_to_device
from lightning_fastdata.pipeline.streams import side_stream
from lightning_fastdata.transforms import Normalizer

DDP_SCRIPT = Path(__file__).with_name("prefetch_ddp_script.py")

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")

#: the generated database: 2 classes x (10 train + 4 val)
TRAIN_SIZE, VAL_SIZE = 20, 8


# ----------------------------------------------------------------------------------------------------------------
# Fakes and fixtures
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """A stand-in batch: its position in the input and the stage it went through (host, copied, ready)."""

    id: int
    stage: str = "host"


class _FakeStream:
    """A CUDA stream that logs ``wait_stream``."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name} wait_stream {other.name}")


class _FakeCuda:
    """``torch.cuda.Stream`` / ``stream`` / ``current_stream`` / ``current_device`` with real stream semantics.

    ``stream(s)`` makes ``s`` the current stream until the block exits, as ``torch.cuda.stream`` does, so a call to
    ``current_stream()`` inside the side-stream block would (wrongly) return the side stream.
    """

    def __init__(self) -> None:
        self.log: list[str] = []
        self.compute = _FakeStream(self.log, "compute")
        self.current = self.compute
        self.created: list[_FakeStream] = []
        self.entered: list[_FakeStream] = []
        cuda = self

        class Stream(_FakeStream):
            """``torch.cuda.Stream(device)``: a class, as torch's is (a module imported meanwhile may use it as one)."""

            def __init__(self, device: int | None = None) -> None:
                super().__init__(cuda.log, f"side{device}")
                cuda.created.append(self)

        self.Stream = Stream

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        self.entered.append(stream)
        self.log.append(f"enter {stream.name}")
        try:
            yield
        finally:
            self.log.append(f"exit {stream.name}")
            self.current = previous

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self.current

    def current_device(self) -> int:
        return 0


@pytest.fixture
def side_streams(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int], Any]:
    """An empty side-stream cache for this test (the module's own cache is restored afterwards)."""
    cache: dict[tuple[str, int], Any] = {}
    monkeypatch.setattr(streams_module, "_SIDE_STREAMS", cache)
    return cache


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, side_streams: dict[tuple[str, int], Any]) -> _FakeCuda:
    """CUDA streams patched with logging fakes; copies and ``record_stream`` are left to the test to patch."""
    cuda = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", cuda.Stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return cuda


@pytest.fixture
def logged_copies(fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    """Also patch ``_to_device`` (logs ``copy <id> on <stream>``) and ``_record_stream`` (logs ``record <id> ...``)."""

    def to_device(batch: _Batch, device: torch.device) -> _Batch:
        fake_cuda.log.append(f"copy {batch.id} on {fake_cuda.current.name}")
        return _Batch(batch.id, "copied")

    def record_stream(batch: _Batch, stream: _FakeStream) -> None:
        fake_cuda.log.append(f"record {batch.id} {batch.stage} on {stream.name}")

    monkeypatch.setattr(device_module, "_to_device", to_device)
    monkeypatch.setattr(device_module, "_record_stream", record_stream)
    return fake_cuda


def _on_device(cuda: _FakeCuda) -> Any:
    """An ``on_device`` transform that logs the stream it runs on and marks the batch ready."""

    def transform(batch: _Batch) -> _Batch:
        assert batch.stage == "copied"
        cuda.log.append(f"on_device {batch.id} on {cuda.current.name}")
        return _Batch(batch.id, "ready")

    return transform


def _consume(batches: Iterator[_Batch], cuda: _FakeCuda) -> list[_Batch]:
    """Consume step by step, logging ``yield <id>`` when each batch is handed out."""
    out = []
    for batch in batches:
        cuda.log.append(f"yield {batch.id}")
        out.append(batch)
    return out


def _index(log: list[str], entry: str, start: int = 0) -> int:
    """Position of the first ``entry`` at or after ``start`` (fails the test if there is none)."""
    assert entry in log[start:], f"{entry!r} not in {log[start:]}"
    return log.index(entry, start)


@pytest.fixture(scope="module")
def database(make_database: Callable[..., Path]) -> Path:
    """A converted database with train (2 x 10) and val (2 x 4) splits of small JPEGs."""
    return make_database(
        "prefetch", short_side=64, num_classes=2, train_per_class=10, val_per_class=4, min_size=40, max_size=80
    )


def _dm(database: Path, cls: type[FastImageDataModule] = FastImageDataModule, **kwargs: Any) -> Any:
    """A small datamodule on the database (no workers unless asked), set up."""
    kwargs = {"image_size": 16, "batch_size": 4, "num_workers": 0, "pin_memory": False, **kwargs}
    dm = cls(str(database), **kwargs)
    dm.setup("fit")
    return dm


def _dataset(n: int = 22) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n))


def _as_lists(loader: Any) -> list[list[list[float]]]:
    return [[t.tolist() for t in batch] for batch in loader]


# ----------------------------------------------------------------------------------------------------------------
# prefetch_to_device: the handshake
# ----------------------------------------------------------------------------------------------------------------


def test_every_batch_is_yielded_once_in_order(logged_copies: _FakeCuda) -> None:
    """All batches come out once, in order, the last one too, each copied and transformed."""
    cuda = logged_copies
    host = [_Batch(i) for i in range(5)]
    out = _consume(prefetch_to_device(iter(host), torch.device("cuda", 0), on_device=_on_device(cuda)), cuda)
    assert [b.id for b in out] == [0, 1, 2, 3, 4]
    assert all(b.stage == "ready" for b in out)  # the transformed device copy, never the host batch
    assert [e for e in cuda.log if e.startswith("copy")] == [f"copy {i} on side0" for i in range(5)]


def test_copy_of_next_batch_is_issued_before_the_current_one_is_yielded(logged_copies: _FakeCuda) -> None:
    """Batch N+1 is copied (on the side stream) before batch N is handed out, and never more than one ahead."""
    cuda = logged_copies
    host = [_Batch(i) for i in range(4)]
    batches = prefetch_to_device(iter(host), torch.device("cuda", 0), on_device=_on_device(cuda))
    for n in range(4):
        batch = next(batches)
        cuda.log.append(f"yield {batch.id}")
        assert batch.id == n
        copies = [e for e in cuda.log if e.startswith("copy")]
        assert len(copies) == min(n + 2, 4)  # one step ahead, no further: device memory stays two batches
    with pytest.raises(StopIteration):
        next(batches)
    for n in range(3):
        assert _index(cuda.log, f"copy {n + 1} on side0") < _index(cuda.log, f"yield {n}")


def test_compute_stream_waits_and_records_before_each_yield(logged_copies: _FakeCuda) -> None:
    """After each copy, the compute stream waits on the side stream and the batch is recorded on it, before use."""
    cuda = logged_copies
    host = [_Batch(i) for i in range(4)]
    _consume(prefetch_to_device(iter(host), torch.device("cuda", 0), on_device=_on_device(cuda)), cuda)
    log = cuda.log
    assert "compute wait_stream compute" not in log  # current_stream() is read outside the side-stream block
    for n in range(4):
        transformed = _index(log, f"on_device {n} on side0")
        wait = _index(log, "compute wait_stream side0", transformed)
        record = _index(log, f"record {n} ready on compute", transformed)
        assert max(wait, record) < _index(log, f"yield {n}")
    assert log.count("compute wait_stream side0") == 4
    assert len([e for e in log if e.startswith("record")]) == 4


def test_copy_and_on_device_run_inside_the_side_stream_block(logged_copies: _FakeCuda) -> None:
    """Each copy and its ``on_device`` transform run between entering and leaving the side-stream context."""
    cuda = logged_copies
    host = [_Batch(i) for i in range(3)]
    _consume(prefetch_to_device(iter(host), torch.device("cuda", 0), on_device=_on_device(cuda)), cuda)
    for n in range(3):
        copy = _index(cuda.log, f"copy {n} on side0")
        assert cuda.log[copy - 1] == "enter side0"
        assert cuda.log[copy + 1] == f"on_device {n} on side0"
        assert cuda.log[copy + 2] == "exit side0"
    assert cuda.log.count("enter side0") == cuda.log.count("exit side0") == 3


def test_without_on_device_the_copy_is_yielded(logged_copies: _FakeCuda) -> None:
    """With no ``on_device``, the device copies themselves are yielded."""
    cuda = logged_copies
    out = _consume(prefetch_to_device(iter([_Batch(0), _Batch(1)]), torch.device("cuda", 0)), cuda)
    assert out == [_Batch(0, "copied"), _Batch(1, "copied")]


def test_single_and_empty_input(logged_copies: _FakeCuda) -> None:
    """One batch is still yielded (there is no next batch to wait for); empty input yields and copies nothing."""
    cuda = logged_copies
    assert _consume(prefetch_to_device(iter([_Batch(7)]), torch.device("cuda", 0)), cuda) == [_Batch(7, "copied")]
    cuda.log.clear()
    assert list(prefetch_to_device(iter([]), torch.device("cuda", 0))) == []
    assert not [e for e in cuda.log if e.startswith(("copy", "record", "enter"))]


def test_one_side_stream_per_device_reused_across_epochs(
    logged_copies: _FakeCuda, side_streams: dict[tuple[str, int], Any]
) -> None:
    """Each device gets one persistent side stream, created on first use and reused by every later epoch."""
    cuda = logged_copies
    for _ in range(2):  # two epochs on cuda:0
        assert len(list(prefetch_to_device(iter([_Batch(0), _Batch(1)]), torch.device("cuda", 0)))) == 2
    assert len(cuda.created) == 1
    first = cuda.created[0]
    assert side_streams == {("copy", 0): first}
    assert all(stream is first for stream in cuda.entered)

    list(prefetch_to_device(iter([_Batch(0)]), torch.device("cuda", 1)))
    assert len(cuda.created) == 2
    assert side_streams["copy", 1] is cuda.created[1] is not first
    assert cuda.created[1].name == "side1"

    list(prefetch_to_device(iter([_Batch(0)]), torch.device("cuda")))  # no index: the current device, 0
    assert len(cuda.created) == 2
    assert side_stream(torch.device("cuda")) is first
    assert side_stream(torch.device("cuda", 1)) is side_streams["copy", 1]
    assert side_stream(torch.device("cuda", 0), "decode") is not first  # another role: its own stream


# ----------------------------------------------------------------------------------------------------------------
# DevicePrefetchLoader
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_loader_off_cuda_is_a_plain_dataloader(device: Any) -> None:
    """Off CUDA: the batches, length and sampler of a DataLoader, a DataLoader iterator, ``on_device`` unused."""
    dataset = _dataset()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    on_device = Mock()
    loader = DevicePrefetchLoader(dataset, batch_size=4, sampler=sampler, device=device, on_device=on_device)
    plain = DataLoader(
        dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    )
    assert isinstance(loader, DataLoader)
    assert not loader.prefetching
    assert loader.sampler is sampler
    assert len(loader) == len(plain) == math.ceil(22 / 4)
    assert isinstance(iter(loader), _BaseDataLoaderIter)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        plain.sampler.set_epoch(epoch)
        batches = _as_lists(loader)
        assert batches == _as_lists(plain)
        epochs.append(batches)
    assert epochs[0] != epochs[1]  # set_epoch through `loader.sampler` reshuffles
    on_device.assert_not_called()


def test_loader_with_persistent_workers_over_two_epochs() -> None:
    """Two worker processes, kept between epochs: the same batches as an in-process DataLoader, every epoch."""
    dataset = _dataset()
    loader = DevicePrefetchLoader(
        dataset, batch_size=4, shuffle=False, num_workers=2, persistent_workers=True, device="cpu"
    )
    expected = _as_lists(DataLoader(dataset, batch_size=4))
    first = iter(loader)
    assert _as_lists(first) == expected
    second = iter(loader)
    assert second is first  # persistent workers: the one worker iterator is reset, not rebuilt
    assert _as_lists(second) == expected


def test_loader_on_cuda_iterates_through_prefetch(fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """On (patched) CUDA the loader goes through ``prefetch_to_device``: the DataLoader's batches, transformed."""
    monkeypatch.setattr(device_module, "_to_device", lambda batch, device: batch)  # the real _record_stream stays
    dataset = _dataset()
    loader = DevicePrefetchLoader(
        dataset, batch_size=4, shuffle=False, device="cuda:0", on_device=lambda b: [b[0] * 10, b[1]]
    )
    assert loader.prefetching
    assert loader.device == torch.device("cuda", 0)
    assert len(loader) == 6
    plain = [[batch[0] * 10, batch[1]] for batch in DataLoader(dataset, batch_size=4)]
    for _ in range(2):
        assert _as_lists(loader) == _as_lists(plain)
    assert fake_cuda.log.count("enter side0") == 12
    assert fake_cuda.log.count("compute wait_stream side0") == 12
    assert len(fake_cuda.created) == 1


# ----------------------------------------------------------------------------------------------------------------
# FastImageDataModule
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [None, True, False])
def test_datamodule_on_cpu_gives_plain_loaders(
    database: Path, prefetch: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU, with or without a Trainer, no setting of ``prefetch_to_device`` prefetches.

    The training loader is a (resumable) loader that does not look ahead; validation gets a plain DataLoader.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dm = _dm(database, prefetch_to_device=prefetch)
    for trainer in (None, fake_trainer(torch.device("cpu"))):
        dm.trainer = trainer
        assert not dm.uses_prefetch()
        train = dm.train_dataloader()
        assert isinstance(train, FastLoader)
        assert train.resumable
        assert not train.prefetching
        assert not dm.val_dataloader().prefetching


def test_datamodule_on_cuda_prefetches_by_default(database: Path) -> None:
    """Training on CUDA: loaders look ahead to the root device, normalizing there with the DataModule's settings."""
    dm = _dm(database, pin_memory=None)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    assert dm.uses_prefetch()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert isinstance(loader, FastLoader)
        assert loader.prefetching
        assert loader.device == torch.device("cuda", 0)
        stage = loader.on_device  # the device stage, owned by the loader
        assert isinstance(stage, DeviceStage)
        assert stage.normalizer is dm.normalizer
        assert (stage.dtype, stage.channels_last, stage.device) == (torch.float32, False, torch.device("cuda", 0))
        assert loader.page_locked  # asynchronous copies need page-locked batches: the slots, locked once
        assert isinstance(loader.sampler, DistributedSampler)
    assert len(dm.train_dataloader()) == TRAIN_SIZE // 4
    assert len(dm.val_dataloader()) == VAL_SIZE // 4


def test_datamodule_prefetch_false_disables_it_on_cuda(database: Path) -> None:
    """``prefetch_to_device=False`` keeps plain DataLoaders even when training on CUDA."""
    dm = _dm(database, prefetch_to_device=False)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    assert not dm.uses_prefetch()
    assert not dm.train_dataloader().prefetching
    assert not dm.val_dataloader().prefetching


def test_datamodule_batches_through_patched_prefetch(
    database: Path, fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the (patched) side stream the batches equal the plain loader's after ``to_model_input``."""
    monkeypatch.setattr(device_module, "_to_device", copied_to_device)
    trainer = fake_trainer(torch.device("cuda", 0))
    prefetched, plain = _dm(database), _dm(database, prefetch_to_device=False)
    prefetched.trainer, plain.trainer = trainer, trainer
    random.seed(0)
    got = list(prefetched.train_dataloader())
    random.seed(0)
    expected = [plain.to_model_input(batch) for batch in plain.train_dataloader()]
    assert len(got) == len(expected) == TRAIN_SIZE // 4
    for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
        assert images.dtype == torch.float32  # normalized on the side stream already
        torch.testing.assert_close(images, want_images)
        assert torch.equal(labels, want_labels)
    # each batch on the side stream twice: its slot copied to the device, then the device stage
    assert fake_cuda.log.count("enter side0") == 2 * len(got)


class _TwoViews:
    """Two random crops of a uint8 CHW image, 32 and 16 px: the views of a self-supervised transform."""

    def __init__(self) -> None:
        self.large, self.small = v2.RandomResizedCrop(32, antialias=True), v2.RandomResizedCrop(16, antialias=True)

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        return [self.large(image), self.small(image)]


class _TwoViewData(FastImageDataModule):
    """A training transform of one's own returning two views of each image."""

    def train_transform(self) -> Callable[[torch.Tensor], list[torch.Tensor]]:  # type: ignore[override]
        return _TwoViews()


def test_two_views_are_copied_and_normalized_on_the_side_stream(
    database: Path, fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On (patched) CUDA both uint8 views of a batch are copied and normalized on the side stream, each equal to the
    plain loader's after ``to_model_input``, in a list, with the targets and indices of their samples."""
    copied: list[tuple[str, torch.dtype]] = []

    def to_device(batch: Any, device: torch.device) -> Any:
        return device_module._apply(batch, lambda t: copied.append((fake_cuda.current.name, t.dtype)) or t)

    normalized: list[tuple[str, tuple[int, ...]]] = []
    normalize = Normalizer.batch

    def logged_batch(self: Normalizer, images: torch.Tensor, *args: Any) -> torch.Tensor:
        normalized.append((fake_cuda.current.name, tuple(images.shape)))
        return normalize(self, images, *args)

    monkeypatch.setattr(device_module, "_to_device", to_device)
    monkeypatch.setattr(Normalizer, "batch", logged_batch)
    trainer = fake_trainer(torch.device("cuda", 0))
    prefetched = _dm(database, _TwoViewData, return_index=True)
    plain = _dm(database, _TwoViewData, return_index=True, prefetch_to_device=False)
    prefetched.trainer, plain.trainer = trainer, trainer
    got = list(prefetched.train_dataloader())
    assert len(got) == TRAIN_SIZE // 4
    # every tensor of each batch copied on the side stream (two uint8 views, targets, indices), then both views
    # normalized there
    assert copied == [
        ("side0", torch.uint8),
        ("side0", torch.uint8),
        ("side0", torch.int64),
        ("side0", torch.int64),
    ] * len(got)
    assert normalized == [("side0", (4, 3, 32, 32)), ("side0", (4, 3, 16, 16))] * len(got)
    expected = [plain.to_model_input(batch) for batch in plain.train_dataloader()]
    for (views, labels, index), (want_views, want_labels, want_index) in zip(got, expected, strict=True):
        assert isinstance(views, list)
        assert [(view.dtype, tuple(view.shape)) for view in views] == [
            (torch.float32, (4, 3, 32, 32)),
            (torch.float32, (4, 3, 16, 16)),
        ]
        for view, want in zip(views, want_views, strict=True):
            assert torch.equal(view, want)
        assert torch.equal(labels, want_labels)
        assert torch.equal(index, want_index)


def test_two_views_are_normalized_on_the_device_without_waiting_for_it(
    database: Path, fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device stage never reads a view's values back to the host: copied to the ``meta`` device (which holds
    none, so any read raises) both views are normalized there, with the constants put on that device once."""
    monkeypatch.setattr(
        device_module, "_to_device", lambda batch, device: device_module._apply(batch, lambda t: t.to("meta"))
    )
    monkeypatch.setattr(torch.cuda, "synchronize", Mock(side_effect=AssertionError("a synchronize per step")))
    given: list[tuple[torch.Tensor, torch.Tensor]] = []
    constants = Normalizer.constants
    monkeypatch.setattr(Normalizer, "constants", lambda self, *args: given.append(constants(self, *args)) or given[-1])
    dm = _dm(database, _TwoViewData)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    batches = 0
    for views, labels in dm.train_dataloader():
        assert [(view.device.type, view.dtype, tuple(view.shape)) for view in views] == [
            ("meta", torch.float32, (4, 3, 32, 32)),
            ("meta", torch.float32, (4, 3, 16, 16)),
        ]
        assert labels.device.type == "meta"
        batches += 1
    assert batches == TRAIN_SIZE // 4
    assert len(given) == 2 * batches  # one look-up per view
    assert all(scale.device.type == shift.device.type == "meta" for scale, shift in given)
    assert all(scale is given[0][0] and shift is given[0][1] for scale, shift in given)  # made once, then reused


class _EpochRecorder(LightningModule):
    """A linear classifier on the mean colour that counts batches and records the sampler's epoch per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.batches: list[int] = []
        self.sampler_epochs: list[int] = []
        self.dtypes: set[torch.dtype] = set()

    def on_train_epoch_start(self) -> None:
        self.batches.append(0)
        self.sampler_epochs.append(self.trainer.train_dataloader.sampler.epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.batches[-1] += 1
        self.dtypes.add(images.dtype)
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ForcedPrefetch(FastImageDataModule):
    """Builds loaders that look ahead on any device (on the CPU they pass batches through)."""

    def uses_prefetch(self) -> bool:
        return True


@pytest.mark.parametrize("cls", [FastImageDataModule, _ForcedPrefetch], ids=["default", "forced"])
def test_fit_on_cpu_with_prefetch_to_device(database: Path, cls: type[FastImageDataModule], tmp_path: Path) -> None:
    """A CPU fit with ``prefetch_to_device=True`` runs ``limit_train_batches`` per epoch and re-seeds each epoch."""
    dm = _dm(database, cls, prefetch_to_device=True)
    model = _EpochRecorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    assert isinstance(loader, FastLoader)
    assert loader.resumable
    assert loader.device == (torch.device("cpu") if cls is _ForcedPrefetch else None)
    assert model.batches == [3, 3]
    assert trainer.global_step == 6
    assert model.sampler_epochs == [0, 1]
    assert loader.sampler.epoch == 1
    assert model.dtypes == {torch.float32}  # normalized by on_after_batch_transfer
    assert "val_loss" in trainer.callback_metrics  # the validation loader ran too


# ----------------------------------------------------------------------------------------------------------------
# Real DDP on CPU through the device look-ahead
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(database: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of rank 0 and rank 1 of a two-epoch DDP fit through the device look-ahead."""
    out = tmp_path_factory.mktemp("prefetch_ddp")
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), str(database), str(out), "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_ddp_through_prefetch_loader_covers_the_training_set(ddp_run: list[dict[str, Any]]) -> None:
    """Each epoch, the two ranks' look-ahead loaders together see every training sample (padding aside)."""
    rank0, rank1 = ddp_run
    for rank, record in enumerate(ddp_run):
        assert record["rank"] == record["sampler_rank"] == rank
        assert record["world_size"] == record["num_replicas"] == 2
        assert record["loader"] == "FastLoader"  # looks ahead to the device and saves its position
        assert record["dtypes"] == ["torch.float32"]
        assert record["sampler_epochs"] == [0, 1]
    n = rank0["train_size"]
    assert n == TRAIN_SIZE
    per_rank = math.ceil(n / 2)
    for epoch in range(2):
        first, second = rank0["epochs"][epoch], rank1["epochs"][epoch]
        assert len(first) == len(second) == per_rank
        assert set(first) | set(second) == set(range(n))
        duplicates = sum(count - 1 for count in Counter(first + second).values())
        assert duplicates == 2 * per_rank - n  # only the sampler's padding repeats
    assert rank0["epochs"][0] != rank0["epochs"][1]  # reshuffled by epoch


@pytest.mark.slow
def test_ddp_through_prefetch_loader_runs_equal_batches(ddp_run: list[dict[str, Any]]) -> None:
    """Both ranks run the same number of batches every epoch (no rank waits on a collective forever)."""
    rank0, rank1 = ddp_run
    expected = math.ceil(math.ceil(TRAIN_SIZE / 2) / 4)  # batch_size 4, drop_last=False
    assert rank0["batches"] == rank1["batches"] == [expected, expected]


# ----------------------------------------------------------------------------------------------------------------
# On a real GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_gpu_batches_equal_with_and_without_prefetch(database: Path, side_streams: dict[tuple[str, int], Any]) -> None:
    """On CUDA, prefetched batches (normalized on the side stream) equal the plain loader's after ``to_model_input``."""
    trainer = fake_trainer(torch.device("cuda", 0))
    prefetched, plain = _dm(database, pin_memory=True), _dm(database, pin_memory=True, prefetch_to_device=False)
    prefetched.trainer, plain.trainer = trainer, trainer
    for loader_name in ("train_dataloader", "val_dataloader"):
        random.seed(0)
        got = list(getattr(prefetched, loader_name)())
        random.seed(0)
        expected = []
        for images, labels in getattr(plain, loader_name)():
            device_batch = (images.to("cuda", non_blocking=True), labels.to("cuda", non_blocking=True))
            expected.append(plain.to_model_input(device_batch))
        torch.cuda.synchronize()
        assert len(got) == len(expected) > 0
        for (images, labels), (want_images, want_labels) in zip(got, expected, strict=True):
            assert images.is_cuda
            assert labels.is_cuda
            assert images.dtype == torch.float32
            torch.testing.assert_close(images, want_images)
            assert torch.equal(labels, want_labels)
    assert len(side_streams) == 1


@pytest.mark.cuda
def test_gpu_memory_does_not_grow_over_epochs(side_streams: dict[tuple[str, int], Any]) -> None:
    """Five epochs of prefetching leave allocated device memory where the first left it, on one side stream."""
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    dataset = TensorDataset(images, torch.arange(64))
    loader = DevicePrefetchLoader(
        dataset, batch_size=8, pin_memory=True, device="cuda", on_device=lambda b: [b[0].float() / 255, b[1]]
    )
    batch_bytes = 8 * 3 * 32 * 32 * (1 + 4) + 8 * 8  # uint8 copy + float result + labels
    allocated = []
    for _ in range(5):
        total = torch.zeros((), device="cuda")
        for batch in loader:
            total += batch[0].sum()
        del batch
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        assert total.item() > 0
        del total
    assert abs(allocated[4] - allocated[0]) <= batch_bytes
    assert len(side_streams) == 1
