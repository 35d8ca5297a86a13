"""Tests for ``FastImageDataModule``: conversion, splits, loaders, worker budget and on-device normalization."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import io
import json
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from fakes import fake_trainer
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from lightning_fastdata import (
    FastImageDataModule,
    LmdbImageDataset,
    ResumeCheckpoint,
    ViewGroup,
    convert,
    make_image_folder,
)
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, CenterCropResize, RandomResizedCropFlip

ROOT = Path(__file__).resolve().parents[1]

#: split folder: 3 classes x (6 train + 2 val); plain folder: 3 classes x 10, no val
SPLIT_TRAIN, SPLIT_VAL, PLAIN_TOTAL = 18, 6, 30


@pytest.fixture(scope="module")
def split_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated ``root/{train,val}/class_<k>/*.jpg`` folder."""
    root = tmp_path_factory.mktemp("dm_split") / "split"
    return make_image_folder(
        root, num_classes=3, train_per_class=6, val_per_class=2, min_size=40, max_size=80, num_workers=1
    )


@pytest.fixture(scope="module")
def plain_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated plain ImageFolder ``root/class_<k>/*.jpg`` (no val split)."""
    root = tmp_path_factory.mktemp("dm_plain") / "plain"
    return make_image_folder(
        root, num_classes=3, train_per_class=10, val_per_class=0, min_size=40, max_size=80, seed=1, num_workers=1
    )


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by the tests of this module that do not test conversion itself."""
    return tmp_path_factory.mktemp("dm_cache")


def _dm(data_dir: Path, cache_dir: Path, cls: type[FastImageDataModule] = FastImageDataModule, **kwargs: Any) -> Any:
    """A small datamodule training on the CPU (no workers unless asked), converted and set up."""
    kwargs = {"image_size": 16, "batch_size": 4, "num_workers": 0, **kwargs}
    dm = cls(data_dir=str(data_dir), cache_dir=str(cache_dir), **kwargs)
    dm.trainer = fake_trainer("cpu")
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _visible(folder: Path) -> list[str]:
    """The names in `folder`, hidden ones (the conversion lock file) left out."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _normalized(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


# ----------------------------------------------------------------------------------------------------------------
# Conversion and splits
# ----------------------------------------------------------------------------------------------------------------


def test_prepare_data_converts_once_into_cache_dir(split_root: Path, tmp_path: Path) -> None:
    """`prepare_data` converts into `cache_dir`; a second call leaves the database untouched."""
    cache = tmp_path / "cache"
    dm = FastImageDataModule(str(split_root), cache_dir=str(cache), num_workers=0)
    assert dm.num_classes == 3  # from the folder names, before conversion
    assert not dm.is_database
    dm.prepare_data()
    db = dm.database_path
    assert db.parent == cache.absolute()
    data_file = db / "data.mdb"
    assert data_file.is_file()
    assert _visible(cache) == [db.name]
    mtime = data_file.stat().st_mtime_ns
    dm.prepare_data()
    FastImageDataModule(str(split_root), cache_dir=str(cache), num_workers=0).prepare_data()
    assert data_file.stat().st_mtime_ns == mtime
    assert _visible(cache) == [db.name]
    assert dm.classes == ["class_0", "class_1", "class_2"]


def test_data_dir_database_converts_nothing(split_root: Path, tmp_path: Path) -> None:
    """A `data_dir` that already is a database is read in place; nothing is written to `cache_dir`."""
    db = tmp_path / "db.lmdb"
    convert(split_root, db, short_side=64, num_workers=0, progress=False)
    mtime = (db / "data.mdb").stat().st_mtime_ns
    cache = tmp_path / "cache"
    dm = FastImageDataModule(str(db), cache_dir=str(cache), num_workers=0, image_size=16)
    assert dm.is_database
    assert dm.database_path == db.absolute()
    dm.prepare_data()
    dm.setup("fit")
    assert not cache.exists()
    assert (db / "data.mdb").stat().st_mtime_ns == mtime
    assert len(dm.train_dataset) == SPLIT_TRAIN
    assert len(dm.val_dataset) == SPLIT_VAL


def test_setup_uses_val_split(split_root: Path, shared_cache: Path) -> None:
    """With a `val` split, train and val are the database's own splits with their transforms."""
    dm = _dm(split_root, shared_cache, val_fraction=0.5)
    assert isinstance(dm.train_dataset, LmdbImageDataset)
    assert isinstance(dm.val_dataset, LmdbImageDataset)
    assert dm.train_dataset.split == "train"
    assert dm.val_dataset.split == "val"
    assert len(dm.train_dataset) == SPLIT_TRAIN  # val_fraction is ignored when there is a val split
    assert len(dm.val_dataset) == SPLIT_VAL
    assert isinstance(dm.train_dataset.transform, RandomResizedCropFlip)
    assert isinstance(dm.val_dataset.transform, CenterCropResize)


def test_setup_holds_out_val_fraction(plain_root: Path, shared_cache: Path) -> None:
    """Without a val split, `val_fraction` of train is held out: disjoint, complete, deterministic per seed."""
    dm = _dm(plain_root, shared_cache, val_fraction=0.2, seed=0)
    train, val = dm.train_dataset.indices.tolist(), dm.val_dataset.indices.tolist()
    assert len(val) == round(PLAIN_TOTAL * 0.2)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(PLAIN_TOTAL))
    assert len(dm.train_dataset) == len(train)

    same = _dm(plain_root, shared_cache, val_fraction=0.2, seed=0)
    assert same.val_dataset.indices.tolist() == val
    other = _dm(plain_root, shared_cache, val_fraction=0.2, seed=1)
    assert other.val_dataset.indices.tolist() != val

    # the held-out view reads the training split with the validation transform
    image, label = dm.val_dataset[0]
    base = LmdbImageDataset(dm.database_path, split="train", transform=CenterCropResize(16), fast_decode=True)
    expected_image, expected_label = base[val[0]]
    assert torch.equal(image, expected_image)
    assert label == expected_label


def test_setup_without_val(plain_root: Path, shared_cache: Path) -> None:
    """`val_fraction=0` on a folder without val trains on everything and has no val loader."""
    dm = _dm(plain_root, shared_cache, val_fraction=0)
    assert len(dm.train_dataset) == PLAIN_TOTAL
    assert dm.val_dataset is None
    assert dm.val_dataloader() == []


def test_cache_dir_inside_data_dir_raises(split_root: Path, tmp_path: Path) -> None:
    """A `cache_dir` inside `data_dir` is refused before anything is written."""
    source = tmp_path / "src"
    make_image_folder(source, num_classes=2, train_per_class=2, val_per_class=0, min_size=40, max_size=50)
    dm = FastImageDataModule(str(source), cache_dir=str(source / "cache"), num_workers=0)
    with pytest.raises(ValueError, match="`cache_dir`"):
        dm.prepare_data()
    assert not (source / "cache").exists()


# ----------------------------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------------------------


def test_train_batches_on_cpu_are_normalized_float(split_root: Path, shared_cache: Path) -> None:
    """On a CPU the loader threads normalize: batches are `(float32 [B, 3, S, S], int64 [B])`, ready for the model."""
    dm = _dm(split_root, shared_cache, image_size=24, batch_size=5)
    loader = dm.train_dataloader()
    assert isinstance(loader, DataLoader)  # a real DataLoader (resumable: it saves its position in checkpoints)
    batches = list(loader)
    assert len(batches) == SPLIT_TRAIN // 5  # drop_last
    images, labels = batches[0]
    assert images.dtype == torch.float32
    assert tuple(images.shape) == (5, 3, 24, 24)
    assert images.is_contiguous()
    assert -2.2 < images.min() < images.max() < 2.7  # ImageNet-normalized range
    assert labels.dtype == torch.int64
    assert tuple(labels.shape) == (5,)
    assert set(torch.cat([b[1] for b in batches]).tolist()) <= {0, 1, 2}
    assert dm.on_after_batch_transfer((images, labels), 0)[0] is images  # nothing left to do


def test_train_batches_for_cuda_are_uint8(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For CUDA training batches stay uint8 (a quarter of the bytes to copy) and are normalized on the device."""
    monkeypatch.setattr(FastImageDataModule, "_device", lambda self: torch.device("cuda", 0))
    dm = _dm(split_root, shared_cache, image_size=24, batch_size=5, pin_memory=False, prefetch_to_device=False)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8
    assert tuple(images.shape) == (5, 3, 24, 24)
    assert images.is_contiguous(memory_format=torch.channels_last)  # NHWC memory: how the crops are written
    assert labels.dtype == torch.int64


def test_val_batches_keep_the_last_partial_batch(split_root: Path, shared_cache: Path) -> None:
    """Validation sees every sample, in order; `drop_last` applies to training only."""
    dm = _dm(split_root, shared_cache, batch_size=4)
    labels = torch.cat([b[1] for b in dm.val_dataloader()])
    assert labels.tolist() == dm.val_dataset.targets
    assert len(list(dm.train_dataloader())) == SPLIT_TRAIN // 4
    assert len(list(_dm(split_root, shared_cache, batch_size=4, drop_last=False).train_dataloader())) == 5


def _uint8_batch(dm: FastImageDataModule) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_fastdata.pipeline.kernel import BatchReader

    return BatchReader(dm.train_dataset, output="uint8").read_batch(range(4))


def test_on_after_batch_transfer_normalizes(split_root: Path, shared_cache: Path) -> None:
    """A uint8 batch becomes normalized float32; extra batch elements pass through."""
    dm = _dm(split_root, shared_cache)
    images, labels = _uint8_batch(dm)
    index = torch.arange(4)
    out = dm.on_after_batch_transfer((images, labels, index), 0)
    assert isinstance(out, tuple)
    assert len(out) == 3
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], _normalized(images), rtol=0, atol=1e-5)
    assert out[1] is labels
    assert out[2] is index
    as_list = dm.on_after_batch_transfer([images, labels], 0)
    assert isinstance(as_list, list)
    torch.testing.assert_close(as_list[0], out[0])
    # an already-float batch, or something else, is returned as it is
    assert dm.on_after_batch_transfer(out, 0) is out
    assert dm.on_after_batch_transfer({"x": images}, 0)["x"] is images


def test_on_after_batch_transfer_channels_last(split_root: Path, shared_cache: Path) -> None:
    """`channels_last=True` hands the model channels_last batches."""
    dm = _dm(split_root, shared_cache, channels_last=True)
    images, labels = _uint8_batch(dm)
    assert next(iter(dm.train_dataloader()))[0].is_contiguous(memory_format=torch.channels_last)
    out, _ = dm.on_after_batch_transfer((images, labels), 0)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, _normalized(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
        ("16-mixed", torch.float32),
        ("bf16-mixed", torch.float32),
        ("32-true", torch.float32),
    ],
)
def test_on_after_batch_transfer_precision_dtype(precision: str, dtype: torch.dtype) -> None:
    """True half precision gets half batches; mixed precision keeps float32 (autocast handles the rest)."""
    dm = FastImageDataModule("unused", num_workers=0)
    dm.trainer = fake_trainer("cpu", precision=precision)
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    out, _ = dm.on_after_batch_transfer((images, torch.zeros(2, dtype=torch.int64)), 0)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _normalized(images), rtol=1e-2, atol=2e-2)


def test_num_workers_auto_divides_cpus_by_processes_per_node(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`num_workers="auto"` is the usable CPUs divided by the training processes of this node."""
    monkeypatch.setattr("lightning_fastdata.cpus.usable_cpu_count", lambda: 8)
    dm = _dm(split_root, shared_cache, num_workers="auto")
    assert dm.resolved_num_workers() == 8  # no trainer: one process
    dm.trainer = fake_trainer(
        "cpu", world_size=8, num_nodes=2, distributed_sampler_kwargs={"num_replicas": 8, "rank": 3}
    )
    assert dm.worker_budget() == 2
    loader = dm.train_dataloader()
    assert loader.workers == 2
    assert loader.engine == "threads"
    assert loader.sampler.num_replicas == 8
    assert loader.sampler.rank == 3
    assert len(loader.sampler) == -(-SPLIT_TRAIN // 8)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 8 worker processes")
def test_engine_auto_picks_processes_for_cuda_training_with_enough_workers(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine="auto"`` (the default): worker processes for uint8 CUDA batches from 4 workers on, else threads; each
    choice is logged once, and an explicit engine is kept."""
    from lightning_fastdata import cpus, workers

    infos: list[str] = []
    monkeypatch.setattr(
        workers,
        "rank_zero_info",
        lambda message, *a, **k: infos.append(str(message)) if "engine=" in message else None,
    )
    dm = _dm(split_root, shared_cache)
    assert dm.engine == "auto"
    assert dm.resolved_engine(16) == "threads"  # CPU training: threads write normalized floats into the batch
    assert dm.resolved_engine(16) == "threads"
    assert infos == ["FastImageDataModule: engine='auto' chose 'threads' (training on the CPU)."]
    dm.trainer = fake_trainer("cuda")
    assert [dm.resolved_engine(w) for w in (0, 2, 3, 4, 16)] == ["threads"] * 3 + ["processes"] * 2
    assert infos[1:] == ["FastImageDataModule: engine='auto' chose 'processes' (CUDA training with 4 workers)."]

    encoded = _dm(split_root, shared_cache, decode="device")
    encoded.trainer = fake_trainer("cuda")
    assert encoded.resolved_engine(16) == "threads"  # workers only read bytes for nvJPEG

    monkeypatch.setattr(cpus, "usable_cpu_count", lambda: 8)
    dm = _dm(split_root, shared_cache, num_workers="auto")
    dm.trainer = fake_trainer("cuda")
    assert (dm.train_dataloader().engine, dm.train_dataloader().workers) == ("processes", 8)
    explicit = _dm(split_root, shared_cache, num_workers="auto", engine="threads")
    explicit.trainer = fake_trainer("cuda")
    assert explicit.train_dataloader().engine == "threads"
    with pytest.raises(ValueError, match="'auto', 'threads' or 'processes'"):
        FastImageDataModule(str(split_root), engine="fibers")  # type: ignore[arg-type]


def test_num_workers_above_budget_warns_once(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `num_workers` above the budget is used, with one warning that names the budget."""
    monkeypatch.setattr("lightning_fastdata.cpus.usable_cpu_count", lambda: 3)
    dm = _dm(split_root, shared_cache, num_workers=5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = dm.train_dataloader()
        dm.train_dataloader()
        dm.val_dataloader()
    budget_warnings = [w for w in record if "budget" in str(w.message)]
    assert len(budget_warnings) == 1
    assert issubclass(budget_warnings[0].category, UserWarning)
    assert "`num_workers=5`" in str(budget_warnings[0].message)
    assert "budget of 3" in str(budget_warnings[0].message)
    assert first.workers == 5


def test_num_workers_within_budget_does_not_warn(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `num_workers` within the budget is used silently."""
    monkeypatch.setattr("lightning_fastdata.cpus.usable_cpu_count", lambda: 3)
    dm = _dm(split_root, shared_cache, num_workers=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert dm.train_dataloader().workers == 3
    assert not [w for w in record if "budget" in str(w.message)]


def test_loader_defaults_and_pass_through(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pin_memory` follows the device, `persistent_workers` the worker count; explicit values pass through."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dm = _dm(split_root, shared_cache, num_workers=0)
    loader = dm.train_dataloader()
    assert loader.page_locked is False
    assert loader.persistent_workers is False  # no workers to keep

    dm.trainer = fake_trainer("cuda")
    loader = dm.train_dataloader()
    assert loader.page_locked is True  # training on CUDA pins by default: the batch slots, once
    assert loader.pin_memory is False  # so torch runs no pin-memory thread copying each batch again

    dm = _dm(split_root, shared_cache, num_workers=2, prefetch_factor=3)
    loader = dm.train_dataloader()
    assert (loader.engine, loader.threads, loader.prefetch_batches) == ("threads", 2, 6)

    dm = _dm(split_root, shared_cache, num_workers=1, prefetch_factor=3, engine="processes")
    loader = dm.train_dataloader()
    assert loader.page_locked is False
    assert loader.persistent_workers is True
    assert loader.prefetch_factor == 3
    assert loader.worker_init_fn is not None

    dm = _dm(split_root, shared_cache, num_workers=1, pin_memory=True, persistent_workers=False, engine="processes")
    loader = dm.val_dataloader()
    assert loader.page_locked is True
    assert loader.persistent_workers is False
    assert loader.prefetch_factor == 2  # PyTorch's default


def test_workers_load_the_same_batches(split_root: Path, shared_cache: Path) -> None:
    """Batches read by worker processes equal those read in the main process (validation: deterministic)."""
    in_process = torch.cat([b[0] for b in _dm(split_root, shared_cache, num_workers=0).val_dataloader()])
    # not persistent: the workers exit when the epoch ends (a persistent iterator reclaimed by the cyclic garbage
    # collector instead stalls 5 s per worker in PyTorch's shutdown, pytorch/pytorch#81794)
    loader = _dm(split_root, shared_cache, num_workers=2, persistent_workers=False).val_dataloader()
    with_workers = torch.cat([b[0] for b in loader])
    assert torch.equal(in_process, with_workers)


def test_shuffle_changes_with_epoch_and_repeats_with_seed(split_root: Path, shared_cache: Path) -> None:
    """The training order differs between epochs, repeats for the same seed and differs for another seed."""

    def orders(seed: int) -> list[list[int]]:
        sampler = _dm(split_root, shared_cache, seed=seed).train_dataloader().sampler
        result = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            result.append(list(sampler))
        return result

    first = orders(seed=0)
    assert sorted(first[0]) == list(range(SPLIT_TRAIN))
    assert first[0] != first[1]
    assert first[0] != list(range(SPLIT_TRAIN))
    assert orders(seed=0) == first
    assert orders(seed=1)[0] != first[0]
    # the val loader is in order
    assert list(_dm(split_root, shared_cache).val_dataloader().sampler) == list(range(SPLIT_VAL))


def test_hyperparameters_saved() -> None:
    """`save_hyperparameters` records the constructor arguments."""
    dm = FastImageDataModule("some/where", batch_size=7, image_size=48, num_workers=2, seed=3)
    assert dm.hparams.batch_size == 7
    assert dm.hparams.image_size == 48
    assert dm.hparams.num_workers == 2
    assert dm.hparams.seed == 3
    assert dm.hparams.data_dir == "some/where"
    assert dm.hparams.val_fraction == 0.1


def _loaded(hparams: Any) -> dict[str, Any]:
    """``hparams`` after ``torch.save`` and ``torch.load(weights_only=True)``, as Lightning loads a checkpoint."""
    buffer = io.BytesIO()
    torch.save(dict(hparams), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


#: a value of each of FastImageDataModule's arguments in a form a Python caller passes: paths, dataclasses, tuples,
#: NumPy values; every argument of the signature is here (the test says which one is missing)
_ARGUMENT_FORMS: dict[str, Any] = {
    "data_dir": Path("some/where"),
    "cache_dir": Path("/tmp/fastdata-cache-form"),
    "image_size": np.int64(32),
    "image_size_schedule": {0: 16, 2: 32},
    "batch_size": 8,
    "num_workers": "tune",
    "engine": "processes",
    "pin_memory": True,
    "persistent_workers": False,
    "prefetch_factor": 3,
    "val_fraction": 0.2,
    "seed": 7,
    "mean": np.array([0.5, 0.4, 0.3]),
    "std": [0.2, 0.25, 0.3],
    "scale": (0.1, 1.0),
    "crop_fraction": np.float32(0.75),
    "short_side": 128,
    "quality": 80,
    "encoding": "raw",
    "channels_last": True,
    "drop_last": False,
    "prefetch_to_device": False,
    "decode": "device",
    "on_bad_sample": "skip",
    "predict_split": "val",
    "prepare_data_per_node": False,
    "max_pixels": None,
    "targets": "multilabel",
    "label_separator": ";",
    "return_index": True,
    "views": [ViewGroup(12, count=3, scale=(0.05, 0.4)), ViewGroup(24, count=2, blur_p=1.0)],
    "color_jitter": (0.4, 0.4, 0.2, 0.1),
    "color_jitter_p": 0.5,
    "grayscale_p": 0.2,
    "blur_p": 0.1,
    "blur_sigma": (0.2, 1.5),
    "solarize_p": 0.2,
    "worker_nice": 19,
}
#: arguments that cannot go together: views are refused with a size schedule and with device decode
_APART = {"views": ("image_size_schedule", "decode")}


@pytest.mark.parametrize("name", sorted(_ARGUMENT_FORMS))
def test_every_argument_is_saved_as_what_a_checkpoint_loads_back(name: str) -> None:
    """Each argument of the signature, in the form a Python caller passes it (a ``ViewGroup``, a ``Path``, a tuple, a
    NumPy value), is saved as a value ``torch.load(weights_only=True)`` reads back and the constructor takes again."""
    parameters = set(inspect.signature(FastImageDataModule.__init__).parameters) - {"self"}
    assert parameters == set(_ARGUMENT_FORMS), "give each argument of FastImageDataModule a form in _ARGUMENT_FORMS"
    kwargs = {"data_dir": "some/where", name: _ARGUMENT_FORMS[name]}
    dm = FastImageDataModule(**kwargs)
    loaded = _loaded(dm.hparams)  # raised UnpicklingError (Unsupported global) for a ViewGroup or a Path
    rebuilt = FastImageDataModule(**loaded)
    assert _loaded(rebuilt.hparams) == loaded
    settings = {  # what each argument sets, where it is not an attribute of the same name
        "mean": lambda m: m.normalizer.mean,
        "std": lambda m: m.normalizer.std,
        **{key: lambda m: repr(m._color) for key in ("color_jitter", "color_jitter_p", "grayscale_p", "blur_p")},
        **{key: lambda m: repr(m._color) for key in ("blur_sigma", "solarize_p")},
    }
    setting = settings.get(name, lambda m: getattr(m, name, None))
    assert setting(rebuilt) == setting(dm) or str(setting(rebuilt)) == str(setting(dm))


class _Mode(str, enum.Enum):
    FAST = "fast"
    CAREFUL = "careful"


@dataclasses.dataclass(frozen=True)
class _Region:
    left: int
    size: tuple[int, int]


class _OwnArguments(FastImageDataModule):
    """A subclass with arguments of its own: an enum, a dataclass and a path, taken back in their plain forms."""

    def __init__(
        self,
        mode: _Mode = _Mode.FAST,
        region: _Region | dict[str, Any] | None = None,
        notes: Path | str = "notes.txt",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.mode = _Mode(mode)
        self.region = _Region(**region) if isinstance(region, dict) else region
        self.notes = Path(notes)


def test_a_subclasss_enum_dataclass_and_path_arguments_load_back_from_a_checkpoint(recwarn: Any) -> None:
    """A subclass's own arguments are saved plainly too: the enum's value, the dataclass's fields, the path's text."""
    dm = _OwnArguments(
        mode=_Mode.CAREFUL, region=_Region(3, (4, 5)), notes=Path("/x/notes.txt"), data_dir=Path("some/where")
    )
    loaded = _loaded(dm.hparams)
    assert (loaded["mode"], loaded["region"], loaded["notes"]) == (
        "careful",
        {"left": 3, "size": (4, 5)},
        "/x/notes.txt",
    )
    rebuilt = _OwnArguments(**loaded)
    assert (rebuilt.mode, rebuilt.region, rebuilt.notes) == (_Mode.CAREFUL, _Region(3, (4, 5)), Path("/x/notes.txt"))
    assert not [w for w in recwarn if "would not load" in str(w.message)]


def test_an_argument_that_cannot_load_from_a_checkpoint_warns_naming_it() -> None:
    """An object of a class of one's own (not a dataclass) would make every resume fail: a warning names it, once."""

    class _Opaque:
        pass

    class _WithObject(FastImageDataModule):
        def __init__(self, thing: Any = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            _WithObject(thing=_Opaque(), data_dir="some/where")
    said = [str(w.message) for w in record if "would not load" in str(w.message)]
    assert len(said) == 1  # once per class
    assert "the saved argument(s) `thing` (_Opaque) would not load from a checkpoint" in said[0]
    assert "`self.hparams.pop(name)`" in said[0]


def test_a_fit_with_view_groups_and_paths_resumes_and_loads_from_its_checkpoint(
    make_database: Callable[..., Path], tmp_path: Path
) -> None:
    """``views=[ViewGroup(...)]`` with ``data_dir`` and ``cache_dir`` as paths, what ``make_image_folder`` returns:
    the run's ``last.ckpt`` resumes under Lightning's default loading; ``load_from_checkpoint`` rebuilds the module."""
    folder = make_image_folder(tmp_path / "images", num_classes=2, train_per_class=8, val_per_class=0, min_size=24,
                               max_size=32)  # fmt: skip
    views = [ViewGroup(16, count=2, scale=(0.4, 1.0)), ViewGroup(8, count=2, scale=(0.1, 0.4))]

    def fit(max_steps: int) -> Trainer:
        dm = FastImageDataModule(folder, cache_dir=tmp_path / "cache", image_size=16, batch_size=4, num_workers=0,
                                 views=views, val_fraction=0)  # fmt: skip
        trainer = Trainer(
            accelerator="cpu", max_steps=max_steps, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[ResumeCheckpoint(every_n_train_steps=2)],
        )  # fmt: skip
        trainer.fit(_ViewsTinyModel(), datamodule=dm, ckpt_path="last")
        return trainer

    fit(max_steps=2)
    assert fit(max_steps=3).global_step == 3  # restored step 2 from the checkpoint, then trained one more
    restored = FastImageDataModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert restored.views == tuple(sorted(views, key=lambda g: -g.size))
    assert (restored.data_dir, restored.cache_dir) == (str(folder), str(tmp_path / "cache"))


class _ViewsTinyModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, targets = batch
        return sum(torch.nn.functional.cross_entropy(self.layer(v.mean(dim=(2, 3))), targets) for v in views)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"image_size": 0}, "image_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"num_workers": "many"}, "num_workers"),
        ({"prefetch_factor": 0}, "prefetch_factor"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"mean": (0.5, 0.5)}, "mean"),
        ({"std": (0.2, 0.0, 0.2)}, "std"),
    ],
)
def test_invalid_arguments_raise(kwargs: dict[str, Any], name: str) -> None:
    """Invalid arguments raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=f"`{name}`"):
        FastImageDataModule("some/where", **kwargs)


class _SavingModule(LightningModule):
    """A tiny model saving hyperparameters named as the DataModule's are: ``image_size``, ``batch_size``, ``mean``."""

    def __init__(self, image_size: int = 16, batch_size: int = 4, mean: Any = IMAGENET_MEAN) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _TinyNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_with_csv_logger(database: Path, tmp_path: Path, model: LightningModule) -> tuple[dict[str, Any], list[str]]:
    """Fit ``model`` one step with a real CSVLogger; the hyperparameters it wrote and the warnings of the run."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 1
    hparams = yaml.safe_load((Path(trainer.logger.log_dir) / "hparams.yaml").read_text().replace("!!python/tuple", ""))
    return hparams, [str(w.message) for w in caught if "FastImageDataModule `" in str(w.message)]


def test_a_model_that_saved_the_same_values_fits_and_logs_each_once(database: Path, tmp_path: Path) -> None:
    """A model that saved ``image_size`` and ``batch_size`` equal to the DataModule's: one entry each, no warning."""
    hparams, said = _fit_with_csv_logger(database, tmp_path, _SavingModule(image_size=16, batch_size=4))
    assert said == []
    assert (hparams["image_size"], hparams["batch_size"], hparams["data_dir"]) == (16, 4, str(database))
    assert not any(key.startswith("datamodule/") for key in hparams)


def test_a_model_that_saved_other_values_fits_and_a_line_names_both(database: Path, tmp_path: Path) -> None:
    """A model that saved ``batch_size=32`` and ``image_size=224`` beside the DataModule's 4 and 16: the fit runs (it
    stopped with Lightning's "Error while merging hparams"), one line per name gives both values, both are logged,
    and the checkpoint still rebuilds the DataModule with its own values; ``mean`` as a list is the same setting."""
    model = _SavingModule(image_size=224, batch_size=32, mean=list(IMAGENET_MEAN))
    hparams, said = _fit_with_csv_logger(database, tmp_path, model)
    assert said == [
        "The model saved `batch_size=32` and FastImageDataModule `batch_size=4` (which its loaders use): loggers get"
        " the DataModule's as `datamodule/batch_size`. Pass the same value to both if they should agree.",
        "The model saved `image_size=224` and FastImageDataModule `image_size=16` (which its loaders use): loggers get"
        " the DataModule's as `datamodule/image_size`. Pass the same value to both if they should agree.",
    ]
    assert (hparams["batch_size"], hparams["datamodule/batch_size"]) == (32, 4)
    assert (hparams["image_size"], hparams["datamodule/image_size"]) == (224, 16)
    assert hparams["mean"] == hparams["datamodule/mean"] == list(IMAGENET_MEAN)
    checkpoint = next((tmp_path / "logs").rglob("*.ckpt"))
    restored = FastImageDataModule.load_from_checkpoint(checkpoint)
    assert (restored.batch_size, restored.image_size, restored.data_dir) == (4, 16, str(database))


# ----------------------------------------------------------------------------------------------------------------
# Subclasses and training
# ----------------------------------------------------------------------------------------------------------------


def test_jitter_subclass_changes_train_transform_only(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example `JitterDataModule` jitters training crops and leaves validation untouched."""
    monkeypatch.syspath_prepend(str(ROOT))
    from fastdata_examples.augmented_datamodule import JitterDataModule

    plain = _dm(split_root, shared_cache)
    jitter = _dm(split_root, shared_cache, cls=JitterDataModule, jitter=0.4)
    no_jitter = _dm(split_root, shared_cache, cls=JitterDataModule, jitter=0.0)
    assert jitter.hparams.batch_size == 4
    differ = 0
    for index in range(6):
        random.seed(index)
        expected, label = plain.train_dataset[index]
        random.seed(index)
        jittered, jittered_label = jitter.train_dataset[index]
        random.seed(index)
        untouched, _ = no_jitter.train_dataset[index]
        assert jittered.dtype == torch.uint8
        assert jittered.shape == expected.shape
        assert jittered_label == label
        assert torch.equal(untouched, expected)
        differ += int(not torch.equal(jittered, expected))
        assert torch.equal(jitter.val_dataset[index][0], plain.val_dataset[index][0])
    assert differ >= 5


class _OwnValTransform(FastImageDataModule):
    """The built-in validation transform, wrapped: validation takes the per-sample path (``dataset[i]``)."""

    def val_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        base = super().val_transform()
        return lambda image: base(image)


def test_a_transform_of_ones_own_sees_the_built_in_paths_pixels(split_root: Path, shared_cache: Path) -> None:
    """The per-sample path (a transform of one's own) decodes as the built-in batch path does: overriding one split's
    transform does not give it other pixels than the other split's (before, it decoded accurately and the batch path
    fast: a grey level apart on average)."""
    plain = _dm(split_root, shared_cache, num_workers=0)
    own = _dm(split_root, shared_cache, cls=_OwnValTransform, num_workers=0)
    uint8 = next(iter(own.val_dataloader()))[0]  # normalized later, in `on_after_batch_transfer`
    assert uint8.dtype == torch.uint8
    # a grey level is 0.017 here: the same pixels, up to the float rounding of the two normalizations
    assert torch.allclose(_normalized(uint8), next(iter(plain.val_dataloader()))[0], atol=1e-4)


def test_jitter_subclass_batches_are_the_same_in_every_run(
    split_root: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example draws from ``sample_rng()``: two runs with the same seed train on the same jittered batches, on
    loader threads too (it drew from the global ``random`` before, and no two runs matched)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from fastdata_examples.augmented_datamodule import JitterDataModule

    def first_batch() -> torch.Tensor:
        return next(
            iter(_dm(split_root, shared_cache, cls=JitterDataModule, jitter=0.4, num_workers=2).train_dataloader())
        )[0]

    assert torch.equal(first_batch(), first_batch())


class _TorchvisionAugmented(FastImageDataModule):
    """Random torchvision v2 transforms of one's own after the built-in crop, all drawing from torch's generator."""

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return v2.Compose([super().train_transform(), v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.RandAugment()])


def _epoch(loader: Any, stop: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the batches of one epoch of ``loader`` (its first ``stop``, when given)."""
    batches = []
    for images, labels in loader:
        batches.append((images.clone(), labels.clone()))
        if len(batches) == stop:
            break
    return batches


def test_a_random_torchvision_transform_gives_the_same_batches_on_every_engine_and_after_a_resume(
    database: Path,
) -> None:
    """``RandAugment`` and ``ColorJitter`` of one's own: the same batches in every run, whatever the global seed, on
    loader threads, worker processes and the training thread, and an epoch resumed after 2 batches equals the whole
    one (on threads they followed thread scheduling; everywhere a resume drew other numbers)."""

    def loader(engine: str, workers: int) -> Any:
        dm = _TorchvisionAugmented(
            str(database), image_size=16, batch_size=4, val_fraction=0, num_workers=workers, engine=engine
        )
        dm.trainer = fake_trainer("cpu")
        dm.setup("fit")
        made = dm.train_dataloader()
        made.sampler.set_epoch(1)
        return made

    reference = None
    for run, (engine, workers) in enumerate([("threads", 2), ("threads", 2), ("processes", 2), ("threads", 0)]):
        torch.manual_seed(run)  # the global generator's state does not matter
        whole = _epoch(loader(engine, workers))
        interrupted = loader(engine, workers)
        head = _epoch(interrupted, stop=2)
        resumed = loader(engine, workers)
        resumed.load_state_dict(interrupted.state_dict())
        reference = reference or whole
        for batches in (whole, head + _epoch(resumed)):
            assert len(batches) == 6
            for (images, labels), (expected, expected_labels) in zip(batches, reference, strict=True):
                torch.testing.assert_close(images, expected, rtol=0, atol=0, msg=f"{engine}, {workers} workers")
                assert labels.tolist() == expected_labels.tolist()


class _PythonRandomAugmented(FastImageDataModule):
    """A transform of one's own that draws from Python's `random` (a flip), which loader threads cannot key."""

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        base = super().train_transform()
        return lambda image: base(image).flip(-1) if random.random() < 0.5 else base(image)


class _NumpyRandomAugmented(FastImageDataModule):
    """A transform of one's own that draws from NumPy's global generator."""

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        base = super().train_transform()
        return lambda image: base(image).add(int(np.random.randint(0, 2))).clamp(0, 255).to(torch.uint8)


def _jitter_datamodule(data_dir: str, **kwargs: Any) -> FastImageDataModule:
    """The shipped example (examples/configs/cpu.yaml's data module), whose draws come from ``sample_rng()``."""
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        from fastdata_examples.augmented_datamodule import JitterDataModule
    finally:
        sys.path.remove(str(ROOT))
    return JitterDataModule(data_dir=data_dir, jitter=0.2, **kwargs)


@pytest.mark.parametrize(
    ("cls", "engine", "workers", "said"),
    [
        (_PythonRandomAugmented, "threads", 2, True),
        (_NumpyRandomAugmented, "threads", 2, True),
        (_PythonRandomAugmented, "processes", 2, False),
        (_PythonRandomAugmented, "threads", 0, False),
        (_TorchvisionAugmented, "threads", 2, False),
        (_jitter_datamodule, "threads", 2, False),
        (FastImageDataModule, "threads", 2, False),
    ],
)
def test_setup_warns_once_when_a_transform_draws_what_loader_threads_cannot_key(
    database: Path,
    recwarn: Any,
    monkeypatch: pytest.MonkeyPatch,
    cls: Callable[..., FastImageDataModule],
    engine: str,
    workers: int,
    said: bool,
) -> None:
    """A transform of one's own that draws from Python's or NumPy's global generator, on loader threads: setup warns,
    once, naming ``sample_rng()`` and the engine that keys them; nothing is said where they are keyed (worker
    processes, the training thread), for torch's draws (torchvision) or ``sample_rng()``'s (the shipped
    ``JitterDataModule``, which cpu.yaml trains, was told otherwise), or for the built-in transforms."""
    infos: list[str] = []
    monkeypatch.setattr("lightning_fastdata.workers.rank_zero_info", lambda message, *a, **k: infos.append(message))
    dm = cls(str(database), image_size=16, batch_size=4, num_workers=workers, engine=engine)
    dm.trainer = fake_trainer("cpu")
    state = (random.getstate(), np.random.get_state()[2])
    dm.setup("fit")
    dm.setup("fit")
    assert (random.getstate(), np.random.get_state()[2]) == state  # the probe's draws are not the caller's concern
    found = [text for text in [str(w.message) for w in recwarn] + infos if "loader threads" in text]
    expected = (
        "FastImageDataModule: the training transform (or dataset) is your own, read on 2 loader threads, and draws"
        " from Python's `random` or NumPy's global generator: the threads share those, so its augmentation differs"
        " between runs and after a resume (torch's random draws, as in torchvision's transforms, are keyed per"
        " sample). Draw from `lightning_fastdata.keyed_random.sample_rng()` instead, or pass `engine='processes'`,"
        " which keys those too."
    )
    assert found == ([expected] if said else [])


class _TwoViews:
    """Two views of a uint8 CHW image: a random 32 px crop, and the whole image at 16 px (a function of the image)."""

    def __init__(self) -> None:
        self.crop = v2.RandomResizedCrop(32, antialias=True)
        self.whole = v2.Resize((16, 16), antialias=True)

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        return [self.crop(image), self.whole(image)]


class _TwoViewData(FastImageDataModule):
    """A training transform returning two views; keeps each batch as the loader gave it, before the device stage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: list[Any] = []

    def train_transform(self) -> Callable[[torch.Tensor], list[torch.Tensor]]:  # type: ignore[override]
        return _TwoViews()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.loaded.append(batch)
        return super().on_after_batch_transfer(batch, dataloader_idx)


class _TwoViewModule(LightningModule):
    """Asserts each step gets a list of two normalized float32 views (32 and 16 px), as it normalizes them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.batches: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, targets, index = batch
        loaded = self.trainer.datamodule.loaded[-1][0]  # the same batch's views as the loader gave them
        mean = torch.tensor(self.trainer.datamodule.normalizer.mean).view(1, 3, 1, 1)
        std = torch.tensor(self.trainer.datamodule.normalizer.std).view(1, 3, 1, 1)
        assert isinstance(views, list)
        assert [(v.dtype, tuple(v.shape)) for v in views] == [
            (torch.float32, (4, 3, 32, 32)),
            (torch.float32, (4, 3, 16, 16)),
        ]
        assert [v.dtype for v in loaded] == [torch.uint8, torch.uint8]
        for view, raw in zip(views, loaded, strict=True):
            torch.testing.assert_close(view, (raw.float() / 255 - mean) / std, rtol=0, atol=1e-5)
        self.batches.append(([v.clone() for v in views], targets.clone(), index.clone()))
        return torch.nn.functional.cross_entropy(
            self.layer(views[0].mean(dim=(2, 3)) + views[1].mean(dim=(2, 3))), targets
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_transform_returning_two_views_trains_on_normalized_views_on_every_engine(database: Path) -> None:
    """Two views of each sample reach a CPU fit as a list of normalized float32 batches, as a single view would, on
    the training thread, loader threads and worker processes alike (the same bits), aligned with each sample's target
    and index (they came back uint8 and unnormalized)."""
    runs = []
    for engine, workers in [("threads", 0), ("threads", 2), ("processes", 2)]:
        dm = _TwoViewData(
            str(database), image_size=32, batch_size=4, val_fraction=0, num_workers=workers, engine=engine,
            return_index=True,
        )  # fmt: skip
        model = _TwoViewModule()
        trainer = Trainer(
            accelerator="cpu",
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=dm)
        assert trainer.train_dataloader.engine == ("main" if workers == 0 else engine)
        assert len(model.batches) == 2
        for views, targets, index in model.batches:
            for i, sample in enumerate(index.tolist()):
                sample_views, target = dm.train_dataset[sample]  # the whole-image view is a function of the image
                assert target == targets[i]
                torch.testing.assert_close(views[1][i], dm.normalizer.batch(sample_views[1][None])[0], rtol=0, atol=0)
        runs.append(model.batches)
    for other in runs[1:]:
        for (views, targets, index), (want_views, want_targets, want_index) in zip(other, runs[0], strict=True):
            for view, want in zip(views, want_views, strict=True):
                assert torch.equal(view, want)
            assert torch.equal(targets, want_targets)
            assert torch.equal(index, want_index)


def _recording_classifier() -> Any:
    """The example `ImageClassifier` (resnet18), recording the dtype and shape of each training batch it gets."""
    from fastdata_examples.classifier import ImageClassifier

    class Recording(ImageClassifier):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.seen: list[tuple[torch.dtype, tuple[int, ...], torch.dtype]] = []
            self.ranges: list[tuple[float, float]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append((batch[0].dtype, tuple(batch[0].shape), batch[1].dtype))
            self.ranges.append((batch[0].min().item(), batch[0].max().item()))
            return super().training_step(batch, batch_idx)

    return Recording(arch="resnet18")


def test_fit_example_classifier(split_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny CPU fit of the example classifier receives normalized float batches and logs a finite loss."""
    monkeypatch.syspath_prepend(str(ROOT))
    model = _recording_classifier()
    # 18 training samples in batches of 6: the three steps are one epoch, so validation runs at its end
    dm = FastImageDataModule(str(split_root), cache_dir=str(tmp_path / "cache"), image_size=32, batch_size=6)
    trainer = Trainer(
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert model.seen == [(torch.float32, (6, 3, 32, 32), torch.int64)] * 3
    low, high = (-0.485 / 0.229, (1 - 0.406) / 0.225)  # the ImageNet-normalized range of 0..255
    for lo, hi in model.ranges:
        assert low - 1e-4 <= lo < 0 < hi <= high + 1e-4
    assert model.hparams.num_classes == 3
    assert np.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert "val/loss" in trainer.callback_metrics
    assert (dm.database_path / "data.mdb").is_file()


# ----------------------------------------------------------------------------------------------------------------
# Test and predict loaders, paths with ~, settings that must agree
# ----------------------------------------------------------------------------------------------------------------


class _TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(images.mean(dim=(2, 3)))


def _tiny_module() -> Any:
    from lightning.pytorch import LightningModule

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _TinyNet()
            self.tested: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.tested.append(len(batch[1]))

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            return batch[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def _trainer() -> Trainer:
    quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    return Trainer(accelerator="cpu", logger=False, **quiet)


def test_test_and_predict_loaders_follow_the_test_split(tmp_path: Path) -> None:
    """``trainer.test`` and ``trainer.predict`` read ``Test/`` in order; ``predict_sources`` names each file."""
    root = tmp_path / "data"
    for split, count in (("Train", 4), ("Val", 2), ("Test", 3)):
        make_image_folder(root / "tmp", num_classes=2, train_per_class=count, val_per_class=0, min_size=20, max_size=30)
        (root / "tmp").rename(root / split)
    dm = FastImageDataModule(str(root), cache_dir=str(tmp_path / "cache"), image_size=16, batch_size=4, num_workers=0)
    model = _tiny_module()
    _trainer().test(model, datamodule=dm)
    assert model.tested == [4, 2]  # 6 test images, the last batch kept
    labels = torch.cat(_trainer().predict(model, datamodule=dm)).tolist()
    sources = dm.predict_sources()
    assert sources == [f"Test/class_{k}/{n:05d}.jpg" for k in range(2) for n in range(3)]
    assert labels == [int(path.split("/")[1][-1]) for path in sources]


def test_test_loader_without_test_split_says_so(split_root: Path, shared_cache: Path) -> None:
    """A database without a test split: ``test_dataloader`` raises naming the splits it has; predict falls to val."""
    dm = _dm(split_root, shared_cache)
    with pytest.raises(ValueError, match=r"has no test split; it holds \['train', 'val'\]"):
        dm.test_dataloader()
    assert dm.resolved_predict_split() == "val"
    assert len(dm.predict_dataloader().dataset) == SPLIT_VAL
    assert len(dm.predict_sources()) == SPLIT_VAL


def test_tilde_data_dir_and_cache_dir(split_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` in ``data_dir`` (a folder or a database) and ``cache_dir`` is the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    convert(split_root, tmp_path / "x.lmdb", short_side=64, num_workers=0, progress=False)
    dm = _dm(Path("~/x.lmdb"), Path("~/cache"))
    assert dm.is_database
    assert len(dm.train_dataset) == SPLIT_TRAIN
    folder = _dm(split_root, Path("~/cache"))
    assert folder.database_path.parent == tmp_path / "cache"


def test_store_follows_image_size_and_cache_keys_settings(split_root: Path, tmp_path: Path) -> None:
    """``short_side=None`` stores enough pixels for ``image_size``; each setting has its own cache slot."""
    cache = str(tmp_path / "cache")
    big = FastImageDataModule(str(split_root), cache_dir=cache, image_size=384)
    assert big.store_short_side() == 439  # 384 / 0.875, rounded up
    assert FastImageDataModule(str(split_root), cache_dir=cache).store_short_side() == 256
    paths = {
        FastImageDataModule(str(split_root), cache_dir=cache, **kw).database_path
        for kw in ({}, {"short_side": 128}, {"quality": 80}, {"encoding": "raw"}, {"short_side": 256})
    }
    assert len(paths) == 4  # the default (None -> 256) and an explicit 256 share one slot


def test_a_store_too_small_for_image_size_warns(split_root: Path, tmp_path: Path) -> None:
    """An explicit ``short_side`` below what ``image_size`` needs warns once, naming both and the fix."""
    with pytest.warns(UserWarning, match=r"short side of at most 20 px, but `image_size=32`.*needs 37 px"):
        _dm(split_root, tmp_path / "cache", image_size=32, short_side=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _dm(split_root, tmp_path / "cache", image_size=32, short_side=37)


def test_a_database_too_small_for_image_size_names_the_conversion_that_fixes_it(
    split_root: Path, tmp_path: Path
) -> None:
    """With a database as ``data_dir`` only a new conversion helps: the warning says that one, and that the
    ``short_side`` passed is ignored (it was advised before, and did nothing)."""
    db = tmp_path / "small.lmdb"
    convert(split_root, db, short_side=20, num_workers=0, progress=False)
    with pytest.warns(UserWarning, match="short_side") as record:
        _dm(db, tmp_path / "cache", image_size=32, short_side=37)
    assert [str(w.message) for w in record] == [
        f"`short_side=37` is ignored: `data_dir` {str(db)!r} is a database, whose images were stored at a short side"
        " of 20 (`short_side` applies when a DataModule converts a folder).",
        "The database stores images with a short side of at most 20 px, but `image_size=32` with `crop_fraction=0.875`"
        f" needs 37 px: every crop is upsampled. Convert the source again with `lightning-fastdata convert SRC {db}"
        " --short-side 37 --force` (or 0 to keep original sizes), or pass the source folder as `data_dir`.",
    ]


def test_a_misspelled_predict_split_fails_at_setup_not_after_fit(split_root: Path, shared_cache: Path) -> None:
    """``predict_split`` names a split the database lacks: ``setup`` says so, before any training."""
    with pytest.raises(ValueError, match=r"`predict_split` 'tst' is not in .*; it holds \['train', 'val'\]"):
        _dm(split_root, shared_cache, predict_split="tst")


def test_a_batch_larger_than_the_training_split_is_clamped_with_drop_last(split_root: Path, shared_cache: Path) -> None:
    """Fewer training images than ``batch_size`` with ``drop_last=True``: one batch of the whole split trains (there was
    none), a warning says so and what to change; with ``drop_last=False`` the one short batch trains, silently."""
    dm = _dm(split_root, shared_cache, batch_size=64)
    with pytest.warns(UserWarning, match="larger than the training split") as record:
        batches = list(dm.train_dataloader())
    assert [len(labels) for _, labels in batches] == [SPLIT_TRAIN]
    assert dm.batch_size == dm.hparams.batch_size == SPLIT_TRAIN
    assert [str(w.message) for w in record] == [
        f"`batch_size=64` is larger than the training split's {SPLIT_TRAIN} images, and `drop_last=True` would leave no"
        f" batch to train on: batches hold {SPLIT_TRAIN} instead, one an epoch. Pass `batch_size` <= {SPLIT_TRAIN}"
        " (a batch size finder stops here by itself), or `drop_last=False`."
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(dm.train_dataloader()) == 1  # said once
        keep = _dm(split_root, shared_cache, batch_size=64, drop_last=False)
        assert len(keep.train_dataloader()) == 1
        assert keep.batch_size == 64


def test_batch_size_finder_stops_at_the_training_split(database: Path, tmp_path: Path) -> None:
    """Lightning's batch size finder doubling past the 24 training images picks 24, and the fit then trains (it
    picked 32, and with ``drop_last=True`` the fit trained on nothing)."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0)
    quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, default_root_dir=tmp_path, **quiet)
    model = _tiny_module()
    with pytest.warns(UserWarning, match="`batch_size=32` is larger than the training split's 24 images"):
        found = Tuner(trainer).scale_batch_size(model, datamodule=dm, mode="power", steps_per_trial=1, max_trials=8)
    assert found == dm.batch_size == dm.hparams.batch_size == 24
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 1


def test_threaded_loaders_get_no_lightning_advice_to_add_worker_processes(
    database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's "does not have many workers" reads ``num_workers`` (0 with loader threads): it stays quiet for a
    threaded loader, and still speaks for a loader that builds batches on the training thread."""
    monkeypatch.setattr("lightning.pytorch.trainer.connectors.data_connector.suggested_max_num_workers", lambda n: 15)

    def fit(workers: int) -> list[str]:
        dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=workers, val_fraction=0)
        trainer = Trainer(
            accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_tiny_module(), datamodule=dm)
        return [str(w.message) for w in caught if "does not have many workers" in str(w.message)]

    assert len(fit(0)) == 1  # batches built in the training loop's own thread: Lightning's advice stands
    assert fit(2) == []


# ---------------------------------------------------------------------------------------------------------------
# A cache on a read-only file system, and what later runs log
# ---------------------------------------------------------------------------------------------------------------

# Runs with `cache` and `empty` on a read-only file system; prints one JSON object with what each step did
_READ_ONLY_CACHE_SCRIPT = """
import contextlib, io, json, os, sys, traceback, warnings

src, cache, empty, root = sys.argv[1:5]
sys.path.append(root)  # for `fastdata_examples.*` in the config; the package itself as installed
from lightning_fastdata import FastImageDataModule, datamodule, resizing, resolve, workers
from lightning_fastdata.cli import main

results = {}
infos = []
for module in (datamodule, resizing, resolve, workers):  # the DataModule's and the modules it logs through
    module.rank_zero_info = lambda message, *args, **kwargs: infos.append(str(message))


def step(name, fn):
    err = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            results[name] = {"value": fn()}
        results[name]["warnings"] = [str(w.message) for w in caught]
    except BaseException as exc:
        results[name] = {"raised": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    results[name]["stderr"] = err.getvalue()


def up_to_date():  # issue 20, row 2
    dm = FastImageDataModule(src, cache_dir=cache, image_size=16, batch_size=4, num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    return {"batch": list(images.shape), "infos": list(infos), "database": str(dm.database_path)}


def tune():  # row 4
    db = FastImageDataModule(src, cache_dir=cache).database_path
    dm = FastImageDataModule(str(db), cache_dir=cache, image_size=16, batch_size=4, num_workers="tune")
    dm.prepare_data()
    return dm.resolved_num_workers()


def new_conversion():  # row 3, from Python
    FastImageDataModule(src, cache_dir=empty, image_size=16).prepare_data()


def fit_into_read_only_env_cache():  # row 3, from the command line, the cache chosen by LIGHTNING_FASTDATA_CACHE
    os.environ["LIGHTNING_FASTDATA_CACHE"] = empty
    os.chdir(root)
    args = ["fit", "--config", "examples/configs/cpu.yaml", "--data.init_args.data_dir", src]
    return main([*args, "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"])


step("up_to_date", up_to_date)
step("tune", tune)
step("new_conversion", new_conversion)
step("fit", fit_into_read_only_env_cache)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def read_only_cache(
    split_root: Path, tmp_path_factory: pytest.TempPathFactory, read_only_python: Any
) -> dict[str, Any]:
    """Converts ``split_root`` into a cache, then uses that cache (and an empty one) on a read-only file system."""
    base = tmp_path_factory.mktemp("read_only_cache")
    cache, empty, user_cache = base / "cache", base / "empty", base / "user_cache"
    empty.mkdir()
    dm = FastImageDataModule(str(split_root), cache_dir=str(cache), image_size=16, batch_size=4, num_workers=0)
    dm.prepare_data()
    (dm.database_path / "verified.json").unlink(missing_ok=True)  # the read-only run must walk it, and cannot record
    env = {**os.environ, "LIGHTNING_FASTDATA_CACHE": str(user_cache)}
    proc = read_only_python(
        [cache, empty], _READ_ONLY_CACHE_SCRIPT, str(split_root), str(cache), str(empty), str(ROOT), env=env
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    results["paths"] = {"cache": cache, "empty": empty, "user_cache": user_cache, "database": dm.database_path}
    return results


@pytest.mark.slow
def test_an_up_to_date_database_in_a_read_only_cache_is_read(read_only_cache: dict[str, Any]) -> None:
    """``FastImageDataModule(src, cache_dir=<read-only folder holding its database>)`` trains from it, quietly."""
    step = read_only_cache["up_to_date"]
    assert "raised" not in step, step.get("trace")
    assert step["value"]["batch"] == [4, 3, 16, 16]
    # nothing about the database, no "up to date ... --force" line either: only the engine choice
    infos = step["value"]["infos"]
    assert len(infos) <= 1
    assert all(info.startswith("FastImageDataModule: engine='auto' chose") for info in infos), infos
    paths = read_only_cache["paths"]
    assert sorted(p.name for p in paths["cache"].iterdir()) == [paths["database"].name]  # no lock file made
    assert not (paths["database"] / "verified.json").exists()
    assert len(list((paths["user_cache"] / "verified").glob("*.json"))) == 1  # the walk, recorded elsewhere


def test_tune_with_a_read_only_cache_tunes_and_says_the_pick_is_not_kept(read_only_cache: dict[str, Any]) -> None:
    """``num_workers="tune"`` measures and uses its pick, warning once that the cache could not be written."""
    step = read_only_cache["tune"]
    assert "raised" not in step, step.get("trace")
    assert step["value"] in (0, 1, 2)
    warned = [w for w in step["warnings"] if "could not cache the pick" in w]
    assert len(warned) == 1, step["warnings"]
    assert "tune.json" in warned[0]
    assert "Pass `cache_dir=` a writable folder (or set LIGHTNING_FASTDATA_CACHE)" in warned[0]
    assert sorted(p.name for p in read_only_cache["paths"]["empty"].iterdir()) == []


def test_a_new_conversion_into_a_read_only_cache_names_the_setting(read_only_cache: dict[str, Any]) -> None:
    """Converting into a read-only cache: ``ReadOnlyDestinationError`` naming ``cache_dir``; from ``fit`` with
    ``LIGHTNING_FASTDATA_CACHE``, one ``error:`` line naming that variable and exit 2."""
    empty = read_only_cache["paths"]["empty"]
    step = read_only_cache["new_conversion"]
    assert step.get("raised") == "ReadOnlyDestinationError", step
    assert step["message"].startswith(f"`cache_dir` {str(empty)!r} is read-only, so `data_dir`")
    assert "Pass `cache_dir=` a writable folder" in step["message"]

    fit = read_only_cache["fit"]
    assert fit.get("value") == 2, fit
    errors = [line for line in fit["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, fit["stderr"]
    assert errors[0].startswith(f"error: `LIGHTNING_FASTDATA_CACHE` {str(empty)!r} is read-only")
    assert "Traceback" not in fit["stderr"]


def test_a_later_run_logs_no_command_line_flag(
    split_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trainer.test``/``predict`` run ``prepare_data`` again: an up-to-date database logs nothing at info level."""
    from lightning_fastdata import resolve

    infos: list[str] = []
    monkeypatch.setattr(resolve, "rank_zero_info", lambda message, *a, **k: infos.append(str(message)))
    FastImageDataModule(str(split_root), cache_dir=str(tmp_path), image_size=16).prepare_data()
    assert len(infos) == 1
    assert infos[0].startswith("wrote 24 images")
    FastImageDataModule(str(split_root), cache_dir=str(tmp_path), image_size=16).prepare_data()
    assert len(infos) == 1
    assert not any("--force" in message for message in infos)


def _regression_list(root: Path, count: int = 12) -> tuple[Path, dict[str, float]]:
    """``root/ages.csv``: ``path,label`` rows of generated images with float labels (``0.375``, ...), and them."""
    folder = make_image_folder(root / "images", num_classes=1, train_per_class=count, val_per_class=0, min_size=40,
                               max_size=56, num_workers=1)  # fmt: skip
    images = sorted((folder / "train" / "class_0").glob("*.jpg")) or sorted(folder.rglob("*.jpg"))
    values = [round(0.125 * i + 0.25, 3) for i in range(len(images))]
    lines = ["path,label", *(f"{p.relative_to(root)},{v}" for p, v in zip(images, values, strict=True))]
    (root / "ages.csv").write_text("\n".join(lines) + "\n")
    return root / "ages.csv", {str(p.relative_to(root)): v for p, v in zip(images, values, strict=True)}


def test_a_list_file_of_float_labels_trains_as_float_targets_only_when_asked(tmp_path: Path) -> None:
    """``data_dir`` a CSV of float labels: refused without ``targets`` (naming it), ``targets="float"`` trains a real
    Trainer on ``float32 [B]`` targets equal to the listed values; a database of another kind is refused."""
    listing, values = _regression_list(tmp_path)
    with pytest.raises(ValueError, match=r"targets='float'"):
        FastImageDataModule(str(listing), cache_dir=str(tmp_path / "cache"), num_workers=0).prepare_data()
    dm = FastImageDataModule(
        str(listing), cache_dir=str(tmp_path / "cache"), image_size=16, batch_size=4, num_workers=0,
        val_fraction=0.25, targets="float", return_index=True,
    )  # fmt: skip
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Regressor(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, targets, index = batch
            seen.append((targets, index))
            return torch.nn.functional.mse_loss(self.head(images.mean((2, 3))).squeeze(1), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(Regressor(), datamodule=dm)
    assert dm.target_kind == "float"
    assert len(seen) == 2  # 9 of 12 images train, in batches of 4 (drop_last)
    sources = dm.sources("train")
    for targets, index in seen:
        assert targets.dtype == torch.float32
        assert targets.shape == index.shape == (4,)
        assert targets.tolist() == pytest.approx([values[sources[i]] for i in index.tolist()])
    with pytest.raises(ValueError, match=r"holds float \(1 value: label\) targets"):
        FastImageDataModule(str(dm.database_path), targets="multilabel", num_workers=0).setup("fit")


def test_a_list_files_kind_and_classes_are_known_before_it_is_converted(tmp_path: Path) -> None:
    """Before ``prepare_data`` (when LightningCLI links and models read ``num_classes``), a list file's classes and kind
    are read as ``targets=`` and ``label_separator=`` say, as its conversion reads them."""
    listing, _ = _regression_list(tmp_path)
    dm = FastImageDataModule(str(listing), cache_dir=str(tmp_path / "cache"), targets="float")
    assert (dm.target_kind, dm.target_dim, dm.num_classes, dm.classes) == ("float", 1, 0, [])
    rows = listing.read_text().splitlines()
    tags = ["a;b", "a;c", "b", "b;c", "c"]
    tagged = ["path,label", *(f"{row.split(',')[0]},{tags[i % 5]}" for i, row in enumerate(rows[1:]))]
    (tmp_path / "tags.csv").write_text("\n".join(tagged) + "\n")
    dm = FastImageDataModule(
        str(tmp_path / "tags.csv"), cache_dir=str(tmp_path / "cache"), targets="multilabel", label_separator=";"
    )
    assert (dm.target_kind, dm.num_classes, dm.classes) == ("multilabel", 3, ["a", "b", "c"])
    dm.prepare_data()
    assert (dm.target_kind, dm.num_classes, dm.classes) == ("multilabel", 3, ["a", "b", "c"])


class _PriorityImages(FastImageDataModule):
    """Each training image's pixels are 20 + the nice value of the process that made it."""

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda image: torch.full((3, 8, 8), 20 + os.getpriority(os.PRIO_PROCESS, 0), dtype=torch.uint8)


def test_worker_nice_reaches_the_worker_processes_of_the_training_loader(database: Path) -> None:
    """``FastImageDataModule(worker_nice=3, engine="processes")``: the training batches are built by processes 3 nice
    levels below the training process, which keeps its own."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    dm = _PriorityImages(
        str(database), image_size=8, batch_size=4, num_workers=2, engine="processes", worker_nice=3,
        mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3,
    )  # fmt: skip
    dm.trainer = fake_trainer("cpu")
    loader = dm.train_dataloader()
    images = next(iter(loader))[0]  # normalized with mean 0 and std 1/255: the pixel values themselves
    assert images.unique().tolist() == [20.0 + min(19, own + 3)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
    del loader


def test_worker_nice_on_loader_threads_warns_that_it_does_nothing(database: Path) -> None:
    """Threads share the training process's priority: ``worker_nice`` there warns, naming the engine that uses it."""
    dm = FastImageDataModule(str(database), image_size=8, batch_size=4, num_workers=1, engine="threads", worker_nice=5)
    dm.trainer = fake_trainer("cpu")
    with pytest.warns(UserWarning, match=r"`worker_nice=5` .* no effect\. Pass `engine='processes'`"):
        loader = dm.train_dataloader()
    del loader
