from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
import stat
import zlib
from pathlib import Path
from typing import Any

import cv2
import hostile
import lmdb
import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_jpeg

from lightning_fastdata import (
    CorruptRecordError,
    DatasetFormatError,
    LmdbImageDataset,
    convert_dataset,
    read_meta,
)
from lightning_fastdata.store import decoding
from lightning_fastdata.store import format as store_format
from lightning_fastdata.store.format import ENCODING_JPEG, ENCODING_PNG, pack_record, record_key


def _tiny_database(dst: Path, n: int, seed: int = 0, classes: tuple[str, ...] = ("a", "b", "c")) -> Path:
    """A database of ``n`` small random images (8-16 px) converted in this process."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        height, width = (int(v) for v in rng.integers(8, 17, size=2))
        samples.append((Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)), i % len(classes)))
    convert_dataset(samples, dst, classes=list(classes), num_workers=0, progress=False)
    return dst


def _put(path: Path, items: dict[bytes, bytes | None]) -> None:
    """Write (or delete, for ``None``) raw LMDB values; call before this process opens ``path`` for reading."""
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, value in items.items():
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
    env.close()


def _jpeg(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="JPEG")
    return out.getvalue()


def _checksum(image: torch.Tensor) -> int:
    return zlib.crc32(image.numpy().tobytes())


# ---------------------------------------------------------------------------------------------------------------
# ImageFolder compatibility and outputs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "val"])
def test_matches_torchvision_image_folder(split_folder, database, split):
    """``classes``, ``class_to_idx``, ``targets`` and the sample order match torchvision's ``ImageFolder``."""
    reference = ImageFolder(str(split_folder / split))
    ds = LmdbImageDataset(database, split)
    assert ds.classes == reference.classes
    assert ds.class_to_idx == reference.class_to_idx
    assert ds.targets == reference.targets
    assert len(ds) == len(reference)
    assert [ds[i][1] for i in range(len(ds))] == [label for _, label in reference.samples]
    assert ds.class_counts == np.bincount(reference.targets, minlength=len(reference.classes)).tolist()


def test_getitem_gives_uint8_chw_tensors(database):
    """The default output is a ``uint8`` tensor of shape ``(3, H, W)`` and an ``int`` label."""
    ds = LmdbImageDataset(database, "train")
    for i in range(len(ds)):
        image, label = ds[i]
        header, _ = ds.read_record(i)
        assert isinstance(image, torch.Tensor)
        assert image.dtype == torch.uint8
        assert tuple(image.shape) == (3, header.height, header.width)
        assert type(label) is int
        assert label == header.label


def test_pil_output_matches_tensor_output(database):
    """``output="pil"`` gives RGB PIL images with the same pixels as the tensor output (within decoder rounding)."""
    tensors = LmdbImageDataset(database, "val")
    pils = LmdbImageDataset(database, "val", output="pil")
    for i in range(len(tensors)):
        image, label = pils[i]
        assert isinstance(image, Image.Image)
        assert image.mode == "RGB"
        expected, expected_label = tensors[i]
        assert label == expected_label
        assert image.size == (expected.shape[2], expected.shape[1])
        diff = np.abs(np.asarray(image, dtype=np.int16) - expected.permute(1, 2, 0).numpy().astype(np.int16))
        assert diff.max() <= 3


def test_encoded_output_decodes_to_the_same_tensor(database):
    """``output="encoded"`` gives the stored bytes as a 1-D ``uint8`` tensor that ``decode_jpeg`` decodes."""
    tensors = LmdbImageDataset(database, "train")
    encoded = LmdbImageDataset(database, "train", output="encoded")
    for i in range(len(encoded)):
        data, label = encoded[i]
        assert data.dtype == torch.uint8
        assert data.dim() == 1
        assert bytes(data.numpy()) == encoded.read_record(i)[1]
        expected, expected_label = tensors[i]
        assert label == expected_label
        assert torch.equal(decode_jpeg(data, mode=ImageReadMode.RGB), expected)


def test_transforms_are_applied(database):
    """``transform`` gets the image and ``target_transform`` the label."""
    ds = LmdbImageDataset(
        database, "val", transform=lambda image: image.float() / 255, target_transform=lambda label: label + 10
    )
    image, label = ds[0]
    assert image.dtype == torch.float32
    assert 0.0 <= float(image.min()) <= float(image.max()) <= 1.0
    assert label == LmdbImageDataset(database, "val").targets[0] + 10


def test_negative_index_and_out_of_range(database):
    """Negative indices count from the end; anything outside ``[-len, len)`` raises ``IndexError``."""
    ds = LmdbImageDataset(database, "val")
    n = len(ds)
    last, last_label = ds[n - 1]
    image, label = ds[-1]
    assert torch.equal(image, last)
    assert label == last_label
    assert torch.equal(ds[-n][0], ds[0][0])
    for index in (n, n + 5, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            ds[index]


def test_iteration_stops_at_the_end(database):
    """Iterating the dataset (as Python does via ``IndexError``) yields exactly ``len`` samples."""
    ds = LmdbImageDataset(database, "val")
    assert len(list(ds)) == len(ds) == 9


def test_repr_and_metadata_attributes(database):
    """``repr`` names the path, split and length; the metadata attributes describe the database."""
    ds = LmdbImageDataset(database, "val")
    assert str(database.absolute()) in repr(ds)
    assert "split='val'" in repr(ds)
    assert "len=9" in repr(ds)
    assert ds.splits == ["train", "val"]
    assert ds.encoding == read_meta(database)["encoding"]


# ---------------------------------------------------------------------------------------------------------------
# Opening errors
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_split_lists_the_splits(database):
    """An unknown split raises ``ValueError`` that lists the splits the database holds."""
    with pytest.raises(ValueError, match=re.escape("'test' is not in")) as info:
        LmdbImageDataset(database, "test")
    assert "['train', 'val']" in str(info.value)


def test_unknown_output_raises(database):
    """An unknown ``output`` raises ``ValueError``."""
    with pytest.raises(ValueError, match="`output` must be"):
        LmdbImageDataset(database, output="numpy")  # type: ignore[arg-type]


def test_missing_path_raises_file_not_found(tmp_path):
    """A path that does not exist raises ``FileNotFoundError`` that says how to create it."""
    with pytest.raises(FileNotFoundError, match="lightning-fastdata convert"):
        LmdbImageDataset(tmp_path / "missing.lmdb")


def test_plain_directory_raises_format_error(split_folder, tmp_path):
    """A plain directory (an image folder, an empty folder) raises ``DatasetFormatError``."""
    with pytest.raises(DatasetFormatError, match="not a lightning_fastdata database"):
        LmdbImageDataset(split_folder)
    with pytest.raises(DatasetFormatError):
        LmdbImageDataset(tmp_path)


def test_incomplete_database_raises_format_error(database_copy):
    """A database whose metadata says ``complete: false`` is refused."""
    env = lmdb.open(str(database_copy), map_size=1 << 26)
    with env.begin(write=True) as txn:
        meta = store_format.load_meta(txn.get(store_format.META_KEY), database_copy)
        txn.put(store_format.META_KEY, store_format.dump_meta({**meta, "complete": False}))
    env.close()
    with pytest.raises(DatasetFormatError, match="incomplete"):
        LmdbImageDataset(database_copy)


def test_train_and_val_share_one_environment(database):
    """Two datasets of one database open in one process and share its environment."""
    train, val = LmdbImageDataset(database, "train"), LmdbImageDataset(database, "val")
    image_train, _ = train[0]
    image_val, _ = val[0]
    assert image_train.shape[0] == image_val.shape[0] == 3
    assert train._environment() is val._environment()
    assert len(train) + len(val) == 33


# ---------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers_yield_every_sample_once(database, context):
    """Two DataLoader workers (fork or spawn) together yield every sample exactly once, with the right pixels."""
    ds = LmdbImageDataset(database, "train")
    expected = sorted((label, _checksum(image)) for image, label in ds)  # the parent has opened the environment
    loader = DataLoader(ds, batch_size=None, shuffle=True, num_workers=2, multiprocessing_context=context)
    got = sorted((int(label), _checksum(image)) for image, label in loader)
    assert got == expected
    assert len(got) == len(ds)


def test_dataset_pickles_without_its_environment(database):
    """A used dataset pickles without its LMDB environment and the copy still reads the same samples."""
    ds = LmdbImageDataset(database, "val")
    first, label = ds[0]
    assert ds._env is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._env is None
    assert clone._pid is None
    assert ds._env is not None  # pickling does not disturb the original
    image, clone_label = clone[0]
    assert torch.equal(image, first)
    assert clone_label == label
    assert clone.targets == ds.targets
    fresh = pickle.loads(pickle.dumps(ds))  # its decoder and target reader work for it, not for the original
    assert fresh.targets == ds.targets
    assert fresh._env is not None  # the targets were read through its own environment
    fresh.max_pixels = 1
    with pytest.raises(CorruptRecordError, match="over `max_pixels`"):
        fresh[0]
    assert ds.max_pixels == decoding.DEFAULT_MAX_PIXELS
    assert torch.equal(ds[0][0], first)


def test_read_only_copy_is_read_without_writing(database, tmp_path):
    """A read-only copy reads fine: no ``lock.mdb`` is created and no file in it changes."""
    copy = tmp_path / "ro.lmdb"
    shutil.copytree(database, copy)
    (copy / "lock.mdb").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    paths = [copy, *copy.iterdir()]
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in paths}
    for p in paths:
        p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        for split in ("train", "val"):
            ds = LmdbImageDataset(copy, split)
            assert [label for _, label in ds] == ds.targets
        assert read_meta(copy)["complete"] is True
    finally:
        for p in paths:
            p.chmod(modes[p])
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before
    assert not (copy / "lock.mdb").exists()


def test_memory_does_not_grow_with_the_dataset(tmp_path):
    """The dataset object holds nothing per sample but one byte (which JPEGs were walked in this process): its pickle,
    which leaves that byte out, is the same size for 6 and 300 samples."""
    small = LmdbImageDataset(_tiny_database(tmp_path / "small" / "db", 6))
    large = LmdbImageDataset(_tiny_database(tmp_path / "large" / "db", 300))
    for ds in (small, large):
        for i in range(len(ds)):
            ds[i]
        assert len(ds.targets) == len(ds)

    def state(ds: LmdbImageDataset) -> dict[str, Any]:
        """The dataset's attributes, and those of the objects it hands its decodes and targets to."""
        parts = {"_decoder": ds._decoder, "_target_reader": ds._target_reader, "_targets": ds._targets}
        return {**vars(ds), **{f"{name}.{k}": v for name, part in parts.items() for k, v in vars(part).items()}}

    def sizes(ds: LmdbImageDataset) -> dict[str, int]:
        kept = state(ds).items()
        return {k: len(v) for k, v in kept if hasattr(v, "__len__") and not isinstance(v, (str, bytearray))}

    assert sizes(small) == sizes(large)
    per_sample = {k: len(v) for k, v in state(large).items() if isinstance(v, bytearray)}
    assert per_sample == {"_decoder._jpeg_checked": len(large)}  # a byte a sample, nothing else
    assert abs(len(pickle.dumps(small)) - len(pickle.dumps(large))) <= 8
    assert len(large) == 50 * len(small)


# ---------------------------------------------------------------------------------------------------------------
# Damaged databases
# ---------------------------------------------------------------------------------------------------------------


def _mutate(value: bytes, kind: int, rng: random.Random) -> bytes | None:
    """One kind of damage to a stored record (``None`` deletes it)."""
    damaged = bytearray(value)
    if kind == 1:  # flip 1-4 bytes anywhere
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
        return bytes(damaged) if damaged != value else bytes(damaged[:-1])
    if kind == 2:  # truncate
        return value[: rng.randrange(len(value))]
    if kind == 3:
        return b""
    if kind == 4:
        return None
    if kind == 5:  # one header byte
        damaged[rng.randrange(store_format.HEADER.size)] ^= rng.randrange(1, 256)
        return bytes(damaged)
    if kind == 6:  # trailing garbage
        return value + rng.randbytes(rng.randint(1, 64))
    return rng.randbytes(rng.randint(0, 2 * len(value)))  # kind 7: replaced by noise


@pytest.mark.parametrize("output", ["tensor", "pil", "encoded"])
def test_fuzzed_records_raise_only_corrupt_record_error(tmp_path, output):
    """Randomly damaged, truncated, emptied or deleted records raise ``CorruptRecordError`` naming split and index."""
    dst = _tiny_database(tmp_path / "db", 160)
    rng = random.Random(output)
    env = lmdb.open(str(dst), map_size=1 << 26)
    kinds = {}
    with env.begin(write=True) as txn:
        for index in range(160):
            kind = index % 8  # every kind of damage, and intact records (kind 0) as controls
            kinds[index] = kind
            if kind == 0:
                continue
            key = record_key("train", index)
            value = _mutate(txn.get(key), kind, rng)
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
    env.close()
    ds = LmdbImageDataset(dst, output=output)
    for index in range(len(ds)):
        if kinds[index] == 0:
            _, label = ds[index]
            assert label == index % 3
            continue
        with pytest.raises(CorruptRecordError, match=re.escape(f"split 'train' index {index} of")):
            ds[index]
        with pytest.raises(CorruptRecordError, match=re.escape(f"split 'train' index {index} of")):
            ds[index - len(ds)]  # the message names the normalized index


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_unverified_payload_damage_decodes_or_raises_corrupt_record_error(tmp_path, output):
    """With checksums off, damaged JPEG bytes either decode to the stored size or raise ``CorruptRecordError``."""
    dst = _tiny_database(tmp_path / "db", 120, seed=1)
    rng = random.Random(7)
    env = lmdb.open(str(dst), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for index in range(120):
            key = record_key("train", index)
            damaged = bytearray(txn.get(key))
            position = rng.randrange(store_format.HEADER.size, len(damaged))
            damaged[position] ^= rng.randrange(1, 256)
            txn.put(key, bytes(damaged))
    env.close()
    ds = LmdbImageDataset(dst, output=output, verify_checksums=False)
    errors, decoded = [], 0
    for index in range(len(ds)):
        header, _ = ds.read_record(index)
        try:
            image, _ = ds[index]
        except CorruptRecordError as err:
            errors.append((index, str(err)))
            continue
        size = image.size[::-1] if output == "pil" else tuple(image.shape[1:])
        assert size == (header.height, header.width)
        decoded += 1
    assert errors
    assert all(f"split 'train' index {index} of" in message for index, message in errors)
    assert decoded + len(errors) == 120


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_record_with_valid_checksum_but_garbage_bytes(database_copy, output):
    """A record that passes its checksum but holds no decodable image raises ``CorruptRecordError``."""
    _put(database_copy, {record_key("val", 1): pack_record(ENCODING_JPEG, 0, 10, 12, b"garbage")})
    ds = LmdbImageDataset(database_copy, "val", output=output)
    with pytest.raises(CorruptRecordError, match=r"split 'val' index 1 .*does not decode"):
        ds[1]
    assert ds[0][0] is not None  # the neighbours are fine
    encoded = LmdbImageDataset(database_copy, "val", output="encoded")
    assert bytes(encoded[1][0].numpy()) == b"garbage"  # the encoded output does not decode


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_record_declaring_a_huge_image_raises_corrupt_record_error(database_copy, output):
    """A JPEG whose header claims 65520x65520 pixels (a decompression bomb) raises ``CorruptRecordError``."""
    jpeg = bytearray(_jpeg(16, 12))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5 : sof + 9] = b"\xff\xf0\xff\xf0"
    _put(database_copy, {record_key("train", 0): pack_record(ENCODING_JPEG, 0, 12, 16, bytes(jpeg))})
    with pytest.raises(CorruptRecordError, match="split 'train' index 0"):
        LmdbImageDataset(database_copy, output=output)[0]


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_record_whose_image_size_differs_from_its_header(database_copy, output):
    """A valid JPEG whose size differs from the record header raises ``CorruptRecordError``."""
    _put(database_copy, {record_key("train", 2): pack_record(ENCODING_JPEG, 1, 20, 20, _jpeg(16, 12))})
    with pytest.raises(CorruptRecordError, match=re.escape("differs from the stored (20, 20)")):
        LmdbImageDataset(database_copy, output=output)[2]


def test_record_with_label_outside_the_classes(database_copy):
    """A record whose label is not a class index raises ``CorruptRecordError``."""
    _put(database_copy, {record_key("train", 3): pack_record(ENCODING_JPEG, 99, 12, 16, _jpeg(16, 12))})
    with pytest.raises(CorruptRecordError, match="label 99 is outside the 3 classes"):
        LmdbImageDataset(database_copy)[3]


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_png_records_decode(database_copy, output):
    """Records in the PNG encoding decode to RGB with their exact pixels."""
    pixels = np.random.default_rng(0).integers(0, 256, (10, 14, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    _put(database_copy, {record_key("val", 0): pack_record(ENCODING_PNG, 2, 10, 14, png.getvalue())})
    image, label = LmdbImageDataset(database_copy, "val", output=output)[0]
    assert label == 2
    array = np.asarray(image) if output == "pil" else image.permute(1, 2, 0).numpy()
    assert np.array_equal(array, pixels)


def _png(image: Image.Image, **params: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **params)
    return out.getvalue()


def _png_kinds() -> dict[str, bytes]:
    """Small PNGs of every kind of 8-bit (or less) PNG, 37 x 53 random pixels each."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (37, 53, 4), dtype=np.uint8))
    grey = Image.fromarray(rng.integers(0, 256, (37, 53), dtype=np.uint8))
    rotated = Image.Exif()
    rotated[0x0112] = 6  # EXIF orientation: rotate 90 degrees
    return {
        "RGB": _png(rgb),
        "RGBA": _png(rgba),
        "L": _png(grey),
        "LA": _png(rgba.convert("LA")),
        "P": _png(rgb.quantize(200)),
        "P with transparency": _png(rgb.quantize(100), transparency=bytes(range(100))),
        "1": _png(grey.convert("1")),
        "L of 4 bits": _png(grey, bits=4),
        "RGB with a transparent colour": _png(rgb, transparency=(1, 2, 3)),
        "RGB with an EXIF rotation": _png(rgb, exif=rotated),
    }


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
@pytest.mark.parametrize("through_a_file", [False, True])
@pytest.mark.parametrize("kind", list(_png_kinds()))
def test_png_records_decode_to_pils_rgb_pixels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, through_a_file: bool
) -> None:
    """A PNG of any 8-bit kind decodes as a tensor (OpenCV) to exactly PIL's ``convert("RGB")``: alpha and
    transparency dropped, palettes, greyscale and 1- and 4-bit samples expanded, an EXIF rotation not applied;
    from its bytes (a small PNG) and through a file in memory (a large one) alike."""
    if through_a_file:
        monkeypatch.setattr(decoding, "_PNG_COPIED_PIXELS", 0)
    png = _png_kinds()[kind]
    db = hostile.write_database(tmp_path / "db", [hostile.record(ENCODING_PNG, 0, 37, 53, png)], ["a"])
    expected = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    tensor, _ = LmdbImageDataset(db)[0]
    pil, _ = LmdbImageDataset(db, output="pil")[0]
    assert np.array_equal(tensor.permute(1, 2, 0).numpy(), expected)
    assert np.array_equal(np.asarray(pil), expected)


def test_16_bit_png_records_decode_to_their_high_byte(tmp_path: Path) -> None:
    """A 16-bit PNG decodes as a tensor to each sample's high byte, greyscale and RGB alike (PIL's own reading of a
    16-bit RGB PNG); as a PIL image it keeps PIL's pixels, whose ``convert("RGB")`` clips a greyscale one at 255."""
    rng = np.random.default_rng(0)
    grey, rgb = rng.integers(0, 65536, (37, 53), dtype=np.uint16), rng.integers(0, 65536, (37, 53, 3), dtype=np.uint16)
    ok, rgb_png = cv2.imencode(".png", np.ascontiguousarray(rgb[..., ::-1]))  # OpenCV writes BGR
    assert ok
    records = [
        hostile.record(ENCODING_PNG, 0, 37, 53, _png(Image.fromarray(grey))),
        hostile.record(ENCODING_PNG, 0, 37, 53, rgb_png.tobytes()),
    ]
    db = hostile.write_database(tmp_path / "db", records, ["a"])
    tensors, pil = LmdbImageDataset(db), LmdbImageDataset(db, output="pil")
    high = (grey >> 8).astype(np.uint8)
    assert np.array_equal(tensors[0][0].permute(1, 2, 0).numpy(), np.stack([high] * 3, axis=-1))
    assert np.array_equal(tensors[1][0].permute(1, 2, 0).numpy(), (rgb >> 8).astype(np.uint8))
    assert np.array_equal(np.asarray(pil[0][0]), np.stack([np.minimum(grey, 255).astype(np.uint8)] * 3, axis=-1))
    assert np.array_equal(np.asarray(pil[1][0]), (rgb >> 8).astype(np.uint8))


def test_a_damaged_png_is_a_clear_error_from_its_bytes_and_through_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PNG whose pixel data is cut short, or whose IDAT is damaged, is one ``CorruptRecordError`` naming the record
    either way OpenCV reads it (``cv2.imread`` given an output says nothing else of a failure but ``None``)."""
    png = _png_kinds()["RGB"]
    idat = png.index(b"IDAT")
    damaged = png[: idat + 20] + bytes(64) + png[idat + 84 :]  # deflate data overwritten; the CRC no longer matches
    records = [hostile.record(ENCODING_PNG, 0, 37, 53, bad) for bad in (png[: len(png) // 2], damaged)]
    db = hostile.write_database(tmp_path / "db", records, ["a"])
    for copied_pixels in (1 << 20, 0):
        monkeypatch.setattr(decoding, "_PNG_COPIED_PIXELS", copied_pixels)
        for index in range(2):
            with pytest.raises(CorruptRecordError, match=f"index {index} of .*: the image does not decode"):
                LmdbImageDataset(db)[index]


@pytest.mark.parametrize("labels", [None, b"\x00\x00\x00"])
def test_damaged_label_array_raises(database_copy, labels):
    """A missing or wrong-length label array makes ``targets`` raise ``CorruptRecordError``."""
    _put(database_copy, {store_format.labels_key("val"): labels})
    ds = LmdbImageDataset(database_copy, "val")
    with pytest.raises(CorruptRecordError, match="label array of split 'val'"):
        _ = ds.targets
    assert ds[0][1] in (0, 1, 2)  # the samples themselves are still readable


def test_database_replaced_while_a_dataset_is_open(tmp_path):
    """A new dataset of a re-converted database sees the new content, not the one this process had open."""
    dst = _tiny_database(tmp_path / "db", 5)
    old = LmdbImageDataset(dst)
    assert len(old) == 5
    old[0]
    _tiny_database(tmp_path / "db", 7, seed=3)
    new = LmdbImageDataset(dst)
    assert len(new) == 7
    assert new.targets == [0, 1, 2, 0, 1, 2, 0]
    new[6]
    assert os.path.samefile(new.path, dst)


@pytest.mark.parametrize("output", ["tensor", "pil"])
def test_raw_record_of_the_wrong_length_raises_even_unverified(tmp_path, output):
    """A raw-pixel record whose payload does not match its header's size is a ``CorruptRecordError``."""
    dst = tmp_path / "db"
    images = [(Image.new("RGB", (6, 4), (i * 40, 0, 0)), i % 2) for i in range(3)]
    convert_dataset(images, dst, encoding="raw", num_workers=0, progress=False)
    env = lmdb.open(str(dst), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(
            record_key("train", 1), store_format.pack_record(store_format.ENCODING_RAW, 1, 4, 6, bytes(6 * 4 * 3 - 5))
        )
    env.close()
    ds = LmdbImageDataset(dst, output=output, verify_checksums=False)
    assert ds[0][1] == 0
    with pytest.raises(CorruptRecordError, match=r"split 'train' index 1 of .*needs 72 bytes, found 67"):
        ds[1]


def test_classic_pil_transform_error_points_to_output_pil(database):
    """A classic ``ToTensor`` pipeline on tensor output fails with a message pointing to ``output='pil'``."""
    from torchvision import transforms

    from lightning_fastdata import SampleError

    classic = transforms.Compose([transforms.RandomResizedCrop(24), transforms.ToTensor()])
    with pytest.raises(SampleError, match=r"pass `output='pil'` to LmdbImageDataset"):
        LmdbImageDataset(database, transform=classic)[0]
    image, _ = LmdbImageDataset(database, transform=classic, output="pil")[0]
    assert image.shape == (3, 24, 24)


# ---------------------------------------------------------------------------------------------------------------
# Images larger than `max_pixels`: refused by their record header and by their own frame header, before decoding
# ---------------------------------------------------------------------------------------------------------------


def _no_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make PIL's decode of pixels fail the test (the checks must come before it), and libjpeg-turbo's unless it is
    given the memory to decode into, no more than the record header declares: it reads the JPEG's own frame header
    and refuses a larger image before it decodes a pixel (``buffer is too small``)."""
    decode_jpeg = decoding.simplejpeg.decode_jpeg

    def decoded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the image was decoded")

    def into_the_records_size(data: Any, *args: Any, buffer: Any = None, **kwargs: Any) -> Any:
        if buffer is None or buffer.nbytes > 3 * 48 * 64:  # the records that lie declare 48 x 64
            raise AssertionError(f"decoded into {None if buffer is None else buffer.nbytes} bytes")
        return decode_jpeg(data, *args, buffer=buffer, **kwargs)

    monkeypatch.setattr(decoding.simplejpeg, "decode_jpeg", into_the_records_size)
    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
    monkeypatch.setattr(decoding, "_read_png", decoded)


@pytest.mark.parametrize("output", ["tensor", "pil"])
@pytest.mark.parametrize(
    ("encoding", "image", "stored"),
    [
        (ENCODING_JPEG, hostile.gray_jpeg(16000, 16000), (16000, 16000)),  # a real 1 MB JPEG of 768 MB of pixels
        (ENCODING_JPEG, hostile.gray_jpeg(16000, 16000), (48, 64)),  # ... whose record header lies
        (ENCODING_JPEG, hostile.claiming(hostile.jpeg(48, 64), 12000, 9000), (48, 64)),
        (ENCODING_PNG, hostile.claiming(hostile.png(48, 64), 9000, 9000), (48, 64)),
        (ENCODING_PNG, hostile.claiming(hostile.png(48, 64), 9000, 9000), (9000, 9000)),
    ],
    # short ids: pytest 8 renders bytes into the id, and so into `PYTEST_CURRENT_TEST`, where one 1 MB JPEG makes every
    # child process's `exec` fail (E2BIG: "Argument list too long"), the database check's among them
    ids=["jpeg-16000", "jpeg-16000-record-48x64", "jpeg-sof-12000x9000", "png-ihdr-9000", "png-9000"],
)
def test_an_image_over_max_pixels_is_refused_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, encoding: int, image: bytes, stored: tuple[int, int]
) -> None:
    """An image whose record header or own frame header (JPEG SOF, PNG IHDR) is over ``max_pixels`` (default
    48 MiP) is a ``CorruptRecordError`` naming the record, the size, the limit and the argument; nothing is
    decoded (a 4 MB record decoded to 16,000 x 16,000 pixels grew the process by 734 MiB)."""
    db = hostile.write_database(
        tmp_path / "db",
        [hostile.record(ENCODING_JPEG, 0, 8, 8, hostile.jpeg(8, 8)), hostile.record(encoding, 1, *stored, image)],
        ["a", "b"],
    )
    dataset = LmdbImageDataset(db, output=output)  # type: ignore[arg-type]
    dataset[0]
    _no_decode(monkeypatch)
    with pytest.raises(CorruptRecordError) as info:
        dataset[1]
    message = str(info.value)
    assert re.match(
        rf"split 'train' index 1 of {re.escape(repr(str(db)))}: the image is \d+x\d+ \([\d,]+ pixels\)", message
    )
    assert "over `max_pixels` (50,331,648)" in message
    assert "raise `max_pixels`" in message
    assert "\n" not in message


def test_max_pixels_can_be_raised_or_lifted(tmp_path: Path) -> None:
    """An image of exactly ``max_pixels`` reads, one pixel more does not; ``None`` lifts the limit."""
    image = hostile.jpeg(48, 64)
    db = hostile.write_database(tmp_path / "db", [hostile.record(ENCODING_JPEG, 0, 48, 64, image)], ["a"])
    assert LmdbImageDataset(db, max_pixels=48 * 64)[0][0].shape == (3, 48, 64)
    assert LmdbImageDataset(db, max_pixels=None)[0][0].shape == (3, 48, 64)
    with pytest.raises(CorruptRecordError, match=r"the image is 48x64 \(3,072 pixels\), over `max_pixels` \(3,071\)"):
        LmdbImageDataset(db, max_pixels=48 * 64 - 1)[0]
    with pytest.raises(ValueError, match="`max_pixels` must be >= 1 or None"):
        LmdbImageDataset(db, max_pixels=0)


def test_a_frame_header_that_disagrees_with_the_record_is_refused_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the limit, a JPEG or PNG whose own size differs from its record header's is refused undecoded."""
    records = [
        hostile.record(ENCODING_JPEG, 0, 48, 64, hostile.claiming(hostile.jpeg(48, 64), 4000, 4000)),
        hostile.record(ENCODING_PNG, 0, 48, 64, hostile.claiming(hostile.png(48, 64), 4000, 4000)),
    ]
    db = hostile.write_database(tmp_path / "db", records, ["a"])
    _no_decode(monkeypatch)
    for output in ("tensor", "pil"):
        dataset = LmdbImageDataset(db, output=output)  # type: ignore[arg-type]
        for index, kind in enumerate(["JPEG", "PNG"]):
            with pytest.raises(
                CorruptRecordError,
                match=re.escape(f"the {kind} frame header's size (4000, 4000) differs from the stored (48, 64)"),
            ):
                dataset[index]


@pytest.mark.parametrize(
    ("encoding", "image", "output", "what", "cost"),
    [
        (ENCODING_JPEG, hostile.cmyk_jpeg(48, 64), "tensor", "CMYK JPEG", 7),
        (ENCODING_JPEG, hostile.cmyk_jpeg(48, 64), "pil", "CMYK JPEG read as a PIL image", 8),
        (ENCODING_PNG, hostile.flat_png(48, 64, "RGBA"), "pil", "RGBA PNG read as a PIL image", 8),
        (ENCODING_PNG, hostile.flat_png(48, 64, "L16"), "pil", "I;16 PNG read as a PIL image", 6),
    ],
    ids=["cmyk-jpeg-tensor", "cmyk-jpeg-pil", "rgba-png-pil", "l16-png-pil"],
)
def test_a_decode_over_its_memory_budget_is_refused_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoding: int, image: bytes, output: str, what: str, cost: int
) -> None:
    """An image within ``max_pixels`` whose decode takes more than 5 bytes a pixel of it (a CMYK JPEG: 7 through
    libjpeg-turbo, 8 through PIL; an RGBA or 16-bit PNG through PIL: 8, 6) is refused before it is decoded, naming
    the record, its kind, its size and the limit; with ``max_pixels`` raised to what its decode takes, it reads.
    (6144 x 8192 PNGs grew a reader by 482 MiB as tensors, 386 MiB as PIL images; CMYK JPEGs by 341 and 390 MiB.)"""
    db = hostile.write_database(tmp_path / "db", [hostile.record(encoding, 0, 48, 64, image)], ["a"])
    enough = -(-48 * 64 * cost // 5)  # 5 bytes a pixel of `max_pixels`: a greyscale JPEG read as a PIL image
    with monkeypatch.context() as patched:
        _no_decode(patched)
        with pytest.raises(CorruptRecordError) as info:
            LmdbImageDataset(db, output=output, max_pixels=enough - 1)[0]  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(
        f"split 'train' index 0 of {str(db)!r}: the image is a 48x64 {what} (3,072 pixels), whose decode takes {cost}"
        f" bytes a pixel"
    )
    assert f"`max_pixels` ({enough - 1:,})" in message
    assert "raise `max_pixels`" in message
    assert "\n" not in message
    image_read, _ = LmdbImageDataset(db, output=output, max_pixels=enough)[0]  # type: ignore[arg-type]
    assert np.asarray(image_read).shape in ((48, 64, 3), (3, 48, 64))


def test_a_record_is_read_only_as_its_encoding(tmp_path: Path) -> None:
    """A PNG record holding another format (here a JPEG, or a GIF) is refused: PIL opens it as a PNG only."""
    gif = io.BytesIO()
    Image.new("RGB", (64, 48)).save(gif, format="GIF")
    records = [
        hostile.record(ENCODING_PNG, 0, 48, 64, hostile.jpeg(48, 64)),
        hostile.record(ENCODING_PNG, 0, 48, 64, gif.getvalue()),
    ]
    dataset = LmdbImageDataset(hostile.write_database(tmp_path / "db", records, ["a"]))
    for index in range(2):
        with pytest.raises(CorruptRecordError, match=f"split 'train' index {index} of .*does not decode"):
            dataset[index]


def test_each_jpeg_is_walked_once_per_process(database: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch path's marker walk (a few us of GIL each) runs once a sample, not each epoch; a pickled copy (what a
    spawned worker gets) walks its samples itself, and a refused record stays refused."""
    walked: list[int] = []
    walk = decoding.jpeg_frame

    def counted(data: Any, *args: Any) -> Any:
        walked.append(len(data))
        return walk(data, *args)

    monkeypatch.setattr(decoding, "jpeg_frame", counted)
    ds = LmdbImageDataset(database)
    n = min(len(ds), 6)
    for _ in range(2):  # two epochs
        for i in range(n):
            ds[i]
    assert len(walked) == n
    copy = pickle.loads(pickle.dumps(ds))
    copy[0]
    assert len(walked) == n + 1
    copy.max_pixels = 1  # every image over it: refused each time, never marked as checked
    fresh = pickle.loads(pickle.dumps(copy))
    for _ in range(2):
        with pytest.raises(CorruptRecordError):
            fresh[1]
