"""Publishing: a local database uploaded to a URL, its marker written last, after the destination is checked.

:func:`check_destination` refuses a prefix holding objects that are not a publication's; :func:`publish` uploads the
files (a snapshot of hard links, so what is hashed is what is uploaded) and then the marker, or nothing when the URL
already holds the same files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_fastdata.errors import DestinationError, RemoteStorageError
from lightning_fastdata.store.format import REPORT_FILE
from lightning_fastdata.store.remote.errors import keeping_secrets, remote_errors
from lightning_fastdata.store.remote.marker import MARKER, PUBLISHED_FILES, etag_of, read_marker, write_marker
from lightning_fastdata.store.remote.urls import CREDENTIALS, filesystem, join, redact_url, scheme_of

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)


def check_destination(url: str) -> set[str]:
    """Check that a database may be published at ``url`` (one listing); returns the names of the objects there.

    Raises:
        DestinationError: ``url`` holds objects that are not a published database's, or its bucket does not exist.
        RemoteStorageError: a missing backend, missing credentials, or a network failure.

    """
    with keeping_secrets(url, "publishing to"):
        return _check_destination(url)


def _check_destination(url: str) -> set[str]:
    """:func:`check_destination`, whose errors may name the URL's secrets in their chain."""
    fs, path = filesystem(url, "dst")
    url = redact_url(url)  # from here on only shown
    with remote_errors(url, "publishing to"):
        fs.invalidate_cache(path)
        try:
            held = {Path(p).name for p in fs.ls(path, detail=False)}
        except FileNotFoundError:
            held = set()
        bucket = path.split("/", 1)[0]
        if not held and scheme_of(url) in CREDENTIALS and bucket != path and not fs.exists(bucket):
            raise DestinationError(
                f"`dst` {url!r}: the bucket {bucket!r} does not exist (or these credentials cannot see it); nothing"
                " was converted. Create the bucket, or check the URL."
            )
    foreign = sorted(held - {*PUBLISHED_FILES, MARKER})
    if foreign:
        raise DestinationError(
            f"`dst` {url!r} holds objects that are not a published database's ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); nothing was uploaded. Choose an empty prefix."
        )
    return held


def publish(database: str | os.PathLike[str], url: str, progress: bool = True) -> dict[str, Any]:
    """Upload the local database ``database`` to ``url``, readable only once complete; returns the marker.

    Any previous marker at ``url`` is removed first (the old publication stops being readable), then the data files
    are uploaded (s3fs splits large files into a multipart upload), then the new marker, last. An interrupted
    upload leaves files without a marker, which staging refuses; publishing again replaces them. When ``url`` already
    holds a publication of the same files (its marker lists their sizes and SHA-256, and the objects still have the
    sizes and ETags it recorded), nothing is uploaded and its marker is returned.

    Raises:
        DestinationError: ``url`` holds objects that are not a published database's.
        RemoteStorageError: a missing backend or bucket, missing credentials (or credentials in an object store's URL),
            or a network failure.

    """
    return publish_database(database, url, progress)[0]


def _holds(
    fs: AbstractFileSystem,
    path: str,
    held: set[str],
    listed: dict[str, Any],
    sizes: dict[str, int],
    sha256: dict[str, str],
) -> bool:
    """Whether ``path`` holds these files, as the marker listing them says and each object there confirms.

    The marker lists their sizes and SHA-256; each object must still be there with the size and ETag the marker
    recorded (one request per file). Without an ETag to compare, ``False``: the marker alone cannot vouch for the bytes.
    """
    if set(listed) != set(sizes) or not set(sizes) <= held:
        return False
    for name, size in sizes.items():
        want = listed[name]
        if want.get("size") != size or want.get("sha256") != sha256[name] or not want.get("etag"):
            return False
        info = fs.info(join(path, name))
        if info.get("size") != size or etag_of(info) != want["etag"]:
            return False
    return True


def publish_database(
    database: str | os.PathLike[str], url: str, progress: bool = True, destination: str | None = None
) -> tuple[dict[str, Any], bool]:
    """:func:`publish`, and whether it uploaded anything.

    ``destination``: what the uploaded conversion report names as the database's ``destination`` (the URL without
    user-info and query, where the local report names the local folder); the local files stay as they are.
    """
    with keeping_secrets(url, "publishing to"):
        return _publish_database(database, url, progress, destination)


def _publish_database(
    database: str | os.PathLike[str], url: str, progress: bool, destination: str | None
) -> tuple[dict[str, Any], bool]:
    """:func:`publish_database`, whose errors may name the URL's secrets in their chain."""
    fs, path = filesystem(url, "dst")
    held = _check_destination(url)
    destination = None if destination is None else redact_url(destination)
    try:
        snapshot: Any = tempfile.TemporaryDirectory(prefix=".publish-", dir=Path(database).parent)
    except OSError:  # a read-only folder: the files as they are
        snapshot = contextlib.nullcontext(None)
    with snapshot as tmp:
        local = Path(database) if tmp is None else _snapshot(Path(database), Path(tmp))
        return _publish_files(fs, path, redact_url(url), held, local, progress, destination)


def _snapshot(database: Path, folder: Path) -> Path:
    """Hard links to the published files of ``database`` in ``folder``, or ``database`` where links cannot be made.

    What is hashed is then what is uploaded, even if the database is converted again or removed meanwhile.
    """
    for name in PUBLISHED_FILES:
        if (database / name).is_file():
            try:
                os.link(database / name, folder / name)
            except OSError:
                return database
    return folder


def _publish_files(
    fs: AbstractFileSystem,
    path: str,
    shown: str,
    held: set[str],
    local: Path,
    progress: bool,
    destination: str | None,
) -> tuple[dict[str, Any], bool]:
    from fsspec.callbacks import TqdmCallback

    contents = {}  # the files that are uploaded from memory: a report naming its destination
    report = local / REPORT_FILE
    if destination is not None and report.is_file():
        named = {**json.loads(report.read_text()), "destination": destination}
        contents[REPORT_FILE] = json.dumps(named, indent=1).encode()
    names = [name for name in PUBLISHED_FILES if name in contents or (local / name).is_file()]
    sha256 = {
        name: hashlib.sha256(contents[name]).hexdigest() if name in contents else _sha256(local / name)
        for name in names
    }
    sizes = {name: len(contents[name]) if name in contents else (local / name).stat().st_size for name in names}
    with remote_errors(shown, "publishing to"):
        if MARKER in held:
            try:
                old = read_marker(fs, path, shown)
            except RemoteStorageError:  # a damaged marker: replaced below
                old = {"files": {}}
            if _holds(fs, path, held, old["files"], sizes, sha256):
                log.info("%s already holds this database (the same files, published %s): nothing uploaded", shown,
                         old.get("published"))  # fmt: skip
                return old, False
            fs.rm_file(join(path, MARKER))  # from here on the old publication is not readable
        fs.makedirs(path, exist_ok=True)  # a folder for file:// (object stores have none to make)
        published: dict[str, dict[str, Any]] = {}
        for name in names:
            kwargs = {"desc": f"uploading {name}", "unit": "B", "unit_scale": True, "disable": not progress}
            if name in contents:
                fs.pipe_file(join(path, name), contents[name])
            else:
                fs.put_file(str(local / name), join(path, name), callback=TqdmCallback(tqdm_kwargs=kwargs))
            fs.invalidate_cache(join(path, name))
            etag = etag_of(fs.info(join(path, name)))
            published[name] = {"size": sizes[name], "sha256": sha256[name], **({"etag": etag} if etag else {})}
        marker = write_marker(fs, path, published)
    return marker, True


def _sha256(path: Path, callback: Callable[[int], Any] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(2**22):
            digest.update(chunk)
            if callback is not None:
                callback(len(chunk))
    return digest.hexdigest()
