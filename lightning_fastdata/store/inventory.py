"""What the cache folder holds: each conversion as ``lightning-fastdata cache list`` shows it, and those made elsewhere.

:func:`list_conversions` reads each conversion's state (complete, being written, a dead converter's leftover, damaged),
size, last use, settings and target kind, without opening LMDB: the metadata comes from the conversion report beside
the records, checked as the reader checks a database's (:func:`conversion_meta`). A conversion written outside the
cache folder (``lightning-fastdata convert SRC DST``) is noted in a registry there (:func:`record_elsewhere`), so
``cache list`` and a DataModule about to convert the same source can point at it (:func:`converted_elsewhere`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fastdata.errors import DatasetFormatError, DestinationError
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.cachedir import SETTINGS, cache_root, in_use, use_path
from lightning_fastdata.store.format import (
    DATA_FILE,
    STAGED_RECORD,
    converter_of,
    describe_converter,
    target_of_partial,
)
from lightning_fastdata.store.ondisk import read_small, write_own
from lightning_fastdata.store.targets import TargetSpec

#: the logger of the cache folder's upkeep, one for its modules, under the name it had before they were split
log = logging.getLogger("lightning_fastdata.store.cache")

#: the most bytes read of a JSON file in the cache (a conversion report, a staged copy's record, the registry): a
#: report lists every skipped and ignored file, some 100 bytes each; a larger file is not read (a report: the
#: metadata is read from the database itself)
MAX_JSON_BYTES = 64 << 20


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


def disk_size(path: Path) -> int:
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
        size=disk_size(database),
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
    only serves :func:`~lightning_fastdata.store.cache.elsewhere_note` and ``cache list``, never a conversion. Written
    whole (a reader never sees half of it); two conversions finishing at once may keep only one of their entries.
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
                    size=disk_size(path),
                    last_used=_last_use(path),
                    state="complete, outside the cache folder",
                    in_use=False,
                )
            )
    return sorted(found, key=lambda c: -c.last_used)
