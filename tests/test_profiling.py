from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_fastdata.profiling as profiling
from lightning_fastdata import FastImageDataModule, LmdbImageDataset, convert, make_image_folder
from lightning_fastdata.errors import SourceLayoutError
from lightning_fastdata.pipeline.kernel import BatchReader
from lightning_fastdata.profiling import PipelineProfile, profile, profile_database, profile_folder
from lightning_fastdata.store.summary import TRUNCATED

FOLDER_STAGES = ["read", "decode", "transforms", "collate"]
DATABASE_STAGES = ["read", "decode", "transforms", "normalize"]  # training on the CPU: no copy to a device


@pytest.fixture(scope="module")
def database(plain_photo_database: Path) -> Path:
    return plain_photo_database


@pytest.fixture(scope="module")
def folder(plain_photo_database: Path) -> Path:
    return plain_photo_database.parent / "src"


def _check_profile(p: PipelineProfile, name: str, path: Path, stages: list[str], samples: int) -> None:
    assert p.name == name
    assert Path(p.path) == path
    assert list(p.stages) == stages
    assert all(ms > 0 for ms in p.stages.values()), p.stages
    assert p.samples == samples
    assert p.total_ms == pytest.approx(sum(p.stages.values()))
    assert p.stages[p.dominant] == max(p.stages.values())


def test_profile_folder_stages(folder):
    """A folder: read, decode, transforms, collate, each > 0 ms per sample; samples capped at the folder size."""
    profile = profile_folder(folder, samples=30, batch_size=8, device="cpu")
    _check_profile(profile, "folder", folder, FOLDER_STAGES, 30)
    profile = profile_folder(folder, samples=500, batch_size=16, device="cpu")
    _check_profile(profile, "folder", folder, FOLDER_STAGES, 80)


def test_profile_folder_with_train_split(tmp_path):
    """A root with ``train/`` profiles its training split."""
    root = make_image_folder(
        tmp_path / "split", num_classes=2, train_per_class=5, val_per_class=2, min_size=40, max_size=60
    )
    p = profile_folder(root, samples=100, batch_size=4, image_size=32, device="cpu")
    assert Path(p.path) == root / "train"
    assert p.samples == 10


def test_profile_database_stages(database):
    """A database, training on the CPU: the batch path's read, decode, transforms and normalize (no copy)."""
    profile = profile_database(database, samples=40, batch_size=16, device="cpu")
    _check_profile(profile, "database", database, DATABASE_STAGES, 40)
    profile = profile_database(database, samples=1000, batch_size=16, device="cpu")
    _check_profile(profile, "database", database, DATABASE_STAGES, 80)


def test_profile_database_times_the_loaders_own_batch_path(database, monkeypatch):
    """The stages are the loader's: its crop kernel, its fast decode, and its ``read_batch`` on the same samples
    (every sample, the last partial batch too), whose time the stages add up to."""
    kernel, decodes, batches = [], [], []
    crop, decode, read_batch = profiling.crop_resize_into, LmdbImageDataset.decode_hwc, BatchReader.read_batch

    def spy_crop(*args, **kwargs):
        kernel.append(args[2])
        return crop(*args, **kwargs)

    def spy_decode(self, *args, **kwargs):
        decodes.append(args[4] if len(args) > 4 else kwargs.get("fast", False))
        return decode(self, *args, **kwargs)

    def spy_batch(self, indices, *args, **kwargs):
        batches.append((len(indices), self.fused, self.output))
        return read_batch(self, indices, *args, **kwargs)

    monkeypatch.setattr(profiling, "crop_resize_into", spy_crop)
    monkeypatch.setattr(LmdbImageDataset, "decode_hwc", spy_decode)
    monkeypatch.setattr(BatchReader, "read_batch", spy_batch)
    p = profile_database(database, samples=40, batch_size=16, image_size=48, device="cpu")
    _check_profile(p, "database", database, DATABASE_STAGES, 40)
    assert kernel[:40] == [48] * 40
    assert set(decodes[:40]) == {True}  # the fast DCT, as the loader decodes
    assert batches == [(16, True, "float"), (16, True, "float"), (8, True, "float")]
    assert p.batch_path_ms is not None
    assert p.batch_path_ms > 0
    assert "the loader's read_batch, every stage at once" in p.format_table()


@pytest.mark.cuda
def test_profile_stages_on_cuda(folder, database):
    """Training on CUDA: the database's uint8 batch is copied to the device and normalized there; the folder's
    float batch is copied."""
    profile = profile_database(database, samples=40, batch_size=16, device="cuda")
    _check_profile(profile, "database", database, ["read", "decode", "transforms", "to_device", "normalize"], 40)
    _check_profile(
        profile_folder(folder, samples=16, batch_size=8, device="cuda"),
        "folder",
        folder,
        [*FOLDER_STAGES, "to_device"],
        16,
    )


def _hand_made(name: str, dominant: str) -> PipelineProfile:
    stages = {"read": 1.0, "decode": 1.0, "transforms": 1.0, "collate": 1.0, "normalize": 1.0, "to_device": 1.0}
    stages[dominant] = 5.0
    return PipelineProfile(name, "/data", stages, samples=10)


@pytest.mark.parametrize(
    ("name", "stage", "advice"),
    [
        ("folder", "decode", "--short-side"),
        ("database", "decode", "--encoding raw"),
        ("folder", "read", "storage"),
        ("folder", "read", "lightning-fastdata convert"),
        ("database", "read", "storage"),
        ("folder", "transforms", "FastImageDataModule"),
        ("database", "transforms", "image_size"),
        ("database", "collate", "uint8"),
        ("database", "normalize", "GPU"),
        ("database", "to_device", "pin_memory"),
    ],
)
def test_conclusion_names_the_dominant_stage_and_its_advice(name, stage, advice):
    """The conclusion names the dominant stage, its share and the total, and advice fit for the stage."""
    p = _hand_made(name, stage)
    conclusion = p.conclusion()
    assert p.dominant == stage
    assert conclusion.startswith(f"{name}: {stage} takes 50% of 10.00 ms per sample; ")
    assert advice in conclusion


def test_conclusion_of_a_database_read_does_not_advise_converting():
    """A database is already converted: reading advice stops at storage."""
    assert "convert" not in _hand_made("database", "read").conclusion()
    assert "--short-side" not in _hand_made("database", "decode").conclusion()


def test_profile_with_db_advises_on_that_database(tmp_path):
    """``profile FOLDER --db DB``: a folder's decode and read advice name DB, and advise converting again (into DB)
    only when DB's stored short side is too small for the crops, never `convert --short-side 256` elsewhere."""
    src = make_image_folder(
        tmp_path / "photos", num_classes=2, train_per_class=3, val_per_class=0, min_size=40, max_size=56
    )
    db = tmp_path / "photos.lmdb"
    convert(src, db, num_workers=0, progress=False)  # short side 256, as training at 224 needs
    folder_profile, _ = profile(src, database=db, samples=6, batch_size=4, device="cpu")
    folder_profile.stages = _hand_made("folder", "decode").stages
    assert folder_profile.conclusion().endswith(
        f"decoding full-size files dominates; the database {db} stores a short side of 256 px already: train from it"
        " (its profile follows)"
    )
    folder_profile.stages = _hand_made("folder", "read").stages
    assert folder_profile.conclusion().endswith(f", or train from the database {db}")
    convert(src, db, short_side=64, num_workers=0, progress=False)  # too small: 224 px crops need 256
    folder_profile, _ = profile(src, database=db, samples=6, batch_size=4, device="cpu")
    folder_profile.stages = _hand_made("folder", "decode").stages
    assert folder_profile.conclusion().endswith(
        f"the database {db} stores a short side of 64 px, less than the 256 px that 224 px crops need (they would"
        f" be upsampled): convert again with `lightning-fastdata convert {src} {db} --short-side 256 --force`"
    )


def test_format_table_has_a_row_per_stage_and_a_total():
    """The table: a heading with name, path and samples, one row per stage with its share, and the total."""
    p = PipelineProfile("folder", "/data", {"read": 1.0, "decode": 3.0}, samples=7)
    lines = p.format_table().splitlines()
    assert lines[0] == "folder (/data), 7 samples"
    assert lines[3:] == ["| read | 1.000 | 25% |", "| decode | 3.000 | 75% |", "| total | 4.000 | 100% |"]


def test_profile_folder_and_database(folder, database):
    """``profile(folder, database=db)`` profiles both, folder first (which costs less is for benchmarks to say)."""
    folder_profile, database_profile = profile(folder, database=database, samples=80, batch_size=16, device="cpu")
    _check_profile(folder_profile, "folder", folder, FOLDER_STAGES, 80)
    _check_profile(database_profile, "database", database, DATABASE_STAGES, 80)


def test_profile_database_finds_its_source_folder(folder, database):
    """``profile(db)`` reads the source folder from the database's metadata and profiles it too."""
    profiles = profile(database, samples=20, batch_size=8)
    assert [(p.name, Path(p.path)) for p in profiles] == [("folder", folder), ("database", database)]


def test_profile_database_without_its_source(database, tmp_path):
    """A database whose source folder is gone is profiled alone."""
    src = make_image_folder(
        tmp_path / "gone", num_classes=2, train_per_class=3, val_per_class=0, min_size=40, max_size=48
    )
    db = tmp_path / "db"
    convert(src, db, short_side=96, num_workers=0, progress=False)
    for path in src.rglob("*.jpg"):
        path.unlink()
    for path in sorted(src.rglob("*"), reverse=True):
        path.rmdir()
    src.rmdir()
    assert [p.name for p in profile(db, samples=6, batch_size=4)] == ["database"]


def test_profile_folder_alone_and_with_the_default_conversion(folder, tmp_path, monkeypatch):
    """``profile(folder)`` profiles the folder alone, or with the conversion FastImageDataModule would read."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(cache))
    assert [p.name for p in profile(folder, samples=20, batch_size=8)] == ["folder"]
    dm = FastImageDataModule(str(folder))
    assert dm.cache_root == cache.absolute()
    convert(folder, dm.database_path, short_side=96, num_workers=0, progress=False)
    profiles = profile(folder, samples=20, batch_size=8)
    assert [(p.name, Path(p.path)) for p in profiles] == [("folder", folder), ("database", dm.database_path)]


def test_profile_restores_the_thread_count(folder, database, tmp_path, monkeypatch):
    """``profile`` times on one thread, as in a worker, and restores the caller's thread count, also on failure."""
    seen = []
    original = profiling.profile_folder

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(profiling, "profile_folder", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        profile(folder, database=database, samples=8, batch_size=4)
        assert seen == [1]
        assert torch.get_num_threads() == 2
        with pytest.raises(FileNotFoundError):
            profile(tmp_path / "missing", samples=8)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_profile_with_a_database_that_is_not_one_raises(tmp_path):
    """A mistyped ``database`` is an error that names it, not a silently missing profile."""
    folder = tmp_path / "images"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        profile(folder, database=tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a database"):
        profile(folder, database=tmp_path / "plain")


def _folder_with_bad_files(root: Path) -> tuple[Path, list[Path]]:
    """A plain folder of 2 classes x 4 JPEGs, plus a zero-byte and a corrupt JPEG; returns it and the bad files."""
    src = make_image_folder(root, num_classes=2, train_per_class=4, val_per_class=0, min_size=40, max_size=56)
    empty, corrupt = src / "class_0" / "empty.jpg", src / "class_1" / "corrupt.jpg"
    empty.write_bytes(b"")
    corrupt.write_bytes(b"\xff\xd8\xff\xe0" + b"truncated" * 8)
    return src, [empty, corrupt]


def test_profile_database_whose_source_holds_bad_files(tmp_path):
    """A database converted from a folder with a zero-byte and a corrupt JPEG profiles with its source there (whose
    bad files are skipped and listed) and with its source gone (alone)."""
    src, bad = _folder_with_bad_files(tmp_path / "src")
    db = tmp_path / "db.lmdb"
    assert len(convert(src, db, num_workers=0, progress=False).skipped) == 2
    folder_profile, database_profile = profile(db, samples=100, batch_size=4, device="cpu")
    _check_profile(folder_profile, "folder", src, FOLDER_STAGES, 8)
    _check_profile(database_profile, "database", db, DATABASE_STAGES, 8)
    assert sorted(Path(item.path) for item in folder_profile.skipped) == sorted(bad)
    assert database_profile.skipped == []
    src.rename(tmp_path / "moved")
    assert [p.name for p in profile(db, samples=100, batch_size=4, device="cpu")] == ["database"]
    (src / "cat").mkdir(parents=True)  # a folder there again, without one readable image: left out too
    (src / "cat" / "empty.jpg").write_bytes(b"")
    assert [p.name for p in profile(db, samples=100, batch_size=4, device="cpu")] == ["database"]


def test_profile_folder_skips_and_lists_bad_files(tmp_path):
    """A folder's unreadable files are skipped, listed with their reason, and others are timed in their place."""
    src, (empty, corrupt) = _folder_with_bad_files(tmp_path / "src")
    p = profile_folder(src, samples=8, batch_size=4, device="cpu")
    _check_profile(p, "folder", src, FOLDER_STAGES, 8)  # the 8 good files, though 2 of 10 are bad
    reasons = {Path(item.path): item.reason for item in p.skipped}
    assert reasons[empty] == "empty file (0 bytes)"
    assert reasons[corrupt] == TRUNCATED  # a JPEG marker then 72 bytes: Pillow reads past its end, as convert says
    table = p.format_table()
    assert "skipped 2 file(s) that cannot be read as images (not timed):" in table
    assert f"  skipped {empty}: empty file (0 bytes)" in table
    assert profile_folder(src, samples=3, batch_size=4, device="cpu").samples == 3


def test_profile_folder_without_a_readable_image_raises(tmp_path):
    """A folder whose every image file is bad is an error that names the folder and a bad file."""
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "empty.jpg").write_bytes(b"")
    with pytest.raises(SourceLayoutError, match=r"none of the 1 image files of .*empty\.jpg: empty file"):
        profile_folder(src.parent, samples=4, device="cpu")
