"""Training runs for the exact mid-epoch resume tests, run as a script by ``test_resume.py``.

Usage: ``python resume_script.py MODE DATA_DIR OUT_DIR SEED DEVICES WORKERS EVERY SLOW_AFTER CKPT [LIMIT [VAL
[KIND [SCHEDULE [VIEWS]]]]]``.

``MODE`` is ``fit`` (train from scratch) or ``resume`` (``trainer.fit(..., ckpt_path=CKPT)``); ``fit-last`` and
``resume-last`` save with :class:`~lightning_fastdata.ResumeCheckpoint` (``every_n_train_steps=EVERY``) instead, into
its default folder under ``Trainer(default_root_dir=CKPT)``, and always call ``trainer.fit(..., ckpt_path="last")``
(on the first run it finds nothing and trains from the start). Two epochs of a tiny
model on ``FastImageDataModule`` whose items carry their sample index; ``DEVICES`` > 1 is DDP on CPU (Lightning
re-executes this script for the other ranks). ``ModelCheckpoint`` saves ``OUT_DIR/ckpt/step=<n>.ckpt`` every
``EVERY`` steps, or with ``EVERY`` ``0`` at the end of every epoch (its default). Each rank appends one JSON line per
training batch to ``OUT_DIR/rank<r>.jsonl`` (flushed at once): ``{"step", "epoch", "batch_idx", "indices", "pixels",
"size"}`` (``pixels``: a SHA-256 of the batch's images, so runs are compared crop for crop; ``size``: their side).
After step ``SLOW_AFTER`` (``0``: never) each step sleeps 0.2 s, so the harness can kill the run a few steps later.
``LIMIT`` is ``Trainer(limit_train_batches)`` (default ``1.0``). ``VAL`` ``1`` holds out a fifth of the images and
validates at the end of every epoch, so ``ModelCheckpoint`` saves in ``on_validation_end`` instead of
``on_train_epoch_end`` (default ``0``: no validation). ``KIND`` ``multilabel`` reads a multi-label database of 2
classes through ``FastImageDataModule(return_index=True)`` (the fused path, its targets and indices in the batch
slots) instead of the index-carrying dataset; each record then also holds the batch's ``targets``. ``SCHEDULE``:
``image_size_schedule`` as JSON (``{"0": 32, "1": 48}``; default none, ``{}`` too). ``VIEWS``: ``views`` as JSON
(``[{"size": 24, "count": 2}, {"size": 12, "count": 3}]``), read on the fused path with ``return_index=True`` as for
``multilabel``: the loss is on the first view, ``pixels`` hashes every view and ``size`` lists their sides.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from indexed import IndexedDataModule
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from ranks import end_process_group
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, ResumeCheckpoint


class RecordingModel(LightningModule):
    """A linear classifier on the mean colour that appends every training batch's sample indices to a JSONL file."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.out_dir = out_dir
        self._file: TextIO | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels, _ = batch
        images = images[0] if isinstance(images, list) else images  # views: the first one
        return _loss(self.layer(images.mean(dim=(2, 3))), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels, _ = batch
        _loss(self.layer(images.mean(dim=(2, 3))), labels)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._file is None:
            self._file = open(Path(self.out_dir, f"rank{self.global_rank}.jsonl"), "a")  # noqa: SIM115
        views = batch[0] if isinstance(batch[0], list) else [batch[0]]
        pixels = hashlib.sha256()
        for view in views:
            pixels.update(view.contiguous().cpu().numpy().tobytes())
        record = {
            "step": self.trainer.global_step,
            "epoch": self.current_epoch,
            "batch_idx": batch_idx,
            "indices": batch[2].tolist(),
            "pixels": pixels.hexdigest(),
            "size": [view.shape[-1] for view in views] if isinstance(batch[0], list) else batch[0].shape[-1],
        }
        if batch[1].is_floating_point():  # multi-hot targets
            record["targets"] = batch[1].tolist()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def on_train_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class indices, binary cross-entropy for multi-hot targets."""
    if targets.is_floating_point():
        return F.binary_cross_entropy_with_logits(logits, targets)
    return F.cross_entropy(logits, targets)


class SlowDown(Callback):
    """Sleeps 0.2 s at the end of every step after ``after`` (gives the harness time to kill the run)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.after and trainer.global_step > self.after:
            time.sleep(0.2)


def main(
    mode: str,
    data_dir: str,
    out_dir: str,
    seed: int,
    devices: int,
    workers: int,
    every: int,
    slow_after: int,
    ckpt: str,
    limit: int | float = 1.0,
    val: bool = False,
    kind: str = "class",
    schedule: dict[int, int] | None = None,
    views: list[dict[str, Any]] | None = None,
) -> None:
    if mode not in ("fit", "resume", "fit-last", "resume-last"):
        raise ValueError(f"MODE must be 'fit', 'resume', 'fit-last' or 'resume-last', got {mode!r}")
    torch.set_num_threads(1)
    fused = kind != "class" or views is not None
    dm = (partial(FastImageDataModule, return_index=True, views=views) if fused else IndexedDataModule)(
        data_dir,
        image_size=16,
        image_size_schedule=schedule,
        batch_size=4,
        num_workers=workers,
        val_fraction=0.2 if val else 0,
        seed=seed,
        drop_last=False,
    )
    last = mode.endswith("-last")
    checkpoint = (
        ResumeCheckpoint(every_n_train_steps=every)
        if last
        else ModelCheckpoint(
            dirpath=Path(out_dir, "ckpt"), filename="{step}", every_n_train_steps=every or None, save_top_k=-1
        )
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=2,
        limit_train_batches=limit,
        limit_val_batches=1.0 if val else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SlowDown(slow_after), checkpoint],
        default_root_dir=ckpt if last else None,
    )
    trainer.fit(
        RecordingModel(out_dir), datamodule=dm, ckpt_path="last" if last else ckpt if mode == "resume" else None
    )


if __name__ == "__main__":
    mode, data_dir, out_dir, seed, devices, workers, every, slow_after, ckpt = sys.argv[1:10]
    limit = sys.argv[10] if len(sys.argv) > 10 else "1.0"
    val = len(sys.argv) > 11 and sys.argv[11] == "1"
    kind = sys.argv[12] if len(sys.argv) > 12 else "class"
    schedule = {int(k): v for k, v in json.loads(sys.argv[13]).items()} if len(sys.argv) > 13 else None
    views = json.loads(sys.argv[14]) if len(sys.argv) > 14 else None
    main(
        mode,
        data_dir,
        out_dir,
        int(seed),
        int(devices),
        int(workers),
        int(every),
        int(slow_after),
        ckpt,
        float(limit) if "." in limit else int(limit),
        val,
        kind,
        schedule,
        views,
    )
    end_process_group()
