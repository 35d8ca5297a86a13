"""What the tests' worker processes import: datasets, transforms and readers they unpickle or run.

Kept apart from the test modules and from Lightning: a spawned process imports the module of every object it
unpickles, and a test module's imports (Lightning, torchvision) cost each worker seconds of start-up.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.transforms import CenterCropResize


def image_digest(image: torch.Tensor) -> str:
    """The sha256 of an image's pixels."""
    return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()


class WithIndex(Dataset):
    """Items ``(image, label, index)``: the index identifies the sample in its database split."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        image, label = self.dataset[index]
        return image, label, index


class RaiseOn:
    """A transform that raises ``ValueError("boom")`` for the decoded images in ``bad`` (all if ``None``)."""

    def __init__(self, bad: frozenset[str] | None, size: int) -> None:
        self.bad = bad
        self.inner = CenterCropResize(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.bad is None or image_digest(image) in self.bad:
            raise ValueError("boom")
        return self.inner(image)


def records_digest(db: Path) -> str:
    """The sha256 of every record's stored bytes and label, in order."""
    dataset = LmdbImageDataset(db, output="encoded")
    digest = hashlib.sha256()
    for image, label in dataset:
        digest.update(image.numpy().tobytes() + label.to_bytes(4, "little"))
    return digest.hexdigest()


def read_all_encoded(db: str, passes: int = 5) -> str:
    """:func:`records_digest` read ``passes`` times (all passes must agree)."""
    digests = {records_digest(Path(db)) for _ in range(passes)}
    if len(digests) != 1:
        raise AssertionError(f"passes over {db} disagreed: {digests}")
    return digests.pop()


class WorkerFacts(Dataset):
    """Each sample is what its worker process knows of itself: ``(worker id, workers, seed, random draws)``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, int, int, float, float, float]:
        import random

        import numpy as np

        info = torch.utils.data.get_worker_info()
        assert info is not None
        assert info.dataset is self
        return info.id, info.num_workers, info.seed, random.random(), float(np.random.random()), torch.rand(()).item()
