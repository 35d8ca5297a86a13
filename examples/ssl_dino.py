"""A small DINO on generated images: ``FastImageDataModule(views=...)`` hands the training step a list of views.

Each image is decoded once and cropped into 2 large and 4 small views (DINO's multi-crop), each with its own keyed
colour jitter; the training step takes ``views, targets = batch`` with ``views`` a list of ``[B, 3, S, S]`` tensors,
large views first, as lightly's and solo-learn's do. The student sees every view, the teacher (an exponential moving
average of the student) the large ones, and the loss is DINO's cross-entropy between the teacher's centred, sharpened
output and the student's.

    python examples/ssl_dino.py --out /tmp/dino --epochs 3

To scale it up: DINO's ``views=[ViewGroup(224, count=2, scale=(0.4, 1.0)), ViewGroup(96, count=6, scale=(0.05,
0.4))]``, a ResNet-50 or ViT backbone and a 65,536-dimensional head; the views arrive normalized on the GPU.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, ViewGroup, make_image_folder

VIEWS = [ViewGroup(48, count=2, scale=(0.4, 1.0)), ViewGroup(24, count=4, scale=(0.05, 0.4))]


class DINO(LightningModule):
    """DINO with a tiny CNN: student on all views, EMA teacher on the large ones, centring and sharpening.

    Args:
        out_dim: the projection head's output (DINO's prototypes).
        num_large_views: how many of the views (the first ones) the teacher sees.
        student_temp: the student's softmax temperature.
        teacher_temp: the teacher's (sharper) softmax temperature.
        momentum: the teacher's EMA momentum.
        lr: Adam's learning rate.

    """

    def __init__(
        self,
        out_dim: int = 64,
        num_large_views: int = 2,
        student_temp: float = 0.1,
        teacher_temp: float = 0.04,
        momentum: float = 0.99,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.student = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),  # any view size: large and small views share the backbone
            nn.Flatten(),
            nn.Linear(32, 64),
            nn.GELU(),
            nn.Linear(64, out_dim),
        )
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.epoch_losses: list[float] = []
        self._losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, _ = batch[0], batch[1]  # views: [B, 3, 48, 48] x 2, then [B, 3, 24, 24] x 4; targets unused
        large = views[: self.hparams.num_large_views]
        with torch.no_grad():
            teacher = [F.softmax((self.teacher(v) - self.center) / self.hparams.teacher_temp, dim=-1) for v in large]
        student = [F.log_softmax(self.student(v) / self.hparams.student_temp, dim=-1) for v in views]
        terms = [
            -(t * s).sum(dim=-1).mean() for i, t in enumerate(teacher) for j, s in enumerate(student) if i != j
        ]  # every view against every large view but itself
        loss = torch.stack(terms).mean()
        with torch.no_grad():
            outputs = torch.cat([self.teacher(v) for v in large])
            self.center.mul_(0.9).add_(outputs.mean(dim=0, keepdim=True), alpha=0.1)
        self._losses.append(loss.detach())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        m = self.hparams.momentum
        with torch.no_grad():
            for teacher, student in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                teacher.mul_(m).add_(student.detach(), alpha=1 - m)

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(torch.stack(self._losses).mean()))
        self._losses.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Generate images, train DINO on their views; returns what a test checks (one batch, the losses by epoch)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".demo/dino", help="where the images and the database go")
    parser.add_argument("--images", type=int, default=24, help="generated images per class (4 classes)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    seed_everything(0, workers=True)
    out = Path(args.out)
    images = make_image_folder(out / "images", num_classes=4, train_per_class=args.images, val_per_class=0,
                               min_size=56, max_size=80, num_workers=1)  # fmt: skip
    dm = FastImageDataModule(
        str(images), cache_dir=str(out / "cache"), image_size=48, batch_size=16, num_workers=0, val_fraction=0,
        views=VIEWS, color_jitter=(0.4, 0.4, 0.2, 0.1), grayscale_p=0.2,
    )  # fmt: skip
    model = DINO(num_large_views=dm.num_large_views)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        deterministic=True,
    )
    trainer.fit(model, datamodule=dm)
    batch = next(iter(dm.train_dataloader()))
    print(f"DINO on {len(VIEWS)} view groups: loss by epoch {[round(v, 3) for v in model.epoch_losses]}")
    return {"batch": dm.on_after_batch_transfer(batch, 0), "losses": model.epoch_losses, "datamodule": dm}


if __name__ == "__main__":
    main()
