"""Databases of every target kind for the tests and their subprocess scripts: the same images, another target each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightning_fastdata import convert_dataset

CLASSES = ["cat", "dog", "sky", "sea"]


def kind_target(kind: str, i: int, classes: int = len(CLASSES)) -> Any:
    """Sample ``i``'s target in a database of ``kind`` (``float1``: one float a sample) of ``classes`` classes."""
    if kind == "class":
        return i % classes
    if kind == "multilabel":
        first = i % classes
        return CLASSES[:classes][first : first + i % (classes + 1)]  # none to all of them
    if kind == "float":
        return np.array([i * 0.5, -float(i), i / 7], dtype=np.float32)
    if kind == "float1":
        return 0.25 * i
    return None


class _Named(list):
    """A dataset of ``(image, target)`` pairs with class names."""

    classes: list[str] = CLASSES


def make_kind_database(
    dst: Path, kind: str, splits: dict[str, int], classes: int = len(CLASSES), seed: int = 0
) -> Path:
    """A database of ``kind`` at ``dst``: ``splits`` maps a split to its number of small random images (24-48 px)."""
    rng = np.random.default_rng(seed)
    named = type("Named", (_Named,), {"classes": CLASSES[:classes]})
    data, start = {}, 0
    for split, n in splits.items():
        samples = named()
        for i in range(start, start + n):
            shape = (int(rng.integers(24, 48)), int(rng.integers(24, 48)), 3)
            samples.append((Image.fromarray(rng.integers(0, 255, shape, np.uint8)), kind_target(kind, i, classes)))
        data[split], start = samples, start + n
    targets = None if kind in ("class", "float", "float1") else kind
    convert_dataset(data, dst, short_side=None, num_workers=0, progress=False, targets=targets)  # type: ignore[arg-type]
    return dst
