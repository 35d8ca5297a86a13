"""Stand-ins shared by the tests: a Trainer that says which device a DataModule trains on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


def fake_trainer(device: str | torch.device = "cpu", **kwargs: Any) -> Any:
    """A stand-in Trainer with the attributes a DataModule reads, training on ``device`` (one process by default).

    A test about one device says so with it: without a Trainer, a DataModule trains on CUDA when there is one. A plain
    namespace, not a ``Mock``: mocks refer to each other in cycles, so a loader reachable from one is freed only by
    the garbage collector, and its persistent worker processes then take 5 s each to stop (pytorch/pytorch#81794).
    """
    defaults: dict[str, Any] = {
        "world_size": 1,
        "num_nodes": 1,
        "precision": "32-true",
        "distributed_sampler_kwargs": None,
        "limit_train_batches": 1.0,
        "strategy": SimpleNamespace(root_device=torch.device(device)),
    }
    return SimpleNamespace(**{**defaults, **kwargs})
