"""Tests for ``lightning_fastdata.resizing``: progressive resizing and FixRes, from the schedule to a real fit."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fakes import fake_trainer
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn import functional as F
from torchvision.transforms import v2
from workers import WithIndex

from lightning_fastdata import FastImageDataModule, InvalidArgumentError, LmdbImageDataset
from lightning_fastdata.pipeline import create_loader
from lightning_fastdata.resizing import check_schedule, size_at
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, CenterCropResize, Normalizer

# ----------------------------------------------------------------------------------------------------------------
# The schedule and the transforms
# ----------------------------------------------------------------------------------------------------------------


def test_schedule_is_checked_and_sorted() -> None:
    """A schedule comes back sorted by epoch; an empty one is none."""
    assert check_schedule({10: 160, 0: 128, 15: 224}) == {0: 128, 10: 160, 15: 224}
    assert list(check_schedule({10: 160, 0: 128}) or {}) == [0, 10]
    assert check_schedule({}) is None
    assert check_schedule(None) is None


@pytest.mark.parametrize("schedule", [{-1: 128}, {0: 0}, {0: 1.5}, {"0": 128}, {0: True}, [(0, 128)]])
def test_bad_schedule_is_refused_by_name(schedule: Any) -> None:
    """A negative epoch, a size below 1, or anything not an int is refused, naming the argument."""
    with pytest.raises(InvalidArgumentError, match="`image_size_schedule`"):
        FastImageDataModule("unused", image_size_schedule=schedule)


def test_size_at_takes_the_last_epoch_started() -> None:
    """Each size holds from its epoch until the next; before the first key, the default."""
    schedule = {2: 128, 10: 160, 15: 224}
    assert [size_at(schedule, e, 96) for e in (0, 1, 2, 9, 10, 14, 15, 99)] == [96, 96, 128, 128, 160, 160, 224, 224]


@pytest.mark.parametrize(("engine", "workers"), [("threads", 0), ("processes", 1)])
def test_the_epochs_size_reaches_crops_inside_wrappers(database: Path, engine: str, workers: int) -> None:
    """Through a wrapped dataset and a ``Compose``, the package's crop reads the epoch's size; it is never resized."""
    crop = CenterCropResize(16)
    inner = LmdbImageDataset(database, split="train", transform=v2.Compose([crop, v2.ToDtype(torch.float32)]))
    sizes = iter([16, 24])
    loader = create_loader(
        WithIndex(inner), 8, engine=engine, workers=workers, output="uint8", before_epoch=lambda e: next(sizes)
    )  # a batch reader of a dataset of one's own: the per-sample path
    assert _sizes(loader, 0) == [16] * 3
    assert _sizes(loader, 1) == [24] * 3
    assert crop.size == 16  # the transform as built
    assert loader.dataset.crop_size == 24  # type: ignore[attr-defined]  # given to the reader


# ----------------------------------------------------------------------------------------------------------------
# The loader follows a new crop size
# ----------------------------------------------------------------------------------------------------------------


def _sizes(loader: Any, epoch: int) -> list[int]:
    """The image side of every batch of ``loader``'s epoch ``epoch``."""
    loader.sampler.set_epoch(epoch)
    return [images.shape[-1] for images, *_ in loader]


def _crops(database: Path, size: int, engine: str = "threads", workers: int = 0) -> tuple[Any, CenterCropResize]:
    """A loader of the train split's centre crops at ``size``, in batches of 8, and its crop transform."""
    crop = CenterCropResize(size)
    dataset = LmdbImageDataset(database, split="train", transform=crop)
    normalizer = Normalizer(IMAGENET_MEAN, IMAGENET_STD)
    return create_loader(dataset, 8, engine=engine, workers=workers, output="float", normalizer=normalizer), crop


@pytest.mark.parametrize(("engine", "workers"), [("threads", 2), ("threads", 0), ("processes", 2)])
def test_loader_builds_batches_of_the_new_crop_size(database: Path, engine: str, workers: int) -> None:
    """The reader's crops grow between epochs: new batch slots, and persistent worker processes restart."""
    loader, crop = _crops(database, 16, engine, workers)
    assert loader.persistent_workers == (engine == "processes")
    assert _sizes(loader, 0) == [16] * 3
    first = loader._iterator
    crop.size = 24
    expected = [images for images, _ in _crops(database, 24)[0]]
    for _ in range(2):  # the epoch that changed, and the next
        batches = [images for images, _ in loader]
        assert len(batches) == len(expected)
        for got, want in zip(batches, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    if engine == "processes":
        assert loader._iterator is not None
        assert loader._iterator is not first  # a new set of workers


def test_before_epoch_restarts_persistent_workers_when_its_value_changes(database: Path) -> None:
    """Per-sample path (no slots to tell): ``before_epoch``'s new value restarts the workers with the new transform."""
    crop = CenterCropResize(16)
    dataset = WithIndex(LmdbImageDataset(database, split="train", transform=crop))
    seen: list[int] = []

    def before_epoch(epoch: int) -> int:
        seen.append(epoch)
        crop.size = 16 if epoch == 0 else 24
        return crop.size

    loader = create_loader(dataset, 8, engine="processes", workers=2, output=None, before_epoch=before_epoch)
    assert _sizes(loader, 0) == [16] * 3
    assert _sizes(loader, 1) == [24] * 3
    assert _sizes(loader, 2) == [24] * 3
    assert seen == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------------
# FastImageDataModule.set_image_size
# ----------------------------------------------------------------------------------------------------------------


def _holdout_dm(database: Path, dm_class: type[FastImageDataModule] = FastImageDataModule) -> FastImageDataModule:
    """A DataModule over a database with no val split (80 images): ``val_fraction`` holds out validation."""
    dm = dm_class(str(database), image_size=16, batch_size=4, num_workers=0, val_fraction=0.25)
    dm.trainer = fake_trainer()
    dm.setup("fit")
    return dm


def test_set_image_size_reaches_the_loaders_and_keeps_the_holdout(plain_photo_database: Path) -> None:
    """The same datasets and transforms, the loaders at the new size: the val split's indices are those before."""
    dm = _holdout_dm(plain_photo_database)
    train, val = dm.train_dataset, dm.val_dataset
    held_out = val.indices.copy()  # type: ignore[union-attr]
    dm.set_image_size(24)
    assert (dm.train_dataset, dm.val_dataset) == (train, val)
    np.testing.assert_array_equal(val.indices, held_out)  # type: ignore[union-attr]
    assert (train.dataset.transform.size, val.dataset.transform.size) == (16, 16)  # type: ignore[union-attr]
    assert (dm.image_size, dm.hparams.image_size) == (24, 16)  # the saved hyperparameter is the configured size
    assert next(iter(dm.val_dataloader()))[0].shape[-1] == 24
    assert next(iter(dm.train_dataloader()))[0].shape[-1] == 24


def test_setup_fit_reopens_the_splits_after_train_dataset_is_reset(plain_photo_database: Path) -> None:
    """``train_dataset = None``, then ``setup("fit")``: the splits again, the same holdout (no missing-split error)."""
    dm = _holdout_dm(plain_photo_database)
    held_out = dm.val_dataset.indices.copy()  # type: ignore[union-attr]
    dm.train_dataset = None
    dm.setup("fit")
    assert dm.train_dataset is not None
    np.testing.assert_array_equal(dm.val_dataset.indices, held_out)  # type: ignore[union-attr]
    assert len(dm.train_dataset) + len(held_out) == 80  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "224"])
def test_set_image_size_refuses_a_bad_size(size: Any) -> None:
    """Not an int >= 1: refused, naming the method and the value."""
    dm = FastImageDataModule("unused", image_size=16)
    with pytest.raises(InvalidArgumentError, match=r"`set_image_size` needs an int >= 1, got"):
        dm.set_image_size(size)
    assert dm.image_size == 16


def test_set_image_size_warns_when_the_store_is_too_small(plain_photo_database: Path, tmp_path: Path) -> None:
    """A size the stored images (short side 96) are too small for warns, naming the size and what it needs."""
    dm = FastImageDataModule(str(plain_photo_database), cache_dir=str(tmp_path), image_size=16, num_workers=0)
    dm.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.set_image_size(64)  # needs 74 px: no warning
    with pytest.warns(UserWarning, match=r"short side of at most 96 px, but `image_size=112`.* needs 128 px"):
        dm.set_image_size(112)


def test_set_image_size_warns_for_a_transform_of_ones_own(plain_photo_database: Path) -> None:
    """A dataset whose transform is not a package crop keeps its size, and says so."""

    class OwnTransform(FastImageDataModule):
        def train_transform(self) -> Any:
            return v2.Resize((16, 16))

    dm = _holdout_dm(plain_photo_database, OwnTransform)
    with pytest.warns(UserWarning, match="the train dataset's transform is not RandomResizedCropFlip"):
        dm.set_image_size(24)


def test_set_image_size_reaches_each_loaders_device_stage(plain_photo_database: Path) -> None:
    """The crops of ``decode="device"``: every loader's device stage takes the size as its epoch starts."""
    dm = _holdout_dm(plain_photo_database)
    train, val = dm.train_dataloader(), dm.val_dataloader()
    dm.set_image_size(24)
    assert val.on_device.image_size == 24  # type: ignore[attr-defined]  # the DataModule's own stage: at once
    next(iter(train))
    assert train.on_device.image_size == 24  # type: ignore[attr-defined]


def test_conversion_is_for_the_largest_scheduled_size(tmp_path: Path) -> None:
    """A folder is stored for the schedule's largest crop, and a later ``set_image_size`` does not move it."""
    dm = FastImageDataModule(str(tmp_path), image_size=224, image_size_schedule={0: 160, 28: 320})
    assert dm.store_short_side() == math.ceil(320 / 0.875)
    path = dm.database_path
    dm.set_image_size(160)
    assert dm.database_path == path


# ----------------------------------------------------------------------------------------------------------------
# A real fit: each epoch at its size, on both engines
# ----------------------------------------------------------------------------------------------------------------


class BatchRecorder(LightningModule):
    """Keeps every training and validation batch's images, per epoch (sanity checking apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.train_batches: dict[int, list[torch.Tensor]] = {}
        self.val_batches: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.train_batches.setdefault(self.current_epoch, []).append(images.clone())
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_batches.setdefault(self.current_epoch, []).append(batch[0].clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SizeByEpoch(Callback):
    """The callback form: ``set_image_size`` in ``on_train_epoch_start``."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.datamodule.set_image_size(self.sizes[trainer.current_epoch])  # type: ignore[attr-defined]


def _at_one_size(database: Path, size: int, epoch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first two training batches of ``epoch`` and the first two validation batches, from a run at ``size``."""
    dm = FastImageDataModule(str(database), image_size=size, batch_size=4, num_workers=0)
    dm.trainer = fake_trainer()
    train = dm.train_dataloader()
    train.sampler.set_epoch(epoch)  # type: ignore[union-attr]
    val = dm.val_dataloader()
    return [b[0] for b in itertools.islice(train, 2)], [b[0] for b in itertools.islice(val, 2)]  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["schedule", "callback"])
@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_fit_trains_each_epoch_at_its_size(database: Path, tmp_path: Path, engine: str, how: str) -> None:
    """Epoch 0 at 16 px, epoch 1 at 24 (FixRes-style), on threads or persistent workers: each epoch's training and
    validation batches are those of a run at that size alone, crop for crop."""
    sizes = {0: 16, 1: 24}
    dm = FastImageDataModule(
        str(database),
        image_size=24,
        image_size_schedule=sizes if how == "schedule" else None,
        batch_size=4,
        num_workers=2,
        engine=engine,  # type: ignore[arg-type]
    )
    model = BatchRecorder()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SizeByEpoch(sizes)] if how == "callback" else [],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.train_dataloader.persistent_workers == (engine == "processes")  # type: ignore[union-attr]
    for epoch, size in sizes.items():
        assert [b.shape[-1] for b in model.train_batches[epoch] + model.val_batches[epoch]] == [size] * 4
        train, val = _at_one_size(database, size, epoch)
        for got, want in zip(model.train_batches[epoch] + model.val_batches[epoch], train + val, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("output", ["uint8", "float"])
def test_a_size_changed_mid_epoch_takes_effect_at_the_next_epoch(database: Path, output: str) -> None:
    """``crop.size`` changed after an epoch's first batch (a ``set_image_size`` mid-epoch, on loader threads): the
    epoch's batches keep its size with their own pixels (not a crash, nor an earlier batch's pixels); the next epoch
    has the new size."""
    normalizer = Normalizer(IMAGENET_MEAN, IMAGENET_STD)
    crop = CenterCropResize(16)
    dataset = LmdbImageDataset(database, split="train", transform=crop)
    loader = create_loader(dataset, 8, engine="threads", workers=2, output=output, normalizer=normalizer)
    reference = [images for images, *_ in create_loader(
        LmdbImageDataset(database, split="train", transform=CenterCropResize(16)), 8, output=output,
        normalizer=normalizer,
    )]  # fmt: skip
    batches = iter(loader)
    first = next(batches)[0]
    crop.size = 24
    rest = [images for images, *_ in batches]
    for got, want in zip([first, *rest], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _sizes(loader, 1) == [24] * 3
