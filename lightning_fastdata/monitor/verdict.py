"""The monitor's arithmetic: summary statistics, the verdict, the speedup if data were free, and the advice.

Plain functions of the per-step series and the summary, so each can be checked from numbers alone; the advice also
reads the Trainer's training dataloader and its world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import DataLoader

from lightning_fastdata import cpus

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: data fraction (wait / (wait + step)) above which a run is input-bound, and below which it is compute-bound
INPUT_BOUND = 0.2
COMPUTE_BOUND = 0.05
#: CPU utilization (0-1) from which CPU training has no idle core to give more loader workers
CPU_SATURATED = 0.85


def verdict(fraction: float) -> str:
    """``"input-bound"``, ``"balanced"`` or ``"compute-bound"`` for a data fraction (0-1)."""
    if fraction > INPUT_BOUND:
        return "input-bound"
    if fraction < COMPUTE_BOUND:
        return "compute-bound"
    return "balanced"


def data_fraction(wait: float, step: float) -> float:
    """The share of the time spent waiting for data: wait / (wait + step)."""
    return wait / max(1e-9, wait + step)


def speedup_if_data_free(wait: float, step: float) -> float:
    """How much faster training would be if data were free: (wait + step) / step."""
    return (wait + step) / max(1e-9, step)


def summarize(
    *,
    wait_ms: Sequence[float],
    step_ms: Sequence[float],
    samples: Sequence[int],
    warmup: Sequence[int],
    gpu_util: Sequence[float],
    cpu_util: Sequence[float],
) -> dict[str, Any]:
    """The end-of-fit summary of the batches outside the warmup: percentiles, means, data fraction, verdict.

    Args:
        wait_ms: every training batch's data wait.
        step_ms: every training batch's step time.
        samples: every training batch's sample count.
        warmup: every training batch's warmup flag (1: left out).
        gpu_util: the GPU utilization (0-1) of each logging interval; empty when not measured.
        cpu_util: the CPU utilization (0-1) of each logging interval; empty when not measured.

    Returns:
        ``steps``, ``warmup_steps``, ``measured_steps`` and ``verdict`` (``None`` when no batch was measured); with
        measured batches also the wait and step p50 / p90 / mean, ``data_fraction``, ``samples_per_sec``,
        ``speedup_if_data_free`` and, when measured, ``gpu_util`` and ``cpu_util``.

    """
    counted = np.asarray(warmup, dtype=bool) == 0
    wait, step = np.asarray(wait_ms)[counted], np.asarray(step_ms)[counted]
    counted_samples = np.asarray(samples)[counted]
    summary: dict[str, Any] = {
        "steps": len(step_ms),
        "warmup_steps": int((~counted).sum()),
        "measured_steps": len(step),
    }
    if not len(step):
        summary["verdict"] = None
        return summary
    total_wait, total_step = float(wait.sum()), float(step.sum())
    fraction = data_fraction(total_wait, total_step)
    summary.update(
        wait_p50_ms=float(np.percentile(wait, 50)),
        wait_p90_ms=float(np.percentile(wait, 90)),
        step_p50_ms=float(np.percentile(step, 50)),
        step_p90_ms=float(np.percentile(step, 90)),
        wait_mean_ms=float(wait.mean()),
        step_mean_ms=float(step.mean()),
        data_fraction=fraction,
        samples_per_sec=float(counted_samples.sum() / max(1e-9, (total_wait + total_step) / 1000.0)),
        speedup_if_data_free=speedup_if_data_free(total_wait, total_step),
        verdict=verdict(fraction),
    )
    if len(gpu_util):
        summary["gpu_util"] = float(np.mean(gpu_util))
    if len(cpu_util):
        summary["cpu_util"] = float(np.mean(cpu_util))
    return summary


def judge_slowest_rank(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The verdict of the rank that waits longest for data, which judges a DDP run.

    Under DDP every rank waits for the slowest loader at the gradient sync, where it shows as their step time.

    Args:
        ranks: every rank's ``rank``, ``wait_mean_ms`` and ``step_mean_ms`` (``None`` where not measured).

    Returns:
        The summary entries to replace: ``judged_rank``, ``data_fraction``, ``speedup_if_data_free`` and
        ``verdict``; ``None`` when no rank was measured.

    """
    measured = [r for r in ranks if r["wait_mean_ms"] is not None and r["step_mean_ms"] is not None]
    if not measured:
        return None
    slowest = max(measured, key=lambda r: r["wait_mean_ms"])
    wait, step = float(slowest["wait_mean_ms"]), float(slowest["step_mean_ms"])
    fraction = data_fraction(wait, step)
    return {
        "judged_rank": slowest["rank"],
        "data_fraction": fraction,
        "speedup_if_data_free": speedup_if_data_free(wait, step),
        "verdict": verdict(fraction),
    }


def epoch_starts(epochs: Sequence[int]) -> list[int]:
    """The indices of the batches that start a new epoch (the run's first batch aside)."""
    epochs = list(epochs)
    return [i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]]


def steps_per_epoch(epochs: Sequence[int]) -> int:
    """The batches of the longest epoch (0 without batches)."""
    starts = [0, *epoch_starts(epochs), len(epochs)]
    return max((b - a for a, b in itertools.pairwise(starts)), default=0)


def advise(
    trainer: Trainer, summary: dict[str, Any], *, cuda: bool, epochs: Sequence[int], wait_ms: Sequence[float]
) -> list[str]:
    """What to change in the training dataloader, computed from the run; ``[]`` when nothing needs to change.

    Input-bound runs get advice on the loader's settings, but no more workers than a ``num_workers="tune"`` pick, nor
    when training on the CPU with its CPUs busy: the workers would take cores from the training step. Neither engine
    is advised over the other for CPU training: worker processes building into batch slots match the threads there
    (``benchmarks/bench_engines.py``).

    A ``FastLoader`` builds batches on threads (``engine="threads"``) or worker processes, and counts them in
    ``workers``; a ``DataLoader`` builds them on ``num_workers`` worker processes.

    Args:
        trainer: the Trainer, for its training dataloader, its datamodule's ``num_workers``, world size, nodes and
            ``max_epochs``.
        summary: the summary (``verdict``, ``data_fraction``, ``wait_p50_ms``, ``wait_p90_ms``, ``gpu_util`` and
            ``cpu_util`` when measured).
        cuda: training runs on CUDA.
        epochs: every training batch's epoch.
        wait_ms: every training batch's data wait.

    """
    judged = summary["verdict"]
    if judged not in ("input-bound", "balanced"):
        return []
    loader = _train_loader(trainer)
    if loader is None:
        if judged == "balanced":
            return []
        return ["the training dataloader is not a torch DataLoader; time its fetch to find the slow stage"]
    advice = []
    engine = getattr(loader, "engine", "processes" if loader.num_workers > 0 else "main")
    if judged == "balanced":
        return advice
    processes = cpus.cpu_sharing_processes(cpus.processes_per_node(trainer.world_size, trainer.num_nodes))
    budget = cpus.worker_budget(trainer.world_size, trainer.num_nodes)
    workers = int(getattr(loader, "workers", loader.num_workers))
    unit = "loader threads" if engine == "threads" else "worker processes"
    # a count FastImageDataModule(num_workers="tune") measured on this machine stands against the budget
    tuned = getattr(getattr(trainer, "datamodule", None), "tunes_workers", False) is True
    busy = None if cuda else summary.get("cpu_util")
    if workers > budget:
        advice.append(
            f"num_workers={workers} ({unit}) exceeds the budget of {budget} ({cpus.usable_cpu_count()} usable"
            f" CPUs / {processes} process(es)): they fight over cores; lower it to {max(1, budget)}"
        )
    elif busy is not None and busy >= CPU_SATURATED:
        keep = f"; keep num_workers={workers}, the pick of num_workers='tune'" if tuned else ""
        advice.append(
            f"training runs on the CPU and its {cpus.usable_cpu_count()} usable CPUs were {busy:.0%} busy: the loader"
            " and the model share them, so more workers would only take cores from the training step; make each"
            f" sample cheaper (fewer or cheaper transforms, a smaller image size) or train on a GPU{keep}"
        )
    elif tuned:
        advice.append(
            f"num_workers={workers} is the pick of num_workers='tune', which measured more workers at most 5% faster"
            " on this machine: the per-sample work itself is the cost; profile read / decode / transform to find the"
            " slow stage"
        )
    elif workers == 0:
        advice.append(
            f"num_workers=0 loads every batch in the training process; set num_workers={max(1, budget)}"
            f" (the budget: {cpus.usable_cpu_count()} usable CPUs / {processes} process(es) sharing them)"
        )
    elif workers < budget:
        advice.append(f"num_workers={workers} ({unit}) is below the budget of {budget}; raise it to {budget}")
    elif cuda and engine == "threads" and workers > 2:  # on the CPU the threads are the faster engine
        advice.append(
            f"the {workers} loader threads use the whole budget, and their Python work per image shares the"
            " training process's GIL with the training step: try engine='processes'"
        )
    if cuda and not getattr(loader, "page_locked", loader.pin_memory):
        advice.append("pin_memory is off while training on CUDA; set pin_memory=True for asynchronous copies")
    if engine == "processes" and not loader.persistent_workers and steps_per_epoch(epochs) and trainer.max_epochs != 1:
        first_waits = [wait_ms[i] for i in epoch_starts(epochs)]
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


def _train_loader(trainer: Trainer) -> DataLoader | None:
    """The Trainer's training dataloader, or the first of several; ``None`` when none is a torch DataLoader."""
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
