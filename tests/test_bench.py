"""Tests for ``lightning_fastdata.bench``: what ``lightning-fastdata bench`` measures, a database or a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import fake_trainer
from torchvision.datasets import ImageFolder

from lightning_fastdata import convert, make_image_folder
from lightning_fastdata.bench import TrainingLoaders, sweep_dataset
from lightning_fastdata.pipeline import FastLoader
from lightning_fastdata.tuning import LoaderConfig, measure


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain ImageFolder of 2 classes x 40 JPEGs."""
    root = tmp_path_factory.mktemp("tuning") / "plain"
    return make_image_folder(root, num_classes=2, train_per_class=40, val_per_class=0, min_size=64, max_size=160)


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_sweep_dataset_database_is_timed_through_the_training_loader(plain_folder, tmp_path, engine):
    """A database is timed through FastImageDataModule's training loader, as ``fit`` builds it, with ``engine``."""
    db = tmp_path / "db"
    convert(plain_folder, db, short_side=96, num_workers=0, progress=False)
    source, kind = sweep_dataset(db, image_size=48, engine=engine)
    assert kind == "database"
    assert isinstance(source, TrainingLoaders)
    assert len(source) == 80
    source.loader.__self__.trainer = fake_trainer("cpu")  # the DataModule whose training loader it times
    loader = source(LoaderConfig(1, 8, engine=engine))
    assert isinstance(loader, FastLoader)
    assert (loader.engine, loader.workers, loader.batch_size) == (engine, 1, 8)
    assert loader.dataset.fused  # the batch path
    images, labels = next(iter(loader))
    assert images.dtype == torch.float32  # on a CPU the loader normalizes
    assert tuple(images.shape) == (8, 3, 48, 48)
    assert labels.dtype == torch.int64
    m = measure(source, LoaderConfig(1, 8, engine=engine), seconds=60.0, max_batches=3)
    assert m.batches == 3
    m = measure(source, LoaderConfig(0, 8, engine=engine), seconds=60.0, max_batches=12)
    assert m.batches == 12  # with the 2 warm-up batches, more than an epoch of 10: read across epochs


def test_sweep_dataset_folders(plain_folder, tmp_path):
    """A plain folder and a root with ``train/`` both give torchvision's ImageFolder with its float pipeline."""
    dataset, kind = sweep_dataset(plain_folder, image_size=32)
    assert kind == "image folder"
    assert isinstance(dataset, ImageFolder)
    assert len(dataset) == 80
    image, _ = dataset[0]
    assert image.dtype == torch.float32
    assert tuple(image.shape) == (3, 32, 32)
    split = make_image_folder(
        tmp_path / "split", num_classes=2, train_per_class=3, val_per_class=2, min_size=40, max_size=60
    )
    dataset, kind = sweep_dataset(split)
    assert kind == "image folder"
    assert Path(dataset.root) == split / "train"
    assert len(dataset) == 6


def test_sweep_dataset_missing_path(tmp_path):
    """A missing path, or a file, raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="missing'"):
        sweep_dataset(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"file\.txt'"):
        sweep_dataset(tmp_path / "file.txt")
