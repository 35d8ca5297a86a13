from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hostile
import lmdb
import pytest

from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError, FastDataError
from lightning_fastdata.store import cache
from lightning_fastdata.store import environments as store_environments
from lightning_fastdata.store import format as store_format
from lightning_fastdata.store.environments import open_readonly, read_meta, read_sources
from lightning_fastdata.store.format import (
    ENCODING_JPEG,
    ENCODING_PNG,
    ENCODING_RAW,
    FORMAT_VERSION,
    HEADER,
    dump_meta,
    labels_key,
    load_meta,
    pack_record,
    record_key,
    unpack_record,
)
from lightning_fastdata.store.reader import LmdbImageDataset

PAYLOAD = bytes(range(7, 47))  # 40 bytes that are not all alike
RECORD = pack_record(ENCODING_JPEG, 3, 480, 640, PAYLOAD)


def _valid_meta(**overrides: object) -> dict[str, object]:
    meta: dict[str, object] = {"format_version": FORMAT_VERSION, "complete": True, "classes": ["a"], "splits": {}}
    meta.update(overrides)
    return meta


def _make_lmdb(path: Path, items: dict[bytes, bytes]) -> Path:
    env = lmdb.open(str(path), map_size=1 << 20, subdir=True)
    with env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key, value)
    env.close()
    return path


def test_pack_unpack_round_trip():
    """A packed record unpacks to the same header fields and payload bytes."""
    header, payload = unpack_record(RECORD)
    assert (header.encoding, header.label, header.height, header.width) == (ENCODING_JPEG, 3, 480, 640)
    assert bytes(payload) == PAYLOAD
    assert HEADER.size == 20  # the module docstring documents the layout
    assert len(RECORD) == HEADER.size + len(PAYLOAD)


def test_pack_unpack_round_trip_png_and_empty_payload():
    """The PNG encoding code and an empty payload round-trip too."""
    header, payload = unpack_record(pack_record(ENCODING_PNG, 0, 1, 1, b""))
    assert header == store_format.RecordHeader(ENCODING_PNG, 0, 1, 1)
    assert bytes(payload) == b""


def test_unpack_accepts_memoryview_and_returns_view():
    """``unpack_record`` reads a memoryview (as LMDB ``buffers=True`` gives) without copying the payload."""
    header, payload = unpack_record(memoryview(RECORD))
    assert isinstance(payload, memoryview)
    assert header.label == 3
    assert bytes(payload) == PAYLOAD


@pytest.mark.parametrize("position", range(len(RECORD)))
def test_every_bit_flip_is_detected(position):
    """Flipping any single bit anywhere in the header or payload raises ``CorruptRecordError``."""
    for bit in range(8):
        damaged = bytearray(RECORD)
        damaged[position] ^= 1 << bit
        with pytest.raises(CorruptRecordError):
            unpack_record(bytes(damaged))


def test_random_multi_byte_corruptions_are_detected():
    """Random overwrites of 1-8 bytes (always changing the record) raise ``CorruptRecordError``."""
    rng = random.Random(1234)
    for _ in range(2000):
        damaged = bytearray(RECORD)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
        if bytes(damaged) == RECORD:  # two flips of one byte cancelled out
            continue
        with pytest.raises(CorruptRecordError):
            unpack_record(bytes(damaged))


@pytest.mark.parametrize("length", range(len(RECORD)))
def test_every_truncation_is_detected(length):
    """A record cut to any shorter length raises ``CorruptRecordError``."""
    with pytest.raises(CorruptRecordError):
        unpack_record(RECORD[:length])


def test_appended_bytes_are_detected():
    """Bytes appended after the payload fail the checksum."""
    with pytest.raises(CorruptRecordError, match="checksum"):
        unpack_record(RECORD + b"\x00")


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (0, b"XX", "bad record magic"),
        (2, bytes([FORMAT_VERSION + 1]), "format version"),
        (3, bytes([99]), "unknown image encoding code 99"),
        (4, b"\x04\x00\x00\x00", "checksum"),  # the label
        (12, b"\x00\x00\x00\x00", "checksum"),  # the width
        (16, b"\x00\x00\x00\x00", "checksum"),  # the crc itself
    ],
)
def test_header_damage_messages(offset, value, match):
    """Each kind of header damage is reported with a message that says what is wrong."""
    damaged = bytearray(RECORD)
    damaged[offset : offset + len(value)] = value
    with pytest.raises(CorruptRecordError, match=match):
        unpack_record(bytes(damaged))


def test_short_record_message_names_sizes():
    """A record shorter than the header says how long it is and how long the header is."""
    with pytest.raises(CorruptRecordError, match=r"record is 5 bytes, shorter than its 20-byte header"):
        unpack_record(RECORD[:5])


def test_verify_false_skips_only_the_checksum():
    """With ``verify=False`` payload damage passes, but a bad header still raises."""
    damaged = bytearray(RECORD)
    damaged[-1] ^= 0xFF
    header, payload = unpack_record(bytes(damaged), verify=False)
    assert header.label == 3
    assert bytes(payload) == bytes(damaged[HEADER.size :])
    with pytest.raises(CorruptRecordError):
        unpack_record(bytes(damaged))
    damaged[0:2] = b"ZZ"
    with pytest.raises(CorruptRecordError, match="magic"):
        unpack_record(bytes(damaged), verify=False)


def test_errors_are_value_errors_and_fastdata_errors():
    """The format errors subclass both ``FastDataError`` and ``ValueError`` so callers can catch either."""
    for cls in (CorruptRecordError, DatasetFormatError):
        assert issubclass(cls, FastDataError)
        assert issubclass(cls, ValueError)


def test_record_and_label_keys_are_computed():
    """Record keys are ``<split>/<index:010d>``: computed, zero-padded and sorting in index order."""
    assert record_key("train", 5) == b"train/0000000005"
    assert record_key("val", 1234567890) == b"val/1234567890"
    assert labels_key("val") == b"__labels__/val"
    keys = [record_key("train", i) for i in (0, 9, 10, 99, 100, 12345)]
    assert keys == sorted(keys)
    assert store_format.META_KEY not in keys


def test_meta_round_trip():
    """``dump_meta`` writes JSON that ``load_meta`` returns unchanged."""
    meta = _valid_meta(classes=["cat", "dog"], splits={"train": {"length": 2, "class_counts": [1, 1]}})
    raw = dump_meta(meta)
    assert json.loads(raw) == meta
    assert load_meta(raw, "/some/db") == meta
    assert load_meta(memoryview(raw), "/some/db") == meta


def test_load_meta_none_means_not_our_database():
    """No metadata record: the error says the LMDB is not ours and how to make one."""
    with pytest.raises(DatasetFormatError, match="not one made by lightning_fastdata") as info:
        load_meta(None, "/data/other.lmdb")
    assert "/data/other.lmdb" in str(info.value)
    assert "lightning-fastdata convert" in str(info.value)


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe\x00", b"", b"[" * 200_000], ids=["not-json", "not-utf8", "empty", "nested-200k"]
)
def test_load_meta_bad_json(raw):
    """Undecodable metadata (nested too deeply too: a RecursionError) is reported as damaged, naming the path and
    the fix."""
    with pytest.raises(DatasetFormatError, match="not valid JSON") as info:
        load_meta(raw, "/data/db")
    assert "/data/db" in str(info.value)
    assert "lightning-fastdata convert" in str(info.value)


def test_json_nested_too_deeply_in_a_database_is_one_clear_error_or_ignored(tmp_path):
    """JSON nested 200,000 deep, which ``json.loads`` raises as a ``RecursionError``: as a database's sources, a
    ``DatasetFormatError`` naming them; as the ``verified.json`` or ``convert_report.json`` beside it, ignored (the
    database is walked again, its metadata read from the database)."""
    deep = b"[" * 200_000
    db = hostile.write_database(tmp_path / "db", [hostile.record(ENCODING_JPEG, 0, 8, 8, hostile.jpeg(8, 8))], ["a"])
    (db / store_format.VERIFIED_FILE).write_bytes(deep)
    (db / store_format.REPORT_FILE).write_bytes(deep)
    assert read_meta(db)["complete"] is True
    assert cache.conversion_meta(db)["complete"] is True
    assert store_format.parse_json((db / store_format.VERIFIED_FILE).read_text())["database"] == str(db)  # rewritten
    hostile.write_database(tmp_path / "deep", [None], ["a"], sources=deep)
    with pytest.raises(DatasetFormatError, match=r"are damaged: its arrays and objects nest too deeply to parse$"):
        read_sources(tmp_path / "deep")


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3"])
def test_load_meta_not_an_object(raw):
    """Valid JSON that is not an object is rejected."""
    with pytest.raises(DatasetFormatError, match="not a JSON object"):
        load_meta(raw, "/data/db")


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, "1", None])
def test_load_meta_wrong_version(version):
    """Another format version is refused with the version found and the one this package reads."""
    with pytest.raises(DatasetFormatError, match=r"format version") as info:
        load_meta(dump_meta(_valid_meta(format_version=version)), "/data/db")
    message = str(info.value)
    assert repr(version) in message
    assert f"reads version {FORMAT_VERSION}" in message


def test_load_meta_missing_version():
    """Metadata without a version is refused like a wrong version."""
    meta = _valid_meta()
    del meta["format_version"]
    with pytest.raises(DatasetFormatError, match="format version None"):
        load_meta(dump_meta(meta), "/data/db")


@pytest.mark.parametrize("complete", [False, None, "true", 1])
def test_load_meta_incomplete(complete):
    """A conversion that never finished (``complete`` is not ``True``) is refused and says to convert again."""
    with pytest.raises(DatasetFormatError, match="incomplete conversion") as info:
        load_meta(dump_meta(_valid_meta(complete=complete)), "/data/db")
    assert "lightning-fastdata convert" in str(info.value)


def test_load_meta_complete_missing_is_incomplete():
    """Metadata without ``complete`` is treated as incomplete."""
    meta = _valid_meta()
    del meta["complete"]
    with pytest.raises(DatasetFormatError, match="incomplete"):
        load_meta(dump_meta(meta), "/data/db")


def test_read_meta_missing_path(tmp_path):
    """``read_meta`` of a path that does not exist raises ``FileNotFoundError`` naming the path."""
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_meta(tmp_path / "nope")


def test_read_meta_plain_directory(tmp_path):
    """``read_meta`` of a directory without ``data.mdb`` raises ``DatasetFormatError``."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DatasetFormatError, match=re.escape("no data.mdb")):
        read_meta(tmp_path)


def test_read_meta_of_a_file(tmp_path):
    """``read_meta`` of a regular file raises ``DatasetFormatError``."""
    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(DatasetFormatError):
        read_meta(path)


def test_read_meta_of_foreign_lmdb(tmp_path):
    """An LMDB database without our metadata is reported as not ours."""
    path = _make_lmdb(tmp_path / "foreign", {b"key": b"value"})
    with pytest.raises(DatasetFormatError, match="not one made by lightning_fastdata"):
        read_meta(path)


def test_read_meta_of_garbage_data_file(tmp_path):
    """A ``data.mdb`` that is not an LMDB file raises ``DatasetFormatError``, not an ``lmdb`` error."""
    path = tmp_path / "garbage"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(DatasetFormatError):
        read_meta(path)


def test_read_meta_of_incomplete_lmdb(tmp_path):
    """An LMDB holding metadata with ``complete: false`` raises ``DatasetFormatError`` mentioning incomplete."""
    path = _make_lmdb(tmp_path / "partial", {store_format.META_KEY: dump_meta(_valid_meta(complete=False))})
    with pytest.raises(DatasetFormatError, match="incomplete"):
        read_meta(path)


def test_read_meta_of_database(database):
    """The session database's metadata is complete and describes its splits and classes."""
    meta = read_meta(database)
    assert meta["complete"] is True
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["classes"] == ["class_0", "class_1", "class_2"]
    assert {name: s["length"] for name, s in meta["splits"].items()} == {"train": 24, "val": 9}


def test_open_readonly_shares_one_environment(database):
    """Two opens of one database in a process return the same environment (LMDB forbids a second one)."""
    assert open_readonly(database) is open_readonly(str(database))


def test_open_readonly_reopens_a_replaced_database(tmp_path):
    """When the database at a path is replaced, the next open sees the new one, not the cached old one."""
    path = _make_lmdb(tmp_path / "db", {b"k": b"old"})
    old_env = open_readonly(path)
    with old_env.begin() as txn:
        assert txn.get(b"k") == b"old"
    new = _make_lmdb(tmp_path / "new", {b"k": b"new"})
    shutil.rmtree(path)
    new.rename(path)
    env = open_readonly(path)
    assert env is not old_env
    with env.begin() as txn:
        assert txn.get(b"k") == b"new"


def test_open_readonly_writes_no_lock_file(tmp_path):
    """Opening read-only creates no ``lock.mdb``."""
    path = _make_lmdb(tmp_path / "db", {b"k": b"v"})
    (path / "lock.mdb").unlink()
    with open_readonly(path).begin() as txn:
        assert txn.get(b"k") == b"v"
    assert sorted(p.name for p in path.iterdir()) == ["data.mdb"]


# ---------------------------------------------------------------------------------------------------------------
# The page walk at open: once per data file, recorded, and again whenever the file changes
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The databases whose pages get walked from now on, in order (the walk itself still runs)."""
    calls: list[Path] = []
    walk = store_environments._check_structure

    def counted(path: Path) -> bool:
        calls.append(path)
        return walk(path)

    monkeypatch.setattr(store_environments, "_check_structure", counted)
    monkeypatch.setattr(store_environments, "_VERIFIED", set())
    return calls


def _as_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget this process's environments and walks, as a process started now would have none."""
    store_environments._close_inherited()
    monkeypatch.setattr(store_environments, "_VERIFIED", set())


def test_a_walked_database_is_not_walked_again_by_another_process(database_copy, walks, monkeypatch):
    """The first open walks the pages and records it beside ``data.mdb``; a later process's open does not walk."""
    _as_a_new_process(monkeypatch)
    assert read_meta(database_copy)["complete"] is True
    assert walks == [database_copy]
    record = json.loads((database_copy / store_format.VERIFIED_FILE).read_text())
    st = (database_copy / store_format.DATA_FILE).stat()
    assert record[store_format.DATA_FILE] == {
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }
    for _ in range(3):
        _as_a_new_process(monkeypatch)
        assert read_meta(database_copy)["complete"] is True
    assert walks == [database_copy]


def _grow(data: Path) -> None:
    with open(data, "ab") as fh:
        fh.write(b"\0" * 4096)


def _touch(data: Path) -> None:
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def _new_inode(data: Path) -> None:
    shutil.copy2(data, data.with_name("copy.tmp"))  # the same bytes and mtime in a new file
    os.replace(data.with_name("copy.tmp"), data)


@pytest.mark.parametrize("change", [_grow, _touch, _new_inode])
def test_a_changed_data_file_is_walked_again(database_copy, walks, monkeypatch, change):
    """A new size, mtime or inode of ``data.mdb`` walks the pages again (then records the new identity)."""
    _as_a_new_process(monkeypatch)
    read_meta(database_copy)
    change(database_copy / store_format.DATA_FILE)
    _as_a_new_process(monkeypatch)
    read_meta(database_copy)
    _as_a_new_process(monkeypatch)
    read_meta(database_copy)
    assert walks == [database_copy, database_copy]


def test_a_copied_database_with_its_record_is_walked_again(database_copy, walks, monkeypatch, tmp_path):
    """A copy carries ``verified.json`` along, but not the data file's identity: the copy is walked."""
    _as_a_new_process(monkeypatch)
    read_meta(database_copy)
    copy = tmp_path / "again.lmdb"
    shutil.copytree(database_copy, copy)
    assert (copy / store_format.VERIFIED_FILE).is_file()
    read_meta(copy)
    assert walks == [database_copy, copy]


def test_a_record_that_cannot_be_written_costs_only_speed(database_copy, walks, monkeypatch, tmp_path):
    """A read-only database folder records the walk in the user's cache; with no writable place, every open walks."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(cache))
    (database_copy / store_format.VERIFIED_FILE).unlink(missing_ok=True)  # copied along with the session's database
    mode = database_copy.stat().st_mode
    database_copy.chmod(0o555)
    try:
        _as_a_new_process(monkeypatch)
        read_meta(database_copy)
        _as_a_new_process(monkeypatch)
        read_meta(database_copy)
        assert walks == [database_copy]
        assert not (database_copy / store_format.VERIFIED_FILE).exists()
        assert len(list((cache / "verified").glob("*.json"))) == 1

        blocker = tmp_path / "a file"
        blocker.write_text("")
        monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(blocker / "cache"))  # cannot be created
        other = tmp_path / "other.lmdb"
        shutil.copytree(database_copy, other)
        other.chmod(0o555)
        for _ in range(2):
            _as_a_new_process(monkeypatch)
            assert read_meta(other)["complete"] is True
        assert walks == [database_copy, other, other]
        assert [p.name for p in tmp_path.glob("**/.verified*.tmp")] == []
    finally:
        database_copy.chmod(mode)
        if (tmp_path / "other.lmdb").exists():
            (tmp_path / "other.lmdb").chmod(mode)


def test_an_incomplete_or_foreign_database_is_never_recorded(tmp_path, walks, monkeypatch):
    """Only a complete database of ours is recorded as walked: nothing is written into anything else."""
    incomplete = _make_lmdb(tmp_path / "incomplete", {b"__meta__": dump_meta(_valid_meta(complete=False))})
    foreign = _make_lmdb(tmp_path / "foreign", {b"k": b"v"})
    for path in (incomplete, foreign, incomplete):
        _as_a_new_process(monkeypatch)
        with pytest.raises(DatasetFormatError):
            read_meta(path)
    assert walks == [incomplete, foreign, incomplete]
    assert sorted(p.name for p in incomplete.iterdir()) == ["data.mdb", "lock.mdb"]
    assert sorted(p.name for p in foreign.iterdir()) == ["data.mdb", "lock.mdb"]


def test_concurrent_records_replace_each_other_whole(database_copy):
    """Processes recording the same walk at once each rename a whole file into place: the result is valid JSON."""
    st = (database_copy / store_format.DATA_FILE).stat()
    identity = store_environments._file_identity(st)
    threads = [
        threading.Thread(target=store_environments._write_marker, args=(database_copy, st, identity)) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert json.loads((database_copy / store_format.VERIFIED_FILE).read_text())[store_format.DATA_FILE] == identity
    assert sorted(p.name for p in database_copy.iterdir() if p.suffix == ".tmp") == []


_FORK_WHILE_READING = """
import os, sys, threading, time
from lightning_fastdata.store.reader import LmdbImageDataset

dataset = LmdbImageDataset(sys.argv[1])
stop = threading.Event()

def read_forever():  # a loader thread's look-ahead: one read transaction after another, never idle
    while not stop.is_set():
        with dataset.records() as read:
            for index in range(len(dataset)):
                read(index)

threading.Thread(target=read_forever, daemon=True).start()
time.sleep(0.2)
for attempt in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:  # the child reopens the database (the parent's environment was closed at the fork) and reads
        header, payload = LmdbImageDataset(sys.argv[1]).read_record(0)
        os._exit(0 if len(payload) > 0 else 3)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        print(f"HANG at fork {attempt}", flush=True)
        os.kill(pid, 9)
        os._exit(1)
    assert os.waitstatus_to_exitcode(status) == 0, status
stop.set()
print("FORKS OK", flush=True)
"""


@pytest.mark.slow
def test_a_fork_while_another_thread_reads_never_hangs_the_child(database: Path) -> None:
    """Forking (DataLoader workers start) while a loader thread reads: the child closes the inherited environment
    and reopens the database. py-lmdb's close waits for the calls in flight, which a child never sees end, so the
    fork waits for the other threads' read transactions to end (the suite hung in such a child)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_READING, str(database), "40"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FORKS OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_fork_from_inside_a_read_transaction_does_not_wait_for_itself(database: Path) -> None:
    """The forking thread's own open transaction is not in flight: the fork goes ahead at once."""
    from lightning_fastdata.store.reader import LmdbImageDataset

    dataset = LmdbImageDataset(database)
    with dataset.records() as read:
        read(0)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if LmdbImageDataset(database).read_record(1)[1] else 3)
        _, status = os.waitpid(pid, 0)
        _, payload = read(1)  # the parent's transaction still reads
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(payload) > 0


@pytest.mark.parametrize(
    ("height", "width"), [(0, 64), (48, 0), (2**32 - 1, 2**32 - 1), (65536, 64), (48, 65536), (2**31, 1)]
)
def test_a_header_declaring_an_impossible_size_is_refused(height: int, width: int) -> None:
    """A header whose sides are not 1 to 65535 (JPEG's limit) is a bad record, even with a valid checksum."""
    damaged = hostile.record(ENCODING_JPEG, 0, height, width, PAYLOAD)
    for verify in (True, False):
        with pytest.raises(CorruptRecordError, match=f"declares a {height}x{width} image; each side must be 1 to"):
            unpack_record(damaged, verify=verify)
    assert unpack_record(hostile.record(ENCODING_JPEG, 0, 65535, 65535, PAYLOAD))[0].height == 65535


def test_a_raw_record_must_hold_exactly_its_pixels() -> None:
    """A raw record's payload is its ``height * width * 3`` bytes, checked with the header (before any allocation)."""
    assert unpack_record(hostile.record(ENCODING_RAW, 0, 2, 3, bytes(18)))[0].width == 3
    for payload in (bytes(17), bytes(19), b""):
        with pytest.raises(CorruptRecordError, match=f"a raw 2x3 RGB record needs 18 bytes, found {len(payload)}"):
            unpack_record(hostile.record(ENCODING_RAW, 0, 2, 3, payload), verify=False)


def test_the_writer_skips_an_image_a_record_cannot_hold(tmp_path: Path) -> None:
    """An image over 65535 pixels a side is skipped at conversion (readers would refuse its record), not written."""
    from PIL import Image

    from lightning_fastdata import convert_dataset

    images = [(Image.new("RGB", (65536, 1)), 0), (Image.new("RGB", (8, 4)), 0)]
    summary = convert_dataset(images, tmp_path / "db", encoding="raw", short_side=0, num_workers=0, progress=False)
    assert summary.written == 1
    assert "65536x1 is over 65535 pixels a side" in summary.skipped[0].reason


def _read_meta_in_a_child(db: Path, timeout: float = 60) -> str:
    """What ``read_meta(db)`` raises (``"opened"`` if nothing), in a child that must end within ``timeout``."""
    script = """
import sys
from lightning_fastdata.store.environments import read_meta
try:
    read_meta(sys.argv[1])
    print("opened")
except Exception as err:
    print(type(err).__name__, err)
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(db)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening {db} took over {timeout} s")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _claiming(db: Path, records: list[bytes], length: Callable[[int], int]) -> int:
    """Rewrite ``db``'s metadata to claim ``length(size)`` records, ``size`` its data file's bytes once it is written
    (a write may grow the file by a page)."""
    claimed = None
    for _ in range(10):
        size = (db / store_format.DATA_FILE).stat().st_size
        if claimed == length(size):
            return claimed
        claimed = length(size)
        splits = {"train": {"length": claimed, "class_counts": [2, 1]}}
        hostile.write_database(db, records, ["a", "b"], meta={"splits": splits})
    raise AssertionError(f"{db} keeps growing")


def _most(size: int) -> int:
    """The most records of split ``train`` a data file of ``size`` bytes can hold."""
    return size // store_format._min_record_bytes("train")


@pytest.mark.parametrize("claimed", [10**10, 2**64, "one more than fits"])
def test_a_length_the_data_file_cannot_hold_is_refused_at_once(tmp_path: Path, claimed: int | str) -> None:
    """A split length beyond what the data file can hold (each record takes at least its key, its 20-byte header and
    LMDB's entry) is a ``DatasetFormatError`` at open, in moments: the first-open walk took time in proportion to it
    (10**10: about 100 minutes). The most that fits opens, its missing records each a ``CorruptRecordError``."""
    records = [hostile.record(ENCODING_JPEG, i % 2, 8, 8, hostile.jpeg(8, 8)) for i in range(3)]
    db = hostile.write_database(tmp_path / "db", records, ["a", "b"])
    length = _claiming(db, records, lambda size: _most(size) + 1 if isinstance(claimed, str) else claimed)
    line = _read_meta_in_a_child(db)  # on a child: the walk took 100 minutes at 10**10
    assert line.startswith(f"DatasetFormatError the metadata of {str(db)!r} claims {length:,} records in split")
    assert "more than its data.mdb of" in line
    most = _claiming(db, records, _most)
    dataset = LmdbImageDataset(db)
    assert len(dataset) == most
    dataset[2]
    with pytest.raises(CorruptRecordError, match=f"split 'train' index {most - 1} of .*the record is missing"):
        dataset[most - 1]


@pytest.mark.parametrize(
    "splits",
    [
        {"train": {"length": -1, "class_counts": [0, 0]}},
        {"train": {"length": "3", "class_counts": [2, 1]}},
        {"train": {"length": 3.0, "class_counts": [2, 1]}},
        {"train": {"length": True, "class_counts": [1, 0]}},
        {"train": {"length": 3, "class_counts": [3]}},
        {"train": {"length": 3}},
        {"train": 3},
        [3],
    ],
)
def test_splits_not_shaped_as_the_writer_writes_them_are_a_format_error(tmp_path: Path, splits: object) -> None:
    """Split lengths and class counts that are not counts are refused at open with a ``DatasetFormatError``."""
    records = [hostile.record(ENCODING_JPEG, i % 2, 8, 8, hostile.jpeg(8, 8)) for i in range(3)]
    db = hostile.write_database(tmp_path / "db", records, ["a", "b"], meta={"splits": splits})
    for opener in (read_meta, LmdbImageDataset):
        with pytest.raises(DatasetFormatError, match=re.escape(f"the metadata of {str(db)!r} is damaged: ")):
            opener(db)


def test_a_walk_that_times_out_is_a_format_error(database_copy: Path, walks: list[Path], monkeypatch) -> None:
    """The first-open walk of a database that does not end in time is a ``DatasetFormatError`` that says so."""

    def too_slow(args: list[str], **kwargs: object) -> None:
        raise subprocess.TimeoutExpired(args, kwargs.get("timeout") or 0)

    _as_a_new_process(monkeypatch)
    monkeypatch.setattr(subprocess, "run", too_slow)
    with pytest.raises(DatasetFormatError, match=r"could not be checked: walking its LMDB pages took over \d+ s"):
        read_meta(database_copy)
    assert walks == [database_copy]


def test_a_fork_from_inside_a_read_transaction_is_named_as_such_in_the_child(database: Path) -> None:
    """A child that reads through the transaction its parent opened before forking is told that, not that the
    database is damaged (it is not): the transaction was closed in the child at the fork."""
    script = """
import os, sys
from lightning_fastdata.store.reader import LmdbImageDataset
dataset = LmdbImageDataset(sys.argv[1])
with dataset.records() as read:
    read(0)
    pid = os.fork()
    if pid == 0:
        try:
            read(1)
        except Exception as err:
            print(type(err).__name__, err, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(database)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert message.startswith("RuntimeError split 'train' index 1 of"), message
    assert "was opened in process" in message
    assert "before this process" in message
    assert "`records()`" in message
    assert "damaged" not in message
    assert "\n" not in message


class _CountedCondition(threading.Condition):
    """A condition that counts the threads waiting on it."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # under the condition's lock
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def test_two_threads_forking_at_once_keep_transactions_out_until_both_have_forked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While one fork still waits for transactions to end, the other fork's end must not let new ones start.

    B forks from inside its own transaction, A from outside one. B goes first (only its own transaction is left) and
    finishes; then C asks to start a transaction: it must wait until A has forked too, or A would wait for C.
    """
    monkeypatch.setattr(store_environments, "FORK_WAIT_S", 5.0)  # A gives up on C after this, forking unclean
    gate = store_environments._ForkGate()
    gate._cond = cond = _CountedCondition()
    reader_in, reader_out, b_forked, b_out, c_in, c_out = (threading.Event() for _ in range(6))
    a_clean: list[bool] = []

    def reader() -> None:
        with gate.inside():
            reader_in.set()
            reader_out.wait(10)

    def fork_a() -> None:
        gate.before_fork()
        a_clean.append(gate.clean)
        gate.after_fork_in_parent()

    def fork_b() -> None:
        with gate.inside():
            gate.before_fork()  # waits for the reader only: its own transaction is not in flight
            b_forked.set()
            gate.after_fork_in_parent()
            b_out.wait(10)

    def c() -> None:
        with gate.inside():
            c_in.set()
            c_out.wait(10)

    threads = [threading.Thread(target=reader)]
    threads[0].start()
    assert reader_in.wait(10)
    threads += [threading.Thread(target=fork_b), threading.Thread(target=fork_a)]
    for thread in threads[1:]:
        thread.start()
    deadline = time.monotonic() + 10
    while cond.waiting < 2 and time.monotonic() < deadline:  # both forks wait for the reader's transaction to end
        time.sleep(0.01)
    assert cond.waiting == 2
    reader_out.set()
    assert b_forked.wait(10)
    threads.append(threading.Thread(target=c))
    threads[-1].start()
    assert not c_in.wait(1.0)  # A still waits for B's transaction: C must not start one
    b_out.set()
    assert c_in.wait(10)  # A forked (B's transaction ended), then C went in
    c_out.set()
    for thread in threads:
        thread.join(10)
    assert a_clean == [True]
