"""What a ``FastImageDataModule``'s arguments resolve to, as immutable plans handed to the modules that do the work.

:class:`DataPlan`: where the data is and how it is read (:mod:`~lightning_fastdata.resolve`,
:mod:`~lightning_fastdata.splits`). :class:`LoaderPlan`: how its loaders run (:mod:`~lightning_fastdata.loaders`,
:mod:`~lightning_fastdata.workers`). :class:`AugmentPlan`: how training samples are augmented, the size schedule
included (:mod:`~lightning_fastdata.resizing`). Each module takes the plan it needs and returns values; the
DataModule alone assigns its attributes from them.

A plan is a snapshot of the DataModule's settings when it is taken (``FastImageDataModule.data_plan`` and its
siblings): Lightning's batch size finder writes ``datamodule.batch_size``, and ``num_workers="tune"`` leaves its pick
in ``num_workers``, so a plan is taken where the work starts, never kept past it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.views import ViewGroup


@dataclass(frozen=True)
class DataPlan:
    """Where a DataModule's data is and how it is read: its database, the cache folder, the splits it holds out."""

    #: the ``data_dir`` argument: a source folder or list file, a database, or a database's URL
    data_dir: str
    #: the ``cache_dir`` argument (named by errors)
    cache_dir: str | None
    #: the cache folder ``cache_dir`` resolves to
    cache_root: Path
    #: the database that is read: ``data_dir`` itself, its conversion, or its staged copy
    database_path: Path
    #: whether ``data_dir`` is a URL, staged into the cache folder
    is_remote: bool
    #: whether ``data_dir`` already is a database (nothing is converted)
    is_database: bool
    #: the target kind asked for (``None``: any)
    targets: str | None
    #: the ``short_side`` argument (ignored, with a warning, for a database)
    short_side: int | None
    #: conversion: the JPEG quality of re-encoded images, and ``"jpeg"`` or ``"raw"``
    quality: int
    encoding: str
    #: separates a list file's labels
    label_separator: str
    #: the largest crop configured, which the stored images must suit
    largest_size: int
    #: the validation centre crop's share of the short side
    crop_fraction: float
    #: the share of ``train`` held out for validation without a ``val`` split
    val_fraction: float
    #: seeds the holdout
    seed: int


@dataclass(frozen=True)
class LoaderPlan:
    """How a DataModule's loaders run: its loader arguments, ``"auto"`` and ``None`` resolved per loader."""

    batch_size: int
    num_workers: int | Literal["auto", "tune"]
    engine: Literal["auto", "threads", "processes"]
    pin_memory: bool | None
    persistent_workers: bool | None
    prefetch_factor: int | None
    decode: str
    prefetch_to_device: bool | None
    drop_last: bool
    return_index: bool
    channels_last: bool
    #: seeds the order of the samples and their augmentation
    seed: int
    #: whether samples that fail to read are left out of their batch (``on_bad_sample="skip"``)
    skips: bool
    worker_nice: int


@dataclass(frozen=True)
class AugmentPlan:
    """How training samples are augmented: the configured crop size and its schedule, the crops, views and colour."""

    #: the configured ``image_size`` (``set_image_size`` changes the DataModule's current size, not this)
    image_size: int
    #: ``{epoch: image_size}`` sorted by epoch, or ``None``
    schedule: Mapping[int, int] | None
    scale: tuple[float, ...]
    crop_fraction: float
    views: tuple[ViewGroup, ...] | None
    #: the training batches' colour augmentation, or ``None``
    color: BatchColor | None

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every crop size configured: ``image_size``, the schedule's, the view groups'."""
        return (self.image_size, *(self.schedule or {}).values(), *(g.size for g in self.views or ()))
