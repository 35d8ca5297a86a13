"""Shared fixtures: a small generated image folder with train/val splits and its converted database."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_fastdata import convert, make_image_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run on a real GPU only: skipped, with the reason, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


#: The session database downscales to this short side: the source images (40-80 px) straddle it, so the
#: database holds both untouched small JPEGs and downscaled, re-encoded ones.
SESSION_SHORT_SIDE = 64


@pytest.fixture(scope="session")
def split_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only (by convention) generated folder ``src/{train,val}/class_<k>/<n>.jpg``: 3 classes, 8 + 3 each."""
    root = tmp_path_factory.mktemp("split_folder") / "src"
    return make_image_folder(
        root, num_classes=3, train_per_class=8, val_per_class=3, min_size=40, max_size=80, seed=0, num_workers=1
    )


@pytest.fixture(scope="session")
def database(split_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's database of ``split_folder``; tests must not modify it (use ``database_copy``)."""
    dst = tmp_path_factory.mktemp("database") / "db.lmdb"
    summary = convert(split_folder, dst, short_side=SESSION_SHORT_SIDE, num_workers=2, progress=False)
    assert not summary.skipped
    return dst


@pytest.fixture
def database_copy(database: Path, tmp_path: Path) -> Path:
    """A private copy of the session database that a test may modify."""
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(database, dst)
    return dst


@pytest.fixture
def split_folder_copy(split_folder: Path, tmp_path: Path) -> Path:
    """A private copy of the session image folder (timestamps kept) that a test may modify."""
    dst = tmp_path / "src"
    shutil.copytree(split_folder, dst)
    return dst
