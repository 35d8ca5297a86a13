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

The upkeep is in three modules, each building on the one before: :mod:`~lightning_fastdata.store.cachedir` (the
folder, the slot a source converts into, the use files and their locks), :mod:`~lightning_fastdata.store.inventory`
(what the folder holds, and the registry of conversions written elsewhere) and this one (removing and pruning
conversions, and the notes a DataModule logs before it converts). Their public names are all importable from here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_fastdata.errors import DestinationError, InvalidArgumentError
from lightning_fastdata.store.cachedir import (
    SETTINGS,
    cache_root,
    converted_path,
    in_use,
    no_readers,
    record_use,
    use_path,
)
from lightning_fastdata.store.format import converter_of, default_cache_dir, describe_converter, partial_path
from lightning_fastdata.store.inventory import (
    ELSEWHERE_FILE,
    MAX_JSON_BYTES,
    CachedConversion,
    conversion_meta,
    converted_elsewhere,
    disk_size,
    list_conversions,
    record_elsewhere,
)
from lightning_fastdata.store.leftovers import clean_stale_conversions, stale_conversions
from lightning_fastdata.store.ondisk import foreign_kind, read_only_error, target_lock
from lightning_fastdata.store.summary import human_bytes

__all__ = [
    "ELSEWHERE_FILE",
    "MAX_JSON_BYTES",
    "SETTINGS",
    "CachedConversion",
    "cache_root",
    "conversion_meta",
    "converted_elsewhere",
    "converted_path",
    "default_cache_dir",
    "elsewhere_note",
    "in_use",
    "list_conversions",
    "other_settings_note",
    "parse_age",
    "parse_size",
    "prune_cache",
    "record_elsewhere",
    "record_use",
    "remove_conversion",
    "source_change_note",
    "use_path",
]


# ---------------------------------------------------------------------------------------------------------------
# Removing and pruning conversions
# ---------------------------------------------------------------------------------------------------------------


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
            with no_readers(database) as free:
                if not free:
                    raise DestinationError(
                        f"{str(database)!r} is in use: a running process reads it (a DataModule opened it). Stop that"
                        " training or Python session, then remove it; nothing was removed."
                    )
                size = disk_size(database)
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
# Why a DataModule converts again
# ---------------------------------------------------------------------------------------------------------------


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
