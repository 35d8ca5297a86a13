"""The loader side of ``FastImageDataModule``: each split's loader, its workers, and the batch on the device.

A facet of :class:`~lightning_fastdata.FastImageDataModule`, a mixin of its own module as Lightning composes its large
public classes (:mod:`lightning_fastdata.datamodule_data` tells how): :class:`LoaderSide` turns the datasets of
:class:`~lightning_fastdata.datamodule_data.DataSide` into loaders (the ``*_dataloader`` hooks), with the worker count
and engine resolved for this machine, sets the image size they crop to (:meth:`~LoaderSide.set_image_size`, and the
schedule at each epoch's start), and finishes each batch on the device (the ``on_*_batch_transfer`` hooks).

The work itself is :class:`~lightning_fastdata.loaders.SplitLoaders`' and the functions of :mod:`.workers`,
:mod:`.resizing` and :mod:`.pipeline.device`, which take the DataModule's plans and values, never the DataModule. A
facet is part of the DataModule: it reads the DataModule's attributes, declared as annotations (set by its
``__init__``, or given by its plans and its other facet; :class:`~lightning_fastdata.datamodule_data.DataModuleState`
declares those both facets read), and never imports :mod:`lightning_fastdata.datamodule`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fastdata import loaders, resizing
from lightning_fastdata.datamodule_data import DataModuleState
from lightning_fastdata.pipeline import DeviceStage, FastLoader
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.device import batch_dtype, trainer_device, uses_prefetch
from lightning_fastdata.pipeline.schema import split_beside
from lightning_fastdata.splits import missing_split
from lightning_fastdata.transforms import Normalizer
from lightning_fastdata.tuning import LoaderConfig
from lightning_fastdata.workers import budget_for, default_workers


class LoaderSide(DataModuleState):
    """Each split's loader, its worker count and engine, the image size it crops to, and the batch on the device.

    The ``*_dataloader`` and ``on_*_batch_transfer`` hooks of :class:`~lightning_fastdata.FastImageDataModule`, and
    :meth:`set_image_size`.
    """

    # what this facet also reads of the DataModule: its arguments, as its `__init__` sets them
    hparams: Any
    image_size_schedule: dict[int, int] | None
    _base_size: int
    batch_size: int
    _tunes_workers: bool
    normalizer: Normalizer
    channels_last: bool
    drop_last: bool
    prefetch_to_device: bool | None
    decode: Literal["cpu", "device"]
    on_bad_sample: Literal["raise", "skip"]
    return_index: bool
    _color: BatchColor | None
    _beside: dict[str, Any]
    # what the data side answers
    cache_root: Path
    database_path: Path
    train_transform: Callable[[], Callable[[torch.Tensor], Any]]
    val_transform: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    build_dataset: Callable[[str, Callable[[Any], Any] | None], Dataset]
    resolved_predict_split: Callable[[Sequence[str] | None], str]

    # --- Loaders ------------------------------------------------------------------------------------------------

    @property
    def tunes_workers(self) -> bool:
        """Whether ``num_workers`` is ``num_workers="tune"``'s pick (measured on this machine), once it is made."""
        return self._tunes_workers

    @property
    def skipped_samples(self) -> int:
        """Samples left out so far under ``on_bad_sample="skip"`` (counted across DataLoader workers)."""
        return self._loaders.skip_counter.value

    def worker_budget(self) -> int:
        """Workers per process that the usable CPUs allow (:func:`~lightning_fastdata.workers.budget_for`)."""
        return budget_for(self.trainer)

    def resolved_num_workers(self) -> int:
        """The worker count the loaders use (``"auto"`` resolved; a value above the budget warns once).

        ``num_workers="tune"``'s pick is also ``num_workers`` from then on; the saved hyperparameter stays ``"tune"``.
        """
        plan, budget = self.loader_plan, self.worker_budget()
        workers = self._loaders.workers.num_workers(plan, budget, self.trainer, self._tuned_workers)
        if self.num_workers == "tune":
            self.num_workers = workers
        return workers

    def _tuned_workers(self) -> int:
        """``num_workers="tune"``'s pick: cached, or measured on :meth:`tuning_loader` (``WorkerChoice``)."""
        return self._loaders.tuned_workers(
            self.loader_plan, self.trainer, self._device(), self.cache_root, lambda: self.database_path,
            self.train_transform, self.worker_budget, self.tuning_loader,
        )  # fmt: skip

    def resolved_engine(self, workers: int | None = None) -> Literal["threads", "processes"]:
        """The engine the loaders use: ``engine``, or ``"auto"``'s choice, logged once (``WorkerChoice.engine``).

        ``workers`` defaults to the budget, or to ``num_workers`` when it is a number.
        """
        plan = self.loader_plan
        if workers is None:
            workers = default_workers(plan, self.worker_budget)
        return self._loaders.engine(plan, self._device(), workers)

    def tuning_loader(self, config: LoaderConfig) -> DataLoader:
        """The training loader as ``fit`` builds it, with ``config``'s settings: what ``"tune"`` and ``bench`` time."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return self._loader(
            self.train_dataset, drop_last=self.drop_last, train=True, config=config, return_index=self.return_index
        )

    def _loader(
        self,
        dataset: Dataset,
        drop_last: bool = False,
        train: bool = False,
        config: LoaderConfig | None = None,
        return_index: bool = False,
    ) -> FastLoader:
        """The loader of ``dataset`` (:meth:`.SplitLoaders.build`): shuffled, resumable and scheduled with ``train``.

        ``config``: a tuning sweep's workers, engine, batch size and pinning, else this DataModule's, resolved.
        """
        scheduled = train and config is None
        if config is None:
            workers = self.resolved_num_workers()
            config = self._loaders.config(self.loader_plan, self.trainer, workers, self.resolved_engine(workers))
        stage = self._device_stage()
        return self._loaders.build(
            dataset, self.loader_plan, config, stage, self._device(), self.trainer, train=train, drop_last=drop_last,
            return_index=return_index, normalizer=self.normalizer, color=self._color,
            before_epoch=functools.partial(self._start_epoch, stage, scheduled), prefetch=self.uses_prefetch(),
        )  # fmt: skip

    def _device(self) -> torch.device:
        return trainer_device(self.trainer)

    def uses_prefetch(self) -> bool:
        """Whether loaders copy batches ahead on a side CUDA stream (``prefetch_to_device``, resolved)."""
        return uses_prefetch(self.prefetch_to_device, self._device())

    def uses_device_decode(self) -> bool:
        """Whether JPEGs are decoded on the GPU (``decode="device"`` on CUDA); warns once when CUDA is missing."""
        return self._loaders.uses_device_decode(self.decode, self._device())

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, seeded ``(images, targets)`` batches: ``views`` for images with ``views``, ``index`` last too.

        ``index`` with ``return_index``. Targets of the database's kind (:attr:`target_kind`: ``int64 [B]``,
        multi-hot ``float32 [B, C]``, ``float32 [B, K]`` or ``[B]``, ``-1``). Images normalized ``float32`` for CPU
        training, ``uint8`` NCHW for CUDA (normalized on the device). A ``batch_size`` above this process's share is
        clamped (:meth:`clamp_batch_size`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        if self.drop_last:
            self.clamp_batch_size()
        return self._loader(self.train_dataset, drop_last=self.drop_last, train=True, return_index=self.return_index)

    def clamp_batch_size(self) -> int:
        """Lower ``batch_size`` to this process's share of the training split when larger, with a warning; returns it.

        The saved ``batch_size`` changes too (:func:`lightning_fastdata.loaders.clamp_batch_size`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        share = loaders.clamp_batch_size(self.batch_size, len(self.train_dataset), self.trainer)  # type: ignore[arg-type]
        if share != self.batch_size:
            self.batch_size = share
            if "batch_size" in self.hparams:
                self.hparams["batch_size"] = share
        return share

    @override
    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Validation batches in order (an empty list when there is no validation data)."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset)

    @override
    def test_dataloader(self) -> DataLoader:
        """Batches of the ``test`` split (a ``test/``, ``testing/``, ... folder), in order, with validation transforms.

        Raises:
            MissingSplitError: the database has no test split (a ``ValueError``).

        """
        if self._database.splits is None:
            self.setup("test")
        if self.test_dataset is None:
            raise missing_split(self.database_path, self._database.splits, "test")
        return self._loader(self.test_dataset)

    @override
    def predict_dataloader(self) -> DataLoader:
        """Batches of :meth:`resolved_predict_split`, in order; :meth:`predict_sources` maps them back to files."""
        if self.predict_dataset is None:
            self.predict_dataset = self.build_dataset(self.resolved_predict_split(), self.val_transform())
        return self._loader(self.predict_dataset, return_index=self.return_index)

    # --- The image size: set here, reaching the loaders through :func:`.resizing.apply_size` ---------------------

    def set_image_size(self, size: int) -> None:
        """Crop to ``size`` (an int >= 1) from now on: progressive resizing and FixRes (docs/datamodule.md).

        The loaders' crops change size as their next epoch starts (the datasets and their transforms stay as built),
        and the crops of ``decode="device"`` at once. Call it before ``fit`` or from ``on_train_epoch_start``. What
        changes and when, what it warns: :mod:`lightning_fastdata.resizing`. ``image_size`` changes; the saved
        hyperparameter stays the configured one.
        """
        size = resizing.check_size(size)
        if size == self.image_size:
            return
        previous, self.image_size = self.image_size, size
        built = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}
        opened = self.data_plan if self._database.splits is not None else None  # checks its stored images
        resizing.apply_size(size, previous, built, self._loaders.stage, opened)

    def _start_epoch(self, stage: DeviceStage, scheduled: bool, epoch: int) -> int:
        """A loader's ``before_epoch``: the schedule's size of ``epoch`` (``scheduled``), the current one for ``stage``.

        The size is set through :meth:`set_image_size` (a subclass's override counts); a loader whose persistent worker
        processes started at another size restarts them, as the returned size changed.
        """
        if scheduled and self.image_size_schedule:
            self.set_image_size(resizing.size_at(self.image_size_schedule, epoch, self._base_size))
        stage.image_size = self.image_size
        return self.image_size

    # --- On the device ------------------------------------------------------------------------------------------

    def batch_dtype(self) -> torch.dtype:
        """The dtype images are converted to: float32, or the Trainer's true-precision dtype."""
        return batch_dtype(self.trainer)

    def _device_stage(self) -> DeviceStage:
        """The on-device transform of this DataModule's batches, for the Trainer's device and precision."""
        return self._loaders.device_stage(
            self.normalizer, self.batch_dtype(), self._device(), self.image_size, self._color, self.channels_last,
            self.on_bad_sample == "skip",
        )  # fmt: skip

    def to_model_input(self, batch: Any) -> Any:
        """uint8 images, or still-encoded ones, in the first element of a batch -> normalized floats on its device.

        The device stage (:class:`~lightning_fastdata.pipeline.device.DeviceStage`); a float batch only takes the dtype.
        """
        return self._device_stage()(batch)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Take the fields that travel beside the batch (its colour parameters) for the device stage.

        The transfer (and a LightningModule's ``transfer_batch_to_device``) moves the plain batch; the device stage
        takes them in :meth:`on_after_batch_transfer`, which Lightning calls next for the same batch.
        """
        batch, self._beside = split_beside(batch)
        return batch

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn the uint8 images (first element of the batch) into normalized floats on the batch's device.

        Nothing to do when the loader already did it on the side stream; otherwise the stage built with the loader
        runs here (one object for the run, not one per batch), with the fields taken beside the batch.
        """
        beside, self._beside = self._beside, {}
        return self._loaders.on_device(batch, self._device_stage, beside)
