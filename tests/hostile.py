"""Hostile images, records and databases, written byte by byte: what a database you did not make may hold.

Shared by the tests of the reader's limits (``tests/test_dataset.py``, ``tests/test_kernel.py``), the fuzz of
hostile databases (``tests/test_hostile.py``, whose cases run in ``tests/hostile_script.py``) and of hostile target
values (``tests/test_hostile_values.py``). Imports no torch.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import simplejpeg
from PIL import Image

from lightning_fastdata.store.format import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    META_KEY,
    dump_meta,
    labels_key,
    record_key,
    sources_key,
)


def _segment(marker: int, body: bytes) -> bytes:
    return b"\xff" + bytes([marker]) + struct.pack(">H", len(body) + 2) + body


def gray_jpeg(height: int, width: int) -> bytes:
    """A valid baseline greyscale JPEG of any size (mid-grey), a real decompression bomb: 2 bits per 8x8 block.

    Its Huffman tables hold one code each (DC difference 0, end of block), so every block is two zero bits: a
    16,000 x 16,000 image is 1 MB, and decodes to 768 MB of RGB.
    """
    return _flat_jpeg(height, width, 1)


def cmyk_jpeg(height: int, width: int) -> bytes:
    """A valid baseline CMYK JPEG of any size, built as :func:`gray_jpeg` with four components (no Adobe marker, so
    decoders take them as CMYK): 8 bits per 8x8 pixels, decoded to 4 bytes a pixel before any conversion to RGB."""
    return _flat_jpeg(height, width, 4)


def _flat_jpeg(height: int, width: int, components: int) -> bytes:
    bits = 2 * components * math.ceil(height / 8) * math.ceil(width / 8)
    scan = bytes(bits // 8) + (bytes([0xFF >> (bits % 8)]) if bits % 8 else b"")  # padded with one bits
    one_code = bytes([1] + [0] * 15)  # a single code, of length 1
    ids = range(1, components + 1)
    return b"".join(
        [
            b"\xff\xd8",
            _segment(0xDB, b"\x00" + bytes([1] * 64)),
            _segment(
                0xC0, struct.pack(">BHHB", 8, height, width, components) + b"".join(bytes([i, 0x11, 0]) for i in ids)
            ),
            _segment(0xC4, b"\x00" + one_code + b"\x00"),  # DC table 0
            _segment(0xC4, b"\x10" + one_code + b"\x00"),  # AC table 0: end of block
            _segment(0xDA, bytes([components]) + b"".join(bytes([i, 0]) for i in ids) + b"\x00\x3f\x00"),
            scan,
            b"\xff\xd9",
        ]
    )


def progressive_jpeg(
    height: int,
    width: int,
    components: int = 3,
    bands: tuple[tuple[int, int], ...] = ((1, 63),),
    bits: int = 0,
) -> bytes:
    """A valid progressive JPEG of any size (mid-grey, 4:4:4), as libjpeg reads it without a warning, scan by scan.

    One DC scan of every component (1 bit a block), then for each component and each band ``(Ss, Se)`` of AC
    coefficients a first scan of its bits from ``bits`` (successive approximation, ``Al`` up to 13) and one refinement
    scan of each lower bit: ``1 + components * len(bands) * (bits + 1)`` scans. Each AC scan is runs of 32,767 empty
    blocks (the symbol EOB14 and 14 bits), a few bytes whatever the image's size, and costs its decoder a pass over the
    component's blocks all the same: with ``bands`` each coefficient alone (``(k, k)``, k = 1..63) and ``bits=13``, an
    8192 x 6144 image of 2,647 scans took 29.8 s to decode (issue 43).
    """
    blocks = math.ceil(height / 8) * math.ceil(width / 8)
    one_code = bytes([1] + [0] * 15)  # a single code, of length 1
    ids = range(1, components + 1)
    dc_bits = blocks * components  # each block's DC difference: category 0, the one code
    dc = bytes(dc_bits // 8) + (bytes([0xFF >> (dc_bits % 8)]) if dc_bits % 8 else b"")
    ac_bits = ("0" + "1" * 14) * math.ceil(blocks / 32767)  # EOB14 and a run of 2**14 + 16383 blocks
    ac_bits += "1" * (-len(ac_bits) % 8)
    ac = int(ac_bits, 2).to_bytes(len(ac_bits) // 8, "big")
    parts = [
        b"\xff\xd8",
        _segment(0xDB, b"\x00" + bytes([1] * 64)),
        _segment(0xC2, struct.pack(">BHHB", 8, height, width, components) + b"".join(bytes([i, 0x11, 0]) for i in ids)),
        _segment(0xC4, b"\x00" + one_code + b"\x00"),  # DC table 0: difference 0
        _segment(0xC4, b"\x10" + one_code + b"\xe0"),  # AC table 0: EOB14, a run of 16,384 to 32,767 blocks
        _segment(0xDA, bytes([components]) + b"".join(bytes([i, 0]) for i in ids) + b"\x00\x00\x00"),
        dc.replace(b"\xff", b"\xff\x00"),  # a 0xFF byte of entropy-coded data is followed by a stuffed 0x00
    ]
    for i in ids:
        for first, last in bands:
            for bit in range(bits, -1, -1):
                refines = 0 if bit == bits else bit + 1
                parts += [
                    _segment(0xDA, bytes([1, i, 0, first, last, refines << 4 | bit])),
                    ac.replace(b"\xff", b"\xff\x00"),
                ]
    parts.append(b"\xff\xd9")
    return b"".join(parts)


def pil_jpeg(height: int, width: int, seed: int = 0, **options: Any) -> bytes:
    """A real RGB JPEG of random pixels saved by PIL with ``options`` (``progressive=True``, ``subsampling=0``, ...)."""
    out = io.BytesIO()
    Image.fromarray(pixels(height, width, seed)).save(out, format="JPEG", **options)
    return out.getvalue()


def pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Random RGB pixels."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def jpeg(height: int, width: int, seed: int = 0) -> bytes:
    """A real RGB JPEG of random pixels."""
    return simplejpeg.encode_jpeg(pixels(height, width, seed), quality=90)


def png(height: int, width: int, seed: int = 0) -> bytes:
    """A real RGB PNG of random pixels."""
    out = io.BytesIO()
    Image.fromarray(pixels(height, width, seed)).save(out, format="PNG")
    return out.getvalue()


def flat_png(height: int, width: int, mode: str = "RGB") -> bytes:
    """A valid PNG of any size, all zeros, written chunk by chunk: ``mode`` ``"RGB"``, ``"RGBA"`` or ``"L16"`` (16-bit
    greyscale). A 6144 x 8192 image is a few hundred KB."""
    colour_type, depth, channels = {"RGB": (2, 8, 3), "RGBA": (6, 8, 4), "L16": (0, 16, 1)}[mode]
    rows, zip_ = (
        bytes(1 + width * channels * depth // 8) * 256,
        zlib.compressobj(1),
    )  # filter byte 0 starts each row; level 1 inflates 3x faster than 9
    data = [zip_.compress(rows) for _ in range(height // 256)]
    data += [zip_.compress(rows[: (height % 256) * (len(rows) // 256)]), zip_.flush()]
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0)),
            _chunk(b"IDAT", b"".join(data)),
            _chunk(b"IEND", b""),
        ]
    )


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def claiming(image: bytes, height: int, width: int) -> bytes:
    """``image`` (a JPEG or a PNG) with its own frame header (SOF, IHDR) claiming ``height`` x ``width``.

    The pixel data is left as it is: a small file that asks its decoder for a huge image.
    """
    data = bytearray(image)
    if data.startswith(b"\x89PNG"):
        data[16:24] = struct.pack(">II", width, height)
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # IHDR's own checksum, recomputed
    else:
        sof = data.index(b"\xff\xc0")
        data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def record(
    encoding: int,
    label: int,
    height: int,
    width: int,
    payload: bytes,
    magic: bytes = MAGIC,
    version: int = FORMAT_VERSION,
) -> bytes:
    """A record with any header fields, its checksum computed as the reader computes it: only the checks can tell."""
    crc = zlib.crc32(payload, zlib.crc32(HEADER.pack(MAGIC, FORMAT_VERSION, encoding, label, height, width, 0)))
    return HEADER.pack(magic, version, encoding, label, height, width, crc) + payload


def write_database(
    path: Path,
    records: list[bytes | None],
    classes: list[str],
    meta: dict[str, Any] | None = None,
    labels: bytes | None = None,
    sources: bytes | None = None,
    split: str = "train",
    extra: dict[bytes, bytes | None] | None = None,
) -> Path:
    """A complete database of one split written with ``lmdb`` directly: ``records`` (``None``: left out), labels
    0, 1, 2, ... and sources as the writer writes them unless given; ``meta`` overrides the metadata's keys and
    ``extra`` puts (or, for ``None``, deletes) raw keys last."""
    n = len(records)
    label_list = [i % len(classes) for i in range(n)] if classes else []
    full: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "complete": True,
        "classes": classes,
        "encoding": {"encoding": "jpeg", "short_side": 0, "quality": 90, "keep_original": True},
        "source": {"path": "elsewhere", "fingerprint": "0"},
        "splits": {split: {"length": n, "class_counts": np.bincount(label_list, minlength=len(classes)).tolist()}},
        "writer": "someone else",
    }
    full.update(meta or {})
    env = lmdb.open(str(path), map_size=1 << 28, subdir=True)
    with env.begin(write=True) as txn:
        for index, value in enumerate(records):
            if value is not None:
                txn.put(record_key(split, index), value)
        txn.put(labels_key(split), np.asarray(label_list, "<i4").tobytes() if labels is None else labels)
        txn.put(sources_key(split), json.dumps([f"{i}.jpg" for i in range(n)]).encode() if sources is None else sources)
        txn.put(META_KEY, dump_meta(full))
        for key, value in (extra or {}).items():
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
    env.close()
    return path


def write_float_database(path: Path, records: list[bytes], values: np.ndarray, split: str = "train") -> Path:
    """A ``float`` database of ``records`` whose targets are ``values`` (``[N, K]``, any float32 values, NaN and
    infinities too, which the writer refuses), with the CRC32 of their array in the metadata as the writer writes it."""
    values = np.asarray(values, dtype="<f4").reshape(len(records), -1)
    raw = values.tobytes()
    meta = {
        "classes": [],
        "targets": {"kind": "float", "dim": values.shape[1], "names": []},
        "splits": {split: {"length": len(records), "class_counts": [], "targets_crc32": zlib.crc32(raw)}},
    }
    return write_database(path, records, [], meta=meta, split=split, extra={f"__targets__/{split}".encode(): raw})


def damage_record(db: Path, index: int, split: str = "train") -> None:
    """Flip one payload byte of record ``index`` of ``split`` in place, keeping its length: only its checksum tells."""
    env = lmdb.open(str(db), map_size=1 << 26)
    try:
        with env.begin(write=True) as txn:
            key = record_key(split, index)
            value = bytearray(txn.get(key))
            value[HEADER.size + 10] ^= 0xFF
            txn.put(key, bytes(value))
    finally:
        env.close()
