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
``verified.json`` where the reading user owns the folder, else in that user's cache (see
:func:`~lightning_fastdata.store.environments.open_readonly`, which opens a database this module describes).

Nothing is ever unpickled: reading a database someone else made runs none of their code.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_fastdata._files import open_regular
from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError
from lightning_fastdata.store.targets import TargetSpec

try:  # advisory locks between converters, and readers asking whether one is at work (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


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

ENCODING_JPEG = 1
ENCODING_PNG = 2
ENCODING_RAW = 3  # uint8 RGB pixels, row-major HWC: no decode at read time
ENCODING_NAMES = {ENCODING_JPEG: "jpeg", ENCODING_PNG: "png", ENCODING_RAW: "raw"}

#: magic, format version, encoding, label, height, width, crc32 of (header without crc + payload)
HEADER = struct.Struct("<2sBBiIII")
#: the largest side a record may have: JPEG's (its frame header stores each side in 16 bits)
MAX_SIDE = 65535
#: what LMDB stores beside each key and value in a page: an 8-byte node header and a 2-byte slot in the page's index
LMDB_ENTRY_BYTES = 10


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
    return len(record_key(split, 0)) + HEADER.size + LMDB_ENTRY_BYTES


def check_fits(meta: dict[str, Any], path: str | os.PathLike[str], size: int) -> None:
    """Refuse split lengths a data file of ``size`` bytes cannot hold: each record takes :func:`_min_record_bytes`.

    A length beyond that would have a reader sample, allocate for and walk records that cannot be there. (Records
    that are missing under a length that fits are each a ``CorruptRecordError`` when read, as damage is.)
    """
    lengths = {name: info["length"] for name, info in meta["splits"].items()}
    if sum(length * _min_record_bytes(name) for name, length in lengths.items()) > size:
        claimed = " and ".join(f"{length:,} records in split {name!r}" for name, length in lengths.items())
        raise DatasetFormatError(
            f"the metadata of {os.fspath(path)!r} claims {claimed}, more than its {DATA_FILE} of {size:,} bytes can"
            f" hold (a record takes {HEADER.size + LMDB_ENTRY_BYTES} bytes beside its key): it is damaged or forged."
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
