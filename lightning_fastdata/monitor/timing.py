"""Timing the fit loop's fetches, transfers and steps from the actions Lightning reports to ``trainer.profiler``.

Lightning's loops report every batch's fetch (``[...].train_dataloader_next``, ``[...].val_next``), host-to-device
transfer (``[Strategy]....batch_to_device``) and step (``run_training_batch``, ``[Strategy]....validation_step``) to
``trainer.profiler``, whatever the profiler. :class:`LoopTimer` wraps the profiler's ``start``/``stop`` to time them,
so a batch's data wait is the loader's time only: callback hooks, logging and checkpoint saving are in neither the
wait nor the step.

On CUDA the training batches are timed on the GPU too, by CUDA events recorded on the compute stream. They are read
only once they have completed (``Event.query()``): waiting for the GPU mid-epoch would drain its queue and turn the
next fetch into idle time the timing itself caused. One ``synchronize()`` (at the end of an epoch and of fit) reads
the rest.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: the CUDA events of one training batch: its index, its wait's start and end (``None`` when Lightning reported no
#: fetch) and its step's start and end
BatchEvents = tuple[int, Any, Any, Any, Any]


def record_event() -> Any:
    """A timing CUDA event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class LoopTimer:
    """Times each batch's data wait (fetch plus transfer) and step from the actions reported to the profiler.

    ``watch()`` wraps the profiler's ``start``/``stop`` as instance attributes (the profiler's class, and what it
    records, stay as they were) and ``unwatch()`` gives them back. ``take()`` hands over the pending batch's host time
    in ms. On CUDA, ``queue_events()`` keeps the events of the training batch just run, and ``read_events()`` returns
    the GPU times of those that have completed, oldest first.
    """

    def __init__(self) -> None:
        self.cuda = False
        self._profiler: Any = None
        self._profiler_methods: dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every pending time and CUDA event (a watched profiler stays watched)."""
        # per ("train" | "val", "wait" | "step"): the pending batch's time so far (seconds) and its last start
        self._pending: dict[tuple[str, str], float | None] = {}
        self._since: dict[tuple[str, str], float] = {}
        self._fetching: str | None = None  # whose batch was fetched last: its transfer is part of its wait
        self._marks: dict[str, list[Any]] = {}  # CUDA events of the pending training batch: "wait", "step"
        self._events: list[BatchEvents] = []  # queued training batches whose events are not read yet

    # ------------------------------------------------------------------------------------------------------------
    # Wrapping the profiler
    # ------------------------------------------------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        """Whether a profiler's actions are being timed."""
        return self._profiler is not None

    def watch(self, profiler: Any, cuda: bool) -> None:
        """Wrap ``profiler.start``/``stop`` to time the loops' fetch, transfer and step actions.

        Args:
            profiler: the Trainer's profiler (``None``: nothing to time).
            cuda: training runs on CUDA: also record CUDA events around the training batches' wait and step.

        """
        self.cuda = cuda
        if profiler is None or profiler is self._profiler:
            return
        self.unwatch()
        start, stop = profiler.start, profiler.stop
        self._profiler_methods = {name: vars(profiler)[name] for name in ("start", "stop") if name in vars(profiler)}

        def timed_start(action_name: str) -> None:
            start(action_name)
            self._action(action_name, starting=True)

        def timed_stop(action_name: str) -> None:
            self._action(action_name, starting=False)
            stop(action_name)

        profiler.start, profiler.stop = timed_start, timed_stop
        self._profiler = profiler

    def unwatch(self) -> None:
        """Give the profiler its own ``start``/``stop`` back (idempotent)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        for name in ("start", "stop"):
            if name in self._profiler_methods:
                setattr(profiler, name, self._profiler_methods[name])
            else:
                vars(profiler).pop(name, None)
        self._profiler_methods = {}

    # ------------------------------------------------------------------------------------------------------------
    # Host times
    # ------------------------------------------------------------------------------------------------------------

    def _classify(self, name: str) -> tuple[str, str, bool] | None:
        """``(phase, what, opens)`` of a profiled action that is a fetch, a transfer or a step; ``None`` for others.

        ``opens``: the action starts a new measurement (a fetch, a step) rather than adding to one (a transfer).
        """
        if name.endswith("].train_dataloader_next"):
            return "train", "wait", True
        if name.endswith("].val_next"):
            return "val", "wait", True
        if name == "run_training_batch":  # forward, backward and optimizer step, without the batch hooks
            return "train", "step", True
        if name.startswith("[Strategy]"):
            if name.endswith(".batch_to_device") and self._fetching is not None:
                return self._fetching, "wait", False
            if name.endswith(".validation_step"):
                return "val", "step", True
        return None

    def _action(self, name: str, starting: bool) -> None:
        """A profiled action began or ended: time the fetches, transfers and steps of the pending batches."""
        found = self._classify(name)
        if found is None:
            return
        phase, what, opens = found
        key = (phase, what)
        now = time.perf_counter()
        cuda = self.cuda and phase == "train"
        if starting:
            if opens:  # a new batch's: what was pending belonged to a batch that was never run (an epoch skip)
                self._pending[key] = 0.0
                if what == "wait":
                    self._fetching = phase
                if cuda:
                    self._marks[what] = [record_event(), None]
            self._since[key] = now
            return
        if self._pending.get(key) is None or key not in self._since:
            return
        self._pending[key] = self._pending[key] + now - self._since.pop(key)  # type: ignore[operator]
        if cuda and what in self._marks:
            self._marks[what][1] = record_event()

    def take(self, phase: str, what: str) -> float | None:
        """The pending batch's measured time in ms, or ``None`` when Lightning reported none.

        Args:
            phase: ``"train"`` or ``"val"``.
            what: ``"wait"`` (fetch plus transfer) or ``"step"``.

        """
        seconds = self._pending.pop((phase, what), None)
        return None if seconds is None else 1000.0 * seconds

    # ------------------------------------------------------------------------------------------------------------
    # GPU times
    # ------------------------------------------------------------------------------------------------------------

    def queue_events(self, index: int) -> None:
        """Keep the CUDA events of the training batch just run, as batch ``index``'s, for ``read_events()``.

        A batch whose step recorded no events (not on CUDA, or no step reported) keeps its host times.
        """
        marks, self._marks = self._marks, {}
        if self.cuda and None not in marks.get("step", [None]):
            waits = marks["wait"] if None not in marks.get("wait", [None]) else [None, None]
            self._events.append((index, *waits, *marks["step"]))

    def first_unread(self) -> int | None:
        """The index of the oldest batch whose events are not read yet; ``None`` when all are."""
        return self._events[0][0] if self._events else None

    def read_events(self, synchronize: bool = False) -> list[tuple[int, float | None, float]]:
        """The GPU times ``(index, wait_ms, step_ms)`` of the queued batches whose events have completed, oldest first.

        ``wait_ms`` is ``None`` for a batch without a fetch's events. Without ``synchronize`` only batches whose events
        have completed (``Event.query()``: the host never waits) are read; the rest stay for a later call. Waiting for
        the GPU here would drain its queue, and the next fetch would then be real idle time that the timing itself
        caused. With ``synchronize`` (at the end of an epoch and of fit) one ``synchronize()`` completes them all.
        """
        if not self._events:
            return []
        if synchronize:
            self._events[-1][-1].synchronize()
        read: list[tuple[int, float | None, float]] = []
        for index, wait_start, wait_end, step_start, step_end in self._events:
            if not synchronize and not step_end.query():  # events complete in order on the compute stream
                break
            wait = float(wait_start.elapsed_time(wait_end)) if wait_start is not None and wait_end is not None else None
            read.append((index, wait, float(step_start.elapsed_time(step_end))))
        del self._events[: len(read)]
        return read
