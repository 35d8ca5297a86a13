"""A small image classifier for FastImageDataModule: any torchvision model, built with ``weights=None``."""

from __future__ import annotations

from typing import Any

import torch
import torchvision
from lightning.pytorch import LightningModule
from torch.nn import functional as F


class ImageClassifier(LightningModule):
    """Cross-entropy classification with a torchvision architecture and SGD + cosine schedule.

    Args:
        arch: a torchvision model name (``torchvision.models.list_models()``), built without weights.
        num_classes: output classes; ``None`` takes them from the Trainer's datamodule.
        lr: peak SGD learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.

    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int | None = None,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.hparams.num_classes is None:
            self.hparams.num_classes = self.trainer.datamodule.num_classes
        self.model = torchvision.models.get_model(self.hparams.arch, weights=None, num_classes=self.hparams.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.model(images)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        acc = (logits.argmax(dim=1) == labels).float().mean()
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train")
        self.log(f"{stage}/acc", acc, prog_bar=True, sync_dist=stage != "train")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.hparams.lr,
            momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=max(1, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
