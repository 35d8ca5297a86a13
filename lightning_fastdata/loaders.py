"""The loader of each split of a DataModule, from its :class:`~.plans.LoaderPlan`: one ``create_loader`` call.

``FastImageDataModule``'s ``*_dataloader`` hooks and ``tuning_loader`` build through :func:`split_loader`, with the
worker count and engine its :mod:`~lightning_fastdata.workers` choice resolved (a
:class:`~lightning_fastdata.tuning.LoaderConfig`), the loader output (:func:`uses_device_decode` decides whether JPEGs
travel still encoded), the device stage for the Trainer's device and, for training, the batch size clamped to the
split (:func:`clamp_batch_size`) and the image size of each epoch (``before_epoch``).
:mod:`lightning_fastdata.pipeline` follows a sample from record to device batch.

Each function takes the values it needs and returns one. :class:`SplitLoaders`, the DataModule's loader side, keeps
what a run's loaders share: the worker count and engine chosen, the device stage of the last loader built (which
``on_after_batch_transfer`` reuses), the skip counter and the warnings given once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_fastdata.pipeline import FastLoader, create_loader
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.device import DeviceStage, loader_output, trains_on_cuda
from lightning_fastdata.pipeline.kernel import Output
from lightning_fastdata.plans import LoaderPlan
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import Normalizer
from lightning_fastdata.tuning import LoaderConfig
from lightning_fastdata.workers import WorkerChoice, quiet_lightning_worker_check, tune_key


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


class SplitLoaders:
    """The loader side of a DataModule: builds each split's loader (:func:`split_loader`) and keeps what they share.

    The DataModule resolves the worker count and engine through it (:attr:`workers`), builds each loader with
    :meth:`build` and runs the device stage of the last one built in ``on_after_batch_transfer`` (:meth:`on_device`).
    """

    def __init__(self) -> None:
        #: the worker count and engine chosen (``num_workers="tune"``'s pick among them), and what was said about them
        self.workers = WorkerChoice()
        #: the warnings given once (``"decode"``: no CUDA for ``decode="device"``)
        self.warned: set[str] = set()
        #: counts the samples left out under ``on_bad_sample="skip"`` (across DataLoader workers)
        self.skip_counter = SkipCounter()
        #: the device stage of the last loader built (for the Trainer it was built for), which :meth:`on_device` reuses
        self.stage: DeviceStage | None = None
        #: whether the loaders run the device stage themselves, on the side stream
        self.stage_in_loader = False

    def uses_device_decode(self, decode: str, device: torch.device) -> bool:
        """Whether JPEGs are decoded on ``device`` (:func:`uses_device_decode`, warned once)."""
        return uses_device_decode(decode, device, self.warned)

    def output(self, decode: str, device: torch.device) -> Output:
        """What the loaders read: encoded for device decode, uint8 for CUDA, normalized float on a CPU."""
        return loader_output(self.uses_device_decode(decode, device), device)

    def engine(self, plan: LoaderPlan, device: torch.device, workers: int) -> Literal["threads", "processes"]:
        """The engine for ``workers``: ``plan.engine``, or ``"auto"``'s choice, logged once (:class:`.WorkerChoice`)."""
        return self.workers.engine(plan, lambda: self.output(plan.decode, device), workers)

    def config(self, plan: LoaderPlan, trainer: Any, workers: int, engine: str) -> LoaderConfig:
        """``plan``'s loader configuration with ``workers`` on ``engine``; pinned by default when training on CUDA."""
        return LoaderConfig(workers, plan.batch_size, plan.prefetch_factor, _pins(plan, trainer), engine)

    def tuned_workers(
        self,
        plan: LoaderPlan,
        trainer: Any,
        device: torch.device,
        cache_root: Path,
        database: Callable[[], Path],
        transform: Callable[[], Any],
        budget: Callable[[], int],
        loader: Callable[[LoaderConfig], Any],
    ) -> int:
        """``num_workers="tune"``'s pick: cached, or measured on ``loader`` (``WorkerChoice.tuned_workers``).

        ``database`` and ``transform`` (the training transform) key the cached pick (:func:`~.workers.tune_key`).
        """

        def output() -> str:
            return self.output(plan.decode, device)

        def key() -> str:
            return tune_key(plan, database(), transform(), output(), trainer)

        return self.workers.tuned_workers(plan, cache_root, key, budget, loader, output, _pins(plan, trainer))

    def device_stage(
        self,
        normalizer: Normalizer,
        dtype: torch.dtype,
        device: torch.device,
        image_size: int,
        color: BatchColor | None,
        channels_last: bool,
        skips: bool,
    ) -> DeviceStage:
        """The on-device transform of the batches, for ``device`` and ``dtype`` (skipped samples counted here)."""
        return DeviceStage(
            normalizer,
            dtype=dtype,
            channels_last=channels_last,
            device=device,
            image_size=image_size,
            skip=self.skip_counter.skip if skips else None,
            color=color,
        )

    def build(
        self,
        dataset: Dataset,
        plan: LoaderPlan,
        config: LoaderConfig,
        stage: DeviceStage,
        device: torch.device,
        trainer: Any,
        *,
        train: bool,
        drop_last: bool,
        return_index: bool,
        normalizer: Normalizer,
        color: BatchColor | None,
        before_epoch: Callable[[int], Hashable],
        prefetch: bool,
    ) -> FastLoader:
        """The loader of ``dataset`` (:func:`split_loader`), shuffled and coloured with ``train``; keeps its ``stage``.

        ``prefetch``: the loader copies batches ahead to ``device`` (the DataModule's ``uses_prefetch()``, which a
        subclass may override). Keeps whether the loader runs ``stage`` itself, on the side stream
        (:attr:`stage_in_loader`).
        """
        self.stage = stage
        loader = split_loader(
            dataset,
            plan,
            config,
            shuffle=train,
            drop_last=drop_last,
            output=self.output(plan.decode, device),
            normalizer=normalizer,
            stage=stage,
            trainer=trainer,
            train=train,
            return_index=return_index,
            prefetch_device=device if prefetch else None,
            color=color if train else None,
            skip_counter=self.skip_counter,
            before_epoch=before_epoch,
        )
        self.stage_in_loader = loader.prefetching
        return loader

    def on_device(self, batch: Any, stage: Callable[[], DeviceStage], beside: dict[str, Any] | None = None) -> Any:
        """``batch`` through the device stage built with the loader (else ``stage()``'s), unless the loader ran it.

        ``beside``: the fields taken beside the batch before its transfer (its colour parameters).
        """
        if self.stage_in_loader:
            return batch
        return (self.stage or stage())(batch, beside)


def _pins(plan: LoaderPlan, trainer: Any) -> bool:
    """Whether the loaders pin their batches: ``plan.pin_memory``, by default when training on CUDA."""
    return trains_on_cuda(trainer) if plan.pin_memory is None else plan.pin_memory
