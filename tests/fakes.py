"""Stand-ins shared by the tests: a Trainer that says which device a DataModule trains on, a machine without CUDA,
and CUDA streams and events on the CPU (classes, as torch's are)."""

from __future__ import annotations

import contextlib
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


def hide_cuda(monkeypatch: Any) -> None:
    """A machine without CUDA (nor Apple's MPS), as torch and Lightning's ``accelerator="auto"`` both see it.

    ``torch.cuda.is_available`` alone is not enough on a GPU host: Lightning picks ``"cuda"`` from
    ``torch.cuda.device_count()`` (``CUDAAccelerator.is_available``), and then builds, for ``devices=2``, a Trainer
    on GPUs the host may not have.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


class _FakeStream:
    """A CUDA stream for ``prefetch_to_device``: ``wait_stream`` does nothing.

    A class, as ``torch.cuda.Stream`` is: a module imported while it stands in may use it as one
    (``torch.cuda.Stream | None`` in an annotation, ``isinstance``).
    """

    def __init__(self, device: Any = None, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class FakeEvent:
    """A CUDA event whose work has always completed: ``record`` does nothing, ``query`` says done."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def copied_to_device(batch: Any, device: Any) -> Any:
    """A stand-in for a batch's copy to the device: every tensor copied into new memory, as a real copy is.

    Never the identity: a batch slot is free once its copy's event completes (at once, here) and a loader refills it,
    so a "copy" that kept the slot's memory would change under the test.
    """
    from lightning_fastdata.pipeline import device as stage

    return stage._apply(batch, torch.clone)


def patch_cuda_streams(monkeypatch: Any) -> None:
    """CUDA streams patched so a loader's device look-ahead runs on the CPU (copies: :func:`copied_to_device`)."""
    from lightning_fastdata.pipeline import device, streams

    compute = _FakeStream()
    monkeypatch.setattr(streams, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(device, "_to_device", copied_to_device)


def refusing_host_reads(stage: Any) -> Any:
    """``stage`` (a device stage) run with every way of reading a tensor back to the host refused: a stand-in for
    ``torch.cuda.set_sync_debug_mode("error")`` on a machine without CUDA."""
    import pytest

    def no_sync(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the device stage read a value back from the device")

    def guarded(batch: Any) -> Any:
        with pytest.MonkeyPatch.context() as patch:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero", "__index__", "__float__"):
                patch.setattr(torch.Tensor, name, no_sync)
            return stage(batch)

    return guarded
