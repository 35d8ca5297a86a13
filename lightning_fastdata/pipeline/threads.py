"""The threads engine (``engine="threads"``): batches built whole on threads in the training process.

No worker start-up, no copy of the dataset per worker, no inter-process transfer; the decode and resize kernels
release the GIL. :class:`~lightning_fastdata.pipeline.factory.FastLoader` runs it with its ``threads``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def threaded_batches(
    batch_indices: Iterator[Sequence[int]],
    read_batch: Callable[[Sequence[int]], Any],
    threads: int,
    ahead: int,
) -> Iterator[Any]:
    """Build batches on ``threads`` threads, each batch whole on one thread, ``ahead`` batches in flight, in order."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="lightning_fastdata")
    pending: deque[Future] = deque(pool.submit(read_batch, b) for b in itertools.islice(batch_indices, ahead))
    try:
        while pending:
            batch = pending.popleft().result()
            following = next(batch_indices, None)
            if following is not None:
                pending.append(pool.submit(read_batch, following))
            yield batch
    finally:  # the epoch ended, or the consumer stopped early: stop the queued batches, let running ones finish
        pool.shutdown(wait=False, cancel_futures=True)
