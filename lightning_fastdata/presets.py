"""Trainer presets for throughput: mixed precision and DDP, as ``Trainer(**preset(...))`` keyword arguments.

Each function returns a plain dict of strings and numbers, usable as ``Trainer(**mixed_precision())`` and as
LightningCLI ``trainer_defaults``; ``examples/configs/gpu_16mixed.yaml`` and ``ddp.yaml`` are their YAML
equivalents. The DDP settings are registered in Lightning's strategy registry under :data:`DDP_STRATEGY` and
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


def _on_cuda(accelerator: Accelerator) -> bool:
    if accelerator == "cpu":
        return False
    if accelerator in ("gpu", "cuda"):
        return True
    return torch.cuda.is_available()


def mixed_precision(accelerator: Accelerator = "auto") -> dict[str, Any]:
    """``precision="16-mixed"`` on CUDA; on the CPU ``"32-true"``, with a line that says why.

    float16 autocast is a GPU feature; CPU autocast runs in bfloat16, which is only faster than float32 on CPUs with
    bfloat16 matrix units (AMX, AVX512-BF16), so the safe CPU choice is full precision. Ask for ``"bf16-mixed"``
    yourself on such a CPU.

    Returns:
        ``{"accelerator": ..., "precision": ...}``.

    """
    if _on_cuda(accelerator):
        return {"accelerator": "gpu" if accelerator == "auto" else accelerator, "precision": "16-mixed"}
    rank_zero_info(
        "mixed_precision: no CUDA device, so precision='32-true' (16-mixed needs a GPU; on a CPU with AMX or"
        " AVX512-BF16 pass precision='bf16-mixed' yourself)."
    )
    return {"accelerator": "cpu", "precision": "32-true"}


def ddp(
    devices: int | str = "auto",
    num_nodes: int = 1,
    static_graph: bool = False,
    accelerator: Accelerator = "auto",
) -> dict[str, Any]:
    """DDP with the settings that matter for throughput.

    ``gradient_as_bucket_view=True`` (gradients live in the all-reduce buckets: no copy, less memory),
    ``find_unused_parameters=False`` (no extra graph traversal every step), and ``static_graph`` when the model uses
    the same parameters every step (lets DDP skip its per-step bookkeeping; wrong for models with conditional
    branches, hence off by default). Lightning picks the process group: nccl on GPUs, gloo on CPUs.
    ``FastImageDataModule`` divides its worker budget by the processes per node by itself.

    Args:
        devices: devices per node (``"auto"``: all of them).
        num_nodes: machines; every node runs ``devices`` processes.
        static_graph: set when every step uses the same parameters.
        accelerator: ``"auto"``, ``"gpu"``/``"cuda"`` or ``"cpu"``.

    Returns:
        ``{"accelerator": ..., "devices": ..., "num_nodes": ..., "strategy": "ddp_fastdata"}`` (a registered name, so
        the dict also works as LightningCLI ``trainer_defaults``).

    """
    if num_nodes < 1:
        raise ValueError(f"`num_nodes` must be >= 1, got {num_nodes}.")
    on_cuda = _on_cuda(accelerator)
    strategy = DDP_STATIC_STRATEGY if static_graph else DDP_STRATEGY
    return {
        "accelerator": ("gpu" if accelerator == "auto" else accelerator) if on_cuda else "cpu",
        "devices": devices,
        "num_nodes": num_nodes,
        "strategy": strategy,
    }


def fast_gpu(devices: int | str = "auto", num_nodes: int = 1, static_graph: bool = False) -> dict[str, Any]:
    """The common case in one call: all GPUs of each node, DDP as in :func:`ddp`, and ``16-mixed``.

    On a machine without CUDA it degrades to the CPU equivalents (gloo DDP, ``32-true``) and says so.
    """
    kwargs = ddp(devices=devices, num_nodes=num_nodes, static_graph=static_graph)
    kwargs["precision"] = mixed_precision(kwargs["accelerator"])["precision"]
    return kwargs
