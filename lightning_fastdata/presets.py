"""Trainer presets: mixed precision and DDP as ``Trainer(**preset(...))`` keyword arguments, and a resume checkpoint.

Each function returns a plain dict of strings and numbers, usable as ``Trainer(**mixed_precision())`` and as
LightningCLI ``trainer_defaults``; ``examples/configs/gpu_16mixed.yaml`` and ``ddp.yaml`` are their YAML
equivalents. A preset sets only what it is about (``precision``, ``strategy``) and the arguments you pass it, so your
own Trainer arguments combine with it: ``Trainer(accelerator="cpu", max_epochs=3, **ddp(devices=2))``; any Trainer
argument passed to a preset (``fast_gpu(precision="bf16-mixed")``) wins over the preset's choice.

The DDP settings are registered in Lightning's strategy registry under :data:`DDP_STRATEGY` and
:data:`DDP_STATIC_STRATEGY`, so a config can also say ``strategy: ddp_fastdata``.

:class:`ResumeCheckpoint` is the checkpoint that ``fit(ckpt_path="last")`` needs after a crash or a kill, as a
callback a config can name: ``--trainer.callbacks+=lightning_fastdata.ResumeCheckpoint``.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_fastdata.errors import InvalidArgumentError

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


class ResumeCheckpoint(ModelCheckpoint):
    r"""A ``ModelCheckpoint`` for resuming a killed fit: ``last.ckpt`` every few steps, in one folder across runs.

    ``Trainer.fit(ckpt_path="last")`` finds only checkpoints named ``last*.ckpt`` in the checkpoint folder, which a
    plain ``ModelCheckpoint`` writes only with ``save_last=True``, and then only at epoch ends unless
    ``every_n_train_steps`` is set. Its default folder is also per logger version (``lightning_logs/version_N/
    checkpoints``), so a new run looks in a new, empty folder. This callback sets all three: ``save_last=True``,
    ``every_n_train_steps`` (default 500), and ``dirpath`` (default ``<default_root_dir>/checkpoints``, whatever the
    logger). Run the same command again with ``ckpt_path="last"``: training continues from the last saved step, and
    ``FastImageDataModule`` continues mid-epoch with the same samples, crops and flips (its loader state is in the
    checkpoint). On the very first run ``"last"`` finds nothing: Lightning warns and trains from the start.

    Only ``last.ckpt`` is kept (``save_top_k=0``); add a ``ModelCheckpoint(monitor=...)`` of your own for the best
    model. A kill loses at most ``every_n_train_steps - 1`` steps, which the resumed run trains again. The end of a
    completed fit is saved too, whatever the step: running the same command once more restores it, says the fit is
    complete and trains nothing (raise ``max_epochs`` or ``max_steps`` to train on from it).

    Args:
        every_n_train_steps: save ``last.ckpt`` every this many optimizer steps. Each save writes the model and
            optimizer state: keep the interval well above the time one save takes.
        dirpath: the checkpoint folder; default ``<Trainer default_root_dir>/checkpoints``, the same on every run
            from the same working directory. Give every experiment its own.
        filename: as ``ModelCheckpoint``'s, for the checkpoints ``save_top_k`` keeps.
        save_top_k: as ``ModelCheckpoint``'s; default ``0``: only ``last.ckpt``.

    Raises:
        InvalidArgumentError: ``every_n_train_steps`` is below 1.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_fastdata import ResumeCheckpoint
        >>> trainer = Trainer(max_epochs=10, callbacks=[ResumeCheckpoint(every_n_train_steps=200)])
        >>> trainer.fit(model, datamodule=dm, ckpt_path="last")  # doctest: +SKIP

        From the command line or a config::

            lightning-fastdata fit --config config.yaml --ckpt_path last \
                --trainer.callbacks+=lightning_fastdata.ResumeCheckpoint \
                --trainer.callbacks.every_n_train_steps=200

    """

    def __init__(
        self,
        every_n_train_steps: int = 500,
        dirpath: str | None = None,
        filename: str | None = None,
        save_top_k: int = 0,
    ) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise InvalidArgumentError(
                f"`every_n_train_steps` must be an int >= 1, got {every_n_train_steps!r}: the steps between two saves"
                " of `last.ckpt`."
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            save_last=True,
            save_top_k=save_top_k,
            every_n_train_steps=every_n_train_steps,
        )

    def _default_dirpath(self, trainer: pl.Trainer) -> None:
        """Default the folder to ``<default_root_dir>/checkpoints``, not the logger's per-version folder."""
        if self.dirpath is None:
            root = str(trainer.default_root_dir)
            folder = os.path.join(root, "checkpoints")
            self.dirpath = folder if "://" in root else os.path.realpath(os.path.expanduser(folder))
            self._fs = get_filesystem(self.dirpath)  # as ModelCheckpoint sets it for a `dirpath` passed in

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Set the default folder, then as ``ModelCheckpoint``."""
        self._default_dirpath(trainer)
        super().setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._steps_at_start: int | None = None  # set when training starts: not at all when the restored fit is done

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._steps_at_start = trainer.global_step

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Say so when the restored checkpoint was a completed fit, so this run trained nothing."""
        loop = trainer.fit_loop
        if self._steps_at_start is not None or trainer.ckpt_path is None:
            return
        # `loop.done` would say "`Trainer.fit` stopped" a second time: its two limits, read directly
        steps_done = 0 <= loop.max_steps <= trainer.global_step
        epochs_done = loop.max_epochs is not None and 0 <= loop.max_epochs <= loop.epoch_progress.current.processed
        if steps_done or epochs_done:
            limit = f"max_steps={loop.max_steps}" if steps_done else f"max_epochs={loop.max_epochs}"
            rank_zero_info(
                f"ResumeCheckpoint: {trainer.ckpt_path} is the end of a completed fit ({limit}, step"
                f" {trainer.global_step}): this run trained nothing. Raise `max_epochs` or `max_steps` to train on from"
                " it, or pass another `dirpath` (or `default_root_dir`) to start a new run."
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last.ckpt`` at the fit's last step when the periodic saves stopped short of it."""
        start = getattr(self, "_steps_at_start", None)
        stepped = start is not None and trainer.global_step > start
        if stepped and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:  # ModelCheckpoint's own (recent Lightning saves `last.ckpt` there when nothing was saved yet)
            super().on_train_end(trainer, pl_module)

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # `fit(ckpt_path="last")` asks each ModelCheckpoint for its last checkpoints before any callback's `setup`;
        # no public hook runs earlier, so the default folder is also set here (else the logger's would be searched)
        self._default_dirpath(trainer)
        return super()._find_last_checkpoints(trainer)
