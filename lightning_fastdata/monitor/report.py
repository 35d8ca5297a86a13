"""What the monitor reports: the per-epoch line, the end-of-fit table, ``loader_report.json`` and the chart."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from lightning_fastdata import cpus
from lightning_fastdata.monitor.verdict import data_fraction, verdict


def epoch_line(epoch: int, wait_ms: Sequence[float], step_ms: Sequence[float], *, warmup: bool) -> str:
    """The line shown at the end of each epoch: the mean wait and step of its batches, their data fraction, verdict.

    The means are the figures the data fraction (mean wait / (mean wait + mean step)) and so the verdict are made
    of: medians beside a mean-based fraction would contradict it whenever a few slow fetches dominate the wait.

    Args:
        epoch: the epoch's number.
        wait_ms: the data wait of each of its training batches (at least one).
        step_ms: the step time of each of its training batches.
        warmup: the epoch is (or ends in) the warmup, which the end-of-fit verdict leaves out.

    """
    wait, step = float(np.mean(wait_ms)), float(np.mean(step_ms))
    fraction = data_fraction(wait, step)
    note = " (warmup: not in the verdict)" if warmup else ""
    return (
        f"LoaderMonitor epoch {epoch}: data wait {wait:.1f} ms, step {step:.1f} ms (means of {len(step_ms)} batches),"
        f" data fraction {fraction:.0%}, {verdict(fraction)}{note}"
    )


def format_table(summary: dict[str, Any], *, warmup_epochs: int, warmup_steps: int) -> str:
    """The end-of-fit summary as a table, or one sentence when there is nothing to judge.

    Args:
        summary: ``LoaderMonitor.summary``.
        warmup_epochs: the monitor's ``warmup_epochs``, named when every batch was warmup.
        warmup_steps: the monitor's ``warmup_steps``, likewise.

    """
    s = summary
    if not s.get("steps"):
        return "LoaderMonitor: no training batches were run: nothing to judge."
    if not s.get("measured_steps"):
        return (
            f"LoaderMonitor: {s.get('steps', 0)} training batches, all within the warmup (warmup_epochs="
            f"{warmup_epochs}, warmup_steps={warmup_steps}): no verdict. Train longer, or lower the"
            " warmup to measure."
        )
    # the means first: the data fraction, verdict and speedup are made of them (under DDP, of the slowest rank's)
    rows = [
        ("data wait mean / p50 / p90", f"{s['wait_mean_ms']:.1f} / {s['wait_p50_ms']:.1f} / {s['wait_p90_ms']:.1f} ms"),
        ("step mean / p50 / p90", f"{s['step_mean_ms']:.1f} / {s['step_p50_ms']:.1f} / {s['step_p90_ms']:.1f} ms"),
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


def write_report(
    report_dir: Path,
    summary: dict[str, Any],
    *,
    wait_ms: Sequence[float],
    step_ms: Sequence[float],
    samples: Sequence[int],
    epochs: Sequence[int],
    warmup: Sequence[int],
) -> None:
    """Write ``loader_report.json`` (the summary and the per-step series) and, with matplotlib, ``loader_report.png``.

    Args:
        report_dir: the folder (made when missing).
        summary: ``LoaderMonitor.summary``.
        wait_ms: every training batch's data wait.
        step_ms: every training batch's step time.
        samples: every training batch's sample count.
        epochs: every training batch's epoch.
        warmup: every training batch's warmup flag.

    """
    report_dir.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[Any]] = {
        "data_wait_ms": list(wait_ms),
        "step_ms": list(step_ms),
        "samples": list(samples),
        "epoch": list(epochs),
        "warmup": [bool(w) for w in warmup],
    }
    report = {"summary": summary, "series": series}
    (report_dir / "loader_report.json").write_text(json.dumps(report, indent=1))
    try:
        _plot(series, report_dir / "loader_report.png")
    except ImportError:
        rank_zero_info(
            "LoaderMonitor: no chart written: matplotlib is not installed (`pip install matplotlib` or"
            " `pip install 'lightning-fastdata[plot]'`)."
        )


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
