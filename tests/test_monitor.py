"""Tests for ``lightning_fastdata.monitor``: timing, warmup, verdicts, advice, the CUDA/NVML paths, reports and DDP.

Most go through ``LoaderMonitor``'s hooks or a real fit; the arithmetic (``verdict``, ``report``), the profiler
timing (``timing``) and the NVML sampler (``gpu``) are also checked on their own.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import Mock, patch

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader

from lightning_fastdata import FastImageDataModule, LmdbImageDataset, LoaderMonitor
from lightning_fastdata.monitor.gpu import GpuSampler, nvml_handles
from lightning_fastdata.monitor.report import epoch_line, format_table
from lightning_fastdata.monitor.timing import LoopTimer
from lightning_fastdata.monitor.verdict import advise, judge_slowest_rank, summarize, verdict
from lightning_fastdata.pipeline import BatchReader, FastLoader

DDP_SCRIPT = Path(__file__).with_name("monitor_ddp_script.py")

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")

#: the summary fields ``advise`` reads, of an input-bound run
_SUMMARY = {"verdict": "input-bound", "wait_p50_ms": 10.0, "wait_p90_ms": 12.0, "data_fraction": 0.5}

#: the callback and ``monitor.timing`` read the clock as ``time.perf_counter`` (and record ``torch.cuda.Event``s)
PERF_COUNTER = "time.perf_counter"
CUDA_EVENT = "torch.cuda.Event"
#: what the callback and its utilization meters look up in their own modules, so patched there
CALLBACK = "lightning_fastdata.monitor.callback"
USAGE = "lightning_fastdata.monitor.usage"

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


class _Clock:
    """A fake ``time.perf_counter``: returns ``now`` (seconds), which the test moves forward."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000.0


#: the actions Lightning's loops report to ``trainer.profiler`` around a batch's fetch and its transfer
TRAIN_FETCH = "[_TrainingEpochLoop].train_dataloader_next"
VAL_FETCH = "[_EvaluationLoop].val_next"
TRANSFER = "[Strategy]SingleDeviceStrategy.batch_to_device"
TRAIN_STEP = "run_training_batch"
VAL_STEP = "[Strategy]SingleDeviceStrategy.validation_step"


def _mock_trainer(**kwargs: Any) -> Mock:
    """A Mock trainer with the attributes the monitor reads (and a real, pass-through profiler)."""
    defaults = {
        "current_epoch": 0,
        "log_every_n_steps": 50,
        "loggers": [Mock()],
        "global_step": 0,
        "world_size": 1,
        "num_nodes": 1,
        "is_global_zero": True,
        "max_epochs": 2,
        "sanity_checking": False,
        "profiler": PassThroughProfiler(),
        "progress_bar_callback": None,
    }
    return Mock(**{**defaults, **kwargs})


def _cpu_module() -> Mock:
    return Mock(device=torch.device("cpu"), automatic_optimization=True)


def _fetch(trainer: Mock, clock: _Clock, wait: float, action: str = TRAIN_FETCH) -> None:
    """What the loop does before a batch: the fetch takes ``wait`` ms on the fake clock (the transfer none)."""
    trainer.profiler.start(action)
    clock.advance(wait)
    trainer.profiler.stop(action)
    with trainer.profiler.profile(TRANSFER):
        pass


def _drive(
    monitor: LoaderMonitor, trainer: Mock, module: Mock, clock: _Clock, batches: list[tuple[float, float]]
) -> None:
    """Run training batches through the fetch and the hooks: each ``(wait_ms, step_ms)`` on the fake clock."""
    for wait, step in batches:
        batch = (torch.zeros(2, 4), torch.zeros(2))
        _fetch(trainer, clock, wait)
        monitor.on_train_batch_start(trainer, module, batch, 0)
        with trainer.profiler.profile(TRAIN_STEP):
            clock.advance(step)
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, module, None, batch, 0)


def _run_epochs(
    monitor: LoaderMonitor, trainer: Mock, module: Mock, epochs: dict[int, list[tuple[float, float]]]
) -> Mock:
    """Run a fit of ``{epoch: batches}`` through the hooks (see ``_drive``); returns the patched ``rank_zero_info``."""
    clock = _Clock()
    with (
        patch("lightning_fastdata.cpus.CpuMeter"),
        patch(PERF_COUNTER, side_effect=clock),
        patch(f"{CALLBACK}.rank_zero_info") as info,
    ):
        monitor.on_train_start(trainer, module)
        for epoch, batches in epochs.items():
            trainer.current_epoch = epoch
            monitor.on_train_epoch_start(trainer, module)
            _drive(monitor, trainer, module, clock, batches)
            monitor.on_train_epoch_end(trainer, module)
        monitor.on_train_end(trainer, module)
    return info


class _SlowDataset(Dataset):
    """``n`` items ``(features, target)`` that each take ``delay`` seconds to load."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.full((4,), float(index)), torch.tensor(0.0)


class _TinyModel(LightningModule):
    """A linear layer on 4 features; ``step_sleep`` seconds of fake compute per training step."""

    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.step_sleep = step_sleep

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features = batch[0]
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return self.layer(features.flatten(1)[:, :4]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _ValModel(_TinyModel):
    """``_TinyModel`` with a validation step that takes 20 ms and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.val_batches = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_batches += 1
        time.sleep(0.02)  # far above an in-memory fetch, even slowed down on a loaded machine


def _fit(
    monitor: LoaderMonitor,
    dataset: Dataset,
    model: LightningModule | None = None,
    *,
    max_epochs: int = 2,
    batch_size: int = 2,
    val_dataset: Dataset | None = None,
    callbacks: list[Callback] | None = None,
    **kwargs: Any,
) -> Trainer:
    """Fit a tiny model on ``dataset`` on the CPU (no workers) with ``monitor`` or ``callbacks``; return the Trainer."""
    options: dict[str, Any] = {
        "max_epochs": max_epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    trainer = Trainer(callbacks=[monitor] if callbacks is None else callbacks, **options)
    val = DataLoader(val_dataset, batch_size=batch_size) if val_dataset is not None else None
    trainer.fit(model or _TinyModel(), DataLoader(dataset, batch_size=batch_size), val)
    return trainer


def _in_memory(n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.zeros(n))


def _slow_pil_loader(path: str) -> Any:
    time.sleep(0.02)
    return default_loader(path)


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).flatten()


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A torchvision ImageFolder ``root/class_<k>/<n>.jpg``: 2 classes x 4 tiny JPEGs."""
    root = tmp_path / "images"
    for k in range(2):
        (root / f"class_{k}").mkdir(parents=True)
        for n in range(4):
            Image.new("RGB", (8, 8), (30 * n, 100 * k, 50)).save(root / f"class_{k}" / f"{n}.jpg")
    return root


# ----------------------------------------------------------------------------------------------------------------
# Timing, logging and batch sizes
# ----------------------------------------------------------------------------------------------------------------


def test_exact_timing_and_interval_metrics():
    """Waits (fetch + transfer), steps and the metrics logged at the `log_every_n_steps` boundary follow the clock."""
    trainer = _mock_trainer(log_every_n_steps=2)
    module = _cpu_module()
    monitor = LoaderMonitor(warmup_epochs=0)
    times = [
        100.000,  # epoch start
        100.002,  # batch 0 fetch start
        100.010,  # fetch end: 8 ms
        100.011,  # transfer start
        100.013,  # transfer end: 2 ms, so a 10 ms wait
        100.014,  # batch 0 start (the monitor's hook)
        100.015,  # step start
        100.045,  # step end: 30 ms
        100.050,  # batch 1 fetch start (the 5 ms before it are batch hooks, other callbacks, the loop: neither)
        100.070,  # fetch end: 20 ms
        100.071,  # transfer start
        100.071,  # transfer end
        100.075,  # batch 1 start
        100.080,  # step start
        100.130,  # step end: 50 ms
        100.131,  # interval logged: 131 ms since the epoch start
        100.135,  # batch 2 fetch start
        100.140,  # fetch end: 5 ms
        100.141,  # transfer start
        100.141,  # transfer end
        100.145,  # batch 2 start
        100.150,  # step start
        100.157,  # step end: 7 ms
    ]
    batches = [
        (torch.zeros(4, 3), torch.zeros(4)),
        {"image": torch.zeros(4, 3), "label": torch.zeros(4)},
        [{"image": torch.zeros(6, 3)}],
    ]
    cpu = Mock(take=Mock(return_value=37.5))
    with (
        patch("lightning_fastdata.cpus.CpuMeter", return_value=cpu),
        patch(PERF_COUNTER, side_effect=times) as perf_counter,
    ):
        monitor.on_train_start(trainer, module)
        monitor.on_train_epoch_start(trainer, module)
        for index, batch in enumerate(batches):
            trainer.profiler.start(TRAIN_FETCH)
            trainer.profiler.stop(TRAIN_FETCH)
            with trainer.profiler.profile(TRANSFER):
                pass
            monitor.on_train_batch_start(trainer, module, batch, index)
            with trainer.profiler.profile(TRAIN_STEP):
                trainer.global_step = index + 1
            monitor.on_train_batch_end(trainer, module, None, batch, index)
            if index == 0:
                module.log_dict.assert_not_called()  # not a boundary yet
            if index == 1:
                module.log_dict.assert_called_once()
        monitor.teardown(trainer, module, "fit")
    assert perf_counter.call_count == len(times)
    assert list(monitor.wait_ms) == pytest.approx([10.0, 20.0, 5.0])
    assert list(monitor.step_ms) == pytest.approx([30.0, 50.0, 7.0])
    assert list(monitor.samples) == [4, 4, 6]
    assert list(monitor.warmup) == [0, 0, 0]
    module.log_dict.assert_called_once()  # batch 2 is not a boundary
    metrics, kwargs = module.log_dict.call_args.args[0], module.log_dict.call_args.kwargs
    assert kwargs == {"on_step": True, "on_epoch": False}  # Lightning picks the step: the model's
    assert metrics == pytest.approx(
        {
            "loader/data_wait_ms": 15.0,
            "loader/step_ms": 40.0,
            "loader/data_fraction": 15.0 / 55.0,
            "loader/samples_per_sec": 8 / 0.131,
            "loader/cpu_util": 0.375,  # a share, 0-1, like the data fraction
        }
    )
    assert "start" not in vars(trainer.profiler)  # the profiler has its own methods back


def _samples_of(monitor: LoaderMonitor, batch: Any) -> list[int]:
    """The ``samples`` series after one training batch ``batch`` through the monitor's hooks."""
    trainer, module = _mock_trainer(), _cpu_module()
    with patch("lightning_fastdata.cpus.CpuMeter"):
        monitor.on_train_start(trainer, module)
    monitor.on_train_epoch_start(trainer, module)
    _fetch(trainer, _Clock(), 1.0)
    monitor.on_train_batch_start(trainer, module, batch, 0)
    monitor.on_train_batch_end(trainer, module, None, batch, 0)
    return list(monitor.samples)


def test_batch_size_fn_overrides_the_batch_search():
    """`batch_size_fn` counts the samples of a batch whose first tensor is not the batch."""
    monitor = LoaderMonitor(batch_size_fn=lambda batch: batch["n"])
    assert _samples_of(monitor, {"n": 5, "mask": torch.zeros(1, 3)}) == [5]


def test_batches_without_a_reported_fetch_warn_once():
    """Batches whose fetch Lightning did not report (a `dataloader_iter` step) count no wait, with one warning."""
    trainer, module = _mock_trainer(), _cpu_module()
    monitor = LoaderMonitor(warmup_epochs=0)
    with patch("lightning_fastdata.cpus.CpuMeter"):
        monitor.on_train_start(trainer, module)
    monitor.on_train_epoch_start(trainer, module)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for index in range(3):
            monitor.on_train_batch_start(trainer, module, torch.zeros(2), index)
            monitor.on_train_batch_end(trainer, module, None, torch.zeros(2), index)
    assert len([w for w in record if "reported no dataloader fetch" in str(w.message)]) == 1
    assert list(monitor.wait_ms) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (torch.zeros(7, 2), 7),
        (torch.tensor(3.0), 1),
        ((torch.zeros(3), torch.zeros(9)), 3),
        ([[], {"x": torch.zeros(5, 1)}], 5),
        ({"meta": "name", "x": torch.zeros(6)}, 6),
        ("not a batch", 0),
    ],
)
def test_batch_size_reads_the_first_tensor(batch, expected):
    """The batch size is the length of the first tensor found in tuples, lists and dicts."""
    assert _samples_of(LoaderMonitor(), batch) == [expected]


# ----------------------------------------------------------------------------------------------------------------
# Warmup
# ----------------------------------------------------------------------------------------------------------------


def test_warmup_epoch_is_left_out_of_the_summary():
    """With `warmup_epochs=1` the first epoch's (slow) batches are flagged and do not reach the percentiles."""
    monitor = LoaderMonitor(warmup_epochs=1, verbose=False)
    info = _run_epochs(monitor, _mock_trainer(), _cpu_module(), {0: [(500.0, 10.0)] * 3, 1: [(0.1, 10.0)] * 3})
    assert list(monitor.warmup) == [1, 1, 1, 0, 0, 0]
    assert list(monitor.epochs) == [0, 0, 0, 1, 1, 1]
    summary = monitor.summary
    assert (summary["steps"], summary["warmup_steps"], summary["measured_steps"]) == (6, 3, 3)
    assert summary["wait_p50_ms"] == pytest.approx(0.1)
    assert summary["wait_p90_ms"] == pytest.approx(0.1)
    assert summary["verdict"] == "compute-bound"  # the 500 ms warmup waits would make it input-bound
    assert summary["advice"] == []
    assert summary["ranks"] == [{"rank": 0, "wait_mean_ms": pytest.approx(0.1), "step_mean_ms": pytest.approx(10.0)}]
    # one line per epoch, the warmup named; nothing about GPU utilization on a CPU fit
    assert [c.args[0] for c in info.call_args_list] == [
        "LoaderMonitor epoch 0: data wait 500.0 ms, step 10.0 ms (means of 3 batches), data fraction 98%,"
        " input-bound (warmup: not in the verdict)",
        "LoaderMonitor epoch 1: data wait 0.1 ms, step 10.0 ms (means of 3 batches), data fraction 1%, compute-bound",
    ]


def test_warmup_is_the_first_epoch_a_resumed_fit_runs():
    """A fit resumed at epoch 2 starts its workers and page cache cold too: its first epoch is the warmup."""
    monitor = LoaderMonitor(warmup_epochs=1, verbose=False)
    resumed = {2: [(500.0, 10.0)] * 3, 3: [(0.1, 10.0)] * 3}  # a fit resumed at epoch 2
    info = _run_epochs(monitor, _mock_trainer(max_epochs=4), _cpu_module(), resumed)
    assert list(monitor.warmup) == [1, 1, 1, 0, 0, 0]
    assert (monitor.summary["warmup_steps"], monitor.summary["measured_steps"]) == (3, 3)
    assert monitor.summary["verdict"] == "compute-bound"
    lines = [c.args[0] for c in info.call_args_list if c.args[0].startswith("LoaderMonitor epoch")]
    assert lines[0].startswith("LoaderMonitor epoch 2:")
    assert lines[0].endswith("(warmup: not in the verdict)")
    assert not lines[1].endswith("(warmup: not in the verdict)")


def test_warmup_steps_leave_out_the_first_batches():
    """`warmup_steps=2` flags the first two batches of the run, whatever the epoch."""
    trainer, module, clock = _mock_trainer(), _cpu_module(), _Clock()
    monitor = LoaderMonitor(warmup_epochs=0, warmup_steps=2)
    with (
        patch("lightning_fastdata.cpus.CpuMeter"),
        patch(PERF_COUNTER, side_effect=clock),
    ):
        monitor.on_train_start(trainer, module)
        monitor.on_train_epoch_start(trainer, module)
        _drive(monitor, trainer, module, clock, [(300.0, 10.0), (200.0, 10.0), (20.0, 10.0), (30.0, 10.0)])
        monitor.on_train_end(trainer, module)
    assert list(monitor.warmup) == [1, 1, 0, 0]
    assert monitor.summary["measured_steps"] == 2
    assert monitor.summary["wait_mean_ms"] == pytest.approx(25.0)
    assert monitor.summary["wait_p90_ms"] == pytest.approx(29.0)


def test_run_inside_warmup_has_no_verdict():
    """A run that never leaves the warmup ends with a summary that says there is no verdict."""
    monitor = LoaderMonitor(warmup_epochs=1)
    _fit(monitor, _in_memory(6), max_epochs=1)
    summary = monitor.summary
    assert summary["steps"] == summary["warmup_steps"] == 3
    assert summary["measured_steps"] == 0
    assert summary["verdict"] is None
    table = monitor.format_table()
    assert "no verdict" in table
    assert "3 training batches, all within the warmup" in table


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"warmup_epochs": -1}, "warmup_epochs"), ({"gpu_poll_interval": 0}, "gpu_poll")]
)
def test_invalid_arguments_raise(kwargs, match):
    """A negative warmup or a non-positive poll interval is rejected with the argument's name."""
    with pytest.raises(ValueError, match=match):
        LoaderMonitor(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Verdicts on real runs
# ----------------------------------------------------------------------------------------------------------------


def test_slow_dataset_is_input_bound_with_worker_advice():
    """A dataset that sleeps per sample feeding a tiny model is input-bound, and told to use the CPU budget."""
    monitor = LoaderMonitor(warmup_epochs=1)
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=3):
        _fit(monitor, _SlowDataset(8, delay=0.02))
    summary = monitor.summary
    assert summary["measured_steps"] == 4
    assert summary["verdict"] == "input-bound"
    assert summary["data_fraction"] > 0.5
    assert summary["wait_p50_ms"] >= 40.0  # 2 samples x 20 ms
    assert summary["speedup_if_data_free"] > 2.0
    advice = summary["advice"]
    assert any("set num_workers=3" in item and "3 usable CPUs / 1 process(es)" in item for item in advice), advice
    assert not any("pin_memory" in item or "convert" in item for item in advice), advice
    table = monitor.format_table()
    assert "input-bound" in table
    assert "set num_workers=3" in table


def test_slow_model_is_compute_bound_without_advice():
    """A model that sleeps per step fed from memory is compute-bound, and gets no advice."""
    monitor = LoaderMonitor(warmup_epochs=1)
    # 200 ms steps: Lightning's own gap between batches (under 1 ms, a few on a loaded machine) stays far below the
    # 10 ms that make 5%
    _fit(monitor, _in_memory(8), _TinyModel(step_sleep=0.2))
    summary = monitor.summary
    assert summary["measured_steps"] == 4
    assert summary["verdict"] == "compute-bound"
    assert summary["step_p50_ms"] >= 200.0
    assert summary["speedup_if_data_free"] < 1.05
    assert summary["advice"] == []
    assert "compute-bound" in monitor.format_table()


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.9, "input-bound"), (0.21, "input-bound"), (0.2, "balanced"), (0.05, "balanced"), (0.049, "compute-bound")],
)
def test_verdict_thresholds(fraction, expected):
    """More than 20% of the time waiting is input-bound, less than 5% compute-bound, balanced between."""
    assert verdict(fraction) == expected


def test_summary_of_the_series_leaves_out_the_warmup():
    """`summarize` judges the non-warmup batches: percentiles, means, fraction, throughput, speedup, utilizations."""
    summary = summarize(
        wait_ms=[500.0, 10.0, 30.0, 20.0],
        step_ms=[5.0, 10.0, 10.0, 20.0],
        samples=[8, 4, 4, 4],
        warmup=[1, 0, 0, 0],
        gpu_util=[0.5, 0.7],
        cpu_util=[],
    )
    assert summary == pytest.approx(
        {
            "steps": 4,
            "warmup_steps": 1,
            "measured_steps": 3,
            "wait_p50_ms": 20.0,
            "wait_p90_ms": 28.0,
            "step_p50_ms": 10.0,
            "step_p90_ms": 18.0,
            "wait_mean_ms": 20.0,
            "step_mean_ms": 40.0 / 3,
            "data_fraction": 60.0 / 100.0,
            "samples_per_sec": 12 / 0.1,
            "speedup_if_data_free": 100.0 / 40.0,
            "verdict": "input-bound",
            "gpu_util": 0.6,
        }
    )
    assert list(summary) == [  # the order of loader_report.json
        *("steps", "warmup_steps", "measured_steps", "wait_p50_ms", "wait_p90_ms", "step_p50_ms", "step_p90_ms"),
        *("wait_mean_ms", "step_mean_ms", "data_fraction", "samples_per_sec", "speedup_if_data_free", "verdict"),
        "gpu_util",
    ]
    all_warmup = summarize(wait_ms=[1.0], step_ms=[1.0], samples=[2], warmup=[1], gpu_util=[0.5], cpu_util=[0.5])
    assert all_warmup == {"steps": 1, "warmup_steps": 1, "measured_steps": 0, "verdict": None}


def test_the_slowest_rank_judges_a_ddp_run():
    """The rank with the longest mean wait gives the verdict; ranks without measurements are passed over."""
    ranks = [
        {"rank": 0, "wait_mean_ms": 10.0, "step_mean_ms": 90.0},
        {"rank": 1, "wait_mean_ms": None, "step_mean_ms": None},
        {"rank": 2, "wait_mean_ms": 40.0, "step_mean_ms": 60.0},
    ]
    assert judge_slowest_rank(ranks) == pytest.approx(
        {"judged_rank": 2, "data_fraction": 0.4, "speedup_if_data_free": 100.0 / 60.0, "verdict": "input-bound"}
    )
    assert judge_slowest_rank(ranks[1:2]) is None


# ----------------------------------------------------------------------------------------------------------------
# Advice
# ----------------------------------------------------------------------------------------------------------------


def _advice(
    loader: Any, *, cuda: bool = False, summary: dict[str, Any] | None = None, **trainer_kwargs: Any
) -> list[str]:
    """The advice for an input-bound run (``_SUMMARY``, updated by ``summary``) of one epoch's batches with the
    training loader ``loader``."""
    trainer = _mock_trainer(train_dataloader=loader, **trainer_kwargs)
    return advise(trainer, {**_SUMMARY, **(summary or {})}, cuda=cuda, epochs=[], wait_ms=[])


@pytest.mark.parametrize("judged", ["balanced", "compute-bound"])
def test_only_input_bound_runs_get_advice(judged):
    """A run that is not input-bound gets no advice, however its loader is set up."""
    trainer = _mock_trainer(train_dataloader=DataLoader(_in_memory(4)))
    assert advise(trainer, {**_SUMMARY, "verdict": judged}, cuda=True, epochs=[], wait_ms=[]) == []
    assert advise(trainer, dict(_SUMMARY), cuda=True, epochs=[], wait_ms=[])  # the same loader, input-bound


def test_image_folder_run_gets_convert_advice(image_folder):
    """A slow torchvision ImageFolder is input-bound and told to convert it once with the CLI."""
    dataset = ImageFolder(str(image_folder), transform=_to_tensor, loader=_slow_pil_loader)
    monitor = LoaderMonitor(warmup_epochs=1)
    _fit(monitor, dataset)
    assert monitor.summary["verdict"] == "input-bound"
    convert = [item for item in monitor.summary["advice"] if "lightning-fastdata convert" in item]
    assert len(convert) == 1
    assert convert[0].startswith("ImageFolder decodes full-size image files")


def test_convert_advice_sees_through_subset_and_skips_tensors(image_folder):
    """The convert advice finds an ImageFolder inside a Subset and is not given for in-memory tensors."""
    subset = Subset(ImageFolder(str(image_folder)), [0, 1, 2])
    assert any("lightning-fastdata convert" in item for item in _advice(DataLoader(subset)))
    assert not any("convert" in item for item in _advice(DataLoader(_in_memory(4))))


@pytest.mark.parametrize(
    ("cuda", "pin_memory", "advised"), [(True, False, True), (True, True, False), (False, False, False)]
)
def test_pin_memory_advice_only_on_cuda(cuda, pin_memory, advised):
    """`pin_memory=False` is flagged only when training runs on CUDA."""
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=1):
        advice = _advice(DataLoader(_in_memory(4), pin_memory=pin_memory), cuda=cuda)
    assert any("pin_memory" in item for item in advice) is advised


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(
    ("workers", "world_size", "expected"),
    [
        (4, 1, "num_workers=4 (worker processes) exceeds the budget of 2 (2 usable CPUs / 1 process(es)): they fight"),
        (1, 1, "num_workers=1 (worker processes) is below the budget of 2; raise it to 2"),
        (2, 2, "num_workers=2 (worker processes) exceeds the budget of 1 (2 usable CPUs / 2 process(es))"),
        (0, 2, "set num_workers=1 (the budget: 2 usable CPUs / 2 process(es) sharing them)"),
    ],
)
def test_worker_advice_against_the_cpu_budget(workers, world_size, expected):
    """The num_workers advice compares the loader with the usable CPUs shared by the processes on the node."""
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        advice = _advice(DataLoader(_in_memory(4), num_workers=workers), world_size=world_size)
    assert any(expected in item for item in advice), advice
    if workers > 2 // world_size:
        assert any(item.endswith(f"lower it to {max(1, 2 // world_size)}") for item in advice), advice


@pytest.mark.parametrize(
    ("threads", "expected", "not_expected"),
    [
        (1, "num_workers=1 (loader threads) is below the budget of 2; raise it to 2", "num_workers=0"),
        (4, "num_workers=4 (loader threads) exceeds the budget of 2", "num_workers=0"),
    ],
)
def test_worker_advice_counts_the_threads_of_a_threaded_loader(database, threads, expected, not_expected):
    """A FastLoader that builds batches on threads has ``num_workers=0``: the advice counts its threads instead."""
    loader = FastLoader(BatchReader(LmdbImageDataset(database)), batch_size=2, threads=threads)
    assert (loader.num_workers, loader.engine) == (0, "threads")
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        advice = _advice(loader)
    assert any(expected in item for item in advice), advice
    assert not any(not_expected in item or "persistent_workers" in item for item in advice), advice


def test_threads_at_the_budget_are_told_about_the_processes_engine(database):
    """Input-bound on CUDA with every budgeted thread busy: the GIL-free engine is the next thing to try; not on the
    CPU, where the threads are the faster engine (what `engine="auto"` picks there)."""
    loader = FastLoader(BatchReader(LmdbImageDataset(database)), batch_size=2, threads=4)
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=4):
        advice = _advice(loader, cuda=True)
        on_cpu = _advice(loader, cuda=False)
    assert loader.engine == "threads"
    assert any("engine='processes'" in item for item in advice), advice
    assert not any("num_workers=" in item for item in advice), advice
    assert not any("engine='processes'" in item for item in on_cpu), on_cpu


@pytest.mark.parametrize("judged", ["input-bound", "balanced"])
def test_cpu_training_on_worker_processes_is_not_told_to_switch_engines(database, judged):
    """Worker processes building into batch slots match the threads on a CPU: no advice to switch engines, in either
    direction, and a balanced run gets no advice at all."""
    loader = FastLoader(
        BatchReader(LmdbImageDataset(database)), batch_size=2, num_workers=2, persistent_workers=True, prefetch_factor=4
    )
    assert loader.engine == "processes"
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        on_cpu = _advice(loader, summary={"verdict": judged})
    assert not any("engine=" in item for item in on_cpu), on_cpu
    if judged == "balanced":
        assert on_cpu == []


@pytest.mark.parametrize("workers", [0, 1])
def test_cpu_training_on_busy_cpus_is_not_told_to_add_workers(workers):
    """On the CPU the loader and the model share the cores: when they are busy, more workers only take cores from the
    training step, so the advice is to make each sample cheaper; with idle cores, or on CUDA, the budget stands."""
    loader = DataLoader(_in_memory(4), num_workers=workers)
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        busy = _advice(loader, summary={"cpu_util": 0.98})
        idle = _advice(loader, summary={"cpu_util": 0.5})
        on_cuda = _advice(loader, cuda=True, summary={"cpu_util": 0.98})
    assert not any("set num_workers" in item or "raise it" in item for item in busy), busy
    assert any(
        item.startswith("training runs on the CPU and its 2 usable CPUs were 98% busy: the loader and the model")
        and "fewer or cheaper transforms, a smaller image size" in item
        for item in busy
    ), busy
    assert not any("look right" in item for item in busy), busy
    raise_it = "set num_workers=2" if workers == 0 else "raise it to 2"
    assert any(raise_it in item for item in idle), idle
    assert any(raise_it in item for item in on_cuda), on_cuda


def test_a_tuned_worker_count_is_kept(database):
    """A count that `num_workers="tune"` measured on this machine is not overruled by the budget."""
    datamodule = FastImageDataModule(str(database), num_workers="tune")
    datamodule.num_workers = 0  # the tuner's pick, as `prepare_data` or `resolved_num_workers` leave it
    loader = DataLoader(_in_memory(4))
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        tuned = _advice(loader, cuda=True, datamodule=datamodule, summary={"cpu_util": 0.5})
        busy = _advice(loader, datamodule=datamodule, summary={"cpu_util": 0.98})
    assert not any("set num_workers" in item for item in tuned + busy), tuned + busy
    assert any(item.startswith("num_workers=0 is the pick of num_workers='tune'") for item in tuned), tuned
    assert any("keep num_workers=0, the pick of num_workers='tune'" in item for item in busy), busy


def test_loader_at_the_budget_gets_the_fallback_advice():
    """A loader that already matches the budget is told the per-sample work itself is the cost."""
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        advice = _advice(DataLoader(_in_memory(4), num_workers=2, persistent_workers=True, prefetch_factor=4))
    assert len(advice) == 1
    assert advice[0].startswith("the loader settings look right for this machine")


def test_non_dataloader_gets_generic_advice():
    """A training loader that is not a torch DataLoader gets advice to time its fetch."""
    assert _advice([range(3)]) == [
        "the training dataloader is not a torch DataLoader; time its fetch to find the slow stage"
    ]


def test_epoch_restart_bursty_waits_and_idle_gpu_advice():
    """Slow epoch starts without persistent workers, bursty waits and a mostly idle GPU are each flagged."""
    epochs, wait_ms = [0, 0, 0, 1, 1, 1], [400.0, 10.0, 10.0, 300.0, 10.0, 10.0]
    trainer = _mock_trainer(train_dataloader=DataLoader(_in_memory(4), num_workers=2), max_epochs=3)
    summary = {
        "verdict": "input-bound",
        "wait_p50_ms": 10.0,
        "wait_p90_ms": 40.0,
        "data_fraction": 0.6,
        "gpu_util": 0.3,
    }
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        advice = advise(trainer, summary, cuda=False, epochs=epochs, wait_ms=wait_ms)
    assert any("300 ms wait while workers restart; set persistent_workers=True" in item for item in advice)
    assert any("prefetch_factor=2; raise prefetch_factor to 4" in item for item in advice)
    assert any("the GPU was 30% busy while 60% of the time" in item for item in advice)
    # one epoch only: no epoch restarts to judge
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=2):
        advice = advise(trainer, summary, cuda=False, epochs=[0] * 6, wait_ms=wait_ms)
    assert not any("persistent_workers" in item for item in advice)


# ----------------------------------------------------------------------------------------------------------------
# CUDA and NVML, on the CPU
# ----------------------------------------------------------------------------------------------------------------


class _FakeCuda:
    """A fake GPU (ms): ``now`` is the end of its queued work, ``done`` how far it has run; ``Event`` stands in for
    ``torch.cuda.Event``, a class as torch's is (a module imported while it stands in may use it as one)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done = 0.0
        self.synchronized = 0
        cuda = self

        class Event(_FakeEvent):
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                super().__init__(cuda)

        self.Event = Event


class _FakeEvent:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.cuda.now

    def query(self) -> bool:
        assert self.at is not None
        return self.cuda.done >= self.at

    def synchronize(self) -> None:
        assert self.at is not None
        self.cuda.synchronized += 1
        self.cuda.done = max(self.cuda.done, self.at)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None
        assert end.at is not None
        assert self.cuda.done >= end.at, "elapsed_time of an event that has not completed"
        return end.at - self.at


def _fake_nvml(util: dict[str, float], used: dict[str, float]) -> SimpleNamespace:
    """A fake NVML module: per-handle utilization (%) and memory used (bytes), read on each call."""
    return SimpleNamespace(
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=util[handle]),
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=used[handle]),
    )


def test_cuda_wait_and_step_come_from_completed_events_without_waiting_for_the_gpu():
    """On CUDA, wait and step are the events' GPU times, read once their events have completed: the monitor never
    makes the host wait for the GPU during an epoch (that would drain its queue), and synchronizes once at its end.

    The wait runs from the fetch's start to the transfer's end on the compute stream: a fetch that returns while the
    GPU still works through queued kernels (batch 1: 20 ms on the host, none on the GPU) is no stall. Logged every
    step, each interval reports the batches whose GPU work had completed by then.
    """
    trainer = _mock_trainer(log_every_n_steps=1)
    module = Mock(device=torch.device("cuda", 0), automatic_optimization=True)
    clock, cuda = _Clock(), _FakeCuda()
    nvml = _fake_nvml({"gpu0": 55.0}, {"gpu0": 3 * 2**30})
    monitor = LoaderMonitor(warmup_epochs=0, gpu_poll_interval=0.005)
    # (host wait, GPU wait, host step, GPU step), ms
    batches = [(5.0, 5.0, 30.0, 12.0), (20.0, 0.0, 30.0, 14.0), (8.0, 3.0, 30.0, 16.0)]
    logged: list[dict[str, Any]] = []  # the logging intervals'
    epoch_logged: list[dict[str, Any]] = []  # the end of the epoch's
    module.log_dict.side_effect = lambda metrics, **kwargs: (logged if kwargs["on_step"] else epoch_logged).append(
        dict(metrics)
    )
    with (
        patch("lightning_fastdata.cpus.CpuMeter"),
        patch(f"{USAGE}.nvml_handles", return_value=(nvml, ["gpu0"])) as handles,
        patch(PERF_COUNTER, side_effect=clock),
        patch(CUDA_EVENT, cuda.Event),
    ):
        monitor.on_train_start(trainer, module)
        handles.assert_called_once_with(0)
        assert monitor._cuda
        assert monitor._usage.gpu is not None
        monitor._usage.gpu.sample()  # at least one sample before the first interval, whatever the thread does
        monitor.on_train_epoch_start(trainer, module)
        previous_end = 0.0
        for index, (host_wait, gpu_wait, host_step, gpu_step) in enumerate(batches):
            batch = torch.zeros(2, 4)
            trainer.profiler.start(TRAIN_FETCH)
            clock.advance(host_wait)
            cuda.now += gpu_wait
            trainer.profiler.stop(TRAIN_FETCH)
            with trainer.profiler.profile(TRANSFER):
                cuda.now += 1.0  # the copy
            clock.advance(3.0)  # other callbacks' batch-start hooks
            cuda.now += 3.0
            monitor.on_train_batch_start(trainer, module, batch, index)
            with trainer.profiler.profile(TRAIN_STEP):
                clock.advance(host_step)
                cuda.now += gpu_step
                trainer.global_step = index + 1
            clock.advance(4.0)  # other callbacks' batch-end hooks
            cuda.now += 4.0
            cuda.done = previous_end  # the GPU is one batch behind the host: it has run the previous batch
            monitor.on_train_batch_end(trainer, module, None, batch, index)
            assert cuda.synchronized == 0  # never during the epoch
            previous_end = cuda.now
        monitor.on_train_epoch_end(trainer, module)
        assert cuda.synchronized == 1  # the rest is read at the end of the epoch
        monitor.on_train_end(trainer, module)
        assert cuda.synchronized == 1  # and nothing was left for the end of fit
        monitor.teardown(trainer, module, "fit")
    assert list(monitor.wait_ms) == pytest.approx([6.0, 1.0, 4.0])  # GPU wait + the 1 ms copy
    assert list(monitor.step_ms) == pytest.approx([12.0, 14.0, 16.0])
    assert "loader/step_ms" not in logged[0]  # batch 0's GPU work was still running at its own logging point
    assert (logged[1]["loader/data_wait_ms"], logged[1]["loader/step_ms"]) == pytest.approx((6.0, 12.0))
    assert (logged[2]["loader/data_wait_ms"], logged[2]["loader/step_ms"]) == pytest.approx((1.0, 14.0))
    assert all(metrics["loader/samples_per_sec"] > 0 for metrics in logged)
    # CPU tensors: a Python number logged from a CUDA module is copied to the GPU, a copy that waits for the queue
    assert {(type(v), v.device.type) for metrics in logged for v in metrics.values()} == {(torch.Tensor, "cpu")}
    assert logged[0]["loader/gpu_util"] == pytest.approx(0.55)
    assert logged[0]["loader/gpu_mem_gb"] == pytest.approx(3.0)
    # the epoch's figures, logged after the synchronize at its end: every batch's GPU times
    assert epoch_logged == [
        pytest.approx(
            {
                "loader/data_wait_ms_epoch": 11.0 / 3,
                "loader/step_ms_epoch": 14.0,
                "loader/data_fraction_epoch": 11.0 / 53.0,
                "loader/samples_per_sec_epoch": 6 / 0.053,
            }
        )
    ]
    assert not monitor._usage.gpu._thread.is_alive()


class _BusyGpuModel(_TinyModel):
    """``_TinyModel`` that queues about 100 ms of matrix products on the GPU per step, none of which it waits for."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        busy = torch.randn(4096, 4096, device=self.device)
        for _ in range(30):
            busy = torch.tanh(busy @ busy)
        return super().training_step(batch, batch_idx)


@pytest.mark.cuda
def test_cuda_fetch_overlapping_queued_gpu_work_is_no_wait():
    """On a real GPU, a 20 ms host fetch while the GPU still runs the last step's kernels is (almost) no wait."""
    monitor = LoaderMonitor(warmup_epochs=0, warmup_steps=2)
    _fit(monitor, _SlowDataset(16, delay=0.01), _BusyGpuModel(), max_epochs=1, accelerator="gpu")
    summary = monitor.summary
    assert summary["measured_steps"] == 6
    assert summary["step_p50_ms"] > 20.0  # the queued kernels are GPU step time
    assert summary["wait_p50_ms"] < 10.0, list(monitor.wait_ms)  # each host fetch took 20 ms


def test_gpu_sampler_averages_and_resets():
    """`take()` averages the samples over time and over GPUs, in GiB, then starts again from nothing."""
    util = {"a": 20.0, "b": 60.0}
    used = {"a": 1 * 2**30, "b": 3 * 2**30}
    sampler = GpuSampler(_fake_nvml(util, used), ["a", "b"], interval=1.0)
    assert sampler.take() is None
    sampler.sample()  # 40%, 2 GiB
    util["a"], used["a"] = 80.0, 5 * 2**30
    sampler.sample()  # 70%, 4 GiB
    assert sampler.take() == pytest.approx((55.0, 3.0))
    assert sampler.take() is None
    sampler.sample()
    assert sampler.take() == pytest.approx((70.0, 4.0))


def test_gpu_sampler_thread_survives_nvml_errors():
    """An NVML error in the polling thread ends the thread quietly instead of raising."""
    nvml = SimpleNamespace(nvmlDeviceGetUtilizationRates=Mock(side_effect=RuntimeError("gone")))
    sampler = GpuSampler(nvml, ["a"], interval=0.001)
    sampler.start()
    sampler._thread.join(timeout=5)
    assert not sampler._thread.is_alive()
    assert nvml.nvmlDeviceGetUtilizationRates.call_count == 1
    sampler.stop()
    assert sampler.take() is None


def test_nvml_handles_reports_why_nvml_is_unusable(monkeypatch):
    """`nvml_handles` returns a reason, not an exception, when NVML fails to start or is not installed."""
    with patch("pynvml.nvmlInit", side_effect=RuntimeError("driver not loaded")):
        reason = nvml_handles(0)
    assert isinstance(reason, str)
    assert "NVML is not usable here" in reason
    assert "driver not loaded" in reason
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert "pip install nvidia-ml-py" in nvml_handles(0)


def test_cpu_training_says_nothing_of_gpus_and_starts_no_sampler():
    """On a CPU module `on_train_start` says nothing about GPU utilization (no GPU to speak of) and polls nothing."""
    monitor = LoaderMonitor()
    with (
        patch(f"{CALLBACK}.rank_zero_info") as info,
        patch(f"{USAGE}.nvml_handles") as handles,
        patch(f"{USAGE}.GpuSampler") as sampler,
    ):
        monitor.on_train_start(_mock_trainer(), _cpu_module())
    info.assert_not_called()
    handles.assert_not_called()
    sampler.assert_not_called()
    assert monitor._usage.gpu is None
    assert not monitor._cuda


def test_cuda_without_nvml_logs_the_reason():
    """On CUDA without a usable NVML the reason is logged and training goes on without a sampler."""
    monitor = LoaderMonitor()
    with (
        patch(f"{CALLBACK}.rank_zero_info") as info,
        patch(f"{USAGE}.nvml_handles", return_value="NVML is not usable here (test)"),
        patch("lightning_fastdata.cpus.CpuMeter"),
    ):
        monitor.on_train_start(_mock_trainer(), Mock(device=torch.device("cuda", 1)))
    info.assert_called_once_with("LoaderMonitor: GPU utilization is not logged: NVML is not usable here (test).")
    assert monitor._cuda
    assert monitor._usage.gpu is None


def test_teardown_stops_the_nvml_thread_and_restores_the_profiler():
    """`teardown` (a fit that ends without `on_train_end`, say) stops the polling thread and unwraps the profiler."""
    monitor, trainer = LoaderMonitor(gpu_poll_interval=0.01), _mock_trainer()
    nvml = _fake_nvml({"gpu0": 50.0}, {"gpu0": 2**30})
    with (
        patch(f"{USAGE}.nvml_handles", return_value=(nvml, ["gpu0"])),
        patch("lightning_fastdata.cpus.CpuMeter"),
    ):
        monitor.on_train_start(trainer, Mock(device=torch.device("cuda", 0)))
    assert monitor._usage.gpu is not None
    assert monitor._usage.gpu._thread.is_alive()
    assert "start" in vars(trainer.profiler)
    monitor.teardown(trainer, Mock(), "fit")
    assert not monitor._usage.gpu._thread.is_alive()
    assert "start" not in vars(trainer.profiler)


# ----------------------------------------------------------------------------------------------------------------
# The profiler timing on its own (monitor.timing)
# ----------------------------------------------------------------------------------------------------------------


def test_loop_timer_gives_the_profiler_its_own_methods_back():
    """Wrapped once however often it is watched; unwatched, a profiler has exactly the methods it had."""
    own_start = Mock()
    profiler = PassThroughProfiler()
    profiler.start = own_start  # an instance attribute of its own, which must come back
    timer, clock = LoopTimer(), _Clock()
    with patch(PERF_COUNTER, side_effect=clock):
        timer.watch(profiler, cuda=False)
        timer.watch(profiler, cuda=False)  # already watched: not wrapped twice
        assert timer.watching
        _fetch(Mock(profiler=profiler), clock, 7.0)
    own_start.assert_any_call(TRAIN_FETCH)
    assert timer.take("train", "wait") == pytest.approx(7.0)
    assert timer.take("train", "wait") is None  # taken: nothing pending
    timer.unwatch()
    timer.unwatch()
    assert not timer.watching
    assert profiler.start is own_start
    assert "stop" not in vars(profiler)


def test_loop_timer_reads_only_completed_events_until_synchronized():
    """`read_events()` returns the GPU times of completed batches only (`query()`), oldest first; `synchronize`
    completes the rest with one `synchronize()`. A batch without a reported fetch has no GPU wait."""
    cuda, profiler, timer = _FakeCuda(), PassThroughProfiler(), LoopTimer()
    with patch(CUDA_EVENT, cuda.Event):
        timer.watch(profiler, cuda=True)
        for index, fetched in enumerate([True, True, False]):
            if fetched:
                with profiler.profile(TRAIN_FETCH):
                    cuda.now += 2.0 + index
                with profiler.profile(TRANSFER):
                    cuda.now += 1.0
            with profiler.profile(TRAIN_STEP):
                cuda.now += 10.0 + index
            timer.queue_events(index)
        timer.unwatch()
    cuda.done = 13.0  # batch 0 (3 ms wait, 10 ms step) has run; batch 1 has not
    assert timer.read_events() == [(0, pytest.approx(3.0), pytest.approx(10.0))]
    assert timer.first_unread() == 1
    assert timer.read_events() == []  # nothing new has completed, and the host did not wait
    assert cuda.synchronized == 0
    assert timer.read_events(synchronize=True) == [(1, 4.0, 11.0), (2, None, 12.0)]
    assert cuda.synchronized == 1
    assert timer.first_unread() is None
    assert timer.read_events(synchronize=True) == []
    assert cuda.synchronized == 1  # nothing queued: nothing to wait for


def test_loop_timer_queues_no_events_off_cuda():
    """Off CUDA a batch keeps its host times: no event is recorded or queued."""
    profiler, timer = PassThroughProfiler(), LoopTimer()
    made: list[Any] = []

    class Event:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(self)

    with patch(CUDA_EVENT, Event):
        timer.watch(profiler, cuda=False)
        with profiler.profile(TRAIN_STEP):
            pass
        timer.queue_events(0)
    assert not made
    assert timer.first_unread() is None
    assert timer.take("train", "step") is not None


# ----------------------------------------------------------------------------------------------------------------
# Loggers, validation, reports
# ----------------------------------------------------------------------------------------------------------------


def test_runs_without_a_logger():
    """With `logger=False` the monitor logs nothing and still produces a summary."""
    monitor = LoaderMonitor(warmup_epochs=0)
    trainer = _fit(monitor, _in_memory(8), max_epochs=1)
    assert trainer.loggers == []
    assert monitor.summary["steps"] == monitor.summary["measured_steps"] == 4
    assert monitor.summary["verdict"] in {"input-bound", "balanced", "compute-bound"}
    assert len(monitor.summary["ranks"]) == 1


def test_validation_timing_is_exact_and_sanity_checks_are_not_logged():
    """Validation wait (its fetch) and step follow the clock; a sanity-check run logs nothing."""
    trainer, module, clock = _mock_trainer(global_step=7), _cpu_module(), _Clock()
    monitor = LoaderMonitor()
    with (
        patch("lightning_fastdata.cpus.CpuMeter"),
        patch(PERF_COUNTER, side_effect=clock),
    ):
        monitor.on_train_start(trainer, module)
        for sanity in (True, False):
            trainer.sanity_checking = sanity
            monitor.on_validation_epoch_start(trainer, module)
            for index, (wait, step) in enumerate([(3.0, 7.0), (4.0, 9.0)]):
                _fetch(trainer, clock, wait, VAL_FETCH)
                clock.advance(50.0)  # other callbacks' validation hooks: neither wait nor step
                monitor.on_validation_batch_start(trainer, module, None, index)
                with trainer.profiler.profile(VAL_STEP):
                    clock.advance(step)
                clock.advance(50.0)
                monitor.on_validation_batch_end(trainer, module, None, None, index)
            monitor.on_validation_epoch_end(trainer, module)
            if sanity:
                module.log_dict.assert_not_called()
    module.log_dict.assert_called_once()
    assert module.log_dict.call_args.args[0] == pytest.approx(
        {"loader/val_data_wait_ms": 3.5, "loader/val_step_ms": 8.0}
    )
    assert module.log_dict.call_args.kwargs == {"on_step": False, "on_epoch": True, "sync_dist": True}
    assert not monitor.wait_ms  # validation batches are not training batches


def test_validation_batches_are_measured_but_not_sanity_checks():
    """In a real fit each validation run logs its wait and step; the sanity check's batches are not logged."""
    logger = Mock()
    model = _ValModel()
    monitor = LoaderMonitor(warmup_epochs=0)
    _fit(
        monitor,
        _in_memory(8),
        model,
        max_epochs=1,
        val_dataset=_in_memory(4),
        logger=logger,
        num_sanity_val_steps=2,
        val_check_interval=2,
    )
    assert model.val_batches == 2 + 2 * 2  # the sanity check ran, then validation after batches 2 and 4
    calls = [c.kwargs for c in logger.log_metrics.call_args_list]
    val_calls = [c for c in calls if "loader/val_step_ms" in c["metrics"]]
    assert len(val_calls) == 2  # one per validation run, none for the sanity check
    assert [c["step"] for c in val_calls] == [1, 3]  # Lightning's step for validation metrics
    for call in val_calls:
        metrics = call["metrics"]
        assert set(metrics) == {"loader/val_data_wait_ms", "loader/val_step_ms", "epoch"}
        assert metrics["loader/val_step_ms"] >= 20.0
        assert 0.0 <= metrics["loader/val_data_wait_ms"] < metrics["loader/val_step_ms"]
    train_calls = [c for c in calls if "loader/step_ms" in c["metrics"]]
    assert [c["step"] for c in train_calls] == [0, 1, 2, 3]  # log_every_n_steps=1
    # the 40 ms validation run after batch 2 is not counted as data wait of batch 3 (halfway: room for a loaded machine)
    assert monitor.wait_ms[2] < 20.0


def test_table_of_a_ddp_summary():
    """`format_table` lays out every measurement, the slowest rank, the verdict and the advice, in this order."""
    summary = {
        "steps": 10,
        "warmup_steps": 3,
        "measured_steps": 7,
        "wait_mean_ms": 10.0,
        "wait_p50_ms": 6.0,
        "wait_p90_ms": 49.0,
        "step_mean_ms": 20.0,
        "step_p50_ms": 10.0,
        "step_p90_ms": 10.44,
        "data_fraction": 0.8889,
        "samples_per_sec": 140.23,
        "speedup_if_data_free": 9.0,
        "verdict": "input-bound",
        "gpu_util": 0.42,
        "cpu_util": 0.41,
        "advice": ["first advice", "second advice"],
        "ranks": [
            {"rank": 0, "wait_mean_ms": 10.0, "step_mean_ms": 20.0},
            {"rank": 1, "wait_mean_ms": 40.0, "step_mean_ms": 5.0},
            {"rank": 2, "wait_mean_ms": None, "step_mean_ms": None},
        ],
        "judged_rank": 1,
    }
    with patch("lightning_fastdata.cpus.usable_cpu_count", return_value=4):
        table = format_table(summary, warmup_epochs=1, warmup_steps=0)
    assert table == "\n".join(
        [
            "LoaderMonitor summary",
            "  data wait mean / p50 / p90  10.0 / 6.0 / 49.0 ms",
            "  step mean / p50 / p90       20.0 / 10.0 / 10.4 ms",
            "  data fraction               88.9%",
            "  throughput                  140.2 samples/s",
            "  GPU utilization             42%",
            "  CPU utilization             41% of 4 usable CPUs",
            "  slowest rank (wait)         rank 1: 40.0 ms mean",
            "  spread across ranks         30.0 ms",
            "  verdict                     input-bound (rank 1, the slowest): 9.00x faster if data were free",
            "  measured                    7 batches (3 warmup batches left out)",
            "  - first advice",
            "  - second advice",
        ]
    )


def test_epoch_line():
    """The per-epoch line: mean wait and step, the data fraction they give, the verdict, the warmup."""
    line = epoch_line(3, [1.0, 2.0, 30.0], [10.0, 12.0, 20.0], warmup=False)
    assert line == (
        "LoaderMonitor epoch 3: data wait 11.0 ms, step 14.0 ms (means of 3 batches), data fraction 44%, input-bound"
    )
    assert epoch_line(0, [0.0], [10.0], warmup=True).endswith("0%, compute-bound (warmup: not in the verdict)")


#: the per-epoch line, its figures as groups: mean wait, mean step, data fraction (%) and verdict
EPOCH_LINE = re.compile(
    r"LoaderMonitor epoch (\d+): data wait ([\d.]+) ms, step ([\d.]+) ms \(means of \d+ batches\),"
    r" data fraction (\d+)%, ([a-z-]+)"
)


@pytest.mark.parametrize(
    ("waits", "steps"),
    [
        ([0.2, 0.2, 0.2, 39.8], [6.1] * 4),  # one slow fetch: wait p50 0.2 ms, yet 62% of the time is waiting
        ([3.0] * 4, [4.0, 4.0, 4.0, 200.0]),  # one slow step: the p50s would give 43% (input-bound), the means 5%
    ],
)
def test_epoch_line_figures_agree_with_its_verdict(waits, steps):
    """Where p50 and mean differ a lot, the epoch line prints the wait and step its data fraction and verdict use."""
    monitor = LoaderMonitor(warmup_epochs=0, verbose=False)
    info = _run_epochs(monitor, _mock_trainer(), _cpu_module(), {0: list(zip(waits, steps, strict=True))})
    line = info.call_args_list[-1].args[0]
    found = EPOCH_LINE.fullmatch(line)
    assert found, line
    wait, step, percent, judged = float(found[2]), float(found[3]), int(found[4]), found[5]
    assert (wait, step) == pytest.approx((np.mean(waits), np.mean(steps)), abs=0.05)
    assert abs(percent - 100 * wait / (wait + step)) <= 1.0  # the printed fraction is the printed figures'
    assert judged == verdict(wait / (wait + step)) == monitor.summary["verdict"]


def test_report_json_and_chart(tmp_path):
    """`report_dir` gets the summary and one series entry per training batch, and a PNG chart."""
    monitor = LoaderMonitor(warmup_epochs=1, report_dir=tmp_path / "report")
    _fit(monitor, _in_memory(6))
    report = json.loads((tmp_path / "report" / "loader_report.json").read_text())
    assert report["summary"] == json.loads(json.dumps(monitor.summary))
    assert report["summary"]["measured_steps"] == 3
    series = report["series"]
    assert set(series) == {"data_wait_ms", "step_ms", "samples", "epoch", "warmup"}
    assert all(len(values) == 6 for values in series.values())
    assert series["warmup"] == [True] * 3 + [False] * 3
    assert series["epoch"] == [0, 0, 0, 1, 1, 1]
    assert series["samples"] == [2] * 6
    assert series["step_ms"] == pytest.approx(list(monitor.step_ms))
    png = tmp_path / "report" / "loader_report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    """Without matplotlib the JSON is still written, no chart, and one message says what to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monitor = LoaderMonitor(warmup_epochs=0, report_dir=tmp_path)
    with patch("lightning_fastdata.monitor.report.rank_zero_info") as info:
        _fit(monitor, _in_memory(4), max_epochs=1)
    assert (tmp_path / "loader_report.json").is_file()
    assert not (tmp_path / "loader_report.png").exists()
    messages = [c.args[0] for c in info.call_args_list if "matplotlib" in c.args[0]]
    assert len(messages) == 1
    assert "no chart written" in messages[0]
    assert "pip install matplotlib" in messages[0]


# ----------------------------------------------------------------------------------------------------------------
# Real fits: only the loader's time is data wait; epoch skips; failed fits; metric rows
# ----------------------------------------------------------------------------------------------------------------


class _SlowHooks(Callback):
    """Sleeps ``seconds`` in the hooks around batches that other callbacks use (progress bars, checkpoints)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, *args: Any) -> None:
        time.sleep(self.seconds)

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)

    def on_validation_end(self, *args: Any) -> None:  # where ModelCheckpoint saves after mid-epoch validation
        time.sleep(self.seconds)


class _SkippingModel(_ValModel):
    """``_ValModel`` with a 40 ms step that skips the rest of epoch 1 at its batch ``skip_at``."""

    def __init__(self, skip_at: int | None) -> None:
        super().__init__()
        self.step_sleep = 0.04
        self.skip_at = skip_at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 1 and batch_idx == self.skip_at else None


def test_epoch_skip_from_on_train_batch_start_is_left_out():
    """A batch skipped by `on_train_batch_start` returning -1 (the rest of its epoch too) is not recorded."""
    monitor = LoaderMonitor(warmup_epochs=0)
    _fit(monitor, _in_memory(8), _SkippingModel(skip_at=1))
    assert list(monitor.epochs) == [0, 0, 0, 0, 1]
    assert len(monitor.wait_ms) == len(monitor.step_ms) == len(monitor.samples) == len(monitor.warmup) == 5
    assert monitor.summary["steps"] == monitor.summary["measured_steps"] == 5


@pytest.mark.parametrize("skip", [False, True], ids=["full-epochs", "epoch-skip"])
@pytest.mark.parametrize("position", ["first", "last"])
def test_other_callbacks_are_not_data_wait(position, skip):
    """Free data and 100 ms callbacks around every batch and after validation: not input-bound, waits far below.

    Wherever the monitor sits, with mid-epoch validation, gradient accumulation, and with or without an epoch skip.
    """
    monitor, slow = LoaderMonitor(warmup_epochs=0), _SlowHooks(0.1)
    model = _SkippingModel(skip_at=3 if skip else None)
    callbacks = [monitor, slow] if position == "first" else [slow, monitor]
    _fit(
        monitor,
        _in_memory(8),
        model,
        val_dataset=_in_memory(4),
        callbacks=callbacks,
        val_check_interval=2,
        accumulate_grad_batches=2,
    )
    assert model.val_batches == 4 * 2 if not skip else 3 * 2  # validation every 2 batches (not after a skip)
    assert len(monitor.step_ms) == (4 + 4 if not skip else 4 + 3)
    summary = monitor.summary
    # the bounds lie halfway to what counting the callbacks' 100 ms would give: 50 ms of room for a loaded machine
    assert 40.0 <= summary["step_p50_ms"] < 90.0  # the model's 40 ms; 140 ms or more if a callback counted
    assert summary["wait_p50_ms"] < 50.0, list(monitor.wait_ms)  # 100 ms or more if a callback counted
    assert summary["verdict"] != "input-bound"  # it would take a mean wait above 10 ms


def test_nvml_thread_stops_when_the_fit_raises():
    """A fit that raises calls `on_exception` (not `teardown`): the NVML polling thread stops there."""

    class _FailingCudaModel(_TinyModel):
        @property
        def device(self) -> torch.device:  # looks like CUDA to the monitor; runs on the CPU
            return torch.device("cuda", 0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("step failed")

    monitor, profiler = LoaderMonitor(gpu_poll_interval=0.01), PassThroughProfiler()
    nvml = _fake_nvml({"gpu0": 50.0}, {"gpu0": 2**30})
    with (
        patch(f"{USAGE}.nvml_handles", return_value=(nvml, ["gpu0"])),
        patch(CUDA_EVENT, _FakeCuda().Event),
        pytest.raises(RuntimeError, match="step failed"),
    ):
        _fit(monitor, _in_memory(4), _FailingCudaModel(), profiler=profiler)
    assert monitor._usage.gpu is not None
    assert not monitor._usage.gpu._thread.is_alive()
    assert "start" not in vars(profiler)  # the profiler has its own methods back


class _LoggingModel(_TinyModel):
    """``_TinyModel`` that logs its loss with ``self.log`` at every step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize(("accumulate", "steps"), [(1, [4, 9, 14]), (2, [4])])
def test_metrics_share_the_models_rows_and_steps(tmp_path, accumulate, steps):
    """In the CSV, loader metrics are in the rows of the model's `self.log` metrics, at its steps; utilizations 0-1."""
    monitor = LoaderMonitor(warmup_epochs=0)
    logger = CSVLogger(tmp_path, name="run", version=0)
    _fit(
        monitor,
        _in_memory(30),
        _LoggingModel(),
        max_epochs=1,
        logger=logger,
        log_every_n_steps=5,
        accumulate_grad_batches=accumulate,
    )
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    loader_rows = [row for row in rows if row["loader/data_wait_ms"]]
    assert [int(row["step"]) for row in loader_rows] == steps
    assert all(row["train_loss"] for row in loader_rows)  # the same row as the model's metric
    epoch_rows = [row for row in rows if row["loader/data_wait_ms_epoch"]]
    assert len(epoch_rows) == 1  # the end of the epoch's row, where Lightning writes every epoch-level metric
    assert {int(row["step"]) for row in rows} == {*steps, int(epoch_rows[0]["step"])}  # no row of the monitor's own
    for row in loader_rows:
        assert 0.0 <= float(row["loader/cpu_util"]) <= 1.0
        assert 0.0 <= float(row["loader/data_fraction"]) <= 1.0


def test_a_run_shorter_than_log_every_n_steps_logs_each_epochs_figures(tmp_path):
    """Two 3-step epochs with `log_every_n_steps=50` end with each epoch's loader figures in metrics.csv."""
    monitor = LoaderMonitor(warmup_epochs=0)
    logger = CSVLogger(tmp_path, name="run", version=0)
    _fit(monitor, _in_memory(6), max_epochs=2, logger=logger, log_every_n_steps=50)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(int(row["epoch"]), int(row["step"])) for row in rows] == [(0, 2), (1, 5)]
    assert "loader/data_wait_ms" not in rows[0]  # no logging interval came to its end
    for row, first in zip(rows, (0, 3), strict=True):
        wait, step = monitor.wait_ms[first : first + 3], monitor.step_ms[first : first + 3]
        assert float(row["loader/data_wait_ms_epoch"]) == pytest.approx(np.mean(wait), rel=1e-5)
        assert float(row["loader/step_ms_epoch"]) == pytest.approx(np.mean(step), rel=1e-5)
        assert float(row["loader/data_fraction_epoch"]) == pytest.approx(sum(wait) / (sum(wait) + sum(step)), rel=1e-5)
        assert float(row["loader/samples_per_sec_epoch"]) == pytest.approx(6000.0 / (sum(wait) + sum(step)), rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Agreement with Lightning's profiler, and DDP
# ----------------------------------------------------------------------------------------------------------------


def test_data_wait_agrees_with_simple_profiler():
    """The total data wait matches SimpleProfiler's dataloader fetch plus batch transfer within 15%.

    40 ms per batch: the two differ by Lightning's own code between their clocks, which a loaded machine slows
    down, and 15% of 40 ms leaves it 6 ms per batch.
    """
    monitor = LoaderMonitor(warmup_epochs=0)
    profiler = SimpleProfiler()
    _fit(monitor, _SlowDataset(60, delay=0.02), max_epochs=1, profiler=profiler)
    durations = profiler.recorded_durations
    fetch = [key for key in durations if key.endswith("].train_dataloader_next")]
    transfer = [key for key in durations if key.startswith("[Strategy]") and key.endswith(".batch_to_device")]
    assert len(fetch) == len(transfer) == 1, sorted(durations)
    assert len(durations[fetch[0]]) == len(durations[transfer[0]]) == len(monitor.wait_ms) == 30
    profiled_ms = 1000.0 * (sum(durations[fetch[0]]) + sum(durations[transfer[0]]))
    assert profiled_ms > 30 * 40.0  # 2 samples x 20 ms per batch
    assert sum(monitor.wait_ms) == pytest.approx(profiled_ms, rel=0.15)


@pytest.mark.slow
def test_ddp_summary_names_the_slowest_rank(tmp_path):
    """Under 2-process DDP on the CPU, every rank's wait is gathered and the slow-loading rank 1 is named."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    ranks = rank0["summary"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks == rank1["summary"]["ranks"]  # the same gathered values on every rank
    assert ranks[1]["wait_mean_ms"] > ranks[0]["wait_mean_ms"] + 30.0  # rank 1 sleeps 2 x 30 ms per batch
    assert ranks[0]["wait_mean_ms"] == pytest.approx(rank0["summary"]["wait_mean_ms"])
    assert ranks[1]["wait_mean_ms"] == pytest.approx(rank1["summary"]["wait_mean_ms"])
    table = rank0["table"]
    assert f"rank 1: {ranks[1]['wait_mean_ms']:.1f} ms mean" in table
    spread = ranks[1]["wait_mean_ms"] - ranks[0]["wait_mean_ms"]
    spread_line = next(line for line in table.splitlines() if "spread across ranks" in line)
    assert spread_line.endswith(f" {spread:.1f} ms")
    # the verdict is rank 1's, the rank everyone waits for, not rank 0's sync-inflated step time
    wait1, step1 = ranks[1]["wait_mean_ms"], ranks[1]["step_mean_ms"]
    assert rank0["summary"]["judged_rank"] == 1
    assert rank0["summary"]["data_fraction"] == pytest.approx(wait1 / (wait1 + step1))
    assert rank0["summary"]["speedup_if_data_free"] == pytest.approx((wait1 + step1) / step1)
    assert "(rank 1, the slowest)" in table


def test_format_table_without_any_batch_says_so():
    """A fit that ran no training batch gets a one-line table that says there is nothing to judge."""
    monitor = LoaderMonitor()
    monitor.summary = {"steps": 0, "warmup_steps": 0, "measured_steps": 0, "verdict": None}
    assert monitor.format_table() == "LoaderMonitor: no training batches were run: nothing to judge."


# ----------------------------------------------------------------------------------------------------------------
# Printing through the progress bar
# ----------------------------------------------------------------------------------------------------------------


def _screen(written: str) -> list[str]:
    """The lines a terminal shows once ``written`` was written to it.

    ``\\r`` goes back to the start of the line and ``\\n`` down to the next one; of the escape sequences, cursor up
    (``ESC[nA``) and erase line (``ESC[2K``) act, colours and the rest are dropped.
    """
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", written):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
            elif token == "\x1b[2K":
                lines[row] = ""
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    return [line.rstrip() for line in lines]


def _fit_with_bar(bar: ProgressBar, *, bar_first: bool = False) -> list[str]:
    """A 2-epoch fit with validation, shown by ``bar``; returns the lines a terminal shows.

    The terminal gets stdout, stderr and Lightning's log messages (``rank_zero_info``'s logger, which does not
    propagate to the root logger), in the order they are written.
    """
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    monitor = LoaderMonitor(warmup_epochs=0)
    try:
        with contextlib.redirect_stdout(written), contextlib.redirect_stderr(written):
            _fit(
                monitor,
                _in_memory(6),
                _ValModel(),
                val_dataset=_in_memory(4),
                callbacks=[bar, monitor] if bar_first else [monitor, bar],
                enable_progress_bar=True,
            )
    finally:
        logger.removeHandler(handler)
    return _screen(written.getvalue())


def _assert_own_lines(screen: list[str]) -> None:
    """The monitor's two epoch lines and its table each start a line, and nothing is glued after them."""
    lines = [line for line in screen if "LoaderMonitor" in line]
    epochs = [line for line in lines if "epoch" in line]
    assert [EPOCH_LINE.fullmatch(line)[1] for line in epochs] == ["0", "1"], lines  # type: ignore[index]
    assert lines[-1] == "LoaderMonitor summary"
    assert len(lines) == 3, lines


@pytest.mark.parametrize(
    ("leave", "bar_first"),
    [(False, False), (True, True)],  # with leave=True a bar whose hooks run first has closed before the monitor's
)
def test_monitor_lines_start_a_line_of_their_own_under_tqdm(leave, bar_first):
    """Under tqdm the monitor's lines are not glued onto the bar, which is still there."""
    screen = _fit_with_bar(TQDMProgressBar(leave=leave), bar_first=bar_first)
    _assert_own_lines(screen)
    assert any(line.startswith("Epoch 1: 100%") for line in screen)


def test_monitor_lines_start_a_line_of_their_own_under_rich(monkeypatch):
    """Under Rich the monitor's lines are printed above the live bar, not after a stale copy of it."""
    rich = pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress import rich_progress

    monkeypatch.setattr(rich, "_console", None)  # RichProgressBar reconfigures rich's global console: a new one
    # Lightning's refresh thread redraws the live bar at its own times; racing the validation bar's removal, it left
    # Rich one line too tall about 1 fit in 40, so the next print cleared the line above the bar. The redraws the
    # hooks ask for are enough to place each line, and make the screen the same on every run.
    if hasattr(rich_progress, "_RefreshThread"):
        monkeypatch.setattr(rich_progress._RefreshThread, "run", lambda self: None)
    screen = _fit_with_bar(RichProgressBar(console_kwargs={"force_terminal": True, "width": 120}))
    _assert_own_lines(screen)
    assert any(line.startswith("Epoch 1/1") for line in screen)


class _RecordingBar(ProgressBar):
    """A progress bar of one's own: it keeps what it is asked to print."""

    def __init__(self) -> None:
        super().__init__()
        self.printed: list[str] = []

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.printed.append(" ".join(map(str, args)))


def test_monitor_prints_through_the_trainers_progress_bar_and_logs_without_one():
    """Every line goes to `trainer.progress_bar_callback.print`, none to the log; without a bar, all to the log."""
    bar, monitor = _RecordingBar(), LoaderMonitor(warmup_epochs=0)
    with patch(f"{CALLBACK}.rank_zero_info") as info:
        _fit(monitor, _in_memory(6), callbacks=[monitor, bar], enable_progress_bar=True)
    info.assert_not_called()
    assert len(bar.printed) == 3
    assert EPOCH_LINE.fullmatch(bar.printed[0])
    assert bar.printed[-1] == monitor.format_table()
    monitor = LoaderMonitor(warmup_epochs=0)
    with patch(f"{CALLBACK}.rank_zero_info") as info:
        _fit(monitor, _in_memory(6))  # enable_progress_bar=False: no bar
    logged = [c.args[0] for c in info.call_args_list]
    assert [EPOCH_LINE.fullmatch(line)[1] for line in logged[:2]] == ["0", "1"]  # type: ignore[index]
    assert logged[2:] == [monitor.format_table()]


def test_a_fit_shorter_than_log_every_n_steps_keeps_its_cpu_row():
    """A fit of 6 steps with `log_every_n_steps=50` logs no interval, yet the summary measures its CPU use over the
    whole fit and the end table has its CPU row."""
    monitor = LoaderMonitor(warmup_epochs=0, verbose=False)
    _fit(monitor, _in_memory(6), log_every_n_steps=50)
    assert len(monitor.cpu_util) == 1
    assert 0.0 <= monitor.summary["cpu_util"] <= 1.0
    assert "CPU utilization" in monitor.format_table()
