"""The on-disk layout of a lightning_fastdata image database, shared by the writer and the reader.

A database is an LMDB environment directory (``data.mdb`` + ``lock.mdb``) holding:

* one record per image under the key ``b"<split>/<index:010d>"``: a fixed 20-byte little-endian header followed
  by the encoded image bytes (see :data:`HEADER`);
* the labels of each split as a packed ``int32`` array under ``b"__labels__/<split>"``, or, for the other target
  kinds, typed arrays under ``b"__targets__/<split>..."`` (:mod:`~lightning_fastdata.store.targets`: the kind is
  ``meta["targets"]``);
* where each record came from, as a UTF-8 JSON list of strings under ``b"__sources__/<split>"`` (the path relative to
  the source folder, the path as listed, or the index in a dataset), in record order;
* the dataset metadata as UTF-8 JSON under ``b"__meta__"``, written in the last transaction with
  ``"complete": true``.

Beside a database ``DST`` a conversion keeps, while it runs, the hidden working copy ``.DST.partial`` (renamed to
``DST`` when complete) and the lock file ``.DST.lock``, which holds the converter's process id and host as JSON and
is removed when the conversion ends. A database opened once records that its LMDB pages were walked in
``verified.json`` where the reading user owns the folder, else in that user's cache (see :func:`open_readonly`).

Nothing is ever unpickled: reading a database someone else made runs none of their code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb

from lightning_fastdata._files import file_kind, open_regular, owned, read_opened
from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError
from lightning_fastdata.store.targets import TargetSpec

try:  # advisory locks between converters, and readers asking whether one is at work (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"LF"
META_KEY = b"__meta__"
DATA_FILE = "data.mdb"
REPORT_FILE = "convert_report.json"
#: in a copy staged from a bucket (:mod:`~lightning_fastdata.store.remote`): its URL and the marker it was staged from
STAGED_RECORD = "staged.json"
#: in the working copy of a staging (``.NAME.partial``): the publication it belongs to and the ranges already fetched
PROGRESS_FILE = "progress.json"
#: beside ``data.mdb``: the identity of the data file whose LMDB pages were walked without a crash
VERIFIED_FILE = "verified.json"
#: the most bytes a ``verified.json`` is read as: the record this package writes takes about 200
_MARKER_MAX_BYTES = 1 << 16

ENCODING_JPEG = 1
ENCODING_PNG = 2
ENCODING_RAW = 3  # uint8 RGB pixels, row-major HWC: no decode at read time
ENCODING_NAMES = {ENCODING_JPEG: "jpeg", ENCODING_PNG: "png", ENCODING_RAW: "raw"}

#: magic, format version, encoding, label, height, width, crc32 of (header without crc + payload)
HEADER = struct.Struct("<2sBBiIII")
#: the largest side a record may have: JPEG's (its frame header stores each side in 16 bits)
MAX_SIDE = 65535
#: what LMDB stores beside each key and value in a page: an 8-byte node header and a 2-byte slot in the page's index
_LMDB_ENTRY_BYTES = 10


def record_key(split: str, index: int) -> bytes:
    """The LMDB key of sample ``index`` of ``split``: computed, so the reader keeps no key list."""
    return f"{split}/{index:010d}".encode()


def labels_key(split: str) -> bytes:
    """The LMDB key of the packed ``int32`` label array of ``split``."""
    return f"__labels__/{split}".encode()


def sources_key(split: str) -> bytes:
    """The LMDB key of the JSON list of ``split``'s source names (relative paths, listed paths or dataset indices)."""
    return f"__sources__/{split}".encode()


@dataclass(frozen=True)
class RecordHeader:
    """The decoded fixed header of one record."""

    encoding: int
    label: int
    height: int
    width: int


def _checksum(encoding: int, label: int, height: int, width: int, payload: bytes | memoryview) -> int:
    head = HEADER.pack(MAGIC, FORMAT_VERSION, encoding, label, height, width, 0)
    return zlib.crc32(payload, zlib.crc32(head))


def pack_record(encoding: int, label: int, height: int, width: int, payload: bytes) -> bytes:
    """Serialize one image record: the fixed header, then the encoded image bytes."""
    crc = _checksum(encoding, label, height, width, payload)
    return HEADER.pack(MAGIC, FORMAT_VERSION, encoding, label, height, width, crc) + payload


def unpack_record(record: bytes | memoryview, verify: bool = True) -> tuple[RecordHeader, memoryview]:
    """Parse a record into its header and a view of the encoded image bytes.

    Raises:
        CorruptRecordError: the record is too short, has a bad magic, version or encoding, fails its checksum,
            declares a side outside 1 to :data:`MAX_SIDE`, or is a raw record whose payload is not its
            ``height * width * 3`` bytes.

    """
    view = memoryview(record)
    if len(view) < HEADER.size:
        raise CorruptRecordError(f"record is {len(view)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, encoding, label, height, width, crc = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad record magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptRecordError(f"record format version {version}, this package reads version {FORMAT_VERSION}")
    if encoding not in ENCODING_NAMES:
        raise CorruptRecordError(f"unknown image encoding code {encoding}")
    payload = view[HEADER.size :]
    if verify and _checksum(encoding, label, height, width, payload) != crc:
        raise CorruptRecordError("checksum mismatch: the record was modified or truncated after conversion")
    # checked before anything is allocated for the image: a forged header (with a valid checksum) must not size a buffer
    if not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
        raise CorruptRecordError(f"the header declares a {height}x{width} image; each side must be 1 to {MAX_SIDE}")
    if encoding == ENCODING_RAW and len(payload) != height * width * 3:
        raise CorruptRecordError(
            f"a raw {height}x{width} RGB record needs {height * width * 3} bytes, found {len(payload)}"
        )
    return RecordHeader(encoding, label, height, width), payload


def parse_json(text: str | bytes, **hooks: Any) -> Any:
    """``json.loads`` for JSON from elsewhere (a database's metadata and sources, a marker or list file).

    ``hooks``: ``json.loads``'s ``parse_int``, ``parse_float``... (a list file keeps its numbers' text).

    Raises:
        ValueError: the text is not JSON (``json.JSONDecodeError``), not UTF-8 (``UnicodeDecodeError``), or nests its
            arrays and objects too deeply to parse, which ``json.loads`` raises as a ``RecursionError``.

    """
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise ValueError("its arrays and objects nest too deeply to parse") from None


def dump_meta(meta: dict[str, Any]) -> bytes:
    """Serialize the dataset metadata (JSON, never pickle)."""
    return json.dumps(meta, sort_keys=True).encode()


def load_meta(raw: bytes | None, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and validate the dataset metadata read from ``path``.

    Raises:
        DatasetFormatError: no metadata (not our database), unreadable JSON, an unknown format version, a
            conversion that never finished, or classes, splits, encoding or source not of the shapes the writer
            writes.

    """
    if raw is None:
        raise DatasetFormatError(
            f"{os.fspath(path)!r} is an LMDB database but not one made by lightning_fastdata (no `__meta__` record)."
            " Create one with `lightning-fastdata convert SRC DST`."
        )
    try:
        meta = parse_json(bytes(raw).decode())
    except ValueError as err:
        raise DatasetFormatError(
            f"the metadata of {os.fspath(path)!r} is not valid JSON ({err}); the database is damaged."
            " Convert the source again with `lightning-fastdata convert`."
        ) from err
    if not isinstance(meta, dict):
        raise DatasetFormatError(f"the metadata of {os.fspath(path)!r} is not a JSON object; the database is damaged.")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetFormatError(
            f"{os.fspath(path)!r} has format version {version!r}, this lightning_fastdata reads version"
            f" {FORMAT_VERSION}. Convert the source again with this version, or install the version that wrote it."
        )
    if meta.get("complete") is not True:
        raise DatasetFormatError(_incomplete_message(Path(path)))
    _check_shapes(meta, path)
    return meta


def _check_shapes(meta: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Refuse metadata whose classes, splits, encoding or source are not of the shapes the writer writes."""
    classes, splits = meta.get("classes"), meta.get("splits")
    problem = None
    if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
        problem = "`classes` is not a list of names"
    elif not isinstance(meta.get("encoding", {}), dict) or not isinstance(meta.get("source", {}), dict):
        problem = "`encoding` or `source` is not an object"
    elif not isinstance(splits, dict):
        problem = "`splits` is not an object"
    else:
        for name, info in splits.items():
            length = info.get("length") if isinstance(info, dict) else None
            counts = info.get("class_counts") if isinstance(info, dict) else None
            if not _is_count(length):
                problem = f"split {name!r} has length {length!r}"
            elif not isinstance(counts, list) or len(counts) != len(classes) or not all(map(_is_count, counts)):
                problem = f"split {name!r} does not count its records per class"
            if problem:
                break
    if not problem:
        TargetSpec.from_meta(meta, os.fspath(path))  # a target kind of a shape the writer writes
    if problem:
        raise DatasetFormatError(
            f"the metadata of {os.fspath(path)!r} is damaged: {problem}. Convert the source again with"
            " `lightning-fastdata convert`, or copy the database again from an intact copy."
        )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _min_record_bytes(split: str) -> int:
    """The fewest bytes one record of ``split`` takes in an LMDB data file: its key, its header, LMDB's entry."""
    return len(record_key(split, 0)) + HEADER.size + _LMDB_ENTRY_BYTES


def _check_fits(meta: dict[str, Any], path: str | os.PathLike[str], size: int) -> None:
    """Refuse split lengths a data file of ``size`` bytes cannot hold: each record takes :func:`_min_record_bytes`.

    A length beyond that would have a reader sample, allocate for and walk records that cannot be there. (Records
    that are missing under a length that fits are each a ``CorruptRecordError`` when read, as damage is.)
    """
    lengths = {name: info["length"] for name, info in meta["splits"].items()}
    if sum(length * _min_record_bytes(name) for name, length in lengths.items()) > size:
        claimed = " and ".join(f"{length:,} records in split {name!r}" for name, length in lengths.items())
        raise DatasetFormatError(
            f"the metadata of {os.fspath(path)!r} claims {claimed}, more than its {DATA_FILE} of {size:,} bytes can"
            f" hold (a record takes {HEADER.size + _LMDB_ENTRY_BYTES} bytes beside its key): it is damaged or forged."
            " Convert the source again with `lightning-fastdata convert`, or copy the database again from an intact"
            " copy."
        )


# ---------------------------------------------------------------------------------------------------------------
# Where things live beside a database, and who is converting it
# ---------------------------------------------------------------------------------------------------------------


def partial_path(dst: Path) -> Path:
    """The hidden working copy a conversion to ``dst`` writes, renamed to ``dst`` when complete."""
    return dst.parent / f".{dst.name}.partial"


def default_cache_dir() -> Path:
    """Where converted databases go by default: ``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache/lightning_fastdata``."""
    env = os.environ.get("LIGHTNING_FASTDATA_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_fastdata"


def lock_path(dst: Path) -> Path:
    """The lock file a conversion to ``dst`` holds while it runs (JSON: the converter's pid, host and start)."""
    return dst.parent / f".{dst.name}.lock"


def target_of_partial(path: Path) -> Path | None:
    """The database a working copy ``.NAME.partial`` becomes (``NAME`` beside it), or ``None`` for other paths."""
    name = path.name
    if name.startswith(".") and name.endswith(".partial") and len(name) > len("..partial"):
        return path.parent / name[1 : -len(".partial")]
    return None


def converter_of(dst: Path) -> dict[str, Any] | None:
    """The converter now writing ``dst`` (``{"pid": ..., "host": ..., "started": ...}``), or ``None`` if none is.

    A converter holds an exclusive ``flock`` on :func:`lock_path` for as long as it runs; the lock dies with its
    process, so a lock file nobody holds (left by a killed converter) means no conversion is under way.
    """
    if fcntl is None:  # pragma: no cover - Windows
        return None
    try:  # read-only, so a read-only folder works; a FIFO there is never opened
        fd, _ = open_regular(lock_path(dst))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                info = parse_json(fh.read(4096).decode() or "{}")
            except ValueError:
                info = {}
            return info if isinstance(info, dict) else {}
        except OSError:
            return None
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def converter_record() -> bytes:
    """What a converter writes into the lock file it holds: its pid, host and start time, as JSON."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()


def describe_converter(info: dict[str, Any]) -> str:
    """``"process 1234 on host h (started ...)"`` from what :func:`converter_of` returned."""
    text = f"process {info['pid']}" if "pid" in info else "another process"
    if info.get("host") and info["host"] != socket.gethostname():
        text += f" on host {info['host']}"
    return text + (f" (started {info['started']})" if info.get("started") else "")


def _incomplete_message(path: Path) -> str:
    """Why ``path`` (incomplete) cannot be read: a conversion is writing it, or one was interrupted."""
    target = target_of_partial(path.absolute())
    info = converter_of(target) if target is not None else None
    if target is not None and info is not None:
        return (
            f"{os.fspath(path)!r} is being converted by {describe_converter(info)}: it is the working copy of"
            f" {str(target)!r}, which appears when the conversion finishes. Wait for it, then open {str(target)!r}."
        )
    if target is not None:
        return (
            f"{os.fspath(path)!r} is an incomplete conversion of {str(target)!r} left by a converter that is no longer"
            " running (it was interrupted or failed). Run `lightning-fastdata convert` again (it starts over), or"
            f" remove it with `lightning-fastdata convert --clean {str(path.absolute().parent)!r}`."
        )
    return (
        f"{os.fspath(path)!r} is an incomplete conversion (it was interrupted or failed)."
        " Run `lightning-fastdata convert` again: it starts over and replaces it."
    )


# ---------------------------------------------------------------------------------------------------------------
# Read-only environments: one per database file per process
# ---------------------------------------------------------------------------------------------------------------
# LMDB refuses a second open of the same files in one process, so readers of one database (train and val, say)
# share an environment. A forked child must not use its parent's environments: they are closed in the child right
# after the fork, and reopened on first use. A database replaced at its path is reopened there; its old environment
# is closed once no read transaction is open on it (:class:`_Holds`), never under one.

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
    (:meth:`~lightning_fastdata.store.reader.LmdbImageDataset._read_failed`). Environments are closed under the lock:
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

    per_record = str(HEADER.size + _LMDB_ENTRY_BYTES)
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
    _check_fits(meta, path, size)
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
