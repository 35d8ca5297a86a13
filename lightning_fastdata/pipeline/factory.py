"""The loader factory: :func:`create_loader` makes every choice of the batch path, :class:`FastLoader` runs it.

:class:`FastLoader`'s ``__iter__`` composes the stages of one epoch in order; :mod:`lightning_fastdata.pipeline`
follows a sample through them, from its database record to a batch on the device.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.device import DeviceStage, prefetch_to_device
from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices, Output, _batch_as_is
from lightning_fastdata.pipeline.processes import WorkerPool, _worker_init, check_nice, shared_slots
from lightning_fastdata.pipeline.resume import ResumableSampler, batches_per_epoch, position_state, restore_position
from lightning_fastdata.pipeline.schema import split_beside, with_beside
from lightning_fastdata.pipeline.slots import SlotLayout, SlotPool
from lightning_fastdata.pipeline.threads import private_slots, threaded_batches
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import Normalizer

Engine = Literal["threads", "processes"]

#: images per task sent to a worker process: each task costs the training process a pipe write, a wake-up and a
#: read on a cold cache, so batches of fewer images go out several to a task (`FastLoader._task_batches`), at most
#: `TASK_BATCHES`
TASK_IMAGES = 256
TASK_BATCHES = 4

log = logging.getLogger(__name__)


def create_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    sampler: Sampler | None = None,
    num_replicas: int = 1,
    rank: int = 0,
    resumable: bool = False,
    drop_last: bool = False,
    engine: Engine = "threads",
    workers: int = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool | None = None,
    output: Output | None = "uint8",
    normalizer: Normalizer | None = None,
    channels_last: bool = False,
    skip_counter: SkipCounter | None = None,
    pin_memory: bool = False,
    device: torch.device | str | None = None,
    device_stage: DeviceStage | None = None,
    limit_batches: int | float = 1.0,
    return_index: bool = False,
    before_epoch: Callable[[int], Hashable] | None = None,
    color: BatchColor | None = None,
    worker_nice: int = 0,
) -> FastLoader:
    """The loader of one split: every choice of the batch path, made here.

    Args:
        dataset: the split. Wrapped in a :class:`~lightning_fastdata.pipeline.kernel.BatchReader` (whole batches, fused
            where it can be) unless it is one already or ``output`` is ``None`` (read sample by sample, as a
            DataLoader reads it).
        batch_size: samples per batch.
        shuffle: shuffle the order, by ``seed`` and the epoch.
        seed: seeds the order and the augmentation.
        sampler: a sampler of one's own, instead of the seeded ``DistributedSampler`` made from ``shuffle``,
            ``seed``, ``num_replicas``, ``rank`` and ``resumable``.
        num_replicas: training processes sharing the data (``DistributedSampler``).
        rank: this process's rank among them.
        resumable: a :class:`~lightning_fastdata.pipeline.resume.ResumableSampler`: the loader's position goes into
            checkpoints and comes back (the training loader).
        drop_last: drop the last incomplete batch.
        engine: ``"threads"`` builds batches on ``workers`` threads in this process; ``"processes"`` on ``workers``
            DataLoader worker processes. ``workers=0``: on the calling thread.
        workers: threads or worker processes.
        prefetch_factor: batches in flight per thread or worker (default: 2).
        persistent_workers: keep worker processes between epochs (default: yes).
        output: what the batch reader gives: ``"uint8"`` (normalized on the device), ``"float"`` (normalized by the
            reading thread, for CPU training), ``"encoded"`` (JPEG bytes for ``decode="device"``); ``None``: the
            dataset's own samples, collated.
        normalizer: the mean and std for ``output="float"``.
        channels_last: ``float`` batches in ``channels_last`` memory.
        skip_counter: leave samples that fail with a package error out of their batch, and count them.
        pin_memory: page-locked host batches, for asynchronous copies to a GPU.
        device: copy batches one step ahead to this CUDA device, on a side stream (``None``, or a device other than
            CUDA: no look-ahead; Lightning copies them).
        device_stage: runs on the side stream after each copy: :class:`DeviceStage`.
        limit_batches: the Trainer's ``limit_train_batches``, for where a resumed epoch ends.
        before_epoch: called with the sampler's epoch as each epoch's iteration starts (see :class:`FastLoader`).
        return_index: batches are ``(images, targets, index)``: ``index`` the samples' true dataset indices,
            ``int64 [B]`` (for a subset of a database split, the index into that split), on every engine.
        color: each batch carries its samples' colour parameters, drawn from their keys, last
            (:mod:`~lightning_fastdata.pipeline.color`); the device stage applies them and takes them off.
        worker_nice: raise each worker process's nice value by this much (0-19), below the training process's
            priority (``engine="processes"``; threads share the training process's).

    A batch's targets are of the database's kind: ``int64 [B]`` classes, multi-hot ``float32 [B, C]``, ``float32
    [B, K]`` values (``[B]`` when K = 1), or ``int64 [B]`` of ``-1`` (no targets).

    Raises:
        ValueError: an unknown ``engine``, a negative ``workers``, or ``worker_nice`` outside 0-19.

    """
    if engine not in ("threads", "processes"):
        raise ValueError(f"`engine` must be 'threads' or 'processes', got {engine!r}.")
    if workers < 0:
        raise ValueError(f"`workers` must be >= 0, got {workers}.")
    check_nice(worker_nice)
    reader = dataset
    if output is not None and not isinstance(dataset, BatchReader):
        reader = BatchReader(
            dataset,
            output=output,
            normalizer=normalizer,
            channels_last=channels_last,
            skip_counter=skip_counter,
            pin_memory=pin_memory and engine == "threads",  # worker processes hand batches over in shared memory
            return_index=return_index,
            color=color,
        )
    elif return_index and not getattr(reader, "return_index", False):
        raise ValueError(
            "`return_index=True` needs a BatchReader made with `return_index=True`, or a dataset to wrap in one"
            " (`output` not None)."
        )
    if sampler is None:
        sampler_class = ResumableSampler if resumable else DistributedSampler
        sampler = sampler_class(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    kwargs: dict[str, Any] = {}
    if engine == "threads":
        kwargs["threads"] = workers
        if prefetch_factor is not None:
            kwargs["prefetch_batches"] = prefetch_factor * max(1, workers)
    else:
        kwargs["num_workers"] = workers
        if workers > 0:
            kwargs["persistent_workers"] = True if persistent_workers is None else persistent_workers
            init = functools.partial(_worker_init, nice=worker_nice) if worker_nice else _worker_init
            kwargs["worker_init_fn"] = init
            if prefetch_factor is not None:
                kwargs["prefetch_factor"] = prefetch_factor
    return FastLoader(
        reader,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        pin_memory=pin_memory,
        device=device,
        on_device=device_stage,
        limit_batches=limit_batches,
        before_epoch=before_epoch,
        **kwargs,
    )


class FastLoader(DataLoader):
    """The package's loader: a DataLoader whose iteration is the batch path (see the module docs).

    A :class:`~torch.utils.data.DataLoader`, so Lightning treats it as any loader: it reaches the sampler for
    ``set_epoch`` (and injects one under DDP when it must), uses ``len()`` for limits and progress, and saves
    ``state_dict()`` in checkpoints for exact mid-epoch resume. Build it with :func:`create_loader`.

    Batches of a fused :class:`~lightning_fastdata.pipeline.kernel.BatchReader` are built into batch slots
    (:mod:`~lightning_fastdata.pipeline.slots`), shared with the worker processes or private to the threads, and
    page-locked once when they go to a CUDA device: :attr:`page_locked` then says ``pin_memory`` was asked for, while
    the DataLoader's own ``pin_memory`` is off (no pin-memory thread). :attr:`slot_misses` counts the batches built
    in fresh memory because the training loop kept every slot's batch alive (in a worker process, a memfd of the
    batch's own: no ``/dev/shm``). The slots are the loader's own, so several loaders may share one batch reader.

    Args:
        dataset: a :class:`~lightning_fastdata.pipeline.kernel.BatchReader` (whole batches), or any dataset (read as a
            DataLoader reads it).
        *args: the arguments of :class:`~torch.utils.data.DataLoader`.
        threads: with ``num_workers=0``, build the batches of a ``BatchReader`` on this many threads in this process
            (``0``: on the calling thread, as a plain DataLoader does).
        prefetch_batches: batches in flight on the threads (default: two per thread).
        device: copy batches one step ahead to this device on a side CUDA stream (only on CUDA).
        on_device: applied to each batch on the side stream after the copy (:class:`DeviceStage`).
        limit_batches: the Trainer's ``limit_train_batches``: an epoch that handed out this many batches (an int, or
            a share of ``len()`` as a float) was complete, so resuming from it starts the next epoch.
        before_epoch: called with the sampler's epoch as each epoch's iteration starts, before its first batch is
            drawn. An int it returns is the epoch's crop size, given to the batch reader
            (:meth:`BatchReader.start_epoch <lightning_fastdata.pipeline.kernel.BatchReader.start_epoch>`: the
            DataModule's ``set_image_size`` and ``image_size_schedule`` reach the crops so, none changed in place).
            What it returns also stands for the dataset's state: when it differs from the value of the epoch the
            running persistent worker processes started in, they restart, so they get the dataset as it is now. A
            change of the batch reader's slot layout is seen without it: the slots take the new shape, and persistent
            workers restart.
        **kwargs: the keyword arguments of :class:`~torch.utils.data.DataLoader`.

    """

    def __init__(
        self,
        dataset: Dataset,
        *args: Any,
        threads: int = 0,
        prefetch_batches: int | None = None,
        device: torch.device | str | None = None,
        on_device: Callable[[Any], Any] | None = None,
        limit_batches: int | float = 1.0,
        before_epoch: Callable[[int], Hashable] | None = None,
        **kwargs: Any,
    ) -> None:
        if threads < 0:
            raise ValueError(f"`threads` must be >= 0, got {threads}.")
        kwargs.setdefault("collate_fn", _batch_as_is if isinstance(dataset, BatchReader) else None)
        super().__init__(dataset, *args, **kwargs)
        self.threads = threads
        self.prefetch_batches = prefetch_batches
        self.device = torch.device(device) if device is not None else None
        self.on_device = on_device
        self.limit_batches = limit_batches
        self.before_epoch = before_epoch
        #: what `before_epoch` returned for the epoch the running persistent workers started in
        self._dataset_state: Hashable = None
        self._handed_out = 0
        self._resume_at = 0
        #: what a batch slot holds, when batches are built into slots (the fused path): see `_slot_pool`
        self._slot_layout = self._reader_layout()
        self._slots: SlotPool | None = None
        self._threads_instead = False
        #: whether host batches are page-locked: their slots, once, or else each batch by torch's pin-memory thread
        self.page_locked = bool(self.pin_memory)
        if self._slot_layout is not None:
            self.pin_memory = False  # no pin-memory thread: no copy of each batch, no thread taking the GIL
        #: batches per task sent to a worker process (one for the other engines)
        self._task_batches = (
            min(TASK_BATCHES, -(-TASK_IMAGES // self.batch_size))
            if self._slot_layout is not None and self.num_workers > 0 and self.batch_size
            else 1
        )

    @property
    def engine(self) -> str:
        """Where batches are built: ``"threads"``, ``"processes"`` or ``"main"`` (the calling thread).

        Worker processes whose batch slots could not be reserved give way to as many threads (logged once).
        """
        if self.num_workers > 0 and not self._threads_instead:
            return "processes"
        return "threads" if self.workers > 0 and isinstance(self.dataset, BatchReader) else "main"

    @property
    def workers(self) -> int:
        """Threads or worker processes building batches (``0``: the calling thread builds them)."""
        if self.num_workers > 0:
            return self.num_workers
        return self.threads if isinstance(self.dataset, BatchReader) else 0

    @property
    def prefetching(self) -> bool:
        """Whether batches are copied to the device one step ahead (only on CUDA)."""
        return self.device is not None and self.device.type == "cuda"

    @property
    def resumable(self) -> bool:
        """Whether the epoch position is saved: with a :class:`~lightning_fastdata.pipeline.resume.ResumableSampler`."""
        return isinstance(self.sampler, ResumableSampler)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One epoch: index batches -> engine -> device (copy, then the device stage) -> counted as handed out."""
        return self._counted() if self.resumable else self._stages()

    @property
    def slot_misses(self) -> int:
        """Batches built in fresh memory because no batch slot was free (the loop kept batches alive)."""
        return self._slots.misses if self._slots is not None else 0

    def _stages(self) -> Iterator[Any]:
        # 0. the epoch starts: `before_epoch` (the epoch's crop size, given to the reader), then slots and persistent
        #    workers follow a changed dataset (`_follow_dataset`)
        self._follow_dataset()
        # 1. index batches, keyed with the epoch's (seed, epoch) and each given a free slot (`_keyed_batches`)
        slots = self._slot_pool()
        keyed = self._keyed_batches()
        # 2-3. the engine builds each batch whole, record to pixels, into its slot (`BatchReader.__getitems__`): the
        #    threads (or the calling thread) are given this loader's slot memory with each batch, worker processes
        #    as they start (`_worker_pool`), since the reader may be shared by several loaders
        if self._own_workers():
            batches = self._worker_batches(keyed if keyed is not None else self.batch_sampler)
        elif keyed is not None:
            reader = self.dataset
            assert isinstance(reader, BatchReader)
            read = functools.partial(reader.__getitems__, slots=slots.memory if slots is not None else None)
            release = (lambda indices: slots.release(getattr(indices, "slot", None))) if slots is not None else None
            batches = threaded_batches(iter(keyed), read, self.workers, self._on_threads(), release)
        else:
            batches = super().__iter__()  # torch's: on the calling thread, or an iterable dataset's workers
        # 4. slots to tensors: views handed out, or copies to the device one step ahead on the side stream; then the
        #    device stage there
        if slots is not None:
            batches = slots.receive(batches, self.device if self.prefetching else None)
        if self.prefetching:
            assert self.device is not None
            batches = prefetch_to_device(batches, self.device, self.on_device)
        return batches

    def _own_workers(self) -> bool:
        """Whether this loader's worker processes read a map-style dataset in batches: its own :class:`WorkerPool`.

        An iterable dataset, or a loader without automatic batching, goes to torch's DataLoader as it is.
        """
        return (
            self.engine == "processes"
            and self.batch_sampler is not None
            and not isinstance(self.dataset, torch.utils.data.IterableDataset)
        )

    def _worker_batches(self, tasks: Any) -> Iterator[Any]:
        """The results of this epoch's tasks from the worker processes: persistent ones kept for the next epoch."""
        pool = self._worker_pool()
        pin = self.pin_memory and torch.cuda.is_available()
        return _from_workers(pool, pool.run(tasks), pin, stop=not self.persistent_workers)

    def _worker_pool(self) -> WorkerPool:
        """The running persistent workers, else new ones, given this loader's slot memory as they start."""
        pool = self._iterator
        if isinstance(pool, WorkerPool) and pool.running:
            return pool
        self.check_worker_number_rationality()
        slots = self._slots.memory if self._slots is not None else None
        pool = WorkerPool(
            self.dataset,
            self.collate_fn,
            self.num_workers,
            context=self.multiprocessing_context,
            worker_init_fn=self.worker_init_fn,
            slots=slots,
            tasks_ahead=self._tasks_ahead(),
            timeout=self.timeout,
            seed=int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()),
        )
        # where DataLoader keeps persistent workers: Lightning's teardown lets go of them there, which stops them
        self._iterator = pool if self.persistent_workers else None
        return pool

    def _ahead(self) -> int:
        """Batches in flight: on the threads, to worker processes, or one on the calling thread.

        With those just received: one batch on threads; for worker processes a whole task, since the next task goes
        out before the batches of the one received are handed out (:meth:`WorkerPool.run`).
        """
        if self.engine == "threads":
            return self._on_threads() + 1
        if self.engine == "processes":
            return (self.num_workers * self._tasks_ahead() + 1) * self._task_batches
        return 2

    def _on_threads(self) -> int:
        """Batches in flight on the threads: ``prefetch_batches``, else ``prefetch_factor`` (2) per thread."""
        return self.prefetch_batches or (self.prefetch_factor or 2) * self.workers

    def _tasks_ahead(self) -> int:
        """Tasks in flight per worker process: ``prefetch_factor`` batches, rounded up to whole tasks."""
        return -(-(self.prefetch_factor or 2) // self._task_batches)

    def _reader_layout(self) -> SlotLayout | None:
        """What a batch slot of the batch reader holds now (``None``: batches are not built into slots)."""
        reader = self.dataset
        return reader.slot_layout(self.batch_size) if isinstance(reader, BatchReader) and self.batch_size else None

    def _follow_dataset(self) -> None:
        """As an epoch's iteration starts: ``before_epoch``, then slots and workers for the dataset as it is now.

        A new slot layout (the crops changed size) gets a new slot pool; the old slots free themselves once the
        batches handed out from them are gone. Persistent worker processes hold the dataset (and, on the fused path,
        the slot memory) they started with: a new layout, or a new value from ``before_epoch``, shuts them down, and
        new ones start for this epoch (`_worker_pool`).
        """
        state = self._dataset_state
        if self.before_epoch is not None:
            state = self.before_epoch(int(getattr(self.sampler, "epoch", 0)))
            if isinstance(self.dataset, BatchReader):  # the epoch's crop size, given to the reader, never set in place
                self.dataset.start_epoch(state if isinstance(state, int) and not isinstance(state, bool) else None)
        layout = self._reader_layout()
        if layout == self._slot_layout and state == self._dataset_state:
            return
        if layout != self._slot_layout:
            log.debug("Batch slots of %s -> %s: the loader makes new ones.", self._slot_layout, layout)
            self._slot_layout, self._slots = layout, None
        self._dataset_state = state
        iterator, self._iterator = self._iterator, None
        if isinstance(iterator, WorkerPool):  # persistent workers (their slots go with them)
            log.debug("The dataset changed: the loader's %d worker processes restart.", self.num_workers)
            iterator.shutdown()

    def _slot_pool(self) -> SlotPool | None:
        """The batch slots of the engine about to run: made once, or for worker processes once per set of workers.

        Persistent workers keep theirs (and the slots) across epochs; otherwise workers start per epoch and
        they get fresh slots, while the previous set keeps its own until it stops. Made again, too, when the reader's
        slot layout changes (`_follow_dataset`). The slots are this loader's alone, never the batch reader's (several
        loaders may share one): worker processes get them as they start (forked ones inherit them, spawned ones
        receive their file descriptor), threads with each batch.
        """
        layout = self._slot_layout
        if layout is None:
            return None
        processes = self.engine == "processes"
        running = isinstance(self._iterator, WorkerPool) and self._iterator.running
        if self._slots is not None and (not processes or (self.persistent_workers and running)):
            return self._slots
        pool = None
        if processes:
            try:
                pool = shared_slots(layout, self._ahead())
            except OSError as err:
                self._threads_instead = True
                log.warning(
                    "engine='processes' could not reserve the shared memory of its batch slots: %s. Batches are built"
                    " on %d threads in this process instead, which need no shared memory. To use worker processes,"
                    " give the process more memory (a container's memory limit), or lower `batch_size`,"
                    " `num_workers` or `prefetch_factor`.",
                    err,
                    self.num_workers,
                )
        if pool is None:
            pool = private_slots(layout, self._ahead())
        if self.page_locked and self.prefetching:
            reason = pool.pin()
            if reason is not None:
                log.warning("Batch slots stay pageable (%s): copies to the GPU will not overlap computation.", reason)
        self._slots = pool
        return pool

    def _counted(self) -> Iterator[Any]:
        # 5. A generator: nothing below runs until the first batch is asked for. Lightning creates the iterator before
        # it calls `set_epoch` (for the first epoch of a fit, and of a fit resumed from an end-of-epoch checkpoint,
        # where it does not call `load_state_dict` either), and DataLoader workers draw their indices as soon as the
        # DataLoader's own iterator exists. Drawn here, the order is that of the epoch the sampler is set to when
        # training really starts, whoever set it and in whatever order. Counted after the look-ahead: a batch read
        # ahead but never handed out is not lost on resume.
        batches = self._stages()
        self._handed_out, self._resume_at = self._resume_at, 0
        for batch in batches:
            self._handed_out += 1
            yield batch

    def _keyed_batches(self) -> _KeyedBatches | None:
        """What every engine draws a BatchReader's index batches from: batches keyed with the epoch's augmentation key.

        ``None`` for any other dataset, whose batch sampler's index batches are drawn as they are.
        """
        if not isinstance(self.dataset, BatchReader) or self.batch_sampler is None:
            return None
        processes = self.engine == "processes"
        return _KeyedBatches(
            self.batch_sampler, self.sampler, self._slots, processes, self._task_batches if processes else 1
        )

    def batches_per_epoch(self) -> int:
        """The batches the training loop takes from an epoch: ``len()`` cut by ``limit_batches``, as Lightning does."""
        return batches_per_epoch(len(self), self.limit_batches)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: epoch, batches handed out, and what the order depends on."""
        return position_state(self.sampler, self.batch_size, self._handed_out)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch after its last handed-out batch (or start the next one if it was complete)."""
        resume_at = restore_position(self.sampler, state, self.batch_size, self.batches_per_epoch())
        if resume_at is not None:
            self._resume_at = resume_at


class _KeyedBatches:
    """A loader's batch sampler, each batch keyed with the epoch's ``(seed, epoch)`` and given a free batch slot.

    The key is read when an epoch's iteration starts, after Lightning's ``set_epoch``: the sampler's ``seed`` and
    ``epoch`` (a ``DistributedSampler``), or else a seed drawn from :mod:`random` for the epoch. A slot is taken as
    each batch is sent to be built (the engines draw one index batch per batch they dispatch), ``None`` when
    none is free. It holds the samplers and the slots, not the loader: an iterator that kept its loader alive would
    be freed only by the garbage collector, and worker processes would stop late.

    For worker processes the slots sent but never received (an epoch left part-way) are freed when the next epoch
    starts: the worker pool has by then waited for every batch its persistent workers were building
    (:meth:`WorkerPool.run`).
    """

    def __init__(
        self,
        batch_sampler: Any,
        sampler: Any,
        slots: SlotPool | None = None,
        to_processes: bool = False,
        per_task: int = 1,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = sampler
        self.slots = slots
        self.to_processes = to_processes
        self.per_task = per_task

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[KeyedIndices]:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            key = (int(sampler.seed), int(sampler.epoch))
        else:
            key = (random.getrandbits(63), 0)
        slots = self.slots
        if slots is None:
            for indices in self.batch_sampler:
                yield KeyedIndices(indices, key)
            return
        if self.to_processes:
            slots.reclaim()
        take, capacity = slots.send if self.to_processes else slots.acquire, slots.layout.batch_size
        batches = (KeyedIndices(i, key, take() if len(i) <= capacity else None) for i in self.batch_sampler)
        if self.per_task == 1:
            yield from batches
            return
        while task := list(itertools.islice(batches, self.per_task)):
            yield task


def _from_workers(pool: WorkerPool, results: Iterator[Any], pin: bool, stop: bool) -> Iterator[Any]:
    """The results of a worker pool's run, page-locked if ``pin``; the pool shut down at the end if ``stop``.

    Holds the pool, not the loader, as :class:`_KeyedBatches` does: a loader kept alive by its running epoch would be
    freed only by the garbage collector.
    """
    try:
        for batch in results:
            yield _pinned(batch) if pin else batch
    finally:
        if stop:
            pool.shutdown()


def _pinned(batch: Any) -> Any:
    """``batch`` with its tensors page-locked, as the DataLoader's pin-memory thread pins them."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    batch, beside = split_beside(batch)
    if beside:  # the fields beside the batch are pinned too, and stay beside it
        return with_beside(_pinned(batch), _pinned(beside))
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        return type(batch)(_pinned(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _pinned(value) for key, value in batch.items()}
    return batch
