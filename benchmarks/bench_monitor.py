"""LoaderMonitor overhead, measured two ways in one run (issue 4: at most 1% of step time).

1. Direct: the monitor's own per-batch hook cost (batch start + batch end, logging interval included), timed over
   many calls against a stand-in Trainer, divided by the step time of the model below.
2. End to end: the same tiny fit with and without the monitor, alternated, CPU time per batch compared (one
   process, no workers, one intra-op thread, so CPU time is the run's cost and other processes barely disturb it).

    python benchmarks/bench_monitor.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from types import SimpleNamespace

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdata import LoaderMonitor


class TinyConvNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, 10),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_seconds(with_monitor: bool, steps: int, loader: DataLoader) -> float:
    trainer = Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        callbacks=[LoaderMonitor(warmup_epochs=0, verbose=False)] if with_monitor else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    start = time.process_time()  # CPU time of this process: less sensitive than wall time to neighbours
    trainer.fit(TinyConvNet(), loader)
    return (time.process_time() - start) / steps


class _NullLogger:
    def log_metrics(self, metrics, step) -> None:
        pass


def hook_cost_us(calls: int, epoch_len: int = 64) -> float:
    """Per-batch cost of every monitor hook and of the timed fetch, the logging interval and epoch ends included."""
    monitor = LoaderMonitor(warmup_epochs=0, verbose=False)
    trainer = SimpleNamespace(
        current_epoch=0, log_every_n_steps=50, loggers=[_NullLogger()], global_step=0, profiler=PassThroughProfiler()
    )
    module = SimpleNamespace(
        device=torch.device("cpu"), automatic_optimization=True, log_dict=lambda *args, **kwargs: None
    )
    monitor.on_train_start(trainer, module)  # as in a fit: the CPU meter, and the profiler wrapped to time fetches
    batch = (torch.zeros(32, 3, 32, 32), torch.zeros(32, dtype=torch.long))
    logging.getLogger("lightning_fastdata").setLevel(logging.WARNING)
    start = time.perf_counter()
    for i in range(calls):
        if i % epoch_len == 0:
            trainer.current_epoch = i // epoch_len
            monitor.on_train_epoch_start(trainer, module)
        trainer.profiler.start("[_TrainingEpochLoop].train_dataloader_next")
        trainer.profiler.stop("[_TrainingEpochLoop].train_dataloader_next")
        with trainer.profiler.profile("[Strategy]SingleDeviceStrategy.batch_to_device"):
            pass
        monitor.on_train_batch_start(trainer, module, batch, i)
        with trainer.profiler.profile("run_training_batch"):
            trainer.global_step += 1
        monitor.on_train_batch_end(trainer, module, None, batch, i)
        if i % epoch_len == epoch_len - 1:
            monitor.on_train_epoch_end(trainer, module)
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(32 * 64, 3, 32, 32), torch.randint(0, 10, (32 * 64,)))
    loader = DataLoader(data, batch_size=32, shuffle=True)

    fit_seconds(False, 20, loader)  # warm up the allocator and imports
    without, with_ = [], []
    for i in range(args.rounds):  # alternate which goes first, so drift hits both alike
        for monitored in (False, True) if i % 2 == 0 else (True, False):
            (with_ if monitored else without).append(fit_seconds(monitored, args.steps, loader))
    step_ms = 1000 * statistics.median(without)
    hook_us = hook_cost_us(20_000)
    end_to_end = statistics.median(with_) / statistics.median(without) - 1

    spread = (max(without) - min(without)) / statistics.median(without)
    print(f"tiny conv net, batch 32 of 3x32x32 on CPU: {step_ms:.2f} ms CPU per batch without the monitor")
    print(f"run-to-run spread without the monitor: {spread:.2%}")
    print(f"direct: monitor hooks cost {hook_us:.1f} us per batch = {hook_us / 10 / step_ms:.3f}% of the step")
    print(
        f"end to end (median of {args.rounds} alternated fits of {args.steps} steps): {end_to_end:+.2%} CPU time"
        " per batch with the monitor"
    )


if __name__ == "__main__":
    main()
