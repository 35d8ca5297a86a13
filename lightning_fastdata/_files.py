"""How this package opens files it did not make; and files in memory that no path names.

A file this package reads but did not make (an image or list file of a source, a lock file, a record beside a
database, a working copy's progress) may be anything under its name: ``/dev/zero`` reads forever, a FIFO blocks its
reader until a writer comes, a symbolic link names a file elsewhere, a regular file may hold gigabytes where a few
hundred bytes were expected. Every such file is opened here: :func:`open_regular` opens only a regular file, never
blocking, and :func:`read_regular` reads one, never more than its size or a limit; :func:`file_kind` says what a
file that is refused is, for a message, and :func:`owned` whether this process's user owns it.

The batch slots and the PNG decoder take their files in memory from here too (:func:`anonymous_file`,
:func:`path_of`). Nothing heavy is imported: conversion workers import this module without torch.
"""

from __future__ import annotations

import os
import stat
import tempfile

#: how a file this package did not make is opened: read-only, never waiting (the open of a FIFO waits for a writer
#: that may never come), never becoming this process's terminal, never inherited by a child
_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
#: the most bytes one ``os.read`` asks for: Linux returns at most 2 GiB - 4 KiB a call, whatever was asked
_READ_CHUNK = 1 << 30


class NotRegularFileError(OSError):
    """A path that names no regular file (a FIFO, a device, a socket, a folder, a link not followed): never read.

    ``kind`` says what it is (``"a FIFO (named pipe)"``, :func:`file_kind`); the message, ``"<path> is <kind>, not a
    regular file"``.
    """

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path!r} is {kind}, not a regular file")
        self.path, self.kind = path, kind


class FileTooLargeError(OSError):
    """A regular file of more bytes than its reader's ``limit``: refused, nothing past the limit read.

    ``size``: the bytes it holds, as far as known (its ``fstat`` size, or ``limit + 1`` where that said less).
    """

    def __init__(self, path: str, limit: int, size: int) -> None:
        super().__init__(f"{path!r} holds more than the {limit} bytes it may")
        self.path, self.limit, self.size = path, limit, size


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``"a regular file"``, ``"a FIFO (named pipe)"``..."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def owned(st: os.stat_result) -> bool:
    """Whether this process's user owns the file ``st`` describes (everything, where there are no users)."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid is None or st.st_uid == geteuid()


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at ``path``, and its ``fstat``; the caller closes it.

    Only a regular file is opened: its ``stat`` (``lstat`` with ``follow_links=False``) is checked before the open,
    since opening a device may act (a tape rewinds) where opening a regular file never does, and again on the open
    descriptor, which a swap of the name between the two cannot fool. The open never blocks (``O_NONBLOCK``: a FIFO
    swapped in meanwhile is refused, not waited on); ``follow_links=False`` opens no symbolic link (``O_NOFOLLOW``).
    The ``fstat`` returned is the opened file's own, not the name's.

    Raises:
        NotRegularFileError: ``path`` is a FIFO, a device, a socket, a folder or, with ``follow_links=False``, a
            symbolic link.
        OSError: it cannot be opened (a link swapped in since the check: ``ELOOP``).

    """
    name = os.fsdecode(path)
    st = os.stat(path, follow_symlinks=follow_links)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(name, file_kind(st.st_mode))
    fd = os.open(path, _READ_FLAGS if follow_links else _READ_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since the check above
            raise NotRegularFileError(name, file_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_opened(fd: int, st: os.stat_result, *, limit: int | None = None, name: str = "") -> bytes:
    """The bytes of the regular file open at ``fd`` (``st``: its ``fstat``), bounded.

    Without ``limit``, the read stops at the size ``fstat`` gave: a file that grows meanwhile is not read past it,
    one cut short gives what it holds. With ``limit``, it is read to its end but never more than ``limit`` bytes,
    whatever its size says (a ``/proc`` file says 0): one that holds more is refused.

    Raises:
        FileTooLargeError: ``limit`` is given and the file holds more (``name`` is the path its message names).
        OSError: it cannot be read.

    """
    if limit is not None and st.st_size > limit:
        raise FileTooLargeError(name, limit, st.st_size)
    bound = st.st_size if limit is None else limit + 1  # one byte past the limit tells a file that holds more
    chunks: list[bytes] = []
    size = 0
    while size < bound:
        chunk = os.read(fd, min(bound - size, _READ_CHUNK))
        if not chunk:  # its end (cut short while read)
            break
        chunks.append(chunk)
        size += len(chunk)
    if limit is not None and size > limit:
        raise FileTooLargeError(name, limit, max(size, st.st_size))
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_regular(path: str | os.PathLike[str], *, limit: int | None = None, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at ``path``: :func:`open_regular`, then :func:`read_opened`.

    Never more than its size when it was opened or, given, ``limit`` bytes; ``follow_links=False`` reads no symbolic
    link.

    Raises:
        NotRegularFileError: ``path`` is a FIFO, a device, a socket, a folder or, with ``follow_links=False``, a
            symbolic link.
        FileTooLargeError: it holds more than ``limit`` bytes.
        OSError: it cannot be opened or read.

    """
    fd, st = open_regular(path, follow_links=follow_links)
    try:
        return read_opened(fd, st, limit=limit, name=os.fsdecode(path))
    finally:
        os.close(fd)


def anonymous_file(name: str) -> int:
    """A descriptor of a file in memory that no path names: a ``memfd`` (Linux), else an unlinked temporary file.

    Nothing is ever left behind, whatever ends the process; ``name`` only labels a ``memfd`` in ``/proc/PID/fd``.
    """
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=where)
    os.unlink(path)
    return fd


#: where a process opens its own descriptors by name (Linux; ``/dev/fd`` on other Unixes)
_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def path_of(fd: int) -> str:
    """A path that opens the file of this process's descriptor ``fd`` again (for an API that takes only a path)."""
    return f"{_FD_DIR}/{fd}"
