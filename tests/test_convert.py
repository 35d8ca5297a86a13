from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

import lightning_fastdata
from lightning_fastdata import (
    ConversionError,
    ConversionSummary,
    DatasetFormatError,
    DestinationError,
    LmdbImageDataset,
    SkippedFile,
    SourceLayoutError,
    convert,
    convert_dataset,
    make_image_folder,
    read_meta,
)
from lightning_fastdata.store import conversion, reader, summary
from lightning_fastdata.store import environments as store_environments
from lightning_fastdata.store import format as store_format

LAYOUT_HINT = "SRC/<class_a>/<image>.jpg"


def _smooth(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB uint8 image (JPEG-friendly, so re-encoding errors stay small)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None]
    x = np.linspace(0.0, 1.0, width)[None, :]
    phase = rng.uniform(0, 2 * np.pi, size=3)
    channels = [0.5 + 0.4 * np.sin(2 * np.pi * (x + y) + p) for p in phase]
    return (np.stack(channels, axis=-1) * 255).round().astype(np.uint8)


def _save(path: Path, width: int = 48, height: int = 32, mode: str = "RGB", seed: int = 0, **save_kwargs) -> Path:
    """Write a smooth test image of ``mode`` to ``path`` (format from the extension)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(_smooth(width, height, seed))
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path, **save_kwargs)
    return path


def _jpeg_bytes(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(_smooth(width, height, seed)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _run(src: Path, dst: Path, **kwargs) -> ConversionSummary:
    kwargs.setdefault("num_workers", 0)
    kwargs.setdefault("progress", False)
    return convert(src, dst, **kwargs)


def _hwc(tensor: torch.Tensor) -> np.ndarray:
    return tensor.permute(1, 2, 0).numpy().astype(np.int16)


def _leftovers(dst: Path) -> list[str]:
    """Hidden working directories of a conversion to ``dst`` (the lock file is allowed to stay)."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name in (f".{dst.name}.partial", f".{dst.name}.old"))


# ---------------------------------------------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------------------------------------------


def test_round_trip_labels_classes_counts_and_pixels(split_folder, database):
    """Every split holds its source images in order, with the right labels and pixels within JPEG tolerance."""
    meta = read_meta(database)
    classes = sorted(p.name for p in (split_folder / "train").iterdir())
    assert meta["classes"] == classes == ["class_0", "class_1", "class_2"]
    assert sorted(meta["splits"]) == ["train", "val"]
    short_side = meta["encoding"]["short_side"]
    for split in ("train", "val"):
        files = sorted((split_folder / split).glob("*/*.jpg"))
        labels = [classes.index(f.parent.name) for f in files]
        ds = LmdbImageDataset(database, split)
        assert len(ds) == len(files) == meta["splits"][split]["length"]
        assert ds.targets == labels
        assert meta["splits"][split]["class_counts"] == np.bincount(labels, minlength=len(classes)).tolist()
        for i, path in enumerate(files):
            image, label = ds[i]
            assert label == labels[i]
            src = Image.open(path).convert("RGB")
            height, width = image.shape[1:]
            assert min(height, width) == min(min(src.size), short_side)
            if (width, height) != src.size:
                src = src.resize((width, height), Image.Resampling.BICUBIC)
            assert np.abs(_hwc(image) - np.asarray(src, dtype=np.int16)).mean() < 6


def test_summary_and_report_of_a_clean_conversion(split_folder, tmp_path):
    """The summary counts what was written per split, and the report beside the database says the same."""
    dst = tmp_path / "db"
    summary = _run(split_folder, dst, short_side=64)
    assert summary.written == 33
    assert summary.splits == {"train": 24, "val": 9}
    assert summary.skipped == []
    assert not summary.up_to_date
    assert summary.bytes_in == sum(f.stat().st_size for f in split_folder.glob("*/*/*.jpg"))
    assert summary.bytes_out > 0
    assert summary.destination == str(dst)
    text = summary.format()
    assert f"wrote 33 images (train=24, val=9) to {dst}" in text
    assert "skipped   0" in text
    report = json.loads((dst / store_format.REPORT_FILE).read_text())
    assert report["written"] == 33
    assert report["skipped"] == []
    assert report["meta"]["complete"] is True
    assert report["meta"]["splits"]["val"]["length"] == 9
    assert _leftovers(dst) == []


def test_worker_processes_give_the_same_database(split_folder, database, tmp_path):
    """Converting in two worker processes stores the same records in the same order as in-process."""
    dst = tmp_path / "db"
    _run(split_folder, dst, short_side=64, num_workers=0)
    for split in ("train", "val"):
        serial, pooled = LmdbImageDataset(dst, split), LmdbImageDataset(database, split)
        assert len(serial) == len(pooled)
        for i in range(len(serial)):
            assert serial.read_record(i) == pooled.read_record(i)


def test_plain_image_folder_becomes_split_train(tmp_path):
    """A plain ImageFolder root (no train/ folder) is stored as the single split ``train``."""
    src = make_image_folder(
        tmp_path / "flat", num_classes=2, train_per_class=3, val_per_class=0, min_size=40, max_size=60, num_workers=1
    )
    summary = _run(src, tmp_path / "db")
    meta = read_meta(tmp_path / "db")
    assert list(meta["splits"]) == ["train"]
    assert summary.splits == {"train": 6}
    assert meta["classes"] == ["class_0", "class_1"]
    assert LmdbImageDataset(tmp_path / "db").targets == [0, 0, 0, 1, 1, 1]


def test_split_root_with_extra_split_and_union_of_classes(tmp_path):
    """Every top-level folder of a split root is a split; classes are the union over the splits."""
    _save(tmp_path / "src" / "train" / "cat" / "a.jpg")
    _save(tmp_path / "src" / "train" / "dog" / "b.jpg")
    _save(tmp_path / "src" / "val" / "dog" / "c.jpg")
    _save(tmp_path / "src" / "test" / "eel" / "d.jpg")
    _run(tmp_path / "src", tmp_path / "db")
    meta = read_meta(tmp_path / "db")
    assert meta["classes"] == ["cat", "dog", "eel"]
    assert {name: s["class_counts"] for name, s in meta["splits"].items()} == {
        "test": [0, 0, 1],
        "train": [1, 1, 0],
        "val": [0, 1, 0],
    }
    assert LmdbImageDataset(tmp_path / "db", "test").targets == [2]


# ---------------------------------------------------------------------------------------------------------------
# Sizes and bytes
# ---------------------------------------------------------------------------------------------------------------


def test_short_side_downscales_and_never_upscales(tmp_path):
    """Images whose short side exceeds ``short_side`` shrink to it (aspect kept); smaller ones keep their size."""
    sizes = {"a.jpg": (120, 90), "b.jpg": (60, 100), "c.jpg": (64, 64), "d.png": (200, 100), "e.png": (30, 20)}
    for name, (width, height) in sizes.items():
        _save(tmp_path / "src" / "k" / name, width, height)
    _run(tmp_path / "src", tmp_path / "db", short_side=64)
    ds = LmdbImageDataset(tmp_path / "db")
    got = [tuple(ds[i][0].shape) for i in range(len(ds))]
    assert got == [(3, 64, 85), (3, 100, 60), (3, 64, 64), (3, 64, 128), (3, 20, 30)]
    headers = [ds.read_record(i)[0] for i in range(len(ds))]
    assert [(h.height, h.width) for h in headers] == [shape[1:] for shape in got]


@pytest.mark.parametrize("short_side", [0, None])
def test_short_side_zero_or_none_keeps_the_size(tmp_path, short_side):
    """``short_side`` 0 or ``None`` stores every image at its original size."""
    _save(tmp_path / "src" / "k" / "big.jpg", 300, 200)
    _save(tmp_path / "src" / "k" / "big.png", 250, 260)
    _run(tmp_path / "src", tmp_path / "db", short_side=short_side)
    ds = LmdbImageDataset(tmp_path / "db")
    assert [tuple(ds[i][0].shape) for i in range(2)] == [(3, 200, 300), (3, 260, 250)]  # big.jpg, big.png
    assert ds.encoding["short_side"] is None


def test_large_jpeg_downscale_uses_draft_and_stays_accurate(tmp_path):
    """A JPEG much larger than ``short_side`` (DCT-domain reduced, then resized) still matches the source."""
    path = _save(tmp_path / "src" / "k" / "big.jpg", 640, 480, quality=95)
    _run(tmp_path / "src", tmp_path / "db", short_side=60)
    image, _ = LmdbImageDataset(tmp_path / "db")[0]
    assert tuple(image.shape) == (3, 60, 80)
    expected = Image.open(path).convert("RGB").resize((80, 60), Image.Resampling.BICUBIC)
    assert np.abs(_hwc(image) - np.asarray(expected, dtype=np.int16)).mean() < 6


def test_keep_original_stores_the_exact_jpeg_bytes(tmp_path):
    """With ``keep_original`` a large RGB or grayscale JPEG is stored byte for byte; without, it is re-encoded."""
    rgb = _save(tmp_path / "src" / "k" / "a.jpg", 120, 90)
    gray = _save(tmp_path / "src" / "k" / "b.jpg", 100, 100, mode="L")
    _run(tmp_path / "src", tmp_path / "kept", short_side=64, keep_original=True)
    _run(tmp_path / "src", tmp_path / "resized", short_side=64)
    kept = LmdbImageDataset(tmp_path / "kept", output="encoded")
    resized = LmdbImageDataset(tmp_path / "resized", output="encoded")
    for i, path in enumerate((rgb, gray)):
        assert bytes(kept[i][0].numpy()) == path.read_bytes()
        assert bytes(resized[i][0].numpy()) != path.read_bytes()
    assert tuple(LmdbImageDataset(tmp_path / "kept")[0][0].shape) == (3, 90, 120)
    assert tuple(LmdbImageDataset(tmp_path / "resized")[0][0].shape) == (3, 64, 85)


def test_keep_original_reencodes_cmyk_jpeg(tmp_path):
    """``keep_original`` does not keep a CMYK JPEG (the reader needs RGB or grayscale); it becomes RGB."""
    path = _save(tmp_path / "src" / "k" / "cmyk.jpg", 40, 30, mode="CMYK")
    _run(tmp_path / "src", tmp_path / "db", keep_original=True)
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.read_record(0)[1] != path.read_bytes()
    assert tuple(ds[0][0].shape) == (3, 30, 40)


def test_small_jpegs_are_stored_byte_identical(split_folder, database):
    """Source JPEGs already within ``short_side`` are stored untouched; larger ones are re-encoded."""
    short_side = read_meta(database)["encoding"]["short_side"]
    seen = {"kept": 0, "resized": 0}
    for split in ("train", "val"):
        ds = LmdbImageDataset(database, split, output="encoded")
        for i, path in enumerate(sorted((split_folder / split).glob("*/*.jpg"))):
            stored = bytes(ds[i][0].numpy())
            if min(Image.open(path).size) <= short_side:
                assert stored == path.read_bytes()
                seen["kept"] += 1
            else:
                assert stored != path.read_bytes()
                seen["resized"] += 1
    assert seen["kept"] > 0
    assert seen["resized"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Re-runs
# ---------------------------------------------------------------------------------------------------------------


def test_up_to_date_rerun_does_nothing_and_force_rebuilds(split_folder_copy, tmp_path):
    """An unchanged source with the same options is not converted again; ``force=True`` rebuilds."""
    dst = tmp_path / "db"
    first = _run(split_folder_copy, dst, short_side=64)
    assert not first.up_to_date
    before = (dst / "data.mdb").stat()
    again = _run(split_folder_copy, dst, short_side=64)
    assert again.up_to_date
    assert again.written == 33
    assert again.splits == {"train": 24, "val": 9}
    assert "up to date" in again.format()
    after = (dst / "data.mdb").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    forced = _run(split_folder_copy, dst, short_side=64, force=True)
    assert not forced.up_to_date
    assert forced.written == 33
    assert (dst / "data.mdb").stat().st_ino != before.st_ino
    assert len(LmdbImageDataset(dst, "train")) == 24
    assert _leftovers(dst) == []


def test_changed_options_rebuild(split_folder_copy, tmp_path):
    """Different encoding options (quality, short side) make a re-run convert again."""
    dst = tmp_path / "db"
    _run(split_folder_copy, dst, short_side=64, quality=90)
    assert not _run(split_folder_copy, dst, short_side=64, quality=80).up_to_date
    assert not _run(split_folder_copy, dst, short_side=48, quality=80).up_to_date
    assert read_meta(dst)["encoding"] == {"short_side": 48, "quality": 80, "keep_original": False, "encoding": "jpeg"}
    assert _run(split_folder_copy, dst, short_side=48, quality=80).up_to_date
    assert not _run(split_folder_copy, dst, short_side=48, quality=80, encoding="raw").up_to_date


def test_touched_source_file_triggers_rebuild(split_folder_copy, tmp_path):
    """A source file with a new modification time makes the next run convert again."""
    dst = tmp_path / "db"
    _run(split_folder_copy, dst)
    victim = next((split_folder_copy / "val" / "class_1").iterdir())
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    summary = _run(split_folder_copy, dst)
    assert not summary.up_to_date
    assert summary.written == 33


def test_added_and_removed_source_files_trigger_rebuild(split_folder_copy, tmp_path):
    """Adding or removing a source image rebuilds, and the database then reflects the new source."""
    dst = tmp_path / "db"
    _run(split_folder_copy, dst)
    assert len(LmdbImageDataset(dst, "val")) == 9  # opens (and caches) the first database in this process
    _save(split_folder_copy / "val" / "class_2" / "zz_new.jpg")
    summary = _run(split_folder_copy, dst)
    assert not summary.up_to_date
    assert summary.splits == {"train": 24, "val": 10}
    val = LmdbImageDataset(dst, "val")
    assert len(val) == 10
    assert val.targets[-1] == 2
    (split_folder_copy / "train" / "class_0" / "00000.jpg").unlink()
    assert _run(split_folder_copy, dst).splits == {"train": 23, "val": 10}
    assert LmdbImageDataset(dst, "train").class_counts == [7, 8, 8]


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------


def _write_bad_inputs(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    good = _jpeg_bytes(60, 40)
    bad = {
        "truncated": folder / "b_truncated.jpg",
        "corrupt": folder / "c_corrupt.jpg",
        "empty": folder / "d_empty.jpg",
        "text": folder / "e_text.jpg",
        "truncated_png": folder / "f_truncated.png",
    }
    bad["truncated"].write_bytes(good[: len(good) // 2])
    bad["corrupt"].write_bytes(b"\xff\xd8\xff\xe0" + random.Random(0).randbytes(600))
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("this is not an image, just text in a file named .jpg\n" * 5)
    png = io.BytesIO()
    Image.fromarray(_smooth(60, 40)).save(png, format="PNG")
    bad["truncated_png"].write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    return bad


def test_bad_inputs_are_skipped_counted_and_reported(tmp_path):
    """Truncated, corrupt, empty and non-image files are skipped, with reasons, and the good ones are kept."""
    src, dst = tmp_path / "src", tmp_path / "db"
    _save(src / "a" / "a_good.jpg", seed=1)
    _save(src / "a" / "z_good.png", seed=2)
    _save(src / "b" / "good.jpg", seed=3)
    bad = _write_bad_inputs(src / "a")
    summary = _run(src, dst)
    assert summary.written == 3
    assert len(summary.skipped) == len(bad)
    assert all(isinstance(item, SkippedFile) for item in summary.skipped)
    reasons = {item.path: item.reason for item in summary.skipped}
    assert set(reasons) == {str(path) for path in bad.values()}
    assert reasons[str(bad["empty"])] == "empty file (0 bytes)"
    assert "not an image" in reasons[str(bad["text"])]
    assert "truncated" in reasons[str(bad["truncated"])]
    assert "truncated" in reasons[str(bad["truncated_png"])]
    assert reasons[str(bad["corrupt"])]
    text = summary.format()
    assert "skipped   5" in text
    for path, reason in reasons.items():
        assert f"skipped {path}: {reason}" in text
    report = json.loads((dst / store_format.REPORT_FILE).read_text())
    assert {item["path"]: item["reason"] for item in report["skipped"]} == reasons
    assert report["written"] == 3
    ds = LmdbImageDataset(dst)
    assert ds.targets == [0, 0, 1]
    assert ds.class_counts == [2, 1]
    for i in range(len(ds)):
        assert tuple(ds[i][0].shape) == (3, 32, 48)


def test_summary_format_lists_at_most_max_skipped():
    """``format`` lists ``max_skipped`` skipped files and points to the report for the rest."""
    summary = ConversionSummary(
        destination="/db", written=1, splits={"train": 1}, skipped=[SkippedFile(f"/s/{i}.jpg", "bad") for i in range(5)]
    )
    text = summary.format(max_skipped=2)
    assert "skipped /s/1.jpg: bad" in text
    assert "/s/2.jpg" not in text
    assert f"... and 3 more, listed in {store_format.REPORT_FILE}" in text
    assert summary.to_dict()["skipped"][4] == {"path": "/s/4.jpg", "reason": "bad"}


@pytest.mark.parametrize(
    ("name", "mode", "save_kwargs"),
    [
        ("gray.jpg", "L", {}),
        ("gray.png", "L", {}),
        ("cmyk.jpg", "CMYK", {}),
        ("rgba.png", "RGBA", {}),
        ("bilevel.png", "1", {}),
        ("la.png", "LA", {}),
        ("rgb.webp", "RGB", {}),
        ("rgb.bmp", "RGB", {}),
        ("rgb.tiff", "RGB", {}),
        ("rgb.ppm", "RGB", {}),
    ],
)
def test_image_modes_become_rgb(tmp_path, name, mode, save_kwargs):
    """Every Pillow mode is stored as RGB and reads back as 3 channels, as a tensor and as a PIL image."""
    path = _save(tmp_path / "src" / "k" / name, 48, 32, mode=mode, **save_kwargs)
    summary = _run(tmp_path / "src", tmp_path / "db")
    assert summary.skipped == []
    image, _ = LmdbImageDataset(tmp_path / "db")[0]
    assert image.dtype == torch.uint8
    assert tuple(image.shape) == (3, 32, 48)
    pil, _ = LmdbImageDataset(tmp_path / "db", output="pil")[0]
    assert pil.mode == "RGB"
    assert pil.size == (48, 32)
    expected = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    assert np.abs(_hwc(image) - expected).mean() < 8


def test_cmyk_jpeg_keeps_its_colour(tmp_path):
    """A CMYK JPEG (pure red in CMYK) reads back as red RGB."""
    folder = tmp_path / "src" / "k"
    folder.mkdir(parents=True)
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(folder / "red.jpg")
    _run(tmp_path / "src", tmp_path / "db")
    image = LmdbImageDataset(tmp_path / "db")[0][0].float().mean(dim=(1, 2))
    assert image[0] > 220
    assert image[1] < 40
    assert image[2] < 40


def test_palette_png_with_transparency_becomes_rgb(tmp_path):
    """A palette PNG with a transparent index keeps its palette colours (red, green, blue bands)."""
    folder = tmp_path / "src" / "k"
    folder.mkdir(parents=True)
    index = np.zeros((20, 30), np.uint8)
    index[:, 10:] = 1
    index[:, 20:] = 2
    img = Image.fromarray(index, "P")
    img.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    img.save(folder / "palette.png", transparency=0)
    assert Image.open(folder / "palette.png").info.get("transparency") == 0
    _run(tmp_path / "src", tmp_path / "db")
    image = LmdbImageDataset(tmp_path / "db")[0][0]
    assert tuple(image.shape) == (3, 20, 30)
    bands = [image[:, 10, col].tolist() for col in (4, 15, 25)]
    for band, channel in zip(bands, range(3), strict=True):
        assert band[channel] > 220
        assert max(band[c] for c in range(3) if c != channel) < 40


def test_rgba_png_keeps_the_colour_channels(tmp_path):
    """An RGBA PNG (alpha varying) is stored as its RGB channels."""
    folder = tmp_path / "src" / "k"
    folder.mkdir(parents=True)
    rgba = np.dstack([_smooth(48, 32), np.linspace(0, 255, 48, dtype=np.uint8)[None, :].repeat(32, 0)])
    Image.fromarray(rgba, "RGBA").save(folder / "rgba.png")
    _run(tmp_path / "src", tmp_path / "db")
    image = LmdbImageDataset(tmp_path / "db")[0][0]
    assert np.abs(_hwc(image) - _smooth(48, 32).astype(np.int16)).mean() < 6


def test_sixteen_bit_grayscale_png_is_rescaled_not_saturated(tmp_path):
    """A 16-bit grayscale PNG (``I;16``, 0..65535) is scaled to 0..255 rather than clipped to white."""
    folder = tmp_path / "src" / "k"
    folder.mkdir(parents=True)
    ramp = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (32, 1))
    Image.fromarray(ramp).save(folder / "gray16.png")
    assert Image.open(folder / "gray16.png").mode.startswith("I")
    _run(tmp_path / "src", tmp_path / "db")
    image = LmdbImageDataset(tmp_path / "db")[0][0].float()
    assert tuple(image.shape) == (3, 32, 64)
    assert 100 < image.mean() < 155
    assert image[:, :, 0].mean() < 20
    assert image[:, :, -1].mean() > 235
    assert (image >= 250).float().mean() < 0.1
    assert torch.allclose(image[0], image[1], atol=2)


def test_float_grayscale_tiff_is_rescaled(tmp_path):
    """A float (``F``) grayscale TIFF in 0..1 is scaled to 0..255."""
    folder = tmp_path / "src" / "k"
    folder.mkdir(parents=True)
    ramp = np.tile(np.linspace(0.0, 1.0, 64, dtype=np.float32), (32, 1))
    Image.fromarray(ramp, "F").save(folder / "float.tif")
    _run(tmp_path / "src", tmp_path / "db")
    image = LmdbImageDataset(tmp_path / "db")[0][0].float()
    assert 100 < image.mean() < 155
    assert image[:, :, 0].mean() < 20
    assert image[:, :, -1].mean() > 235


def test_extensions_any_case_and_non_images_ignored(tmp_path):
    """``.JPEG``/``.Png``/``.TIF`` count as images; ``.txt``, ``.DS_Store`` and hidden files and folders are ignored."""
    folder = tmp_path / "src" / "k"
    _save(folder / "a.JPEG")
    _save(folder / "b.Png")
    _save(folder / "c.jpg")
    _save(folder / "d.TIF")
    (folder / "notes.txt").write_text("not an image")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(100))
    _save(folder / ".hidden.jpg")
    _save(folder / ".thumbnails" / "t.jpg")
    (folder / "readme.md").write_text("# hello")
    summary = _run(tmp_path / "src", tmp_path / "db")
    assert summary.written == 4
    assert summary.skipped == []
    assert len(LmdbImageDataset(tmp_path / "db")) == 4


def test_hidden_class_folders_are_ignored(tmp_path):
    """A hidden folder beside the class folders (``.git``, ``.ipynb_checkpoints``) is not a class."""
    _save(tmp_path / "src" / "cat" / "a.jpg")
    _save(tmp_path / "src" / ".ipynb_checkpoints" / "b.jpg")
    _run(tmp_path / "src", tmp_path / "db")
    assert read_meta(tmp_path / "db")["classes"] == ["cat"]


def _layout_missing(root: Path) -> Path:
    return root / "missing"


def _layout_empty(root: Path) -> Path:
    (root / "empty").mkdir()
    return root / "empty"


def _layout_flat(root: Path) -> Path:
    _save(root / "flat" / "a.jpg")
    _save(root / "flat" / "b.jpg")
    return root / "flat"


def _layout_no_images(root: Path) -> Path:
    (root / "noimg" / "cat").mkdir(parents=True)
    (root / "noimg" / "cat" / "readme.txt").write_text("no images here")
    return root / "noimg"


def _layout_file(root: Path) -> Path:
    return _save(root / "image.jpg")


def _layout_split_without_classes(root: Path) -> Path:
    _save(root / "splits" / "train" / "cat" / "a.jpg")
    (root / "splits" / "val").mkdir()
    _save(root / "splits" / "val" / "loose.jpg")
    return root / "splits"


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (_layout_missing, "does not exist"),
        (_layout_empty, "has no sub-folders"),
        (_layout_flat, "has no sub-folders"),
        (_layout_no_images, "found no image files"),
        (_layout_file, "is a file, not a folder"),
        (_layout_split_without_classes, "has no class sub-folders"),
    ],
)
def test_bad_source_layouts_raise_with_the_expected_layout(tmp_path, layout, match):
    """A missing, empty or wrongly laid out source raises ``SourceLayoutError`` that shows the expected tree."""
    src = layout(tmp_path)
    dst = tmp_path / "db"
    with pytest.raises(SourceLayoutError, match=match) as info:
        _run(src, dst)
    message = str(info.value)
    assert LAYOUT_HINT in message
    assert "SRC/train/<class>/<image>.jpg" in message
    assert str(src.name) in message
    assert not dst.exists()


# ---------------------------------------------------------------------------------------------------------------
# Failures publish nothing
# ---------------------------------------------------------------------------------------------------------------


def test_strict_with_a_bad_file_writes_nothing(tmp_path):
    """``strict=True`` and one bad file: ``ConversionError`` naming it, and no database (or leftovers) at ``dst``."""
    src, dst = tmp_path / "src", tmp_path / "db"
    _save(src / "a" / "good.jpg")
    (src / "a" / "bad.jpg").write_bytes(b"")
    with pytest.raises(ConversionError, match="strict") as info:
        _run(src, dst, strict=True)
    assert str(src / "a" / "bad.jpg") in str(info.value)
    assert not dst.exists()
    assert _leftovers(dst) == []


def test_strict_failure_keeps_the_previous_database(tmp_path):
    """A failed strict re-conversion leaves the previous complete database in place and readable."""
    src, dst = tmp_path / "src", tmp_path / "db"
    _save(src / "a" / "good.jpg")
    _run(src, dst)
    (src / "a" / "bad.jpg").write_text("not an image")
    _save(src / "a" / "more.jpg")
    with pytest.raises(ConversionError):
        _run(src, dst, strict=True)
    assert len(LmdbImageDataset(dst)) == 1
    assert _leftovers(dst) == []


def test_all_inputs_bad_raises_and_writes_nothing(tmp_path):
    """When no input converts, ``ConversionError`` says so and nothing appears at ``dst``."""
    src, dst = tmp_path / "src", tmp_path / "db"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(b"")
    (src / "a" / "y.png").write_text("text")
    with pytest.raises(ConversionError, match="none of the 2 inputs could be converted"):
        _run(src, dst)
    assert not dst.exists()
    assert _leftovers(dst) == []


def test_foreign_non_empty_dst_folder_is_refused_and_untouched(split_folder, tmp_path):
    """A ``dst`` folder holding other files is never replaced: ``ConversionError``, files unchanged."""
    dst = tmp_path / "precious"
    (dst / "sub").mkdir(parents=True)
    (dst / "notes.txt").write_text("keep me")
    (dst / "sub" / "data.bin").write_bytes(b"\x01\x02")
    with pytest.raises(ConversionError, match="not a lightning_fastdata database"):
        _run(split_folder, dst, force=True)
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["notes.txt", "sub", "sub/data.bin"]
    assert (dst / "notes.txt").read_text() == "keep me"
    assert (dst / "sub" / "data.bin").read_bytes() == b"\x01\x02"


def test_foreign_lmdb_at_dst_is_refused_and_untouched(split_folder, tmp_path):
    """Another program's LMDB database at ``dst`` is not ours, so it is not replaced."""
    dst = tmp_path / "other.lmdb"
    env = lmdb.open(str(dst), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"precious", b"data")
    env.close()
    with pytest.raises(ConversionError, match="not a lightning_fastdata database"):
        _run(split_folder, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["data.mdb", "lock.mdb"]
    # the converter looked at it through the shared read-only environment (LMDB allows one per process)
    with store_environments.open_readonly(dst).begin() as txn:
        assert txn.get(b"precious") == b"data"


def test_dst_that_is_a_file_is_refused_and_untouched(split_folder, tmp_path):
    """A regular file at ``dst`` is not replaced."""
    dst = tmp_path / "file.lmdb"
    dst.write_text("a file")
    with pytest.raises(ConversionError):
        _run(split_folder, dst)
    assert dst.read_text() == "a file"


def test_empty_dst_folder_is_used(split_folder, tmp_path):
    """An existing empty folder at ``dst`` is filled with the database."""
    dst = tmp_path / "db"
    dst.mkdir()
    assert _run(split_folder, dst).written == 33
    assert read_meta(dst)["complete"] is True


def test_incomplete_own_database_at_dst_is_replaced(split_folder, database_copy):
    """Our own database marked incomplete at ``dst`` is replaced by a complete conversion."""
    env = lmdb.open(str(database_copy), map_size=1 << 24)
    with env.begin(write=True) as txn:
        meta = store_format.load_meta(txn.get(store_format.META_KEY), database_copy)
        txn.put(store_format.META_KEY, store_format.dump_meta({**meta, "complete": False}))
    env.close()
    with pytest.raises(DatasetFormatError, match="incomplete"):
        read_meta(database_copy)
    summary = _run(split_folder, database_copy, short_side=64)
    assert not summary.up_to_date
    assert read_meta(database_copy)["complete"] is True


def test_replacing_a_database_this_process_read_leaves_no_claim_on_its_files(split_folder, database_copy, tmp_path):
    """After ``--force`` replaces a database read here, a new database may reuse the old files' inodes.

    The old database has the writer's ``lock.mdb``, which a reader neither locks nor names. A file system hands a
    deleted file's inode to a new file; hard links stand in for that here.
    """
    assert (database_copy / "lock.mdb").exists()
    old = LmdbImageDataset(database_copy, "val")
    assert len(old) == 9  # this process now has the old database open
    kept = tmp_path / "kept"
    kept.mkdir()
    os.link(database_copy / "lock.mdb", kept / "lock.mdb")
    _run(split_folder, database_copy, short_side=64, force=True)
    reused = shutil.copytree(database_copy, tmp_path / "reused.lmdb")
    (reused / "lock.mdb").unlink()
    os.link(kept / "lock.mdb", reused / "lock.mdb")  # the old lock file's inode, as a new file
    env = lmdb.open(str(reused), map_size=1 << 26)  # "already open in this process" had the reader named it
    env.close()
    assert len(LmdbImageDataset(reused, "val")) == 9
    assert old[0][1] == 0  # the old files are still open here: the dataset reads what it indexed


def test_a_dataset_opened_before_its_database_was_replaced_says_so(split_folder, database_copy):
    """Opening the new database closes the old one's environment: reading the old dataset says to create it again."""
    old = LmdbImageDataset(database_copy, "val")
    assert old[0][1] == 0
    _run(split_folder, database_copy, short_side=64, force=True)
    assert LmdbImageDataset(database_copy, "val")[1][0].shape[0] == 3
    for read in (lambda: old[1], lambda: old.targets):
        with pytest.raises(DatasetFormatError, match=r"replaced or deleted after this dataset opened it.*again"):
            read()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"short_side": -1}, "short_side"),
        ({"quality": 0}, "quality"),
        ({"quality": 101}, "quality"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_invalid_options_raise_value_error(split_folder, tmp_path, kwargs, match):
    """Out-of-range options raise ``ValueError`` naming the argument, before anything is written."""
    dst = tmp_path / "db"
    with pytest.raises(ValueError, match=match):
        _run(split_folder, dst, **kwargs)
    assert not dst.exists()


def test_dst_must_be_outside_src(split_folder_copy):
    """``dst`` equal to ``src``, a parent of it, or inside it is refused with a ``ValueError`` that says which."""
    for src, dst, message in [
        (split_folder_copy, split_folder_copy, "are the same path"),
        (split_folder_copy / "train", split_folder_copy, "`src` .* is inside `dst`"),
        (split_folder_copy, split_folder_copy / "db.lmdb", "`dst` .* is inside `src`"),
    ]:
        with pytest.raises(ValueError, match=message):
            _run(src, dst)
    assert not (split_folder_copy / "db.lmdb").exists()


def test_tiny_initial_map_size_grows(tmp_path):
    """A 64 KiB initial LMDB map is grown (doubling) as needed and the database is complete and correct."""
    rng = np.random.default_rng(0)
    noise = [(rng.random((128, 128, 3)) * 255).astype(np.uint8) for _ in range(8)]
    for i, pixels in enumerate(noise):
        folder = tmp_path / "src" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    dst = tmp_path / "db"
    summary = _run(tmp_path / "src", dst, quality=95, initial_map_size=64 << 10)
    assert summary.written == 8
    encoded = LmdbImageDataset(dst, output="encoded")
    assert sum(len(encoded[i][0]) for i in range(len(encoded))) > 2 * (64 << 10)
    assert (dst / "data.mdb").stat().st_size > 2 * (64 << 10)
    ds = LmdbImageDataset(dst)
    assert ds.targets == [0, 0, 0, 0, 1, 1, 1, 1]
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # c0/{0,2,4,6}.png, then c1/{1,3,5,7}.png
    for i, source in enumerate(order):  # noise survives JPEG poorly, but each image is nearest its own source
        diffs = [np.abs(_hwc(ds[i][0]) - pixels.astype(np.int16)).mean() for pixels in noise]
        assert int(np.argmin(diffs)) == source


def _sizes(low: int, high: int, count: int, seed: int = 0) -> list[int]:
    return [int(n) for n in np.random.default_rng(seed).integers(low, high, count)]


@pytest.mark.parametrize(
    ("splits", "most"),
    [
        ({"train": _sizes(6000, 14000, 1500)}, 1.02),  # photos at short side 256: 2-4 overflow pages each
        ({"train": _sizes(300, 1900, 3000)}, 1.05),  # thumbnails, in the leaf pages
        ({"train": _sizes(1900, 2300, 2000)}, 1.05),  # either side of LMDB's overflow threshold
        ({"train": [196_628] * 200}, 1.01),  # raw 256x256 pixels: 49 pages each
        ({"train": _sizes(200, 200_000, 800)}, 1.02),
        ({s: _sizes(300, 1900, 1000, i) for i, s in enumerate(("train", "val", "test"))}, 1.5),  # test before train
    ],
    ids=["photos", "thumbnails", "threshold", "raw", "mixed", "splits-out-of-order"],
)
def test_the_disk_space_estimate_is_never_below_what_lmdb_writes(tmp_path, splits, most):
    """The writer's bound of ``data.mdb`` (what a full disk's message says the database needs) holds its size for
    records of any size, put as a conversion puts them (issue 42: the records' bytes were 50-98% of it)."""
    from lightning_fastdata.store.writer import _LmdbWriter

    writer = _LmdbWriter(tmp_path, 1 << 20)  # grown by doubling as it fills
    writer.put(store_format.META_KEY, b"m" * 700)
    writer.flush()
    rng = random.Random(0)
    for split, sizes in splits.items():
        for i, size in enumerate(sizes):
            writer.put(store_format.record_key(split, i), rng.randbytes(size))
    for split, sizes in splits.items():
        writer.put(store_format.labels_key(split), bytes(4 * len(sizes)))
        writer.put(
            store_format.sources_key(split), json.dumps([f"class_{i % 7}/{i}.jpg" for i in range(len(sizes))]).encode()
        )
    writer.put(store_format.META_KEY, b"m" * 900)
    bound = writer.bound.nbytes()
    writer.close()
    size = (tmp_path / store_format.DATA_FILE).stat().st_size
    assert size <= bound <= most * size


@pytest.mark.parametrize(("euid", "blocks", "free"), [(1000, 100, 10 * 4096), (0, 100, 25 * 4096), (1000, 0, None)])
def test_the_free_space_checked_before_each_commit(tmp_path, monkeypatch, euid, blocks, free):
    """Root may write into the blocks a file system reserves for it; a file system that reports no size is not
    checked (a FUSE mount reporting nothing free must not stop a conversion)."""
    from lightning_fastdata.store import writer

    # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, ...: 25 blocks free, 10 of them for anyone
    monkeypatch.setattr(
        writer.os, "statvfs", lambda path: os.statvfs_result((4096, 4096, blocks, 25, 10, 0, 0, 0, 0, 255))
    )
    monkeypatch.setattr(writer.os, "geteuid", lambda: euid)
    assert writer._free_space(tmp_path) == free


# ---------------------------------------------------------------------------------------------------------------
# convert_dataset
# ---------------------------------------------------------------------------------------------------------------


COLOURS = [(230, 20, 20), (20, 230, 20), (20, 20, 230)]


def _pil_samples(n: int = 6) -> list[tuple[Image.Image, int]]:
    return [(Image.new("RGB", (20 + 2 * i, 16 + i), COLOURS[i % 3]), i % 3) for i in range(n)]


def _convert_ds(dataset, dst: Path, **kwargs) -> ConversionSummary:
    kwargs.setdefault("num_workers", 0)
    kwargs.setdefault("progress", False)
    return convert_dataset(dataset, dst, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_convert_dataset_of_pil_images(tmp_path, num_workers):
    """A list of ``(PIL image, label)`` converts in order; classes default to ``"0"``, ``"1"``, ..."""
    samples = _pil_samples()
    summary = _convert_ds(samples, tmp_path / "db", num_workers=num_workers)
    assert summary.splits == {"train": 6}
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.classes == ["0", "1", "2"]
    assert ds.targets == [0, 1, 2, 0, 1, 2]
    for i, (img, label) in enumerate(samples):
        image, got = ds[i]
        assert got == label
        assert tuple(image.shape) == (3, img.height, img.width)
        assert (image.float().mean(dim=(1, 2)) - torch.tensor(COLOURS[label], dtype=torch.float)).abs().max() < 6


def test_convert_dataset_with_classes(tmp_path):
    """Explicit ``classes`` are stored, even a class that has no sample."""
    _convert_ds(_pil_samples(), tmp_path / "db", classes=["red", "green", "blue", "unused"])
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.classes == ["red", "green", "blue", "unused"]
    assert ds.class_to_idx == {"red": 0, "green": 1, "blue": 2, "unused": 3}
    assert ds.class_counts == [2, 2, 2, 0]


def test_convert_dataset_of_encoded_bytes(tmp_path):
    """``(bytes, label)`` samples: small JPEG bytes are stored untouched, PNG bytes become JPEG of the same size."""
    jpeg = _jpeg_bytes(40, 30)
    png = io.BytesIO()
    Image.fromarray(_smooth(50, 20)).save(png, format="PNG")
    _convert_ds([(jpeg, 1), (png.getvalue(), np.int64(0)), (bytearray(jpeg), 1)], tmp_path / "db")
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.targets == [1, 0, 1]
    assert ds.read_record(0)[1] == jpeg
    assert ds.read_record(2)[1] == jpeg
    header, payload = ds.read_record(1)
    assert payload[:3] == b"\xff\xd8\xff"
    assert (header.height, header.width) == (20, 50)
    assert tuple(ds[1][0].shape) == (3, 20, 50)


class _ReadInWorkers:
    """A dataset that refuses reads in the process that made it past its first sample (which sets the target kind)."""

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.samples = _pil_samples(40)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        if index > 0 and os.getpid() == self.parent:
            raise RuntimeError("read in the process that forks the pool")
        return self.samples[index]


def test_the_default_reads_a_dataset_of_ones_own_only_in_the_pool(tmp_path, monkeypatch):
    """``num_workers=None`` times the first files in this process before it starts a pool, but never a dataset of
    one's own: its reads could open handles (a file, a database) that the forked workers would then share."""
    from lightning_fastdata.store import encode

    monkeypatch.setattr(encode, "usable_cpu_count", lambda: 2)
    summary = convert_dataset(_ReadInWorkers(), tmp_path / "db", num_workers=None, progress=False)
    assert (summary.written, summary.skipped, summary.workers) == (40, [], 2)


class _NamedDataset(list):
    classes = ("cat", "dog")


def test_convert_dataset_mapping_of_splits(tmp_path):
    """A mapping converts one split per key; classes come from the first dataset's ``classes`` attribute."""
    train = _NamedDataset([(Image.new("RGB", (16, 16), COLOURS[0]), 0), (Image.new("RGB", (16, 16), COLOURS[1]), 1)])
    val = [(Image.new("RGB", (12, 10), COLOURS[1]), 1)]
    summary = _convert_ds({"train": train, "val": val}, tmp_path / "db")
    assert summary.splits == {"train": 2, "val": 1}
    assert LmdbImageDataset(tmp_path / "db").classes == ["cat", "dog"]
    val_ds = LmdbImageDataset(tmp_path / "db", "val")
    assert val_ds.targets == [1]
    assert tuple(val_ds[0][0].shape) == (3, 10, 12)
    _convert_ds({"train": train, "val": val}, tmp_path / "db2", classes=["a", "b", "c"])
    assert read_meta(tmp_path / "db2")["classes"] == ["a", "b", "c"]


class _Flaky:
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        image = Image.new("RGB", (8, 8), COLOURS[0])
        samples = [
            (image, 0),
            (image, -1),
            (image, True),
            (np.zeros((8, 8, 3), np.uint8), 0),
            (image, "cat"),
            (image, 1),
        ]
        if index == 2:
            raise OSError("disk on fire")
        return samples[index]


def test_convert_dataset_skips_bad_samples_with_reasons(tmp_path):
    """Bad labels, unsupported sample types and samples that raise are skipped and named ``split[index]``."""
    summary = _convert_ds(_Flaky(), tmp_path / "db")
    reasons = {item.path: item.reason for item in summary.skipped}
    assert sorted(reasons) == ["train[1]", "train[2]", "train[3]", "train[4]"]
    assert "label must be a non-negative int" in reasons["train[1]"]
    assert reasons["train[2]"] == "dataset raised OSError: disk on fire"
    assert "got ndarray" in reasons["train[3]"]
    assert "label must be a non-negative int" in reasons["train[4]"]
    assert LmdbImageDataset(tmp_path / "db").targets == [0, 1]


def test_convert_dataset_label_beyond_classes_raises(tmp_path):
    """A label outside the given ``classes`` raises ``ConversionError`` and publishes nothing."""
    dst = tmp_path / "db"
    with pytest.raises(ConversionError, match="number of classes"):
        _convert_ds(_pil_samples(), dst, classes=["only", "two"])
    assert not dst.exists()
    assert _leftovers(dst) == []


@pytest.mark.parametrize("dataset", [[], {}, {"train": [(Image.new("RGB", (4, 4)), 0)], "val": []}])
def test_convert_dataset_empty_raises(tmp_path, dataset):
    """An empty dataset (or mapping, or split) raises ``SourceLayoutError``."""
    with pytest.raises(SourceLayoutError, match="non-empty"):
        _convert_ds(dataset, tmp_path / "db")
    assert not (tmp_path / "db").exists()


def test_convert_dataset_fingerprint_controls_reruns(tmp_path):
    """With a ``fingerprint`` an identical re-run does nothing; without one every call converts."""
    samples, dst = _pil_samples(), tmp_path / "db"
    assert not _convert_ds(samples, dst).up_to_date
    assert not _convert_ds(samples, dst).up_to_date
    assert not _convert_ds(samples, dst, fingerprint="v1").up_to_date
    assert _convert_ds(samples, dst, fingerprint="v1").up_to_date
    assert not _convert_ds(samples, dst, fingerprint="v2").up_to_date
    assert not _convert_ds(samples, dst, fingerprint="v2", force=True).up_to_date


# ---------------------------------------------------------------------------------------------------------------
# Interruptions
# ---------------------------------------------------------------------------------------------------------------


def _slow_source(root: Path, per_class: int = 75) -> Path:
    """A folder that takes ~1-2 s to convert in one worker: large noise PNGs (hard links, so no disk cost)."""
    rng = np.random.default_rng(0)
    originals = []
    for i in range(2):
        path = root / f"original_{i}.png"
        Image.fromarray((rng.random((520, 520, 3)) * 255).astype(np.uint8)).save(path, compress_level=1)
        originals.append(path)
    src = root / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for n in range(per_class):
            os.link(originals[n % 2], src / cls / f"{n:04d}.png")
    return src


@pytest.mark.slow
def test_killed_conversion_publishes_nothing_and_rerun_completes(tmp_path):
    """SIGKILL mid-conversion leaves no database at ``dst`` (only an incomplete hidden one); a re-run completes."""
    src, dst = _slow_source(tmp_path), tmp_path / "db"
    partial = tmp_path / ".db.partial"
    cmd = [sys.executable, "-m", "lightning_fastdata.cli", "convert", str(src), str(dst)]
    cmd += ["--workers", "1", "--short-side", "500", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (partial / "data.mdb").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.01)
        time.sleep(0.3)  # let the first transaction (metadata, complete=false) commit
        assert proc.poll() is None, "the conversion finished before it could be interrupted"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the converter and its pool worker (one process group)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    with pytest.raises(FileNotFoundError):
        read_meta(dst)
    with pytest.raises(FileNotFoundError):
        LmdbImageDataset(dst)
    assert partial.is_dir()
    with pytest.raises(DatasetFormatError, match="incomplete"):
        LmdbImageDataset(partial)
    with pytest.raises(DatasetFormatError, match="incomplete"):
        read_meta(partial)

    summary = _run(src, dst, short_side=500, num_workers=2)
    assert summary.written == 150
    assert not partial.exists()
    ds = LmdbImageDataset(dst)
    assert len(ds) == 150
    assert ds.targets == [0] * 75 + [1] * 75
    assert tuple(ds[149][0].shape) == (3, 500, 500)


class _Interrupting:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        if index == 5:
            raise KeyboardInterrupt
        return Image.new("RGB", (8, 8), COLOURS[index % 3]), index % 3


def test_keyboard_interrupt_leaves_nothing(tmp_path):
    """Ctrl-C during an in-process conversion propagates and leaves neither a partial folder nor ``dst``."""
    dst = tmp_path / "db"
    with pytest.raises(KeyboardInterrupt):
        _convert_ds(_Interrupting(), dst)
    assert not dst.exists()
    assert _leftovers(dst) == []


def test_keyboard_interrupt_keeps_the_previous_database(tmp_path):
    """An interrupted re-conversion leaves the previous database complete and unchanged."""
    dst = tmp_path / "db"
    _convert_ds(_pil_samples(), dst)
    with pytest.raises(KeyboardInterrupt):
        _convert_ds(_Interrupting(), dst)
    assert len(LmdbImageDataset(dst)) == 6
    assert _leftovers(dst) == []


def test_raw_encoding_stores_pixels_and_reads_them_back(split_folder_copy, tmp_path):
    """``encoding="raw"`` stores uint8 RGB pixels that read back equal to the JPEG path's decode of the same resize."""
    raw_db, jpeg_db = tmp_path / "raw", tmp_path / "jpeg"
    _run(split_folder_copy, raw_db, short_side=48, encoding="raw")
    _run(split_folder_copy, jpeg_db, short_side=48, quality=100)
    assert read_meta(raw_db)["encoding"]["encoding"] == "raw"
    raw, jpeg = LmdbImageDataset(raw_db, "val"), LmdbImageDataset(jpeg_db, "val")
    for i in range(len(raw)):
        header, data = raw.read_record(i)
        assert header.encoding == store_format.ENCODING_RAW
        assert len(data) == header.height * header.width * 3
        (a, la), (b, lb) = raw[i], jpeg[i]
        assert la == lb
        assert a.dtype == torch.uint8
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().mean() < 3
    pil = LmdbImageDataset(raw_db, "val", output="pil")[0][0]
    assert pil.mode == "RGB"
    assert torch.equal(torch.from_numpy(np.asarray(pil)).permute(2, 0, 1), raw[0][0])


def test_raw_encoding_rejects_keep_original(split_folder_copy, tmp_path):
    """``keep_original`` stores JPEG bytes, so asking for it with raw pixels is a ``ValueError``."""
    with pytest.raises(ValueError, match="keep_original"):
        _run(split_folder_copy, tmp_path / "db", encoding="raw", keep_original=True)
    with pytest.raises(ValueError, match="encoding"):
        _run(split_folder_copy, tmp_path / "db", encoding="png")


def test_in_process_conversion_keeps_the_callers_thread_count(split_folder_copy, tmp_path):
    """``num_workers=0`` converts in this process without leaving torch capped at one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _run(split_folder_copy, tmp_path / "db", num_workers=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# A conversion of a dataset whose labels say what the encoding worker had loaded: 0 no torch, 1 torch capped at one
# thread, 2 torch with more. A script file, not `-c`: a spawned worker imports the main module to unpickle `Probe`
_WORKER_IMPORTS = textwrap.dedent(
    """
    import io, multiprocessing, sys
    from PIL import Image
    from lightning_fastdata import convert_dataset

    class Probe:
        def __init__(self, jpeg):
            self.jpeg = jpeg

        def __len__(self):
            return 8

        def __getitem__(self, index):
            torch = sys.modules.get("torch")
            return self.jpeg, 0 if torch is None else 1 if torch.get_num_threads() == 1 else 2

    if __name__ == "__main__":
        multiprocessing.set_start_method(sys.argv[1])
        if sys.argv[3] == "torch":
            import torch

            torch.set_num_threads(2)
        out = io.BytesIO()
        Image.new("RGB", (8, 8), "red").save(out, format="JPEG")
        convert_dataset(Probe(out.getvalue()), sys.argv[2], classes=["none", "one", "more"], num_workers=2,
                        progress=False)
    """
)


@pytest.mark.parametrize(
    ("method", "parent", "label"), [("fork", "", 0), ("spawn", "", 0), ("forkserver", "", 0), ("fork", "torch", 1)]
)
def test_pool_workers_import_no_torch(tmp_path, method, parent, label):
    """A conversion worker loads no torch (it took ~5 s per worker), under every start method; a parent's torch,
    inherited by fork, is capped at one thread per worker."""
    script = tmp_path / "probe.py"
    script.write_text(_WORKER_IMPORTS)
    proc = subprocess.run(
        [sys.executable, str(script), method, str(tmp_path / "db"), parent], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LmdbImageDataset(tmp_path / "db").targets == [label] * 8


def test_the_default_converts_a_few_images_without_a_pool(split_folder_copy, tmp_path, monkeypatch):
    """``num_workers=None`` starts no pool where it would not pay (a pool took seconds to start, longer than the
    conversion); an explicit worker count is honoured."""
    from types import SimpleNamespace

    from lightning_fastdata.store import encode

    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was started for a few images")

    clock = itertools.count(0.0, 0.001)  # a millisecond an image, whatever the machine's load
    with monkeypatch.context() as patch:
        patch.setattr(encode, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        patch.setattr(encode.multiprocessing, "get_context", no_pool)
        summary = _run(split_folder_copy, tmp_path / "db", num_workers=None)
    assert (summary.written, summary.workers) == (33, 0)
    assert _run(split_folder_copy, tmp_path / "db2", num_workers=2).workers == 2


def test_a_pool_started_after_the_first_images_gives_the_same_database(split_folder, database, tmp_path, monkeypatch):
    """The default encodes the first images here, then (when they were slow) the rest in a pool: same records."""
    from types import SimpleNamespace

    from lightning_fastdata.store import encode

    clock = itertools.chain([0.0] * 4, itertools.repeat(10.0))  # three images in 10 s: a pool pays for the rest
    monkeypatch.setattr(encode, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(encode, "usable_cpu_count", lambda: 2)
    dst = tmp_path / "db"
    assert _run(split_folder, dst, short_side=64, num_workers=None).workers == 2
    for split in ("train", "val"):
        mixed, pooled = LmdbImageDataset(dst, split), LmdbImageDataset(database, split)
        assert [mixed.read_record(i) for i in range(len(mixed))] == [pooled.read_record(i) for i in range(len(pooled))]


@pytest.mark.parametrize(
    ("seconds_per_task", "remaining", "workers", "method", "pays"),
    [
        (0.002, 50, 2, "fork", False),  # 0.1 s of work: not worth a pool
        (0.002, 5000, 2, "fork", True),
        (0.002, 500, 2, "spawn", False),  # a spawned worker imports this package first
        (0.002, 5000, 2, "forkserver", True),
        (1.0, 100, 1, "fork", False),  # one worker is this process, slower
    ],
)
def test_a_pool_is_started_only_where_it_pays(seconds_per_task, remaining, workers, method, pays):
    """The default's choice between a pool and this process, from the time per image of the first ones."""
    from lightning_fastdata.store.encode import _pool_pays

    assert _pool_pays(seconds_per_task, remaining, workers, method) is pays


# ---------------------------------------------------------------------------------------------------------------
# Sources people have: split names, list files, datasets; bad paths; replacing another source's database
# ---------------------------------------------------------------------------------------------------------------


def _tree(root: Path, layout: dict[str, int]) -> Path:
    """Write ``root/<relative folder>/<n>.jpg`` for each ``{relative folder: image count}``."""
    for folder, count in layout.items():
        for n in range(count):
            _save(root / folder / f"{n}.jpg", seed=n)
    return root


@pytest.mark.parametrize(
    ("train", "val", "test"),
    [("Train", "Val", "Test"), ("training", "validation", "testing"), ("TRAIN", "dev", "test"), ("train", "valid", "")],
)
def test_split_folder_names_are_recognised_in_any_case(tmp_path, train, val, test):
    """Split folders in any common spelling and case are splits (stored as train/val/test), never classes."""
    layout = {f"{train}/cat": 2, f"{train}/dog": 2, f"{val}/cat": 1, f"{val}/dog": 1}
    if test:
        layout.update({f"{test}/cat": 1, f"{test}/dog": 1})
    _tree(tmp_path / "src", layout)
    summary = _run(tmp_path / "src", tmp_path / "db")
    assert summary.splits == {"train": 4, "val": 2, **({"test": 2} if test else {})}
    assert LmdbImageDataset(tmp_path / "db", split="val").classes == ["cat", "dog"]


def test_a_root_of_only_val_is_a_val_split(tmp_path):
    """A root holding only ``val/<class>/`` converts to a ``val`` split, not a one-class dataset."""
    _tree(tmp_path / "src", {"val/cat": 2, "val/dog": 1})
    summary = _run(tmp_path / "src", tmp_path / "db")
    assert summary.splits == {"val": 3}
    assert read_meta(tmp_path / "db")["classes"] == ["cat", "dog"]


def test_a_split_named_class_folder_warns(tmp_path):
    """A top-level folder named like a split but holding images directly is read as a class, with a warning."""
    _tree(tmp_path / "src", {"cat": 2, "test": 2})
    with pytest.warns(UserWarning, match="'test' has a split name but holds no class folders"):
        summary = _run(tmp_path / "src", tmp_path / "db")
    assert summary.splits == {"train": 4}
    assert read_meta(tmp_path / "db")["classes"] == ["cat", "test"]


def test_two_folders_for_one_split_are_refused(tmp_path):
    """``val/`` and ``validation/`` side by side are ambiguous: ``SourceLayoutError`` naming both."""
    _tree(tmp_path / "src", {"train/a": 1, "val/a": 1, "validation/a": 1})
    with pytest.raises(SourceLayoutError, match="two folders for split 'val'"):
        _run(tmp_path / "src", tmp_path / "db")


def test_sources_map_each_record_to_its_file(split_folder, tmp_path):
    """Each record's path relative to ``src`` is stored, in record order, and matches the stored image."""
    from lightning_fastdata import read_sources

    _run(split_folder, tmp_path / "db", short_side=0)
    val = LmdbImageDataset(tmp_path / "db", split="val", output="pil")
    sources = read_sources(tmp_path / "db", "val")
    assert len(sources) == len(val) == 9
    assert sources[0] == "val/class_0/00000.jpg"
    for index in (0, 4, 8):
        image, label = val[index]
        assert sources[index].split("/")[1] == val.classes[label]
        assert image.size == Image.open(split_folder / sources[index]).size


def test_dangling_link_non_image_files_and_empty_classes_are_listed(tmp_path):
    """A dangling symlink is skipped (not a crash), other files and empty class folders are listed as ignored."""
    src = _tree(tmp_path / "src", {"cat": 2, "dog": 2})
    (src / "empty").mkdir()
    (src / "cat" / "notes.txt").write_text("not an image")
    os.symlink(tmp_path / "gone.jpg", src / "dog" / "link.jpg")
    summary = _run(src, tmp_path / "db")
    assert summary.written == 4
    assert [(Path(s.path).name, s.reason) for s in summary.skipped] == [
        ("link.jpg", "dangling symbolic link (its target does not exist)")
    ]
    ignored = {Path(s.path).name: s.reason for s in summary.ignored}
    assert set(ignored) == {"notes.txt", "empty"}
    assert "empty class folder" in ignored["empty"]
    assert read_meta(tmp_path / "db")["classes"] == ["cat", "dog"]
    text = summary.format()
    assert "link.jpg: dangling symbolic link" in text
    assert "ignored" in text
    assert "notes.txt: not an image file name" in text
    with pytest.raises(ConversionError, match="strict"):
        _run(src, tmp_path / "strict", strict=True)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_image_over_pillows_size_limit_is_skipped_with_the_way_to_allow_it(tmp_path, monkeypatch, workers):
    """A file over Pillow's decompression-bomb limit is skipped and listed, not a traceback that stops the
    conversion; the caller's ``PIL.Image.MAX_IMAGE_PIXELS`` reaches the pool's workers, so raising it lets it in."""
    src = _tree(tmp_path / "src", {"cat": 2, "dog": 2})
    _save(src / "cat" / "huge.jpg", width=100, height=100)  # 10,000 pixels; the others 48 x 32 = 1,536
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # Pillow refuses more than twice this
    summary = _run(src, tmp_path / "db", num_workers=workers)
    assert summary.written == 4
    ((path, reason),) = [(Path(s.path).name, s.reason) for s in summary.skipped]
    assert path == "huge.jpg"
    assert reason.startswith("too large to open safely (Image size (10000 pixels) exceeds limit of 4000 pixels")
    assert "raise `PIL.Image.MAX_IMAGE_PIXELS`" in reason
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert _run(src, tmp_path / "db", num_workers=workers, force=True).written == 5


def test_a_class_missing_from_train_is_kept_with_a_warning_naming_it(tmp_path):
    """A class folder with images in val or test but none in train is kept, with one warning naming it, its splits
    and the closest train class (a misspelled folder); classes every split shares, or only train has, are silent."""
    layout = {"train/cat": 1, "train/dog": 1, "train/bird": 1, "val/cat": 1, "test/cat": 1, "test/dgo": 1, "val/fox": 1}
    src = _tree(tmp_path / "src", layout)
    with pytest.warns(UserWarning, match="none in train") as record:
        _run(src, tmp_path / "db")
    (message,) = [str(w.message) for w in record if "none in train" in str(w.message)]
    assert message == (
        f"`src` {str(src)!r}: 2 class(es) have images in another split but none in train, so the model never learns"
        " them: 'dgo' (in test; did you mean 'dog'?), 'fox' (in val). They are kept as classes; rename or move the"
        " folders if that is a mistake."
    )
    assert read_meta(tmp_path / "db")["classes"] == ["bird", "cat", "dgo", "dog", "fox"]


def test_replacing_another_sources_database_needs_force(split_folder, tmp_path):
    """Converting folder B onto folder A's database is refused (``DestinationError``), unless ``force``."""
    from lightning_fastdata import DestinationError

    other = _tree(tmp_path / "other", {"a": 1, "b": 1})
    _run(split_folder, tmp_path / "db")
    with pytest.raises(DestinationError, match=r"converted from .*src.*refusing to replace it.*--force"):
        _run(other, tmp_path / "db")
    assert read_meta(tmp_path / "db")["source"]["path"] == str(split_folder)
    assert _run(other, tmp_path / "db", force=True).written == 2
    assert read_meta(tmp_path / "db")["classes"] == ["a", "b"]


def test_tilde_is_expanded(tmp_path, monkeypatch):
    """``~`` in ``src`` and ``dst`` (convert) and in a database path (LmdbImageDataset, read_meta) is the home."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _tree(tmp_path / "src", {"a": 1, "b": 1})
    assert convert("~/src", "~/db", num_workers=0, progress=False).written == 2
    assert (tmp_path / "db" / "data.mdb").is_file()
    assert len(LmdbImageDataset("~/db")) == 2
    assert read_meta("~/db")["splits"]["train"]["length"] == 2


@pytest.mark.parametrize("kind", ["csv", "json"])
def test_list_file_source(tmp_path, kind):
    """A ``path,label[,split]`` list (CSV or JSON) converts: names become classes, paths are stored as listed."""
    from lightning_fastdata import read_sources

    _tree(tmp_path / "images", {"x": 4})
    rows = [
        {"path": "images/x/0.jpg", "label": "dog", "split": "train"},
        {"path": "images/x/1.jpg", "label": "cat", "split": "Train"},
        {"path": "images/x/2.jpg", "label": "dog", "split": "validation"},
        {"path": "images/x/missing.jpg", "label": "cat", "split": "train"},
    ]
    src = tmp_path / f"list.{kind}"
    if kind == "csv":
        src.write_text("path,label,split\n" + "".join(f"{r['path']},{r['label']},{r['split']}\n" for r in rows))
    else:
        src.write_text(json.dumps(rows))
    summary = _run(src, tmp_path / "db")
    assert summary.splits == {"train": 2, "val": 1}
    assert [Path(s.path).name for s in summary.skipped] == ["missing.jpg"]
    train = LmdbImageDataset(tmp_path / "db")
    assert train.classes == ["cat", "dog"]
    assert train.targets == [1, 0]
    assert read_sources(tmp_path / "db", "train") == ["images/x/0.jpg", "images/x/1.jpg"]


def test_a_json_list_file_nested_too_deeply_is_a_clear_error(tmp_path):
    """A JSON list file nested 200,000 deep (``json.loads`` raises ``RecursionError``) is a ``SourceLayoutError``."""
    src = tmp_path / "list.json"
    src.write_text("[" * 200_000)
    with pytest.raises(SourceLayoutError, match="is not valid JSON: its arrays and objects nest too deeply to parse"):
        _run(src, tmp_path / "db")


def test_list_file_numeric_labels_and_missing_columns(tmp_path):
    """Integer labels keep their value as the class index; a list without ``label`` is a clear error."""
    _tree(tmp_path / "images", {"x": 2})
    src = tmp_path / "list.csv"
    src.write_text("path,label\nimages/x/0.jpg,2\nimages/x/1.jpg,0\n")
    _run(src, tmp_path / "db")
    train = LmdbImageDataset(tmp_path / "db")
    assert train.classes == ["0", "1", "2"]
    assert train.targets == [2, 0]
    src.write_text("file,class\nimages/x/0.jpg,2\n")
    with pytest.raises(SourceLayoutError, match="no label or path column; its columns are"):
        _run(src, tmp_path / "db2")


@pytest.mark.parametrize("label", ["3000000000", str(2**20 + 2)])
def test_a_list_files_class_index_is_checked_before_a_class_is_made_for_each(tmp_path, label):
    """A numeric label far beyond the rows (a hostile or mistyped list) is one error, not billions of class names."""
    _tree(tmp_path / "images", {"x": 2})
    src = tmp_path / "list.csv"
    src.write_text(f"path,label\nimages/x/0.jpg,0\nimages/x/1.jpg,{label}\n")
    with pytest.raises(SourceLayoutError, match=rf"the label {label} read as a class index makes [\d,]+ classes for 2"):
        _run(src, tmp_path / "db")
    assert not (tmp_path / "db").exists()


def test_a_list_files_digits_that_are_not_ascii_are_class_names(tmp_path):
    """Labels such as ``²`` (a digit to ``str.isdigit``, not to ``int``) are class names, not a crash."""
    _tree(tmp_path / "images", {"x": 2})
    src = tmp_path / "list.csv"
    src.write_text("path,label\nimages/x/0.jpg,\u00b2\nimages/x/1.jpg,1\n", encoding="utf-8")
    _run(src, tmp_path / "db")
    assert LmdbImageDataset(tmp_path / "db").classes == ["1", "\u00b2"]


@pytest.mark.parametrize(
    ("labels", "classes", "targets"), [("cat,,dog", ["cat", "dog"], [0, 1]), ("0,,1", ["0", "1"], [0, 1])]
)
def test_a_list_row_without_a_label_is_skipped_and_makes_no_class(tmp_path, labels, classes, targets):
    """A row with an empty label is skipped and listed; it adds no class ``''`` that would shift every label."""
    _tree(tmp_path / "images", {"x": 3})
    src = tmp_path / "list.csv"
    src.write_text("path,label\n" + "".join(f"images/x/{n}.jpg,{label}\n" for n, label in enumerate(labels.split(","))))
    summary = _run(src, tmp_path / "db")
    assert [s.reason for s in summary.skipped] == ["row without a path or a label"]
    train = LmdbImageDataset(tmp_path / "db")
    assert (train.classes, train.targets) == (classes, targets)


def test_an_image_listed_twice_with_the_same_label_is_converted_once_and_refused_under_strict(tmp_path):
    """The same path twice (``./`` and ``x/../`` spellings too) with the same label: one record, the later rows
    skipped and listed naming the first; ``strict=True`` refuses them as every row it cannot convert as listed."""
    _tree(tmp_path / "images", {"x": 2})
    src = tmp_path / "list.csv"
    rows = ["images/x/0.jpg,cat", "images/x/1.jpg,dog", "./images/x/0.jpg,cat", "images/x/../x/0.jpg,cat"]
    src.write_text("path,label\n" + "\n".join(rows) + "\n")
    result = _run(src, tmp_path / "db")
    assert (result.written, LmdbImageDataset(tmp_path / "db").targets) == (2, [0, 1])
    again = "again, as in row 1, with the same target: converted once; remove the row"
    assert [(Path(s.path).name, s.reason) for s in result.skipped] == [
        ("list.csv row 3", f"'./images/x/0.jpg' {again}"),
        ("list.csv row 4", f"'images/x/../x/0.jpg' {again}"),
    ]
    assert "list.csv row 3: './images/x/0.jpg' again, as in row 1" in result.format()
    with pytest.raises(ConversionError, match=r"2 input\(s\) could not be converted and `strict` is set.*row 3"):
        _run(src, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize(
    ("header", "rows", "targets", "match"),
    [
        ("path,label", ["0.jpg,cat", "1.jpg,dog", "0.jpg,dog"], None,
         r"`src` '.*list.csv': '0.jpg' is listed twice with different labels: row 1 \(label 'cat'\) and row 3 \(label"
         r" 'dog'\)\. An image has one target: keep one row per image, or name `cat\|dog` in one row and pass"
         r" `--targets multilabel`\.$"),
        ("path,label", ["0.jpg,cat|dog", "0.jpg,cat"], "multilabel",
         r"row 1 \(label 'cat\|dog'\) and row 2 \(label 'cat'\)\. An image has one target: keep one row per image, or"
         r" name its classes in one row\.$"),
        ("path,x,y", ["0.jpg,1,2", "0.jpg,1,3"], "float", r"row 1 \(x '1', y '2'\) and row 2 \(x '1', y '3'\)"),
        ("path,label,split", ["0.jpg,cat,train", "1.jpg,cat,train", "0.jpg,cat,val", "1.jpg,dog,val"], None,
         r"'0.jpg' is listed in split 'train' \(row 1\) and in split 'val' \(row 3\): the model would be evaluated"
         r" on an image it trained on\. Keep each image in one split: remove one of the rows\. \(1 more row\(s\)"
         r" conflict with an earlier row of their image\.\)$"),
        ("path,split", ["0.jpg,train", "0.jpg,test"], "none", "listed in split 'train' .row 1. and in split 'test'"),
    ],
)  # fmt: skip
def test_an_image_listed_twice_with_different_labels_or_splits_is_refused(tmp_path, header, rows, targets, match):
    """The same path with another label (values, classes), or in two splits (a leak), is a ``SourceLayoutError``
    naming the path, both rows and what differs, and how to fix it; nothing is written."""
    _tree(tmp_path, {".": 2})
    src = tmp_path / "list.csv"
    src.write_text(header + "\n" + "\n".join(rows) + "\n")
    with pytest.raises(SourceLayoutError, match=match):
        _run(src, tmp_path / "db", targets=targets)
    assert not (tmp_path / "db").exists()


class _HfLike:
    """A duck-typed stand-in for a Hugging Face ``datasets.Dataset``: mapping rows and a ``ClassLabel`` feature."""

    def __init__(self, rows: list[dict], names: list[str]) -> None:
        self.rows = rows
        self.features = {"image": object(), "label": type("ClassLabel", (), {"names": names})()}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def test_convert_dataset_hugging_face_stand_in(tmp_path):
    """Rows as mappings with a ``ClassLabel``: classes from the feature, bytes stored, ``validation`` -> ``val``."""
    from lightning_fastdata import read_sources

    pil_rows = [{"image": Image.fromarray(_smooth(40, 30, i)), "label": i % 2} for i in range(3)]
    byte_rows = [{"image": {"bytes": _jpeg_bytes(seed=7), "path": None}, "label": 1}]
    splits = {"train": _HfLike(pil_rows, ["ant", "bee"]), "validation": _HfLike(byte_rows, ["ant", "bee"])}
    summary = convert_dataset(splits, tmp_path / "db", num_workers=0, progress=False)
    assert summary.splits == {"train": 3, "val": 1}
    val = LmdbImageDataset(tmp_path / "db", split="val")
    assert val.classes == ["ant", "bee"]
    _header, data = val.read_record(0)
    assert bytes(data) == _jpeg_bytes(seed=7)  # a small JPEG is stored untouched
    assert read_sources(tmp_path / "db", "train") == ["0", "1", "2"]


def test_convert_dataset_real_hugging_face_dataset(tmp_path):
    """A real ``datasets.Dataset`` with ``Image`` and ``ClassLabel`` features converts (skipped without datasets)."""
    datasets = pytest.importorskip("datasets")

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["ant", "bee"])})
    images = [Image.fromarray(_smooth(40, 30, i)) for i in range(4)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 1, 0]}, features=features)
    summary = convert_dataset(ds.train_test_split(test_size=0.5, seed=0), tmp_path / "db", progress=False)
    assert summary.splits == {"train": 2, "test": 2}
    test = LmdbImageDataset(tmp_path / "db", split="test")
    assert test.classes == ["ant", "bee"]
    assert sorted(test.targets + LmdbImageDataset(tmp_path / "db").targets) == [0, 0, 1, 1]


_FORK_AFTER_OPENCV = """
import sys
import numpy as np
from lightning_fastdata import convert, make_image_folder
from lightning_fastdata._cv import cv2

assert cv2.getNumThreads() == 1, cv2.getNumThreads()  # OpenCV's own pool is off once the package is imported
big = np.random.default_rng(0).integers(0, 255, (3000, 3000, 3), dtype=np.uint8)
for _ in range(3):  # with OpenCV's own thread pool on, this starts it in the parent
    cv2.resize(big, (1000, 1000), interpolation=cv2.INTER_AREA)
src = make_image_folder(sys.argv[1] + "/src", num_classes=2, train_per_class=6, val_per_class=0, min_size=300,
                        max_size=400, num_workers=1)
summary = convert(src, sys.argv[1] + "/db", short_side=64, num_workers=2, progress=False)
print("converted", summary.written)
"""


@pytest.mark.slow
def test_forked_conversion_workers_after_opencv_use_do_not_deadlock(tmp_path):
    """A fork pool started after the parent ran OpenCV converts: importing the package turns OpenCV's pool off.

    A pool thread holding its lock at the fork would deadlock the child's first OpenCV call (seen once in this suite,
    when a conversion worker called ``cv2.setNumThreads`` after an in-process conversion had run OpenCV).
    """
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_OPENCV, str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "converted 12" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# Issue 20: layouts a new user tried, and conversions interrupted, killed or watched while they run
# ---------------------------------------------------------------------------------------------------------------


def test_classes_nested_one_level_deeper_are_refused_naming_the_path_to_pass(tmp_path):
    """``root/dataset/<class>/<image>`` is not read as one class ``dataset``: the error names the folder to pass."""
    root = tmp_path / "root"
    for cls in ("cat", "dog", "fox"):
        _save(root / "dataset" / cls / "a.jpg")
    with pytest.raises(SourceLayoutError, match="nested one level deeper") as info:
        _run(root, tmp_path / "db")
    message = str(info.value)
    assert f"Pass {str(root / 'dataset')!r} as `src`" in message
    assert "'cat', 'dog', 'fox'" in message
    assert not (tmp_path / "db").exists()
    assert _run(root / "dataset", tmp_path / "db").splits == {"train": 3}  # the path it names converts

    wrapped = tmp_path / "wrapped"  # a root of splits one level too deep: wrapped/dataset/{train,val}/<class>/
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            _save(wrapped / "dataset" / split / cls / "a.jpg")
    with pytest.raises(SourceLayoutError, match=f"Pass {str(wrapped / 'dataset')!r} as `src`"):
        _run(wrapped, tmp_path / "db2")


def test_class_folders_with_sub_folders_still_convert(tmp_path):
    """Two or more classes whose images lie in sub-folders are a valid ImageFolder; so is one class with images."""
    root = tmp_path / "root"
    for cls in ("cat", "dog"):
        _save(root / cls / "2024" / "a.jpg")
        _save(root / cls / "2025" / "b.jpg")
    assert _run(root, tmp_path / "db").splits == {"train": 4}
    single = tmp_path / "single"
    _save(single / "only" / "a.jpg")
    _save(single / "only" / "sub" / "b.jpg")
    assert _run(single, tmp_path / "db1").splits == {"train": 2}


def test_a_misspelled_split_warns_naming_the_closest_known_one(tmp_path):
    """A CSV row with split ``trian`` warns, naming ``trian`` and ``train``; a custom split name stays silent."""
    _save(tmp_path / "a.jpg")
    _save(tmp_path / "b.jpg", seed=1)
    _save(tmp_path / "c.jpg", seed=2)
    listing = tmp_path / "list.csv"
    listing.write_text("path,label,split\na.jpg,cat,trian\nb.jpg,dog,train\nc.jpg,cat,holdout\n")
    with pytest.warns(UserWarning, match=r"1 row\(s\) with split 'trian'.*Did you mean 'train'\?") as record:
        summary = _run(listing, tmp_path / "db")
    assert summary.splits == {"trian": 1, "train": 1, "holdout": 1}  # stored as given, as documented
    assert not [w for w in record if "holdout" in str(w.message)]

    root = tmp_path / "root"  # the same for a split folder
    _save(root / "train" / "cat" / "a.jpg")
    _save(root / "vall" / "cat" / "a.jpg")
    with pytest.warns(UserWarning, match=r"the split folder 'vall'.*Did you mean 'val'\?"):
        _run(root, tmp_path / "db2")


def test_a_dst_under_a_file_is_a_destination_error(split_folder, tmp_path):
    """A ``dst`` whose parent is a file: ``DestinationError`` naming that file, and nothing written."""
    blocker = tmp_path / "afile"
    blocker.write_text("a file")
    for dst in (blocker / "db.lmdb", blocker / "deeper" / "db.lmdb"):
        with pytest.raises(DestinationError, match=f"{str(blocker)!r} is a file, not a folder"):
            _run(split_folder, dst)
    assert blocker.read_text() == "a file"


def test_a_finished_conversion_leaves_no_lock_file(split_folder, tmp_path):
    """The lock file beside ``dst`` exists only while a conversion runs."""
    dst = tmp_path / "db"
    _run(split_folder, dst)
    _run(split_folder, dst)  # up to date
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]


def test_a_planted_lock_file_is_refused_and_never_written_through(split_folder, tmp_path, monkeypatch):
    """A ``.DST.lock`` that is a symbolic link (to a file the lock would truncate and overwrite), a folder, or another
    user's file (where there is no database to reuse) stops the conversion with one line naming it and, for another
    user's, its owner; the file it points to, or the other user's lock file, is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    dst = tmp_path / "out" / "db.lmdb"
    dst.parent.mkdir()
    lock = store_format.lock_path(dst)
    lock.symlink_to(victim)
    with pytest.raises(DestinationError, match="is a symbolic link, where this package writes its own file") as info:
        _run(split_folder, dst)
    assert "\n" not in str(info.value)
    assert str(lock) in str(info.value)
    assert victim.read_text() == "precious\n"
    lock.unlink()
    lock.mkdir()
    with pytest.raises(DestinationError, match="is not a regular file"):
        _run(split_folder, dst)
    lock.rmdir()
    lock.write_text("")
    with monkeypatch.context() as patched:
        patched.setattr(os, "geteuid", lambda: os.getuid() + 1)  # as if another user had made it
        with pytest.raises(DestinationError, match=_foreign_lock(lock)) as info:
            _run(split_folder, dst)
    assert "\n" not in str(info.value)
    assert (lock.read_text(), dst.exists()) == ("", False)
    assert _run(split_folder, dst).written == 33
    assert not lock.exists()
    assert victim.read_text() == "precious\n"


def _foreign_lock(lock: Path) -> str:
    """What the error says of the lock file ``lock`` of another user (this process's real uid, its euid patched)."""
    return rf"its lock file '{re.escape(str(lock))}' belongs to another user \((\w+, )?uid {os.getuid()}\)"


def test_a_database_another_user_converted_is_reused_beside_their_lock_file(split_folder, tmp_path, monkeypatch):
    """A complete database with its converter's lock file beside it, both another user's (a run of theirs stopped,
    or under way): converting it again with the same settings reuses it, never writing the lock file; with other
    settings, one line names the lock file, its owner and that no process holds it."""
    dst = tmp_path / "shared" / "db.lmdb"
    _run(split_folder, dst, short_side=32)
    lock = store_format.lock_path(dst)
    record = '{"pid": 1, "host": "their-node"}'
    lock.write_text(record)
    with monkeypatch.context() as patched:
        patched.setattr(os, "geteuid", lambda: os.getuid() + 1)  # as if another user had made them
        again = _run(split_folder, dst, short_side=32)
        with pytest.raises(DestinationError, match=_foreign_lock(lock)) as info:
            _run(split_folder, dst, short_side=48)
    assert again.up_to_date
    assert again.written == 33
    assert "holds a database that is out of date" in str(info.value)
    assert "held by no process" in str(info.value)
    assert "\n" not in str(info.value)
    assert lock.read_text() == record
    assert read_meta(dst)["encoding"]["short_side"] == 32


# A conversion through the command line whose pool workers block on their first image, until the test interrupts or
# kills it; the file `ready` appears once a worker blocks (the pool inherits the patch through fork). Ctrl-C is
# handled as in a terminal even where the suite runs with SIGINT ignored (a shell's background job), which the child
# would inherit
_BLOCKED_CONVERSION = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from lightning_fastdata.cli import main
    from lightning_fastdata.store import encode

    signal.signal(signal.SIGINT, signal.default_int_handler)

    ready = Path(sys.argv[1])

    def blocked(source, opts):
        ready.touch()
        time.sleep(600)

    encode._encode_image = blocked
    sys.exit(main(sys.argv[2:]))
    """
)


@contextlib.contextmanager
def _blocked_conversion(src: Path, dst: Path, tmp_path: Path):
    """A ``lightning-fastdata convert SRC DST --workers 2`` process, yielded once its metadata is written."""
    ready = tmp_path / "ready"
    cmd = [sys.executable, "-c", _BLOCKED_CONVERSION, str(ready), "convert", str(src), str(dst), "--workers", "2"]
    proc = subprocess.Popen(
        [*cmd, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        partial = store_format.partial_path(dst)
        while not (ready.exists() and store_format.converter_of(dst) and _has_incomplete_meta(partial)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the conversion never started"
            time.sleep(0.01)
        yield proc
    finally:
        if proc.returncode is None:  # the test did not end it itself
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)


def _has_incomplete_meta(partial: Path) -> bool:
    if not (partial / store_format.DATA_FILE).exists():
        return False
    env = lmdb.open(str(partial), readonly=True, lock=False, subdir=True)  # a private handle: not the shared one
    try:
        with env.begin() as txn:
            return txn.get(store_format.META_KEY) is not None
    finally:
        env.close()


def _two_class_source(root: Path) -> Path:
    for cls in ("cat", "dog"):
        for n in range(3):
            _save(root / cls / f"{n}.jpg", seed=n)
    return root


@pytest.mark.slow
def test_ctrl_c_during_convert_prints_one_line_not_worker_tracebacks(tmp_path):
    """SIGINT to the process group of ``convert --workers 2``: exit 130, one line on stderr, nothing left."""
    src, dst = _two_class_source(tmp_path / "src"), tmp_path / "out" / "db.lmdb"
    with _blocked_conversion(src, dst, tmp_path) as proc:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        "interrupted: nothing was published; run the same command again to start over"
    ], err
    assert sorted(p.name for p in dst.parent.iterdir()) == []


@pytest.mark.slow
def test_a_running_conversion_is_named_and_left_alone_by_clean(tmp_path):
    """Opening ``.X.partial`` while a conversion writes it names the converting process; ``--clean`` keeps it."""
    from lightning_fastdata.cli import main

    src, dst = _two_class_source(tmp_path / "src"), tmp_path / "out" / "db.lmdb"
    partial = store_format.partial_path(dst)
    with _blocked_conversion(src, dst, tmp_path) as proc:
        with pytest.raises(DatasetFormatError, match=f"is being converted by process {proc.pid} ") as info:
            LmdbImageDataset(partial)
        assert f"Wait for it, then open {str(dst)!r}" in str(info.value)
        assert main(["convert", "--clean", str(dst.parent)]) == 0
        assert partial.is_dir()
        assert store_format.lock_path(dst).is_file()
        assert proc.poll() is None


@pytest.mark.slow
def test_a_killed_conversion_is_reported_and_cleaned_by_convert_clean(tmp_path, capsys, caplog):
    """After SIGKILL the stale working copy is named as left by a dead converter, reported by the next conversion in
    its folder, and removed (with its lock file) by ``convert --clean``; complete databases stay."""
    from lightning_fastdata.cli import main

    src, dst = _two_class_source(tmp_path / "src"), tmp_path / "out" / "db.lmdb"
    partial = store_format.partial_path(dst)
    with _blocked_conversion(src, dst, tmp_path) as proc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert partial.is_dir()
    with pytest.raises(DatasetFormatError, match="left by a converter that is no longer running") as info:
        LmdbImageDataset(partial)
    assert f"lightning-fastdata convert --clean {str(dst.parent)!r}" in str(info.value)

    other = dst.parent / "other.lmdb"
    with caplog.at_level("WARNING", logger="lightning_fastdata.store.writer"):
        _run(src, other)
    assert "1 incomplete conversion(s) left by converters that are no longer running" in caplog.text
    assert f".db.lmdb.partial. Remove them with `lightning-fastdata convert --clean {dst.parent}`" in caplog.text

    assert main(["convert", "--clean", str(dst.parent)]) == 0
    out = capsys.readouterr().out
    assert f"removed {partial} (" in out
    assert f"removed {store_format.lock_path(dst)}, the lock file" in out
    assert sorted(p.name for p in dst.parent.iterdir()) == ["other.lmdb"]
    assert len(LmdbImageDataset(other)) == 6
    assert main(["convert", "--clean", str(dst.parent)]) == 0
    assert capsys.readouterr().out.startswith("nothing to clean in")


def test_clean_puts_back_a_database_moved_aside_by_a_killed_replacement(split_folder, tmp_path):
    """A ``.X.old`` whose ``X`` is missing (killed between the two renames of a replacement) is restored, not lost."""
    from lightning_fastdata.store.leftovers import clean_stale_conversions

    dst = tmp_path / "db"
    _run(split_folder, dst)
    os.replace(dst, tmp_path / ".db.old")
    assert clean_stale_conversions(tmp_path) == [
        f"restored {dst} from .db.old, left by a conversion interrupted while replacing it"
    ]
    assert len(LmdbImageDataset(dst)) == 24


def test_the_package_exports_the_new_homes():
    """The public API names the objects in ``store``; nothing imported from the package warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lightning_fastdata.convert is conversion.convert
        assert lightning_fastdata.convert_dataset is conversion.convert_dataset
        assert lightning_fastdata.LmdbImageDataset is reader.LmdbImageDataset
        assert lightning_fastdata.read_meta is store_environments.read_meta
        assert lightning_fastdata.read_sources is store_environments.read_sources
        assert lightning_fastdata.SkippedFile is summary.SkippedFile


SHARED = ("short_side", "quality", "keep_original", "encoding", "num_workers", "strict", "force", "progress")


@pytest.mark.parametrize("name", [*SHARED, "initial_map_size"])
def test_convert_and_convert_dataset_share_each_option(name):
    """The shared options have one default, one type and one description, shown in full by both functions."""
    one, other = inspect.signature(conversion.convert), inspect.signature(conversion.convert_dataset)
    assert one.parameters[name].default == other.parameters[name].default
    assert one.parameters[name].annotation == other.parameters[name].annotation
    entry = next(line for line in conversion._OPTIONS_DOC.splitlines() if line.startswith(f"{name}: "))
    for func in (conversion.convert, conversion.convert_dataset):
        dst = next(line for line in func.__doc__.splitlines() if line.lstrip().startswith("dst: "))
        indent = dst[: len(dst) - len(dst.lstrip())]  # 8 spaces, or 4 where Python 3.13 dedents docstrings
        assert f"\n{indent}{entry}\n" in func.__doc__
        assert "{options}" not in func.__doc__
        assert "as in :func:`convert`" not in func.__doc__
