"""The opt-in bad-sample policy: leave samples that fail out of their batch, and count them across workers."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from lightning_fastdata.errors import FastDataError, SampleError

log = logging.getLogger(__name__)

#: skipped samples logged one by one, per process, before the log goes quiet
_LOGGED = 10


class SkipCounter:
    """A sample counter shared with DataLoader workers (a ``multiprocessing.Value``: fork and spawn both see it)."""

    def __init__(self) -> None:
        # A spawn-context value: its lock is a named semaphore, which forked children inherit and spawn or forkserver
        # children (spawn-context DataLoader workers, `strategy="ddp_spawn"`) reopen by name. A fork-context lock,
        # the default on Linux, refuses to be sent to a spawned process, and the DataModule holding it with it.
        self._value = multiprocessing.get_context("spawn").Value("q", 0)

    def add(self, n: int = 1) -> int:
        """Add ``n``; returns the new total."""
        with self._value.get_lock():
            self._value.value += n
            return int(self._value.value)

    def skip(self, err: Exception) -> None:
        """Count a sample left out because of ``err``; the first few are logged, one by one, per process."""
        total = self.add()
        if total <= _LOGGED:
            log.warning("skipping a bad sample (%d so far): %s", total, err)

    @property
    def value(self) -> int:
        """The count so far."""
        return int(self._value.value)


def read_kept(items: Sequence[Any], read: Callable[[Any], Any], skip_counter: SkipCounter | None) -> list[Any]:
    """``read`` every item of a batch; with a ``skip_counter`` a package error leaves that sample out, counted.

    Raises:
        FastDataError: an item failed, without a ``skip_counter``.
        SampleError: every item failed, with one.

    """
    results = []
    for item in items:
        try:
            results.append(read(item))
        except FastDataError as err:
            if skip_counter is None:
                raise
            skip_counter.skip(err)
    if not results:
        raise SampleError(
            f"all {len(items)} samples of a batch failed and were skipped; the data is likely unreadable"
            " (see the warnings above). Check the database with `LmdbImageDataset` directly."
        )
    return results
