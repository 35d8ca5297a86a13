"""The loader of each split of a DataModule, with its settings: one ``create_loader`` call, on this process's shard.

``FastImageDataModule``'s ``*_dataloader`` hooks and ``tuning_loader`` build through :func:`split_loader`: the worker
count and engine its :mod:`~lightning_fastdata.workers` choice resolves, the loader output (:func:`uses_device_decode`
decides whether JPEGs travel still encoded) and the device stage for the Trainer's device, and, for training, the
batch size clamped to the split (:func:`clamp_batch_size`) and the image size of each epoch
(:func:`lightning_fastdata.resizing.start_epoch`). :mod:`lightning_fastdata.pipeline` follows a sample from record to
device batch.

The DataModule is read through its methods (``_output``, ``_device_stage``, ``set_image_size``...), so that a
subclass's overrides count.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_fastdata import resizing
from lightning_fastdata.pipeline import FastLoader, create_loader
from lightning_fastdata.tuning import LoaderConfig
from lightning_fastdata.workers import quiet_lightning_worker_check


def split_loader(
    dm: Any,
    dataset: Dataset,
    shuffle: bool,
    drop_last: bool,
    train: bool = False,
    config: LoaderConfig | None = None,
    return_index: bool = False,
) -> FastLoader:
    """The loader of one split of ``dm``, with its settings (or ``config``'s, for tuning).

    ``return_index``: batches end with each sample's dataset index (the training and predict loaders, where the
    conventions put it, with ``dm.return_index``).

    Keeps the loader's device stage on ``dm`` (``_stage``, which ``on_after_batch_transfer`` reuses) and whether the
    loader runs it itself (``_stage_in_loader``).
    """
    if config is None:
        workers, batch_size = dm.resolved_num_workers(), dm.batch_size
        engine = dm.resolved_engine(workers)
        prefetch_factor, pin_memory = dm.prefetch_factor, dm.pin_memory
    else:
        engine, workers, batch_size = config.engine, config.num_workers, config.batch_size
        prefetch_factor, pin_memory = config.prefetch_factor, config.pin_memory
    if engine == "threads" and workers > 0:
        quiet_lightning_worker_check()
        if dm.worker_nice:
            rank_zero_warn(
                f"`worker_nice={dm.worker_nice}` lowers the priority of worker processes, but this loader builds its"
                " batches on threads of the training process: it has no effect. Pass `engine='processes'` to use it."
            )
    trainer = dm.trainer
    # A DistributedSampler seeded with `seed` in every case: Lightning leaves a DistributedSampler in place and
    # calls its `set_epoch` each epoch, so shuffling changes by epoch, is reproducible from `seed`, and shards
    # across ranks with the Trainer's own `distributed_sampler_kwargs` (num_replicas, rank).
    dist_kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
    limit = getattr(trainer, "limit_train_batches", 1.0) if train else 1.0
    dm._stage = dm._device_stage()
    # colour augmentation (training only): drawn per sample where the batch is built; a CPU run's loader colours
    # each crop before normalizing it, a CUDA run's device stage colours the uint8 batch on the device
    color = getattr(dm, "_color", None) if train else None
    output = dm._output()
    if color is not None and output == "encoded":
        raise ValueError(
            "Colour augmentation (`color_jitter`, `grayscale_p`, `blur_p`, `solarize_p`) is not available with"
            " `decode='device'` yet: pass `decode='cpu'`."
        )
    loader = create_loader(
        dataset,
        batch_size,
        shuffle=shuffle,
        seed=dm.seed,
        num_replicas=dist_kwargs.get("num_replicas", 1),
        rank=dist_kwargs.get("rank", 0),
        resumable=train,
        drop_last=drop_last,
        engine=engine,  # type: ignore[arg-type]
        workers=workers,
        prefetch_factor=prefetch_factor,
        persistent_workers=dm.persistent_workers,
        output=output,
        normalizer=dm.normalizer,
        channels_last=dm.channels_last,
        skip_counter=dm._skip_counter if dm.on_bad_sample == "skip" else None,
        pin_memory=dm._on_cuda() if pin_memory is None else pin_memory,
        device=dm._device() if dm.uses_prefetch() else None,
        device_stage=dm._stage,
        limit_batches=limit if isinstance(limit, (int, float)) else 1.0,
        return_index=return_index,
        color=color,
        worker_nice=dm.worker_nice,
        before_epoch=functools.partial(resizing.start_epoch, dm, dm._stage, train and config is None),
    )
    dm._stage_in_loader = loader.prefetching
    return loader


def clamp_batch_size(dm: Any) -> int:
    """Lower ``dm.batch_size`` to this process's share of the training split when it is larger; returns it.

    The DataModule's attribute and its saved ``batch_size`` both change, so Lightning's ``BatchSizeFinder`` (which
    reads the saved value) stops there, and a checkpoint says what trained. Warns when it lowers it.
    """
    if dm.train_dataset is None:
        dm.setup("fit")
    samples = len(dm.train_dataset)
    replicas = (getattr(dm.trainer, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
    share = max(1, math.ceil(samples / replicas))  # a DistributedSampler pads every rank to the same share
    if dm.batch_size <= share:
        return dm.batch_size
    per_process = f" ({share} per process on {replicas})" if replicas > 1 else ""
    rank_zero_warn(
        f"`batch_size={dm.batch_size}` is larger than the training split's {samples} images{per_process}, and"
        f" `drop_last=True` would leave no batch to train on: batches hold {share} instead, one an epoch. Pass"
        f" `batch_size` <= {share} (a batch size finder stops here by itself), or `drop_last=False`."
    )
    dm.batch_size = share
    if "batch_size" in dm.hparams:
        dm.hparams["batch_size"] = share
    return share


def uses_device_decode(dm: Any) -> bool:
    """Whether ``dm``'s JPEGs are decoded on the GPU (``decode="device"`` on CUDA); warns once when CUDA is missing."""
    if dm.decode != "device":
        return False
    if dm._device().type == "cuda":
        return True
    if not dm._warned_decode:
        dm._warned_decode = True  # set before warning: once, even where warnings are errors
        rank_zero_warn(
            f"`decode='device'` needs a CUDA device, but training runs on {dm._device().type}: decoding on the"
            " CPU in the DataLoader workers instead."
        )
    return False
