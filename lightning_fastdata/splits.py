"""Which database splits a DataModule reads: train, val (or a seeded holdout of train), test and predict.

``FastImageDataModule.setup`` checks the database (:func:`check_database`) and opens them (:func:`open_splits`):
each split plays the role its canonical name says (:func:`split_roles`), and without a ``val`` split a seeded
``val_fraction`` of ``train`` is held out, both sides :class:`IndexView` s of the same split.
``predict_dataloader`` reads :func:`pick_predict_split`. Every index of a split, a held-out one included, names its
source file (:func:`split_sources`).

The functions take a :class:`~lightning_fastdata.plans.DataPlan` and the DataModule's ``build_dataset`` and
transform methods (so that a subclass's overrides count), and return the datasets, which the DataModule keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_fastdata import resolve
from lightning_fastdata.errors import MissingSplitError
from lightning_fastdata.plans import DataPlan
from lightning_fastdata.store import cache
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store.sources import canonical_split


class IndexView(Dataset):
    """A fixed subset of a dataset, its indices held as ``int32`` (4 bytes per sample).

    The ``val_fraction`` holdout and the rest of ``train``. The batch path reads it as it reads a ``Subset``: its
    ``dataset`` and ``indices`` (:func:`lightning_fastdata.pipeline.kernel.fuses`).
    """

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        self.dataset = dataset
        self.indices = indices.astype(np.int32)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.indices[index])]


def split_roles(splits: Iterable[str]) -> dict[str, str]:
    """The split that plays each role: ``{"train" | "val" | "test" | its own name: split}``.

    Splits are found by their canonical names (``valid``, ``validation``, ``testing``... in databases written before
    split names were canonical); an exact ``val`` beats ``valid``.
    """
    by_role: dict[str, str] = {}
    for name in sorted(splits, key=lambda n: (n != canonical_split(n), n)):  # an exact "val" beats "valid"
        by_role.setdefault(canonical_split(name) or name, name)
    return by_role


def check_database(plan: DataPlan) -> list[str]:
    """The names of the splits of ``plan``'s database, sorted, once it is checked against the plan.

    Records the database's use, and checks its target kind and stored size against ``plan``'s arguments (a URL's
    database is staged, or found staged, first: ``FastImageDataModule.setup``).
    """
    cache.record_use(plan.database_path, plan.cache_root)  # its last use, and that this process reads it
    meta = _environments.read_meta(plan.database_path)
    resolve.check_targets(meta, plan.targets, plan.database_path)
    resolve.check_store(
        meta, plan.short_side, plan.largest_size, plan.crop_fraction, plan.is_database, plan.data_dir
    )  # fmt: skip
    return sorted(meta["splits"])


@dataclass(frozen=True)
class OpenedSplits:
    """The datasets of a database's splits, by role (``None``: the database has no such split, nor a holdout)."""

    train: Dataset | None = None
    val: Dataset | None = None
    test: Dataset | None = None


def open_splits(
    plan: DataPlan,
    splits: Iterable[str],
    build: Callable[[str, Any], Dataset],
    train_transform: Callable[[], Any],
    val_transform: Callable[[], Any],
) -> OpenedSplits:
    """The datasets of ``splits``, built by ``build(split, transform)``; ``val_fraction`` of ``train`` without ``val``.

    ``train_transform`` and ``val_transform`` make each dataset's transform (the DataModule's methods, so that a
    subclass's overrides count). The holdout is seeded (``plan.seed``): opened again, it is the same.
    """
    by_role = split_roles(splits)
    val_split, test_split = by_role.get("val"), by_role.get("test")
    train = val = test = None
    if "train" in by_role:
        train = build(by_role["train"], train_transform())
        if val_split is None and plan.val_fraction > 0:
            n = len(train)  # type: ignore[arg-type]
            order = np.random.default_rng(plan.seed).permutation(n)
            n_val = max(1, round(n * plan.val_fraction))
            val = IndexView(build(by_role["train"], val_transform()), np.sort(order[:n_val]))
            train = IndexView(train, np.sort(order[n_val:]))
    if val_split is not None:
        val = build(val_split, val_transform())
    if test_split is not None:
        test = build(test_split, val_transform())
    return OpenedSplits(train, val, test)


def pick_predict_split(database: Path, wanted: str | None, names: Sequence[str] | None = None) -> str:
    """The split ``predict_dataloader`` reads: ``wanted`` (``predict_split``), else ``test``, ``val``, ``train``.

    ``names``: the splits of ``database`` (default: read from its metadata).

    Raises:
        MissingSplitError: ``wanted`` is not one of them.

    """
    names = list(_environments.read_meta(database)["splits"]) if names is None else list(names)
    if wanted is not None:
        if wanted not in names:
            raise MissingSplitError(
                f"`predict_split` {wanted!r} is not in {str(database)!r}; it holds {sorted(names)}."
            )
        return wanted
    for role in ("test", "val", "train"):
        match = next((n for n in sorted(names) if canonical_split(n) == role), None)
        if match is not None:
            return match
    return sorted(names)[0]


#: each required split's name in the error, and what to do
_MISSING = {
    "train": (
        "`train`",
        "Put training images in `train/<class>/` (or `training/`) under `data_dir`, or run validate/test/predict only.",
    ),
    "test": (
        "test",
        "Put test images in `test/<class>/` (or `testing/`) beside `train/` under `data_dir`, then run again.",
    ),
}


def missing_split(database: Path, splits: Sequence[str] | None, role: str) -> MissingSplitError:
    """The error for a ``train`` (``fit``) or ``test`` (``test_dataloader``) split that ``database`` lacks."""
    name, fix = _MISSING[role]
    return MissingSplitError(f"{str(database)!r} has no {name} split; it holds {splits}. {fix}")


def split_sources(database: Path, split: str | None = None) -> list[str]:
    """Where each index of ``split`` of ``database`` came from (``FastImageDataModule.sources``).

    ``split`` defaults to the training split, which the held-out validation samples are indices of too. Each entry is
    the path relative to the converted folder, the path as listed in a list file, or the index in a converted dataset.

    Raises:
        MissingSplitError: the database has no split ``split``.
        ValueError: the database predates stored sources; convert it again (``--force``) to store them.

    """
    names = sorted(_environments.read_meta(database)["splits"])
    if split is None:
        by_role = sorted(names, key=lambda n: (canonical_split(n) != "train", n != "train", n))
        split = by_role[0]
    if split not in names:
        raise MissingSplitError(f"split {split!r} is not in {str(database)!r}; it holds {names}.")
    sources = _environments.read_sources(database, split)
    if sources is None:
        raise ValueError(
            f"{str(database)!r} was converted before source paths were stored; convert it again"
            " (`lightning-fastdata convert --force`) to map predictions back to files."
        )
    return sources
