"""A short real fit on a GPU: 16-mixed, LoaderMonitor, prefetch to the device, CPU and device decode.

Marked ``cuda``: skipped without a GPU, run by ``make test-gpu``. Between steps (the fetch, the copy and
normalization on the side stream, nvJPEG with ``decode="device"``, and LoaderMonitor's per-step work) CUDA runs under
``torch.cuda.set_sync_debug_mode("error")``: any host-device synchronization there fails the fit.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, LoaderMonitor

pytestmark = pytest.mark.cuda

EPOCHS, BATCH, IMAGES = 3, 8, 64


class _ConvNet(LightningModule):
    """A small conv net that checks what the loader hands it: normalized float batches on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, 2),
        )
        self.seen: list[tuple[str, torch.dtype, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.seen.append((images.device.type, images.dtype, images.is_contiguous(memory_format=torch.channels_last)))
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _NoSyncBetweenSteps(Callback):
    """``set_sync_debug_mode("error")`` from the end of one step to the start of the next (within an epoch)."""

    def __init__(self) -> None:
        self.windows = 0

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        batch_idx = args[-1]
        if batch_idx + 1 < trainer.num_training_batches:
            torch.cuda.set_sync_debug_mode("error")
            self.windows += 1

    def on_train_batch_start(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def on_train_epoch_end(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def on_exception(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.fixture(scope="module")
def gpu_database(make_database: Callable[..., Path]) -> Path:
    return make_database(
        "gpu_fit",
        short_side=96,
        convert_workers=None,
        num_classes=2,
        train_per_class=IMAGES // 2,
        val_per_class=0,
        seed=1,
        num_workers=None,
    )


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_a_short_16_mixed_fit_on_the_gpu(gpu_database: Path, tmp_path: Path, decode: str) -> None:
    """Three epochs in 16-mixed with channels_last: GPU batches, no synchronization between steps, a monitor verdict
    with GPU utilization, and its metrics in the logger's rows."""
    dm = FastImageDataModule(
        str(gpu_database), image_size=64, batch_size=BATCH, val_fraction=0, channels_last=True, decode=decode
    )
    model, monitor, guard = _ConvNet(), LoaderMonitor(warmup_epochs=1), _NoSyncBetweenSteps()
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_epochs=EPOCHS,
        callbacks=[guard, monitor],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    steps = EPOCHS * (IMAGES // BATCH)
    assert trainer.global_step == steps
    assert dm.uses_prefetch()
    assert dm.uses_device_decode() is (decode == "device")
    assert set(model.seen) == {("cuda", torch.float32, True)}
    assert guard.windows == EPOCHS * (IMAGES // BATCH - 1)
    summary = monitor.summary
    assert summary["measured_steps"] == (EPOCHS - 1) * (IMAGES // BATCH)
    assert summary["verdict"] in {"input-bound", "balanced", "compute-bound"}
    assert 0.0 <= summary["data_fraction"] <= 1.0
    assert summary["samples_per_sec"] > 0
    assert 0.0 <= summary["gpu_util"] <= 1.0  # NVML (nvidia-ml-py is a dependency)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))  # noqa: SIM115
    logged = [row for row in rows if row.get("loader/step_ms")]
    assert logged
    assert all(float(row["loader/step_ms"]) > 0 for row in logged)


class _ViewsNet(_ConvNet):
    """The conv net on every view of a ``(views, targets)`` batch; records what each view was."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, labels = batch
        self.seen.extend((v.device.type, v.dtype, tuple(v.shape[1:])) for v in views)  # type: ignore[misc]
        return sum(F.cross_entropy(self.net(v), labels) for v in views)  # type: ignore[return-value]


def test_views_with_dino_colour_on_the_gpu_never_sync(gpu_database: Path) -> None:
    """DINO-style views with its per-view colour recipe, coloured on the side stream: GPU float32 views, and no
    host-device synchronization from one step to the next (fetch, copy, colour, normalize)."""
    views = [
        {"size": 48, "scale": (0.4, 1.0), "blur_p": 1.0},
        {"size": 48, "scale": (0.4, 1.0), "blur_p": 0.1, "solarize_p": 0.2},
        {"size": 24, "count": 3, "scale": (0.05, 0.4), "blur_p": 0.5},
    ]
    dm = FastImageDataModule(
        str(gpu_database), batch_size=BATCH, val_fraction=0, views=views, color_jitter=(0.4, 0.4, 0.2, 0.1),
        grayscale_p=0.2,
    )  # fmt: skip
    model, guard = _ViewsNet(), _NoSyncBetweenSteps()
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=2,
        callbacks=[guard],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert guard.windows == 2 * (IMAGES // BATCH - 1)
    assert set(model.seen) == {("cuda", torch.float32, (3, 48, 48)), ("cuda", torch.float32, (3, 24, 24))}


def test_the_gpu_colours_as_the_cpu_does() -> None:
    """The batched colour stage on CUDA (float32) and the CPU path (uint8, OpenCV) agree within 2 grey levels."""
    from lightning_fastdata.pipeline.color import BatchColor

    color = BatchColor((0.4, 0.4, 0.2, 0.1), 0.8, 0.2, 0.5, (0.1, 2.0), 0.2)
    images = torch.randint(0, 256, (32, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    params = torch.from_numpy(color.draw((0, 0), list(range(32))))
    on_gpu = color.apply_batch(images.cuda(), params.cuda()).cpu()
    assert (on_gpu - color.apply_images(images, params).float()).abs().max() <= 2.0
