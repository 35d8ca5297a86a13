"""Databases in object storage: publish one to a bucket, and stage it once per node into the local cache.

An LMDB database is a memory map, fast only on a local disk; so a database at a URL (any fsspec URL: ``s3://``,
``gs://``, ``az://``, ``https://``, ``file://``) is copied once to each node's cache and read there.

A published database is a folder (a key prefix) holding the database's files (``data.mdb``,
``convert_report.json``) and, written last, the completion marker ``published.json``: each file's size, ETag (where
the store gives one) and SHA-256, and an id that changes with every publication. A folder without the marker (an
upload under way or interrupted) is refused, so nothing half-uploaded is ever read.

Staging (:func:`stage`), under the cache's lock of the staged copy
(:func:`~lightning_fastdata.store.ondisk.target_lock`, which works across jobs on one node): read the marker (the only
request when the node already holds this publication) and refuse one that names any file but the published ones, fetch
every file in parallel ranged reads into the hidden working copy ``.NAME.partial`` (the ranges done, synced to disk, are
kept in ``progress.json`` there, so an interrupted staging resumes), hash each file as its ranges complete and compare
it with the marker's SHA-256, rename the working copy into place, and open it. The staged copy keeps the marker it was
staged from in ``staged.json``. A bucket's data is never trusted: nothing is written outside the working copy, nor
through a link planted in it, each range is written once (what is hashed is what is published), a server cannot make
staging hold more than a range per read (over HTTP), and a URL's user-info (and an http(s) query) is shown nowhere
(:func:`redact_url`).

Credentials and endpoints come from fsspec and its backend alone (``AWS_*`` variables, profiles and instance roles
for s3fs, ``FSSPEC_<PROTOCOL>_<OPTION>`` variables such as ``FSSPEC_S3_ENDPOINT_URL``); this module holds none. An
object store's URL holding credentials (``s3://KEY:SECRET@bucket/...``) is refused before any request; an http(s)
URL may hold them (``https://user:password@host/...``, a signed query), and then every error raised here is raised
without the backend's error it came from (whose text holds the full URL), and fsspec's HTTP log records are redacted
while staging or publishing runs (:func:`_keeping_secrets`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_fastdata._files import read_regular
from lightning_fastdata.cpus import usable_cpu_count
from lightning_fastdata.errors import (
    DatasetFormatError,
    DestinationError,
    FastDataError,
    InvalidArgumentError,
    RemoteStorageError,
)
from lightning_fastdata.store.format import (
    DATA_FILE,
    PROGRESS_FILE,
    REPORT_FILE,
    STAGED_RECORD,
    parse_json,
    partial_path,
    read_meta,
)
from lightning_fastdata.store.ondisk import (
    foreign_kind,
    fsync_dir,
    move_into_place,
    not_own,
    open_own,
    recover_interrupted_publish,
    target_lock,
    unwritable_error,
    write_json,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

#: the completion marker, uploaded last: a folder without it is not (yet) a database
MARKER = "published.json"
#: the files of a database that are published (``lock.mdb`` and ``verified.json`` belong to one machine)
PUBLISHED_FILES = (DATA_FILE, REPORT_FILE)
#: bytes per ranged read. From rclone's S3 server on 2 cores (benchmarks/bench_staging.py, 200 MiB, 4 reads in
#: flight): 32 MiB ranges staged 719 MiB/s, 16 MiB 715, 64 MiB 489, 8 MiB (8 in flight) 521. Moto's server reads
#: the whole object for every ranged GET, so there fewer, larger ranges win; a real store serves each independently.
#: A resumed staging refetches at most one range per reader; the ranges in flight are held in memory.
RANGE_SIZE = 32 * 2**20
#: ranged reads in flight: twice the usable CPUs, 4 to 10 (``None``: decided when staging). On 2 cores 4 beat 8
#: (715 against 455 MiB/s, 16 MiB ranges); object stores serve each connection at a fraction of a node's bandwidth,
#: so a node with more cores keeps more reads in flight
READ_THREADS: int | None = None
#: seconds between two records of the ranges done: each syncs the files to disk first (``fdatasync``), then
#: ``progress.json``; a staging killed meanwhile fetches those seconds' ranges again (0: a record after each range)
SYNC_SECONDS = 1.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: the most bytes a marker may hold (it lists two files in a few hundred): a larger one is refused, unread
MARKER_LIMIT = 2**20
#: the most bytes read of a record this package writes in a staged or working copy (``staged.json``: the URL and the
#: marker; ``progress.json``: the marker, the range size and the start of every range fetched, at most 17 bytes each
#: below 100 TiB): a marker of :data:`MARKER_LIMIT` bytes written again (a few MiB at most) and the ranges of 100 TiB
#: of files fit. A larger record, or a link, is not read: the copy is staged again, or its working copy started over
RECORD_LIMIT = 64 * 2**20

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: the schemes whose query and fragment are not part of the path: HTTP's, where a query holds a signature or a token.
#: fsspec keeps ``?`` and ``#`` in the path for every other scheme (``file:///data/run#1``, ``s3://bucket/exp?a``)
_QUERY_SCHEMES = ("http", "https")
#: a URL in a line of text: its scheme, user-info (everything from ``//`` to the last ``@`` before the first ``/``),
#: its path, and a query or fragment, up to the next blank
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?:[^/\s]*@)?(?P<path>[^?#\s]*)(?P<query>[?#]\S*)?")
#: what ends a query in a line of text but belongs to the text: closing quotes and brackets, punctuation
_QUERY_END = re.compile(r"[\'\")\]>},.;:]*$")
#: the largest file a marker may list (1 EiB): beyond it a size is not a database's, and beyond what ``ftruncate`` takes
_MAX_SIZE = 2**60
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
#: the package fsspec needs for each scheme, for the error when it is missing
_BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
}
_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials or an instance role"
    " (and AWS_ENDPOINT_URL for a store other than AWS)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`",
    "az": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_CONNECTION_STRING",
}
_CREDENTIALS.update({"s3a": _CREDENTIALS["s3"], "gcs": _CREDENTIALS["gs"]})
_CREDENTIALS.update({"abfs": _CREDENTIALS["az"], "abfss": _CREDENTIALS["az"]})
#: the schemes whose URL may name a container before an ``@``: adlfs reads ``abfs://container@account.dfs.core.
#: windows.net/path``, so there only user-info holding a ``:`` (a key) is refused
_CONTAINER_SCHEMES = ("az", "abfs", "abfss")
#: a secret of a URL shorter than this is not looked for in free text (an error, a log record), where it would be found
#: by chance (``?a=1`` in "line 1"); it is still cut from every URL shown (:func:`redact_url`)
_SECRET_MIN = 4


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL (``scheme://...``, ``file://`` included) rather than a local path."""
    return path is not None and _SCHEME.match(os.fspath(path)) is not None


def redact_url(url: str) -> str:
    """``url`` as it may be shown, logged, recorded or used as a name: without user-info, and over HTTP without query.

    ``https://user:pa'ss@[::1]:8443/db.lmdb?signature=...#x`` becomes ``https://[::1]:8443/db.lmdb``. The user-info is
    all of the authority (what follows ``//``, up to the first ``/``) to its last ``@``. A query and a fragment are cut
    only from ``http(s)://`` URLs: fsspec reads ``?`` and ``#`` as part of the path for every other scheme
    (``file:///data/run#1/db.lmdb`` is a folder ``run#1``), so they stay. A plain URL, and a local path, are returned as
    they are. The full URL is still the one used to read; :func:`redact_text` does the same to a line of text.
    """
    found = _SCHEME.match(url)
    if found is None:
        return url
    rest = url[found.end() :]
    if found[1].lower() in _QUERY_SCHEMES:
        rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    authority, slash, path = rest.partition("/")
    return f"{url[: found.end()]}{authority.rpartition('@')[2]}{slash}{path}"


def redact_text(text: str) -> str:
    """``text`` (an error from a backend) with every URL in it redacted as :func:`redact_url` does.

    A URL in text ends at the next blank; the closing quotes, brackets and punctuation after a query cut from it stay.
    """

    def redact(found: re.Match[str]) -> str:
        query = found["query"] or ""
        if found["scheme"].lower() in _QUERY_SCHEMES:
            query = _QUERY_END.search(query)[0]  # type: ignore[index]
        return f"{found['scheme']}://{found['path']}{query}"

    return _URL.sub(redact, text)


def _split_query(path: str) -> tuple[str, str]:
    """An fsspec path (an http(s) URL keeps its scheme) and its query: ``("https://h/db.lmdb", "?token=x")``.

    Only an http(s) URL has one; a fragment is dropped (it is never sent). Any other path is returned whole, with
    ``""``: fsspec reads ``?`` and ``#`` as part of it.
    """
    cut = re.search(r"[?#]", path) if _scheme(path) in _QUERY_SCHEMES else None
    if cut is None:
        return path, ""
    return path[: cut.start()], f"?{path[cut.end() :].partition('#')[0]}" if cut[0] == "?" else ""


def _join(path: str, name: str) -> str:
    """The path of the file ``name`` in the folder ``path``: before its query, over HTTP (``.../db.lmdb/x?token=t``)."""
    base, query = _split_query(path)
    return f"{base.rstrip('/')}/{name}{query}"


def _secrets(url: str) -> list[str]:
    """What ``url`` holds that is never shown, longest first.

    Its user-info (whole, the user, the password) and, over HTTP, its query and fragment (whole, each ``key=value`` and
    each value); each as written and percent-decoded.
    """
    found = _SCHEME.match(url)
    if found is None:
        return []
    rest, parts = url[found.end() :], []
    if found[1].lower() in _QUERY_SCHEMES and (cut := re.search(r"[?#]", rest)) is not None:
        rest, tail = rest[: cut.start()], rest[cut.end() :]
        parts.append(tail)
        for piece in re.split(r"[&;#?]", tail):
            parts += [piece, piece.partition("=")[2]]
    info, at, _ = rest.partition("/")[0].rpartition("@")
    if at:
        parts += [info, *info.split(":", 1)]
    found_parts = {text for part in parts for text in (part, urllib.parse.unquote_plus(part)) if text}
    return sorted(found_parts, key=len, reverse=True)


def _scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every one of ``secrets`` of :data:`_SECRET_MIN` characters or more replaced by ``***``."""
    for secret in secrets:
        if len(secret) >= _SECRET_MIN:
            text = text.replace(secret, "***")
    return text


def _mentions(err: BaseException, secrets: list[str]) -> bool:
    """Whether ``err``, its chain or its traceback shows one of ``secrets``, or any URL's user-info or http(s) query."""
    text = "".join(traceback.format_exception(err))
    return redact_text(text) != text or any(s in text for s in secrets if len(s) >= _SECRET_MIN)


class _RedactRecords(logging.Filter):
    """Redacts the records of fsspec's HTTP file system, which logs every URL it requests at DEBUG level.

    Installed on its logger only while a call of this module with a secret in its URL runs (:func:`_keeping_secrets`):
    a record's text (its message, its traceback) loses every URL's user-info and http(s) query, and every secret of the
    URLs of the calls running (a server's reason phrase, in a traceback, can echo a token). It only ever rewrites a
    record's text: no record is dropped, and a record of another user of fsspec that comes meanwhile loses nothing but
    secrets.
    """

    #: the loggers that log a requested URL: fsspec's HTTP file system (``logger.debug(url)``, and the traceback of a
    #: refused HEAD). Object stores' URLs hold no secret here (user-info is refused), so s3fs's and botocore's
    #: records need nothing
    LOGGERS = ("fsspec.http",)

    def __init__(self) -> None:
        super().__init__()
        self._secrets: list[list[str]] = []  # of each call running
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record`` without user-info, http(s) query or a secret in its text; keep it."""
        secrets = [secret for found in list(self._secrets) for secret in found]
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its message: logging reports it, as it would
            return True
        clean = _scrub(redact_text(message), secrets)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = _scrub(redact_text(text), secrets), None  # a handler shows the text
        return True

    @contextlib.contextmanager
    def keeping(self, secrets: list[str]) -> Iterator[None]:
        """Redact the records of :data:`LOGGERS` (``secrets`` among others) while the block runs."""
        with self._lock:
            if not self._secrets:
                for name in self.LOGGERS:
                    logging.getLogger(name).addFilter(self)
            self._secrets.append(secrets)
        try:
            yield
        finally:
            with self._lock:
                self._secrets.remove(secrets)
                if not self._secrets:
                    for name in self.LOGGERS:
                        logging.getLogger(name).removeFilter(self)


_REDACT_RECORDS = _RedactRecords()


@contextlib.contextmanager
def _keeping_secrets(url: str, doing: str) -> Iterator[None]:
    """Keep the secrets of ``url`` out of what a call of this module raises and what fsspec's HTTP file system logs.

    An error of this package is raised without the exception it came from (``__cause__`` and ``__context__`` cleared):
    a backend's error names the full URL (aiohttp's ``ClientResponseError``: ``url='...?X-Amz-Signature=...'``), and
    every traceback, ``trainer.fit``'s included, prints the chain. Its message, already redacted, is scrubbed again
    (a server's reason phrase could echo a token). Any other error showing a secret becomes the one-line
    :class:`RemoteStorageError` of what was being done (``doing``). A URL without secrets changes nothing.
    """
    secrets = _secrets(url)
    if not secrets:
        yield
        return
    with _REDACT_RECORDS.keeping(secrets):
        try:
            try:
                yield
            except FastDataError:
                raise
            except Exception as err:
                if not _mentions(err, secrets):
                    raise
                raise _remote_error(err, url, doing) from None
        except FastDataError as err:
            err.__cause__ = err.__context__ = None  # `raise` below re-raises it as it is: no new context
            err.__suppress_context__ = True
            err.args = tuple(_scrub(arg, secrets) if isinstance(arg, str) else arg for arg in err.args)
            raise


def _refuse_credentials(url: str, argument: str) -> None:
    """Refuse an object store's URL holding credentials (``s3://KEY:SECRET@bucket/...``), before any request.

    s3fs, gcsfs and adlfs read no credentials from a URL (s3fs takes ``KEY:SECRET@bucket`` for a bucket name, and
    botocore's error then prints it); a secret in a URL ends up in shell histories, job scripts, process lists and
    logs. An Azure URL's container before the ``@`` (``abfs://container@account.dfs.core.windows.net/...``) is kept.

    Raises:
        RemoteStorageError: the URL holds user-info; the message shows it as ``***`` and says where credentials go.

    """
    scheme, found = _scheme(url), _SCHEME.match(url)
    if scheme not in _CREDENTIALS or found is None:
        return
    info, at, _ = url[found.end() :].partition("/")[0].rpartition("@")
    if not at or (scheme in _CONTAINER_SCHEMES and ":" not in info):
        return
    shown = f"{url[: found.end()]}***@{redact_url(url)[found.end() :]}"
    container = (
        " (a container may come before the '@' without a ':': az://container@account.dfs.core.windows.net/path)"
        if scheme in _CONTAINER_SCHEMES
        else ""
    )
    raise RemoteStorageError(
        f"`{argument}` {shown!r} holds credentials before its '@', which {scheme}:// URLs do not take{container};"
        f" nothing was read. Remove them from the URL and set {_CREDENTIALS[scheme]} instead (or fsspec's"
        f" FSSPEC_{scheme.upper()}_<OPTION> variables): a secret in a URL ends up in shell histories, job scripts,"
        " process lists and logs."
    )


def check_local(path: str | os.PathLike[str] | None, argument: str, why: str) -> None:
    """Refuse a URL where a local path is needed.

    Raises:
        InvalidArgumentError: ``path`` is a URL; the message names ``argument`` and says why (``why``).

    """
    if is_url(path):
        shown = redact_url(os.fspath(path))  # type: ignore[arg-type]
        raise InvalidArgumentError(f"`{argument}` {shown!r} is a URL, but {why}.")


def _scheme(url: str) -> str:
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def filesystem(url: str, argument: str = "data_dir") -> tuple[AbstractFileSystem, str]:
    """The fsspec file system of ``url`` and the path in it (no trailing slash); makes no request.

    Over HTTP the path is the URL, with its query: a file's path in it is :func:`_join`'s, the name before the query.

    Raises:
        RemoteStorageError: fsspec, or the backend of the URL's scheme, is not installed, or the scheme is unknown; or
            an object store's URL holds credentials (:func:`_refuse_credentials`).

    """
    _refuse_credentials(url, argument)
    scheme, shown = _scheme(url), redact_url(url)
    backend = _BACKENDS.get(scheme)
    install = "pip install 'lightning-fastdata[remote]'" + (f" {backend}" if backend not in (None, "s3fs") else "")
    try:
        import fsspec
    except ImportError:
        raise RemoteStorageError(f"`{argument}` {shown!r} is a URL, which needs fsspec: run `{install}`.") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as err:
        raise RemoteStorageError(
            f"`{argument}` {shown!r} needs fsspec's {scheme}:// backend ({backend or err}): run `{install}`."
        ) from None
    except ValueError as err:
        raise RemoteStorageError(
            f"`{argument}` {shown!r}: fsspec cannot open {scheme}:// URLs ({redact_text(str(err))}). Pass an s3://,"
            " gs://, az://, https:// or file:// URL, or a local path."
        ) from None
    base, query = _split_query(path)  # over HTTP the path is the URL: its query (a token) goes after each file name
    return fs, base.rstrip("/") + query


def staged_path(url: str, root: Path) -> Path:
    """Where ``url`` is staged under the cache folder ``root``: ``<name>-<digest of the URL>.lmdb``.

    Of the URL without user-info, and over HTTP without query (:func:`redact_url`): no secret becomes part of a name,
    and a URL signed again (a new query) is still the same copy; two paths that differ only after a ``?`` or ``#``
    (``file:///data/run#1/db.lmdb``, ``.../run#2/db.lmdb``) are two copies. A plain URL's name is the one it always had.
    """
    clean = redact_url(url).rstrip("/")
    name = clean.rsplit("/", 1)[-1].removesuffix(".lmdb") or "database"
    digest = hashlib.sha256(json.dumps(["remote", clean]).encode()).hexdigest()[:10]
    return root / f"{name}-{digest}.lmdb"


# ---------------------------------------------------------------------------------------------------------------
# Errors: one line naming the URL and what to set
# ---------------------------------------------------------------------------------------------------------------


def _remote_error(err: BaseException, url: str, doing: str) -> RemoteStorageError:
    """The one-line error for ``err``, raised by fsspec while ``doing`` (``"reading"``...) ``url``.

    The URL, and any URL in the backend's message, is shown without user-info and an http(s) query (:func:`redact_url`,
    :func:`redact_text`).
    """
    scheme, url = _scheme(url), redact_url(url)
    if isinstance(err, FileNotFoundError) and getattr(err.__cause__, "status", None) in (401, 403):
        err = err.__cause__  # fsspec's HTTP file system reports a size it was refused (a HEAD's 403) as not found
    names = {cls.__name__ for cls in type(err).__mro__}
    detail = redact_text(str(err).strip().splitlines()[0]) if str(err).strip() else type(err).__name__
    where = _CREDENTIALS.get(scheme, "the credentials your fsspec backend reads")
    if scheme in _QUERY_SCHEMES:  # what a server of signed URLs refuses: an expired or wrong signature, or password
        where = "the user-info or the signed query of the URL, which may have expired"
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}:
        return RemoteStorageError(f"no credentials found for {url!r} while {doing} it ({detail}). Set {where}.")
    refused = getattr(err, "status", None) in (401, 403)  # aiohttp's ClientResponseError
    if refused or isinstance(err, PermissionError) or "AccessDenied" in detail or "Forbidden" in detail:
        return RemoteStorageError(
            f"access to {url!r} was denied while {doing} it ({detail}). Check the credentials ({where}) and that they"
            " may read (and, to publish, write) this bucket."
        )
    if isinstance(err, FileNotFoundError):
        return RemoteStorageError(f"{url!r} was not found while {doing} it ({detail}).")
    again = "publishing starts over" if doing.startswith("publish") else "staging resumes where it stopped"
    return RemoteStorageError(
        f"network failure while {doing} {url!r} ({type(err).__name__}: {detail}). Check the network and the"
        f" endpoint{' (AWS_ENDPOINT_URL or FSSPEC_S3_ENDPOINT_URL)' if scheme in ('s3', 's3a') else ''}, then run"
        f" again: {again}."
    )


@contextlib.contextmanager
def _remote(url: str, doing: str) -> Iterator[None]:
    """Turn what fsspec and its backend raise into :func:`_remote_error`'s one line."""
    try:
        yield
    except FastDataError:
        raise
    except Exception as err:
        raise _remote_error(err, url, doing) from err


def _missing_marker(fs: AbstractFileSystem, path: str, shown: str) -> RemoteStorageError:
    """Why ``shown`` (the URL, redacted) has no marker: an unfinished upload, a missing bucket, or nothing there."""
    with _remote(shown, "reading"):
        if fs.exists(_join(path, DATA_FILE)):
            return RemoteStorageError(
                f"{shown!r} holds {DATA_FILE} but no {MARKER}, the marker uploaded last: an upload is under way or was"
                f" interrupted, so it is not read. Publish it again with `lightning-fastdata convert SRC {shown}`."
            )
        bucket = path.split("/", 1)[0]
        if _scheme(shown) in _CREDENTIALS and bucket != path and not fs.exists(bucket):
            return RemoteStorageError(
                f"the bucket {bucket!r} of {shown!r} does not exist (or these credentials cannot see it). Check the"
                f" URL, or the credentials ({_CREDENTIALS[_scheme(shown)]})."
            )
    return RemoteStorageError(
        f"no database at {shown!r} (no {MARKER} there). Check the URL, or publish one with"
        f" `lightning-fastdata convert SRC {shown}`."
    )


# ---------------------------------------------------------------------------------------------------------------
# Staging
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagedDatabase:
    """What :func:`stage` did: the local copy, and whether it was fetched, fetched again (and why) or reused."""

    path: Path
    action: Literal["staged", "restaged", "reused", "found"]
    reason: str | None = None


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


def _read_marker(fs: AbstractFileSystem, path: str, shown: str) -> dict[str, Any]:
    """The marker of the database at ``shown``: one request, and checked (:func:`_check_marker`) before any write.

    One ranged GET of :data:`MARKER_LIMIT` bytes and one more (a whole-object read makes s3fs ask for the size first, a
    second request); over HTTP no more is read whatever the server sends. A larger marker is refused.
    """
    with _remote(shown, "reading"):
        try:
            if _reads_http(fs):
                with _HttpReply(fs, _join(path, MARKER), 0, MARKER_LIMIT + 1) as reply:
                    raw: bytes | None = bytes(reply.read(MARKER_LIMIT + 1))
            else:
                raw = fs.cat_file(_join(path, MARKER), start=0, end=MARKER_LIMIT + 1)
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
    (:func:`_keeping_secrets`). An http(s) query (a signature, a token) is sent with every file's request.

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
    with _keeping_secrets(url, "staging"):
        return _stage(url, root, progress, argument, check)


def _stage(url: str, root: str | os.PathLike[str], progress: bool, argument: str, check: bool) -> StagedDatabase:
    """:func:`stage`, whose errors may name the URL's secrets in their chain: :func:`_keeping_secrets` clears it."""
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
        marker = _read_marker(fs, path, shown)
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


def _etag(info: dict[str, Any]) -> str | None:
    """The ETag in an fsspec ``info`` (s3fs: ``ETag``; gcsfs: ``etag``; adlfs: ``etag``), unquoted."""
    value = info.get("ETag") or info.get("etag") or info.get("e_tag")
    return str(value).strip('"') if value else None


def _check_source(fs: AbstractFileSystem, path: str, shown: str, name: str, want: dict[str, Any]) -> None:
    """Check that the object ``name`` is the one the marker lists: its size, and its ETag where both have one."""
    with _remote(shown, "reading"):
        fs.invalidate_cache(_join(path, name))
        info = fs.info(_join(path, name))
    etag = _etag(info)
    if info.get("size") != want["size"] or (etag and want.get("etag") and etag != want["etag"]):
        raise RemoteStorageError(
            f"{shown}/{name} is not the file its {MARKER} lists ({info.get('size')} bytes, ETag {etag}; the marker"
            f" says {want['size']} bytes, ETag {want.get('etag')}): it is being published again, or was replaced by"
            f" hand. Wait for the upload and run again, or publish it again with `lightning-fastdata convert SRC"
            f" {shown}`."
        )


def _fetch_all(
    fs: AbstractFileSystem, path: str, shown: str, marker: dict[str, Any], work: Path, progress: bool
) -> None:
    """Fetch every file of the publication ``marker`` into ``work``, resumably; each then has the marker's SHA-256.

    A file whose copy does not match (ranges damaged on this disk since an interrupted staging, or bytes altered on
    the way) is fetched again, whole, once; a second mismatch discards the working copy.
    """
    for name, want in marker["files"].items():
        _check_source(fs, path, shown, name, want)
    state = _working_copy(work, marker)
    bad = _fetch_files(fs, path, shown, marker, work, state, progress)
    if bad:
        for name in bad:  # a new publication under way: its marker will say so; fetching again cannot help
            _check_source(fs, path, shown, name, marker["files"][name])
        log.warning(
            "%s: the copy of %s does not match the SHA-256 its %s lists (ranges damaged on this disk since an"
            " interrupted staging, or bytes altered on the way); fetching it again",
            shown,
            " and ".join(bad),
            MARKER,
        )
        state["done"] = {name: starts for name, starts in state["done"].items() if name not in bad}
        write_json(work / PROGRESS_FILE, state)  # a run stopped before they are fetched again fetches them too
        bad = _fetch_files(fs, path, shown, marker, work, state, progress)
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
        or state.get("range_size") != RANGE_SIZE
        or not isinstance(state.get("done"), dict)
    ):
        if state is not None:
            log.info("%s: discarding a partly staged copy of another publication", work)
        for entry in os.scandir(work):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        state = {"marker": marker, "range_size": RANGE_SIZE, "done": {}}
        write_json(work / PROGRESS_FILE, state)  # from the start: `convert --clean` tells it from a conversion's
    return state


def _check_free_space(work: Path, shown: str, needed: int) -> None:
    """Refuse to start when the disk of ``work`` has less free space than the ``needed`` bytes left to fetch."""
    from lightning_fastdata.store.summary import human_bytes

    free = shutil.disk_usage(work).free
    if needed > free:
        raise DestinationError(
            f"staging {shown} needs {human_bytes(needed)} more on the disk of {str(work.parent)!r}, but"
            f" {human_bytes(free)} is free there; nothing more was fetched. Free space there (`lightning-fastdata cache"
            " prune`), or pass a `cache_dir` (`--cache-dir`) on a larger disk."
        )


def _fetch_files(
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
    resumed = sum(min(RANGE_SIZE, files[name]["size"] - start) for name, starts in done.items() for start in starts)
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
            (name, start, min(start + RANGE_SIZE, want["size"]))
            for name, want in files.items()
            for start in range(0, want["size"], RANGE_SIZE)
            if start not in done[name]
        ]
        lock = threading.Lock()
        reader = _RangeReader(fs, shown)
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
            with reader.open(_join(path, name), start, end, files[name]["size"]) as reply:
                if reply.whole:
                    return take_whole(name, reply)
                data = reply.read(end - start + 1)  # one byte more than asked tells a longer reply, unread
            if len(data) != end - start:
                got = f"more than {end - start}" if len(data) > end - start else len(data)
                raise _BadReply(f"answered a read of bytes {start}-{end} of {name} with {got} bytes")
            return settle(name, start, data)

        def take_whole(name: str, reply: _Reply) -> int:
            """Write from ``reply``, the whole file ``name``, the ranges nobody claimed, holding one range at a time."""
            with lock:
                if name in whole:
                    return 0  # another reply brings the whole file: this one is closed unread
                whole.add(name)
            size, new = files[name]["size"], 0
            for start in range(0, size, RANGE_SIZE):
                with lock:
                    if len(claimed[name]) * RANGE_SIZE >= size:  # every range is written, or being written
                        return new
                data = reply.read(min(RANGE_SIZE, size - start))
                if len(data) < min(RANGE_SIZE, size - start):
                    raise _BadReply(
                        f"sent {name} whole for a ranged read, but it ends at byte {start + len(data)} of {size}"
                    )
                new += settle(name, start, data)
            if reply.read(1):
                raise _BadReply(f"sent {name} whole for a ranged read, but it is longer than its {size} bytes")
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
                    finished, pending = wait(pending, timeout=SYNC_SECONDS or None, return_when=FIRST_COMPLETED)
                    for future in finished:
                        bar.update(future.result())
                    advance()
                    if not finished or time.perf_counter() - synced >= SYNC_SECONDS:
                        persist()
                        synced = time.perf_counter()
            except BaseException as err:
                for future in pending:
                    future.cancel()
                with contextlib.suppress(OSError):  # a full disk may refuse progress.json too: the error says why
                    persist()
                if isinstance(err, _BadReply):
                    raise RemoteStorageError(
                        f"the server of {shown!r} {err}: nothing of that reply was written. Check the server (a ranged"
                        " read must be answered with those bytes, or with the whole file), then run again: staging"
                        " resumes where it stopped."
                    ) from err
                if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _disk_full(err, work, shown) from err
                if isinstance(err, Exception):
                    raise _remote_error(err, shown, "staging") from err
                raise
        advance()
        persist()
        return [name for name, digest in hashes.items() if digest.hexdigest() != files[name]["sha256"]]
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(folder)


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
        resumed = sum(min(RANGE_SIZE, want["size"] - start) for start in done[name])
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
    return {s for s in starts if type(s) is int and 0 <= s < size and s % RANGE_SIZE == 0}


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
            end = min(self.offset + RANGE_SIZE, self.size)
            while self.offset < end:
                chunk = os.pread(self.fd, min(2**22, end - self.offset), self.offset)
                if not chunk:
                    raise OSError(f"the working copy ends at byte {self.offset} of {self.size}")
                self._sha256.update(chunk)
                self.offset += len(chunk)

    def hexdigest(self) -> str | None:
        """The file's SHA-256, ``None`` while a range is not hashed."""
        return self._sha256.hexdigest() if self.offset >= self.size else None


class _RangeReader:
    """Ranged reads of one staging; reads past botocore's response checksums where a server sends wrong ones.

    Some S3-compatible servers (Ceph RGW before its fix of 2025, ``rclone serve s3``, versitygw) answer a ranged
    GET with the whole object's checksum; botocore (1.36+) then checks the part against it and raises
    ``FlexibleChecksumError``. AWS S3 sends no checksum for such a range. On the first such error the reads go through
    a copy of the file system that does not check response checksums (``response_checksum_validation=
    "when_required"``); the SHA-256 that every staged file is checked against covers them.
    """

    def __init__(self, fs: AbstractFileSystem, shown: str) -> None:
        self.fs, self.shown = fs, shown
        self._lock = threading.Lock()

    def open(self, path: str, start: int, end: int, size: int) -> _Reply:
        """The reply to a ranged read of bytes ``start:end`` of ``path``, a file of ``size`` bytes (one GET).

        Over HTTP the reply is read from the connection as it is used (:class:`_HttpReply`); other backends read it
        whole (``cat_file``), and a reply of ``size`` bytes for a shorter range is then the whole file.
        """
        if _reads_http(self.fs):
            return _HttpReply(self.fs, path, start, end)
        data = self.read(path, start, end)
        return _Reply(data, whole=len(data) == size and end - start != size)

    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of ``path`` (one ranged GET), read whole."""
        fs = self.fs
        try:
            return _read_range(fs, path, start, end)
        except Exception as err:
            protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
            if type(err).__name__ != "FlexibleChecksumError" or "s3" not in protocols:
                raise
            with self._lock:
                if self.fs is fs:
                    log.warning(
                        "%s: the server sent a checksum that does not match a ranged read (%s); some S3-compatible"
                        " servers send the whole object's checksum with every range. Staging goes on without"
                        " botocore's response checks; each file's SHA-256 is checked against the marker, as always.",
                        self.shown,
                        redact_text(str(err)),
                    )
                    self.fs = _without_response_checksums(fs)
            return _read_range(self.fs, path, start, end)


class _BadReply(OSError):
    """A reply that is not what was asked: a range of another length or start, or a whole file of another size."""


class _Reply:
    """The reply to a ranged read, read as it is used; ``whole``: the server ignored the range and sends the whole file.

    This one holds a reply read whole (``cat_file``); :class:`_HttpReply` reads one from the connection.
    """

    def __init__(self, data: bytes, whole: bool) -> None:
        self.whole, self._data, self._at = whole, memoryview(data), 0

    def read(self, n: int) -> bytes | bytearray | memoryview:
        """The next ``n`` bytes of the reply, fewer only where it ends."""
        chunk = self._data[self._at : self._at + n]
        self._at += len(chunk)
        return chunk

    def close(self) -> None:
        """Let go of the reply, read or not."""
        self._data = memoryview(b"")

    def __enter__(self) -> _Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HttpReply(_Reply):
    """A reply of fsspec's HTTP file system, read from its connection as it is used (aiohttp, on fsspec's loop).

    What is held is what is asked for: a reply longer than asked, or the whole file a server that ignores ranges
    sends, is never read whole into memory, and a reply closed unread closes its connection. A reply other than 206
    is the whole file (from byte 0); a 206 must start where asked.
    """

    def __init__(self, fs: Any, url: str, start: int, end: int) -> None:
        from fsspec.asyn import sync

        self._fs, self._sync = fs, sync
        self._response = sync(fs.loop, self._get, url, start, end)
        self.whole = self._response.status != 206
        found = re.match(r"bytes (\d+)-", self._response.headers.get("Content-Range", ""))
        if not self.whole and found is not None and int(found[1]) != start:
            self.close()
            name = redact_url(url).rsplit("/", 1)[-1]  # without the query
            raise _BadReply(f"answered a read from byte {start} of {name} with bytes from {found[1]}")

    async def _get(self, url: str, start: int, end: int) -> Any:
        session = await self._fs.set_session()
        options = dict(self._fs.kwargs)
        options["headers"] = {**options.get("headers", {}), "Range": f"bytes={start}-{end - 1}"}
        response = await session.get(self._fs.encode_url(url), **options)
        try:
            self._fs._raise_not_found_for_status(response, url)
        except BaseException:
            response.close()
            raise
        return response

    async def _read(self, n: int) -> bytearray:
        data, got = bytearray(n), 0  # filled in place: ``n`` bytes held, and one chunk of 64 KiB
        with memoryview(data) as view:
            while got < n and (chunk := await self._response.content.read(min(n - got, 2**16))):
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
        del data[got:]
        return data

    def read(self, n: int) -> bytearray:
        """The next ``n`` bytes of the reply, fewer only where it ends."""
        return self._sync(self._fs.loop, self._read, n)  # type: ignore[no-any-return]

    async def _close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection serves the next read
        else:
            self._response.close()  # the rest is never read

    def close(self) -> None:
        """Let go of the reply; one not read to its end closes its connection."""
        self._sync(self._fs.loop, self._close)


def _reads_http(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is fsspec's HTTP file system, whose replies :class:`_HttpReply` reads as they are used."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "http" in protocols and hasattr(fs, "set_session")


def _without_response_checksums(fs: AbstractFileSystem) -> AbstractFileSystem:
    """A new instance of the S3 file system ``fs``, with its options, whose client checks no response checksum."""
    options = dict(fs.storage_options)
    config = {**(options.get("config_kwargs") or {}), "response_checksum_validation": "when_required"}
    return type(fs)(**{**options, "config_kwargs": config, "skip_instance_cache": True})


def read_threads() -> int:
    """How many ranged reads staging keeps in flight: :data:`READ_THREADS`, else twice the usable CPUs, 4 to 10.

    10 is the connection pool of s3fs's client (aiobotocore's ``max_pool_connections``): more would queue for it.
    """
    return READ_THREADS or min(10, max(4, 2 * usable_cpu_count()))


def _read_range(fs: AbstractFileSystem, path: str, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of ``path`` (one ranged GET)."""
    return bytes(fs.cat_file(path, start=start, end=end))


def _sha256(path: Path, callback: Callable[[int], Any] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(2**22):
            digest.update(chunk)
            if callback is not None:
                callback(len(chunk))
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------------------------


def check_destination(url: str) -> set[str]:
    """Check that a database may be published at ``url`` (one listing); returns the names of the objects there.

    Raises:
        DestinationError: ``url`` holds objects that are not a published database's, or its bucket does not exist.
        RemoteStorageError: a missing backend, missing credentials, or a network failure.

    """
    with _keeping_secrets(url, "publishing to"):
        return _check_destination(url)


def _check_destination(url: str) -> set[str]:
    """:func:`check_destination`, whose errors may name the URL's secrets in their chain."""
    fs, path = filesystem(url, "dst")
    url = redact_url(url)  # from here on only shown
    with _remote(url, "publishing to"):
        fs.invalidate_cache(path)
        try:
            held = {Path(p).name for p in fs.ls(path, detail=False)}
        except FileNotFoundError:
            held = set()
        bucket = path.split("/", 1)[0]
        if not held and _scheme(url) in _CREDENTIALS and bucket != path and not fs.exists(bucket):
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
        info = fs.info(_join(path, name))
        if info.get("size") != size or _etag(info) != want["etag"]:
            return False
    return True


def publish_database(
    database: str | os.PathLike[str], url: str, progress: bool = True, destination: str | None = None
) -> tuple[dict[str, Any], bool]:
    """:func:`publish`, and whether it uploaded anything.

    ``destination``: what the uploaded conversion report names as the database's ``destination`` (the URL without
    user-info and query, where the local report names the local folder); the local files stay as they are.
    """
    with _keeping_secrets(url, "publishing to"):
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
    with _remote(shown, "publishing to"):
        if MARKER in held:
            try:
                old = _read_marker(fs, path, shown)
            except RemoteStorageError:  # a damaged marker: replaced below
                old = {"files": {}}
            if _holds(fs, path, held, old["files"], sizes, sha256):
                log.info("%s already holds this database (the same files, published %s): nothing uploaded", shown,
                         old.get("published"))  # fmt: skip
                return old, False
            fs.rm_file(_join(path, MARKER))  # from here on the old publication is not readable
        fs.makedirs(path, exist_ok=True)  # a folder for file:// (object stores have none to make)
        published: dict[str, dict[str, Any]] = {}
        for name in names:
            kwargs = {"desc": f"uploading {name}", "unit": "B", "unit_scale": True, "disable": not progress}
            if name in contents:
                fs.pipe_file(_join(path, name), contents[name])
            else:
                fs.put_file(str(local / name), _join(path, name), callback=TqdmCallback(tqdm_kwargs=kwargs))
            fs.invalidate_cache(_join(path, name))
            etag = _etag(fs.info(_join(path, name)))
            published[name] = {"size": sizes[name], "sha256": sha256[name], **({"etag": etag} if etag else {})}
        marker = {
            "format_version": 1,
            "id": uuid.uuid4().hex,
            "published": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": published,
        }
        fs.pipe_file(_join(path, MARKER), json.dumps(marker, sort_keys=True).encode())
    return marker, True
