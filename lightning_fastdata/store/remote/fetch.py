"""Fetching a publication's files into the working copy: parallel ranged reads, each range written once, hashed.

Ranges are read :func:`read_threads` at a time; a range counts as done in ``progress.json`` only once its bytes are
synced to disk, so an interrupted staging resumes. Each file is hashed as its ranges complete in order, read back from
the disk: what is hashed is what is published. The tunables (``RANGE_SIZE``, ``READ_THREADS``, ``SYNC_SECONDS``) are
read from :mod:`lightning_fastdata.store.remote` at each call, where they are set.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_fastdata.cpus import usable_cpu_count
from lightning_fastdata.errors import DestinationError, RemoteStorageError
from lightning_fastdata.store import remote
from lightning_fastdata.store.format import PROGRESS_FILE
from lightning_fastdata.store.ondisk import open_own, write_json
from lightning_fastdata.store.remote.errors import remote_error
from lightning_fastdata.store.remote.replies import BadReply, RangeReader, Reply
from lightning_fastdata.store.remote.urls import join
from lightning_fastdata.store.summary import human_bytes

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read_threads() -> int:
    """How many ranged reads staging keeps in flight: ``remote.READ_THREADS``, else twice the usable CPUs, 4 to 10.

    10 is the connection pool of s3fs's client (aiobotocore's ``max_pool_connections``): more would queue for it.
    """
    return remote.READ_THREADS or min(10, max(4, 2 * usable_cpu_count()))


def fetch_files(
    fs: AbstractFileSystem,
    path: str,
    shown: str,
    marker: dict[str, Any],
    work: Path,
    state: dict[str, Any],
    progress: bool,
) -> list[str]:
    """Fetch the ranges not done in ``state`` in parallel, hashing each file as its ranges complete in order.

    The ranges done before (by an interrupted staging) are read back and hashed too. A range counts as done in
    ``progress.json`` only once its bytes are synced to disk; every file is synced before this returns.

    Returns:
        The files whose SHA-256 is not the one ``marker`` lists.

    """
    from tqdm.auto import tqdm

    files = marker["files"]
    done = {name: _done_ranges(state, name, want["size"]) for name, want in files.items()}
    total = sum(want["size"] for want in files.values())
    resumed = sum(
        min(remote.RANGE_SIZE, files[name]["size"] - start) for name, starts in done.items() for start in starts
    )
    _check_free_space(work, shown, total - _on_disk(work, files, done))  # before anything is allocated
    if resumed:
        log.info("%s: resuming a staging interrupted with %d of %d bytes fetched", shown, resumed, total)
    fds: dict[str, int] = {}
    folder = os.open(work, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    try:
        for name, want in files.items():
            fds[name] = open_own(work / name, os.O_RDWR, folder)
            if os.fstat(fds[name]).st_size != want["size"]:
                os.ftruncate(fds[name], want["size"])
        hashes = {name: _FileHash(fds[name], want["size"]) for name, want in files.items()}
        tasks = [
            (name, start, min(start + remote.RANGE_SIZE, want["size"]))
            for name, want in files.items()
            for start in range(0, want["size"], remote.RANGE_SIZE)
            if start not in done[name]
        ]
        lock = threading.Lock()
        reader = RangeReader(fs, shown)
        # the ranges written, or being written, from one reply: each range is written once, from the first reply that
        # brings it, so the bytes hashed (the ranges done, read back) are the bytes published
        claimed = {name: set(starts) for name, starts in done.items()}

        def settle(name: str, start: int, data: bytes | bytearray | memoryview) -> int:
            """Write ``data`` as the range ``start`` of ``name`` unless another reply claimed it; the bytes written."""
            with lock:
                if start in claimed[name]:
                    return 0  # written, or being written, from another reply: these bytes are dropped
                claimed[name].add(start)
            _pwrite_all(fds[name], data, start)
            with lock:
                done[name].add(start)
            return len(data)

        whole: set[str] = set()  # the files a server sent whole, for a ranged read: no more reads are issued for them

        def fetch(name: str, start: int, end: int) -> int:
            with lock:
                if start in claimed[name] or name in whole:  # written, or coming, from a whole file the server sent
                    return 0
            with reader.open(join(path, name), start, end, files[name]["size"]) as reply:
                if reply.whole:
                    return take_whole(name, reply)
                data = reply.read(end - start + 1)  # one byte more than asked tells a longer reply, unread
            if len(data) != end - start:
                got = f"more than {end - start}" if len(data) > end - start else len(data)
                raise BadReply(f"answered a read of bytes {start}-{end} of {name} with {got} bytes")
            return settle(name, start, data)

        def take_whole(name: str, reply: Reply) -> int:
            """Write from ``reply``, the whole file ``name``, the ranges nobody claimed, holding one range at a time."""
            with lock:
                if name in whole:
                    return 0  # another reply brings the whole file: this one is closed unread
                whole.add(name)
            size, new = files[name]["size"], 0
            for start in range(0, size, remote.RANGE_SIZE):
                with lock:
                    if len(claimed[name]) * remote.RANGE_SIZE >= size:  # every range is written, or being written
                        return new
                data = reply.read(min(remote.RANGE_SIZE, size - start))
                if len(data) < min(remote.RANGE_SIZE, size - start):
                    raise BadReply(
                        f"sent {name} whole for a ranged read, but it ends at byte {start + len(data)} of {size}"
                    )
                new += settle(name, start, data)
            if reply.read(1):
                raise BadReply(f"sent {name} whole for a ranged read, but it is longer than its {size} bytes")
            return new

        def advance() -> None:
            with lock:
                ready = {name: set(starts) for name, starts in done.items()}
            for name, digest in hashes.items():
                digest.advance(ready[name])

        recorded = [-1]

        def persist() -> None:
            """Record the ranges done, once their bytes are on disk."""
            with lock:
                snapshot = {name: sorted(starts) for name, starts in done.items()}
            count = sum(map(len, snapshot.values()))
            if count == recorded[0]:
                return
            for fd in fds.values():
                os.fdatasync(fd)
            state["done"] = snapshot
            write_json(work / PROGRESS_FILE, state)
            recorded[0] = count

        with (
            tqdm(
                total=total, initial=resumed, unit="B", unit_scale=True, desc=f"staging {shown}", disable=not progress
            ) as bar,
            ThreadPoolExecutor(read_threads(), thread_name_prefix="stage") as pool,
        ):
            pending: set[Future[int]] = {pool.submit(fetch, *task) for task in tasks}
            synced = time.perf_counter()
            try:
                advance()  # the ranges fetched before, while the first reads are under way
                while pending:
                    finished, pending = wait(pending, timeout=remote.SYNC_SECONDS or None, return_when=FIRST_COMPLETED)
                    for future in finished:
                        bar.update(future.result())
                    advance()
                    if not finished or time.perf_counter() - synced >= remote.SYNC_SECONDS:
                        persist()
                        synced = time.perf_counter()
            except BaseException as err:
                for future in pending:
                    future.cancel()
                with contextlib.suppress(OSError):  # a full disk may refuse progress.json too: the error says why
                    persist()
                if isinstance(err, BadReply):
                    raise RemoteStorageError(
                        f"the server of {shown!r} {err}: nothing of that reply was written. Check the server (a ranged"
                        " read must be answered with those bytes, or with the whole file), then run again: staging"
                        " resumes where it stopped."
                    ) from err
                if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _disk_full(err, work, shown) from err
                if isinstance(err, Exception):
                    raise remote_error(err, shown, "staging") from err
                raise
        advance()
        persist()
        return [name for name, digest in hashes.items() if digest.hexdigest() != files[name]["sha256"]]
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(folder)


def _check_free_space(work: Path, shown: str, needed: int) -> None:
    """Refuse to start when the disk of ``work`` has less free space than the ``needed`` bytes left to fetch."""
    free = shutil.disk_usage(work).free
    if needed > free:
        raise DestinationError(
            f"staging {shown} needs {human_bytes(needed)} more on the disk of {str(work.parent)!r}, but"
            f" {human_bytes(free)} is free there; nothing more was fetched. Free space there (`lightning-fastdata cache"
            " prune`), or pass a `cache_dir` (`--cache-dir`) on a larger disk."
        )


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``os.pwrite`` may write less)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if not written:
            raise OSError(errno.ENOSPC, f"nothing was written at byte {offset}")
        view, offset = view[written:], offset + written


def _on_disk(work: Path, files: dict[str, Any], done: dict[str, set[int]]) -> int:
    """The bytes of ``files`` that the working copy ``work`` already holds on its disk, which fetching does not need.

    Per file, its ranges ``done``, or the blocks it holds (capped at its size) where that is more: a file fetched
    again after its SHA-256 did not match holds all its blocks with no range done, and fetching it again overwrites
    them in place.
    """
    held = 0
    for name, want in files.items():
        resumed = sum(min(remote.RANGE_SIZE, want["size"] - start) for start in done[name])
        try:
            found = os.lstat(work / name)
        except OSError:
            found = None
        blocks = min(found.st_blocks * 512, want["size"]) if found is not None and stat.S_ISREG(found.st_mode) else 0
        held += max(resumed, blocks)
    return held


def _done_ranges(state: dict[str, Any], name: str, size: int) -> set[int]:
    """The starts of the ranges of ``name`` that ``state`` records as done, those that are ranges of this file."""
    starts = state["done"].get(name)
    if not isinstance(starts, list):
        return set()
    return {s for s in starts if type(s) is int and 0 <= s < size and s % remote.RANGE_SIZE == 0}


def _disk_full(err: OSError, work: Path, shown: str) -> DestinationError:
    """The error for a disk that filled up during staging (another program wrote to it meanwhile)."""
    return DestinationError(
        f"staging {shown} filled the disk of {str(work.parent)!r} ({err.strerror}): another program wrote to it"
        " meanwhile. Free space there and run again (staging resumes), or pass a `cache_dir` on a larger disk."
    )


class _FileHash:
    """The SHA-256 of a file being staged, advanced over its ranges in order as they are done, read back from it.

    What is hashed is what is on disk and gets published, ranges fetched by an interrupted staging included; a range
    read back right after it was written comes from the page cache, and hashing overlaps the reads still in flight.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size, self.offset = fd, size, 0
        self._sha256 = hashlib.sha256()

    def advance(self, done: set[int]) -> None:
        """Hash the ranges from :attr:`offset` on whose starts are in ``done``, up to the first that is not."""
        while self.offset < self.size and self.offset in done:
            end = min(self.offset + remote.RANGE_SIZE, self.size)
            while self.offset < end:
                chunk = os.pread(self.fd, min(2**22, end - self.offset), self.offset)
                if not chunk:
                    raise OSError(f"the working copy ends at byte {self.offset} of {self.size}")
                self._sha256.update(chunk)
                self.offset += len(chunk)

    def hexdigest(self) -> str | None:
        """The file's SHA-256, ``None`` while a range is not hashed."""
        return self._sha256.hexdigest() if self.offset >= self.size else None
