"""Where lightning_fastdata keeps what it makes for you: the cache folder, the conversions in it, and their upkeep.

``FastImageDataModule`` converts an image folder (or list file) once into ``<cache>/<name>-<digest>.lmdb``, the digest
keyed by the source's path and the conversion settings, so changing a setting converts into a new slot and switching
back finds the earlier conversion up to date. The same folder holds the ``num_workers="tune"`` picks, the records of
databases verified in read-only folders, and the CLI's cached ``--help`` texts.

Each conversion ``NAME`` there may have a sibling ``.NAME.used``: its modification time is the conversion's last use
(touched once each time a DataModule opens it, never per sample), and every process reading the conversion holds a
shared ``flock`` on it for as long as it lives, so :func:`remove_conversion` can tell a conversion in use from an idle
one. :func:`list_conversions`, :func:`remove_conversion` and :func:`prune_cache` are the ``lightning-fastdata cache``
command.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lightning_fastdata.errors import DatasetFormatError, DestinationError, InvalidArgumentError
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.format import (
    DATA_FILE,
    STAGED_RECORD,
    converter_of,
    default_cache_dir,
    describe_converter,
    partial_path,
    target_of_partial,
)
from lightning_fastdata.store.leftovers import clean_stale_conversions, stale_conversions
from lightning_fastdata.store.ondisk import (
    foreign_kind,
    open_own,
    read_only_error,
    read_small,
    target_lock,
    write_own,
)
from lightning_fastdata.store.summary import human_bytes
from lightning_fastdata.store.targets import TargetSpec

try:  # shared locks held by readers, an exclusive one taken by a removal (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

#: the settings a DataModule's conversion is keyed by, as stored under ``encoding`` in a database's metadata
SETTINGS = ("short_side", "quality", "encoding", "keep_original")

#: the most bytes read of a JSON file in the cache (a conversion report, a staged copy's record, the registry): a
#: report lists every skipped and ignored file, some 100 bytes each; a larger file is not read (a report: the
#: metadata is read from the database itself)
MAX_JSON_BYTES = 64 << 20


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The absolute cache folder: ``cache_dir`` (``~`` expanded) when given, else :func:`default_cache_dir`."""
    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()).absolute()


def converted_path(
    source: Path,
    root: Path,
    short_side: int | None,
    quality: int,
    encoding: str,
    targets: str | None = None,
    label_separator: str = "|",
) -> Path:
    """The database under ``root`` that the source ``source`` (an absolute path) converts into with these settings.

    ``targets`` (and, for ``multilabel``, ``label_separator``) are part of the key when they change what is stored:
    a kind other than classes (``None``, inferred, stores classes or refuses) never shares a slot with another.
    """
    settings: list[Any] = [str(source), short_side, quality, encoding]
    if targets not in (None, "class"):
        settings.append(targets if targets != "multilabel" else [targets, label_separator])
    key = json.dumps(settings)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return root / f"{source.name}-{digest}.lmdb"


# ---------------------------------------------------------------------------------------------------------------
# Last use, and who is reading
# ---------------------------------------------------------------------------------------------------------------


def use_path(database: Path) -> Path:
    """The file whose mtime is ``database``'s last use, and on which its readers hold a shared lock."""
    return database.parent / f".{database.name}.used"


#: the use files this process holds a shared lock on, for its lifetime (as it keeps the databases' environments open)
_HELD: dict[str, IO[bytes]] = {}


@atexit.register
def _close_held() -> None:
    """Close the use files at exit (no unlock: a forked child's close leaves its parent's lock in place)."""
    for held in _HELD.values():
        held.close()
    _HELD.clear()


def record_use(database: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
    """Note that this process reads ``database`` now: touch its use file and hold a shared lock on it.

    Does nothing for a database outside the cache folder ``root`` (default :func:`cache_root`), and costs nothing
    but speed where the use file cannot be written (a read-only cache): the conversion's last use is then its
    conversion time. Called once per ``setup``, never per sample.
    """
    database = Path(database).expanduser().absolute()
    if database.parent != cache_root(root):
        return
    path = use_path(database)
    try:
        held = _HELD.get(str(path))
        if held is None or held.closed:
            held = _open_use_file(path)  # held for this process's lifetime, like the LMDB environment
            if fcntl is not None:  # waits only while a removal (or `cache list`'s probe) holds it exclusively
                fcntl.flock(held, fcntl.LOCK_SH)
            _HELD[str(path)] = held
        os.utime(held.fileno() if os.utime in os.supports_fd else path)  # the file held, not where a link points
    except OSError as err:
        log.debug("cannot record the use of %s in %s: %s", database, path, err)
    except DestinationError as err:  # the data is read; its use is not recorded
        # another user's use file (a cache folder shared by users) is theirs, as before; a link, a hard link or a
        # folder there no reader of this package made: said
        with contextlib.suppress(OSError):
            found = os.lstat(path)
            if foreign_kind(found) == f"owned by another user (uid {found.st_uid})":
                log.debug("cannot record the use of %s: %s", database, err)
                return
        log.warning("cannot record the use of %s: %s", database, err)


def _open_use_file(path: Path) -> IO[bytes]:
    """The use file ``path`` opened to append (made if missing), only as this user's own regular file, never a link.

    Raises:
        DestinationError: ``path`` is a symbolic link (a dangling one would make a file wherever it points), a hard
            link, not a regular file, or another user's file.
        OSError: it cannot be opened (a read-only cache).

    """
    return os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND), "ab")


@contextlib.contextmanager
def _no_readers(database: Path) -> Iterator[bool]:
    """Hold the use file of ``database`` exclusively while the block runs; yields whether no process reads it.

    Raises:
        DestinationError: the use file is a symbolic link, a hard link, not a regular file, or another user's: it is
            never written or locked through, so whether a process reads ``database`` cannot be known.

    """
    if fcntl is None:  # pragma: no cover - Windows: readers cannot be known
        yield True
        return
    try:
        fh = _open_use_file(use_path(database))  # closed below; a planted file is refused: whether one reads is unknown
    except OSError:
        yield True  # a read-only cache folder: no reader could have recorded itself there
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def in_use(database: Path) -> bool:
    """Whether a live process reads ``database`` (holds the shared lock :func:`record_use` takes).

    ``False`` when its use file is a link, a hard link or another user's: :func:`record_use` locks no such file.
    """
    if not use_path(database).exists():
        return False
    try:
        with _no_readers(database) as free:
            return not free
    except DestinationError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# What the cache holds
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedConversion:
    """One conversion in the cache folder, as ``lightning-fastdata cache list`` shows it."""

    #: the database directory
    path: Path
    #: its name without ``.lmdb``: what ``cache remove`` takes
    key: str
    #: the converted folder or list file (``None``: unknown, the metadata cannot be read)
    source: str | None
    #: ``short_side``, ``quality``, ``encoding``, ``keep_original`` as converted
    settings: dict[str, Any]
    #: bytes on disk
    size: int
    #: when a DataModule last opened it, else when it was converted (seconds since the epoch)
    last_used: float
    #: ``"complete"``, ``"being written by process N ..."``, ``"incomplete"`` (a dead converter's leftover), or
    #: ``"damaged: ..."``
    state: str
    #: whether a live process reads it
    in_use: bool
    #: the URL a staged copy of a database in a bucket came from (``None``: converted here)
    staged_from: str | None = None
    #: what each sample's target is, as :meth:`~lightning_fastdata.store.targets.TargetSpec.describe` says it
    #: (``"class (10 classes)"``, ``"float (2 values: x, y)"``); ``None``: unknown, the metadata cannot be read
    targets: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``cache list --json``)."""
        return {
            "key": self.key,
            "path": str(self.path),
            "source": self.source,
            "settings": self.settings,
            "size": self.size,
            "last_used": self.last_used,
            "state": self.state,
            "in_use": self.in_use,
            "staged_from": self.staged_from,
            "targets": self.targets,
        }


def _disk_size(path: Path) -> int:
    """Bytes ``path`` (a folder of files, or a file) takes on disk: allocated blocks, as ``du`` counts them."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = 0
    for file in files:
        with contextlib.suppress(OSError):
            st = file.stat()
            total += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return total


def conversion_meta(database: Path) -> dict[str, Any] | None:
    """The metadata of the complete conversion at ``database``; ``None`` if there is none or it cannot be read.

    Read from the conversion report written beside the records (plain JSON, no LMDB open and no page walk), else
    from the database itself. Either is validated as the reader validates a database's (:func:`_report_meta`), so a
    caller may take ``meta["source"]["path"]``, ``meta["encoding"]`` and the splits' lengths as the writer wrote them.
    """
    if not (database / _format.DATA_FILE).is_file():
        return None
    meta = _report_meta(database)
    if meta is not None:
        return meta
    try:
        meta = _environments.read_meta(database)
    except (DatasetFormatError, OSError):
        return None
    return meta if _source_path(meta) is not None else None


def _report_meta(database: Path) -> dict[str, Any] | None:
    """The metadata in the conversion report of ``database``, if it is of the shapes the writer writes; else ``None``.

    The report is read without following a link and only up to :data:`MAX_JSON_BYTES`; its metadata must pass the
    checks of a database's (:func:`~lightning_fastdata.store.format.load_meta`: its version, complete, classes,
    splits, encoding, source and targets), name its source's path, and claim no more records than ``data.mdb`` holds.
    Any other report (planted, damaged, or of another version) is not read: the database itself is.
    """
    raw = read_small(database / _format.REPORT_FILE, MAX_JSON_BYTES)
    if raw is None:
        return None
    try:
        report = _format.parse_json(raw)
        meta = report.get("meta") if isinstance(report, dict) else None
        if not isinstance(meta, dict):
            return None
        checked = _format.load_meta(json.dumps(meta).encode(), database)
        _format.check_fits(checked, database, (database / _format.DATA_FILE).stat().st_size)
    except (DatasetFormatError, OSError, ValueError):
        return None
    return checked if _source_path(checked) is not None else None


def _source_path(meta: Mapping[str, Any]) -> str | None:
    """The source path a conversion's metadata names (``meta["source"]`` is an object: validated), if it is text."""
    path = meta.get("source", {}).get("path")
    return path if isinstance(path, str) else None


def _last_use(database: Path) -> float:
    times = []
    for path in (use_path(database), database / "data.mdb"):
        with contextlib.suppress(OSError):
            times.append(os.lstat(path).st_mtime)  # a link's own time, not that of the file it names
    return max(times, default=0.0)


def _entry(database: Path, key: str, partial: bool) -> CachedConversion:

    target = target_of_partial(database) if partial else database
    writer = converter_of(target) if target is not None else None
    meta = None if partial else conversion_meta(database)
    if writer is not None:
        state = f"being written by {describe_converter(writer)}"
    elif partial:
        state = "incomplete"
    elif meta is None:
        state = "damaged: its metadata cannot be read"
    else:
        state = "complete"
    encoding = (meta or {}).get("encoding", {})
    return CachedConversion(
        path=database,
        key=key,
        source=None if meta is None else _source_path(meta),
        settings={name: encoding[name] for name in SETTINGS if name in encoding},
        size=_disk_size(database),
        last_used=_last_use(database),
        state=state,
        in_use=not partial and in_use(database),
        staged_from=None if partial else _staged_from(database),
        targets=_targets_of(meta, database),
    )


def _targets_of(meta: dict[str, Any] | None, database: Path) -> str | None:
    """What the targets of the conversion with metadata ``meta`` are, in words; ``None`` if unknown or damaged."""
    if meta is None:
        return None
    try:
        return TargetSpec.from_meta(meta, database).describe()
    except (DatasetFormatError, AttributeError, TypeError):
        return None


def _staged_from(database: Path) -> str | None:
    """The URL in a staged copy's record (:mod:`~lightning_fastdata.store.remote`), else ``None``.

    Without user-info and query (:func:`~lightning_fastdata.store.remote.redact_url`): records written before staging
    redacted them may hold them.
    """
    from lightning_fastdata.store.remote import redact_url

    with contextlib.suppress(ValueError):
        record = _format.parse_json(read_small(database / STAGED_RECORD, MAX_JSON_BYTES) or b"null")
        url = record.get("url") if isinstance(record, dict) else None
        return redact_url(url) if isinstance(url, str) else None
    return None


def list_conversions(cache_dir: str | os.PathLike[str] | None = None) -> list[CachedConversion]:
    """The conversions in the cache folder, most recently used first, and working copies of unfinished ones.

    Args:
        cache_dir: the cache folder; default :func:`cache_root` (``$LIGHTNING_FASTDATA_CACHE`` or
            ``~/.cache/lightning_fastdata``).

    """
    root = cache_root(cache_dir)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for item in entries:
        path = Path(item.path)
        if not item.is_dir(follow_symlinks=False):
            continue
        target = target_of_partial(path)
        if target is not None:
            found.append(_entry(path, target.name.removesuffix(".lmdb") + " (unfinished)", partial=True))
        elif not item.name.startswith(".") and (path / DATA_FILE).is_file():
            found.append(_entry(path, item.name.removesuffix(".lmdb"), partial=False))
    return sorted(found, key=lambda c: -c.last_used)


def _resolve(key_or_path: str, root: Path) -> Path:
    """The conversion in ``root`` named by a key (``NAME``, ``NAME.lmdb``, the digest) or a path."""
    keys = [c for c in list_conversions(root) if not c.key.endswith("(unfinished)")]
    given = Path(key_or_path).expanduser()
    if os.sep in key_or_path or given.is_absolute():
        path = given.absolute()
        if path.parent != root:
            raise InvalidArgumentError(
                f"`{key_or_path}` is not a conversion in the cache folder {str(root)!r}; `cache remove` removes only"
                " conversions there (delete a database elsewhere yourself). Pass `--cache-dir` for another cache."
            )
        matches = [c.path for c in keys if c.path == path]
    else:
        name = key_or_path.removesuffix(".lmdb")
        matches = [c.path for c in keys if c.key == name or c.key.rsplit("-", 1)[-1] == name]
    if len(matches) != 1:
        known = ", ".join(c.key for c in keys) or "none"
        raise InvalidArgumentError(
            f"no conversion `{key_or_path}` in the cache folder {str(root)!r} (it holds: {known})."
            " Pass a key as `lightning-fastdata cache list` shows it, or its path."
        )
    return matches[0]


def _remove(database: Path) -> int:
    """Remove ``database`` unless a converter writes it or a process reads it; returns the bytes freed.

    The database is first renamed to its working-copy name (``.NAME.partial``), which no reader takes for a complete
    database, then deleted: an interrupted removal leaves only what ``cache prune`` or ``convert --clean`` removes.

    Raises:
        DestinationError: a conversion is writing it, a process reads it, or the cache folder is read-only.

    """
    try:
        with target_lock(database, wait=False) as read_only:
            if read_only is not None:
                raise read_only_error(database, read_only) from read_only
            with _no_readers(database) as free:
                if not free:
                    raise DestinationError(
                        f"{str(database)!r} is in use: a running process reads it (a DataModule opened it). Stop that"
                        " training or Python session, then remove it; nothing was removed."
                    )
                size = _disk_size(database)
                working = partial_path(database)
                with contextlib.suppress(FileNotFoundError):
                    what = foreign_kind(os.lstat(working), directory=True)
                    if what is not None:  # a link or a file there: renaming the database over it would fail midway
                        raise DestinationError(
                            f"{str(working)!r} is {what}, where removing {database.name} renames it first; nothing"
                            " was removed. Remove it, and check who else can write to the cache folder."
                        )
                shutil.rmtree(working, ignore_errors=True)
                os.replace(database, working)
                shutil.rmtree(working)
                with contextlib.suppress(OSError):
                    os.unlink(use_path(database))
                return size
    except BlockingIOError:
        info = converter_of(database) or {}
        raise DestinationError(
            f"{str(database)!r} is being written by {describe_converter(info)}; nothing was removed. Wait for the"
            " conversion to finish (or stop it), then remove it."
        ) from None


def remove_conversion(key_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Remove one conversion from the cache folder; returns a line saying what was freed.

    Args:
        key_or_path: the conversion's key as :func:`list_conversions` names it (``pets-0fb5ace5b9``, with or without
            ``.lmdb``, or only its digest), or its path.
        cache_dir: the cache folder; default :func:`cache_root`.

    Raises:
        InvalidArgumentError: no conversion, or more than one, matches ``key_or_path``.
        DestinationError: a conversion is writing it, a process reads it, or the cache folder is read-only.

    """
    database = _resolve(key_or_path, cache_root(cache_dir))
    size = _remove(database)
    return f"removed {database} ({human_bytes(size)})"


_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_UNITS.update({f"{u}ib": n for u, n in list(_UNITS.items()) if u not in ("", "b")})
_UNITS.update({"kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4})
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """Bytes from ``"20GB"`` (powers of 1000), ``"20G"`` or ``"20GiB"`` (powers of 1024), or a plain number.

    Raises:
        InvalidArgumentError: ``text`` is not a size.

    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(f"`--max-size` {text!r} is not a size; write e.g. 20GB, 500MB, 20GiB or 20G.")
    return round(float(match.group(1)) * _UNITS[unit])


def parse_age(text: str) -> float:
    """Seconds from ``"30d"``, ``"12h"``, ``"90m"``, ``"2w"``, ``"45s"``, or a plain number of days.

    Raises:
        InvalidArgumentError: ``text`` is not an age.

    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise InvalidArgumentError(f"`--older-than` {text!r} is not an age; write e.g. 30d, 12h, 90m or 2w.")
    return float(match.group(1)) * _AGES[match.group(2) or "d"]


def prune_cache(
    cache_dir: str | os.PathLike[str] | None = None,
    max_size: int | None = None,
    older_than: float | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Remove conversions not used for ``older_than`` seconds, then the least recently used until ``max_size`` fits.

    Conversions being written or read are kept (and said so); leftovers of interrupted conversions are removed too.

    Args:
        cache_dir: the cache folder; default :func:`cache_root`.
        max_size: the bytes the complete conversions may take in all, at most.
        older_than: remove the conversions whose last use is older than this many seconds.
        dry_run: say what would be removed, remove nothing.

    Returns:
        One line per conversion removed (or, with ``dry_run``, that would be) or kept although selected.

    Raises:
        InvalidArgumentError: neither ``max_size`` nor ``older_than`` is given, or one is negative.

    """
    if max_size is None and older_than is None:
        raise InvalidArgumentError("`cache prune` needs `--max-size` or `--older-than` (or both): --max-size 20GB.")
    if (max_size or 0) < 0 or (older_than or 0) < 0:
        raise InvalidArgumentError(f"`--max-size` ({max_size}) and `--older-than` ({older_than}) must be >= 0.")
    root = cache_root(cache_dir)
    complete = [c for c in list_conversions(root) if c.state == "complete"]
    now = time.time()
    chosen = [c for c in complete if older_than is not None and now - c.last_used > older_than]
    if max_size is not None:
        total = sum(c.size for c in complete if c not in chosen)
        for conversion in sorted((c for c in complete if c not in chosen), key=lambda c: c.last_used):
            if total <= max_size:
                break
            chosen.append(conversion)
            total -= conversion.size
    lines = []
    for conversion in chosen:
        age = (now - conversion.last_used) / 86400
        what = f"{conversion.path} ({human_bytes(conversion.size)}, last used {age:.1f} days ago)"
        if dry_run:
            lines.append(f"would remove {what}")
            continue
        try:
            _remove(conversion.path)
            lines.append(f"removed {what}")
        except DestinationError as err:
            lines.append(f"kept {conversion.key}: {err}")
    if dry_run:
        lines += [f"would remove {path}, left by an interrupted conversion" for path in stale_conversions(root)]
    elif root.is_dir():
        lines += clean_stale_conversions(root)
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Conversions written elsewhere (`convert SRC DST`): a registry, so that the cache can point at them
# ---------------------------------------------------------------------------------------------------------------

#: the registry of conversions to an explicit destination, in the cache folder: ``{"SOURCE": ["DST", ...]}``
ELSEWHERE_FILE = "elsewhere.json"
#: destinations kept per source, the most recent last
_MAX_ELSEWHERE = 20


def _read_elsewhere(root: Path) -> dict[str, list[str]]:
    """The registry in ``root``, keeping only entries of the right shapes; empty if it is missing or damaged."""
    raw = read_small(root / ELSEWHERE_FILE, MAX_JSON_BYTES)
    try:
        data = _format.parse_json(raw) if raw is not None else None
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        source: [d for d in destinations if isinstance(d, str)]
        for source, destinations in data.items()
        if isinstance(source, str) and isinstance(destinations, list)
    }


def record_elsewhere(source: Path, database: Path, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Note in the cache folder's registry that ``source`` was converted into ``database``, outside the cache.

    Nothing for a database in the cache folder, and nothing but a debug log when the registry cannot be written: it
    only serves :func:`elsewhere_note` and ``cache list``, never a conversion. Written whole (a reader never sees half
    of it); two conversions finishing at once may keep only one of their entries.
    """
    root = cache_root(cache_dir)
    source, database = Path(source).absolute(), Path(database).absolute()
    if database.parent == root:
        return
    try:
        registry = _read_elsewhere(root)
        kept = [d for d in registry.get(str(source), []) if d != str(database) and Path(d).exists()]
        registry[str(source)] = [*kept, str(database)][-_MAX_ELSEWHERE:]
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{ELSEWHERE_FILE}.{os.getpid()}.tmp"
        write_own(tmp, json.dumps(registry, indent=1).encode())  # never through a link planted at that name
        os.replace(tmp, root / ELSEWHERE_FILE)
    except (OSError, DestinationError) as err:
        log.debug("cannot record the conversion of %s into %s in %s: %s", source, database, root, err)


def converted_elsewhere(cache_dir: str | os.PathLike[str] | None = None) -> list[CachedConversion]:
    """The complete conversions the registry of the cache folder names outside it, newest first.

    Each is a database whose metadata still names the source it was recorded under; moved, removed or replaced ones
    are left out. Their ``key`` is their path: ``cache remove`` and ``cache prune`` never take them.
    """
    root = cache_root(cache_dir)
    found = []
    for source, destinations in _read_elsewhere(root).items():
        for destination in dict.fromkeys(destinations):
            path = Path(destination)
            meta = conversion_meta(path) if path.is_absolute() and path.parent != root else None
            recorded = meta.get("source") if meta is not None else None
            if not isinstance(recorded, dict) or recorded.get("path") != source:
                continue
            encoding = meta.get("encoding") if isinstance(meta.get("encoding"), dict) else {}
            found.append(
                CachedConversion(
                    path=path,
                    key=str(path),
                    source=source,
                    settings={name: encoding[name] for name in SETTINGS if name in encoding},
                    size=_disk_size(path),
                    last_used=_last_use(path),
                    state="complete, outside the cache folder",
                    in_use=False,
                )
            )
    return sorted(found, key=lambda c: -c.last_used)


def elsewhere_note(
    source: Path, target: Path, settings: Mapping[str, Any], cache_dir: str | os.PathLike[str] | None = None
) -> str | None:
    """Before converting ``source`` into the cache slot ``target``: the databases ``convert SRC DST`` made of it.

    The complete ones of the same settings, still there, and the advice to pass one as ``data_dir``. ``None`` when
    ``target`` exists (it is reused or brought up to date) or there is no such database. Whether one is up to date
    with ``source`` is not checked here (that takes a scan of the source): a conversion of it says so.
    """
    if target.exists():
        return None
    roots = dict.fromkeys([target.parent, cache_root(cache_dir)])
    wanted = {**settings, "keep_original": False}
    same = [
        str(c.path)
        for root in roots
        for c in converted_elsewhere(root)
        if c.source == str(source) and all(c.settings.get(name) == value for name, value in wanted.items())
    ]
    if not same:
        return None
    names = ", ".join(repr(path) for path in dict.fromkeys(same))
    return (
        f"converting {str(source)!r} into the cache ({target.name}), but `lightning-fastdata convert` already made a"
        f" database of it with the same settings: {names}. Pass it as `data_dir` to train from it instead (a"
        " database is read as it is: rerun that `convert` after the source changes)."
    )


# ---------------------------------------------------------------------------------------------------------------
# Why a DataModule converts again
# ---------------------------------------------------------------------------------------------------------------


def other_settings_note(source: Path, target: Path, settings: Mapping[str, Any]) -> str | None:
    """Before converting ``source`` into the new ``target``: its other conversions in the cache, and what differs.

    ``None`` when ``target`` already exists (it is reused, or converted again: see :func:`source_change_note`) or
    the cache holds no other conversion of ``source``.
    """
    if target.exists():
        return None
    others = []
    for conversion in list_conversions(target.parent):
        if conversion.source != str(source) or conversion.path == target or conversion.state != "complete":
            continue
        differ = [
            f"{name}={settings[name]!r} (it has {conversion.settings.get(name)!r})"
            for name in settings
            if conversion.settings.get(name) != settings[name]
        ]
        others.append(f"{conversion.key} ({human_bytes(conversion.size)}): {', '.join(differ) or 'same settings'}")
    if not others:
        return None
    return (
        f"converting {str(source)!r} again, into {target.name}: the cache already holds {len(others)} conversion(s) of"
        f" it with other settings, which stay: {'; '.join(others)}. List them with `lightning-fastdata cache list`,"
        " remove one with `lightning-fastdata cache remove KEY`."
    )


def source_change_note(target: Path, previous: Mapping[str, Any], splits: Mapping[str, int]) -> str:
    """After ``target`` was converted again from a changed source: which splits appeared, went or changed size."""
    before = {name: int(info["length"]) for name, info in previous.get("splits", {}).items()}
    changes = [f"split {name!r} is new ({splits[name]} images)" for name in splits if name not in before]
    changes += [f"split {name!r} is gone" for name in before if name not in splits]
    changes += [
        f"split {name!r} {before[name]} -> {splits[name]} images"
        for name in splits
        if name in before and before[name] != splits[name]
    ]
    detail = "; ".join(changes) or "files were added, removed or modified"
    since = previous.get("created", "then")
    return f"converted {target.name} again because its source changed since {since}: {detail}."
