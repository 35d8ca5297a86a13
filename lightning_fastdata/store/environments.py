"""Opening a database read-only: one shared LMDB environment per data file per process, walked once before use.

:func:`open_readonly` opens (once per process) the environment of a database, after the first-open walk of its pages in
a throwaway child process, recorded in ``verified.json`` so that later opens skip it; :func:`read_transaction` reads
through it, holding forks back and the environment open meanwhile. :func:`read_meta` and :func:`read_sources` read a
database's metadata and sources through them. The on-disk layout they read is :mod:`~lightning_fastdata.store.format`'s.

LMDB refuses a second open of the same files in one process, so readers of one database (train and val, say) share an
environment. A forked child must not use its parent's environments: they are closed in the child right after the fork,
and reopened on first use. A database replaced at its path is reopened there; its old environment is closed once no
read transaction is open on it (:class:`_Holds`), never under one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb

from lightning_fastdata._files import file_kind, open_regular, owned, read_opened
from lightning_fastdata.errors import DatasetFormatError
from lightning_fastdata.store.format import (
    DATA_FILE,
    HEADER,
    LMDB_ENTRY_BYTES,
    META_KEY,
    VERIFIED_FILE,
    check_fits,
    default_cache_dir,
    load_meta,
    parse_json,
    sources_key,
)

log = logging.getLogger(__name__)

#: the most bytes a ``verified.json`` is read as: the record this package writes takes about 200
_MARKER_MAX_BYTES = 1 << 16

_ENVS: dict[str, tuple[tuple[int, int, int], lmdb.Environment]] = {}
_ENVS_LOCK = threading.Lock()

#: how long a fork waits for the other threads' read transactions to end (a batch's decode takes milliseconds)
FORK_WAIT_S = 30.0


class _ForkGate:
    """Holds a fork back until no other thread of this process is inside one of this package's LMDB transactions.

    py-lmdb (3.x) counts the calls in flight on each environment and closing one waits for the count to reach zero. A
    forked child inherits the count, but not the threads that would bring it down: had a loader thread been reading
    when the fork came (a threads engine's look-ahead, say, while worker processes start), closing the inherited
    environment in the child would wait forever. So every read transaction of the package runs inside :meth:`inside`,
    and a fork waits (up to :data:`FORK_WAIT_S`) until none does on another thread, new ones waiting meanwhile.
    Forks are counted, not flagged: two threads may fork at once, and the first to finish must not let transactions
    start while the second still waits for them to end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0  # threads inside a transaction
        self._forking = 0  # forks under way (in before_fork, or between it and after_fork_in_parent)
        self._depth = threading.local()  # this thread's nesting
        self.clean = True  # whether the last fork found no other thread inside

    @contextlib.contextmanager
    def inside(self) -> Any:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._forking:
                    self._cond.wait()
                self._inside += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._inside -= 1
                    if self._forking:  # a fork waits for this: from inside a transaction, for one left, not none
                        self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held through the fork: no transaction starts until it is done
        self._forking += 1
        own = 1 if getattr(self._depth, "n", 0) else 0  # the forking thread's own transaction is not in flight
        self._cond.wait_for(lambda: self._inside <= own, FORK_WAIT_S)
        self.clean = self._inside <= own

    def after_fork_in_parent(self) -> None:
        self._forking -= 1
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> bool:
        """Start afresh (the child's only thread is the forking one); whether the inherited environments are idle."""
        clean = self.clean
        depth = getattr(self._depth, "n", 0)
        self.__init__()  # type: ignore[misc]
        self._depth.n = depth
        self._inside = 1 if depth else 0
        return clean


class _Holds:
    """The read transactions open on each environment, and the environments of replaced databases still in use.

    A read transaction hands out views of the memory map, which a loader thread decodes with the GIL released
    (``simplejpeg``, OpenCV): closing the environment unmaps those pages under it, and the process dies (SIGSEGV).
    So when the database at a path is replaced and the path opened again, its old environment is only retired here:
    closed at once if no transaction is open on it, else by the thread that ends the last one. A dataset that reads
    through it afterwards finds it closed, and says the database was replaced
    (:func:`~lightning_fastdata.store.reader._read_failed`). Environments are closed under the lock:
    a transaction starting meanwhile waits, then finds the environment closed, never a map unmapped under it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}  # id(env): read transactions open on it (it is alive while they are)
        self._retired: dict[int, lmdb.Environment] = {}  # replaced at its path: closed when its last one ends

    @contextlib.contextmanager
    def holding(self, env: lmdb.Environment) -> Iterator[None]:
        """Keep ``env`` open (mapped) until the ``with`` block ends."""
        key = id(env)
        with self._lock:
            self._open[key] = self._open.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._open.pop(key, 1) - 1  # absent in a child forked inside the block: counts start afresh
                if left > 0:
                    self._open[key] = left
                elif key in self._retired:
                    self._retired.pop(key).close()

    def retire(self, env: lmdb.Environment) -> None:
        """Close ``env`` (replaced at its path) now if no transaction is open on it, else when the last one ends."""
        with self._lock:
            if self._open.get(id(env)):
                self._retired[id(env)] = env
            else:
                env.close()

    def after_fork_in_child(self) -> list[lmdb.Environment]:
        """Start afresh (the parent's other threads are gone); the retired environments, for the child to close."""
        retired = list(self._retired.values())
        self.__init__()  # type: ignore[misc]
        return retired


_GATE = _ForkGate()
_HOLDS = _Holds()
#: environments a child could not close (another thread was inside them at the fork): kept, never deallocated
_ABANDONED: list[lmdb.Environment] = []


@contextlib.contextmanager
def read_transaction(env: lmdb.Environment, buffers: bool = False) -> Any:
    """A read transaction of ``env`` that holds forks back until it ends (see :class:`_ForkGate`).

    ``env`` stays open meanwhile, even if its database is replaced and its path opened again (see :class:`_Holds`).

    Raises:
        lmdb.Error: ``env`` was closed: its database was replaced (or this process forked) since it was opened.

    """
    with _GATE.inside(), _HOLDS.holding(env):
        txn = env.begin(buffers=buffers)
        try:
            yield txn
        finally:
            txn.abort()  # read-only: nothing to commit


def _close_inherited() -> None:
    clean = _GATE.after_fork_in_child()
    for env in [env for _, env in _ENVS.values()] + _HOLDS.after_fork_in_child():
        if clean:
            env.close()
        else:  # closing would wait forever on the calls in flight in the parent's other threads
            _ABANDONED.append(env)
    _ENVS.clear()
    if not clean:
        log.warning(
            "a fork came while another thread held a database read open for over %.0f s: this child keeps the"
            " parent's LMDB environments open and cannot reopen them.",
            FORK_WAIT_S,
        )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_GATE.before_fork, after_in_parent=_GATE.after_fork_in_parent, after_in_child=_close_inherited
    )


def open_readonly(path: str | os.PathLike[str]) -> lmdb.Environment:
    """This process's read-only environment of the database at ``path`` (opened once, shared).

    Opened with ``readonly=True, lock=False, readahead=False, meminit=False``, on ``data.mdb`` itself
    (``subdir=False``): no lock file is written or named, so a read-only directory works, many processes can read at
    once, and the writer's ``lock.mdb`` beside it plays no part.

    The first open of a data file walks every lookup the reader will make in a throwaway child process, so that
    damaged LMDB pages (which crash LMDB itself) are a :class:`DatasetFormatError` here instead of a crash in
    training. A walk that passes is recorded in ``verified.json`` beside ``data.mdb`` (or, where the database's
    directory is read-only or another user's, under ``default_cache_dir()/verified``) with the data file's inode,
    size, mtime and ctime; later opens by any process of this user that find the same identity skip the walk, and any
    change to the file walks it again. A record is trusted only where this user wrote it: a regular file of theirs,
    with one link, in their cache or in a database folder they own; one shipped in someone else's folder is ignored
    (:func:`_marker_paths`). A record that cannot be written costs only speed: the next process walks again.

    Once the database at ``path`` is replaced (re-converted, copied over), the next open returns a new environment;
    the old one stays open until no read transaction is open on it, then is closed (:class:`_Holds`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetFormatError: ``path`` is not an LMDB database directory, its ``data.mdb`` is not a regular file (a FIFO
            or a device, never opened: opening a FIFO would wait forever), or its pages are damaged.

    """
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(
            f"{str(path)!r} does not exist. Create a database with `lightning-fastdata convert SRC {path}`."
        )
    data = path / DATA_FILE
    try:
        st = data.stat()
    except OSError:
        raise DatasetFormatError(
            f"{str(path)!r} is not a lightning_fastdata database (no {DATA_FILE} in it)."
            " Create one with `lightning-fastdata convert SRC DST` and pass DST."
        ) from None
    if not stat.S_ISREG(st.st_mode):  # checked before LMDB opens it: the open of a FIFO waits for a writer
        raise DatasetFormatError(
            f"{str(path)!r} is not a lightning_fastdata database: its {DATA_FILE} is {file_kind(st.st_mode)}, not the"
            " regular file LMDB writes. Convert the source again with `lightning-fastdata convert`, or copy the"
            " database again from an intact copy."
        )
    # the size too: a data file cut short in place (same inode) must be checked again, not read past its end
    identity = (st.st_dev, st.st_ino, st.st_size)
    with _ENVS_LOCK:
        cached = _ENVS.get(str(path))
        if cached is not None and cached[0] == identity:
            return cached[1]
        if cached is not None:  # the database was replaced (re-converted) or its file changed size since we opened it
            del _ENVS[str(path)]
            _HOLDS.retire(cached[1])  # closed once no read transaction is open on it: never unmapped under a reader
        try:
            # the data file itself (``subdir=False``): py-lmdb knows an open environment by the inodes of its data and
            # lock files, and refuses a second open of either in one process. A reader never locks, nor holds a lock
            # file open: named, a deleted database's lock file would leave its inode to a new file, which would then
            # be refused as "already open in this process". The data file it holds open, so its inode stays its own.
            env = lmdb.open(
                str(data), readonly=True, lock=False, readahead=False, meminit=False, subdir=False, max_spare_txns=4
            )
        except lmdb.Error as err:
            raise DatasetFormatError(f"{str(path)!r} cannot be opened as an LMDB database: {err}") from err
        _check_size(env, st.st_size, path)
        try:
            _verify_once(path, st)
        except DatasetFormatError:
            env.close()
            raise
        _ENVS[str(path)] = (identity, env)
        return env


#: how long the first-open walk of a data file may take; a database of 1.28 million records takes seconds
WALK_TIMEOUT_S = 3600.0
#: data files (device, inode, size, mtime, ctime) whose LMDB pages were walked without a crash, here or in a parent
_VERIFIED: set[tuple[int, int, int, int, int]] = set()


def _file_identity(st: os.stat_result) -> dict[str, int]:
    """What must stay the same for a walk of a data file to hold: any write changes the mtime or the ctime."""
    return {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _verify_once(path: Path, st: os.stat_result) -> None:
    """Walk the pages of ``path`` unless this file, unchanged, was walked before (in any process of this user)."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _VERIFIED:
        return
    identity = _file_identity(st)
    if any(_read_marker(marker) == identity for marker in _marker_paths(path, st)):
        _VERIFIED.add(key)
        return
    if not _check_structure(path):
        return  # not a complete database of ours: nothing was walked, so nothing is recorded
    try:
        after = (path / DATA_FILE).stat()
    except OSError:
        return
    if _file_identity(after) != identity:
        return  # the file changed while it was walked: the next open walks it again
    _VERIFIED.add(key)
    _write_marker(path, st, identity)


def _marker_paths(path: Path, st: os.stat_result) -> list[Path]:
    """Where the walk of ``path`` is recorded, and trusted: this user's own places, never someone else's.

    In the database's folder if this user owns it, and in the user's cache (per device and inode). A record in a
    folder someone else owns is neither trusted nor written: whoever made the database there could have copied its
    data file's inode, size and times into one, and so skipped the walk that would refuse its damaged pages.
    """
    digest = hashlib.sha256(f"{path}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()[:32]
    in_cache = default_cache_dir() / "verified" / f"{digest}.json"
    try:
        mine = owned(path.stat())
    except OSError:
        mine = False
    return [path / VERIFIED_FILE, in_cache] if mine else [in_cache]


def _writable(folder: Path) -> bool:
    """Whether to write into ``folder``: not when its mode says read-only, even to root, who could."""
    try:
        return bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def _read_marker(marker: Path) -> dict[str, Any] | None:
    """The data file's identity that a record of a walk holds, if this user wrote the record, else ``None``.

    Only a regular file of this user's with no other link (not a symbolic link, FIFO or device, nor a link to a file
    written for another database) is read, and only up to its size: :data:`_MARKER_MAX_BYTES` at most.
    """
    try:
        fd, st = open_regular(marker, follow_links=False)
    except OSError:
        return None
    try:
        if not owned(st) or st.st_nlink != 1 or st.st_size > _MARKER_MAX_BYTES:
            return None
        raw = read_opened(fd, st)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        record = parse_json(raw.decode())
    except ValueError:
        return None
    return record.get(DATA_FILE) if isinstance(record, dict) else None


def _write_marker(path: Path, st: os.stat_result, identity: dict[str, int]) -> None:
    """Record the walk atomically (a temporary file renamed into place) in the first place that can be written.

    Its places are :func:`_marker_paths`'s: this user's own, where a later open trusts it.
    """
    record = {
        DATA_FILE: identity,
        "database": str(path),
        "walked": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for marker in _marker_paths(path, st):
        tmp = None
        if marker.parent == path and not _writable(path):
            continue
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{marker.name}.", suffix=".tmp", dir=marker.parent)
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, marker)
            return
        except OSError as err:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            log.debug("cannot record the verification of %s in %s: %s", path, marker, err)


# Runs in a fresh interpreter that imports only lmdb: it looks up every key the reader will ever ask for, the way the
# reader does (values as views: record bytes are not read; their CRC covers them, and a missing or damaged record is
# reported when it is read, naming its split and index). LMDB trusts its own B-tree pages, so a damaged branch or
# leaf page can abort or SIGBUS the process that walks it; here that process is a throwaway child, and its death
# becomes a clear error at open instead of a crash in training. Exit status 3: not a complete database of ours, or
# metadata that claims more records than the file can hold (argv[2]: the bytes each takes beside its key, as
# _min_record_bytes counts them), nothing walked: the walk's time is bounded by the file's size, not by a claim.
_STRUCTURE_CHECK = r"""
import json, os, sys
import lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, readahead=False, meminit=False, subdir=True)
with env.begin(buffers=True) as txn:
    raw = txn.get(b"__meta__")
    try:
        meta = json.loads(bytes(raw).decode())
        assert meta["complete"] is True
        lengths = {str(name): info["length"] for name, info in meta["splits"].items()}
        assert all(type(length) is int and length >= 0 for length in lengths.values())
        least = sum(n * (len(f"{name}/{0:010d}".encode()) + int(sys.argv[2])) for name, n in lengths.items())
        assert least <= os.path.getsize(os.path.join(sys.argv[1], "data.mdb"))
    except Exception:
        sys.exit(3)  # not ours, incomplete, unreadable or impossible metadata: read_meta says which, clearly
    for name, length in lengths.items():
        txn.get(f"__labels__/{name}".encode())
        for part in ("", "/offsets", "/indices"):  # the arrays of the other target kinds (store/targets.py)
            txn.get(f"__targets__/{name}{part}".encode())
        txn.get(f"__sources__/{name}".encode())
        for i in range(length):
            txn.get(f"{name}/{i:010d}".encode())  # a view: walks the pages, reads no record bytes
"""


def _check_structure(path: Path) -> bool:
    """Walk every lookup of the database in a child process; if LMDB crashes on it, raise a clear error instead.

    Returns:
        Whether the pages were walked (``False``: not a complete database of ours; :func:`load_meta` says why).

    """
    import signal
    import subprocess
    import sys

    per_record = str(HEADER.size + LMDB_ENTRY_BYTES)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _STRUCTURE_CHECK, str(path), per_record],
            capture_output=True,
            text=True,
            timeout=WALK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise DatasetFormatError(
            f"{str(path)!r} could not be checked: walking its LMDB pages took over {WALK_TIMEOUT_S:.0f} s, which a"
            " local disk does in seconds. Copy the database to a local disk and open it there; if that times out too,"
            " it is damaged: convert the source again."
        ) from None
    if proc.returncode in (0, 3):
        return proc.returncode == 0
    last_line = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        detail = f"walking its index pages crashed LMDB ({name}{': ' + last_line if last_line else ''})"
    else:
        detail = proc.stdout.strip() or last_line or f"the check exited with status {proc.returncode}"
    raise DatasetFormatError(
        f"{str(path)!r} is damaged: {detail}. Its LMDB pages were overwritten after conversion; convert the source"
        " again, or copy the database again."
    )


def _check_size(env: lmdb.Environment, size: int, path: Path) -> None:
    """Refuse a data file shorter than the pages LMDB says it uses: reading past its end would crash (SIGBUS)."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < needed:
        env.close()
        raise DatasetFormatError(
            f"{str(path)!r} is truncated: {DATA_FILE} has {size} bytes but its pages need {needed}. The file was"
            " cut short after conversion (a failed copy or a full disk); convert the source again, or copy the"
            " database again."
        )


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated metadata of the database at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetFormatError: ``path`` is not a complete lightning_fastdata database of a readable version, or its
            metadata claims more records than its data file can hold.

    """
    env = open_readonly(path)
    try:
        with read_transaction(env) as txn:
            raw = txn.get(META_KEY)
        size = (Path(path).expanduser() / DATA_FILE).stat().st_size
    except (lmdb.Error, OSError) as err:
        raise DatasetFormatError(f"reading the metadata of {os.fspath(path)!r} failed: {err}") from err
    meta = load_meta(raw, path)
    check_fits(meta, path, size)
    return meta


def read_sources(path: str | os.PathLike[str], split: str = "train") -> list[str] | None:
    """Where each record of ``split`` came from, in record order; ``None`` for databases written before sources.

    Each entry is the record's path relative to the converted folder, its path as written in a list file, or its index
    in a converted dataset. Convert an older database again to add them.

    Raises:
        ValueError: ``split`` is not in the database.
        DatasetFormatError: the database is not usable, or its list of sources is damaged.

    """
    splits = read_meta(path)["splits"]
    if split not in splits:
        raise ValueError(f"`split` {split!r} is not in {os.fspath(path)!r}; it holds {sorted(splits)}.")
    try:
        with read_transaction(open_readonly(path)) as txn:
            raw = txn.get(sources_key(split))
    except lmdb.Error as err:
        raise DatasetFormatError(f"reading the sources of {os.fspath(path)!r} failed: {err}") from err
    if raw is None:
        return None
    try:
        sources = parse_json(bytes(raw).decode())
    except ValueError as err:
        raise DatasetFormatError(f"the sources of split {split!r} of {os.fspath(path)!r} are damaged: {err}") from err
    if not isinstance(sources, list) or len(sources) != int(splits[split]["length"]):
        raise DatasetFormatError(f"the sources of split {split!r} of {os.fspath(path)!r} are damaged.")
    return [str(item) for item in sources]
