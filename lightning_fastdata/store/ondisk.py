"""What the writer and staging do with a target's files on disk: lock, own, work on a copy, move it into place.

A target (a database ``NAME``, converted or staged) is written under its lock (:func:`target_lock`, ``.NAME.lock``)
into a hidden working copy (``.NAME.partial``), which is then moved into place by rename (:func:`move_into_place`,
the database it replaces moved aside as ``.NAME.old`` for the moment), the folder synced (:func:`fsync_dir`). A file
or folder this package writes is opened only as this user's own, never through a link planted at its name
(:func:`open_own`, :func:`not_own`). The writer (:mod:`~lightning_fastdata.store.writer`), staging
(:mod:`~lightning_fastdata.store.remote`), the cleaning of leftovers (:mod:`~lightning_fastdata.store.leftovers`) and
the cache (:mod:`~lightning_fastdata.store.cache`) use these; the low-level readers of regular files are
:mod:`lightning_fastdata._files`'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_fastdata._files import owned, read_regular
from lightning_fastdata.errors import DestinationError, ReadOnlyDestinationError
from lightning_fastdata.store.format import (
    converter_of,
    converter_record,
    describe_converter,
    fcntl,  # advisory lock so two converters never build one target at once
    lock_path,
)
from lightning_fastdata.store.summary import human_bytes

log = logging.getLogger(__name__)

#: what ``mkdir``/``open`` raise in a folder this process may not write to
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


#: what ``flock`` raises on a file system without file locks (NFS without its lock service, Lustre without the
#: ``flock`` mount option)
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


@contextlib.contextmanager
def target_lock(dst: Path, wait: bool = True) -> Iterator[OSError | None]:
    """Hold the conversion lock of ``dst`` while the block runs; yields the error when it cannot be written or locked.

    A folder that is read-only, or on a file system without file locks, yields that error instead of a lock, and so
    does a lock file that is another user's regular file (:class:`ForeignLock`: this process never writes to it):
    then only a complete, up-to-date database may be used (:func:`unwritable_error` says why nothing else is).
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
            fh = os.fdopen(open_own(path, os.O_RDWR), "r+b")  # held for the whole block, closed in `finally`
        except OSError as err:
            if err.errno not in READ_ONLY:
                raise
            yield err  # a read-only folder: no conversion can happen here, but a complete database can be used
            return
        except DestinationError:
            foreign = ForeignLock.of(path)
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


class ForeignLock(PermissionError):
    """The lock file of a target is another user's regular file: this process never writes to it, so it cannot lock.

    ``uid`` is its owner's.
    """

    uid: int

    @classmethod
    def of(cls, path: Path) -> ForeignLock | None:
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


def open_own(path: Path, flags: int, folder: int | None = None) -> int:
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
            refused = not_own(path, os.lstat(path.name if folder is not None else path, dir_fd=folder))
            if refused is not None:
                raise refused from None
        raise
    refused = not_own(path, os.fstat(fd))
    if refused is not None:
        os.close(fd)
        raise refused
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)  # a regular file of this user's: as opened without O_NONBLOCK
    return fd


def not_own(path: Path, found: os.stat_result, directory: bool = False) -> DestinationError | None:
    """Why ``path`` (``found``: its ``lstat``) is not a regular file (``directory``: a folder) of this user's."""
    what = foreign_kind(found, directory)
    if what is None:
        return None
    return DestinationError(
        f"{str(path)!r} is {what}, where this package writes its own {'folder' if directory else 'file'}; nothing"
        f" was written through it. Remove it, and check who else can write to {str(path.parent)!r}."
    )


def foreign_kind(found: os.stat_result, directory: bool = False) -> str | None:
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


def write_own(path: Path, data: bytes) -> None:
    """Write ``data`` as the whole of ``path``, a regular file of this user's (:func:`open_own`), made if missing.

    Truncated only once it passed the check: ``O_TRUNC`` would empty a planted link's or hard link's file on open.

    Raises:
        DestinationError: ``path`` is a symbolic link, a hard link, not a regular file, or another user's.
        OSError: the file cannot be opened or written.

    """
    fd = open_own(path, os.O_WRONLY)
    with os.fdopen(fd, "wb") as fh:
        fh.truncate(0)
        fh.write(data)


def check_fresh(folder: Path, names: tuple[str, ...]) -> None:
    """Refuse to let another program (LMDB) open ``names`` in ``folder`` unless each is missing or this user's own.

    ``folder`` must be a folder of this user's, not a link; a file there that is a symbolic link, a hard link or
    another user's would be opened and written through by LMDB, which follows links.

    Raises:
        DestinationError: ``folder`` or one of the files is not this package's own.

    """
    refused = not_own(folder, os.lstat(folder), directory=True)
    for name in names:
        if refused is not None:
            break
        with contextlib.suppress(FileNotFoundError):
            refused = not_own(folder / name, os.lstat(folder / name))
    if refused is not None:
        raise refused


def fresh_working_copy(tmp: Path) -> None:
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
        refused = not_own(tmp, found, directory=True)
        if refused is not None:
            raise refused
        log.info("removing %s (%s), left by an interrupted conversion", tmp, human_bytes(dir_size(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except FileExistsError:  # what rmtree could not remove, or something made there meanwhile
        raise DestinationError(
            f"{str(tmp)!r}, the working copy of an interrupted conversion, could not be removed; nothing was"
            " written. Remove it (check its permissions), then run the conversion again."
        ) from None
    check_fresh(tmp, ())


def remove_aside(old: Path) -> None:
    """Remove ``old`` (``.DST.old``, a database a publish moved aside), unless it is not this user's own folder.

    Raises:
        DestinationError: ``old`` is a symbolic link, not a folder, or another user's: planted, it is never removed,
            followed or renamed over.

    """
    try:
        found = os.lstat(old)
    except FileNotFoundError:
        return
    refused = not_own(old, found, directory=True)
    if refused is not None:
        raise refused
    shutil.rmtree(old, ignore_errors=True)


def move_into_place(tmp: Path, dst: Path) -> None:
    """Move the finished database into place; an interruption leaves either the old or the new one, or none.

    The rename is synced (the folder of ``dst``): after a crash the new database is there, not a name pointing at
    nothing. The files in ``tmp`` must be synced already.

    Raises:
        DestinationError: ``.DST.old`` is a symbolic link, not a folder, or another user's: nothing is renamed over it.

    """
    if dst.exists():
        old = dst.parent / f".{dst.name}.old"
        remove_aside(old)  # left by a publish that died after moving the new one in; a planted one is refused
        os.replace(dst, old)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
        if os.path.islink(old):  # `dst` was a link, moved aside as it is: only the link goes
            os.unlink(old)
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
        fsync_dir(dst.parent)


def recover_interrupted_publish(dst: Path) -> None:
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
    refused = not_own(old, found, directory=True)
    if refused is not None:
        raise refused
    log.warning("restoring %s from %s, left by a conversion interrupted while it replaced it", dst, old)
    os.replace(old, dst)


def fsync_dir(folder: Path) -> None:
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


def dir_size(path: Path) -> int:
    """The bytes of the files directly in the folder ``path`` (a database's, or a working copy's)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def read_small(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path``, read without following a link; ``None`` if it has over ``limit``.

    ``None`` too when ``path`` is missing, a link or not a regular file (a FIFO is never opened), or cannot be read:
    what is read is never more than ``limit`` bytes, whatever the file says of its size
    (:func:`~lightning_fastdata._files.read_regular`).
    """
    try:
        return read_regular(path, limit=limit, follow_links=False)
    except OSError:  # NotRegularFileError and FileTooLargeError among them
        return None


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` atomically and durably: a temporary file, synced, renamed into place, its folder synced."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(value, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_only_error(dst: Path, err: OSError | None = None, outdated: bool = False) -> DestinationError:
    """The error for a conversion into a folder this process cannot write to (or whose lock file is another user's)."""
    if isinstance(err, ForeignLock):
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


def _foreign_lock_error(dst: Path, err: ForeignLock, outdated: bool) -> DestinationError:
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


def unwritable_error(dst: Path, err: OSError, outdated: bool = False) -> DestinationError:
    """The error for a conversion where no lock can be taken: a read-only folder, no file locks, another user's lock."""
    if err.errno not in _NO_LOCKS:
        return read_only_error(dst, err, outdated)
    return DestinationError(
        f"`dst` {str(dst)!r} cannot be converted: its folder {str(dst.parent)!r} is on a file system without file"
        f" locks ({err.strerror or err}), and without the lock two processes (two nodes sharing this folder) could"
        " write one database at once. Convert once where locks work (a local disk) and copy the database here, or"
        " mount the file system with locks (NFS: its lock service; Lustre: the `flock` mount option). An up-to-date"
        " database needs no lock to be read: pass it as `data_dir`."
    )
