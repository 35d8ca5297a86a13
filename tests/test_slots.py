"""Tests for ``lightning_fastdata.pipeline.slots``: who owns a batch slot, through both engines and start methods."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fakes import patch_cuda_streams
from torch.utils.data import DistributedSampler

from lightning_fastdata import LmdbImageDataset
from lightning_fastdata.pipeline import slots as slots_module
from lightning_fastdata.pipeline.factory import FastLoader, create_loader
from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices
from lightning_fastdata.pipeline.processes import _worker_init
from lightning_fastdata.pipeline.schema import BatchSchema
from lightning_fastdata.pipeline.slots import SlotBatch, SlotLayout, SlotMemory, SlotPool
from lightning_fastdata.transforms import Normalizer, RandomResizedCropFlip

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture
def dataset(database: Path) -> LmdbImageDataset:
    return LmdbImageDataset(database, transform=RandomResizedCropFlip(16))


def _child_env() -> dict[str, str]:
    """This environment for a child ``python``, the repository first on its ``PYTHONPATH``: the caller's
    ``PYTHONPATH`` kept, which may be where the installed packages are (``pip install --target``)."""
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}


def _pool(count: int = 2, shared: bool = False) -> SlotPool:
    return SlotPool(SlotMemory(SlotLayout(4, BatchSchema.of([(2, 2, 3)])), count, shared=shared))


def test_a_slot_is_free_again_only_once_every_tensor_sharing_it_is_gone() -> None:
    """Images, labels and any view of them keep their slot; when the last goes, the slot is free (no refcount read)."""
    pool = _pool()
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {0, 1}
    assert pool.acquire() is None  # none free: the caller builds this batch in fresh memory
    assert pool.misses == 1
    images, labels = pool.hand_out(first, 3)
    assert (images.shape, labels.shape, labels.dtype) == ((3, 3, 2, 2), (3,), torch.int64)
    view = images[1:].numpy()  # a NumPy view of a slice keeps it too
    del images
    gc.collect()
    assert pool.acquire() is None
    del labels
    gc.collect()
    assert pool.acquire() is None
    del view
    assert pool.acquire() == first  # no garbage collection needed: freed as the last view went
    pool.release(second)  # a slot given back without being handed out
    assert pool.acquire() == second


def test_the_slot_freed_last_is_the_next_one_acquired() -> None:
    """A loop holding one batch at a time reuses one slot, however many the pool has: its pages stay mapped."""
    pool = _pool(4)
    used = set()
    for _ in range(5):
        slot = pool.acquire()
        used.add(slot)
        images, labels = pool.hand_out(slot, 4)
        del images, labels  # the batch is dropped: its slot is free again
    assert used == {0}
    first, second = pool.acquire(), pool.acquire()
    pool.release(second)
    pool.release(first)
    assert pool.acquire() == first
    assert pool.acquire() == second


def test_a_handed_out_batch_reads_what_was_written_into_its_slot() -> None:
    """NHWC images come out as NCHW views of the slot, with the slot's int64 labels, or labels given instead."""
    pool = _pool(1)
    slot = pool.acquire()
    assert slot is not None
    written = np.arange(4 * 2 * 2 * 3, dtype=np.uint8).reshape(4, 2, 2, 3)
    pool.memory.images(slot)[:] = written
    pool.memory.field(slot, "target")[:] = [7, 8, 9, 10]
    images, labels = pool.hand_out(slot, 2)
    assert torch.equal(images, torch.from_numpy(written[:2]).permute(0, 3, 1, 2))
    assert labels.tolist() == [7, 8]
    del images, labels
    slot = pool.acquire()
    assert pool.hand_out(slot, 2, labels=["a", "b"])[1] == ["a", "b"]


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_a_views_slot_is_free_only_once_every_view_is_gone(dtype: str) -> None:
    """A multi-view slot hands out one NCHW tensor per view over its own aligned region; the slot stays taken until
    the last view (or a slice of it) is gone."""
    layout = SlotLayout(4, BatchSchema.of([(8, 8, 3), (8, 8, 3), (4, 4, 3)], dtype, index=True))
    large = 4 * 8 * 8 * 3 * np.dtype(dtype).itemsize
    assert layout.region_offsets == [0, large, 2 * large]
    pool = SlotPool(SlotMemory(layout, 1))
    for v, region in enumerate(pool.memory.regions(0)):
        region[...] = v
    pool.memory.field(0, "target")[:] = [5, 6, 7, 8]
    views, labels, index = pool.hand_out(pool.acquire(), 3)
    assert [tuple(view.shape) for view in views] == [(3, 3, 8, 8), (3, 3, 8, 8), (3, 3, 4, 4)]
    assert [int(view.max()) for view in views] == [0, 1, 2]
    assert all(str(view.dtype) == f"torch.{dtype}" for view in views)
    assert labels.tolist() == [5, 6, 7]
    assert len(index) == 3
    last = views[2][1:]
    del views
    gc.collect()
    assert pool.acquire() is None  # a slice of the last view still holds the slot
    del last
    assert pool.acquire() == 0


@pytest.mark.parametrize(
    ("dtype", "views"),
    [("uint8", ((6, 5, 3), (6, 5, 3), (4, 3, 3))), ("float32", ((3, 6, 5), (3, 6, 5), (3, 4, 3)))],
    ids=["uint8 NHWC", "float32 NCHW"],
)
def test_each_handed_out_view_is_its_region_pixel_for_pixel(dtype: str, views: tuple) -> None:
    """Every view's NCHW tensor reads its own region's samples, in their stored order (channels last or not)."""
    layout = SlotLayout(4, BatchSchema.of(views, dtype))
    pool = SlotPool(SlotMemory(layout, 2))
    rng = np.random.default_rng(0)
    for region in pool.memory.regions(1):
        region[...] = rng.integers(0, 255, region.shape)
    handed, _ = pool.hand_out(1, 3)
    for view, region in zip(handed, pool.memory.regions(1, 3), strict=True):
        expected = torch.from_numpy(region.copy())
        assert torch.equal(view, expected.permute(0, 3, 1, 2) if dtype == "uint8" else expected)
        assert view.is_contiguous(memory_format=torch.channels_last) is (dtype == "uint8")


def test_a_device_copy_frees_its_slot_only_once_its_event_has_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On (patched) CUDA a slot copied to the device stays taken until ``Event.query()`` says the copy is done."""
    patch_cuda_streams(monkeypatch)
    done = {"copy": False}

    class Event:
        def record(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return done["copy"]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    pool = _pool(1)
    pool.memory.field(0, "target")[:] = [1, 2, 3, 4]
    batches = list(pool.receive(iter([SlotBatch(pool.acquire(), 4)]), torch.device("cuda", 0)))
    assert batches[0][1].tolist() == [1, 2, 3, 4]
    del batches
    assert pool.acquire() is None  # the copy is still in flight: never handed to another batch
    done["copy"] = True
    assert pool.acquire() == 0


def test_shared_slots_name_nothing_in_dev_shm_and_private_ones_refuse_to_travel() -> None:
    """Shared slots are an anonymous memfd (nothing in /dev/shm to leak); private ones never cross processes."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    shared = SlotMemory(SlotLayout(4, BatchSchema.of([(2, 2, 3)])), 3, shared=True)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in after - before if "lightning_fastdata" in name}
    if hasattr(os, "memfd_create"):
        with open("/proc/self/maps") as maps:
            assert "memfd:lightning_fastdata-slots" in maps.read()
    assert shared.nbytes == 3 * shared.layout.slot_bytes
    with pytest.raises(TypeError, match="stay in their process"):
        SlotMemory(SlotLayout(4, BatchSchema.of([(2, 2, 3)])), 1).__reduce__()


def test_a_shared_memory_shortage_is_an_error_at_once_never_a_bus_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared slots reserve their pages up front: a shortage raises OSError with the size, before any batch."""

    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(OSError, match=r"reserving 1 MiB of shared memory failed"):
        SlotMemory(SlotLayout(1024, BatchSchema.of([(32, 32, 1)])), 1, shared=True)


#: three reservations of 32 MiB of shared slots under an address-space limit 16 MiB above what the process maps: the
#: pages are reserved (shmem is not address space), then the mapping fails; prints the errors and the descriptors
#: open before and after, slot memfds first
_RESERVE_UNDER_A_LIMIT = textwrap.dedent(
    """
    import os, resource
    from lightning_fastdata.pipeline.schema import BatchSchema
    from lightning_fastdata.pipeline.slots import SlotLayout, SlotMemory

    def descriptors():
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return sum("lightning_fastdata-slots" in name for name in names), len(names)

    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    before = descriptors()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 16 * 2**20, resource.RLIM_INFINITY))
    for _ in range(3):
        try:
            SlotMemory(SlotLayout(32, BatchSchema.of([(1024, 1024, 1)])), 1, shared=True)
        except OSError as err:
            print("RAISED", err, flush=True)
    print("DESCRIPTORS", *before, *descriptors(), flush=True)
    """
)


def test_a_reservation_that_cannot_be_mapped_keeps_no_descriptor_and_names_the_size() -> None:
    """Under an address-space limit the pages are reserved but the mapping fails: each failure closes the memfd (and
    frees its pages) and says how much was asked for, however often it is tried."""
    env = _child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _RESERVE_UNDER_A_LIMIT], capture_output=True, text=True, env=env, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    raised = [line for line in out.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 3, out
    assert all("reserving 32 MiB of shared memory failed: Cannot allocate memory" in line for line in raised), out
    memfds_before, open_before, memfds_after, open_after = map(int, out.split("DESCRIPTORS")[1].split())
    assert (memfds_after, open_after) == (memfds_before, open_before) == (0, open_before), out


#: 160 batches of one sample on two worker processes (start method argv[2]), all kept, under a limit of 64 open
#: descriptors and torch's "file_system" sharing strategy: nearly every batch misses a slot and is built in a memfd
_KEEP_UNDER_A_DESCRIPTOR_LIMIT = textwrap.dedent(
    """
    import os, resource, sys
    import torch
    from lightning_fastdata import LmdbImageDataset
    from lightning_fastdata.pipeline import create_loader
    from lightning_fastdata.transforms import CenterCropResize

    if __name__ == "__main__":
        torch.multiprocessing.set_sharing_strategy("file_system")
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        dataset = LmdbImageDataset(sys.argv[1], transform=CenterCropResize(8))
        indices = [i % len(dataset) for i in range(160)]
        loader = create_loader(dataset, 1, sampler=indices, engine="processes", workers=2, output="uint8")
        loader.multiprocessing_context = sys.argv[2]
        kept = list(loader)
        print("KEPT", len(kept), "MISSES", loader.slot_misses, "OPEN", len(os.listdir("/proc/self/fd")), flush=True)
        fresh = create_loader(dataset, 1, sampler=indices, engine="threads", workers=0, output="uint8")
        same = [torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kept, fresh, strict=True)]
        print("SAME", sum(same), flush=True)
    """
)


@pytest.mark.parametrize(
    "context",
    ["fork", pytest.param("spawn", marks=pytest.mark.slow), pytest.param("forkserver", marks=pytest.mark.slow)],
)
def test_kept_batches_built_in_fresh_memory_hold_no_descriptor(tmp_path: Path, database: Path, context: str) -> None:
    """A loop may keep more batches built in fresh memory (memfds from the workers) than it may open descriptors: each
    is mapped and its descriptor closed, whatever torch's sharing strategy (each one's ``mmap`` held a descriptor:
    "Too many open files" part-way), and each holds the samples of a fresh read."""
    script = tmp_path / "keep.py"
    script.write_text(_KEEP_UNDER_A_DESCRIPTOR_LIMIT)
    env = _child_env()
    proc = subprocess.run(
        [sys.executable, str(script), str(database), context], capture_output=True, text=True, env=env, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.search(r"KEPT (\d+) MISSES (\d+) OPEN (\d+)", out)
    assert found is not None, out
    kept, misses, still_open = map(int, found.groups())
    assert kept == 160, out
    assert misses > 64, out  # more batches built in memfds than the descriptors the process may open
    assert still_open < 32, out
    assert "SAME 160" in out, out


def _reference(reader: BatchReader, batch: KeyedIndices) -> tuple[torch.Tensor, torch.Tensor]:
    return reader.read_batch(KeyedIndices(list(batch), batch.key))


def _spy_batches(loader: FastLoader) -> list[KeyedIndices]:
    """The index batches the loader's engine is given, as they are drawn (recorded on the loader's own sampler)."""
    drawn: list[KeyedIndices] = []
    original = type(loader)._keyed_batches

    class Recording:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __iter__(self) -> Any:
            for task in self.inner:  # one batch, or a task of several for worker processes
                for batch in task if type(task) is list else [task]:
                    drawn.append(KeyedIndices(list(batch), batch.key))
                yield task

    loader.__class__ = type("Spied", (type(loader),), {"_keyed_batches": lambda s: Recording(original(s))})
    return drawn


@pytest.mark.parametrize(
    ("engine", "context"),
    [
        ("threads", None),
        ("processes", "fork"),
        pytest.param("processes", "spawn", marks=pytest.mark.slow),
        pytest.param("processes", "forkserver", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("output", ["uint8", "float"])
def test_batches_the_loop_keeps_are_never_overwritten(
    dataset: LmdbImageDataset, engine: str, context: str | None, output: str
) -> None:
    """An epoch's batches all kept alive equal fresh reads of the same indices: the slots ran out and later batches
    were built in fresh memory, never in a slot still in use. Then, dropping each batch, every one fits in a slot."""
    kwargs: dict[str, Any] = {}
    if engine == "processes":
        kwargs = {"num_workers": 2, "persistent_workers": True, "worker_init_fn": _worker_init}
        kwargs["multiprocessing_context"] = context
    else:
        kwargs = {"threads": 2}
    reader = BatchReader(dataset, output=output, normalizer=Normalizer(MEAN, STD))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = FastLoader(reader, batch_size=1, sampler=sampler, **kwargs)
    drawn = _spy_batches(loader)
    kept = list(loader)
    assert len(kept) == len(dataset)
    assert loader.slot_misses > 0  # more batches kept than slots
    reference = BatchReader(dataset, output=output, normalizer=Normalizer(MEAN, STD))
    for (images, labels), batch in zip(kept, drawn, strict=True):
        want_images, want_labels = _reference(reference, batch)
        torch.testing.assert_close(images, want_images, rtol=0, atol=0)
        assert torch.equal(labels, want_labels)
    del kept
    misses = loader.slot_misses
    for epoch in range(2):
        sampler.set_epoch(epoch + 1)
        drawn.clear()
        for (images, labels), batch in zip(loader, drawn, strict=False):
            want_images, want_labels = _reference(reference, batch)
            torch.testing.assert_close(images, want_images, rtol=0, atol=0)
            assert torch.equal(labels, want_labels)
            del images, labels
    assert loader.slot_misses == misses  # each batch dropped before the next: always a free slot
    del loader


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_epochs_left_part_way_give_their_slots_back(dataset: LmdbImageDataset, engine: str) -> None:
    """Breaking out of epochs after one batch, ten times over, never runs the slots out."""
    loader = create_loader(dataset, 2, shuffle=True, engine=engine, workers=2, output="uint8")
    for epoch in range(10):
        loader.sampler.set_epoch(epoch)
        for images, _labels in loader:
            assert images.shape == (2, 3, 16, 16)
            break
    assert loader.slot_misses == 0
    assert loader.engine == engine
    del loader


def test_slots_that_cannot_be_reserved_fall_back_to_threads_with_one_message(
    dataset: LmdbImageDataset, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No memory for the shared slots: one warning with the fix, then the same batches built on threads."""

    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    loader = create_loader(dataset, 4, engine="processes", workers=2, output="uint8", seed=1)
    plain = create_loader(dataset, 4, engine="threads", workers=0, output="uint8", seed=1)
    with caplog.at_level("WARNING", logger="lightning_fastdata.pipeline.factory"):
        got = [(images.clone(), labels) for images, labels in loader]
        again = list(loader)
    warnings = [r.getMessage() for r in caplog.records if "could not reserve" in r.getMessage()]
    assert len(warnings) == 1
    assert "Cannot allocate memory" in warnings[0]
    assert "on 2 threads in this process instead" in warnings[0]
    assert "lower `batch_size`" in warnings[0]
    assert loader.engine == "threads"
    assert len(again) == len(got)
    for (images, labels), (want_images, want_labels) in zip(got, plain, strict=True):
        torch.testing.assert_close(images, want_images, rtol=0, atol=0)
        assert torch.equal(labels, want_labels)


def test_the_engines_send_only_the_slot_back(dataset: LmdbImageDataset) -> None:
    """Given a slot, the reader writes the batch into it and returns ``(slot, count)``: no tensor to pickle."""
    reader = BatchReader(dataset, output="uint8")
    layout = reader.slot_layout(4)
    assert layout == SlotLayout(4, BatchSchema.of([(16, 16, 3)], "uint8"))
    pool = SlotPool(SlotMemory(layout, 1, shared=True))
    reader.slots = pool.memory
    indices = KeyedIndices([0, 1, 2], (5, 0), slot=pool.acquire())
    result = reader.__getitems__(indices)
    assert isinstance(result, SlotBatch)
    assert (result.slot, result.count, result.labels) == (0, 3, None)
    images, labels = pool.hand_out(result.slot, result.count)
    want_images, want_labels = reader.read_batch(KeyedIndices([0, 1, 2], (5, 0)))
    torch.testing.assert_close(images, want_images, rtol=0, atol=0)
    assert torch.equal(labels, want_labels)
    assert len(pickle.dumps(result)) < 100
    assert slots_module.SLOTS_HELD >= 4


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_slots_are_page_locked_once_for_a_cuda_device(
    dataset: LmdbImageDataset, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copying ahead to (patched) CUDA, the whole slot memory is registered once (``cudaHostRegister``) for all
    epochs, torch runs no pin-memory thread, and the registration goes with the memory."""
    patch_cuda_streams(monkeypatch)
    calls: list[tuple[Any, ...]] = []

    class Cudart:
        def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
            calls.append(("register", address, size))
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            calls.append(("unregister", address))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    loader = create_loader(
        dataset, 4, shuffle=True, engine=engine, workers=2, output="uint8", pin_memory=True, device="cuda:0"
    )
    assert loader.prefetching
    assert loader.page_locked
    assert not loader.pin_memory  # no pin-memory thread copying each batch again
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for images, _labels in loader:
            assert images.shape == (4, 3, 16, 16)
    memory = loader._slots.memory
    address = memory.address
    assert calls == [("register", address, memory.nbytes)]
    del loader, memory, images, _labels
    gc.collect()
    assert calls[-1] == ("unregister", address)


@pytest.mark.parametrize(
    ("engine", "workers", "context"),
    [
        ("threads", 2, None),
        ("threads", 0, None),  # on the calling thread
        ("processes", 2, "fork"),
        pytest.param("processes", 2, "spawn", marks=pytest.mark.slow),
    ],
)
def test_loaders_sharing_a_reader_build_their_batches_in_their_own_slots(
    dataset: LmdbImageDataset, engine: str, workers: int, context: str | None
) -> None:
    """Two loaders over one ``BatchReader``, iterated in turn: every batch of each equals a fresh read of its indices
    (each loader's batches go into its own slots, wherever the reader is shared)."""
    reader = BatchReader(dataset, output="uint8")
    loaders = [create_loader(reader, 2, shuffle=True, seed=seed, engine=engine, workers=workers) for seed in (1, 2)]
    if context is not None:
        for loader in loaders:
            loader.multiprocessing_context = context
    drawn = [_spy_batches(loader) for loader in loaders]
    got: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for pair in zip(*loaders, strict=True):
        for kept, (images, labels) in zip(got, pair, strict=True):
            kept.append((images.clone(), labels.clone()))
    reference = BatchReader(dataset, output="uint8")
    for kept, batches in zip(got, drawn, strict=True):
        assert len(kept) == len(batches) == len(dataset) // 2
        for (images, labels), batch in zip(kept, batches, strict=True):
            want_images, want_labels = _reference(reference, batch)
            torch.testing.assert_close(images, want_images, rtol=0, atol=0)
            assert torch.equal(labels, want_labels)
    assert reader.slots is None  # the shared reader holds no loader's slots
    del loaders
