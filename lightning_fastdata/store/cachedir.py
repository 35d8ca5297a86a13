"""The cache folder: where it is, the slot a source converts into there, and who reads each conversion.

:func:`cache_root` is the folder, :func:`converted_path` the database a source converts into with given settings (its
name keyed by the source's path and the settings, so a change of settings converts into a new slot). Each conversion
``NAME`` there may have a sibling ``.NAME.used`` (:func:`use_path`): its modification time is the conversion's last
use (touched once each time a DataModule opens it, never per sample), and every process reading the conversion holds a
shared ``flock`` on it for as long as it lives (:func:`record_use`), so a removal can tell a conversion in use from an
idle one (:func:`no_readers`, :func:`in_use`).

The rest of the cache's upkeep builds on this module: :mod:`~lightning_fastdata.store.inventory` (what the folder
holds) and :mod:`~lightning_fastdata.store.cache` (removing, pruning, and the notes a DataModule logs).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from lightning_fastdata.errors import DestinationError
from lightning_fastdata.store.format import default_cache_dir
from lightning_fastdata.store.ondisk import foreign_kind, open_own

try:  # shared locks held by readers, an exclusive one taken by a removal (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: the logger of the cache folder's upkeep, one for its modules, under the name it had before they were split
log = logging.getLogger("lightning_fastdata.store.cache")

#: the settings a DataModule's conversion is keyed by, as stored under ``encoding`` in a database's metadata
SETTINGS = ("short_side", "quality", "encoding", "keep_original")


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
def no_readers(database: Path) -> Iterator[bool]:
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
        with no_readers(database) as free:
            return not free
    except DestinationError:
        return False
