"""``LoaderMonitor``: is training waiting for data, how much faster could it go, and what should change?"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_fastdata import cpus

log = logging.getLogger(__name__)

#: data fraction (wait / (wait + step)) above which a run is input-bound, and below which it is compute-bound
INPUT_BOUND = 0.2
COMPUTE_BOUND = 0.05


def _batch_size(batch: Any) -> int:
    """The number of samples in a batch: the length of its first tensor (searching tuples, lists and dicts)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    if isinstance(batch, dict):
        for item in batch.values():
            size = _batch_size(item)
            if size:
                return size
    return 0


class _GpuSampler:
    """Polls NVML for the utilization and memory of some GPUs in a daemon thread; ``take()`` averages and resets."""

    def __init__(self, nvml: Any, handles: list[Any], interval: float) -> None:
        self.nvml = nvml
        self.handles = handles
        self.interval = interval
        self._lock = threading.Lock()
        self._util_sum = 0.0
        self._mem_sum = 0.0
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="LoaderMonitor-nvml", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> None:
        util = mem = 0.0
        for handle in self.handles:
            util += float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            mem += float(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
        with self._lock:
            self._util_sum += util / len(self.handles)
            self._mem_sum += mem / len(self.handles)
            self._count += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as err:  # NVML errors must never take training down
                log.debug("NVML sampling stopped: %s", err)
                return

    def take(self) -> tuple[float, float] | None:
        """Mean utilization (%) and memory used (GiB) since the last call, or ``None`` without samples."""
        with self._lock:
            if not self._count:
                return None
            util, mem = self._util_sum / self._count, self._mem_sum / self._count / 2**30
            self._util_sum = self._mem_sum = 0.0
            self._count = 0
        return util, mem

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)


def _nvml_handles(device_index: int) -> tuple[Any, list[Any]] | str:
    """NVML and the handle of CUDA device ``device_index``, or the reason GPU utilization is unavailable."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (`pip install nvidia-ml-py`)"
    try:
        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception as err:
        return f"NVML is not usable here ({err})"
    return pynvml, [handle]


class LoaderMonitor(Callback):
    r"""Measures how long training waits for data, and says whether the input pipeline is the bottleneck.

    Works with any LightningModule and any dataloader. Per training batch it measures the **data wait** — the time
    the fit loop spends getting the batch: the ``next()`` on the dataloader's iterator plus the host-to-device
    transfer (``batch_to_device``) — and the **step** time — forward, backward and optimizer step
    (``run_training_batch``). Both are read from the actions Lightning's loops report to ``trainer.profiler`` for
    every batch, whatever the profiler (the monitor wraps its ``start``/``stop`` during the fit and gives them back
    after), so the wait is the loader's time only: the batch hooks of any callback, logging, checkpoint saving and
    validation are in neither the wait nor the step, wherever the monitor sits in the callback list.

    On the CPU both are host times. On CUDA both are GPU times, from CUDA events on the compute stream: the wait runs
    from the start of the fetch to the end of the transfer — the time the GPU sat idle because the batch was not
    there; a fetch that returns while the GPU still works through queued kernels costs no GPU time, so it is no
    stall. The monitor never makes the host wait for the GPU during an epoch (that would drain the queue and turn the
    next fetch into idle time it caused itself): at each logging point it reads only the events that have completed
    (``Event.query()``) and leaves the rest for the next one, and logs its metrics as CPU tensors (a Python number
    logged from a CUDA module is copied to the GPU, and that copy waits for the queue); one ``synchronize()`` at the
    end of each epoch reads what is left.

    The first epoch is warmup (worker start-up, cold page cache): it is logged but left out of the verdict.

    **Logged Metrics** (through ``LightningModule.log``, so at the same steps and in the same rows as the model's own
    ``self.log`` metrics: every ``Trainer(log_every_n_steps)`` optimizer steps):

    - ``loader/data_wait_ms``, ``loader/step_ms``: means over the training batches timed since the last log (on
      CUDA, those whose GPU work had completed; a few steps behind)
    - ``loader/data_fraction``: wait / (wait + step), 0-1
    - ``loader/samples_per_sec``: samples over wall time
    - ``loader/gpu_util`` (0-1), ``loader/gpu_mem_gb``: NVML averages (only on CUDA with NVML)
    - ``loader/cpu_util``: CPU use of this process and its workers as a share of the usable CPUs, 0-1
    - ``loader/val_data_wait_ms``, ``loader/val_step_ms``: the same for validation (fetch plus transfer, and
      ``validation_step``), once per validation run, host times

    At the end of each epoch (one line) and of fit (a table), rank zero reports p50/p90 wait and step, the data
    fraction, throughput, GPU utilization, a verdict (input-bound, balanced, compute-bound), the speedup available if
    data were free ((wait + step) / step), and — when input-bound — advice computed from this run.

    Args:
        warmup_epochs: epochs at the start left out of the verdict.
        warmup_steps: training batches at the start left out of the verdict (for long epochs; a batch is warmup if
            either applies).
        batch_size_fn: returns the number of samples in a batch, for batches whose first tensor is not the batch.
        report_dir: write ``loader_report.json`` (per-step series and summary) and, with matplotlib,
            ``loader_report.png`` here at the end of fit.
        gpu_poll_interval: seconds between NVML samples.
        verbose: log the end-of-fit table (``format_table()`` returns it either way); the per-epoch line is always
            logged.

    Raises:
        ValueError: a negative warmup or a non-positive poll interval.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_fastdata import LoaderMonitor
        >>> trainer = Trainer(callbacks=[LoaderMonitor()])

    """

    def __init__(
        self,
        warmup_epochs: int = 1,
        warmup_steps: int = 0,
        batch_size_fn: Callable[[Any], int] | None = None,
        report_dir: str | os.PathLike[str] | None = None,
        gpu_poll_interval: float = 0.1,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if warmup_epochs < 0 or warmup_steps < 0:
            raise ValueError(f"`warmup_epochs` ({warmup_epochs}) and `warmup_steps` ({warmup_steps}) must be >= 0.")
        if gpu_poll_interval <= 0:
            raise ValueError(f"`gpu_poll_interval` must be > 0, got {gpu_poll_interval}.")
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.gpu_poll_interval = gpu_poll_interval
        self.verbose = verbose
        self._profiler: Any = None
        self._profiler_methods: dict[str, Any] = {}
        self._warned_no_fetch = False
        self._reset()

    def _reset(self) -> None:
        # per-step series (8 bytes per value): compact enough for millions of steps
        self.wait_ms = array("d")
        self.step_ms = array("d")
        self.samples = array("l")
        self.epochs = array("l")
        self.warmup = array("b")
        self.gpu_util = array("d")
        self.cpu_util = array("d")
        # per ("train" | "val", "wait" | "step"): the pending batch's time so far (seconds) and its last start
        self._pending: dict[tuple[str, str], float | None] = {}
        self._since: dict[tuple[str, str], float] = {}
        self._fetching: str | None = None  # whose batch was fetched last: its transfer is part of its wait
        self._start: float | None = None
        self._step_at_start = 0
        self._cuda = False
        self._marks: dict[str, list[Any]] = {}  # CUDA events of the pending training batch: "wait", "step"
        self._events: list[tuple[int, Any, Any, Any, Any]] = []  # index, wait start/end, step start/end
        self._interval_start: float | None = None
        self._interval_first = 0  # the first batch of the logging interval (for throughput)
        self._timed_first = 0  # the first batch whose times are not logged yet (on CUDA they are final later)
        self._gpu: _GpuSampler | None = None
        self._cpu: cpus.CpuMeter | None = None
        self._val_wait = array("d")
        self._val_step = array("d")
        self._val_start: float | None = None
        self._epoch_first = 0
        self.summary: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------------------
    # Set-up and tear-down
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        device = pl_module.device
        self._cuda = device.type == "cuda"
        self._cpu = cpus.CpuMeter()
        self._watch_fetches(trainer)
        if self._cuda:
            found = _nvml_handles(device.index if device.index is not None else torch.cuda.current_device())
            if isinstance(found, str):
                rank_zero_info(f"LoaderMonitor: GPU utilization is not logged: {found}.")
            else:
                nvml, handles = found
                self._gpu = _GpuSampler(nvml, handles, self.gpu_poll_interval)
                self._gpu.start()
        else:
            rank_zero_info(f"LoaderMonitor: GPU utilization is not logged: training runs on {device.type}, not CUDA.")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        self._flush_events(wait=True)
        self.summary = self._summarize(trainer)
        self.summary["ranks"] = ranks = self._gather_ranks(trainer, pl_module)
        if len(ranks) > 1:
            self._judge_slowest_rank(trainer, ranks)
        if self.verbose:
            rank_zero_info(self.format_table())
        if self.report_dir is not None and trainer.is_global_zero:
            self._write_report()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a fit that raised ends here: Lightning calls `on_exception`, not `on_train_end` or `teardown`
        self._stop()

    def _stop(self) -> None:
        """Stop the NVML thread and give the profiler its own methods back (both idempotent)."""
        if self._gpu is not None:
            self._gpu.stop()
        self._unwatch_fetches()

    # ------------------------------------------------------------------------------------------------------------
    # Fetches, transfers and steps, as Lightning's loops report them to the profiler
    # ------------------------------------------------------------------------------------------------------------

    def _watch_fetches(self, trainer: Trainer) -> None:
        """Wrap ``trainer.profiler.start``/``stop`` to time the loops' fetch, transfer and step actions.

        The wrappers are instance attributes: the profiler's class, and what it records, stay as they were.
        """
        profiler = getattr(trainer, "profiler", None)
        if profiler is None or profiler is self._profiler:
            return
        self._unwatch_fetches()
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

    def _unwatch_fetches(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        for name in ("start", "stop"):
            if name in self._profiler_methods:
                setattr(profiler, name, self._profiler_methods[name])
            else:
                vars(profiler).pop(name, None)
        self._profiler_methods = {}

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
        cuda = self._cuda and phase == "train"
        if starting:
            if opens:  # a new batch's: what was pending belonged to a batch that was never run (an epoch skip)
                self._pending[key] = 0.0
                if what == "wait":
                    self._fetching = phase
                if cuda:
                    self._marks[what] = [_record_event(), None]
            self._since[key] = now
            return
        if self._pending.get(key) is None or key not in self._since:
            return
        self._pending[key] = self._pending[key] + now - self._since.pop(key)  # type: ignore[operator]
        if cuda and what in self._marks:
            self._marks[what][1] = _record_event()

    def _take(self, phase: str, what: str) -> float | None:
        """The pending batch's measured time in ms, or ``None`` when Lightning reported none."""
        seconds = self._pending.pop((phase, what), None)
        return None if seconds is None else 1000.0 * seconds

    def _warn_no_fetch(self) -> None:
        if not self._warned_no_fetch:
            self._warned_no_fetch = True
            rank_zero_warn(
                "LoaderMonitor: Lightning reported no dataloader fetch to `trainer.profiler` for this batch"
                " (a `training_step` that takes `dataloader_iter`, or a Lightning version that names the fetch"
                " differently), so its data wait is recorded as 0 and the verdict can be too optimistic."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Training batches
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_first = len(self.wait_ms)
        if self._interval_start is None:
            self._interval_start = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()  # the step's fallback start, should Lightning not report the step
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        index = len(self.step_ms)
        wait, step = self._take("train", "wait"), self._take("train", "step")
        if wait is None:
            self._warn_no_fetch()
        self.wait_ms.append(wait or 0.0)
        if step is None:
            step = 1000.0 * (time.perf_counter() - self._start) if self._start is not None else 0.0
        self.step_ms.append(step)
        marks, self._marks = self._marks, {}
        if self._cuda and None not in marks.get("step", [None]):
            waits = marks["wait"] if None not in marks.get("wait", [None]) else [None, None]
            self._events.append((index, *waits, *marks["step"]))
        size = self.batch_size_fn(batch) if self.batch_size_fn is not None else _batch_size(batch)
        self.samples.append(int(size))
        self.epochs.append(trainer.current_epoch)
        warm = trainer.current_epoch < self.warmup_epochs or index < self.warmup_steps
        self.warmup.append(1 if warm else 0)
        # Lightning writes the model's step metrics after this hook when (batches that stepped before this one + 1)
        # is a multiple of `log_every_n_steps`: logged through the module, these go in that write, at its step. With
        # automatic optimization those batches are the optimizer steps, and with gradient accumulation the interval
        # is logged at the batch that steps; with manual optimization every batch counts.
        every = trainer.log_every_n_steps
        if pl_module.automatic_optimization:
            done, stepped = self._step_at_start, trainer.global_step > self._step_at_start
        else:
            done, stepped = index, True
        if every > 0 and stepped and (done + 1) % every == 0:
            self._log_interval(pl_module)

    def _flush_events(self, wait: bool = False) -> None:
        """Replace the host times of CUDA batches by their GPU times, oldest first.

        Without ``wait`` only batches whose events have completed (``Event.query()``: the host never waits) are read;
        the rest stay for a later call. Waiting for the GPU here would drain its queue, and the next fetch would then
        be real idle time that the monitor itself caused. With ``wait`` (at the end of an epoch and of fit) one
        ``synchronize()`` completes them all.
        """
        if not self._events:
            return
        if wait:
            self._events[-1][-1].synchronize()
        done = 0
        for index, wait_start, wait_end, step_start, step_end in self._events:
            if not wait and not step_end.query():  # events complete in order on the compute stream
                break
            if wait_start is not None and wait_end is not None:
                self.wait_ms[index] = float(wait_start.elapsed_time(wait_end))
            self.step_ms[index] = float(step_start.elapsed_time(step_end))
            done += 1
        del self._events[:done]

    def _timed(self) -> int:
        """How many batches, from the first, have final wait and step times (on CUDA: whose events were read)."""
        return self._events[0][0] if self._events else len(self.step_ms)

    def _log_interval(self, pl_module: LightningModule) -> None:
        self._flush_events()
        now = time.perf_counter()
        first, last = self._interval_first, len(self.step_ms)
        self._interval_first = last
        elapsed = now - (self._interval_start if self._interval_start is not None else now)
        self._interval_start = now
        metrics: dict[str, float] = {}
        # wait and step of the batches timed since the last log: on CUDA those whose GPU work has completed
        timed_first, timed_last = self._timed_first, self._timed()
        if timed_last > timed_first:
            self._timed_first = timed_last
            wait = float(np.mean(self.wait_ms[timed_first:timed_last]))
            step = float(np.mean(self.step_ms[timed_first:timed_last]))
            metrics["loader/data_wait_ms"] = wait
            metrics["loader/step_ms"] = step
            metrics["loader/data_fraction"] = wait / (wait + step) if wait + step > 0 else 0.0
        if elapsed > 0:
            metrics["loader/samples_per_sec"] = sum(self.samples[first:last]) / elapsed
        if self._gpu is not None:
            gpu = self._gpu.take()
            if gpu is not None:
                metrics["loader/gpu_util"], metrics["loader/gpu_mem_gb"] = gpu[0] / 100.0, gpu[1]
                self.gpu_util.append(gpu[0] / 100.0)
        if self._cpu is not None:
            cpu = self._cpu.take()
            if cpu is not None:
                metrics["loader/cpu_util"] = cpu / 100.0
                self.cpu_util.append(cpu / 100.0)
        if metrics:
            # CPU tensors: a Python number is copied to the module's device (on CUDA a blocking copy, which waits for
            # every queued kernel), and read back when the logger writes it
            values = {name: torch.tensor(value, dtype=torch.float32) for name, value in metrics.items()}
            pl_module.log_dict(values, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_events(wait=True)
        first = self._epoch_first
        wait, step = np.asarray(self.wait_ms[first:]), np.asarray(self.step_ms[first:])
        if not len(step):
            return
        fraction = wait.sum() / max(1e-9, wait.sum() + step.sum())
        note = " (warmup: not in the verdict)" if self.warmup[-1] else ""
        rank_zero_info(
            f"LoaderMonitor epoch {trainer.current_epoch}: data wait p50 {np.median(wait):.1f} ms,"
            f" step p50 {np.median(step):.1f} ms, data fraction {fraction:.0%}, {_verdict(fraction)}{note}"
        )

    # ------------------------------------------------------------------------------------------------------------
    # Validation batches
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_wait, self._val_step = array("d"), array("d")

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._val_start = time.perf_counter()  # the step's fallback start, should Lightning not report the step

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val_start is not None and self._profiler is not None and not trainer.sanity_checking:
            wait, step = self._take("val", "wait"), self._take("val", "step")
            self._val_wait.append(wait or 0.0)
            self._val_step.append(step if step is not None else 1000.0 * (time.perf_counter() - self._val_start))

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._val_step:
            return
        metrics = {
            "loader/val_data_wait_ms": float(np.mean(self._val_wait)),
            "loader/val_step_ms": float(np.mean(self._val_step)),
        }
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------------------------
    # Summary, verdict, advice
    # ------------------------------------------------------------------------------------------------------------

    def _summarize(self, trainer: Trainer) -> dict[str, Any]:
        counted = np.asarray(self.warmup, dtype=bool) == 0
        wait, step = np.asarray(self.wait_ms)[counted], np.asarray(self.step_ms)[counted]
        samples = np.asarray(self.samples)[counted]
        summary: dict[str, Any] = {
            "steps": len(self.step_ms),
            "warmup_steps": int((~counted).sum()),
            "measured_steps": len(step),
        }
        if not len(step):
            summary["verdict"] = None
            return summary
        total_wait, total_step = float(wait.sum()), float(step.sum())
        fraction = total_wait / max(1e-9, total_wait + total_step)
        summary.update(
            wait_p50_ms=float(np.percentile(wait, 50)),
            wait_p90_ms=float(np.percentile(wait, 90)),
            step_p50_ms=float(np.percentile(step, 50)),
            step_p90_ms=float(np.percentile(step, 90)),
            wait_mean_ms=float(wait.mean()),
            step_mean_ms=float(step.mean()),
            data_fraction=fraction,
            samples_per_sec=float(samples.sum() / max(1e-9, (total_wait + total_step) / 1000.0)),
            speedup_if_data_free=(total_wait + total_step) / max(1e-9, total_step),
            verdict=_verdict(fraction),
        )
        if len(self.gpu_util):
            summary["gpu_util"] = float(np.mean(self.gpu_util))
        if len(self.cpu_util):
            summary["cpu_util"] = float(np.mean(self.cpu_util))
        summary["advice"] = self._advice(trainer, summary) if summary["verdict"] == "input-bound" else []
        return summary

    def _advice(self, trainer: Trainer, summary: dict[str, Any]) -> list[str]:
        loader = _train_loader(trainer)
        if loader is None:
            return ["the training dataloader is not a torch DataLoader; time its fetch to find the slow stage"]
        advice = []
        processes = cpus.cpu_sharing_processes(cpus.processes_per_node(trainer.world_size, trainer.num_nodes))
        budget = cpus.worker_budget(trainer.world_size, trainer.num_nodes)
        # a FastLoader builds batches on threads (`engine="threads"`) or worker processes; a DataLoader on processes
        engine = getattr(loader, "engine", "processes" if loader.num_workers > 0 else "main")
        workers = int(getattr(loader, "workers", loader.num_workers))
        unit = "loader threads" if engine == "threads" else "worker processes"
        if workers == 0:
            advice.append(
                f"num_workers=0 loads every batch in the training process; set num_workers={max(1, budget)}"
                f" (the budget: {cpus.usable_cpu_count()} usable CPUs / {processes} process(es) sharing them)"
            )
        elif workers < budget:
            advice.append(f"num_workers={workers} ({unit}) is below the budget of {budget}; raise it to {budget}")
        elif workers > budget:
            advice.append(
                f"num_workers={workers} ({unit}) exceeds the budget of {budget} ({cpus.usable_cpu_count()} usable"
                f" CPUs / {processes} process(es)): they fight over cores; lower it to {max(1, budget)}"
            )
        elif engine == "threads" and workers > 2:
            advice.append(
                f"the {workers} loader threads use the whole budget, and their Python work per image shares the"
                " training process's GIL with the training step: try engine='processes'"
            )
        if self._cuda and not loader.pin_memory:
            advice.append("pin_memory is off while training on CUDA; set pin_memory=True for asynchronous copies")
        epoch_batches = self._steps_per_epoch()
        if engine == "processes" and not loader.persistent_workers and epoch_batches and trainer.max_epochs != 1:
            first_waits = [self.wait_ms[i] for i in self._epoch_starts()]
            if first_waits and np.mean(first_waits) > 5 * summary["wait_p50_ms"]:
                advice.append(
                    f"each epoch starts with a {np.mean(first_waits):.0f} ms wait while workers restart; set"
                    " persistent_workers=True"
                )
        dataset = getattr(loader, "dataset", None)
        if _decodes_files(dataset):
            advice.append(
                f"{type(dataset).__name__} decodes full-size image files on every read; convert once with"
                " `lightning-fastdata convert SRC DST` and read DST with LmdbImageDataset or FastImageDataModule"
            )
        if "gpu_util" in summary and summary["gpu_util"] < 0.5:
            advice.append(
                f"the GPU was {summary['gpu_util']:.0%} busy while {summary['data_fraction']:.0%} of the time went to"
                " waiting for data: the input pipeline, not the model, sets the speed"
            )
        prefetch = getattr(loader, "prefetch_factor", None)
        if (
            engine == "processes"
            and prefetch is not None
            and prefetch <= 2
            and summary["wait_p90_ms"] > 3 * summary["wait_p50_ms"]
        ):
            advice.append(
                f"waits are bursty (p90 {summary['wait_p90_ms']:.0f} ms vs p50 {summary['wait_p50_ms']:.0f} ms) with"
                f" prefetch_factor={prefetch}; raise prefetch_factor to 4 to smooth them"
            )
        if not advice:
            advice.append(
                "the loader settings look right for this machine: the per-sample work itself is the cost; profile"
                " read / decode / transform to find the slow stage"
            )
        return advice

    def _epoch_starts(self) -> list[int]:
        epochs = list(self.epochs)
        return [i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]]

    def _steps_per_epoch(self) -> int:
        starts = [0, *self._epoch_starts(), len(self.epochs)]
        return max((b - a for a, b in itertools.pairwise(starts)), default=0)

    def _gather_ranks(self, trainer: Trainer, pl_module: LightningModule) -> list[dict[str, float]]:
        """Every rank's mean wait and step (a collective under DDP: all ranks call it in ``on_train_end``)."""
        mine = torch.tensor(
            [self.summary.get("wait_mean_ms", math.nan), self.summary.get("step_mean_ms", math.nan)],
            dtype=torch.float64,
        )
        if trainer.world_size > 1:
            gathered = trainer.strategy.all_gather(mine.to(pl_module.device)).reshape(-1, 2).cpu()
        else:
            gathered = mine.reshape(1, 2)
        return [
            {"rank": r, "wait_mean_ms": _finite(float(w)), "step_mean_ms": _finite(float(s))}
            for r, (w, s) in enumerate(gathered)
        ]

    def _judge_slowest_rank(self, trainer: Trainer, ranks: list[dict[str, float | None]]) -> None:
        """Judge the run by the rank that waits longest for data.

        Under DDP every rank waits for the slowest loader at the gradient sync, where it shows as their step time.
        """
        measured = [r for r in ranks if r["wait_mean_ms"] is not None and r["step_mean_ms"] is not None]
        if not measured or self.summary.get("verdict") is None:
            return
        slowest = max(measured, key=lambda r: r["wait_mean_ms"])  # type: ignore[arg-type,return-value]
        wait, step = float(slowest["wait_mean_ms"]), float(slowest["step_mean_ms"])  # type: ignore[arg-type]
        fraction = wait / max(1e-9, wait + step)
        self.summary.update(
            judged_rank=slowest["rank"],
            data_fraction=fraction,
            speedup_if_data_free=(wait + step) / max(1e-9, step),
            verdict=_verdict(fraction),
        )
        self.summary["advice"] = self._advice(trainer, self.summary) if self.summary["verdict"] == "input-bound" else []

    def format_table(self) -> str:
        """The end-of-fit summary as a table."""
        s = self.summary
        if not s.get("steps"):
            return "LoaderMonitor: no training batches were run: nothing to judge."
        if not s.get("measured_steps"):
            return (
                f"LoaderMonitor: {s.get('steps', 0)} training batches, all within the warmup (warmup_epochs="
                f"{self.warmup_epochs}, warmup_steps={self.warmup_steps}): no verdict. Train longer, or lower the"
                " warmup to measure."
            )
        rows = [
            ("data wait p50 / p90", f"{s['wait_p50_ms']:.1f} / {s['wait_p90_ms']:.1f} ms"),
            ("step p50 / p90", f"{s['step_p50_ms']:.1f} / {s['step_p90_ms']:.1f} ms"),
            ("data fraction", f"{s['data_fraction']:.1%}"),
            ("throughput", f"{s['samples_per_sec']:.1f} samples/s"),
        ]
        if "gpu_util" in s:
            rows.append(("GPU utilization", f"{s['gpu_util']:.0%}"))
        if "cpu_util" in s:
            rows.append(("CPU utilization", f"{s['cpu_util']:.0%} of {cpus.usable_cpu_count()} usable CPUs"))
        waits = {r["rank"]: r["wait_mean_ms"] for r in s.get("ranks", []) if r["wait_mean_ms"] is not None}
        if len(waits) > 1:
            slowest = max(waits, key=waits.__getitem__)
            rows.append(("slowest rank (wait)", f"rank {slowest}: {waits[slowest]:.1f} ms mean"))
            rows.append(("spread across ranks", f"{max(waits.values()) - min(waits.values()):.1f} ms"))
        judged = f" (rank {s['judged_rank']}, the slowest)" if "judged_rank" in s else ""
        rows.append(("verdict", f"{s['verdict']}{judged}: {s['speedup_if_data_free']:.2f}x faster if data were free"))
        rows.append(("measured", f"{s['measured_steps']} batches ({s['warmup_steps']} warmup batches left out)"))
        width = max(len(k) for k, _ in rows)
        lines = ["LoaderMonitor summary", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
        lines += [f"  - {item}" for item in s.get("advice", [])]
        return "\n".join(lines)

    def _write_report(self) -> None:
        assert self.report_dir is not None
        self.report_dir.mkdir(parents=True, exist_ok=True)
        series = {
            "data_wait_ms": list(self.wait_ms),
            "step_ms": list(self.step_ms),
            "samples": list(self.samples),
            "epoch": list(self.epochs),
            "warmup": [bool(w) for w in self.warmup],
        }
        report = {"summary": self.summary, "series": series}
        (self.report_dir / "loader_report.json").write_text(json.dumps(report, indent=1))
        try:
            _plot(series, self.report_dir / "loader_report.png")
        except ImportError:
            rank_zero_info(
                "LoaderMonitor: no chart written: matplotlib is not installed (`pip install matplotlib` or"
                " `pip install 'lightning-fastdata[plot]'`)."
            )


def _record_event() -> Any:
    """A timing CUDA event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _verdict(fraction: float) -> str:
    if fraction > INPUT_BOUND:
        return "input-bound"
    if fraction < COMPUTE_BOUND:
        return "compute-bound"
    return "balanced"


def _train_loader(trainer: Trainer) -> DataLoader | None:
    loaders = trainer.train_dataloader
    if isinstance(loaders, DataLoader):
        return loaders
    flat = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else []
    return next((dl for dl in flat if isinstance(dl, DataLoader)), None)


def _decodes_files(dataset: Any) -> bool:
    """Whether a dataset reads and decodes image files per sample (torchvision's ImageFolder family)."""
    while dataset is not None and hasattr(dataset, "dataset") and not hasattr(dataset, "loader"):
        dataset = dataset.dataset  # Subset and similar wrappers
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:  # pragma: no cover - torchvision is a dependency
        return False
    return isinstance(dataset, DatasetFolder)


def _plot(series: dict[str, list[Any]], path: Path) -> None:
    # a bare Figure on the Agg canvas: the user's pyplot backend (a notebook's, say) is left alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = np.arange(len(series["step_ms"]))
    fig = Figure(figsize=(9, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, series["step_ms"], label="step", linewidth=1)
    ax.plot(steps, series["data_wait_ms"], label="data wait", linewidth=1)
    warm = np.asarray(series["warmup"], dtype=bool)
    if warm.any():
        ax.axvspan(-0.5, float(np.nonzero(warm)[0].max()) + 0.5, color="grey", alpha=0.2, label="warmup (not judged)")
    ax.set_xlabel("training batch")
    ax.set_ylabel("ms")
    ax.set_title("LoaderMonitor: data wait vs step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
