"""The completion marker ``published.json``: read and checked before staging writes anything, and written last.

The marker lists each published file's size, ETag (where the store gives one) and SHA-256, and an id that changes with
every publication; a folder without it (an upload under way or interrupted) is refused. A marker naming any file but
the published ones, or a size or SHA-256 that is not one, is refused before anything is fetched.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from lightning_fastdata.errors import RemoteStorageError
from lightning_fastdata.store.format import DATA_FILE, REPORT_FILE, parse_json
from lightning_fastdata.store.remote.errors import remote_errors
from lightning_fastdata.store.remote.replies import HttpReply, reads_http
from lightning_fastdata.store.remote.urls import CREDENTIALS, join, scheme_of

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

#: the completion marker, uploaded last: a folder without it is not (yet) a database
MARKER = "published.json"


#: the files of a database that are published (``lock.mdb`` and ``verified.json`` belong to one machine)
PUBLISHED_FILES = (DATA_FILE, REPORT_FILE)


#: the most bytes a marker may hold (it lists two files in a few hundred): a larger one is refused, unread
MARKER_LIMIT = 2**20


#: the largest file a marker may list (1 EiB): beyond it a size is not a database's, and beyond what ``ftruncate`` takes
_MAX_SIZE = 2**60


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def read_marker(fs: AbstractFileSystem, path: str, shown: str) -> dict[str, Any]:
    """The marker of the database at ``shown``: one request, and checked (:func:`_check_marker`) before any write.

    One ranged GET of :data:`MARKER_LIMIT` bytes and one more (a whole-object read makes s3fs ask for the size first, a
    second request); over HTTP no more is read whatever the server sends. A larger marker is refused.
    """
    with remote_errors(shown, "reading"):
        try:
            if reads_http(fs):
                with HttpReply(fs, join(path, MARKER), 0, MARKER_LIMIT + 1) as reply:
                    raw: bytes | None = bytes(reply.read(MARKER_LIMIT + 1))
            else:
                raw = fs.cat_file(join(path, MARKER), start=0, end=MARKER_LIMIT + 1)
        except FileNotFoundError:
            raw = None
    if raw is None:
        raise _missing_marker(fs, path, shown)
    if len(raw) > MARKER_LIMIT:
        raise _not_a_marker(shown, f"larger than {MARKER_LIMIT} bytes, where a marker lists two files in a few hundred")
    try:
        marker = parse_json(raw)
    except ValueError as err:  # not JSON, not UTF-8, or nested too deeply to parse
        raise _not_a_marker(shown, str(err).splitlines()[0]) from None
    _check_marker(marker, shown)
    return marker  # type: ignore[no-any-return]


def _check_marker(marker: Any, shown: str) -> None:
    r"""Refuse a marker that names a file the publisher never writes, or a size or SHA-256 that is not one.

    The names are compared as exact strings with :data:`PUBLISHED_FILES`, the only files staging then creates in the
    working copy: so a marker cannot name a path outside the cache (``/x``, ``../x``), one of staging's own files
    (``progress.json``, ``staged.json``), a folder or a look-alike (``d\u0430ta.mdb``).

    Raises:
        RemoteStorageError: one line naming the bad name (ASCII-escaped, cut short) or field.

    """
    files = marker.get("files") if isinstance(marker, dict) else None
    for name in files if isinstance(files, dict) else ():
        if name not in PUBLISHED_FILES:
            raise RemoteStorageError(
                f"{shown}/{MARKER} lists a file named {_clip(name)}, but a publication holds only"
                f" {' and '.join(PUBLISHED_FILES)}; nothing was fetched or written. The marker was not written by"
                f" lightning_fastdata, or it was altered: publish the database again with"
                f" `lightning-fastdata convert SRC {shown}`."
            )
    why = _marker_problem(files)
    if why is not None:
        raise _not_a_marker(shown, why)


def _not_a_marker(shown: str, why: str) -> RemoteStorageError:
    """The error for a marker that lightning_fastdata did not write, or that is damaged (``why``)."""
    return RemoteStorageError(
        f"{shown}/{MARKER} is not a marker written by lightning_fastdata, or it is damaged ({why}); nothing was"
        f" fetched. Publish the database again with `lightning-fastdata convert SRC {shown}`."
    )


def _marker_problem(files: Any) -> str | None:
    """What is wrong with a marker's ``files`` whose names are all published ones (``None``: nothing)."""
    if not isinstance(files, dict) or DATA_FILE not in files:
        return f"no {DATA_FILE} listed"
    for name, info in files.items():
        size = info.get("size") if isinstance(info, dict) else None
        if type(size) is not int or not 0 <= size <= _MAX_SIZE:
            return f"{name}: the size {_clip(size)} is not a number of bytes from 0 to 2**60"
        if not isinstance(info.get("sha256"), str) or not _SHA256_HEX.fullmatch(info["sha256"]):
            return f"{name}: no SHA-256 of 64 hexadecimal digits"
        if not isinstance(info.get("etag", ""), str):
            return f"{name}: an ETag that is not a string"
    return None


def _clip(value: object) -> str:
    """``value``, read from a marker, for one line: ASCII escapes show NUL, line breaks and look-alike letters."""
    text = ascii(value)
    if len(text) <= 80:
        return text
    return f"{text[:60]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def _missing_marker(fs: AbstractFileSystem, path: str, shown: str) -> RemoteStorageError:
    """Why ``shown`` (the URL, redacted) has no marker: an unfinished upload, a missing bucket, or nothing there."""
    with remote_errors(shown, "reading"):
        if fs.exists(join(path, DATA_FILE)):
            return RemoteStorageError(
                f"{shown!r} holds {DATA_FILE} but no {MARKER}, the marker uploaded last: an upload is under way or was"
                f" interrupted, so it is not read. Publish it again with `lightning-fastdata convert SRC {shown}`."
            )
        bucket = path.split("/", 1)[0]
        if scheme_of(shown) in CREDENTIALS and bucket != path and not fs.exists(bucket):
            return RemoteStorageError(
                f"the bucket {bucket!r} of {shown!r} does not exist (or these credentials cannot see it). Check the"
                f" URL, or the credentials ({CREDENTIALS[scheme_of(shown)]})."
            )
    return RemoteStorageError(
        f"no database at {shown!r} (no {MARKER} there). Check the URL, or publish one with"
        f" `lightning-fastdata convert SRC {shown}`."
    )


def etag_of(info: dict[str, Any]) -> str | None:
    """The ETag in an fsspec ``info`` (s3fs: ``ETag``; gcsfs: ``etag``; adlfs: ``etag``), unquoted."""
    value = info.get("ETag") or info.get("etag") or info.get("e_tag")
    return str(value).strip('"') if value else None


def check_source(fs: AbstractFileSystem, path: str, shown: str, name: str, want: dict[str, Any]) -> None:
    """Check that the object ``name`` is the one the marker lists: its size, and its ETag where both have one."""
    with remote_errors(shown, "reading"):
        fs.invalidate_cache(join(path, name))
        info = fs.info(join(path, name))
    etag = etag_of(info)
    if info.get("size") != want["size"] or (etag and want.get("etag") and etag != want["etag"]):
        raise RemoteStorageError(
            f"{shown}/{name} is not the file its {MARKER} lists ({info.get('size')} bytes, ETag {etag}; the marker"
            f" says {want['size']} bytes, ETag {want.get('etag')}): it is being published again, or was replaced by"
            f" hand. Wait for the upload and run again, or publish it again with `lightning-fastdata convert SRC"
            f" {shown}`."
        )


def write_marker(fs: AbstractFileSystem, path: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Upload the marker of the published ``files`` to ``path``, last: from then on the publication is read; return it.

    ``files``: each file's size, SHA-256 and ETag (where the store gives one). The id is new with every publication.
    """
    marker = {
        "format_version": 1,
        "id": uuid.uuid4().hex,
        "published": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    fs.pipe_file(join(path, MARKER), json.dumps(marker, sort_keys=True).encode())
    return marker
