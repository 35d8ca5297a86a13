"""Files in memory that no path names, shared by the batch slots and the PNG decoder."""

from __future__ import annotations

import os
import tempfile


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
