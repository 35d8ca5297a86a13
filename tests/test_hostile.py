"""A database you did not make can't hurt you: a fuzz of hostile record headers, payloads, targets and metadata.

Each hostile database is written byte by byte (``tests/hostile.py``) and read every way a reader can (``dataset[i]``
as tensors and PIL images, the batch path with and without the skip policy, device decode's host side) in a child
process (``tests/hostile_script.py``). Every read must end in this package's own error, naming the record, or in a
skip under ``on_bad_sample="skip"``, within 10 s, growing the reader's peak memory by at most 256 MiB.

The JPEG marker walk that finds a progressive frame's scans and coefficient buffer before it is decoded is tested here
too, with the records it refuses on every path (issue 43); hostile target values are in ``test_hostile_values.py``.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import hostile
import numpy as np
import pytest
from PIL import Image, ImageFile

from lightning_fastdata import CorruptRecordError, LmdbImageDataset
from lightning_fastdata.pipeline import create_loader
from lightning_fastdata.pipeline.device_decode import EncodedCropDataset
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.store import decoding
from lightning_fastdata.store.format import (
    ENCODING_JPEG,
    ENCODING_PNG,
    ENCODING_RAW,
    FORMAT_VERSION,
    META_KEY,
    labels_key,
)
from lightning_fastdata.store.jpeg import MAX_JPEG_SCANS, JpegFrame, jpeg_frame
from lightning_fastdata.store.targets import targets_key
from lightning_fastdata.transforms import CenterCropResize

#: the figures every read must keep to
SECONDS = 10.0
GROWTH = 256 << 20
CLASSES = ["a", "b", "c"]
#: every AC coefficient in a band of its own: with ``bits=13``, 882 scans a component (issue 43's record: 2,647)
EACH = tuple((k, k) for k in range(1, 64))


def _record_cases() -> list[tuple[str, bytes | None, str, bool]]:
    """``(name, record, expected, host)``: a record (``None``: missing) read beside two good ones. ``expected``:
    ``"error"``, ``"ok"`` or ``"either"`` (damage a decoder may or may not notice); ``host``: whether device decode's
    host side must catch it too (header and frame-header damage), or may leave it to the device."""
    jpg, png = hostile.jpeg(48, 64), hostile.png(48, 64)
    jpeg_, png_, raw = ENCODING_JPEG, ENCODING_PNG, ENCODING_RAW
    rec = hostile.record
    sos = jpg.index(b"\xff\xda")
    scrawled = bytearray(jpg)
    scrawled[sos + 40 : sos + 60] = bytes(range(1, 21))
    noise = np.random.default_rng(0).integers(0, 256, 1024, dtype=np.uint8).tobytes()
    header_damage = [
        ("encoding 0", rec(0, 0, 48, 64, jpg)),
        ("encoding 4", rec(4, 0, 48, 64, jpg)),
        ("encoding 255", rec(255, 0, 48, 64, jpg)),
        ("PNG code, JPEG bytes", rec(png_, 0, 48, 64, jpg)),
        ("raw code, JPEG bytes", rec(raw, 0, 48, 64, jpg)),
        ("JPEG code, raw bytes", rec(jpeg_, 0, 48, 64, bytes(48 * 64 * 3))),
        ("JPEG code, PNG bytes", rec(jpeg_, 0, 48, 64, png)),
        ("height 0", rec(jpeg_, 0, 0, 64, jpg)),
        ("width 0", rec(jpeg_, 0, 48, 0, jpg)),
        ("0 x 0", rec(jpeg_, 0, 0, 0, jpg)),
        ("2**32-1 square", rec(jpeg_, 0, 2**32 - 1, 2**32 - 1, jpg)),
        ("65536 high", rec(jpeg_, 0, 65536, 64, jpg)),
        ("65536 wide", rec(jpeg_, 0, 48, 65536, jpg)),
        ("2**31 x 1", rec(jpeg_, 0, 2**31, 1, jpg)),
        ("65535 square", rec(jpeg_, 0, 65535, 65535, jpg)),
        ("one pixel row over max_pixels", rec(jpeg_, 0, 6145, 8192, jpg)),
        ("height one too many", rec(jpeg_, 0, 49, 64, jpg)),
        ("sides swapped", rec(jpeg_, 0, 64, 48, jpg)),
        ("label -1", rec(jpeg_, -1, 48, 64, jpg)),
        ("label -2**31", rec(jpeg_, -(2**31), 48, 64, jpg)),
        ("label 2**31-1", rec(jpeg_, 2**31 - 1, 48, 64, jpg)),
        ("label 3 of 3 classes", rec(jpeg_, 3, 48, 64, jpg)),
        ("version 0", rec(jpeg_, 0, 48, 64, jpg, version=0)),
        ("version 2", rec(jpeg_, 0, 48, 64, jpg, version=FORMAT_VERSION + 1)),
        ("version 255", rec(jpeg_, 0, 48, 64, jpg, version=255)),
        ("magic XX", rec(jpeg_, 0, 48, 64, jpg, magic=b"XX")),
        ("magic lf", rec(jpeg_, 0, 48, 64, jpg, magic=b"lf")),
        ("magic NUL NUL", rec(jpeg_, 0, 48, 64, jpg, magic=b"\0\0")),
        ("raw one byte short", rec(raw, 0, 48, 64, bytes(48 * 64 * 3 - 1))),
        ("raw one byte long", rec(raw, 0, 48, 64, bytes(48 * 64 * 3 + 1))),
        ("raw 65535 square of 3 bytes", rec(raw, 0, 65535, 65535, bytes(3))),
        ("empty JPEG", rec(jpeg_, 0, 48, 64, b"")),
        ("empty PNG", rec(png_, 0, 48, 64, b"")),
        ("JPEG of 1 KiB of noise", rec(jpeg_, 0, 48, 64, noise)),
        ("PNG of 1 KiB of noise", rec(png_, 0, 48, 64, noise)),
        ("JPEG of zeros", rec(jpeg_, 0, 48, 64, bytes(4096))),
        ("JPEG start of image only", rec(jpeg_, 0, 48, 64, jpg[:2])),
        ("missing record", None),
    ]
    bombs = [  # frame headers (JPEG SOF, PNG IHDR) claiming huge images: caught before any decoder sees them
        ("JPEG SOF 65500 square, header 48x64", rec(jpeg_, 0, 48, 64, hostile.claiming(jpg, 65500, 65500))),
        ("JPEG SOF 65500 square, header alike", rec(jpeg_, 0, 65500, 65500, hostile.claiming(jpg, 65500, 65500))),
        ("JPEG SOF 16000 square, header 48x64", rec(jpeg_, 0, 48, 64, hostile.claiming(jpg, 16000, 16000))),
        ("JPEG SOF 4000 square, header 48x64", rec(jpeg_, 0, 48, 64, hostile.claiming(jpg, 4000, 4000))),
        ("PNG IHDR 65535 square, header 48x64", rec(png_, 0, 48, 64, hostile.claiming(png, 65535, 65535))),
        ("PNG IHDR 30000 square, header alike", rec(png_, 0, 30000, 30000, hostile.claiming(png, 30000, 30000))),
        ("PNG IHDR 4000 square, header 48x64", rec(png_, 0, 48, 64, hostile.claiming(png, 4000, 4000))),
        ("real 16000 square JPEG (1 MB)", rec(jpeg_, 0, 16000, 16000, hostile.gray_jpeg(16000, 16000))),
        ("real 16000 square JPEG, header 48x64", rec(jpeg_, 0, 48, 64, hostile.gray_jpeg(16000, 16000))),
        ("real 6144 x 8193 JPEG", rec(jpeg_, 0, 6144, 8193, hostile.gray_jpeg(6144, 8193))),
    ]
    decode_damage = [  # sound headers over damaged pixel data: found by the decoder (on the device, for JPEGs)
        ("JPEG cut in its scan", rec(jpeg_, 0, 48, 64, jpg[: len(jpg) // 2])),
        ("JPEG scan scrawled over", rec(jpeg_, 0, 48, 64, bytes(scrawled))),
        ("PNG cut short", rec(png_, 0, 48, 64, png[: len(png) // 2])),
        ("JPEG SOF 6144x8192 over a 48x64 scan", rec(jpeg_, 0, 6144, 8192, hostile.claiming(jpg, 6144, 8192))),
        ("PNG IHDR 6144x8192 over a 48x64 image", rec(png_, 0, 6144, 8192, hostile.claiming(png, 6144, 8192))),
    ]
    progressive = [  # issue 43: a multi-scan JPEG's scans, and the coefficient buffer it decodes through, are limited
        (
            "progressive 6144 x 8192 4:4:4 JPEG: 288 MiB of coefficients",
            rec(jpeg_, 0, 6144, 8192, hostile.progressive_jpeg(6144, 8192)),
        ),
        (
            "progressive 6144 x 8192 4:4:4 JPEG of 2,647 scans",
            rec(jpeg_, 0, 6144, 8192, hostile.progressive_jpeg(6144, 8192, bands=EACH, bits=13)),
        ),
        (
            "progressive 6144 x 8192 grey JPEG of 883 scans",
            rec(jpeg_, 0, 6144, 8192, hostile.progressive_jpeg(6144, 8192, 1, bands=EACH, bits=13)),
        ),
        ("progressive 64 x 64 JPEG of 2,647 scans", rec(jpeg_, 0, 64, 64, _many_scans())),
    ]
    sound = [  # extreme but sound: read (as tensors and batches at least: see BUDGET)
        ("real 6144 x 8192 JPEG: max_pixels exactly", rec(jpeg_, 0, 6144, 8192, hostile.gray_jpeg(6144, 8192))),
        ("real 8 x 65500 JPEG", rec(jpeg_, 0, 8, 65500, hostile.gray_jpeg(8, 65500))),
        ("raw 1 x 65535", rec(raw, 0, 1, 65535, bytes(65535 * 3))),
        ("PNG 48x64", rec(png_, 0, 48, 64, png)),
        ("real 6144 x 8192 RGB PNG: max_pixels exactly", rec(png_, 0, 6144, 8192, hostile.flat_png(6144, 8192))),
        ("real 6144 x 8192 RGBA PNG", rec(png_, 0, 6144, 8192, hostile.flat_png(6144, 8192, "RGBA"))),
        ("real 6144 x 8192 16-bit grey PNG", rec(png_, 0, 6144, 8192, hostile.flat_png(6144, 8192, "L16"))),
        ("real 6144 x 8192 CMYK JPEG", rec(jpeg_, 0, 6144, 8192, hostile.cmyk_jpeg(6144, 8192))),
        (
            "real 6144 x 5120 CMYK JPEG: as PIL, 5/8 of max_pixels",
            rec(jpeg_, 0, 6144, 5120, hostile.cmyk_jpeg(6144, 5120)),
        ),
        (
            "progressive 6144 x 8192 grey JPEG of 64 scans",
            rec(jpeg_, 0, 6144, 8192, hostile.progressive_jpeg(6144, 8192, 1, bands=EACH)),
        ),
    ]
    expected = {
        "JPEG scan scrawled over": "either",
        "real 6144 x 8192 RGBA PNG": "tensor",
        "real 6144 x 8192 16-bit grey PNG": "tensor",
        "real 6144 x 8192 CMYK JPEG": "refused",
        "progressive 6144 x 8192 grey JPEG of 64 scans": "tensor",  # 5 bytes a pixel; 7 as a PIL image
    }
    return [
        *((name, value, "error", True) for name, value in header_damage + bombs + progressive),
        *((name, value, expected.get(name, "error"), name.startswith("PNG")) for name, value in decode_damage),
        *((name, value, expected.get(name, "ok"), False) for name, value in sound),
    ]


#: how a read of each mode ends for an image within ``max_pixels`` whose decode takes more than its memory budget
#: (``DECODE_BUDGET`` bytes a pixel of ``max_pixels``) on some paths: ``"tensor"``, one that reads as tensors and
#: batches but as a PIL image takes too much (RGBA, 16-bit); ``"refused"``, one that takes too much every way it is
#: decoded (a CMYK JPEG, 7 bytes a pixel: device decode's host side refuses it before its bytes travel, as the CPU
#: decode that stands in for the device's would take as much)
BUDGET = {
    "tensor": {
        "dataset": "ok",
        "dataset_pil": "error",
        "loader_raise": "ok",
        "loader_skip": "ok",
        "encoded_skip": "ok",
    },
    "refused": {
        "dataset": "error",
        "dataset_pil": "error",
        "loader_raise": "error",
        "loader_skip": "skip",
        "encoded_skip": "skip",
    },
}


def _many_scans() -> bytes:
    """A valid 64 x 64 progressive JPEG of 2,647 scans, as issue 43's (which is 8192 x 6144): 2 ms to decode."""
    return hostile.progressive_jpeg(64, 64, bands=EACH, bits=13)


def _float_values(values: list[Any]) -> dict[str, Any]:
    """``write_database`` arguments of a ``float`` database of 4 records whose targets are ``values``."""
    raw = np.asarray(values, dtype="<f4").tobytes()
    split = {"length": 4, "class_counts": [], "targets_crc32": zlib.crc32(raw)}
    meta = {"classes": [], "targets": {"kind": "float", "dim": 1, "names": []}, "splits": {"train": split}}
    return {"meta": meta, "extra": {targets_key("train"): raw}}


#: ``(name, values, index)``: a ``float`` database's targets (one a sample) and the record under test
FLOAT_CASES = [
    ("float target NaN", [0.5, 1.5, float("nan"), 2.5], 2),
    ("float target +inf", [0.5, 1.5, float("inf"), 2.5], 2),
    ("float target -inf", [0.5, 1.5, 2.5, float("-inf")], 3),
]


def _meta_cases() -> list[tuple[str, dict[str, Any]]]:
    """``(name, write_database keyword arguments)`` of databases whose metadata, labels or sources are hostile."""
    splits = {"train": {"length": 4, "class_counts": [2, 1, 1]}}

    def length(value: Any) -> dict[str, Any]:
        return {"meta": {"splits": {"train": {"length": value, "class_counts": [2, 1, 1]}}}}

    return [
        ("length 10**10", length(10**10)),
        ("length 2**63", length(2**63)),
        ("length 10**30", length(10**30)),
        ("length 10**6 in a small file", length(10**6)),
        ("length -1", length(-1)),
        ("length '4'", length("4")),
        ("length 4.0", length(4.0)),
        ("length true", length(True)),
        ("length null", length(None)),
        ("length 6: two records missing", length(6)),
        ("class_counts too short", {"meta": {"splits": {"train": {"length": 4, "class_counts": [4]}}}}),
        ("class_counts negative", {"meta": {"splits": {"train": {"length": 4, "class_counts": [-1, 4, 1]}}}}),
        ("class_counts missing", {"meta": {"splits": {"train": {"length": 4}}}}),
        ("classes not a list", {"meta": {"classes": 3}}),
        ("classes not names", {"meta": {"classes": [1, 2, 3]}}),
        ("splits a list", {"meta": {"splits": [splits]}}),
        ("split a number", {"meta": {"splits": {"train": 4}}}),
        ("encoding a number", {"meta": {"encoding": 5}}),
        ("source a string", {"meta": {"source": "x"}}),
        ("format version 2", {"meta": {"format_version": FORMAT_VERSION + 1}}),
        ("incomplete", {"meta": {"complete": False}}),
        ("metadata not JSON", {"extra": {META_KEY: b"{not json"}}),
        ("metadata a list", {"extra": {META_KEY: b"[1, 2]"}}),
        ("metadata missing", {"extra": {META_KEY: None}}),
        ("labels missing", {"extra": {labels_key("train"): None}}),
        ("labels one short", {"labels": bytes(12)}),
        ("labels 4 MiB", {"labels": bytes(4 << 20)}),
        ("sources not JSON", {"sources": b"[not json"}),
        ("sources one short", {"sources": b'["0.jpg", "1.jpg", "2.jpg"]'}),
        ("sources an object", {"sources": b'{"length": 10000000000}'}),
        ("metadata nested 200,000 deep", {"extra": {META_KEY: b"[" * 200_000}}),
        ("sources nested 200,000 deep", {"sources": b"[" * 200_000}),
        ("label array holding -1", {"labels": np.array([0, 1, -1, 2], dtype="<i4").tobytes()}),
        ("label array holding 3 of 3 classes", {"labels": np.array([0, 3, 1, 2], dtype="<i4").tobytes()}),
        *((f"{name}, read by `targets`", _float_values(values)) for name, values, _ in FLOAT_CASES),
    ]


def _write(tmp_path: Path) -> list[dict[str, Any]]:
    """The hostile databases, and the cases that read them."""
    good = [hostile.record(ENCODING_JPEG, i % 3, 48, 64, hostile.jpeg(48, 64, seed=i)) for i in range(4)]
    records = _record_cases()
    db = hostile.write_database(tmp_path / "records", good[:2] + [value for _, value, _, _ in records], CLASSES)
    cases = [
        {"name": name, "db": str(db), "index": 2 + i, "expected": expected, "host": host}
        for i, (name, _, expected, host) in enumerate(records)
    ]
    for i, (name, values, index) in enumerate(FLOAT_CASES):  # each read every way, beside the good records 0 and 1
        floats = [hostile.record(ENCODING_JPEG, -1, 48, 64, hostile.jpeg(48, 64, seed=j)) for j in range(4)]
        path = hostile.write_database(tmp_path / f"float{i}", floats, CLASSES, **_float_values(values))
        cases.append({"name": name, "db": str(path), "index": index, "expected": "error", "host": True})
    for i, (name, kwargs) in enumerate(_meta_cases()):
        path = hostile.write_database(tmp_path / f"meta{i}", good, CLASSES, **kwargs)
        cases.append({"name": name, "db": str(path), "index": None, "expected": "error", "host": True})
    return cases


def _judge(case: dict[str, Any], result: dict[str, Any]) -> str | None:
    """What is wrong with how a read ended, or ``None``."""
    outcome, mode = result["outcome"], result["mode"]
    if result["seconds"] > SECONDS:
        return f"took {result['seconds']:.1f} s"
    if result["growth"] > GROWTH:
        return f"grew the peak memory by {result['growth'] >> 20} MiB"
    if outcome == "error":
        if not result["ours"]:
            return f"raised {result['error']}: {result['message']}"
        if "\n" in result["message"]:
            return f"a message of more than one line: {result['message']!r}"
        if case["index"] is not None and f"index {case['index']} of" not in result["message"]:
            return f"a message that does not name the record: {result['message']}"
    if case["index"] is None:  # metadata: refused at open, or (labels, sources, missing records) when read
        return None if mode == "loader_skip" or outcome == "error" else f"ended {outcome}"
    if case["expected"] in BUDGET:
        allowed = {BUDGET[case["expected"]][mode]}
    elif mode == "encoded_skip" and not case["host"] and case["expected"] != "ok":
        allowed = {"ok", "skip"}  # a JPEG whose headers are sound goes to the device as it is
    elif mode == "dataset_pil" and not case["host"] and case["expected"] != "ok":
        allowed = {"ok", "error"}  # PIL decodes a damaged JPEG scan as libjpeg pads it, where simplejpeg refuses it
    elif mode.endswith("skip"):
        allowed = {"ok": {"ok"}, "error": {"skip"}, "either": {"ok", "skip"}}[case["expected"]]
    else:
        allowed = {"ok": {"ok"}, "error": {"error"}, "either": {"ok", "error"}}[case["expected"]]
    if outcome not in allowed:
        return f"ended {outcome}, expected {' or '.join(sorted(allowed))}"
    if outcome == "skip" and (result["skipped"], result["images"]) != (1, 2):
        return f"skipped {result['skipped']} and kept {result['images']} of 3"
    return None


@pytest.mark.slow
def test_hostile_databases_end_in_a_clear_error_or_a_skip_in_time_and_memory(tmp_path: Path) -> None:
    """Every hostile header, payload and metadata case, read every way, ends in this package's own one-line error
    naming the record, or in a skip under ``on_bad_sample="skip"``, within 10 s and 256 MiB of peak memory."""
    cases = _write(tmp_path)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = Path(__file__).with_name("hostile_script.py")
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the reads did not end; the last lines: {str(err.stdout)[-500:]}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "outcome" in line]
    assert proc.returncode == 0, f"the reader died ({proc.returncode}) at {lines[-1:]}: {proc.stderr[-2000:]}"
    by_name = {case["name"]: case for case in cases}
    problems = [
        f"{result['case']} [{result['mode']}]: {problem}"
        for result in results
        if (problem := _judge(by_name[result["case"]], result)) is not None
    ]
    assert not problems, "\n".join(problems)
    assert len(results) == sum(2 if case["index"] is None else 5 for case in cases)
    counts: dict[str, int] = {}
    for result in results:
        key = result.get("error") or result["outcome"]
        counts[key] = counts.get(key, 0) + 1
    slowest = max(results, key=lambda r: r["seconds"])

    def largest(pil: bool) -> str:
        top = max((r for r in results if (r["mode"] == "dataset_pil") == pil), key=lambda r: r["growth"])
        return f"{top['growth'] / 2**20:.0f} MiB ({top['case']} [{top['mode']}])"

    print(  # the figures, with `pytest -s`
        f"{len(cases)} cases, {len(results)} reads: {counts}; slowest {slowest['seconds']:.2f} s"
        f" ({slowest['case']} [{slowest['mode']}]); largest peak growth {largest(False)}, with output='pil'"
        f" {largest(True)}; peak reset per read: {results[0]['resettable']}"
    )


# ----------------------------------------------------------------------------------------------------------------
# Multi-scan JPEGs (issue 43): the marker walk, the scan limit and the coefficient buffer, on every read path
# ----------------------------------------------------------------------------------------------------------------


def _with(data: bytes, at: int, inserted: bytes) -> bytes:
    return data[:at] + inserted + data[at:]


def _grey_jpeg(**options: Any) -> bytes:
    """A real 48 x 64 greyscale JPEG of random pixels saved by PIL with ``options``."""
    out = io.BytesIO()
    Image.fromarray(hostile.pixels(48, 64)[..., 0]).save(out, format="JPEG", **options)
    return out.getvalue()


def test_jpeg_frame_reads_the_frame_type_sampling_and_scans_as_libjpeg_does() -> None:
    """The walk over a JPEG's markers gives its frame type, size, sampling factors and the scans libjpeg reads: one
    for a single-scan frame (the walk stops there), every SOS of a progressive one, however its scans' data is coded
    (stuffed bytes, restart markers), and none of the bytes that only look like a SOS marker (in a comment)."""
    y444, y420 = ((1, 1),) * 3, ((2, 2), (1, 1), (1, 1))
    assert jpeg_frame(hostile.pil_jpeg(48, 64)) == JpegFrame(0xC0, 48, 64, y420, 1, False)
    progressive = hostile.pil_jpeg(48, 64, progressive=True, subsampling=0)
    assert jpeg_frame(progressive) == JpegFrame(0xC2, 48, 64, y444, 10, True)  # libjpeg's progression for colour
    grey = _grey_jpeg(progressive=True)
    assert jpeg_frame(grey) == JpegFrame(0xC2, 48, 64, ((1, 1),), 6, True)  # ... for grey
    restarts = hostile.pil_jpeg(48, 64, progressive=True, restart_marker_blocks=1)
    assert restarts.count(b"\xff\xd0") > 1
    assert jpeg_frame(restarts).scans == 10  # type: ignore[union-attr]
    sos_alike = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" * 20
    commented = _with(progressive, 2, hostile._segment(0xFE, sos_alike))  # a COM segment right after SOI
    assert jpeg_frame(commented) == jpeg_frame(progressive)
    junk = _with(progressive, progressive.index(b"\xff\xc2"), b"junk\xff\x00")  # skipped, as libjpeg skips it
    assert jpeg_frame(junk) == jpeg_frame(progressive)
    many = jpeg_frame(_many_scans())
    assert many == JpegFrame(0xC2, 64, 64, y444, 2647, True)
    assert jpeg_frame(_many_scans(), count_to=200).scans == 200  # type: ignore[union-attr]
    # the buffer of the whole image's coefficients (2 bytes each, 64 a block): 6 bytes a pixel for 4:4:4, 3 for 4:2:0
    assert many.buffer_bytes() == 6 * 64 * 64  # type: ignore[union-attr]
    assert jpeg_frame(hostile.pil_jpeg(48, 64, progressive=True)).buffer_bytes() == 3 * 48 * 64  # type: ignore[union-attr]
    assert jpeg_frame(hostile.pil_jpeg(48, 64)).buffer_bytes() == 0  # type: ignore[union-attr]
    for nothing in (b"", hostile.png(8, 8), progressive[: progressive.index(b"\xff\xda")], b"\xff\xd8" + bytes(100)):
        assert jpeg_frame(nothing) is None


def test_a_jpeg_of_too_many_scans_is_a_bad_sample_on_every_path(tmp_path: Path) -> None:
    """A valid progressive JPEG of 2,647 scans (issue 43's, at 64 x 64: 2,647 passes over 8192 x 6144 took 29.8 s) is
    a one-line ``CorruptRecordError`` naming the record, its scans and the limit, as a tensor, a PIL image, a batch,
    and on device decode's host side; skipped under the skip policy. ``max_pixels=None`` (a trusted database) reads it.
    """
    good = [hostile.record(ENCODING_JPEG, 0, 64, 64, hostile.jpeg(64, 64, seed=i)) for i in range(2)]
    db = hostile.write_database(
        tmp_path / "db", [good[0], hostile.record(ENCODING_JPEG, 0, 64, 64, _many_scans()), good[1]], ["a"]
    )
    refusal = re.escape(
        f"split 'train' index 1 of {str(db)!r}: the progressive JPEG has 2,647 scans, over the {MAX_JPEG_SCANS} a JPEG"
        " may have"
    )
    for output in ("tensor", "pil"):
        with pytest.raises(CorruptRecordError, match=refusal) as info:
            LmdbImageDataset(db, output=output)[1]  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
    dataset = LmdbImageDataset(db, transform=CenterCropResize(16))
    with pytest.raises(CorruptRecordError, match=refusal):
        list(create_loader(dataset, 3, engine="threads", workers=0))
    for output in ("uint8", "encoded"):
        counter = SkipCounter()
        batches = list(create_loader(dataset, 3, output=output, skip_counter=counter, return_index=True))
        assert [batch[-1].tolist() for batch in batches] == [[0, 2]]
        assert counter.value == 1
    with pytest.raises(CorruptRecordError, match=refusal):
        EncodedCropDataset(LmdbImageDataset(db), lambda height, width: (0, 0, height, width), 0.0)[1]
    assert LmdbImageDataset(db, max_pixels=None)[1][0].shape == (3, 64, 64)


@pytest.mark.parametrize(
    ("output", "what", "cost"),
    [("tensor", "progressive JPEG", 3), ("pil", "RGB progressive JPEG read as a PIL image", 4)],
)
def test_a_progressive_jpeg_s_coefficient_buffer_counts_against_the_decode_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, what: str, cost: int
) -> None:
    """A progressive 4:4:4 JPEG decodes through a buffer of its DCT coefficients, 6 bytes a pixel, beside its image (3
    bytes a pixel as a tensor, 4 as a PIL image): refused undecoded over the budget (5 bytes a pixel of
    ``max_pixels``), naming both (issue 43: 8192 x 6144 grew a reader by 433 MiB, 482 as PIL); read within it."""
    db = hostile.write_database(
        tmp_path / "db", [hostile.record(ENCODING_JPEG, 0, 48, 64, hostile.progressive_jpeg(48, 64))], ["a"]
    )
    enough = -(-48 * 64 * (cost + 6) // 5)
    with monkeypatch.context() as patched:

        def decoded(*args: object, **kwargs: object) -> None:
            raise AssertionError("the image was decoded")

        patched.setattr(decoding.simplejpeg, "decode_jpeg", decoded)
        patched.setattr(ImageFile.ImageFile, "load", decoded)
        with pytest.raises(CorruptRecordError) as info:
            LmdbImageDataset(db, output=output, max_pixels=enough - 1)[0]  # type: ignore[arg-type]
        if output == "tensor":  # device decode's host side refuses it too, before its bytes travel
            with pytest.raises(CorruptRecordError):
                EncodedCropDataset(LmdbImageDataset(db, max_pixels=enough - 1), lambda h, w: (0, 0, h, w), 0.0)[0]
    message = str(info.value)
    assert message.startswith(
        f"split 'train' index 0 of {str(db)!r}: the image is a 48x64 {what} (3,072 pixels), whose decode takes"
        f" {cost + 6} bytes a pixel (0 MiB: {cost} a pixel for the image and 0 MiB for the buffer of its DCT"
        " coefficients"
    )
    assert f"`max_pixels` ({enough - 1:,})" in message
    assert "\n" not in message
    image, _ = LmdbImageDataset(db, output=output, max_pixels=enough)[0]  # type: ignore[arg-type]
    assert (np.asarray(image) == 128).all()
