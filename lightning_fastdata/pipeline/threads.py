"""The threads engine (``engine="threads"``): batches built whole on threads in the training process.

No worker start-up, no copy of the dataset per worker, no inter-process transfer; the decode and resize kernels
release the GIL. :class:`~lightning_fastdata.pipeline.factory.FastLoader` runs it with its ``threads`` (or on the
calling thread, with none), each batch built into a private batch slot (:mod:`~lightning_fastdata.pipeline.slots`)
of that loader: the slot memory goes with each batch to the batch reader, which several loaders may share.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning_fastdata.pipeline.slots import SLOTS_HELD, SlotLayout, SlotMemory, SlotPool


def private_slots(layout: SlotLayout, ahead: int) -> SlotPool:
    """The slots of the threads (or of the calling thread): one per batch in flight, :data:`SLOTS_HELD` for the loop."""
    return SlotPool(SlotMemory(layout, ahead + SLOTS_HELD))


def threaded_batches(
    batch_indices: Iterator[Sequence[int]],
    read_batch: Callable[[Sequence[int]], Any],
    threads: int,
    ahead: int,
    dropped: Callable[[Sequence[int]], None] | None = None,
) -> Iterator[Any]:
    """Build batches on ``threads`` threads, each batch whole on one thread, ``ahead`` batches in flight, in order.

    ``threads=0``: each batch on the calling thread as it is asked for (``ahead`` unused). ``dropped`` is called with
    the indices of every batch that is not handed out: one that failed, and those still queued or being built when
    the consumer stops early (once their thread is done with them).
    """
    if threads == 0:
        return _in_turn(batch_indices, read_batch, dropped)
    return _on_threads(batch_indices, read_batch, threads, ahead, dropped)


def _in_turn(
    batch_indices: Iterator[Sequence[int]],
    read_batch: Callable[[Sequence[int]], Any],
    dropped: Callable[[Sequence[int]], None] | None,
) -> Iterator[Any]:
    """:func:`threaded_batches` on the calling thread."""
    for indices in batch_indices:
        try:
            batch = read_batch(indices)
        except BaseException:
            if dropped is not None:
                dropped(indices)
            raise
        yield batch


def _on_threads(
    batch_indices: Iterator[Sequence[int]],
    read_batch: Callable[[Sequence[int]], Any],
    threads: int,
    ahead: int,
    dropped: Callable[[Sequence[int]], None] | None,
) -> Iterator[Any]:
    """:func:`threaded_batches` on a pool of ``threads`` threads."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="lightning_fastdata")
    pending: deque[tuple[Sequence[int], Future]] = deque(
        (b, pool.submit(read_batch, b)) for b in itertools.islice(batch_indices, ahead)
    )
    try:
        while pending:
            indices, future = pending.popleft()
            try:
                batch = future.result()
            except BaseException:
                if dropped is not None:
                    dropped(indices)
                raise
            following = next(batch_indices, None)
            if following is not None:
                pending.append((following, pool.submit(read_batch, following)))
            yield batch
    finally:  # the epoch ended, or the consumer stopped early: stop the queued batches, let running ones finish
        if dropped is not None:
            for indices, future in pending:  # runs at once for a finished batch, else when cancelled or finished
                future.add_done_callback(lambda _, indices=indices: dropped(indices))
        pool.shutdown(wait=False, cancel_futures=True)
