"""Shared by the tests and their subprocess scripts: DataModules whose items carry their index, and a model that
records them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.nn import functional as F
from torch.utils.data import Dataset
from workers import WithIndex

from lightning_fastdata import FastImageDataModule

__all__ = ["IndexedDataModule", "RecordingModel", "WithIndex"]


class IndexedDataModule(FastImageDataModule):
    """``FastImageDataModule`` whose batches are ``(images, labels, indices)``."""

    def build_dataset(self, split: str, transform: Callable[[Any], Any] | None) -> Dataset:
        return WithIndex(super().build_dataset(split, transform))


class RecordingModel(LightningModule):
    """A linear classifier on the mean colour that records, per epoch, the sample indices of every training batch.

    Also the batch count per epoch, the sampler's epoch at each epoch's first batch and the image dtypes seen. Batches
    are ``(images, labels, indices)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.seen: list[list[int]] = []
        self.batches: list[int] = []
        self.sampler_epochs: list[int | None] = []
        self.dtypes: set[str] = set()

    def on_train_epoch_start(self) -> None:
        self.seen.append([])
        self.batches.append(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels, indices = batch
        if batch_idx == 0:
            self.sampler_epochs.append(getattr(self.trainer.train_dataloader.sampler, "epoch", None))
        self.dtypes.add(str(images.dtype))
        self.seen[-1].extend(indices.tolist())
        self.batches[-1] += 1
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
