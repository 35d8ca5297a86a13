"""Targets of every kind, and each sample's dataset index, through the whole batch path: loaders and DataModule fits.

A batch holds the targets its database's kind says (``store/targets.py``): class indices ``int64 [B]``, multi-hot
``float32 [B, C]``, ``float32 [B, K]`` (``[B]`` when K = 1) or ``int64 [B]`` of ``-1``; with ``return_index`` also
``index``, the true dataset index ``int64 [B]``. Each is checked against ``LmdbImageDataset.targets_of`` on the fused,
per-sample and encoded paths, on both engines and the calling thread, in slots and in fresh memory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostile import damage_record
from kinds import make_kind_database
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import Subset

from lightning_fastdata import FastImageDataModule, LmdbImageDataset
from lightning_fastdata.pipeline import create_loader
from lightning_fastdata.transforms import CenterCropResize, Normalizer

#: training images of every database (no val split: the DataModule holds out `val_fraction` of them), and test ones
TRAIN, TEST = 40, 6
NORMALIZER = Normalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A database of each kind (``float1``: one float a sample) of the same images: ``train`` and ``test`` splits."""
    root = tmp_path_factory.mktemp("kinds")
    kinds = ("class", "multilabel", "float", "float1", "none")
    return {kind: make_kind_database(root / f"{kind}.lmdb", kind, {"train": TRAIN, "test": TEST}) for kind in kinds}


def _check(batch: Any, dataset: LmdbImageDataset) -> np.ndarray:
    """A batch ``(images, targets, index)`` holds the targets of its indices; returns the indices."""
    images, targets, index = batch
    assert index.dtype == torch.int64
    assert index.shape == (len(images),)
    want = dataset.targets_of(index.numpy())
    assert targets.dtype == (torch.int64 if want.dtype == np.int64 else torch.float32)
    assert tuple(targets.shape) == want.shape
    np.testing.assert_array_equal(targets.numpy(), want)
    return index.numpy()


# ----------------------------------------------------------------------------------------------------------------
# create_loader: every path and engine
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["uint8", "float", "encoded"])
@pytest.mark.parametrize(("engine", "workers"), [("threads", 0), ("threads", 2), ("processes", 2)])
def test_batches_hold_the_targets_of_every_kind_and_their_true_index(
    kinds: dict[str, Path], engine: str, workers: int, output: str
) -> None:
    """Every kind, through a Subset: targets of the database's dtype and shape, and the index into the split."""
    view = list(range(3, TRAIN, 2))
    for kind, db in kinds.items():
        dataset = LmdbImageDataset(db, transform=CenterCropResize(16))
        loader = create_loader(
            Subset(dataset, view), 4, engine=engine, workers=workers, output=output, normalizer=NORMALIZER,
            return_index=True,
        )  # fmt: skip
        seen = np.concatenate([_check(batch, dataset) for batch in loader])
        assert seen.tolist() == view, kind
        shapes = {"class": (), "multilabel": (4,), "float": (3,), "float1": (), "none": ()}
        assert dataset.targets_of([0]).shape[1:] == shapes[kind]
        del loader


@pytest.mark.parametrize("kind", ["multilabel", "float"])
def test_the_per_sample_path_appends_the_index_to_each_sample(kinds: dict[str, Path], kind: str) -> None:
    """A transform of one's own (per-sample path): the dataset's targets collated, and each sample's true index."""
    dataset = LmdbImageDataset(kinds[kind], transform=lambda image: image[:, :8, :8].contiguous())
    view = list(range(1, TRAIN, 3))
    loader = create_loader(Subset(dataset, view), 4, workers=2, return_index=True)
    assert not loader.dataset.fused
    assert np.concatenate([_check(batch, dataset) for batch in loader]).tolist() == view
    assert all(len(batch) == 2 for batch in create_loader(dataset, 4, workers=2))  # without: (images, targets)


@pytest.mark.parametrize("fused", [True, False])
def test_nested_subsets_index_the_database(kinds: dict[str, Path], fused: bool) -> None:
    """A Subset of a Subset (negative indices too): each batch's index is the database's, on the fused path and the
    per-sample one (a transform of one's own), as ``PredictionWriter`` maps it."""
    transform = CenterCropResize(16) if fused else (lambda image: image[:, :8, :8].contiguous())
    dataset = LmdbImageDataset(kinds["float"], transform=transform)
    outer = list(range(5, TRAIN))  # samples 5.. of the split
    inner = [0, 2, 4, -1, -3]  # of those: 5, 7, 9, 39, 37
    loader = create_loader(Subset(Subset(dataset, outer), inner), 2, workers=2, return_index=True)
    assert loader.dataset.fused is fused
    assert np.concatenate([_check(batch, dataset) for batch in loader]).tolist() == [5, 7, 9, TRAIN - 1, TRAIN - 3]


def test_batches_built_in_fresh_memory_hold_targets_and_index(kinds: dict[str, Path]) -> None:
    """Worker processes whose slots are all kept by the loop build batches in fresh memory: targets and index too."""
    dataset = LmdbImageDataset(kinds["multilabel"], transform=CenterCropResize(16))
    loader = create_loader(dataset, 1, engine="processes", workers=2, return_index=True, persistent_workers=False)
    kept = list(loader)
    assert loader.slot_misses > 0
    assert sorted(np.concatenate([_check(batch, dataset) for batch in kept]).tolist()) == list(range(TRAIN))
    del kept, loader


@pytest.mark.parametrize("output", ["uint8", "encoded"])
@pytest.mark.parametrize(("engine", "workers"), [("threads", 2), ("processes", 2)])
def test_a_skipped_sample_takes_its_target_and_index_with_it(
    kinds: dict[str, Path], tmp_path: Path, engine: str, workers: int, output: str
) -> None:
    """A damaged record of a multilabel database under the skip policy: the kept samples keep their own targets."""
    db = tmp_path / "damaged.lmdb"
    shutil.copytree(kinds["multilabel"], db)
    damage_record(db, 5)
    dataset = LmdbImageDataset(db, transform=CenterCropResize(16))
    dm = FastImageDataModule(str(db), on_bad_sample="skip")  # its skip counter, as the DataModule passes it
    skips = dm._loaders.skip_counter
    loader = create_loader(
        dataset, 4, engine=engine, workers=workers, output=output, return_index=True, skip_counter=skips
    )
    batches = list(loader)
    if output == "encoded":  # the checksum is checked as the record is read: the sample never reaches the device
        assert all(len(batch[0]) == len(batch[1]) == len(batch[2]) for batch in batches)
        batches = [(torch.zeros(len(b[2])), b[1], b[2]) for b in batches]
    seen = np.concatenate([_check(batch, dataset) for batch in batches]).tolist()
    assert seen == [i for i in range(TRAIN) if i != 5]
    assert [len(batch[2]) for batch in batches][1] == 3  # the batch of 4..7 kept 3
    assert dm.skipped_samples == 1
    del loader


# ----------------------------------------------------------------------------------------------------------------
# FastImageDataModule under a real Trainer
# ----------------------------------------------------------------------------------------------------------------


class _CheckingModel(LightningModule):
    """Checks every training batch's targets against the database and records its indices; keeps validation's targets.

    With ``return_index`` a training batch is ``(images, targets, index)`` and a validation batch ``(images, targets)``,
    as solo-learn's and lightly's evaluation steps unpack it.
    """

    def __init__(self, db: Path, classes: int) -> None:
        super().__init__()
        self.dataset = LmdbImageDataset(db)
        self.layer = torch.nn.Linear(3, max(classes, 1))
        self.seen: list[int] = []
        self.val_targets: list[torch.Tensor] = []

    def _loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.layer(images.mean(dim=(2, 3)))
        kind = self.dataset.target_kind
        if kind == "multilabel":
            return torch.nn.functional.binary_cross_entropy_with_logits(out, targets)
        if kind == "float":
            return torch.nn.functional.mse_loss(out.squeeze(-1) if targets.ndim == 1 else out, targets)
        return torch.nn.functional.cross_entropy(out, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets, index = batch
        self.seen += _check((images, targets.cpu(), index.cpu()), self.dataset).tolist()
        return self._loss(images, targets)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, targets = batch  # solo-learn's `X, targets = batch`: no index, even with `return_index`
        self.val_targets.append(targets.cpu())
        self._loss(images, targets)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[2].cpu()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(**kwargs: Any) -> Trainer:
    return Trainer(
        **{
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **kwargs,
        }
    )


@pytest.mark.parametrize(("engine", "workers"), [("threads", 2), ("processes", 2)])
@pytest.mark.parametrize("kind", ["multilabel", "float"])
def test_fit_batches_hold_the_targets_of_the_databases_kind(
    kinds: dict[str, Path], kind: str, engine: str, workers: int
) -> None:
    """A fit on a multilabel or float database, on each engine: every batch's targets are its samples', typed; the
    training batches carry their indices, the validation batches are ``(images, targets)`` of the held-out samples."""
    db = kinds[kind]
    dm = FastImageDataModule(
        str(db), image_size=16, batch_size=4, num_workers=workers, engine=engine, val_fraction=0.25, drop_last=False,
        return_index=True,
    )  # fmt: skip
    assert dm.target_kind == kind
    assert (dm.num_classes, dm.target_dim) == ((4, 0) if kind == "multilabel" else (0, 3))
    model = _CheckingModel(db, 4 if kind == "multilabel" else 3)
    _trainer(max_epochs=1).fit(model, datamodule=dm)
    held_out = dm.val_dataset.indices.tolist()  # type: ignore[union-attr]
    assert sorted(model.seen) == sorted(set(range(TRAIN)) - set(held_out))
    # in order: the held-out samples' records in `train`, which the held-out view reads
    np.testing.assert_array_equal(torch.cat(model.val_targets).numpy(), model.dataset.targets_of(held_out))
    assert dm.hparams["return_index"] is True


def test_return_index_names_the_source_of_each_training_and_predicted_sample(database: Path) -> None:
    """``sources(split)[index]`` names each training and predict batch's file; validation and test batches stay
    ``(images, targets)`` with ``return_index`` (solo-learn's ``X, targets = batch``)."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=2, return_index=True)
    classes = dm.classes

    class Named(_CheckingModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels, index = batch
            sources = dm.sources("train")
            for label, i in zip(labels.tolist(), index.tolist(), strict=True):
                assert Path(sources[i]).parent.name == classes[label]
            self.seen += index.tolist()
            return self._loss(images, labels)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.validation_step(batch, batch_idx)

    model = Named(database, len(classes))
    _trainer(max_epochs=1, num_sanity_val_steps=1).fit(model, datamodule=dm)  # the sanity check unpacks two too
    assert sorted(model.seen)[: len(dm.sources("train"))] == sorted(set(model.seen))
    val_labels = [classes.index(Path(source).parent.name) for source in dm.sources("val")]
    assert torch.cat(model.val_targets).tolist() == val_labels[:4] + val_labels  # the sanity check's batch, then all
    assert {len(batch) for batch in dm.val_dataloader()} == {2}
    predicted = torch.cat(_trainer().predict(model, datamodule=dm)).tolist()  # type: ignore[arg-type]
    assert predicted == list(range(len(dm.predict_sources())))
    assert dm.sources() == dm.sources("train")
    with pytest.raises(ValueError, match="split 'nope' is not in"):
        dm.sources("nope")


def test_the_predict_split_indexes_its_database_split_and_the_held_out_view_has_none(kinds: dict[str, Path]) -> None:
    """A converted dataset's database: predict's index is its record in ``test``; the held-out validation view's
    batches are ``(images, targets)`` of its records in ``train``, in order."""
    dm = FastImageDataModule(str(kinds["multilabel"]), image_size=16, batch_size=4, num_workers=0, return_index=True)
    dm.setup("fit")
    val = list(dm.val_dataloader())
    assert {len(batch) for batch in val} == {2}
    held_out = dm.val_dataset.indices.tolist()  # type: ignore[union-attr]
    assert len(held_out) == round(TRAIN * 0.1)
    train = LmdbImageDataset(kinds["multilabel"], "train")
    assert torch.equal(torch.cat([b[1].cpu() for b in val]), torch.from_numpy(train.targets_of(held_out)))
    predict = [batch for batch in dm.predict_dataloader()]
    assert torch.cat([b[2].cpu() for b in predict]).tolist() == list(range(TEST))
    assert dm.predict_sources() == dm.sources("test")
    test = LmdbImageDataset(kinds["multilabel"], "test")
    assert torch.equal(torch.cat([b[1].cpu() for b in predict]), torch.from_numpy(test.targets_of(range(TEST))))


def test_num_classes_and_target_kind_of_every_kind(kinds: dict[str, Path]) -> None:
    """``num_classes`` counts the classes of class and multilabel databases, 0 otherwise; ``target_dim`` floats."""
    found = {
        kind: (dm.target_kind, dm.num_classes, dm.target_dim)
        for kind, dm in ((kind, FastImageDataModule(str(db))) for kind, db in kinds.items())
    }
    assert found == {
        "class": ("class", 4, 0),
        "multilabel": ("multilabel", 4, 0),
        "float": ("float", 0, 3),
        "float1": ("float", 0, 1),
        "none": ("none", 0, 0),
    }


@pytest.mark.parametrize(("engine", "workers"), [("threads", 0), ("processes", 2)])
def test_without_return_index_a_batch_is_images_and_the_targets_of_its_kind(
    kinds: dict[str, Path], engine: str, workers: int
) -> None:
    """The fused path without ``return_index``: ``(images, targets)``, multi-hot rows in their samples' order."""
    dataset = LmdbImageDataset(kinds["multilabel"], transform=CenterCropResize(16))
    batches = list(create_loader(dataset, 8, engine=engine, workers=workers))
    assert {len(batch) for batch in batches} == {2}
    targets = torch.cat([batch[1] for batch in batches])
    assert targets.dtype == torch.float32
    np.testing.assert_array_equal(targets.numpy(), dataset.targets_of(range(TRAIN)))
