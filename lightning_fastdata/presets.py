"""Trainer presets for throughput: mixed precision and DDP, as ``Trainer(**preset(...))`` keyword arguments.

Each function returns a plain dict of strings and numbers, usable as ``Trainer(**mixed_precision())`` and as
LightningCLI ``trainer_defaults``; ``examples/configs/gpu_16mixed.yaml`` and ``ddp.yaml`` are their YAML
equivalents. A preset sets only what it is about (``precision``, ``strategy``) and the arguments you pass it, so your
own Trainer arguments combine with it: ``Trainer(accelerator="cpu", max_epochs=3, **ddp(devices=2))``; any Trainer
argument passed to a preset (``fast_gpu(precision="bf16-mixed")``) wins over the preset's choice.

The DDP settings are registered in Lightning's strategy registry under :data:`DDP_STRATEGY` and
:data:`DDP_STATIC_STRATEGY`, so a config can also say ``strategy: ddp_fastdata``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

Accelerator = Literal["auto", "gpu", "cuda", "cpu"]

#: DDP with bucket-view gradients and no unused-parameter search (registered strategy name)
DDP_STRATEGY = "ddp_fastdata"
#: the same with ``static_graph=True``
DDP_STATIC_STRATEGY = "ddp_fastdata_static"

for _name, _static in ((DDP_STRATEGY, False), (DDP_STATIC_STRATEGY, True)):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(
            _name,
            DDPStrategy,
            description="DDP tuned for throughput by lightning_fastdata" + (" (static graph)" if _static else ""),
            gradient_as_bucket_view=True,
            find_unused_parameters=False,
            static_graph=_static,
        )


def _on_cuda(accelerator: Accelerator | None) -> bool:
    if accelerator == "cpu":
        return False
    if accelerator in ("gpu", "cuda"):
        return True
    return torch.cuda.is_available()


def _accelerator(accelerator: Accelerator | None, on_cuda: bool) -> dict[str, Any]:
    """``{"accelerator": ...}`` only when the caller chose one: otherwise the Trainer's own ``"auto"`` decides.

    Leaving it out lets a caller write ``Trainer(accelerator="cpu", **preset())`` without a duplicate keyword.
    """
    if accelerator is None:
        return {}
    return {"accelerator": ("gpu" if accelerator == "auto" else accelerator) if on_cuda else "cpu"}


def mixed_precision(accelerator: Accelerator | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    """``precision="16-mixed"`` on CUDA; on the CPU ``"32-true"``, with a line that says why.

    float16 autocast is a GPU feature; CPU autocast runs in bfloat16, which is only faster than float32 on CPUs with
    bfloat16 matrix units (AMX, AVX512-BF16), so the safe CPU choice is full precision. Ask for ``"bf16-mixed"``
    yourself on such a CPU.

    Args:
        accelerator: the accelerator training runs on; ``None`` (default) follows CUDA, as the Trainer's ``"auto"``
            does, and leaves ``accelerator`` out of the result, so ``Trainer(accelerator=..., **mixed_precision())``
            works. Pass ``"cpu"`` here when you train on the CPU of a machine with a GPU.
        trainer_kwargs: your own Trainer arguments, returned as given; they win over the preset's.

    Returns:
        ``{"precision": ...}``, with ``"accelerator"`` when you passed one, and your ``trainer_kwargs``.

    """
    on_cuda = _on_cuda(accelerator)
    if not on_cuda and "precision" not in trainer_kwargs:
        rank_zero_info(
            "mixed_precision: no CUDA device, so precision='32-true' (16-mixed needs a GPU; on a CPU with AMX or"
            " AVX512-BF16 pass precision='bf16-mixed' yourself)."
        )
    preset = {**_accelerator(accelerator, on_cuda), "precision": "16-mixed" if on_cuda else "32-true"}
    return {**preset, **trainer_kwargs}


def ddp(
    devices: int | str | None = None,
    num_nodes: int | None = None,
    static_graph: bool = False,
    accelerator: Accelerator | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """DDP with the settings that matter for throughput.

    ``gradient_as_bucket_view=True`` (gradients live in the all-reduce buckets: no copy, less memory),
    ``find_unused_parameters=False`` (no extra graph traversal every step), and ``static_graph`` when the model uses
    the same parameters every step (lets DDP skip its per-step bookkeeping; wrong for models with conditional
    branches, hence off by default). Lightning picks the process group: nccl on GPUs, gloo on CPUs.
    ``FastImageDataModule`` divides its worker budget by the processes per node by itself.

    Only ``strategy`` is always set; ``devices``, ``num_nodes`` and ``accelerator`` are set when you pass them, so
    ``Trainer(accelerator="cpu", **ddp(devices=2))`` works, and so does ``Trainer(**ddp(devices=2, max_epochs=3))``.

    Args:
        devices: devices per node; ``None`` leaves the Trainer's default (``"auto"``: all of them).
        num_nodes: machines; every node runs ``devices`` processes. ``None`` leaves the Trainer's default (1).
        static_graph: set when every step uses the same parameters.
        accelerator: ``"auto"``, ``"gpu"``/``"cuda"`` or ``"cpu"``; ``None`` leaves the Trainer's ``"auto"``.
        trainer_kwargs: your own Trainer arguments, returned as given; they win over the preset's.

    Returns:
        ``{"strategy": "ddp_fastdata", ...}`` (a registered name, so the dict also works as LightningCLI
        ``trainer_defaults``), with the arguments you passed.

    """
    if num_nodes is not None and num_nodes < 1:
        raise ValueError(f"`num_nodes` must be >= 1, got {num_nodes}.")
    preset: dict[str, Any] = _accelerator(accelerator, _on_cuda(accelerator))
    if devices is not None:
        preset["devices"] = devices
    if num_nodes is not None:
        preset["num_nodes"] = num_nodes
    preset["strategy"] = DDP_STATIC_STRATEGY if static_graph else DDP_STRATEGY
    return {**preset, **trainer_kwargs}


def fast_gpu(
    devices: int | str | None = None,
    num_nodes: int | None = None,
    static_graph: bool = False,
    accelerator: Accelerator | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """The common case in one call: all GPUs of each node, DDP as in :func:`ddp`, and ``16-mixed``.

    On a machine without CUDA it degrades to the CPU equivalents (gloo DDP, ``32-true``) and says so. Arguments as
    in :func:`ddp`; pass your own ``precision`` (or any Trainer argument) here to override the preset's.
    """
    kwargs = ddp(devices=devices, num_nodes=num_nodes, static_graph=static_graph, accelerator=accelerator)
    return {**kwargs, **mixed_precision(accelerator, **trainer_kwargs)}
