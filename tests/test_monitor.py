"""Tests for ``LoaderMonitor``: timing, warmup, verdicts, advice, the CUDA/NVML paths, reports and DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import Mock, patch

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.profilers import SimpleProfiler
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader

from lightning_fastdata import LoaderMonitor
from lightning_fastdata.monitor import _batch_size, _GpuSampler, _nvml_handles, _verdict

DDP_SCRIPT = Path(__file__).with_name("monitor_ddp_script.py")

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")

#: the advice summary fields ``_advice`` reads
_SUMMARY = {"wait_p50_ms": 10.0, "wait_p90_ms": 12.0, "data_fraction": 0.5}

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


def _mock_trainer(**kwargs: Any) -> Mock:
    """A Mock trainer with the attributes the monitor reads."""
    defaults = {
        "current_epoch": 0,
        "log_every_n_steps": 50,
        "loggers": [Mock()],
        "global_step": 0,
        "world_size": 1,
        "num_nodes": 1,
        "is_global_zero": True,
        "max_epochs": 2,
    }
    return Mock(**{**defaults, **kwargs})


def _cpu_module() -> Mock:
    return Mock(device=torch.device("cpu"))


def _drive(
    monitor: LoaderMonitor, trainer: Mock, module: Mock, clock: _Clock, batches: list[tuple[float, float]]
) -> None:
    """Run training batches through the hooks: each ``(wait_ms, step_ms)`` on the fake clock."""
    for wait, step in batches:
        batch = (torch.zeros(2, 4), torch.zeros(2))
        clock.advance(wait)
        monitor.on_train_batch_start(trainer, module, batch, 0)
        clock.advance(step)
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, module, None, batch, 0)


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
    """``_TinyModel`` with a validation step that takes 5 ms and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.val_batches = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_batches += 1
        time.sleep(0.005)


def _fit(
    monitor: LoaderMonitor,
    dataset: Dataset,
    model: LightningModule | None = None,
    *,
    max_epochs: int = 2,
    batch_size: int = 2,
    val_dataset: Dataset | None = None,
    **kwargs: Any,
) -> Trainer:
    """Fit a tiny model on ``dataset`` with ``monitor`` on the CPU (no workers) and return the Trainer."""
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
    trainer = Trainer(callbacks=[monitor], **options)
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
    """Waits, steps and the metrics logged at the `log_every_n_steps` boundary follow the clock exactly."""
    logger = Mock()
    trainer = _mock_trainer(log_every_n_steps=2, loggers=[logger])
    module = _cpu_module()
    monitor = LoaderMonitor(warmup_epochs=0)
    times = [
        100.000,  # epoch start
        100.010,  # batch 0 start: 10 ms wait
        100.040,  # batch 0 end: 30 ms step
        100.041,  # mark
        100.061,  # batch 1 start: 20 ms wait
        100.111,  # batch 1 end: 50 ms step
        100.112,  # interval logged: 112 ms since the epoch start
        100.113,  # mark
        100.118,  # batch 2 start: 5 ms wait
        100.125,  # batch 2 end: 7 ms step
        100.126,  # mark
    ]
    batches = [
        (torch.zeros(4, 3), torch.zeros(4)),
        {"image": torch.zeros(4, 3), "label": torch.zeros(4)},
        [{"image": torch.zeros(6, 3)}],
    ]
    cpu = Mock(take=Mock(return_value=37.5))
    with (
        patch("lightning_fastdata.monitor.CpuMeter", return_value=cpu),
        patch("lightning_fastdata.monitor.time.perf_counter", side_effect=times) as perf_counter,
    ):
        monitor.on_train_start(trainer, module)
        monitor.on_train_epoch_start(trainer, module)
        for index, batch in enumerate(batches):
            monitor.on_train_batch_start(trainer, module, batch, index)
            trainer.global_step = index + 1
            monitor.on_train_batch_end(trainer, module, None, batch, index)
            if index == 0:
                logger.log_metrics.assert_not_called()  # not a boundary yet
            if index == 1:
                logger.log_metrics.assert_called_once()
    assert perf_counter.call_count == len(times)
    assert list(monitor.wait_ms) == pytest.approx([10.0, 20.0, 5.0])
    assert list(monitor.step_ms) == pytest.approx([30.0, 50.0, 7.0])
    assert list(monitor.samples) == [4, 4, 6]
    assert list(monitor.warmup) == [0, 0, 0]
    logger.log_metrics.assert_called_once()  # batch 2 is not a boundary
    metrics, kwargs = logger.log_metrics.call_args.args[0], logger.log_metrics.call_args.kwargs
    assert kwargs == {"step": 2}
    assert metrics == pytest.approx(
        {
            "loader/data_wait_ms": 15.0,
            "loader/step_ms": 40.0,
            "loader/data_fraction": 15.0 / 55.0,
            "loader/samples_per_sec": 8 / 0.112,
            "loader/cpu_util": 37.5,
        }
    )


def test_batch_size_fn_overrides_the_batch_search():
    """`batch_size_fn` counts the samples of a batch whose first tensor is not the batch."""
    trainer, module = _mock_trainer(), _cpu_module()
    monitor = LoaderMonitor(batch_size_fn=lambda batch: batch["n"])
    with patch("lightning_fastdata.monitor.CpuMeter"):
        monitor.on_train_start(trainer, module)
    monitor.on_train_epoch_start(trainer, module)
    batch = {"n": 5, "mask": torch.zeros(1, 3)}
    monitor.on_train_batch_start(trainer, module, batch, 0)
    monitor.on_train_batch_end(trainer, module, None, batch, 0)
    assert list(monitor.samples) == [5]


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
    assert _batch_size(batch) == expected


# ----------------------------------------------------------------------------------------------------------------
# Warmup
# ----------------------------------------------------------------------------------------------------------------


def test_warmup_epoch_is_left_out_of_the_summary():
    """With `warmup_epochs=1` the first epoch's (slow) batches are flagged and do not reach the percentiles."""
    trainer, module, clock = _mock_trainer(), _cpu_module(), _Clock()
    monitor = LoaderMonitor(warmup_epochs=1)
    with (
        patch("lightning_fastdata.monitor.CpuMeter"),
        patch("lightning_fastdata.monitor.time.perf_counter", side_effect=clock),
    ):
        monitor.on_train_start(trainer, module)
        for epoch, (wait, step) in enumerate([(500.0, 10.0), (0.1, 10.0)]):
            trainer.current_epoch = epoch
            monitor.on_train_epoch_start(trainer, module)
            _drive(monitor, trainer, module, clock, [(wait, step)] * 3)
            monitor.on_train_epoch_end(trainer, module)
        monitor.on_train_end(trainer, module)
    assert list(monitor.warmup) == [1, 1, 1, 0, 0, 0]
    assert list(monitor.epochs) == [0, 0, 0, 1, 1, 1]
    summary = monitor.summary
    assert (summary["steps"], summary["warmup_steps"], summary["measured_steps"]) == (6, 3, 3)
    assert summary["wait_p50_ms"] == pytest.approx(0.1)
    assert summary["wait_p90_ms"] == pytest.approx(0.1)
    assert summary["verdict"] == "compute-bound"  # the 500 ms warmup waits would make it input-bound
    assert summary["advice"] == []
    assert summary["ranks"] == [{"rank": 0, "wait_mean_ms": pytest.approx(0.1), "step_mean_ms": pytest.approx(10.0)}]


def test_warmup_steps_leave_out_the_first_batches():
    """`warmup_steps=2` flags the first two batches of the run, whatever the epoch."""
    trainer, module, clock = _mock_trainer(), _cpu_module(), _Clock()
    monitor = LoaderMonitor(warmup_epochs=0, warmup_steps=2)
    with (
        patch("lightning_fastdata.monitor.CpuMeter"),
        patch("lightning_fastdata.monitor.time.perf_counter", side_effect=clock),
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
    with patch("lightning_fastdata.monitor.usable_cpu_count", return_value=3):
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
    # 80 ms steps: Lightning's own few-ms gap between batches (more on a loaded machine) stays far below 5%
    _fit(monitor, _in_memory(16), _TinyModel(step_sleep=0.08))
    summary = monitor.summary
    assert summary["measured_steps"] == 8
    assert summary["verdict"] == "compute-bound"
    assert summary["step_p50_ms"] >= 80.0
    assert summary["speedup_if_data_free"] < 1.05
    assert summary["advice"] == []
    assert "compute-bound" in monitor.format_table()


@pytest.mark.parametrize(
    ("fraction", "verdict"),
    [(0.9, "input-bound"), (0.21, "input-bound"), (0.2, "balanced"), (0.05, "balanced"), (0.049, "compute-bound")],
)
def test_verdict_thresholds(fraction, verdict):
    """More than 20% of the time waiting is input-bound, less than 5% compute-bound, balanced between."""
    assert _verdict(fraction) == verdict


# ----------------------------------------------------------------------------------------------------------------
# Advice
# ----------------------------------------------------------------------------------------------------------------


def _advice(loader: Any, *, cuda: bool = False, **trainer_kwargs: Any) -> list[str]:
    monitor = LoaderMonitor()
    monitor._cuda = cuda
    trainer = _mock_trainer(train_dataloader=loader, **trainer_kwargs)
    return monitor._advice(trainer, dict(_SUMMARY))


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
    with patch("lightning_fastdata.monitor.usable_cpu_count", return_value=1):
        advice = _advice(DataLoader(_in_memory(4), pin_memory=pin_memory), cuda=cuda)
    assert any("pin_memory" in item for item in advice) is advised


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(
    ("workers", "world_size", "expected"),
    [
        (4, 1, "num_workers=4 exceeds the budget of 2 (2 usable CPUs / 1 process(es)): workers fight over cores"),
        (1, 1, "num_workers=1 is below the budget of 2; raise it to 2"),
        (2, 2, "num_workers=2 exceeds the budget of 1 (2 usable CPUs / 2 process(es))"),
        (0, 2, "set num_workers=1 (the budget: 2 usable CPUs / 2 process(es) on this node)"),
    ],
)
def test_worker_advice_against_the_cpu_budget(workers, world_size, expected):
    """The num_workers advice compares the loader with the usable CPUs shared by the processes on the node."""
    with patch("lightning_fastdata.monitor.usable_cpu_count", return_value=2):
        advice = _advice(DataLoader(_in_memory(4), num_workers=workers), world_size=world_size)
    assert any(expected in item for item in advice), advice
    if workers > 2 // world_size:
        assert any(item.endswith(f"lower it to {max(1, 2 // world_size)}") for item in advice), advice


def test_loader_at_the_budget_gets_the_fallback_advice():
    """A loader that already matches the budget is told the per-sample work itself is the cost."""
    with patch("lightning_fastdata.monitor.usable_cpu_count", return_value=2):
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
    monitor = LoaderMonitor()
    monitor.epochs.extend([0, 0, 0, 1, 1, 1])
    monitor.wait_ms.extend([400.0, 10.0, 10.0, 300.0, 10.0, 10.0])
    trainer = _mock_trainer(train_dataloader=DataLoader(_in_memory(4), num_workers=2), max_epochs=3)
    summary = {"wait_p50_ms": 10.0, "wait_p90_ms": 40.0, "data_fraction": 0.6, "gpu_util": 30.0}
    with patch("lightning_fastdata.monitor.usable_cpu_count", return_value=2):
        advice = monitor._advice(trainer, summary)
    assert any("300 ms wait while workers restart; set persistent_workers=True" in item for item in advice)
    assert any("prefetch_factor=2; raise prefetch_factor to 4" in item for item in advice)
    assert any("the GPU was 30% busy while 60% of the time" in item for item in advice)


# ----------------------------------------------------------------------------------------------------------------
# CUDA and NVML, on the CPU
# ----------------------------------------------------------------------------------------------------------------


class _FakeCuda:
    """A fake GPU clock (ms) whose ``event()`` stands in for ``torch.cuda.Event``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.synchronized = 0

    def event(self, enable_timing: bool = False) -> _FakeEvent:
        assert enable_timing
        return _FakeEvent(self)


class _FakeEvent:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.cuda.now

    def synchronize(self) -> None:
        self.cuda.synchronized += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.at is not None
        assert end.at is not None
        return end.at - self.at


def _fake_nvml(util: dict[str, float], used: dict[str, float]) -> SimpleNamespace:
    """A fake NVML module: per-handle utilization (%) and memory used (bytes), read on each call."""
    return SimpleNamespace(
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=util[handle]),
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=used[handle]),
    )


def test_cuda_steps_come_from_events_synchronized_once_per_interval():
    """On CUDA the step times are the events' elapsed times, read with one synchronize per logging interval."""
    logger = Mock()
    trainer = _mock_trainer(log_every_n_steps=2, loggers=[logger])
    module = Mock(device=torch.device("cuda", 0))
    clock, cuda = _Clock(), _FakeCuda()
    nvml = _fake_nvml({"gpu0": 55.0}, {"gpu0": 3 * 2**30})
    monitor = LoaderMonitor(warmup_epochs=0, gpu_poll_interval=0.005)
    host_and_gpu_steps = [(30.0, 12.0), (30.0, 14.0), (30.0, 16.0)]
    with (
        patch("lightning_fastdata.monitor.CpuMeter"),
        patch("lightning_fastdata.monitor._nvml_handles", return_value=(nvml, ["gpu0"])) as handles,
        patch("lightning_fastdata.monitor.time.perf_counter", side_effect=clock),
        patch("lightning_fastdata.monitor.torch.cuda.Event", side_effect=cuda.event),
    ):
        monitor.on_train_start(trainer, module)
        handles.assert_called_once_with(0)
        assert monitor._cuda
        assert monitor._gpu is not None
        monitor._gpu.sample()  # at least one sample before the first interval, whatever the thread does
        monitor.on_train_epoch_start(trainer, module)
        for index, (host, gpu) in enumerate(host_and_gpu_steps):
            batch = torch.zeros(2, 4)
            clock.advance(1.0)
            cuda.now += 1.0
            monitor.on_train_batch_start(trainer, module, batch, index)
            clock.advance(host)
            cuda.now += gpu
            monitor.on_train_batch_end(trainer, module, None, batch, index)
            if index == 0:
                assert cuda.synchronized == 0  # no synchronize per step
                assert monitor.step_ms[0] == pytest.approx(30.0)  # host time until the interval is read
            if index == 1:
                assert cuda.synchronized == 1
        monitor.on_train_epoch_end(trainer, module)
        monitor.teardown(trainer, module, "fit")
    assert cuda.synchronized == 2  # one interval + the partial one flushed at the epoch end
    assert list(monitor.step_ms) == pytest.approx([12.0, 14.0, 16.0])
    assert not monitor._events
    metrics = logger.log_metrics.call_args.args[0]
    assert metrics["loader/step_ms"] == pytest.approx(13.0)
    assert metrics["loader/gpu_util"] == pytest.approx(55.0)
    assert metrics["loader/gpu_mem_gb"] == pytest.approx(3.0)
    assert list(monitor.gpu_util) == pytest.approx([55.0])
    assert not monitor._gpu._thread.is_alive()


def test_gpu_sampler_averages_and_resets():
    """`take()` averages the samples over time and over GPUs, in GiB, then starts again from nothing."""
    util = {"a": 20.0, "b": 60.0}
    used = {"a": 1 * 2**30, "b": 3 * 2**30}
    sampler = _GpuSampler(_fake_nvml(util, used), ["a", "b"], interval=1.0)
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
    sampler = _GpuSampler(nvml, ["a"], interval=0.001)
    sampler.start()
    sampler._thread.join(timeout=5)
    assert not sampler._thread.is_alive()
    assert nvml.nvmlDeviceGetUtilizationRates.call_count == 1
    sampler.stop()
    assert sampler.take() is None


def test_nvml_handles_reports_why_nvml_is_unusable(monkeypatch):
    """`_nvml_handles` returns a reason, not an exception, when NVML fails to start or is not installed."""
    with patch("pynvml.nvmlInit", side_effect=RuntimeError("driver not loaded")):
        reason = _nvml_handles(0)
    assert isinstance(reason, str)
    assert "NVML is not usable here" in reason
    assert "driver not loaded" in reason
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert "pip install nvidia-ml-py" in _nvml_handles(0)


def test_cpu_training_logs_one_line_and_starts_no_sampler():
    """On a CPU module `on_train_start` says once why GPU utilization is not logged, and polls nothing."""
    monitor = LoaderMonitor()
    with (
        patch("lightning_fastdata.monitor.rank_zero_info") as info,
        patch("lightning_fastdata.monitor._nvml_handles") as handles,
        patch("lightning_fastdata.monitor._GpuSampler") as sampler,
    ):
        monitor.on_train_start(_mock_trainer(), _cpu_module())
    info.assert_called_once()
    assert "GPU utilization is not logged" in info.call_args.args[0]
    assert "training runs on cpu" in info.call_args.args[0]
    handles.assert_not_called()
    sampler.assert_not_called()
    assert monitor._gpu is None
    assert not monitor._cuda


def test_cuda_without_nvml_logs_the_reason():
    """On CUDA without a usable NVML the reason is logged and training goes on without a sampler."""
    monitor = LoaderMonitor()
    with (
        patch("lightning_fastdata.monitor.rank_zero_info") as info,
        patch("lightning_fastdata.monitor._nvml_handles", return_value="NVML is not usable here (test)"),
        patch("lightning_fastdata.monitor.CpuMeter"),
    ):
        monitor.on_train_start(_mock_trainer(), Mock(device=torch.device("cuda", 1)))
    info.assert_called_once_with("LoaderMonitor: GPU utilization is not logged: NVML is not usable here (test).")
    assert monitor._cuda
    assert monitor._gpu is None


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
    """Validation wait and step follow the clock; a sanity-check run logs nothing."""
    logger = Mock()
    trainer, module, clock = _mock_trainer(loggers=[logger], global_step=7), _cpu_module(), _Clock()
    monitor = LoaderMonitor()
    with patch("lightning_fastdata.monitor.time.perf_counter", side_effect=clock):
        for sanity in (True, False):
            trainer.sanity_checking = sanity
            monitor.on_validation_epoch_start(trainer, module)
            for index, (wait, step) in enumerate([(3.0, 7.0), (4.0, 9.0)]):
                clock.advance(wait)
                monitor.on_validation_batch_start(trainer, module, None, index)
                clock.advance(step)
                monitor.on_validation_batch_end(trainer, module, None, None, index)
            monitor.on_validation_epoch_end(trainer, module)
            if sanity:
                logger.log_metrics.assert_not_called()
    logger.log_metrics.assert_called_once()
    assert logger.log_metrics.call_args.args[0] == pytest.approx(
        {"loader/val_data_wait_ms": 3.5, "loader/val_step_ms": 8.0}
    )
    assert logger.log_metrics.call_args.kwargs == {"step": 7}
    assert monitor._mark == clock.now  # the next training batch's wait starts after validation


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
    val_calls = [c for c in logger.log_metrics.call_args_list if "loader/val_step_ms" in c.args[0]]
    assert len(val_calls) == 2  # one per validation run, none for the sanity check
    assert [c.kwargs["step"] for c in val_calls] == [2, 4]
    for call in val_calls:
        metrics = call.args[0]
        assert set(metrics) == {"loader/val_data_wait_ms", "loader/val_step_ms"}
        assert metrics["loader/val_step_ms"] >= 5.0
        assert 0.0 <= metrics["loader/val_data_wait_ms"] < metrics["loader/val_step_ms"]
    train_calls = [c for c in logger.log_metrics.call_args_list if "loader/step_ms" in c.args[0]]
    assert len(train_calls) == 4  # log_every_n_steps=1
    # the 10 ms validation run after batch 2 is not counted as data wait of batch 3
    assert monitor.wait_ms[2] < 5.0


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
    with patch("lightning_fastdata.monitor.rank_zero_info") as info:
        _fit(monitor, _in_memory(4), max_epochs=1)
    assert (tmp_path / "loader_report.json").is_file()
    assert not (tmp_path / "loader_report.png").exists()
    messages = [c.args[0] for c in info.call_args_list if "matplotlib" in c.args[0]]
    assert len(messages) == 1
    assert "no chart written" in messages[0]
    assert "pip install matplotlib" in messages[0]


# ----------------------------------------------------------------------------------------------------------------
# Agreement with Lightning's profiler, and DDP
# ----------------------------------------------------------------------------------------------------------------


def test_data_wait_agrees_with_simple_profiler():
    """The total data wait matches SimpleProfiler's dataloader fetch plus batch transfer within 15%."""
    monitor = LoaderMonitor(warmup_epochs=0)
    profiler = SimpleProfiler()
    _fit(monitor, _SlowDataset(60, delay=0.005), max_epochs=1, profiler=profiler)
    durations = profiler.recorded_durations
    fetch = [key for key in durations if key.endswith("].train_dataloader_next")]
    transfer = [key for key in durations if key.startswith("[Strategy]") and key.endswith(".batch_to_device")]
    assert len(fetch) == len(transfer) == 1, sorted(durations)
    assert len(durations[fetch[0]]) == len(durations[transfer[0]]) == len(monitor.wait_ms) == 30
    profiled_ms = 1000.0 * (sum(durations[fetch[0]]) + sum(durations[transfer[0]]))
    assert profiled_ms > 30 * 10.0  # 2 samples x 5 ms per batch
    assert sum(monitor.wait_ms) == pytest.approx(profiled_ms, rel=0.15)


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
    assert ranks[1]["wait_mean_ms"] > ranks[0]["wait_mean_ms"] + 10.0  # rank 1 sleeps 2 x 10 ms per batch
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
