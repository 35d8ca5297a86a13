"""Sources you did not make (issue 43): list files and image folders naming devices, FIFOs and sockets, and list
files that are no text a CSV reader takes (a 200 KiB cell, NUL bytes, UTF-16, bytes that are not UTF-8).

Each conversion must end with a clear error or a counted skip. A regression would hang (a FIFO blocks its reader) or
read until memory runs out (``/dev/zero``), so every case runs in a child process (this file, run as a script) with a
timeout and a bounded address space: it fails instead of hanging the suite or the machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: how long one child may run: generous, for a loaded machine; a conversion that hangs fails instead
_TIMEOUT_S = 60
#: the address space of a child: a read of `/dev/zero` stops with a MemoryError here, not at the machine's memory
_CHILD_MEMORY = 2 << 30

_NOT_AN_IMAGE = "not an image file: only regular files are read"


def _in_child(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    """What each call gave, run one after the other in a child process: see :func:`_call`."""
    try:
        proc = subprocess.run(
            [sys.executable, __file__, json.dumps(calls)], capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {_TIMEOUT_S} s (hung on a FIFO, or reading without end): {calls}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """Run one call in this (child) process: ``convert``, the ``cli``, or a worker's read of one file."""
    import contextlib
    import io

    from lightning_fastdata import convert
    from lightning_fastdata.cli import main
    from lightning_fastdata.store import encode
    from lightning_fastdata.store.sources import open_image_file

    try:
        if call["op"] == "convert":
            summary = convert(call["src"], call["dst"], progress=False, **call.get("kwargs", {}))
            return {"written": summary.written, "skipped": {s.path: s.reason for s in summary.skipped}}
        if call["op"] == "cli":
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(call["argv"])
            return {"code": code, "stderr": err.getvalue()}
        if call["op"] == "rows":  # Hugging Face rows whose undecoded image gives only its file's path
            from lightning_fastdata import convert_dataset

            rows = [{"image": {"bytes": None, "path": path}, "label": 0} for path in call["paths"]]
            summary = convert_dataset(rows, call["dst"], classes=["a"], num_workers=0, progress=False)
            return {"written": summary.written, "skipped": {s.path: s.reason for s in summary.skipped}}
        if call["op"] == "work":  # what a pool worker does with one task
            return {"reason": encode._work(("train", call["path"], 0)).reason}
        open_image_file(call["path"])
        return {}
    except BaseException as err:  # the parent judges what was raised (a MemoryError too)
        return {"error": type(err).__name__, "message": str(err)}


def _image(path: Path) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), (200, 40, 40)).save(path, quality=90)
    return path


def _socket_file(path: Path) -> None:
    """A socket's file at ``path`` (it stays after the socket closes); bound by a short relative name."""
    here = Path.cwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path.name)
    finally:
        os.chdir(here)


# ---------------------------------------------------------------------------------------------------------------
# Source images that are no regular files
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/zero").exists() or not Path("/proc/self/status").exists(), reason="Linux files")
def test_a_list_naming_dev_zero_a_fifo_and_a_socket_skips_each_and_converts_the_rest(tmp_path):
    """``/dev/zero`` (absolute paths are allowed), a link to it, a FIFO, a socket, a folder: each skipped and counted,
    in this process and in a pool, without being opened; ``strict`` refuses them and writes nothing.
    ``/proc/self/status``, a regular file whose size says 0 but holds more, is read to its end within the cap on a
    source's size (``MAX_SOURCE_BYTES``): not an image."""
    root = tmp_path / "root"
    _image(root / "good.jpg")
    os.mkfifo(root / "fifo.jpg")
    (root / "zero.jpg").symlink_to("/dev/zero")
    _socket_file(root / "sock.jpg")
    (root / "folder.jpg").mkdir()
    names = ["good.jpg", "/dev/zero", "fifo.jpg", "zero.jpg", "sock.jpg", "folder.jpg", "/proc/self/status"]
    src = root / "list.csv"
    src.write_text("path,label\n" + "".join(f"{name},{i % 2}\n" for i, name in enumerate(names)))
    results = _in_child(
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "db0"), "kwargs": {"num_workers": 0}},
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "db2"), "kwargs": {"num_workers": 2}},
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "strict"), "kwargs": {"strict": True}},
    )
    expected = {
        "/dev/zero": f"a character device, {_NOT_AN_IMAGE}",
        str(root / "fifo.jpg"): f"a FIFO (named pipe), {_NOT_AN_IMAGE}",
        str(root / "zero.jpg"): f"a character device (a symbolic link to '/dev/zero'), {_NOT_AN_IMAGE}",
        str(root / "sock.jpg"): f"a socket, {_NOT_AN_IMAGE}",
        str(root / "folder.jpg"): f"a folder, {_NOT_AN_IMAGE}",
        "/proc/self/status": "not an image: the content is in no format Pillow can read",
    }
    for result in results[:2]:
        assert result.get("written") == 1, result
        assert {path: reason.split(";")[0] for path, reason in result["skipped"].items()} == expected
    assert results[2]["error"] == "ConversionError", results[2]
    assert "6 input(s) could not be converted and `strict` is set" in results[2]["message"]
    assert not (tmp_path / "strict").exists()


def test_an_image_folder_with_a_fifo_and_a_link_to_dev_zero_skips_both(tmp_path):
    """An image folder's FIFO and symbolic link to ``/dev/zero``, named as images: skipped and counted."""
    src = tmp_path / "images"
    _image(src / "cat" / "a.jpg")
    _image(src / "dog" / "b.jpg")
    os.mkfifo(src / "cat" / "fifo.jpg")
    (src / "dog" / "zero.png").symlink_to("/dev/zero")
    (result,) = _in_child({"op": "convert", "src": str(src), "dst": str(tmp_path / "db")})
    assert result.get("written") == 2, result
    assert sorted(result["skipped"]) == [str(src / "cat" / "fifo.jpg"), str(src / "dog" / "zero.png")]
    assert result["skipped"][str(src / "cat" / "fifo.jpg")].startswith(f"a FIFO (named pipe), {_NOT_AN_IMAGE}")


def test_a_source_file_over_the_size_cap_is_skipped_unread(tmp_path):
    """A (sparse) file of 2 GiB + 1 byte named in a list: skipped, saying its size and the cap, in this process and in
    a pool, without being read (the child's address space is 2 GiB: a read would end in a MemoryError); an
    ``ImageFolder``'s loader refuses it too."""
    root = tmp_path / "root"
    _image(root / "good.jpg")
    with open(root / "huge.jpg", "wb") as fh:
        fh.truncate((2 << 30) + 1)
    src = root / "list.csv"
    src.write_text("path,label\ngood.jpg,a\nhuge.jpg,b\n")
    *converted, loader = _in_child(
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "db0"), "kwargs": {"num_workers": 0}},
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "db2"), "kwargs": {"num_workers": 2}},
        {"op": "open_image_file", "path": str(root / "huge.jpg")},
    )
    for result in converted:
        assert result.get("written") == 1, result
        assert result["skipped"] == {
            str(root / "huge.jpg"): "a file of 2.0 GiB, over the 2 GiB a source image may have (no image Pillow"
            " decodes is that large); it was not read"
        }
    assert loader["error"] == "SampleError"
    assert "holds more than the 2147483648 bytes it may" in loader["message"]


def test_a_worker_opens_only_regular_files(tmp_path):
    """A path that became a FIFO or a device after the scan: the worker skips it, unopened or unread, and
    ``open_image_file`` (an ``ImageFolder``'s loader) refuses it; neither blocks nor reads without end."""
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    work_fifo, work_zero, loader = _in_child(
        {"op": "work", "path": str(fifo)},
        {"op": "work", "path": "/dev/zero"},
        {"op": "open_image_file", "path": str(fifo)},
    )
    assert work_fifo == {"reason": f"a FIFO (named pipe), {_NOT_AN_IMAGE}; list or put the image file itself there"}
    assert work_zero["reason"].startswith(f"a character device, {_NOT_AN_IMAGE}")
    assert loader["error"] == "SampleError"
    assert "is a FIFO (named pipe), not a regular file" in loader["message"]


def test_a_dataset_row_naming_a_fifo_or_dev_zero_is_skipped(tmp_path):
    """A Hugging Face row's undecoded image that gives only a path (``{"bytes": None, "path": ...}``) is read as a
    list file's path is: a FIFO or ``/dev/zero`` is skipped, saying what it is, and the rest converts."""
    good = _image(tmp_path / "a.jpg")
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    (result,) = _in_child({"op": "rows", "paths": [str(good), str(fifo), "/dev/zero"], "dst": str(tmp_path / "db")})
    assert result.get("written") == 1, result
    reasons = sorted(result["skipped"].values())
    assert len(reasons) == 2
    assert "is a FIFO (named pipe), not a regular file" in reasons[1]
    assert "'/dev/zero' is a character device, not a regular file" in reasons[0]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="a Linux /proc file")
def test_a_file_is_read_up_to_the_size_it_had_when_opened(tmp_path):
    """The read stops at ``fstat``'s size: ``/proc/self/status`` says 0 and yields more; a plain file is whole."""
    from lightning_fastdata._files import read_regular

    path = tmp_path / "a.bin"
    path.write_bytes(b"\x00\x01" * 1000)
    assert read_regular(path) == b"\x00\x01" * 1000
    assert read_regular("/proc/self/status") == b""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="a Linux /proc file")
def test_a_limited_read_stops_at_the_limit_and_follows_no_link_when_told(tmp_path):
    """With ``limit`` a file is read to its end (``/proc`` says 0), one that holds more is refused; with
    ``follow_links=False`` a link is refused as one, its target unread."""
    from lightning_fastdata._files import FileTooLargeError, NotRegularFileError, read_regular

    path = tmp_path / "a.bin"
    path.write_bytes(b"\x00\x01" * 1000)
    assert read_regular(path, limit=2000) == b"\x00\x01" * 1000
    with pytest.raises(FileTooLargeError, match="more than the 1999 bytes"):
        read_regular(path, limit=1999)
    assert read_regular("/proc/self/status", limit=1 << 16).startswith(b"Name:")
    link = tmp_path / "link.bin"
    link.symlink_to(path)
    assert read_regular(link) == path.read_bytes()
    with pytest.raises(NotRegularFileError, match="is a symbolic link, not a regular file"):
        read_regular(link, follow_links=False)


# ---------------------------------------------------------------------------------------------------------------
# List files that are no regular file, or no text a CSV reader takes
# ---------------------------------------------------------------------------------------------------------------


def test_a_list_file_that_is_a_fifo_or_a_device_is_refused(tmp_path):
    """A FIFO (or a link to ``/dev/zero``) named as a list file is refused, saying what it is, and never opened."""
    fifo = tmp_path / "list.csv"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.csv"
    zero.symlink_to("/dev/zero")
    by_convert, by_cli, device = _in_child(
        {"op": "convert", "src": str(fifo), "dst": str(tmp_path / "db")},
        {"op": "cli", "argv": ["convert", str(fifo), str(tmp_path / "db")]},
        {"op": "convert", "src": str(zero), "dst": str(tmp_path / "db")},
    )
    assert by_convert["error"] == "SourceLayoutError"
    assert f"`src` {str(fifo)!r} is a FIFO (named pipe), not a folder or a list file" in by_convert["message"]
    assert by_cli["code"] == 2
    assert "is a FIFO (named pipe), not a folder or a list file" in by_cli["stderr"]
    assert "is a character device, not a folder or a list file" in device["message"]
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_a_cell_over_the_csv_limit_names_the_file_and_the_row(tmp_path, suffix):
    """A 200 KiB cell (over ``csv.field_size_limit()``) is refused naming the file, the row and its line, and what
    to fix; the CLI says so (exit 2) instead of a traceback of ``_csv.Error``."""
    _image(tmp_path / "a.jpg")
    sep = "\t" if suffix == ".tsv" else ","
    src = tmp_path / f"list{suffix}"
    src.write_text(f"path{sep}label\na.jpg{sep}cat\na.jpg{sep}{'x' * 200 * 1024}\n")
    by_convert, by_cli = _in_child(
        {"op": "convert", "src": str(src), "dst": str(tmp_path / "db")},
        {"op": "cli", "argv": ["convert", str(src), str(tmp_path / "db")]},
    )
    assert by_convert["error"] == "SourceLayoutError", by_convert
    assert by_convert["message"].startswith(f"`src` {str(src)!r}: row 2 (from line 3) cannot be read as CSV")
    assert "A cell is 131,072 characters at most" in by_convert["message"]
    assert by_cli["code"] == 2
    assert "row 2 (from line 3) cannot be read as CSV" in by_cli["stderr"]
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(b"path,label\na.jpg,cat\nb\x00.jpg,dog\n", "holds a NUL character at line 3", id="nul"),
        pytest.param(
            "path,label\na.jpg,cat\n".encode("utf-16-le"), "holds a NUL character at line 1", id="utf16-no-bom"
        ),
        pytest.param(
            "path,label\na.jpg,cat\n".encode("utf-16"),
            "byte 0xff at line 1 (invalid start byte). It starts as UTF-16",
            id="utf16",
        ),
        pytest.param(b"path,label\na.jpg,cat\nb\xff.jpg,dog\n", "byte 0xff at line 3 (invalid start byte)", id="latin"),
    ],
)
def test_a_list_file_that_is_not_utf8_text_names_the_line(tmp_path, data, match):
    """NUL bytes, UTF-16 (with or without its byte-order mark) and bytes that are not UTF-8: refused naming the line,
    and how to save the file."""
    _image(tmp_path / "a.jpg")
    src = tmp_path / "list.csv"
    src.write_bytes(data)
    (result,) = _in_child({"op": "convert", "src": str(src), "dst": str(tmp_path / "db")})
    assert result.get("error") == "SourceLayoutError", result
    assert result["message"].startswith(f"`src` {str(src)!r} ")
    assert match in result["message"]
    assert "save it again as 'CSV UTF-8'" in result["message"]
    assert not (tmp_path / "db").exists()


def test_a_json_path_with_a_nul_character_is_skipped(tmp_path):
    """A JSON list's ``\\u0000`` in a path (which no file name holds) is a counted skip, not a raw ``ValueError``."""
    _image(tmp_path / "a.jpg")
    src = tmp_path / "list.json"
    src.write_text(json.dumps([{"path": "a.jpg", "label": "cat"}, {"path": "b\u0000.jpg", "label": "dog"}]))
    (result,) = _in_child({"op": "convert", "src": str(src), "dst": str(tmp_path / "db")})
    assert result.get("written") == 1, result
    assert list(result["skipped"].values()) == ["the path holds a NUL character, which no file name can"]


if __name__ == "__main__":  # a child of `_in_child`: run the calls given, in bounded memory
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))
    print(json.dumps([_call(call) for call in json.loads(sys.argv[1])]))
