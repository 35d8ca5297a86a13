"""A FastImageDataModule subclass that changes the training augmentation: brightness/contrast jitter on uint8.

Its random numbers come from ``sample_rng()``: a function of (seed, epoch, sample), so two runs with the same seed
train on the same batches, with either engine, and a resumed run continues exactly.

Use it from a config with ``class_path: fastdata_examples.augmented_datamodule.JitterDataModule`` (this file, by a
name no other package uses: see ``fastdata_examples/__init__.py``); every argument of FastImageDataModule passes through
``**kwargs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_fastdata import FastImageDataModule
from lightning_fastdata.keyed_random import sample_rng


class _Jitter:
    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], strength: float) -> None:
        self.base = base
        self.strength = strength

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image = self.base(image)
        rng = sample_rng()  # not `random`: its draws differ between runs and loader threads
        gain = 1.0 + rng.uniform(-self.strength, self.strength)
        offset = 255.0 * rng.uniform(-self.strength, self.strength) / 2
        # stays uint8: one small float pass on a 224x224 crop, after the resize
        return image.float().mul_(gain).add_(offset).clamp_(0, 255).to(torch.uint8)


class JitterDataModule(FastImageDataModule):
    """FastImageDataModule plus random brightness and contrast on the training crops.

    Args:
        jitter: maximum relative change of contrast (and half of it for brightness), 0 to turn it off.
        **kwargs: the arguments of :class:`~lightning_fastdata.FastImageDataModule`.

    """

    def __init__(self, jitter: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.jitter = jitter

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        base = super().train_transform()
        return _Jitter(base, self.jitter) if self.jitter > 0 else base
