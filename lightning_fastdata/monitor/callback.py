"""``LoaderMonitor``: the Lightning hooks that time every batch, log the metrics and report the verdict.

The callback wires the concerns that live beside it: ``timing`` (fetch, transfer and step from the profiler's
actions, CUDA events), ``series`` (the per-step series and the means logged from them), ``usage`` (GPU and CPU
utilization, with ``gpu``'s NVML sampler), ``verdict`` (the arithmetic and the advice) and ``report`` (the epoch line,
the table, the JSON and the chart).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fastdata.monitor.report import epoch_line, format_table, write_report
from lightning_fastdata.monitor.series import StepSeries
from lightning_fastdata.monitor.timing import LoopTimer
from lightning_fastdata.monitor.usage import UsageMeters
from lightning_fastdata.monitor.verdict import advise, judge_slowest_rank, summarize


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

    The first epoch this fit runs is warmup (worker start-up, cold page cache), also when it resumes from a checkpoint
    at a later epoch: it is logged but left out of the verdict.

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

    And at the end of every training epoch, also on a run shorter than ``log_every_n_steps``:

    - ``loader/data_wait_ms_epoch``, ``loader/step_ms_epoch``: means over the epoch's training batches
    - ``loader/data_fraction_epoch``: their wait / (wait + step), 0-1
    - ``loader/samples_per_sec_epoch``: the epoch's samples over its summed wait and step times

    At the end of each epoch (one line: the mean wait and step, the data fraction they give and its verdict) and of
    fit (a table), rank zero reports the mean, p50 and p90 wait and step, the data fraction, throughput, GPU
    utilization, a verdict (input-bound, balanced, compute-bound), the speedup available if data were free ((wait +
    step) / step), and — when input-bound — advice computed from this run. Both are printed through the Trainer's
    progress bar (``trainer.progress_bar_callback.print``), so they start on a line of their own under tqdm or Rich;
    without a bar they are logged (``rank_zero_info``).

    Args:
        warmup_epochs: the first epochs this fit runs (whatever their number, on a resumed fit) left out of the
            verdict.
        warmup_steps: the first training batches this fit runs left out of the verdict (for long epochs; a batch is
            warmup if either applies).
        batch_size_fn: returns the number of samples in a batch, for batches whose first tensor is not the batch.
        report_dir: write ``loader_report.json`` (per-step series and summary) and, with matplotlib,
            ``loader_report.png`` here at the end of fit.
        gpu_poll_interval: seconds between NVML samples.
        verbose: show the end-of-fit table (``format_table()`` returns it either way); the per-epoch line is always
            shown.

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
        self._timer = LoopTimer()  # wraps the profiler for a fit: it outlives the per-fit state below
        self._warned_no_fetch = False
        self._reset()

    def _reset(self) -> None:
        self._series = series = StepSeries(self.warmup_epochs, self.warmup_steps)
        self._usage = usage = UsageMeters(self.gpu_poll_interval)
        # their arrays, public here too (the same arrays: `StepSeries` and `UsageMeters` append, never rebind)
        self.wait_ms, self.step_ms, self.samples = series.wait_ms, series.step_ms, series.samples
        self.epochs, self.warmup = series.epochs, series.warmup
        self.gpu_util, self.cpu_util = usage.gpu_util, usage.cpu_util
        self._timer.reset()
        self._start: float | None = None
        self._step_at_start = 0
        self._cuda = False
        self._val_start: float | None = None
        self.summary: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------------------
    # Set-up and tear-down
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        device = pl_module.device
        self._cuda = device.type == "cuda"
        unmeasured = self._usage.start(device)
        if unmeasured is not None:
            self._say(trainer, f"LoaderMonitor: GPU utilization is not logged: {unmeasured}.")
        self._timer.watch(getattr(trainer, "profiler", None), cuda=self._cuda)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        self._series.read_gpu_times(self._timer, synchronize=True)
        self._usage.finish()
        self.summary = summary = summarize(
            wait_ms=self.wait_ms,
            step_ms=self.step_ms,
            samples=self.samples,
            warmup=self.warmup,
            gpu_util=self.gpu_util,
            cpu_util=self.cpu_util,
        )
        if summary["verdict"] is not None:
            summary["advice"] = self._advise(trainer)
        summary["ranks"] = ranks = _gather_ranks(trainer, pl_module.device, summary)
        judged = judge_slowest_rank(ranks) if len(ranks) > 1 and summary["verdict"] is not None else None
        if judged is not None:  # the rank every other rank waits for at the gradient sync
            summary.update(judged)
            summary["advice"] = self._advise(trainer)
        if self.verbose:
            self._say(trainer, self.format_table())
        if self.report_dir is not None and trainer.is_global_zero:
            write_report(
                self.report_dir,
                summary,
                wait_ms=self.wait_ms,
                step_ms=self.step_ms,
                samples=self.samples,
                epochs=self.epochs,
                warmup=self.warmup,
            )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # a fit that raised ends here: Lightning calls `on_exception`, not `on_train_end` or `teardown`
        self._stop()

    def _stop(self) -> None:
        """Stop the NVML thread and give the profiler its own methods back (both idempotent)."""
        self._usage.stop()
        self._timer.unwatch()

    # ------------------------------------------------------------------------------------------------------------
    # Training batches
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._series.start_epoch()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()  # the step's fallback start, should Lightning not report the step
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        wait, step = self._timer.take("train", "wait"), self._timer.take("train", "step")
        if wait is None:
            self._warn_no_fetch()
        if step is None:
            step = 1000.0 * (time.perf_counter() - self._start) if self._start is not None else 0.0
        size = self.batch_size_fn(batch) if self.batch_size_fn is not None else _batch_size(batch)
        index = self._series.add(wait or 0.0, step, int(size), trainer.current_epoch)
        self._timer.queue_events(index)  # on CUDA its GPU times replace the host times once its events completed
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

    def _warn_no_fetch(self) -> None:
        if not self._warned_no_fetch:
            self._warned_no_fetch = True
            rank_zero_warn(
                "LoaderMonitor: Lightning reported no dataloader fetch to `trainer.profiler` for this batch"
                " (a `training_step` that takes `dataloader_iter`, or a Lightning version that names the fetch"
                " differently), so its data wait is recorded as 0 and the verdict can be too optimistic."
            )

    def _log_interval(self, pl_module: LightningModule) -> None:
        self._series.read_gpu_times(self._timer)
        # wait and step of the batches timed since the last log: on CUDA those whose GPU work has completed
        metrics = self._series.interval_metrics(self._timer.first_unread())
        metrics.update(self._usage.take())
        if metrics:
            # CPU tensors: a Python number is copied to the module's device (on CUDA a blocking copy, which waits for
            # every queued kernel), and read back when the logger writes it
            values = {name: torch.tensor(value, dtype=torch.float32) for name, value in metrics.items()}
            pl_module.log_dict(values, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._series.read_gpu_times(self._timer, synchronize=True)
        wait, step = self._series.epoch_times()
        if not step:
            return
        self._say(trainer, epoch_line(trainer.current_epoch, wait, step, warmup=bool(self.warmup[-1])))
        # the epoch's figures, which reach the logger also when the epoch is shorter than `log_every_n_steps`
        pl_module.log_dict(self._series.epoch_metrics(), on_step=False, on_epoch=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------------------------
    # Validation batches
    # ------------------------------------------------------------------------------------------------------------

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._series.start_validation()

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
        if self._val_start is not None and self._timer.watching and not trainer.sanity_checking:
            wait, step = self._timer.take("val", "wait"), self._timer.take("val", "step")
            step = step if step is not None else 1000.0 * (time.perf_counter() - self._val_start)
            self._series.add_validation(wait or 0.0, step)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = None if trainer.sanity_checking else self._series.validation_metrics()
        if metrics is not None:
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------------------------
    # End of fit: advice, the DDP gather, the table
    # ------------------------------------------------------------------------------------------------------------

    def _advise(self, trainer: Trainer) -> list[str]:
        return advise(trainer, self.summary, cuda=self._cuda, epochs=self.epochs, wait_ms=self.wait_ms)

    def format_table(self) -> str:
        """The end-of-fit summary as a table."""
        return format_table(self.summary, warmup_epochs=self.warmup_epochs, warmup_steps=self.warmup_steps)

    def _say(self, trainer: Trainer, text: str) -> None:
        """Show ``text`` on rank zero through the Trainer's progress bar, or log it when no bar is showing.

        Logged beside a live bar, a line would be glued to the bar's last state (tqdm) or written under a stale copy
        of it (Rich); the bar's own ``print`` clears the bar, writes the line and redraws the bar below it.
        """
        bar = trainer.progress_bar_callback
        if bar is not None and _bar_prints(bar):
            if trainer.is_global_zero:
                bar.print(text)
        else:
            rank_zero_info(text)


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


def _bar_prints(bar: ProgressBar) -> bool:
    """Whether ``bar.print()`` shows a line now: the bar is enabled and, for tqdm, one of its bars is still open.

    ``TQDMProgressBar.print()`` writes nothing once its bars are closed (at the end of fit, or of each epoch with
    ``leave=True``, when the bar's hook runs before the monitor's); a closed tqdm bar has ended its line, so logging
    is safe then.
    """
    if not getattr(bar, "is_enabled", True):  # Lightning's bars have it, `ProgressBar` itself does not
        return False
    if not isinstance(bar, TQDMProgressBar):
        return True
    for name in ("train_progress_bar", "val_progress_bar"):
        try:
            if not getattr(bar, name).disable:
                return True
        except TypeError:  # that bar is not made yet
            continue
    return False


def _gather_ranks(trainer: Trainer, device: torch.device, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's mean wait and step (a collective under DDP: all ranks call it in ``on_train_end``)."""
    mine = torch.tensor(
        [summary.get("wait_mean_ms", math.nan), summary.get("step_mean_ms", math.nan)], dtype=torch.float64
    )
    if trainer.world_size > 1:
        gathered = trainer.strategy.all_gather(mine.to(device)).reshape(-1, 2).cpu()
    else:
        gathered = mine.reshape(1, 2)
    return [
        {"rank": r, "wait_mean_ms": _finite(float(w)), "step_mean_ms": _finite(float(s))}
        for r, (w, s) in enumerate(gathered)
    ]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
