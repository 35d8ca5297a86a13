"""Stand-ins shared by the tests: a Trainer that says which device a DataModule trains on."""

from __future__ import annotations

from typing import Any
from unittest.mock import Mock

import torch


def fake_trainer(device: str | torch.device = "cpu", **kwargs: Any) -> Mock:
    """A stand-in Trainer with the attributes a DataModule reads, training on ``device`` (one process by default).

    A test about one device says so with it: without a Trainer, a DataModule trains on CUDA when there is one.
    """
    defaults: dict[str, Any] = {
        "world_size": 1,
        "num_nodes": 1,
        "precision": "32-true",
        "distributed_sampler_kwargs": None,
        "limit_train_batches": 1.0,
        "strategy": Mock(root_device=torch.device(device)),
    }
    return Mock(**{**defaults, **kwargs})
