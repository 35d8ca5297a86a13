"""A multi-label tagger on generated images: a ``path,label`` CSV with ``red|blue`` labels, end to end.

Each generated image shows a few coloured squares; its tags are their colours (``red``, ``green``, ``blue``,
``yellow``), 0 to 3 of them. The list file is converted with ``targets="multilabel"`` (``lightning-fastdata convert
tags.csv tags.lmdb --targets multilabel`` on the command line), and ``FastImageDataModule`` hands the model multi-hot
``float32 [B, C]`` targets, which ``BCEWithLogitsLoss`` takes as they are.

    python examples/multilabel_tagger.py --out /tmp/tagger --epochs 3
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from PIL import Image
from torch import nn

from lightning_fastdata import FastImageDataModule, convert

TAGS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}


def make_tagged_images(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` 64x64 JPEGs of 0-3 coloured squares on grey noise, and ``tags.csv`` (``path,label``) naming them."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        image = rng.integers(90, 160, size=(64, 64, 3), dtype=np.uint8)
        tags = sorted(rng.choice(list(TAGS), size=int(rng.integers(0, 4)), replace=False).tolist())
        for tag in tags:
            y, x = (int(v) for v in rng.integers(0, 44, size=2))
            image[y : y + 20, x : x + 20] = TAGS[tag]
        name = f"images/{i:04d}.jpg"
        Image.fromarray(image).save(root / name, quality=92)
        rows.append({"path": name, "label": "|".join(tags)})
    with open(root / "tags.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["path", "label"])
        writer.writeheader()
        writer.writerows(rows)
    return root / "tags.csv"


class Tagger(LightningModule):
    """A small CNN with one logit per tag, trained with ``BCEWithLogitsLoss`` on multi-hot targets."""

    def __init__(self, num_classes: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, num_classes),
        )
        self.loss = nn.BCEWithLogitsLoss()
        self.val_losses: list[float] = []
        self._epoch_loss: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = batch[0], batch[1]  # targets: float32 [B, C], multi-hot
        loss = self.loss(self(images), targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, targets = batch[0], batch[1]
        loss = self.loss(self(images), targets)
        self._epoch_loss.append(loss.detach())
        self.log("val/loss", loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self._epoch_loss and not self.trainer.sanity_checking:
            self.val_losses.append(float(torch.stack(self._epoch_loss).mean()))
        self._epoch_loss.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Generate, convert, train; returns what a test checks (the classes, one batch's targets, the val losses)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".demo/tagger", help="where the images and the database go")
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    seed_everything(0, workers=True)
    out = Path(args.out)
    listing = make_tagged_images(out, args.images)
    convert(listing, out / "tags.lmdb", targets="multilabel", short_side=0, progress=False)
    dm = FastImageDataModule(
        str(out / "tags.lmdb"), image_size=48, batch_size=32, num_workers=0, val_fraction=0.2, scale=(0.6, 1.0)
    )
    model = Tagger(num_classes=len(dm.classes))
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, datamodule=dm)
    batch = next(iter(dm.val_dataloader()))
    print(f"tags {dm.classes}: val loss by epoch {[round(v, 3) for v in model.val_losses]}")
    return {"classes": dm.classes, "targets": batch[1], "val_losses": model.val_losses, "datamodule": dm}


if __name__ == "__main__":
    main()
