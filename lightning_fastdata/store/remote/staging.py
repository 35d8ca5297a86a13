"""Staging: a database published at a URL, copied once per node into the cache, checked, and reused after.

Under the lock of the staged copy (:func:`~lightning_fastdata.store.ondisk.target_lock`): read the marker
(:mod:`~lightning_fastdata.store.remote.marker`), fetch the files into the working copy ``.NAME.partial``
(:mod:`~lightning_fastdata.store.remote.fetch`), record the marker in ``staged.json``, move the copy into place and
open it (:func:`stage`). :func:`find_staged` finds a copy without a request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_fastdata._files import read_regular
from lightning_fastdata.errors import DatasetFormatError, DestinationError, RemoteStorageError
from lightning_fastdata.store import remote
from lightning_fastdata.store.environments import read_meta
from lightning_fastdata.store.format import (
    DATA_FILE,
    PROGRESS_FILE,
    STAGED_RECORD,
    parse_json,
    partial_path,
)
from lightning_fastdata.store.ondisk import (
    foreign_kind,
    fsync_dir,
    move_into_place,
    not_own,
    recover_interrupted_publish,
    target_lock,
    unwritable_error,
    write_json,
)
from lightning_fastdata.store.remote.errors import keeping_secrets
from lightning_fastdata.store.remote.fetch import fetch_files
from lightning_fastdata.store.remote.marker import MARKER, check_source, read_marker
from lightning_fastdata.store.remote.urls import filesystem, redact_url, staged_path

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

#: the most bytes read of a record this package writes in a staged or working copy (``staged.json``: the URL and the
#: marker; ``progress.json``: the marker, the range size and the start of every range fetched, at most 17 bytes each
#: below 100 TiB): a marker of :data:`~lightning_fastdata.store.remote.marker.MARKER_LIMIT` bytes written again (a few
#: MiB at most) and the ranges of 100 TiB of files fit. A larger record, or a link, is not read: the copy is staged
#: again, or its working copy started over
RECORD_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class StagedDatabase:
    """What :func:`stage` did: the local copy, and whether it was fetched, fetched again (and why) or reused."""

    path: Path
    action: Literal["staged", "restaged", "reused", "found"]
    reason: str | None = None


def stage(
    url: str, root: str | os.PathLike[str], progress: bool = True, argument: str = "data_dir", check: bool = True
) -> StagedDatabase:
    """Copy the database published at ``url`` into the cache folder ``root``, once; later calls reuse it.

    Holds the lock of the staged copy while it works, so the processes of one node (and jobs sharing the node) stage
    it once; the others wait, then reuse it. A node that holds the current publication makes one request (the
    marker); a changed publication is staged again, and the log says why. An interrupted staging resumes: the
    ranges fetched are kept in the working copy.

    What a bucket says is checked before it is used: the marker may name only the files a publication holds, every
    staged file has the SHA-256 the marker lists (a file that does not is fetched again once, then refused), and the
    copy is opened before it is returned; a copy staged earlier that no longer opens is thrown away and staged again,
    once, with a warning. Errors and logs show ``url`` without its user-info and an http(s) query (:func:`redact_url`),
    and an error is raised without the backend's error it came from when ``url`` holds either
    (:func:`keeping_secrets`). An http(s) query (a signature, a token) is sent with every file's request.

    Args:
        url: an fsspec URL of a database published by ``lightning-fastdata convert SRC URL``.
        root: the local cache folder (``FastImageDataModule``'s ``cache_dir``).
        progress: show a progress bar while fetching.
        argument: the argument named in errors.
        check: open the staged copy before returning it (``False``: check its files only).

    Returns:
        The :class:`StagedDatabase`: its local path, and what was done.

    Raises:
        RemoteStorageError: a missing backend, bucket, object or marker, missing credentials (or credentials in an
            object store's URL), a network failure, a marker naming a file a publication never holds, a file that does
            not match its marker twice, or a publication that matches its marker but does not open. Nothing is
            published in the cache then.
        DestinationError: ``root`` is read-only (:class:`~lightning_fastdata.errors.ReadOnlyDestinationError`), has
            no file locks, or holds another user's lock file, and holds no staged copy of this publication; its disk
            has less free space than is left to fetch; or it holds a symbolic link, or another user's file or staged
            copy, where staging writes or keeps its copy.
        DatasetFormatError: the copy in a read-only ``root`` does not open (it cannot be staged again there).

    """
    with keeping_secrets(url, "staging"):
        return _stage(url, root, progress, argument, check)


def _stage(url: str, root: str | os.PathLike[str], progress: bool, argument: str, check: bool) -> StagedDatabase:
    """:func:`stage`, whose errors may name the URL's secrets in their chain: :func:`keeping_secrets` clears it."""
    shown = redact_url(url)
    target = staged_path(url, Path(root))
    fs, path = filesystem(url, argument)
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
    with target_lock(target) as unlockable:
        for copy in (target, target.parent / f".{target.name}.old"):
            _check_own_copy(copy)
        if unlockable is None:  # without the lock, another process may be replacing the copy: nothing is moved
            recover_interrupted_publish(target)
        marker = read_marker(fs, path, shown)
        if _is_staged(target, marker):
            damage = _cannot_open(target) if check else None
            if damage is None:
                log.debug("%s: reusing %s, staged from the current publication", shown, target)
                return StagedDatabase(target, "reused")
            if unlockable is not None:  # a read-only cache: the copy cannot be replaced
                raise damage
            reason: str | None = f"the copy staged at {target} does not open ({damage}): staging it again"
            log.warning("%s: %s", shown, reason)
            shutil.rmtree(target)
        elif unlockable is not None:  # a read-only cache, or one without file locks: only a staged copy may be used
            raise unwritable_error(target, unlockable, outdated=target.exists()) from unlockable
        else:
            old = (_read_json(target / STAGED_RECORD) or {}).get("marker")
            reason = _why_restaged(old, marker, shown) if isinstance(old, dict) else None
            log.info(reason or f"staging {shown} into {target}")
        work = partial_path(target)
        _fetch_all(fs, path, shown, marker, work, progress)
        write_json(work / STAGED_RECORD, {"url": shown, "marker": marker})
        (work / PROGRESS_FILE).unlink(missing_ok=True)
        fsync_dir(work)
        move_into_place(work, target)
        damage = _cannot_open(target) if check else None
        if damage is not None:  # the bytes are the publication's (SHA-256): fetching them again cannot help
            shutil.rmtree(target, ignore_errors=True)
            raise RemoteStorageError(
                f"the database published at {shown} is damaged: its files have the SHA-256 its {MARKER} lists, but"
                f" they do not open as a database ({damage}). Publish it again from a sound copy with"
                f" `lightning-fastdata convert SRC {shown}`."
            ) from damage
        return StagedDatabase(target, "restaged" if reason else "staged", reason)


def find_staged(url: str, root: str | os.PathLike[str]) -> Path | None:
    """The staged copy of ``url`` under ``root``, waiting for a staging under way; no request (``None``: none yet)."""
    target = staged_path(url, Path(root))
    if not target.parent.is_dir():
        return None
    with target_lock(target):
        _check_own_copy(target)
        return target if _is_staged(target) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object this package recorded at ``path`` (``staged.json``, ``progress.json``), else ``None``.

    ``None`` too where ``path`` is missing, a symbolic link (never followed), not a regular file (a FIFO is never
    opened), over :data:`RECORD_LIMIT` bytes, or not a JSON object.
    """
    try:
        value = parse_json(read_regular(path, limit=RECORD_LIMIT, follow_links=False))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _is_staged(target: Path, marker: dict[str, Any] | None = None) -> bool:
    """Whether ``target`` is a complete staged copy (of the publication ``marker``, when given)."""
    record = _read_json(target / STAGED_RECORD)
    if record is None or (marker is not None and record.get("marker") != marker):
        return False
    files = record.get("marker", {}).get("files", {})
    try:
        return all((target / name).stat().st_size == info["size"] for name, info in files.items())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def _check_own_copy(path: Path) -> None:
    """Refuse the staged copy ``path`` (or ``.NAME.old``, moved aside) unless it is missing or a folder of this user's.

    Another user's copy in a shared cache could hold any bytes under a marker it copied; a link is never followed.

    Raises:
        DestinationError: ``path`` is a symbolic link (never followed), not a folder, or another user's; nothing was
            read, restored or removed through it.

    """
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    what = foreign_kind(found, directory=True)
    if what is not None:
        raise DestinationError(
            f"the staged copy {str(path)!r} is {what}: a copy this user did not stage could hold any bytes, so nothing"
            " was read, restored or removed through it. Remove it (its owner can), or pass a `cache_dir` of your own."
        )


def _why_restaged(old: dict[str, Any], new: dict[str, Any], shown: str) -> str:
    """Why a staged copy of ``old`` is replaced by the publication ``new``."""
    before, after = old.get("files", {}).get(DATA_FILE, {}), new["files"][DATA_FILE]
    sizes = f"{DATA_FILE} {before.get('size', '?')} -> {after['size']} bytes"
    return (
        f"{shown!r} was published again ({old.get('published', '?')} -> {new.get('published', '?')}, {sizes}):"
        " staging the new version"
    )


def _cannot_open(target: Path) -> DatasetFormatError | None:
    """Why the staged copy ``target`` does not open as a database (metadata read, pages walked once), else ``None``."""
    try:
        read_meta(target)
    except DatasetFormatError as err:
        return err
    return None


def _fetch_all(
    fs: AbstractFileSystem, path: str, shown: str, marker: dict[str, Any], work: Path, progress: bool
) -> None:
    """Fetch every file of the publication ``marker`` into ``work``, resumably; each then has the marker's SHA-256.

    A file whose copy does not match (ranges damaged on this disk since an interrupted staging, or bytes altered on
    the way) is fetched again, whole, once; a second mismatch discards the working copy.
    """
    for name, want in marker["files"].items():
        check_source(fs, path, shown, name, want)
    state = _working_copy(work, marker)
    bad = fetch_files(fs, path, shown, marker, work, state, progress)
    if bad:
        for name in bad:  # a new publication under way: its marker will say so; fetching again cannot help
            check_source(fs, path, shown, name, marker["files"][name])
        log.warning(
            "%s: the copy of %s does not match the SHA-256 its %s lists (ranges damaged on this disk since an"
            " interrupted staging, or bytes altered on the way); fetching it again",
            shown,
            " and ".join(bad),
            MARKER,
        )
        state["done"] = {name: starts for name, starts in state["done"].items() if name not in bad}
        write_json(work / PROGRESS_FILE, state)  # a run stopped before they are fetched again fetches them too
        bad = fetch_files(fs, path, shown, marker, work, state, progress)
    if bad:
        shutil.rmtree(work, ignore_errors=True)
        raise RemoteStorageError(
            f"the copy of {shown}/{bad[0]} does not match the SHA-256 its {MARKER} lists, fetched twice: the server"
            " altered it, or the object changed without a new marker; the copy is discarded. Check the server, or"
            f" publish the database again with `lightning-fastdata convert SRC {shown}`."
        )


def _working_copy(work: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """The progress recorded in the working copy ``work`` towards ``marker``; ``work`` made, or emptied to start over.

    Raises:
        DestinationError: ``work`` is a symbolic link, not a folder, or another user's.

    """
    try:
        found = os.lstat(work)
    except FileNotFoundError:
        work.mkdir()
        found = os.lstat(work)
    refused = not_own(work, found, directory=True)
    if refused is not None:
        raise refused
    state = _read_json(work / PROGRESS_FILE)
    if (
        state is None
        or state.get("marker") != marker
        or state.get("range_size") != remote.RANGE_SIZE
        or not isinstance(state.get("done"), dict)
    ):
        if state is not None:
            log.info("%s: discarding a partly staged copy of another publication", work)
        for entry in os.scandir(work):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        state = {"marker": marker, "range_size": remote.RANGE_SIZE, "done": {}}
        write_json(work / PROGRESS_FILE, state)  # from the start: `convert --clean` tells it from a conversion's
    return state
