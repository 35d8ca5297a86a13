"""Batch slots: batch buffers made once and reused, each owned by exactly one party at a time.

A slot is the memory of one batch: each field of its schema (:mod:`~lightning_fastdata.pipeline.schema`), up to
``batch_size`` rows each: the images (one region per view), their targets (of the database's kind: ``int64`` classes,
multi-hot or float ``float32`` rows) and, when asked for, their ``int64`` dataset indices and colour parameters. Its
layout (:class:`SlotLayout`) is computed from the schema. A :class:`SlotPool` owns a fixed number of slots, made when
the loader starts, and passes each one on explicitly:

1. **free -> filling.** :meth:`SlotPool.acquire` gives a free slot to whoever builds the next batch: a loader thread,
   or a DataLoader worker process, which is told its slot with the batch's indices.
2. **filling -> handed out.** :meth:`SlotPool.hand_out` wraps the filled slot in tensors for the training loop. The
   tensors' storage holds a view of the slot made for this hand-out alone, and a weak reference to that view
   frees the slot when the storage goes: when the last tensor sharing it (the batch, its slices and views, a
   ``.numpy()`` of it) is gone, whenever and on whichever thread that happens.
3. **or filling -> copying.** For a CUDA device, :meth:`SlotPool.to_device` copies the slot ``non_blocking`` on the
   side stream and records an event; the slot is free once that event has completed, which ``acquire`` asks with
   ``Event.query()`` (never a wait).

No reference count is read anywhere (``sys.getrefcount`` counts borrowed references differently from one CPython
version to the next). When no slot is free, ``acquire`` says so and that one batch is built in fresh memory: never a
wait, and never a slot with two owners.

``acquire`` gives the slot freed last (a stack, not a queue), so the loop cycles through as few slots as it holds
batches at once, whose pages are mapped (and zeroed) already. A slot's first write in a process costs a page fault per
page: per 4 KiB page of shared memory (no transparent huge pages there unless the kernel's ``shmem_enabled`` allows
them; the first fault anywhere also zeroes the page, which ``posix_fallocate`` leaves to it), per zeroed 2 MiB huge
page of private memory. Taken in turn, every slot of the pool paid that in each worker before one was reused, several
times a batch's own work (measured: docs/benchmarks.md#batch-slots-the-slot-freed-last-is-reused-first).

The memory is private to the process (the threads engine) or shared with worker processes (the process engine):
an anonymous ``memfd`` on Linux, reserved up front with ``posix_fallocate``, so nothing is ever named in
``/dev/shm`` (nothing can be left behind there, whatever kills the process, and a container's small ``/dev/shm``
does not limit it), and a shortage of memory is an ``OSError`` at start-up instead of a bus error mid-epoch (a
failed reservation closes its descriptor: it holds nothing). The memory is the loader's, never the batch reader's,
which several loaders may share: the threads are given it with each batch, worker processes as they start (forked
ones inherit the mapping, spawned ones receive the descriptor). A worker's batch that finds no free slot is built in
a one-slot memfd of its own, sent back as its descriptor (:class:`FreshBatch`).
"""

from __future__ import annotations

import collections
import functools
import mmap
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fastdata._files import anonymous_file, path_of
from lightning_fastdata._torch_private import DupFd
from lightning_fastdata.pipeline import device as stage  # the module: its copy is what the tests patch
from lightning_fastdata.pipeline.schema import BatchSchema, FieldSpec
from lightning_fastdata.pipeline.streams import side_stream

#: bytes between a slot's images, its targets and its indices, and between slots: cache-line (and page) aligned views
_ALIGN = 64

#: slots beyond those of the batches in flight and just received: the one Lightning's fetcher holds ahead, the one in
#: the step, the one copied to the device ahead of it, and one to spare
SLOTS_HELD = 4


@dataclass(frozen=True)
class SlotLayout:
    """Where each field of a batch of ``batch_size`` lives in a slot: computed from the batch's schema.

    The fields (:class:`~lightning_fastdata.pipeline.schema.BatchSchema`) follow one another, images first (one region
    per view), each aligned, ``batch_size`` rows each; a slot is rounded up to a page. An image sample's shape is its
    memory order: ``(H, W, 3)`` for ``uint8`` and ``channels_last`` batches, ``(3, H, W)`` for contiguous ``float32``
    ones.
    """

    batch_size: int
    schema: BatchSchema

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Where each field starts in a slot (aligned), by name."""
        offsets, end = {}, 0
        for field in self.schema.all_fields:
            offsets[field.name] = _aligned(end)
            end = offsets[field.name] + self.field_bytes(field)
        return offsets

    def field_bytes(self, field: FieldSpec, n: int | None = None) -> int:
        """Bytes of ``n`` rows (default ``batch_size``) of ``field``."""
        return (self.batch_size if n is None else n) * field.sample_bytes

    @property
    def regions(self) -> tuple[tuple[int, ...], ...]:
        """The sample shape of each image region: each view's, or the images' alone."""
        return tuple(field.shape for field in self.schema.images)

    @property
    def region_offsets(self) -> list[int]:
        """Where each image region starts in a slot (aligned)."""
        return [self.offsets[field.name] for field in self.schema.images]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The first image region's sample shape."""
        return self.schema.images[0].shape

    @property
    def dtype(self) -> str:
        """The images' dtype."""
        return self.schema.images[0].dtype

    @property
    def multiview(self) -> bool:
        """Whether the images are views, handed out as a list."""
        return self.schema.multiview

    @property
    def image_bytes(self) -> int:
        """Bytes of a full batch of images (of every view's region, and the alignment between them)."""
        last = self.schema.images[-1]
        return self.offsets[last.name] + self.field_bytes(last)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot, rounded up to a page: slots never share a page."""
        last = self.schema.all_fields[-1]
        end = self.offsets[last.name] + self.field_bytes(last)
        return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def channels_last(self) -> bool:
        """Whether samples are stored HWC (handed out as NCHW views of NHWC memory)."""
        return self.sample_shape[-1] == 3 and len(self.sample_shape) == 3


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class SlotMemory:
    """The memory of ``count`` slots of ``layout``: private, or shared with worker processes (see the module notes).

    What a worker needs to fill a slot, and all it receives: pickling a shared one sends its descriptor (spawn,
    forkserver); a forked worker inherits it as it is.

    Raises:
        OSError: the memory could not be reserved (a memory limit), with the size that was asked for.

    """

    def __init__(self, layout: SlotLayout, count: int, shared: bool = False) -> None:
        self.layout = layout
        self.count = count
        self.shared = shared
        self._fd: int | None = None
        nbytes = count * layout.slot_bytes
        if not shared:
            self._map = None
            self.bytes = np.empty(nbytes, dtype=np.uint8)
            return
        try:
            fd = anonymous_file("lightning_fastdata-slots")
        except OSError as err:  # no descriptor left (EMFILE)
            raise _reserving_failed(err, nbytes) from None
        self._attach(fd, reserve=True)

    def _attach(self, fd: int, reserve: bool = False) -> None:
        """Map the memory of ``fd``, now owned by this object; its pages reserved first when ``reserve``.

        On any failure ``fd`` is closed, and with it whatever was reserved: a failed reservation holds nothing.
        """
        nbytes = self.count * self.layout.slot_bytes
        try:
            if reserve:
                os.posix_fallocate(fd, 0, nbytes)  # the pages now, or ENOSPC / ENOMEM now: never a bus error later
            self._map = mmap.mmap(fd, nbytes)  # ENOMEM under an address-space limit (`ulimit -v`)
            self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        except BaseException as err:
            os.close(fd)
            if isinstance(err, OSError):
                raise _reserving_failed(err, nbytes) from None
            raise
        self._fd = fd
        weakref.finalize(self, os.close, fd)

    def slot(self, slot: int) -> np.ndarray:
        """The whole of slot ``slot``, as flat bytes (a new view each call)."""
        size = self.layout.slot_bytes
        return self.bytes[slot * size : (slot + 1) * size]

    def images(self, slot: int, n: int | None = None) -> np.ndarray:
        """The first ``n`` samples of slot ``slot`` (default: all of them), in their stored shape and dtype."""
        return self.regions(slot, n)[0]

    def regions(self, slot: int, n: int | None = None) -> list[np.ndarray]:
        """The first ``n`` samples of each image region of slot ``slot`` (one per view; :meth:`images` for one)."""
        return [self.field(slot, field.name, n) for field in self.layout.schema.images]

    def field(self, slot: int, name: str, n: int | None = None) -> np.ndarray:
        """Field ``name`` of slot ``slot``'s first ``n`` samples (default: all): ``[n, *shape]`` of its dtype.

        Raises:
            KeyError: the layout's batches do not hold the field.

        """
        layout = self.layout
        field = layout.schema.field(name)
        if field is None:
            raise KeyError(f"batch slots of {layout} hold no field {name!r}")
        n = layout.batch_size if n is None else n
        start = layout.offsets[name]
        flat = self.slot(slot)[start : start + layout.field_bytes(field, n)]
        return flat.view(field.dtype).reshape(n, *field.shape)

    @property
    def address(self) -> int:
        """The address of the first byte (for page-locking)."""
        return int(self.bytes.ctypes.data)

    @property
    def nbytes(self) -> int:
        """Bytes of all slots."""
        return int(self.bytes.nbytes)

    def __reduce__(self) -> Any:
        if not self.shared or self._fd is None:
            raise TypeError("private batch slots stay in their process")
        return _attach_shared, (self.layout, self.count, DupFd(self._fd))


def _attach_shared(layout: SlotLayout, count: int, fd: Any) -> SlotMemory:
    """A worker's side of :class:`SlotMemory`'s pickling: map the memory the descriptor names."""
    memory = SlotMemory.__new__(SlotMemory)
    memory.layout, memory.count, memory.shared = layout, count, True
    memory._attach(fd.detach())
    return memory


def _reserving_failed(err: OSError, nbytes: int) -> OSError:
    """The error of shared slots that could not be made: what was asked for, and why."""
    return OSError(err.errno, f"reserving {nbytes / 2**20:.0f} MiB of shared memory failed: {err.strerror}")


class SlotBatch(tuple):
    """What a producer returns for a batch it built in a slot: ``(slot, count, labels)``.

    All that crosses from a worker process to the training process: a few bytes, however large the batch. ``count``
    is the samples in the slot (fewer than the batch's indices when bad samples were skipped); ``labels`` are the
    targets when they are not in the slot (a ``target_transform``'s), else ``None``: every field of the slot's schema
    is in the slot. A tuple, so it unpickles without
    running Python code.
    """

    __slots__ = ()

    def __new__(cls, slot: int, count: int, labels: Any = None) -> SlotBatch:  # noqa: D102
        return tuple.__new__(cls, (slot, count, labels))

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(self)

    @property
    def slot(self) -> int:
        """The slot that holds the batch."""
        return self[0]

    @property
    def count(self) -> int:
        """Samples in it."""
        return self[1]

    @property
    def labels(self) -> Any:
        """Targets that are not in the slot (a ``target_transform``'s), else ``None``."""
        return self[2]

    def __repr__(self) -> str:
        return f"SlotBatch(slot={self[0]}, count={self[1]})"


class FreshBatch(tuple):
    """A batch a worker process built in a memfd of its own (no slot was free): ``(images, labels[, index])``.

    Its fields are the layout's (:mod:`~lightning_fastdata.pipeline.schema`); a field that travels beside the batch
    goes in the memory too, and is beside it again once received.

    In the worker it is the batch itself. Sent to the training process it goes as the memfd's file descriptor, as
    the slots' memory goes to a spawned worker, and arrives as the batch's tuple of tensors over the
    same pages (:func:`_received`): nothing copied, nothing named in ``/dev/shm``, no descriptor kept, and the memory
    freed with the last tensor that uses it. ``labels``: targets that are not in the memory (a ``target_transform``'s),
    else ``None`` (the targets are in the memory, and so are the dataset indices of a layout with ``index``).
    """

    _sent: tuple[SlotMemory, int, Any]

    def __new__(cls, memory: SlotMemory, count: int, labels: Any = None) -> FreshBatch:  # noqa: D102
        batch = tuple.__new__(cls, _fresh_tensors(memory, count, labels))
        batch._sent = (memory, count, labels)
        return batch

    def __reduce__(self) -> Any:
        memory, count, labels = self._sent
        return _received, (memory.layout, DupFd(memory._fd), count, labels)


def _received(layout: SlotLayout, fd: Any, count: int, labels: Any) -> tuple[Any, ...]:
    """The training process's side of :class:`FreshBatch`: its memfd mapped by torch, the descriptor closed.

    A ``mmap.mmap`` (a :class:`SlotMemory`) keeps a descriptor of its own for as long as it lives: one for each batch
    the loop keeps, until a loop keeping hundreds runs out of them (``ulimit -n``), whatever torch's sharing strategy.
    torch's ``MapAllocator`` closes its descriptor once the file is mapped: the batch holds its pages, and nothing else.
    """
    fd = fd.detach()
    try:
        storage = torch.UntypedStorage.from_file(path_of(fd), shared=True, nbytes=layout.slot_bytes)
    finally:
        os.close(fd)
    memory = SlotMemory.__new__(SlotMemory)  # a one-slot memory over torch's mapping: no descriptor, no mmap
    memory.layout, memory.count, memory.shared, memory._fd, memory._map = layout, 1, True, None, None
    memory.bytes = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return _fresh_tensors(memory, count, labels)


def _fresh_tensors(memory: SlotMemory, count: int, labels: Any) -> tuple[Any, ...]:
    """A one-slot memory's first ``count`` samples as the training step's batch: NCHW images, then the other fields.

    Built by :meth:`BatchSchema.assemble <lightning_fastdata.pipeline.schema.BatchSchema.assemble>`; the targets are
    the slot's if ``labels`` is ``None``.
    """
    views = [torch.from_numpy(region) for region in memory.regions(0, count)]
    if memory.layout.channels_last:
        views = [view.permute(0, 3, 1, 2) for view in views]
    schema = memory.layout.schema
    values = {field.name: torch.from_numpy(memory.field(0, field.name, count)) for field in schema.fields}
    if labels is not None:
        values["target"] = labels
    return schema.assemble(views, values)


def _nchw_geometry(
    start: int, shape: tuple[int, ...], itemsize: int, channels_last: bool
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """An image region's NCHW view as ``as_strided`` takes it: offset in elements, a sample's size, the strides.

    ``start``: the region's byte offset in the slot; ``shape``: the stored sample shape, ``(H, W, 3)`` when
    ``channels_last`` (the layout's, for every view: a ``(3, H, 3)`` sample reads either way), else ``(3, H, W)``.
    Returns ``(offset, (C, H, W), (N, C, H, W) strides)``.
    """
    if channels_last:  # NHWC memory seen as NCHW
        h, w, c = shape
        return start // itemsize, (c, h, w), (h * w * c, 1, w * c, c)
    c, h, w = shape
    return start // itemsize, (c, h, w), (c * h * w, h * w, w, 1)


class Batches(tuple):
    """The batches of one task, in order: what a worker process returns when it is sent several batches at once."""

    __slots__ = ()


def _freed(free: collections.deque[int], slot: int, _owner: Any) -> None:
    """The callback of a hand-out's weak reference: its view is gone, so is every tensor that used the slot."""
    free.append(slot)


class SlotPool:
    """The owner of a :class:`SlotMemory`'s slots in the training process: who has each slot (module notes).

    Args:
        memory: the slots.

    """

    def __init__(self, memory: SlotMemory) -> None:
        self.memory = memory
        # appended by finalizers (any thread, any time) and popped from the same end by `acquire` (the slot freed
        # last, whose pages are mapped: see the module notes): a deque does both atomically; slot 0 on top
        self._free: collections.deque[int] = collections.deque(reversed(range(memory.count)))
        self._copying: collections.deque[tuple[Any, int]] = collections.deque()
        #: slots given to a worker process whose batch has not come back yet
        self._in_flight: set[int] = set()
        self._pinned = False
        #: batches built in fresh memory because no slot was free
        self.misses = 0
        layout = memory.layout  # read once: `hand_out` runs per batch, on a cold cache between training steps
        self._sample_shape, self._dtype, self._slot_bytes = (
            layout.sample_shape,
            np.dtype(layout.dtype),
            layout.slot_bytes,
        )
        self._channels_last = layout.channels_last
        #: each view's NCHW tensor over a multi-view slot, worked out once: (element offset, sample size, strides)
        self._view_geometry = [_nchw_geometry(start, shape, self._dtype.itemsize, self._channels_last)
                               for start, shape in zip(layout.region_offsets, layout.regions, strict=True)]  # fmt: skip
        self._torch_dtype, self._image_bytes = getattr(torch, layout.dtype), layout.image_bytes
        self._owners: list[weakref.ref | None] = [None] * memory.count
        self._on_release = [functools.partial(_freed, self._free, slot) for slot in range(memory.count)]
        self._schema = layout.schema
        #: each slot's fields after the images, ``(name, rows)``: copied out per hand-out (a few bytes a sample)
        self._rows = [[(field.name, memory.field(slot, field.name)) for field in layout.schema.fields]
                      for slot in range(memory.count)]  # fmt: skip

    @property
    def layout(self) -> SlotLayout:
        """What one slot holds."""
        return self.memory.layout

    def acquire(self) -> int | None:
        """A free slot, now owned by the caller; ``None`` (and one more :attr:`misses`) when none is free.

        The one freed last: its pages are the likeliest to be mapped in the process that fills it (module notes).
        """
        copying = self._copying
        while copying and copying[0][0].query():  # copies to the device that have completed free their slots
            self._free.append(copying.popleft()[1])
        try:
            return self._free.pop()
        except IndexError:
            self.misses += 1
            return None

    def send(self) -> int | None:
        """A free slot for a batch built in a worker process; it stays in flight until :meth:`receive` sees it."""
        slot = self.acquire()
        if slot is not None:
            self._in_flight.add(slot)
        return slot

    def reclaim(self) -> None:
        """Free the slots still in flight: their batches will never be received.

        Only when no worker can still be writing them: torch's DataLoader, starting an epoch on persistent workers,
        first waits for every batch of the epoch before (and drops those the loop never took).
        """
        self._free.extend(self._in_flight)
        self._in_flight.clear()

    def receive(self, batches: Iterator[Any], device: torch.device | None = None) -> Iterator[Any]:
        """The batches of an engine, each :class:`SlotBatch` as tensors: on the CPU, or copied to ``device``.

        A :class:`Batches` result gives its batches one by one. Anything else (a batch built in fresh memory) passes
        through. Copies to a CUDA device are queued on its side stream
        (:func:`~lightning_fastdata.pipeline.streams.side_stream`).
        """
        stream = side_stream(device) if device is not None else None
        in_flight, hand_out = self._in_flight, self.hand_out
        for result in batches:
            for batch in result if type(result) is Batches else (result,):
                if type(batch) is SlotBatch:
                    slot, count, labels = batch
                    in_flight.discard(slot)
                    if stream is None:
                        batch = hand_out(slot, count, labels)
                    else:
                        assert device is not None
                        with torch.cuda.stream(stream):
                            batch = self.to_device(slot, count, device, stream, labels)
                yield batch

    def release(self, slot: int | None) -> None:
        """Give ``slot`` back without handing it out (its batch was dropped, or never built); ``None`` is no slot."""
        if slot is not None:
            self._free.append(slot)

    def hand_out(self, slot: int, n: int, labels: Any = None) -> tuple[Any, ...]:
        """Slot ``slot``'s first ``n`` samples as the training step's batch, whose tensors own the slot until they go.

        Images are NCHW (views of NHWC memory when stored so), a list of each view's for views; the other fields are
        copies of the slot's (a few bytes a sample), the targets ``labels`` when given. Built by the schema
        (:meth:`BatchSchema.assemble <lightning_fastdata.pipeline.schema.BatchSchema.assemble>`).
        """
        images = self._hand_out_views(slot, n) if self.layout.multiview else [self._hand_out_images(slot, n)]
        values = {name: torch.from_numpy(rows[:n].copy()) for name, rows in self._rows[slot]}
        if labels is not None:
            values["target"] = labels
        return self._schema.assemble(images, values)

    def _hand_out_images(self, slot: int, n: int) -> Tensor:
        """The images of a one-region slot: the hand-out's own view, which frees the slot when it goes."""
        # this hand-out's own view: the tensor's storage below holds it, and nothing else does; when it goes, the
        # weak reference's callback frees the slot (the reference itself is kept here until the slot is reused)
        view = np.ndarray((n, *self._sample_shape), self._dtype, self.memory.bytes, slot * self._slot_bytes)
        self._owners[slot] = weakref.ref(view, self._on_release[slot])
        images = torch.from_numpy(view)
        return images.permute(0, 3, 1, 2) if self._channels_last else images

    def _hand_out_views(self, slot: int, n: int) -> list[Tensor]:
        """The images of a multi-view slot: each view's NCHW tensor.

        One hand-out view of the slot's image bytes, as for one region; every view's tensor is a torch view of the one
        tensor over it (NumPy would collapse views of views to the slot memory, which the weak reference must not
        follow), so the slot is free once all of them are gone.
        """
        whole = np.ndarray((self._image_bytes,), np.uint8, self.memory.bytes, slot * self._slot_bytes)
        self._owners[slot] = weakref.ref(whole, self._on_release[slot])
        flat = torch.from_numpy(whole)
        if self._torch_dtype != torch.uint8:
            flat = flat.view(self._torch_dtype)
        # one strided view per view straight from the slot (a 64-sample, 8-view batch was 32 torch calls and 25
        # layout sums, most of the training process's time per batch on the processes engine)
        return [flat.as_strided((n, *size), strides, offset) for offset, size, strides in self._view_geometry]

    def to_device(self, slot: int, n: int, device: torch.device, stream: Any, labels: Any = None) -> Any:
        """Slot ``slot``'s first ``n`` samples copied to ``device`` on ``stream``; the slot is free once they are.

        Call it inside ``torch.cuda.stream(stream)``: the copies (``non_blocking``, from page-locked memory when
        :meth:`pin` succeeded) and the event that frees the slot are queued there.
        """
        images, fields = self._views[slot]
        values = {name: rows[:n] for name, rows in fields.items()}
        if labels is not None:
            values["target"] = labels
        batch = stage._to_device(self._schema.assemble([view[:n] for view in images], values), device)
        event = torch.cuda.Event()
        event.record(stream)
        self._copying.append((event, slot))
        return batch

    @functools.cached_property
    def _views(self) -> list[tuple[list[Tensor], dict[str, Tensor]]]:
        """Each slot's whole images (NCHW, one per region) and other fields, as tensors made once: for copies."""
        views: list[tuple[list[Tensor], dict[str, Tensor]]] = []
        for slot in range(self.memory.count):
            regions = [torch.from_numpy(region) for region in self.memory.regions(slot)]
            if self._channels_last:
                regions = [region.permute(0, 3, 1, 2) for region in regions]
            views.append((regions, {name: torch.from_numpy(rows) for name, rows in self._rows[slot]}))
        return views

    def pin(self) -> str | None:
        """Page-lock the whole memory once (``cudaHostRegister``), for asynchronous copies; the reason if it fails."""
        if self._pinned:
            return None
        address, nbytes = self.memory.address, self.memory.nbytes
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(address, nbytes, 0)
        if int(status) != 0:
            return f"cudaHostRegister of {nbytes / 2**20:.0f} MiB returned {status}"
        self._pinned = True
        weakref.finalize(self.memory, cudart.cudaHostUnregister, address)
        return None
