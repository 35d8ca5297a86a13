"""The loader of each split of a DataModule, from its :class:`~.plans.LoaderPlan`: one ``create_loader`` call.

``FastImageDataModule``'s ``*_dataloader`` hooks and ``tuning_loader`` build through :func:`split_loader`, with the
worker count and engine its :mod:`~lightning_fastdata.workers` choice resolved (a
:class:`~lightning_fastdata.tuning.LoaderConfig`), the loader output (:func:`uses_device_decode` decides whether JPEGs
travel still encoded), the device stage for the Trainer's device and, for training, the batch size clamped to the
split (:func:`clamp_batch_size`) and the image size of each epoch (``before_epoch``).
:mod:`lightning_fastdata.pipeline` follows a sample from record to device batch.

Each function takes the values it needs and returns one; the DataModule keeps what they return.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_fastdata.pipeline import FastLoader, create_loader
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.device import DeviceStage
from lightning_fastdata.pipeline.kernel import Output
from lightning_fastdata.plans import LoaderPlan
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import Normalizer
from lightning_fastdata.tuning import LoaderConfig
from lightning_fastdata.workers import quiet_lightning_worker_check


def split_loader(
    dataset: Dataset,
    plan: LoaderPlan,
    config: LoaderConfig,
    *,
    shuffle: bool,
    drop_last: bool,
    output: Output,
    normalizer: Normalizer,
    stage: DeviceStage,
    trainer: Any,
    train: bool = False,
    return_index: bool = False,
    prefetch_device: torch.device | None = None,
    color: BatchColor | None = None,
    skip_counter: SkipCounter | None = None,
    before_epoch: Callable[[int], Hashable] | None = None,
) -> FastLoader:
    """The loader of one split, with ``plan``'s settings and ``config``'s workers, engine, batch size and pinning.

    Args:
        dataset: the split.
        plan: the DataModule's loader settings.
        config: the resolved worker count, engine, batch size, prefetch factor and pinning (or a tuning sweep's).
        shuffle: shuffle the order (seeded by ``plan.seed`` and the epoch).
        drop_last: drop the last incomplete batch.
        output: what the batch reader gives (``"uint8"``, ``"float"``, ``"encoded"``).
        normalizer: the mean and std.
        stage: the device stage, run on the side stream when ``prefetch_device`` is a CUDA device.
        trainer: the Trainer, for the DDP shard and ``limit_train_batches`` (``None``: one process).
        train: the training loader: resumable, with the Trainer's batch limit.
        return_index: batches end with each sample's dataset index.
        prefetch_device: copy batches ahead to this device (``None``: Lightning copies them).
        color: the training batches' colour augmentation.
        skip_counter: counts the samples left out, when ``plan.skips``.
        before_epoch: called with the epoch as each epoch starts (the image size schedule).

    """
    engine, workers = config.engine, config.num_workers
    if engine == "threads" and workers > 0:
        quiet_lightning_worker_check()
        if plan.worker_nice:
            rank_zero_warn(
                f"`worker_nice={plan.worker_nice}` lowers the priority of worker processes, but this loader builds its"
                " batches on threads of the training process: it has no effect. Pass `engine='processes'` to use it."
            )
    # A DistributedSampler seeded with `seed` in every case: Lightning leaves a DistributedSampler in place and
    # calls its `set_epoch` each epoch, so shuffling changes by epoch, is reproducible from `seed`, and shards
    # across ranks with the Trainer's own `distributed_sampler_kwargs` (num_replicas, rank).
    dist_kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
    limit = getattr(trainer, "limit_train_batches", 1.0) if train else 1.0
    # colour augmentation (training only): drawn per sample where the batch is built; a CPU run's loader colours
    # each crop before normalizing it, a CUDA run's device stage colours the uint8 batch on the device
    if color is not None and output == "encoded":
        raise ValueError(
            "Colour augmentation (`color_jitter`, `grayscale_p`, `blur_p`, `solarize_p`) is not available with"
            " `decode='device'` yet: pass `decode='cpu'`."
        )
    return create_loader(
        dataset,
        config.batch_size,
        shuffle=shuffle,
        seed=plan.seed,
        num_replicas=dist_kwargs.get("num_replicas", 1),
        rank=dist_kwargs.get("rank", 0),
        resumable=train,
        drop_last=drop_last,
        engine=engine,  # type: ignore[arg-type]
        workers=workers,
        prefetch_factor=config.prefetch_factor,
        persistent_workers=plan.persistent_workers,
        output=output,
        normalizer=normalizer,
        channels_last=plan.channels_last,
        skip_counter=skip_counter if plan.skips else None,
        pin_memory=config.pin_memory,
        device=prefetch_device,
        device_stage=stage,
        limit_batches=limit if isinstance(limit, (int, float)) else 1.0,
        return_index=return_index,
        color=color,
        worker_nice=plan.worker_nice,
        before_epoch=before_epoch,
    )


def clamp_batch_size(batch_size: int, samples: int, trainer: Any) -> int:
    """``batch_size``, or this process's share of a training split of ``samples`` when that is smaller (with a warning).

    The share is what a DistributedSampler gives each of the Trainer's processes. The DataModule keeps the result as
    its ``batch_size`` and saved ``batch_size``, so Lightning's ``BatchSizeFinder`` (which reads the saved value) stops
    there, and a checkpoint says what trained.
    """
    replicas = (getattr(trainer, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
    share = max(1, math.ceil(samples / replicas))  # a DistributedSampler pads every rank to the same share
    if batch_size <= share:
        return batch_size
    per_process = f" ({share} per process on {replicas})" if replicas > 1 else ""
    rank_zero_warn(
        f"`batch_size={batch_size}` is larger than the training split's {samples} images{per_process}, and"
        f" `drop_last=True` would leave no batch to train on: batches hold {share} instead, one an epoch. Pass"
        f" `batch_size` <= {share} (a batch size finder stops here by itself), or `drop_last=False`."
    )
    return share


def uses_device_decode(decode: str, device: torch.device, warned: set[str]) -> bool:
    """Whether JPEGs are decoded on ``device`` (``decode="device"`` on CUDA); warns once when CUDA is missing.

    ``warned``: the warnings given so far (the DataModule's); ``"decode"`` is added before this one is given, so it is
    given once even where warnings are errors.
    """
    if decode != "device":
        return False
    if device.type == "cuda":
        return True
    if "decode" not in warned:
        warned.add("decode")
        rank_zero_warn(
            f"`decode='device'` needs a CUDA device, but training runs on {device.type}: decoding on the"
            " CPU in the DataLoader workers instead."
        )
    return False
