"""Shared by the tests and their subprocess scripts: datasets and DataModules whose items carry their index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from lightning_fastdata import FastImageDataModule


class WithIndex(Dataset):
    """Items ``(image, label, index)``: the index identifies the sample in its database split."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        image, label = self.dataset[index]
        return image, label, index


class IndexedDataModule(FastImageDataModule):
    """``FastImageDataModule`` whose batches are ``(images, labels, indices)``."""

    def build_dataset(self, split: str, transform: Callable[[Any], Any] | None) -> Dataset:
        return WithIndex(super().build_dataset(split, transform))
