"""The process engine (``engine="processes"``): batches built whole by DataLoader worker processes, into shared slots.

torch's DataLoader runs the workers (start method, ``worker_init_fn``, persistent workers, a dead worker's error,
timeouts); only what a worker returns is this package's. The training process owns a pool of batch slots in memory
it shares with the workers (:mod:`~lightning_fastdata.pipeline.slots`), made once per set of workers and kept across
epochs with persistent workers; the workers receive it as they start (:func:`with_slots`). Each batch's indices go
out with a free slot; the worker decodes, crops and resizes straight into it (:meth:`BatchReader.__getitems__
<lightning_fastdata.pipeline.kernel.BatchReader.__getitems__>`) and sends back only ``(slot, count)``. The training
process hands out a view of the slot, or its copy on the device, and frees the slot when that is done with: no
shared-memory segment, page fault, pickled tensor or pin-memory copy per batch. A batch whose indices found no free
slot (the loop kept many batches alive) is built in a memfd of its own, which goes back as its file descriptor
(:class:`~lightning_fastdata.pipeline.slots.FreshBatch`): the fused path names nothing in ``/dev/shm``, however many
batches the loop keeps. What does go through PyTorch's shared memory in ``/dev/shm``, as a plain DataLoader's
batches do: batches of the per-sample path (a dataset or transform of one's own), still-encoded ones
(``decode="device"``) and labels that are tensors of their own (a ``target_transform``'s); for those a container
needs room there (``docker run --shm-size``), or ``engine="threads"``.

Workers import this module to unpickle the ``worker_init_fn``, so it imports neither Lightning nor torchvision.
"""

from __future__ import annotations

import multiprocessing.queues
import os
import queue
import select
import sys
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import _utils, get_worker_info
from torch.utils.data.dataloader import _DatasetKind, _MultiProcessingDataLoaderIter

from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.slots import SLOTS_HELD, SlotLayout, SlotMemory, SlotPool


def shared_slots(layout: SlotLayout, ahead: int) -> SlotPool:
    """The slots of one set of worker processes: one per batch in flight, and :data:`SLOTS_HELD` for the loop.

    Raises:
        OSError: the shared memory could not be reserved.

    """
    return SlotPool(SlotMemory(layout, ahead + SLOTS_HELD, shared=True))


def with_slots(memory: SlotMemory, init: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker's ``worker_init_fn``: its loader's slot memory onto the worker's batch reader, then ``init``.

    The memory is the loader's, not the reader's (several loaders may share a reader): it reaches the worker with
    the ``worker_init_fn``, inherited by a forked worker, its file descriptor pickled for a spawned one.
    """
    info = get_worker_info()
    assert info is not None
    info.dataset.slots = memory  # type: ignore[attr-defined]
    if init is not None:
        init(worker_id)


def check_nice(worker_nice: Any) -> int:
    """``worker_nice`` checked: an int from 0 (the training process's priority) to 19 (the lowest).

    Raises:
        InvalidArgumentError: anything else (a ``ValueError``).

    """
    if isinstance(worker_nice, bool) or not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
        raise InvalidArgumentError(
            f"`worker_nice` must be an int from 0 (the training process's priority) to 19 (the lowest), got"
            f" {worker_nice!r}."
        )
    return worker_nice


def _worker_init(worker_id: int, nice: int = 0) -> None:
    """One intra-op thread per worker process: the workers already use every core the budget gives them.

    OpenCV needs nothing here: :mod:`lightning_fastdata._cv` switched its thread pool off in the parent. ``nice``:
    how much lower than the training process's this worker's priority is (``os.nice``), so the training thread, which
    launches the GPU's work, gets a core the moment it wakes, while the workers keep every core it leaves idle.
    """
    torch.set_num_threads(1)
    if nice and hasattr(os, "nice"):  # POSIX
        os.nice(nice)


#: whether a torch profiler records (private in torch; where it is missing, every task gets torch's range)
_profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


class _WatchedQueue(multiprocessing.queues.Queue):
    """A ``multiprocessing.Queue`` with a ``select.poll`` on its pipe, made again whenever the queue resets."""

    def _watch(self) -> None:
        raise NotImplementedError

    def _reset(self, *args: Any, **kwargs: Any) -> None:  # `multiprocessing.Queue`'s: made, unpickled or forked
        super()._reset(*args, **kwargs)
        self._watch()


class TaskQueue(_WatchedQueue):
    """A worker's index queue, which the training process alone writes: it writes each task to the pipe itself.

    ``multiprocessing.Queue.put`` hands each object to a feeder thread, which pickles it and writes it to the pipe: per
    task a condition's notify, a thread's wake-up and two hand-overs of the GIL, about 0.75 us of the training
    process's CPU per image of a 256-image task on a loaded 2-core machine. A task is a few hundred bytes that the pipe
    takes at once, so :meth:`put` writes it as the feeder would: the same pickler, length header and write lock, and
    the semaphore that ``get`` releases.

    It never blocks where the feeder would not have blocked the caller. A task over ``PIPE_BUF`` (written in one piece
    only up to that size), one that finds the pipe full (a worker that stopped reading) or the write lock taken (by a
    process that died holding it) goes to the feeder thread, and so does every later one, which keeps the order.
    """

    _writable: select.poll

    def _watch(self) -> None:
        self._writable = select.poll()
        self._writable.register(self._writer.fileno(), select.POLLOUT)

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:  # noqa: D102
        # once the feeder runs, every task goes to it
        if self._thread is None and not self._closed and self._put_now(obj, block, timeout):
            return
        super().put(obj, block, timeout)

    def _put_now(self, obj: Any, block: bool, timeout: float | None) -> bool:
        """Write ``obj`` to the pipe now; ``False``, having written nothing, where that could block."""
        task = ForkingPickler.dumps(obj)
        if len(task) > _DIRECT_BYTES or not self._wlock.acquire(False):
            return False
        try:
            if not self._writable.poll(0):  # no room (while we hold the lock, no one else writes)
                return False
            if not self._sem.acquire(block, timeout):
                raise queue.Full
            try:
                self._writer.send_bytes(task)
            except BaseException:
                self._sem.release()
                raise
            return True
        finally:
            self._wlock.release()


class ResultQueue(_WatchedQueue):
    """The workers' result queue as the training process reads it: waiting on a ``select.poll`` made once.

    torch reads it with a timeout, and ``Connection.poll`` builds, fills and closes a ``selectors`` selector per call
    (8 us warm against 1 us, several times that on the cold cache the workers leave); :meth:`get` waits on the poll
    object, then reads as ``multiprocessing.Queue.get`` does. Its ``put`` is the queue's own: the workers write to it.
    """

    _readable: select.poll

    def _watch(self) -> None:
        self._readable = select.poll()
        self._readable.register(self._reader.fileno(), select.POLLIN)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:  # noqa: D102
        if not block or timeout is None or self._closed:
            return super().get(block, timeout)
        deadline = time.monotonic() + timeout
        if not self._rlock.acquire(True, timeout):
            raise queue.Empty
        try:
            if not self._readable.poll(max(deadline - time.monotonic(), 0.0) * 1000):
                raise queue.Empty
            result = self._reader.recv_bytes()
            self._sem.release()
        finally:
            self._rlock.release()
        return ForkingPickler.loads(result)


#: the largest task :class:`TaskQueue` writes itself: a pipe write of at most ``PIPE_BUF`` bytes (with the 4-byte length
#: header) is atomic, and one the pipe reports writable takes it without blocking
_DIRECT_BYTES = getattr(select, "PIPE_BUF", 0) - 4


def watched(mp_queue: Any, kind: type[_WatchedQueue]) -> None:
    """Make ``mp_queue`` a ``kind`` (:class:`TaskQueue`, :class:`ResultQueue`) before its first task goes out.

    Left as it is on Windows (no write lock), or once its feeder thread runs.
    """
    if type(mp_queue) is not multiprocessing.queues.Queue or sys.platform == "win32" or not hasattr(select, "poll"):
        return
    if getattr(mp_queue, "_thread", True) is not None:  # already fed by its thread (or not the queue we know)
        return
    kind._watch(mp_queue)  # first: a thread may be reading it already (torch's pin-memory thread)
    mp_queue.__class__ = kind


#: how long a worker whose connection broke may take to be seen dead before the broken connection is the error
DEATH_GRACE_S = 5.0


class WorkerIterator(_MultiProcessingDataLoaderIter):
    """torch's worker-process iterator, which names a worker that died while its batch was being received.

    A batch of tensors in PyTorch's shared memory arrives as file descriptors, fetched from the worker that made it.
    If that worker is killed in the meantime, the fetch fails with ``ConnectionResetError`` (or ``EOFError``) a moment
    before the worker is seen dead, and torch, which looks for dead workers only then, raises the bare connection
    error. This waits up to :data:`DEATH_GRACE_S` for the dead worker and raises torch's own error naming it.

    Its workers' index queues are :class:`TaskQueue` objects and their result queue a :class:`ResultQueue`: the
    training process writes each task to the pipe itself and waits for results on a poll object made once.

    Its ``__next__`` opens torch's profiler range around each task only while a profiler records: the range is two
    operator calls, about 140 us of the training process's CPU per task on a loaded 2-core machine (half a
    microsecond per image of a 256-image task), spent whether anything records it or not.
    """

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        # before the first task goes out: torch's `__init__` ends here
        for index_queue in self._index_queues:
            watched(index_queue, TaskQueue)
        watched(self._worker_result_queue, ResultQueue)
        super()._reset(loader, first_iter)

    def __next__(self) -> Any:
        if _profiler_enabled() or self._dataset_kind != _DatasetKind.Map or self._sampler_iter is None:
            return super().__next__()
        # torch's `_BaseDataLoaderIter.__next__` without the range (and without its check of an iterable dataset's
        # length, which a map-style one does not need)
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _try_get_data(self, timeout: float = _utils.MP_STATUS_CHECK_INTERVAL) -> tuple[bool, Any]:
        try:
            return super()._try_get_data(timeout)
        except (ConnectionError, EOFError) as err:
            deadline = time.monotonic() + DEATH_GRACE_S
            while True:
                dead = [i for i, w in enumerate(self._workers) if self._workers_status[i] and not w.is_alive()]
                if dead:
                    pids = ", ".join(str(self._workers[i].pid) for i in dead)
                    for i in dead:
                        self._mark_worker_as_unavailable(i)
                    raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from err
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
