"""The data side of ``FastImageDataModule``: where the data is, what it holds, and its datasets.

Lightning builds its large public classes from facets, each a mixin of its own module:
``LightningDataModule(DataHooks, HyperparametersMixin)``, ``LightningModule(..., ModelHooks, DataHooks,
CheckpointHooks, Module)``. :class:`~lightning_fastdata.FastImageDataModule` does the same: this facet,
:class:`DataSide`, answers where the database is (``data_dir`` itself, its conversion or its staged copy), what its
samples' targets are and where each came from, prepares and opens it (the ``prepare_data`` and ``setup`` hooks) and
builds each split's dataset with its transform (the extension points a subclass overrides);
:class:`~lightning_fastdata.datamodule_loaders.LoaderSide` feeds the datasets to the model.

The work itself is :class:`~lightning_fastdata.database.Database`'s and the functions of :mod:`.resolve` and
:mod:`.splits`, which take the DataModule's plans, never the DataModule. A facet is part of the DataModule: it reads
the DataModule's attributes, declared as annotations (set by its ``__init__``, or given by its plans and its other
facet; :class:`DataModuleState` declares those both facets read), and never imports
:mod:`lightning_fastdata.datamodule`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.hooks import DataHooks
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_fastdata import resolve
from lightning_fastdata.database import Database
from lightning_fastdata.hparams import say_clashes
from lightning_fastdata.loaders import SplitLoaders
from lightning_fastdata.pipeline.views import MultiViewCrop, ViewGroup
from lightning_fastdata.plans import AugmentPlan, DataPlan, LoaderPlan
from lightning_fastdata.splits import missing_split, pick_predict_split, split_sources
from lightning_fastdata.store import cache, remote
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.store.targets import TargetSpec
from lightning_fastdata.transforms import CenterCropResize, RandomResizedCropFlip


class DataModuleState(DataHooks):
    """What both facets of the DataModule read: its Trainer, its split datasets, its components and its plans.

    Declarations only (a facet's contract with the DataModule, which sets each of them); the facets' hooks override
    those of Lightning's :class:`~lightning.pytorch.core.hooks.DataHooks`, as ``LightningDataModule``'s do.
    """

    trainer: Trainer | None
    train_dataset: Dataset | None
    val_dataset: Dataset | None
    test_dataset: Dataset | None
    predict_dataset: Dataset | None
    #: the data side's work: the database, staged or converted, and its splits once open
    _database: Database
    #: the loader side's work: worker count and engine, the device stage of the last loader, what was warned once
    _loaders: SplitLoaders
    data_plan: DataPlan
    loader_plan: LoaderPlan
    num_workers: int | Literal["auto", "tune"]
    image_size: int


class DataSide(DataModuleState):
    """Where the data is and what it holds: the database, its targets and sources, its splits' datasets.

    The ``prepare_data`` and ``setup`` hooks of :class:`~lightning_fastdata.FastImageDataModule`, and the extension
    points :meth:`train_transform`, :meth:`val_transform` and :meth:`build_dataset`.
    """

    # what this facet also reads of the DataModule: its arguments, as its `__init__` sets them
    data_dir: str
    cache_dir: str | None
    views: list[ViewGroup] | None
    scale: tuple[float, ...]
    crop_fraction: float
    short_side: int | None
    quality: int
    encoding: Literal["jpeg", "raw"]
    predict_split: str | None
    max_pixels: int | None
    targets: Literal["class", "multilabel", "float", "none"] | None
    label_separator: str
    _warned_hparams: set[tuple[str, str, str]]
    # a plan, its saved arguments' clashes, and what the loader side answers
    augment_plan: AugmentPlan
    hparams_clashes: dict[str, tuple[Any, Any]]
    worker_budget: Callable[[], int]
    resolved_engine: Callable[..., Literal["threads", "processes"]]
    _tuned_workers: Callable[[], int]

    # --- Where the data is --------------------------------------------------------------------------------------

    @property
    def is_database(self) -> bool:
        """Whether ``data_dir`` already is a converted database (then nothing is converted), here or at a URL."""
        return self.is_remote or resolve.is_database(self.data_dir)

    @property
    def is_remote(self) -> bool:
        """Whether ``data_dir`` is a URL, whose database is staged into ``cache_dir`` (:attr:`staging`)."""
        return remote.is_url(self.data_dir)

    @property
    def staging(self) -> remote.StagedDatabase | None:
        """What staging ``data_dir`` did in this process (fetched, fetched again and why, reused); ``None``: nothing."""
        return self._database.staged

    @property
    def cache_root(self) -> Path:
        """The directory holding conversions and the ``num_workers="tune"`` cache."""
        return cache.cache_root(self.cache_dir)

    @property
    def database_path(self) -> Path:
        """The database that is read: ``data_dir`` itself, or its conversion under ``cache_dir``."""
        return resolve.database_path(
            self.data_dir, self.cache_root, self.store_short_side(), self.quality, self.encoding, self.targets,
            self.label_separator,
        )  # fmt: skip

    def store_short_side(self) -> int | None:
        """The short side a conversion stores (``None``: original sizes): ``short_side``, or one fit for the crops."""
        return resolve.store_short_side(self.short_side, max(self.augment_plan.sizes), self.crop_fraction)

    @property
    def classes(self) -> list[str]:
        """Class names: from the database, or before conversion from the folder names (nothing is read)."""
        return self._database.classes(self.data_plan)

    @property
    def num_large_views(self) -> int:
        """Training views of the largest size per image (``views``' first groups; 1 without ``views``)."""
        if self.views is None:
            return 1
        return sum(g.count for g in self.views if g.size == self.views[0].size)

    @property
    def num_small_views(self) -> int:
        """Training views smaller than the largest per image (DINO's local crops; 0 without ``views``)."""
        return 0 if self.views is None else sum(g.count for g in self.views) - self.num_large_views

    @property
    def num_classes(self) -> int:
        """Classes of a ``class`` or ``multilabel`` database (``C``); 0 for ``float`` and ``none`` targets."""
        classes = self.classes  # before conversion or staging: a folder's, or the error that says to stage first
        return len(classes) if self.target_kind in ("class", "multilabel") else 0

    # --- Targets and where each sample came from ----------------------------------------------------------------

    @property
    def target_spec(self) -> TargetSpec:
        """What each sample's target is (:mod:`~lightning_fastdata.store.targets`): the database's, else classes."""
        return self._database.target_spec(self.data_plan)

    @property
    def target_kind(self) -> str:
        """``"class"``, ``"multilabel"``, ``"float"`` or ``"none"``: what batches hold (:meth:`train_dataloader`)."""
        return self.target_spec.kind

    @property
    def target_dim(self) -> int:
        """Values per sample of a ``float`` target (``K``), else 0."""
        return self.target_spec.dim

    def sources(self, split: str | None = None) -> list[str]:
        """Where each index of ``split`` came from: ``sources(split)[index]`` names the file of a batch's ``index``.

        ``split`` defaults to the training split. What an entry is, and the errors: :func:`.splits.split_sources`.
        """
        return split_sources(self.database_path, split)

    # --- Lightning hooks ----------------------------------------------------------------------------------------

    @override
    def prepare_data(self) -> None:
        """Convert ``data_dir`` once, or stage it from its URL (one process per node; an up-to-date copy is reused)."""
        self._database.prepare(self.data_plan)
        if self.num_workers == "tune":  # measured here, on one process per node, so the ranks read the cache
            self.num_workers = self._tuned_workers()

    @override
    def setup(self, stage: str) -> None:
        """Open the database's splits (:func:`~lightning_fastdata.splits.open_splits`); only ``fit`` needs ``train``.

        Without a ``val`` split, ``val_fraction`` of ``train`` is held out (seeded).
        """
        # before Lightning merges the hyperparameters, which it does after `setup`
        say_clashes(self.trainer, self.hparams_clashes, self._warned_hparams)
        if self.train_dataset is None and (self._database.splits is None or stage == "fit"):
            # again after `train_dataset = None`: the same splits and holdout (seeded), rebuilt
            opened = self._database.open(
                self.data_plan, self.predict_split, self.build_dataset, self.train_transform, self.val_transform
            )
            for name in ("train", "val", "test"):  # a split the database lacks leaves its dataset as it was
                if getattr(opened, name) is not None:
                    setattr(self, f"{name}_dataset", getattr(opened, name))
        if stage == "fit" and self.train_dataset is None:
            raise missing_split(self.database_path, self._database.splits, "train")
        if stage == "fit":
            self._loaders.workers.say_shared_generators(
                self.train_dataset, self.loader_plan, self.worker_budget, self.resolved_engine
            )

    def resolved_predict_split(self, splits: Sequence[str] | None = None) -> str:
        """The split ``predict_dataloader`` reads: ``predict_split``, else ``test``, else ``val``, else ``train``."""
        return pick_predict_split(self.database_path, self.predict_split, splits)

    def predict_sources(self) -> list[str]:
        """Where each sample of :meth:`predict_dataloader` came from, in its order (on one device; :meth:`sources`).

        Under DDP each rank predicts every ``world_size``-th sample (``DistributedSampler`` without shuffling); rank
        ``r``'s ``i``-th prediction is ``predict_sources()[r + i * world_size]`` (the last few may repeat).
        """
        return self.sources(self.resolved_predict_split())

    # --- Extension points ---------------------------------------------------------------------------------------

    def train_transform(self) -> Callable[[torch.Tensor], Any]:
        """The per-image training transform: uint8 CHW in, uint8 CHW ``image_size`` square out.

        With ``views``, a list of uint8 CHW crops, one per view, large views first
        (:class:`~lightning_fastdata.pipeline.views.MultiViewCrop`).
        """
        if self.views is not None:
            return MultiViewCrop(self.views)
        return RandomResizedCropFlip(self.image_size, scale=self.scale)  # type: ignore[arg-type]

    def val_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The per-image validation transform: uint8 CHW in, uint8 CHW ``image_size`` square out."""
        return CenterCropResize(self.image_size, crop_fraction=self.crop_fraction)

    def build_dataset(self, split: str, transform: Callable[[Any], Any] | None) -> Dataset:
        """The dataset of one split of the database; override to add fields or change decoding.

        It decodes as the built-in batch path does (``fast_decode=True``), so a transform of one's own for one split
        sees the same pixels as the built-in transform of another, and refuses images over ``max_pixels``.
        """
        return LmdbImageDataset(
            self.database_path, split=split, transform=transform, fast_decode=True, max_pixels=self.max_pixels
        )
