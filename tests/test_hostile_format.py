"""A database you did not make, at open (issue 43): replaced while it is read, a forged walk record, files that are
not files.

* A database replaced while loader threads decode its records from the memory map: its old environment is never
  closed (unmapped) under a read, which killed the process with SIGSEGV (``tests/replaced_script.py``).
* A ``verified.json`` is trusted only where this user wrote it: one copying a damaged data file's identity into
  someone else's folder skipped the walk, and LMDB aborted the process (SIGABRT) on the damaged page.
* A FIFO or a device named ``data.mdb`` (or ``verified.json``, or a converter's lock file) is refused at once, never
  opened: the open of a FIFO waited forever.

Whatever could crash or hang runs in a child process, so that a regression fails here instead of taking pytest down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import hostile
import lmdb
import numpy as np
import pytest
import simplejpeg

from lightning_fastdata.errors import DatasetFormatError
from lightning_fastdata.store import environments as store_environments
from lightning_fastdata.store import format as store_format
from lightning_fastdata.store.environments import open_readonly, read_transaction
from lightning_fastdata.store.format import (
    DATA_FILE,
    ENCODING_JPEG,
    VERIFIED_FILE,
)
from lightning_fastdata.store.reader import LmdbImageDataset

#: a uid no one on a test machine has: "someone else", for the folders and records a test hands over to them
OTHER_UID = 54321
#: only root can hand a file over to another user; elsewhere the child process plays another user instead
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _jpegs(count: int, side: int = 16, seed: int = 0) -> list[bytes]:
    return [hostile.jpeg(side, side, seed * count + i) for i in range(count)]


def _database(path: Path, images: list[bytes]) -> Path:
    """A complete database of ours holding ``images`` (JPEGs) as split ``train``, classes ``a`` and ``b``."""
    records: list[bytes | None] = [
        hostile.record(ENCODING_JPEG, i % 2, *simplejpeg.decode_jpeg_header(image)[:2], image)
        for i, image in enumerate(images)
    ]
    return hostile.write_database(path, records, ["a", "b"])


def _replace_data_file(path: Path, images: list[bytes]) -> None:
    """Rename a new database's data file over ``path``'s, as a copy or a re-conversion replaces it (a new inode)."""
    new = _database(path.with_name(path.name + ".new"), images)
    os.replace(new / DATA_FILE, path / DATA_FILE)


def _run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: a crash is its negative exit status, a hang a failed test, not ours."""
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the child did not end in {timeout:.0f} s (a hang); it printed: {err.stdout!r} {err.stderr!r}")


def _died(proc: subprocess.CompletedProcess[str]) -> str:
    """How a child ended, for an assertion's message: the signal that killed it, or its status and output."""
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}: {proc.stderr[-1500:]}"
    return f"exit status {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"


# ---------------------------------------------------------------------------------------------------------------
# 1. A database replaced while it is read
# ---------------------------------------------------------------------------------------------------------------


def test_a_replaced_database_stays_mapped_until_its_open_read_ends(tmp_path: Path) -> None:
    """Opening the path of a replaced database while a read transaction of the old one is open leaves the old one
    open and mapped: the read goes on reading the old bytes (the old environment was closed under it, and a decode
    of its views crashed). Once the read ends, the old environment is closed, and the dataset says it was replaced."""
    old_images, new_images = _jpegs(4, seed=1), _jpegs(4, seed=2)
    path = _database(tmp_path / "db.lmdb", old_images)
    dataset = LmdbImageDataset(path)
    with dataset.records() as read:
        read(0)
        _replace_data_file(path, new_images)
        assert LmdbImageDataset(path).read_record(1)[1] == bytearray(new_images[1])  # the path opened again: new
        header, payload = read(1)  # the open read: still the old file, still mapped
        assert bytes(payload) == old_images[1]
        expected = simplejpeg.decode_jpeg(old_images[1], "RGB")
        assert np.array_equal(dataset.decode_hwc(1, header, payload), expected)
    with pytest.raises(DatasetFormatError, match="was replaced or deleted after this dataset opened it"):
        dataset[0]
    assert not store_environments._HOLDS._retired  # closed when its last read ended: nothing kept mapped


def test_a_replaced_environment_is_closed_once_its_last_transaction_ends(tmp_path: Path) -> None:
    """Of two read transactions open on a replaced database's environment, the first to end leaves it open for the
    other; the last closes it, and a transaction begun afterwards is LMDB's error (which a dataset names)."""
    path = _database(tmp_path / "db.lmdb", _jpegs(2, seed=3))
    old = open_readonly(path)
    with read_transaction(old) as first:
        with read_transaction(old) as second:
            _replace_data_file(path, _jpegs(2, seed=4))
            assert open_readonly(path) is not old
            assert second.get(b"__meta__") is not None
        assert first.get(b"__meta__") is not None  # the other transaction ended; this one still reads
    with pytest.raises(lmdb.Error), read_transaction(old):
        pass


@pytest.mark.slow
def test_a_database_replaced_under_decoding_threads_never_crashes(tmp_path: Path) -> None:
    """Loader threads decode records straight from the memory map while the database is replaced and its path opened
    again, 12 times a run, 3 runs: each run ends with status 0, each thread reading the old file or told that it was
    replaced, never a checksum failure (bytes of two files mixed). Before: SIGSEGV in every run of 20."""
    script = Path(__file__).with_name("replaced_script.py")
    for run in range(3):
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        try:
            proc = subprocess.run(
                [sys.executable, str(script), str(folder), "12", "4"], capture_output=True, text=True, timeout=120
            )
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"run {run} did not end (a hang): {err.stdout!r}")
        assert proc.returncode == 0, f"run {run}: {_died(proc)}"
        summary = json.loads(proc.stdout.splitlines()[-1])
        assert summary["errors"] == [], summary
        assert summary["batches"] > 0, summary


# ---------------------------------------------------------------------------------------------------------------
# 2. A walk record only this user wrote is trusted
# ---------------------------------------------------------------------------------------------------------------


def _main_db_root(data: bytes, page_size: int) -> tuple[int, int]:
    """``(root page, depth)`` of the main DB from the newer of LMDB's two meta pages (LMDB 0.9, 64-bit)."""
    metas = []
    for page in (0, 1):
        main = 16 + page * page_size + 4 + 4 + 8 + 8 + 48  # page header; magic, version, address, map size, free DB
        depth = int(np.frombuffer(data, "<u2", 1, main + 6)[0])
        root = int(np.frombuffer(data, "<u8", 1, main + 40)[0])
        txnid = int(np.frombuffer(data, "<u8", 1, main + 56)[0])
        metas.append((txnid, root, depth))
    return max(metas)[1:]


def _damage_root_page(db: Path) -> None:
    """Make the main DB's root branch page claim a single key: a lookup through it aborts LMDB (an assertion)."""
    env = lmdb.open(str(db), readonly=True, lock=False)
    page_size = env.stat()["psize"]
    env.close()
    data_file = db / DATA_FILE
    root, depth = _main_db_root(data_file.read_bytes(), page_size)
    assert depth >= 2  # a branch page at the root
    with open(data_file, "r+b") as fh:  # mp_lower of the root page: one key instead of several
        fh.seek(root * page_size + 12)
        fh.write((16 + 2).to_bytes(2, "little"))


def _forge_record(db: Path) -> None:
    """A ``verified.json`` for ``db``'s data file as it is now, as ``store.format._write_marker`` writes one."""
    identity = store_environments._file_identity((db / DATA_FILE).stat())
    record = {DATA_FILE: identity, "database": str(db), "walked": "2026-01-01T00:00:00+00:00"}
    (db / VERIFIED_FILE).write_text(json.dumps(record))


# Opens a database, as this user, or (argv[2] = "pretend") as a user other than its folder's owner: without root a
# test cannot hand a folder over, so this process takes another uid for its own. Prints how the open ended.
_OPEN = textwrap.dedent(
    """
    import json, os, sys
    if sys.argv[2] == "pretend":
        real = os.geteuid()
        os.geteuid = lambda: real + 1
    from lightning_fastdata import FastDataError
    from lightning_fastdata.store.environments import read_meta
    try:
        read_meta(sys.argv[1])
        print(json.dumps({"outcome": "opened"}))
    except FastDataError as err:
        print(json.dumps({"outcome": type(err).__name__, "message": str(err)}))
    """
)


def test_a_forged_walk_record_in_someone_elses_folder_does_not_skip_the_walk(tmp_path: Path) -> None:
    """A damaged root page, and a ``verified.json`` copying the data file's inode, size and times, in a read-only
    folder of another user: the record is not trusted, so the walk runs and refuses the database with a clear
    ``DatasetFormatError``. Before, the walk was skipped and LMDB aborted the reading process (SIGABRT)."""
    db = _database(tmp_path / "theirs.lmdb", _jpegs(200))
    _damage_root_page(db)
    if IS_ROOT:  # before the record is forged: a chown changes the data file's ctime
        for path in (db, *db.iterdir()):
            os.chown(path, OTHER_UID, OTHER_UID)
    _forge_record(db)
    if IS_ROOT:
        os.chown(db / VERIFIED_FILE, OTHER_UID, OTHER_UID)
    before = sorted(p.name for p in db.iterdir())
    db.chmod(0o555)
    try:
        proc = _run_child(_OPEN, str(db), "real" if IS_ROOT else "pretend")
    finally:
        db.chmod(0o755)
    assert proc.returncode == 0, _died(proc)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["outcome"] == "DatasetFormatError", result
    assert "is damaged: walking its index pages crashed LMDB" in result["message"], result
    assert sorted(p.name for p in db.iterdir()) == before  # nothing written into their folder


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """The databases whose pages get walked from now on, in order (the walk itself still runs), with a cache of its
    own for records, and this process's environments and walks forgotten."""
    calls: list[Path] = []
    walk = store_environments._check_structure

    def counted(path: Path) -> bool:
        calls.append(path)
        return walk(path)

    monkeypatch.setattr(store_environments, "_check_structure", counted)
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(tmp_path / "cache"))
    _as_a_new_process(monkeypatch)
    return calls


def _as_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    store_environments._close_inherited()
    monkeypatch.setattr(store_environments, "_VERIFIED", set())


def _symlinked(record: Path) -> None:
    elsewhere = record.with_name("elsewhere.json")
    record.rename(elsewhere)
    record.symlink_to(elsewhere)


def _hard_linked(record: Path) -> None:
    os.link(record, record.with_name("another.json"))


def _given_away(record: Path) -> None:
    os.chown(record, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(
    "tamper",
    [
        _symlinked,
        _hard_linked,
        pytest.param(_given_away, marks=pytest.mark.skipif(not IS_ROOT, reason="only root can chown")),
    ],
)
def test_a_walk_record_this_user_did_not_write_is_walked_again(
    tmp_path: Path, walks: list[Path], monkeypatch: pytest.MonkeyPatch, tamper: Callable[[Path], None]
) -> None:
    """The record of a walk is trusted only as a regular file of this user's with one link: a symbolic link to a
    record, a second link of one, or one owned by someone else is ignored, and the data file walked again."""
    db = _database(tmp_path / "db.lmdb", _jpegs(4))
    open_readonly(db)
    _as_a_new_process(monkeypatch)
    open_readonly(db)
    assert walks == [db]  # recorded beside data.mdb, and trusted
    tamper(db / VERIFIED_FILE)
    _as_a_new_process(monkeypatch)
    open_readonly(db)
    assert walks == [db, db]


@pytest.mark.skipif(not IS_ROOT, reason="only root can hand a folder over to another user")
def test_a_database_in_someone_elses_folder_is_recorded_in_this_users_cache(
    tmp_path: Path, walks: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a folder another user owns (writable to root), no record is trusted or written: the walk is recorded in
    this user's cache, where the next open finds it."""
    db = _database(tmp_path / "db.lmdb", _jpegs(4))
    os.chown(db, OTHER_UID, OTHER_UID)
    for _ in range(2):
        open_readonly(db)
        _as_a_new_process(monkeypatch)
    assert walks == [db]
    assert not (db / VERIFIED_FILE).exists()
    assert len(list((tmp_path / "cache" / "verified").glob("*.json"))) == 1


# ---------------------------------------------------------------------------------------------------------------
# 3. Only regular files are opened
# ---------------------------------------------------------------------------------------------------------------

# Opens each database named on the command line, one JSON line each: a FIFO opened for reading would block the
# open(2) until a writer comes, so a regression hangs this child (and fails the test at its timeout), not pytest.
_OPEN_EACH = textwrap.dedent(
    """
    import json, sys
    from lightning_fastdata import FastDataError
    from lightning_fastdata.store.environments import read_meta
    for path in sys.argv[1:]:
        print(json.dumps({"path": path, "start": True}), flush=True)
        try:
            read_meta(path)
            print(json.dumps({"path": path, "outcome": "opened"}), flush=True)
        except FastDataError as err:
            print(json.dumps({"path": path, "outcome": type(err).__name__, "message": str(err)}), flush=True)
    """
)


def test_files_that_are_not_regular_files_are_never_opened(tmp_path: Path) -> None:
    """A FIFO named ``data.mdb`` is a clear ``DatasetFormatError`` at once (its open waited forever), as is a
    ``data.mdb`` linked to a character device (``/dev/zero``: before, LMDB's "not an LMDB file"). A FIFO named
    ``verified.json`` is not a record (the database is walked and opens), and a FIFO as a converter's lock file beside
    an incomplete conversion is no converter (it waited forever too)."""
    fifo = tmp_path / "fifo.lmdb"
    fifo.mkdir()
    os.mkfifo(fifo / DATA_FILE)
    device = tmp_path / "device.lmdb"
    device.mkdir()
    (device / DATA_FILE).symlink_to("/dev/zero")
    record_fifo = _database(tmp_path / "record.lmdb", _jpegs(2))
    os.mkfifo(record_fifo / VERIFIED_FILE)
    partial = hostile.write_database(tmp_path / ".half.lmdb.partial", [], ["a"], meta={"complete": False})
    os.mkfifo(store_format.lock_path(tmp_path / "half.lmdb"))
    cases = [fifo, device, record_fifo, partial]

    proc = _run_child(_OPEN_EACH, *map(str, cases))
    assert proc.returncode == 0, _died(proc)
    results = {line["path"]: line for line in map(json.loads, proc.stdout.splitlines()) if "outcome" in line}
    assert list(results) == list(map(str, cases)), proc.stdout
    fifo_result, device_result, record_result, partial_result = results.values()
    assert fifo_result["outcome"] == "DatasetFormatError"
    assert f"its {DATA_FILE} is a FIFO (named pipe), not the regular file LMDB writes" in fifo_result["message"]
    assert device_result["outcome"] == "DatasetFormatError"
    assert f"its {DATA_FILE} is a character device" in device_result["message"]
    assert record_result["outcome"] == "opened"
    assert partial_result["outcome"] == "DatasetFormatError"
    assert "left by a converter that is no longer running" in partial_result["message"]


def test_a_walk_record_is_read_only_up_to_its_size_limit(
    tmp_path: Path, walks: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``verified.json`` of 1 MiB, far more than any record this package writes (about 200 bytes), is not read at
    all: the data file is walked."""
    db = _database(tmp_path / "db.lmdb", _jpegs(2))
    open_readonly(db)
    record = json.loads((db / VERIFIED_FILE).read_text())
    record["padding"] = " " * (1 << 20)
    (db / VERIFIED_FILE).write_text(json.dumps(record))
    _as_a_new_process(monkeypatch)
    open_readonly(db)
    assert walks == [db, db]
