"""A database you did not make can't hurt you: a fuzz of hostile record headers, payloads and metadata.

Each hostile database is written byte by byte (``tests/hostile.py``) and read every way a reader can (``dataset[i]``
as tensors and PIL images, the batch path with and without the skip policy, device decode's host side) in a child
process (``tests/hostile_script.py``). Every read must end in this package's own error, naming the record, or in a
skip under ``on_bad_sample="skip"``, within 10 s, growing the reader's peak memory by at most 256 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hostile
import numpy as np
import pytest

from lightning_fastdata.store.format import (
    ENCODING_JPEG,
    ENCODING_PNG,
    ENCODING_RAW,
    FORMAT_VERSION,
    META_KEY,
    labels_key,
)

#: the figures every read must keep to
SECONDS = 10.0
GROWTH = 256 << 20
CLASSES = ["a", "b", "c"]


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
    ]
    expected = {
        "JPEG scan scrawled over": "either",
        "real 6144 x 8192 RGBA PNG": "tensor",
        "real 6144 x 8192 16-bit grey PNG": "tensor",
        "real 6144 x 8192 CMYK JPEG": "refused",
    }
    return [
        *((name, value, "error", True) for name, value in header_damage + bombs),
        *((name, value, expected.get(name, "error"), name.startswith("PNG")) for name, value in decode_damage),
        *((name, value, expected.get(name, "ok"), False) for name, value in sound),
    ]


#: how a read of each mode ends for an image within ``max_pixels`` whose decode takes more than its memory budget
#: (``DECODE_BUDGET`` bytes a pixel of ``max_pixels``) on some paths: ``"tensor"``, one that reads as tensors and
#: batches but as a PIL image takes too much (RGBA, 16-bit); ``"refused"``, one that takes too much every way it is
#: decoded on the host (a CMYK JPEG: device decode's host side leaves a JPEG to the device)
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
        "encoded_skip": "ok",
    },
}


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
