"""The process engine (``engine="processes"``): batches built whole by worker processes, into shared slots.

The engine owns its workers (:class:`WorkerPool`): it starts them with the
loader's multiprocessing context and ``worker_init_fn``, sends each its tasks (index batches) over a pipe of its own,
takes the results back in order, names a worker that dies, and stops them at the end of an epoch (or, with
persistent workers, when the loader goes or its dataset changes). The training process owns a pool of batch slots in
memory it shares with the workers (:mod:`~lightning_fastdata.pipeline.slots`), made once per set of workers and kept
across epochs with persistent workers; the workers receive it as they start. Each batch's indices go out with a free
slot; the worker decodes, crops and resizes straight into it (:meth:`BatchReader.__getitems__
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

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import random
import select
import signal
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # registers the reductions that send tensors through shared memory

from lightning_fastdata._torch_private import set_worker_info
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.slots import SLOTS_HELD, SlotLayout, SlotMemory, SlotPool


def shared_slots(layout: SlotLayout, ahead: int) -> SlotPool:
    """The slots of one set of worker processes: one per batch in flight, and :data:`SLOTS_HELD` for the loop.

    Raises:
        OSError: the shared memory could not be reserved.

    """
    return SlotPool(SlotMemory(layout, ahead + SLOTS_HELD, shared=True))


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


# -- the workers ---------------------------------------------------------------------------------------------------

#: how often an idle worker checks that the training process is still there
WATCH_S = 1.0
#: how long a stopping worker may take to finish its task before it is terminated
JOIN_S = 5.0
#: how long a worker whose connection broke may take to be seen dead before the broken connection is the error
DEATH_GRACE_S = 5.0
#: the capacity each task and result pipe is given, where Linux allows (``F_SETPIPE_SZ``; 1 MiB is the default most an
#: unprivileged process may set). The training process writes tasks with a blocking send and reads results in order:
#: a worker blocked writing a result larger than its pipe while that worker's task pipe is full would stall both, at
#: Linux's default 64 KiB with tasks of thousands of indices and a collate of one's own that returns large data
PIPE_BYTES = 1 << 20


class WorkerPool:
    """``workers`` processes that build the batches of a map-style dataset, and the pipes that feed them.

    Each worker has two pipes of its own: tasks (index batches) in, results out. The training process is the only
    writer of a task pipe and the only reader of a result pipe, so it writes each task into the pipe itself and reads
    each result straight out of it: no queue, no feeder thread, no lock. Tasks go to the workers in turn, so a
    worker's results come back in the order its tasks went out, and an epoch's in the order of its tasks. A worker that
    dies is seen by its process sentinel, which the training process waits on beside the worker's result pipe.

    A worker starts as torch's DataLoader workers start: one intra-op thread, :mod:`random`, torch and NumPy seeded
    from the pool's base seed and the worker's id, :func:`torch.utils.data.get_worker_info` set, then
    ``worker_init_fn``.

    Args:
        dataset: what the workers read; each task is read as a DataLoader reads an index batch (``__getitems__``
            where the dataset has it, else ``dataset[i]`` for each index), then passed through ``collate_fn``.
        collate_fn: makes a task's samples one result (``None``: the samples as they are).
        workers: worker processes.
        context: the multiprocessing context they start in (``fork``, ``spawn``, ``forkserver``); ``None``: the
            default one.
        worker_init_fn: called in each worker with its id once it is set up, as torch's workers call it.
        slots: batch slot memory given to each worker's dataset (``dataset.slots``) before ``worker_init_fn``.
        tasks_ahead: tasks in flight per worker.
        timeout: seconds to wait for a result before raising (``0``: no limit), as the DataLoader's ``timeout``.
        seed: the base seed; worker ``i`` is seeded with ``seed + i``. ``None``: drawn from torch's global generator.

    Raises:
        RuntimeError: a worker died (its id, pid and signal named), or a result took longer than ``timeout``.

    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        workers: int,
        *,
        context: Any = None,
        worker_init_fn: Callable[[int], None] | None = None,
        slots: SlotMemory | None = None,
        tasks_ahead: int = 2,
        timeout: float = 0,
        seed: int | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"`workers` must be >= 1, got {workers}.")
        if tasks_ahead < 1:
            raise ValueError(f"`tasks_ahead` must be >= 1, got {tasks_ahead}.")
        context = context if context is not None else multiprocessing.get_context()
        if seed is None:  # as torch's DataLoader draws its workers' base seed
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self.tasks_ahead, self.timeout = tasks_ahead, timeout
        self._procs: list[Any] = []
        self._tasks: list[multiprocessing.connection.Connection] = []
        self._results: list[multiprocessing.connection.Connection] = []
        # stops the workers when the pool is shut down, garbage-collected, or the interpreter exits
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._tasks, self._results)
        setup = _Setup(dataset, collate_fn, worker_init_fn, slots, seed, workers, os.getpid())
        try:
            for worker_id in range(workers):
                tasks_out, tasks_in = context.Pipe(duplex=False)
                results_out, results_in = context.Pipe(duplex=False)
                _widen(tasks_in)
                _widen(results_in)
                proc = context.Process(
                    target=_work,
                    args=(setup, worker_id, tasks_out, results_in),
                    name=f"lightning_fastdata-worker-{worker_id}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
                self._tasks.append(tasks_in)
                self._results.append(results_out)
                tasks_out.close()  # the worker's ends: a worker that dies leaves its result pipe closed
                results_in.close()
        except BaseException:
            self.shutdown()
            raise
        self._waits = [_Wait(conn, proc.sentinel) for conn, proc in zip(self._results, self._procs, strict=True)]
        #: the worker of each task in flight, oldest first
        self._in_flight: deque[int] = deque()
        self._runs = 0

    @property
    def workers(self) -> int:
        """Worker processes."""
        return len(self._waits)

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids (while they run)."""
        return [proc.pid for proc in self._procs]

    @property
    def running(self) -> bool:
        """Whether the workers are there to take tasks: not shut down, none found dead."""
        return self._finalizer.alive

    def run(self, tasks: Iterable[Any]) -> Iterator[Any]:
        """Each task's result, in the order of ``tasks``, with :attr:`tasks_ahead` tasks in flight per worker.

        A worker's exception is raised here, as the DataLoader raises it. The next task goes out before a received
        result is handed over. Another run first waits for the tasks an earlier one left in flight (a loop that
        stopped part-way) and drops their results; the earlier run ends.

        Raises:
            RuntimeError: the pool was shut down.

        """
        if not self.running:
            raise RuntimeError("This worker pool was shut down: make a new one.")
        self._drain()
        self._runs += 1
        return self._results_of(iter(tasks), self._runs)

    def shutdown(self) -> None:
        """Stop the workers: each is asked to stop, given :data:`JOIN_S` to finish, then terminated. Idempotent."""
        self._finalizer()

    def _results_of(self, tasks: Iterator[Any], run: int) -> Iterator[Any]:
        turns = itertools.cycle(range(self.workers))
        for task in itertools.islice(tasks, self.workers * self.tasks_ahead):
            self._send(next(turns), task)
        while self._in_flight and run == self._runs and self.running:  # a later run, or a shutdown, ends it
            result = self._receive(self._in_flight.popleft())
            task = next(tasks, _END)
            if task is not _END:
                self._send(next(turns), task)
            if type(result) is _WorkerError:
                result.reraise()
            yield result

    def _send(self, worker: int, task: Any) -> None:
        try:
            self._tasks[worker].send(task)  # a few hundred bytes: the pipe takes them at once, no thread needed
        except OSError as err:  # a broken pipe: the worker is gone
            died = self._died(worker, wait=DEATH_GRACE_S)
            if died is None:
                raise
            raise died from err
        self._in_flight.append(worker)

    def _receive(self, worker: int) -> Any:
        """The next result of ``worker``: raises if it dies first, or ``timeout`` passes."""
        ready = self._waits[worker].ready(self.timeout or None)
        if not ready:
            # its pipe closed or its sentinel fired (`False`): it died, which its exit code shows at once or a moment
            # later; nothing at all (`None`): the timeout passed
            died = self._died(worker, wait=DEATH_GRACE_S if ready is False else 0.0)
            if died is None:
                self.shutdown()
                raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds (`timeout`).")
            raise died
        try:
            return self._results[worker].recv()
        except (ConnectionError, EOFError, FileNotFoundError) as err:
            # a dead worker's pipe, or tensors whose file descriptors were to be fetched from it: it was killed
            # meanwhile, which its sentinel shows a moment later; the connection's error if it stays alive
            died = self._died(worker, wait=DEATH_GRACE_S)
            if died is None:
                raise
            raise died from err

    def _died(self, worker: int, wait: float = 0.0) -> RuntimeError | None:
        """The error naming dead ``worker`` (the pool now shut down); ``None`` if it is alive after ``wait`` s."""
        proc = self._procs[worker]
        proc.join(wait)
        code, pid = proc.exitcode, proc.pid
        if code is None:
            return None
        self.shutdown()
        if code < 0:
            how = f"was killed by signal: {signal.strsignal(-code) or -code} ({_signal_name(-code)})"
            if -code == signal.SIGKILL:
                how += "; SIGKILL is often the kernel's out-of-memory killer (see `dmesg`)"
        else:
            how = f"exited unexpectedly with exit code {code}"
        return RuntimeError(
            f"DataLoader worker (pid {pid}, worker {worker} of {self.workers}) {how}. The loader's other workers were"
            " stopped. To rule worker processes out, try `engine='threads'`."
        )

    def _drain(self) -> None:
        """Wait for the tasks still in flight and drop their results (a loop stopped part-way)."""
        while self._in_flight:
            self._receive(self._in_flight.popleft())


#: the end of the tasks
_END = object()


def _widen(conn: multiprocessing.connection.Connection) -> None:
    """Give the pipe of ``conn`` :data:`PIPE_BYTES` of capacity where the system allows it; else leave it as it is."""
    with contextlib.suppress(AttributeError, ImportError, OSError):  # not Linux, or a lower `pipe-max-size`
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


class _Setup:
    """What every worker of a pool starts from (pickled once per worker by ``spawn`` and ``forkserver``)."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        worker_init_fn: Callable[[int], None] | None,
        slots: SlotMemory | None,
        seed: int,
        workers: int,
        parent: int,
    ) -> None:
        self.dataset, self.collate_fn, self.worker_init_fn, self.slots = dataset, collate_fn, worker_init_fn, slots
        self.seed, self.workers, self.parent = seed, workers, parent


class _Wait:
    """Waits for a worker's next result, or its death, on a ``select.poll`` made once.

    ``Connection.poll`` and ``multiprocessing.connection.wait`` build a selector per call: several microseconds of
    the training process per task.
    """

    def __init__(self, conn: multiprocessing.connection.Connection, sentinel: int) -> None:
        self._conn, self._sentinel = conn, sentinel
        self._poll = select.poll() if hasattr(select, "poll") else None
        if self._poll is not None:
            self._poll.register(conn.fileno(), select.POLLIN)
            self._poll.register(sentinel, select.POLLIN)

    def ready(self, timeout: float | None) -> bool | None:
        """``True``: a result can be read; ``False``: the worker died first; ``None``: ``timeout`` passed."""
        if self._poll is None:  # no poll (Windows)
            ready = multiprocessing.connection.wait([self._conn, self._sentinel], timeout)
            return (self._conn in ready) if ready else None
        events = dict(self._poll.poll(None if timeout is None else timeout * 1000))
        if not events:
            return None
        return bool(events.get(self._conn.fileno(), 0) & select.POLLIN)


class _WorkerError:
    """An exception raised in a worker, as it goes to the training process: its type and its traceback's text."""

    def __init__(self, worker_id: int, error: BaseException) -> None:
        self.exc_type: type = type(error)
        self.text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        self.where = f"in DataLoader worker process {worker_id}"

    def reraise(self) -> None:
        """Raise it again as torch's DataLoader does: its type, with the worker's traceback in the message."""
        message = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.text}"
        try:
            error = self.exc_type(message)
        except Exception:
            raise RuntimeError(message) from None
        raise error

    def __reduce__(self) -> Any:
        exc_type = self.exc_type if "<locals>" not in self.exc_type.__qualname__ else RuntimeError  # unpicklable
        return _worker_error, (exc_type, self.text, self.where)


def _worker_error(exc_type: type, text: str, where: str) -> _WorkerError:
    error = _WorkerError.__new__(_WorkerError)
    error.exc_type, error.text, error.where = exc_type, text, where
    return error


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stop(procs: list[Any], tasks: list[Any], results: list[Any]) -> None:
    """Stop workers: the stop message, their result pipes closed (a worker writing one stops), join, terminate."""
    for conn in tasks:
        with contextlib.suppress(OSError):  # a worker that is gone
            conn.send(None)
        conn.close()
    for conn in results:
        conn.close()
    for proc in procs:
        proc.join(JOIN_S)
        if proc.exitcode is None:
            proc.terminate()
            proc.join(JOIN_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def fetch(dataset: Any, collate_fn: Callable[[Any], Any] | None, indices: Any) -> Any:
    """One task's result, read as a DataLoader reads an index batch."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]
    return collate_fn(samples) if collate_fn is not None else samples


def _work(setup: _Setup, worker_id: int, tasks: Any, results: Any) -> None:
    """A worker's life: set up as torch's workers are, then each task read and its result sent.

    It ends when told to stop, when its pipes close, or when the training process is gone.
    """
    try:
        seed = setup.seed + worker_id
        torch.set_num_threads(1)
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(np.random.SeedSequence([worker_id, setup.seed]).generate_state(4))  # torch's NumPy seed
        dataset = setup.dataset
        if setup.slots is not None:
            dataset.slots = setup.slots
        set_worker_info(worker_id, setup.workers, seed, dataset)
        failed = None
        try:
            if setup.worker_init_fn is not None:
                setup.worker_init_fn(worker_id)
        except Exception as err:  # every task answers with it: the training process raises it with the first
            failed = _WorkerError(worker_id, err)
        while True:
            if not tasks.poll(WATCH_S):
                if os.getppid() != setup.parent:  # the training process died: nobody will stop us
                    return
                continue
            task = tasks.recv()
            if task is None:
                return
            try:
                result = failed if failed is not None else fetch(dataset, setup.collate_fn, task)
            except Exception as err:
                result = _WorkerError(worker_id, err)
            results.send(result)
            del result, task
    except (KeyboardInterrupt, EOFError, BrokenPipeError):  # Ctrl-C reaches the training process too; pipes closed
        return
