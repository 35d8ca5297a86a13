"""The data side of a ``FastImageDataModule``: its database, converted or staged once per node, then its splits opened.

``prepare_data`` hands a :class:`~lightning_fastdata.plans.DataPlan` to :meth:`Database.prepare`, which converts a
folder or list file (:func:`~lightning_fastdata.resolve.convert_source`) or stages a URL's database
(:func:`~lightning_fastdata.resolve.stage`); ``setup`` hands it to :meth:`Database.open`, which checks the database
and opens its splits (:mod:`~lightning_fastdata.splits`). A :class:`Database` keeps what that did in this process (the
staged copy, the split names); the datasets it opens are returned, and the DataModule keeps them as its
``train_dataset``, ``val_dataset`` and ``test_dataset``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from lightning_fastdata import resolve
from lightning_fastdata.plans import DataPlan
from lightning_fastdata.splits import OpenedSplits, check_database, open_splits, pick_predict_split
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store import remote
from lightning_fastdata.store.targets import TargetSpec


class Database:
    """The database a DataModule reads, and what this process did to it: staged a URL's copy, opened its splits."""

    def __init__(self) -> None:
        #: what staging ``data_dir`` did in this process (fetched, fetched again and why, reused); ``None``: nothing
        self.staged: remote.StagedDatabase | None = None
        #: the names of the database's splits, once it is open (``None``: not yet)
        self.splits: list[str] | None = None

    def prepare(self, plan: DataPlan) -> None:
        """Convert ``plan``'s source once, or stage its database from its URL (an up-to-date copy is reused)."""
        if plan.is_remote:
            self.staged = resolve.stage(plan.data_dir, plan.cache_dir, plan.cache_root)
        if plan.is_database:
            _environments.read_meta(plan.database_path)  # fail early with a clear message if it is not usable
            return
        short_side = resolve.store_short_side(plan.short_side, plan.largest_size, plan.crop_fraction)
        settings = {"short_side": short_side, "quality": plan.quality, "encoding": plan.encoding}
        resolve.convert_source(
            plan.data_dir, plan.cache_dir, plan.cache_root, plan.database_path, settings, plan.targets,
            plan.label_separator,
        )  # fmt: skip

    def open(
        self,
        plan: DataPlan,
        predict_split: str | None,
        build: Callable[[str, Any], Dataset],
        train_transform: Callable[[], Any],
        val_transform: Callable[[], Any],
    ) -> OpenedSplits:
        """Check the database and open its splits (:func:`~.splits.open_splits`), staging a URL's first.

        A rank other than the node's first waits for that node's staging. A misspelled ``predict_split`` fails here,
        not after the whole fit. ``build`` and the transforms are the DataModule's methods (a subclass's overrides
        count).
        """
        if plan.is_remote and self.staged is None:
            self.staged = resolve.find_or_stage(plan.data_dir, plan.cache_dir, plan.cache_root)
        self.splits = check_database(plan)
        if predict_split is not None:
            pick_predict_split(plan.database_path, predict_split, self.splits)
        return open_splits(plan, self.splits, build, train_transform, val_transform)

    def classes(self, plan: DataPlan) -> list[str]:
        """Class names: from the database, or before conversion from the folder names (nothing is read)."""
        return resolve.classes(
            plan.data_dir, plan.cache_root, plan.database_path, self.staged is not None, plan.targets,
            plan.label_separator,
        )  # fmt: skip

    def target_spec(self, plan: DataPlan) -> TargetSpec:
        """What each sample's target is: the database's, else what the conversion of the source will store."""
        if plan.is_remote and self.staged is None:
            resolve.check_staged(plan.data_dir, plan.cache_root)
        return resolve.target_spec(plan.data_dir, plan.database_path, plan.targets, plan.label_separator)
