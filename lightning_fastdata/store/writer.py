"""The writer of a database: records into a hidden working copy, published by rename, under a lock per target.

:func:`write_database` carries one conversion through: take the lock of ``dst`` (``.DST.lock``), stop early when
``dst`` is up to date, encode the plan's tasks (:mod:`~lightning_fastdata.store.encode`) and write them into
``.DST.partial`` with metadata marked complete last, then move it into place (:func:`_publish`). An interruption
leaves the previous database or none; :func:`stale_conversions` finds what killed converters left, and
:func:`clean_stale_conversions` removes it. The reader (:mod:`~lightning_fastdata.store.reader`) mirrors this
module; both follow :mod:`~lightning_fastdata.store.format`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import mmap
import os
import shutil
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb
from tqdm.auto import tqdm

from lightning_fastdata.__about__ import __version__
from lightning_fastdata._files import owned, read_regular
from lightning_fastdata.errors import ConversionError, DatasetFormatError, DestinationError, ReadOnlyDestinationError
from lightning_fastdata.store.encode import EncodeOptions, encode_all
from lightning_fastdata.store.format import (
    DATA_FILE,
    FORMAT_VERSION,
    META_KEY,
    PROGRESS_FILE,
    REPORT_FILE,
    converter_of,
    converter_record,
    describe_converter,
    dump_meta,
    fcntl,  # advisory lock so two converters never build one target at once
    labels_key,
    lock_path,
    open_readonly,
    pack_record,
    parse_json,
    partial_path,
    read_meta,
    read_transaction,
    record_key,
    sources_key,
)
from lightning_fastdata.store.sources import ConversionPlan
from lightning_fastdata.store.summary import ConversionSummary, SkippedFile, human_bytes
from lightning_fastdata.store.targets import MAX_DIM, MIXED_KINDS, AmbiguousTargetsError, TargetColumn

log = logging.getLogger(__name__)

#: what ``mkdir``/``open`` raise in a folder this process may not write to
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)

#: what ``flock`` raises on a file system without file locks (NFS without its lock service, Lustre without the
#: ``flock`` mount option)
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


INITIAL_MAP_SIZE = 1 << 28  # 256 MiB; doubled whenever the database fills it
_TXN_RECORDS = 512
_TXN_BYTES = 64 << 20

# LMDB's page layout (mdb.c of LMDB 0.9; checked on 0.9.36, which py-lmdb 3.0 bundles): what an entry costs on disk
_PAGE_HEADER = 16  # PAGEHDRSZ
_NODE_HEADER = 8  # NODESIZE: before each key in a leaf or branch page
_NODE_SLOT = 2  # sizeof(indx_t): the node's place in its page's index
_PAGE_NUMBER = 8  # sizeof(pgno_t): what a leaf node holds of a value kept on overflow pages
#: pages a commit may take from LMDB's free list rather than from the disk: the few that the commits before it freed
_REUSABLE_PAGES = 64
#: LMDB's largest page (MAX_PAGESIZE): on a system with larger pages (64 KiB on some arm64 kernels) it uses this
_MAX_PAGE = 1 << 15
#: beside ``data.mdb``: LMDB's ``lock.mdb`` (8 KiB) and the conversion report
_OTHER_FILES = 64 << 10
#: the files LMDB makes in a database folder it writes
_LMDB_FILES = (DATA_FILE, "lock.mdb")


class _PageBound:
    """An upper bound of the size of ``data.mdb`` once it holds the entries put so far: the disk space it needs.

    From LMDB's page layout: a value whose node (header, key, value) is over ``nodemax`` (2038 bytes with 4 KiB pages)
    gets whole overflow pages of its own, ``(15 + size) // page + 1`` (a 10 KiB record takes 12 KiB), and its leaf
    node holds their first page's number. Leaves filled in key order are simulated: LMDB moves a full leaf's last node
    to the new page with the next one. Keys put between others (a split whose name sorts before one written, the
    labels, sources and metadata) are counted in half-full pages, as branch pages are. Each commit copies the pages it
    changes (the path to the leaf, the free list's), freeing the old ones for the commits after the next to reuse.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._room = page_size - _PAGE_HEADER
        self._node_max = ((self._room // 2) & ~1) - _NODE_SLOT
        self.overflow = 0  # overflow pages
        self.commits = 0
        self._leaves = 1  # the leaves of the keys put in order, simulated
        self._fill = self._last = 0  # the bytes of the last such leaf, and of its last node
        self._between = self._between_runs = self._between_largest = 0  # the keys put between others
        self._top = self._previous = b""
        self._longest_key = 0

    def overflow_pages(self, key: bytes, size: int) -> int:
        """The overflow pages a value of ``size`` bytes under ``key`` takes (0: it lies in its leaf)."""
        if _NODE_HEADER + len(key) + size <= self._node_max:
            return 0
        return (_PAGE_HEADER - 1 + size) // self.page_size + 1

    def add(self, key: bytes, size: int) -> None:
        """Count an entry put under ``key`` with a value of ``size`` bytes."""
        pages = self.overflow_pages(key, size)
        self.overflow += pages
        self._longest_key = max(self._longest_key, len(key))
        node = _NODE_HEADER + len(key) + (_PAGE_NUMBER if pages else size)
        node += (node & 1) + _NODE_SLOT
        if key > self._top:
            if self._fill + node > self._room:
                self._leaves += 1
                self._fill = self._last + node
            else:
                self._fill += node
            self._last, self._top = node, key
        else:
            self._between += node
            self._between_largest = max(self._between_largest, node)
            self._between_runs += key < self._previous or self._between_runs == 0
        self._previous = key

    def nbytes(self, scale: float = 1.0) -> int:
        """The bound, in bytes; ``scale`` projects the entries so far to ``scale`` times as many alike."""
        half = (self._room - self._between_largest) // 2
        leaves = math.ceil(self._leaves * scale) + math.ceil(self._between * scale / half) + 2 * self._between_runs
        depth, level, branches = 1, leaves, 0
        per_branch = self._room // 2 // (_NODE_HEADER + self._longest_key + 1 + _NODE_SLOT)  # a node per child page
        while level > 1:
            level = math.ceil(level / per_branch)
            branches += level
            depth += 1
        # pages freed by a commit are reused two commits later: three commits' copies at a time, and a page of the
        # free list now and then
        copied = 3 * (depth + 2) + math.ceil(self.commits * scale / 8)
        return self.page_size * (2 + math.ceil(self.overflow * scale) + leaves + branches + copied)


class _NoRoom(OSError):
    """A commit that cannot fit on the disk, found before LMDB writes it."""


def _free_space(path: Path) -> int | None:
    """The bytes this process may still write on the disk of ``path``; ``None`` where the file system does not say.

    For root, the blocks the file system reserves for it count too (ext4 keeps 5%): root writes into them.
    """
    if not hasattr(os, "statvfs"):  # Windows
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks == 0:  # a pseudo or FUSE file system that reports no size
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


class _LmdbWriter:
    """Batches puts into transactions and grows ``map_size`` (doubling) whenever the database is full.

    ``bound`` counts what LMDB writes (:class:`_PageBound`); before each commit, the overflow pages it surely adds are
    checked against the free disk space, so a full disk stops the conversion with :class:`_NoRoom` before LMDB writes
    a page of it (LMDB reports a short write as ``mdb_txn_commit: Input/output error``, and the disk stays full).
    """

    def __init__(self, path: Path, map_size: int, bound: _PageBound | None = None) -> None:
        self.path = path
        self.map_size = map_size
        _check_fresh(path, _LMDB_FILES)  # LMDB opens (and writes) its files through links: none may be planted
        self.env = lmdb.open(str(path), map_size=map_size, subdir=True, readahead=False, meminit=False, sync=False)
        self.bound = bound if bound is not None else _PageBound(self.env.stat()["psize"])
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._pending_pages = 0  # overflow pages

    def put(self, key: bytes, value: bytes) -> None:
        self._pending.append((key, value))
        self._pending_bytes += len(value)
        self._pending_pages += self.bound.overflow_pages(key, len(value))
        self.bound.add(key, len(value))
        if len(self._pending) >= _TXN_RECORDS or self._pending_bytes >= _TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._pending_pages > _REUSABLE_PAGES:
            needed = (self._pending_pages - _REUSABLE_PAGES) * self.bound.page_size
            free = _free_space(self.path)
            if free is not None and free < needed:
                raise _NoRoom(errno.ENOSPC, f"its next commit alone needs {human_bytes(needed)}")
        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value)
            except lmdb.MapFullError:
                self.map_size *= 2
                log.debug("LMDB map full; growing map_size to %d bytes", self.map_size)
                self.env.set_mapsize(self.map_size)
                continue
            self.bound.commits += 1
            self._pending.clear()
            self._pending_bytes = self._pending_pages = 0

    def close(self) -> None:
        try:
            self.flush()
            self.env.sync(True)
        finally:  # a full disk too: an environment left open in this process blocks a later open of its files
            self.env.close()


def _existing_meta(dst: Path) -> dict[str, Any] | None:
    """The metadata of a complete database at ``dst``, ``None`` if there is none; refuse to clobber other data."""
    if not dst.exists():
        return None
    if dst.is_dir() and not any(dst.iterdir()):
        return None
    try:
        return read_meta(dst)
    except DatasetFormatError as err:
        if (dst / DATA_FILE).is_file() and _has_meta_record(dst):
            return None  # our own incomplete or outdated database: safe to replace
        raise DestinationError(
            f"`dst` {str(dst)!r} exists and is not a lightning_fastdata database; refusing to replace it."
            " Pass a new or empty path."
        ) from err


def _has_meta_record(dst: Path) -> bool:
    """Whether the LMDB at ``dst`` holds a ``__meta__`` record, i.e. was written by lightning_fastdata."""
    try:
        with read_transaction(open_readonly(dst)) as txn:
            return txn.get(META_KEY) is not None
    except (DatasetFormatError, lmdb.Error):
        return False


@contextlib.contextmanager
def _target_lock(dst: Path, wait: bool = True) -> Iterator[OSError | None]:
    """Hold the conversion lock of ``dst`` while the block runs; yields the error when it cannot be written or locked.

    A folder that is read-only, or on a file system without file locks, yields that error instead of a lock, and so
    does a lock file that is another user's regular file (:class:`_ForeignLock`: this process never writes to it):
    then only a complete, up-to-date database may be used (:func:`_unwritable_error` says why nothing else is).
    The lock file holds this converter's pid and host (readers name it: "is being converted by process N") and is
    removed at the end while still held: a waiter that then gets the lock sees that its file is gone and locks the new
    one, so no zero-byte lock file stays beside each database.

    Raises:
        BlockingIOError: ``wait`` is false and another process holds the lock.
        DestinationError: the lock file is a symbolic link, a hard link or not a regular file.

    """
    if fcntl is None:  # pragma: no cover - Windows
        yield None
        return
    path = lock_path(dst)
    while True:
        try:
            fh = os.fdopen(_open_own(path, os.O_RDWR), "r+b")  # held for the whole block, closed in `finally`
        except OSError as err:
            if err.errno not in _READ_ONLY:
                raise
            yield err  # a read-only folder: no conversion can happen here, but a complete database can be used
            return
        except DestinationError:
            foreign = _ForeignLock.of(path)
            if foreign is None:  # a link or not a regular file: refused
                raise
            yield foreign  # another user's lock: as in a read-only folder, a complete database can be used
            return
        try:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise
                holder = converter_of(dst) or {}
                log.warning(
                    "waiting for another conversion to %s to finish (%s holds %s); this one then reuses or replaces"
                    " its result",
                    dst,
                    describe_converter(holder),
                    path,
                )
                fcntl.flock(fh, fcntl.LOCK_EX)
            if _same_file(fh.fileno(), path):
                break
        except OSError as err:
            if isinstance(err, BlockingIOError) or err.errno not in _NO_LOCKS:
                fh.close()
                raise
            fh.close()  # no locks on this file system: without one, two converters could write one working copy
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:  # the empty lock file this call just made
                    path.unlink()
            yield err
            return
        except BaseException:
            fh.close()
            raise
        fh.close()  # the converter we waited for removed this lock file: lock the current one
    try:
        fh.truncate(0)
        fh.seek(0)
        fh.write(converter_record())
        fh.flush()
        yield None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


class _ForeignLock(PermissionError):
    """The lock file of a target is another user's regular file: this process never writes to it, so it cannot lock.

    ``uid`` is its owner's.
    """

    uid: int

    @classmethod
    def of(cls, path: Path) -> _ForeignLock | None:
        """The error for the lock file ``path`` when it is another user's regular file, else ``None``."""
        try:
            found = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(found.st_mode) or not hasattr(os, "geteuid") or found.st_uid == os.geteuid():
            return None
        error = cls(errno.EACCES, f"the lock file is owned by another user (uid {found.st_uid})", str(path))
        error.uid = found.st_uid
        return error


def _open_own(path: Path, flags: int, folder: int | None = None) -> int:
    """``os.open`` of ``path``, created if missing, only as a regular file of this user's, never through a link.

    ``O_NOFOLLOW`` refuses a symbolic link planted at ``path`` (a lock file or a staged file pointing at another file,
    which opening would truncate and write), and the check of the file opened a hard link (another name of a file
    elsewhere); ``folder``: a descriptor of the folder ``path`` is in, opened without following links either. Pass
    no ``O_TRUNC``: it would empty a refused file on open. Truncate once this returns.

    Raises:
        DestinationError: ``path`` is a symbolic link, a hard link, not a regular file, or another user's file.
        OSError: what ``os.open`` raises otherwise (a read-only folder: EROFS, EACCES).

    """
    # O_NONBLOCK: a FIFO planted there is refused at once, where a write-only open would wait for a reader
    flags |= os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path.name if folder is not None else path, flags, 0o644, dir_fd=folder)
    except OSError:
        with contextlib.suppress(OSError):
            refused = _not_own(path, os.lstat(path.name if folder is not None else path, dir_fd=folder))
            if refused is not None:
                raise refused from None
        raise
    refused = _not_own(path, os.fstat(fd))
    if refused is not None:
        os.close(fd)
        raise refused
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)  # a regular file of this user's: as opened without O_NONBLOCK
    return fd


def _not_own(path: Path, found: os.stat_result, directory: bool = False) -> DestinationError | None:
    """Why ``path`` (``found``: its ``lstat``) is not a regular file (``directory``: a folder) of this user's."""
    what = _foreign(found, directory)
    if what is None:
        return None
    return DestinationError(
        f"{str(path)!r} is {what}, where this package writes its own {'folder' if directory else 'file'}; nothing"
        f" was written through it. Remove it, and check who else can write to {str(path.parent)!r}."
    )


def _foreign(found: os.stat_result, directory: bool = False) -> str | None:
    """What ``found`` (an ``lstat``) is, where a regular file (``directory``: a folder) of this user's should be.

    ``None`` when it is one; else ``"a symbolic link"``, ``"not a folder"``, ``"not a regular file"``, ``"owned by
    another user (uid N)"`` or, for a file, ``"a hard link (N links)"``: a second name of another file (``ln victim
    .DST.lock``), which writing this one would overwrite. This package never links a file it writes (a publish links
    only a finished database's files, which nothing writes again), so a file of its own has one name.
    """
    if stat.S_ISLNK(found.st_mode):
        return "a symbolic link"
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(found.st_mode):
        return "not a folder" if directory else "not a regular file"
    if not owned(found):
        return f"owned by another user (uid {found.st_uid})"
    if not directory and found.st_nlink > 1:  # a folder's link count is its subfolders': no sign of anything
        return f"a hard link ({found.st_nlink} links)"
    return None


def _write_own(path: Path, data: bytes) -> None:
    """Write ``data`` as the whole of ``path``, a regular file of this user's (:func:`_open_own`), made if missing.

    Truncated only once it passed the check: ``O_TRUNC`` would empty a planted link's or hard link's file on open.

    Raises:
        DestinationError: ``path`` is a symbolic link, a hard link, not a regular file, or another user's.
        OSError: the file cannot be opened or written.

    """
    fd = _open_own(path, os.O_WRONLY)
    with os.fdopen(fd, "wb") as fh:
        fh.truncate(0)
        fh.write(data)


def _check_fresh(folder: Path, names: tuple[str, ...]) -> None:
    """Refuse to let another program (LMDB) open ``names`` in ``folder`` unless each is missing or this user's own.

    ``folder`` must be a folder of this user's, not a link; a file there that is a symbolic link, a hard link or
    another user's would be opened and written through by LMDB, which follows links.

    Raises:
        DestinationError: ``folder`` or one of the files is not this package's own.

    """
    refused = _not_own(folder, os.lstat(folder), directory=True)
    for name in names:
        if refused is not None:
            break
        with contextlib.suppress(FileNotFoundError):
            refused = _not_own(folder / name, os.lstat(folder / name))
    if refused is not None:
        raise refused


def _fresh_working_copy(tmp: Path) -> None:
    """Make the working copy ``tmp`` (``.DST.partial``) an empty folder of this user's, removing a dead conversion's.

    Raises:
        DestinationError: ``tmp`` is a symbolic link, not a folder, or another user's (planted: nothing is removed,
            followed or written through it), or what a dead conversion left there cannot be removed.

    """
    try:
        found: os.stat_result | None = os.lstat(tmp)
    except FileNotFoundError:
        found = None
    if found is not None:
        refused = _not_own(tmp, found, directory=True)
        if refused is not None:
            raise refused
        log.info("removing %s (%s), left by an interrupted conversion", tmp, human_bytes(_dir_size(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except FileExistsError:  # what rmtree could not remove, or something made there meanwhile
        raise DestinationError(
            f"{str(tmp)!r}, the working copy of an interrupted conversion, could not be removed; nothing was"
            " written. Remove it (check its permissions), then run the conversion again."
        ) from None
    _check_fresh(tmp, ())


def _remove_aside(old: Path) -> None:
    """Remove ``old`` (``.DST.old``, a database a publish moved aside), unless it is not this user's own folder.

    Raises:
        DestinationError: ``old`` is a symbolic link, not a folder, or another user's: planted, it is never removed,
            followed or renamed over.

    """
    try:
        found = os.lstat(old)
    except FileNotFoundError:
        return
    refused = _not_own(old, found, directory=True)
    if refused is not None:
        raise refused
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    """Make the names in ``folder`` (files created, renamed or removed there) durable; a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system whose folders cannot be synced
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _make_parent(dst: Path) -> None:
    """Create the folder ``dst`` goes into; a file in the way or a read-only folder is a ``DestinationError``."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [dst.parent, *dst.parent.parents] if p.exists() and not p.is_dir()), dst.parent)
        raise DestinationError(
            f"`dst` {str(dst)!r} cannot be created: {str(blocker)!r} is a file, not a folder. Choose a `dst` whose"
            " parent folders are folders, or move that file away."
        ) from None
    except OSError as err:
        if err.errno in _READ_ONLY:
            raise _read_only_error(dst, err) from err
        raise


def _read_only_error(dst: Path, err: OSError | None = None, outdated: bool = False) -> DestinationError:
    """The error for a conversion into a folder this process cannot write to (or whose lock file is another user's)."""
    if isinstance(err, _ForeignLock):
        return _foreign_lock_error(dst, err, outdated)
    reason = f" ({err.strerror})" if err is not None and err.strerror else ""
    what = (
        "holds a database that is out of date (its source or the conversion settings changed), and"
        if outdated
        else "cannot be written:"
    )
    # the folder that refused: where `dst`'s folder does not exist yet, the nearest parent that does, not a folder
    # that is not there
    folder = next((p for p in [dst.parent, *dst.parent.parents] if p.is_dir()), dst.parent)
    where = (
        f"its folder {str(dst.parent)!r} is read-only{reason}"
        if folder == dst.parent
        else f"its folder {str(dst.parent)!r} does not exist and cannot be made in {str(folder)!r}, which is"
        f" read-only{reason}"
    )
    error = ReadOnlyDestinationError(
        f"`dst` {str(dst)!r} {what} {where}. Convert into a writable folder, or convert there first and make it"
        " read-only afterwards."
    )
    error.folder = str(folder)
    error.reason = err.strerror if err is not None and err.strerror else None
    return error


def _foreign_lock_error(dst: Path, err: _ForeignLock, outdated: bool) -> DestinationError:
    """The error for a target whose lock file is another user's: it names the file, its owner and whether it is held."""
    import pwd

    try:
        owner = f"{pwd.getpwuid(err.uid).pw_name}, uid {err.uid}"
    except KeyError:
        owner = f"uid {err.uid}"
    holder = converter_of(dst)
    held = (
        f"held now by {describe_converter(holder)}: wait for it to finish, then run again"
        if holder is not None
        else "held by no process (left by a run that was stopped): its owner may remove it"
    )
    what = "holds a database that is out of date, but" if outdated else "cannot be written:"
    return DestinationError(
        f"{str(dst)!r} {what} its lock file {err.filename!r} belongs to another user ({owner}): this package never"
        f" writes to another user's file, so it cannot take the lock. That file is {held}. A complete, up-to-date"
        f" database at {str(dst)!r} is read without the lock; to write one, use a folder of your own."
    )


def _unwritable_error(dst: Path, err: OSError, outdated: bool = False) -> DestinationError:
    """The error for a conversion where no lock can be taken: a read-only folder, no file locks, another user's lock."""
    if err.errno not in _NO_LOCKS:
        return _read_only_error(dst, err, outdated)
    return DestinationError(
        f"`dst` {str(dst)!r} cannot be converted: its folder {str(dst.parent)!r} is on a file system without file"
        f" locks ({err.strerror or err}), and without the lock two processes (two nodes sharing this folder) could"
        " write one database at once. Convert once where locks work (a local disk) and copy the database here, or"
        " mount the file system with locks (NFS: its lock service; Lustre: the `flock` mount option). An up-to-date"
        " database needs no lock to be read: pass it as `data_dir`."
    )


def _recover_interrupted_publish(dst: Path) -> None:
    """Put back the previous database if a conversion died between moving it aside and moving the new one in.

    Raises:
        DestinationError: the database moved aside (``.DST.old``) is a symbolic link, not a folder, or another user's:
            it is neither followed nor moved.

    """
    old = dst.parent / f".{dst.name}.old"
    try:
        found = os.lstat(old)
    except FileNotFoundError:
        return
    if os.path.lexists(dst):
        return  # nothing to put back: the next publish removes it
    refused = _not_own(old, found, directory=True)
    if refused is not None:
        raise refused
    log.warning("restoring %s from %s, left by a conversion interrupted while it replaced it", dst, old)
    os.replace(old, dst)


def stale_conversions(folder: str | os.PathLike[str]) -> list[Path]:
    """What interrupted conversions left in ``folder``: working copies and lock files that no running converter holds.

    Each ``.NAME.partial`` (an unfinished database), ``.NAME.old`` (a replaced one) and ``.NAME.lock`` whose lock is
    not held by a live converter is listed; those of a conversion under way are not. Only this user's own folders are
    listed, and lock files that are regular files of one name: a link, a hard link or another user's folder under
    such a name was not left by this user's conversion, and is never removed or restored (see
    :func:`clean_stale_conversions`).
    """
    return _leftovers(folder)[0]


def _leftovers(folder: str | os.PathLike[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """:func:`stale_conversions`, and what stands under a leftover's name but is not this user's own, with what it is.

    The latter are those that, followed, look like a leftover (:func:`_looks_ours`): a link to a database named
    ``.NAME.old``, say, which restoring would make ``NAME`` a link to data this user never converted.
    """
    root = Path(folder).expanduser().absolute()
    try:
        names = sorted(e.name for e in os.scandir(root) if e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    stale, foreign = [], []
    for name in names:
        for suffix in (".partial", ".old", ".lock"):
            if name.endswith(suffix) and len(name) > len(suffix) + 1:
                path, target = root / name, root / name[1 : -len(suffix)]
                what = _not_left_by_us(path)
                if what is not None:
                    if _looks_ours(path, target):
                        foreign.append((path, what))
                elif _looks_ours(path, target) and converter_of(target) is None:
                    stale.append(path)
    return stale, foreign


def _not_left_by_us(path: Path) -> str | None:
    """What ``path`` (a leftover's name) is when no conversion of this user's left it (:func:`_foreign`), else ``None``.

    A lock file that is a regular file of one name passes whoever owns it: taking its lock says whose it is.
    """
    try:
        found = os.lstat(path)
    except OSError:
        return None  # gone meanwhile: nothing to say of it (nor does it look like a leftover any longer)
    if path.suffix == ".lock" and stat.S_ISREG(found.st_mode) and found.st_nlink == 1:
        return None
    return _foreign(found, directory=path.suffix != ".lock")


def _looks_ours(path: Path, target: Path) -> bool:
    """Whether ``path`` (``.NAME.partial``, ``.NAME.old`` or ``.NAME.lock``), followed, looks left by a conversion.

    Not another program's: a database folder (or a working copy not yet started), or a lock file beside one or
    holding a converter's record. Whether it is this user's own is :func:`_not_left_by_us`'s to say.
    """
    if path.suffix == ".lock":
        if not path.is_file():
            return False
        if (target / DATA_FILE).is_file() or partial_path(target).is_dir():
            return True
        with contextlib.suppress(UnicodeDecodeError, ValueError):
            record = parse_json(_read_small(path, 4096) or b"null")  # a converter's record is some 100 bytes
            return isinstance(record, dict) and "pid" in record and "host" in record
        return False
    return path.is_dir() and ((path / DATA_FILE).is_file() or _staging(path) or not any(path.iterdir()))


def _read_small(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path``, read without following a link; ``None`` if it has over ``limit``.

    ``None`` too when ``path`` is missing, a link or not a regular file (a FIFO is never opened), or cannot be read:
    what is read is never more than ``limit`` bytes, whatever the file says of its size
    (:func:`~lightning_fastdata._files.read_regular`).
    """
    try:
        return read_regular(path, limit=limit, follow_links=False)
    except OSError:  # NotRegularFileError and FileTooLargeError among them
        return None


def _staging(path: Path) -> bool:
    """Whether the working copy ``path`` is a staging's (it holds ``progress.json``), not a conversion's."""
    return (path / PROGRESS_FILE).is_file()


def clean_stale_conversions(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what interrupted conversions left in ``folder`` (:func:`stale_conversions`); one line per action.

    A ``.NAME.old`` whose database ``NAME`` is missing (a conversion died while replacing it) is put back as
    ``NAME`` rather than removed. Each ``NAME``'s leftovers are removed while holding its conversion lock, so a
    conversion that starts meanwhile is never touched. A link, a hard link or another user's folder under a
    leftover's name is left as it is, and named in a line of its own.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ReadOnlyDestinationError: ``folder`` is read-only.

    """
    root = Path(folder).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"`folder` {str(root)!r} does not exist or is not a folder. Pass the folder to clean.")
    stale, foreign = _leftovers(root)
    leftovers: dict[Path, list[Path]] = {}
    for path in stale:
        leftovers.setdefault(root / path.name[1 : -len(path.suffix)], []).append(path)
    done = []
    for target, paths in leftovers.items():
        try:
            with _target_lock(target, wait=False) as read_only:
                if read_only is not None:
                    raise _unwritable_error(target, read_only) from read_only
                done += [_clean(path, target) for path in paths]
        except BlockingIOError:
            continue  # a conversion to `target` started meanwhile: its files are in use
    for path, what in foreign:
        kind = "file" if path.suffix == ".lock" else "folder"
        done.append(
            f"left {str(path)!r} as it is: it is {what}, where an interrupted conversion leaves a {kind} of this"
            f" user's; nothing was removed, restored or followed through it. Unless you made it, remove it, and check"
            f" who else can write to {str(root)!r}."
        )
    return done


def _clean(path: Path, target: Path) -> str:
    """Remove (or, for a database moved aside, put back) one leftover of a conversion to ``target``.

    Raises:
        DestinationError: ``path``, listed as this user's folder, was replaced by a link or another user's since.

    """
    if path.suffix != ".lock":
        try:
            refused = _not_own(path, os.lstat(path), directory=True)
        except FileNotFoundError:
            return f"{path} is gone already"
        if refused is not None:
            raise refused
    if path.suffix == ".old" and not os.path.lexists(target):
        os.replace(path, target)
        return f"restored {target} from {path.name}, left by a conversion interrupted while replacing it"
    if path.suffix != ".lock":
        size, what = _dir_size(path), "staging" if _staging(path) else "conversion"
        shutil.rmtree(path, ignore_errors=True)
        return f"removed {path} ({human_bytes(size)}), left by an interrupted {what}"
    return f"removed {path}, the lock file of a conversion that is no longer running"  # removed when the lock ends


def _report_stale(dst: Path) -> None:
    """Name the working copies that dead converters left beside ``dst`` (this one's own is replaced anyway)."""
    own = partial_path(dst)
    stale = [p for p in stale_conversions(dst.parent) if p.suffix == ".partial" and p != own]
    if stale:
        sizes = sum(_dir_size(p) for p in stale if p.is_dir())
        log.warning(
            "%d incomplete conversion(s) left by converters that are no longer running take %s in %s: %s. Remove them"
            " with `lightning-fastdata convert --clean %s`.",
            len(stale),
            human_bytes(sizes),
            dst.parent,
            ", ".join(p.name for p in stale),
            dst.parent,
        )


def _write_failure(
    err: BaseException, tmp: Path, dst: Path, plan: ConversionPlan, summary: ConversionSummary, bound: _PageBound
) -> str:
    """Why writing failed: a full disk, named with the free space and what the database needs (:class:`_PageBound`).

    A full disk is the one clear error, whether it was found before a commit (:class:`_NoRoom`) or LMDB's commit
    failed on it (``ENOSPC``, or the ``Input/output error`` of a short write where less is free than still needed).
    """
    free = _free_space(dst.parent)
    try:
        written = (tmp / DATA_FILE).stat().st_size
    except OSError:
        written = 0
    total = sum(len(tasks) for tasks in plan.tasks.values())
    if summary.written > 0:  # the records handed to LMDB so far, committed or not; the sources list is put last
        names = sum(len(name) + 4 for split_names in plan.names.values() for name in split_names)
        needed = bound.nbytes(total / summary.written) + names + _OTHER_FILES
        basis = f"LMDB's pages of the images so far: {human_bytes(round(needed / total))} per image, for {total} images"
    else:
        needed = plan.source_bytes
        basis = f"the {human_bytes(plan.source_bytes)} of the {total} source images"
    code = getattr(err, "errno", None)
    full = isinstance(err, _NoRoom) or code in (errno.ENOSPC, errno.EDQUOT) or isinstance(err, lmdb.DiskError)
    full = full or (free is not None and needed > 0 and free < needed - written)
    if not full:
        return (
            f"writing the database under {str(tmp)!r} failed: {err}. Check free disk space and permissions of"
            f" {str(dst.parent)!r}, then run the conversion again; nothing was published."
        )
    missing = max(0, needed - written - (free or 0))
    what = (
        f"stopped before filling the disk ({err.strerror})"
        if isinstance(err, _NoRoom)
        else f"failed: the disk is full (ENOSPC; LMDB said: {err})"
    )
    return (
        f"writing the database under {str(tmp)!r} {what}. {human_bytes(free or 0)} is free on the disk of"
        f" {str(dst.parent)!r}; the database needs about {human_bytes(needed)} (estimated from {basis}), so free about"
        f" {human_bytes(missing)} more, or convert onto another disk, then run the conversion again; nothing was"
        " published."
    )


def write_database(
    plan: ConversionPlan,
    dst: str | os.PathLike[str],
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    num_workers: int | None,
    strict: bool,
    force: bool,
    progress: bool,
    initial_map_size: int,
) -> ConversionSummary:
    """Convert ``plan`` into the database ``dst``, or find it up to date; the arguments are ``convert``'s.

    Raises:
        DestinationError: ``dst`` holds other data, or (without ``force``) a database of another source; or a
            symbolic link, a hard link or another user's file or folder stands where the conversion writes its lock
            file, its working copy (``.DST.partial``, and LMDB's files in it) or the database it moves aside
            (``.DST.old``): nothing is written, removed or renamed through it.
        ReadOnlyDestinationError: the folder of ``dst`` is read-only and ``dst`` is not an up-to-date database.
        ConversionError: nothing could be converted, an input was skipped under ``strict``, or writing failed.

    """
    dst = Path(dst).absolute()
    _make_parent(dst)
    encoding_meta = asdict(opts)
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"`num_workers` must be >= 0 (0 converts in this process), got {num_workers}.")
    summary = ConversionSummary(destination=str(dst), workers=num_workers or 0, ignored=list(plan.ignored))
    start = time.perf_counter()
    with _target_lock(dst) as read_only:
        if read_only is None:
            _recover_interrupted_publish(dst)
        old = _existing_meta(dst)
        old_source = old.get("source", {}).get("path") if old is not None else None
        # a dataset's source is only its type name: two datasets cannot be told apart, and re-running must work
        both_datasets = str(old_source).startswith("<") and plan.source.startswith("<")
        if old is not None and not force and old_source != plan.source and not both_datasets:
            raise DestinationError(
                f"`dst` {str(dst)!r} holds a database converted from {old_source!r}, not from {plan.source!r};"
                " refusing to replace it (it may be the only copy of that data). Choose another `dst`, or pass"
                " --force (`force=True`) to replace it."
            )
        if (
            old is not None
            and not force
            and plan.fingerprint is not None
            and old.get("source", {}).get("fingerprint") == plan.fingerprint
            and old.get("encoding") == encoding_meta
            and old.get("targets", {"kind": "class"}) == plan.targets.to_meta()  # `--targets` stores another kind
        ):
            summary.up_to_date = True
            summary.written = sum(s["length"] for s in old["splits"].values())
            summary.splits = {name: s["length"] for name, s in old["splits"].items()}
            return summary
        if read_only is not None:
            raise _unwritable_error(dst, read_only, outdated=old is not None) from read_only

        _report_stale(dst)
        tmp = partial_path(dst)
        _remove_aside(dst.parent / f".{dst.name}.old")  # before any work: a planted one would stop the publish
        _fresh_working_copy(tmp)
        summary.skipped.extend(plan.skipped)
        bound = _PageBound(min(mmap.PAGESIZE, _MAX_PAGE))  # LMDB's page is the system's, at most 32 KiB
        try:
            try:
                meta = _write(plan, tmp, datasets, opts, num_workers, progress, initial_map_size, summary, bound)
            except (lmdb.Error, OSError) as err:
                raise ConversionError(_write_failure(err, tmp, dst, plan, summary, bound)) from err
            summary.seconds = time.perf_counter() - start
            if strict and summary.skipped:
                raise ConversionError(
                    f"{len(summary.skipped)} input(s) could not be converted and `strict` is set; nothing was"
                    f" written to {str(dst)!r}. First: {summary.skipped[0].path}: {summary.skipped[0].reason}."
                    " Fix or remove those files, or convert without --strict to skip them."
                )
            if summary.written == 0:
                first = f" First: {summary.skipped[0].path}: {summary.skipped[0].reason}." if summary.skipped else ""
                raise ConversionError(f"none of the {len(summary.skipped)} inputs could be converted.{first}")
            summary.bytes_out = _dir_size(tmp)
            report = {"meta": meta, **summary.to_dict()}
            try:
                _write_own(tmp / REPORT_FILE, json.dumps(report, indent=2, default=str).encode())
            except OSError as err:
                raise ConversionError(
                    f"writing {REPORT_FILE} under {str(tmp)!r} failed: {err}. Check free disk space; nothing"
                    " was published."
                ) from err
            _publish(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return summary


def _publish(tmp: Path, dst: Path) -> None:
    """Move the finished database into place; an interruption leaves either the old or the new one, or none.

    The rename is synced (the folder of ``dst``): after a crash the new database is there, not a name pointing at
    nothing. The files in ``tmp`` must be synced already.

    Raises:
        DestinationError: ``.DST.old`` is a symbolic link, not a folder, or another user's: nothing is renamed over it.

    """
    if dst.exists():
        old = dst.parent / f".{dst.name}.old"
        _remove_aside(old)  # left by a publish that died after moving the new one in; a planted one is refused
        os.replace(dst, old)
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
        if os.path.islink(old):  # `dst` was a link, moved aside as it is: only the link goes
            os.unlink(old)
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)


def _write(
    plan: ConversionPlan,
    tmp: Path,
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    workers: int | None,
    progress: bool,
    initial_map_size: int,
    summary: ConversionSummary,
    bound: _PageBound,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "complete": False,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "writer": f"lightning_fastdata {__version__}",
        "encoding": asdict(opts),
        "source": {"path": plan.source, "fingerprint": plan.fingerprint},
    }
    all_tasks = [task for split_tasks in plan.tasks.values() for task in split_tasks]
    all_names = [name for split in plan.tasks for name in plan.names.get(split, [])]
    if len(all_names) != len(all_tasks):
        all_names = [f"{task[0]}[{task[1]}]" for task in all_tasks]
    spec = plan.targets
    if spec.kind in ("class", "multilabel") and plan.classes is not None:
        spec = dataclasses.replace(spec, num_classes=len(plan.classes))
    elif spec.kind == "multilabel":  # indices of a dataset without class names: checked against the largest kind
        spec = dataclasses.replace(spec, num_classes=MAX_DIM)
    columns = {split: TargetColumn(spec) for split in plan.tasks}
    sources: dict[str, list[str]] = {split: [] for split in plan.tasks}
    class_to_idx = {name: i for i, name in enumerate(plan.classes)} if plan.classes is not None else None
    bar = tqdm(total=len(all_tasks), unit="img", desc=f"convert {Path(plan.source).name}", disable=not progress)
    # The pool starts before the LMDB environment opens: a forked child must never inherit an open environment.
    with bar, encode_all(all_tasks, datasets, opts, workers, (spec, class_to_idx, plan.targets_inferred)) as encoded:
        summary.workers = encoded.workers
        writer = _LmdbWriter(tmp, initial_map_size, bound)
        try:
            writer.put(META_KEY, dump_meta(meta))  # complete=False until the very end
            writer.flush()
            for task, name, result in zip(all_tasks, all_names, encoded.results, strict=True):
                split = task[0]
                summary.bytes_in += result.bytes_in
                if result.reason is not None or result.payload is None:
                    shown = task[1] if isinstance(task[1], str) else f"{split}[{task[1]}]"
                    if str(result.reason).startswith(MIXED_KINDS):  # inferred from the first sample, wrongly
                        raise AmbiguousTargetsError(
                            f"the dataset's targets are not all of one kind: {shown}'s"
                            f" {str(result.reason)[len(MIXED_KINDS) :].strip()}. Pass `targets=` ('class',"
                            " 'multilabel', 'float' or 'none') to say what they are; nothing was written."
                        )
                    summary.skipped.append(SkippedFile(str(shown), str(result.reason)))
                    bar.set_postfix(skipped=len(summary.skipped), refresh=False)
                else:
                    column = columns[split]
                    label = column.add(result.label)
                    record = pack_record(result.encoding, label, result.height, result.width, result.payload)
                    writer.put(record_key(split, len(column) - 1), record)
                    sources[split].append(name)
                    summary.written += 1  # live, with bytes_out: a full disk's message estimates the space needed
                    summary.bytes_out += len(record)
                bar.update()
            classes = plan.classes
            if spec.kind in ("class", "multilabel"):
                top = max((column.top() for column in columns.values()), default=-1)
                if classes is None:
                    classes = [str(i) for i in range(top + 1)]
                elif top >= len(classes):
                    raise ConversionError(
                        f"a label is >= the number of classes ({len(classes)}); pass the full `classes`."
                    )
                spec = dataclasses.replace(spec, num_classes=len(classes))
            else:
                classes = []
            meta["classes"] = classes
            meta["targets"] = spec.to_meta()
            meta["splits"] = {}
            for split, column in columns.items():
                column.spec = spec
                if spec.kind == "class":
                    writer.put(labels_key(split), column.labels().tobytes())
                for key, value in column.arrays(split).items():
                    writer.put(key, value)
                writer.put(sources_key(split), json.dumps(sources[split]).encode())
                meta["splits"][split] = {"length": len(column), **column.split_meta(split)}
            summary.add_targets(spec, classes, meta["splits"])
            meta["complete"] = True
            writer.put(META_KEY, dump_meta(meta))
        except BaseException:
            writer.env.close()  # drop pending writes: the partial directory is deleted by the caller
            raise
        writer.close()
    summary.splits = {split: len(column) for split, column in columns.items()}
    summary.written = sum(summary.splits.values())
    return meta
