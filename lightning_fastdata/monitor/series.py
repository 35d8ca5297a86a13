"""The per-step series of a fit, and the means ``LoaderMonitor`` logs from them.

Every training batch adds its data wait, its step time, its samples, its epoch and whether it is warmup; on CUDA its
host times are replaced by its GPU times once its events have completed
(:meth:`~lightning_fastdata.monitor.timing.LoopTimer.read_events`). The series remember where the logging interval and
the epoch began, and turn the batches since into the logged means: those of an interval whose times are final, those
of the epoch, those of a validation run. Arrays of 8-byte values: compact enough for millions of steps.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

import numpy as np

from lightning_fastdata.monitor.timing import LoopTimer
from lightning_fastdata.monitor.verdict import data_fraction


class StepSeries:
    """One fit's per-batch record: the training batches' times, samples, epochs and warmup flags.

    Args:
        warmup_epochs: the first epochs of the fit that are warmup.
        warmup_steps: the first training batches of the fit that are warmup.

    """

    def __init__(self, warmup_epochs: int, warmup_steps: int) -> None:
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.wait_ms = array("d")
        self.step_ms = array("d")
        self.samples = array("l")
        self.epochs = array("l")
        self.warmup = array("b")
        self._interval_start: float | None = None
        self._interval_first = 0  # the first batch of the logging interval (for throughput)
        self._timed_first = 0  # the first batch whose times are not logged yet (on CUDA they are final later)
        self._epoch_first = 0
        self._val_wait = array("d")
        self._val_step = array("d")

    def start_epoch(self) -> None:
        """A training epoch begins (the first one also begins the first logging interval)."""
        self._epoch_first = len(self.wait_ms)
        if self._interval_start is None:
            self._interval_start = time.perf_counter()

    def add(self, wait: float, step: float, samples: int, epoch: int) -> int:
        """Record a training batch of ``epoch`` (host times in ms); returns its index."""
        index = len(self.step_ms)
        self.wait_ms.append(wait)
        self.step_ms.append(step)
        self.samples.append(samples)
        self.epochs.append(epoch)
        # counted from this fit's first epoch, not epoch 0: a fit resumed from a checkpoint starts cold too
        warm = epoch - self.epochs[0] < self.warmup_epochs or index < self.warmup_steps
        self.warmup.append(1 if warm else 0)
        return index

    def read_gpu_times(self, timer: LoopTimer, synchronize: bool = False) -> None:
        """Replace the host times of CUDA batches by their GPU times, for the batches whose events have completed.

        The host never waits for the GPU here except with ``synchronize`` (at the end of an epoch and of fit).
        """
        for index, wait, step in timer.read_events(synchronize):
            if wait is not None:
                self.wait_ms[index] = wait
            self.step_ms[index] = step

    def interval_metrics(self, first_unread: int | None) -> dict[str, float]:
        """The logging interval that ends now: its means and throughput; the next interval begins.

        Args:
            first_unread: the first batch whose GPU times are not read yet (``None``: all are); the wait and step
                means are of the batches timed since the last log, up to it.

        """
        now = time.perf_counter()
        first, last = self._interval_first, len(self.step_ms)
        self._interval_first = last
        elapsed = now - (self._interval_start if self._interval_start is not None else now)
        self._interval_start = now
        metrics: dict[str, float] = {}
        timed_first, timed_last = self._timed_first, len(self.step_ms) if first_unread is None else first_unread
        if timed_last > timed_first:
            self._timed_first = timed_last
            wait = float(np.mean(self.wait_ms[timed_first:timed_last]))
            step = float(np.mean(self.step_ms[timed_first:timed_last]))
            metrics["loader/data_wait_ms"] = wait
            metrics["loader/step_ms"] = step
            metrics["loader/data_fraction"] = wait / (wait + step) if wait + step > 0 else 0.0
        if elapsed > 0:
            metrics["loader/samples_per_sec"] = sum(self.samples[first:last]) / elapsed
        return metrics

    def epoch_times(self) -> tuple[Sequence[float], Sequence[float]]:
        """The waits and steps of the epoch's training batches so far."""
        return self.wait_ms[self._epoch_first :], self.step_ms[self._epoch_first :]

    def epoch_metrics(self) -> dict[str, float]:
        """The epoch's means, fraction and throughput (over its summed wait and step); it must have a batch."""
        wait, step = self.epoch_times()
        total_wait, total_step = float(np.sum(wait)), float(np.sum(step))
        samples = sum(self.samples[self._epoch_first :])
        return {
            "loader/data_wait_ms_epoch": total_wait / len(wait),
            "loader/step_ms_epoch": total_step / len(step),
            "loader/data_fraction_epoch": data_fraction(total_wait, total_step),
            "loader/samples_per_sec_epoch": samples / max(1e-9, (total_wait + total_step) / 1000.0),
        }

    def start_validation(self) -> None:
        """A validation run begins: its batches are recorded afresh."""
        self._val_wait, self._val_step = array("d"), array("d")

    def add_validation(self, wait: float, step: float) -> None:
        """Record a validation batch's host times (ms)."""
        self._val_wait.append(wait)
        self._val_step.append(step)

    def validation_metrics(self) -> dict[str, float] | None:
        """The validation run's means; ``None`` when it recorded no batch."""
        if not self._val_step:
            return None
        return {
            "loader/val_data_wait_ms": float(np.mean(self._val_wait)),
            "loader/val_step_ms": float(np.mean(self._val_step)),
        }
