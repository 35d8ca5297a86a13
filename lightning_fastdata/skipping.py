"""The opt-in bad-sample policy: leave samples that fail out of their batch, and count them across workers."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset, default_collate

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


class SkipBadSamples(Dataset):
    """Returns ``None`` instead of raising for a sample that fails with one of this package's errors.

    Errors that are not about the sample (``IndexError``, a bug raising ``TypeError`` outside the transform, ...)
    still propagate. Use with :class:`SkippingCollate`.
    """

    def __init__(self, dataset: Dataset, counter: SkipCounter) -> None:
        self.dataset = dataset
        self.counter = counter

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except FastDataError as err:
            self.counter.skip(err)
            return None


class SkippingCollate:
    """Collates the samples that are not ``None`` (with ``collate_fn``, default: PyTorch's ``default_collate``)."""

    def __init__(self, collate_fn: Callable[[Sequence[Any]], Any] | None = None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, samples: Sequence[Any]) -> Any:
        """Collate the good samples of a batch."""
        good = [sample for sample in samples if sample is not None]
        if not good:
            raise SampleError(
                f"all {len(samples)} samples of a batch failed and were skipped; the data is likely unreadable"
                " (see the warnings above). Check the database with `LmdbImageDataset` directly."
            )
        return self.collate_fn(good)
