"""Shared by the tests and their subprocess scripts: datasets and DataModules whose items carry their index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset
from workers import WithIndex

from lightning_fastdata import FastImageDataModule

__all__ = ["IndexedDataModule", "WithIndex"]


class IndexedDataModule(FastImageDataModule):
    """``FastImageDataModule`` whose batches are ``(images, labels, indices)``."""

    def build_dataset(self, split: str, transform: Callable[[Any], Any] | None) -> Dataset:
        return WithIndex(super().build_dataset(split, transform))
