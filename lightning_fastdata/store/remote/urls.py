"""URLs of databases in object storage: parsing, redaction, the file system of a URL, and a staged copy's name.

A URL's user-info and an http(s) query (a signature, a token) are used to read and never shown: :func:`redact_url`
and :func:`redact_text` cut them from what is printed, logged, recorded or used as a name. An object store's URL that
holds credentials is refused before any request (:func:`filesystem`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_fastdata.errors import InvalidArgumentError, RemoteStorageError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


#: the schemes whose query and fragment are not part of the path: HTTP's, where a query holds a signature or a token.
#: fsspec keeps ``?`` and ``#`` in the path for every other scheme (``file:///data/run#1``, ``s3://bucket/exp?a``)
QUERY_SCHEMES = ("http", "https")


#: a URL in a line of text: its scheme, user-info (everything from ``//`` to the last ``@`` before the first ``/``),
#: its path, and a query or fragment, up to the next blank
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?:[^/\s]*@)?(?P<path>[^?#\s]*)(?P<query>[?#]\S*)?")


#: what ends a query in a line of text but belongs to the text: closing quotes and brackets, punctuation
_QUERY_END = re.compile(r"[\'\")\]>},.;:]*$")


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


CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials or an instance role"
    " (and AWS_ENDPOINT_URL for a store other than AWS)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`",
    "az": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_CONNECTION_STRING",
}


CREDENTIALS.update({"s3a": CREDENTIALS["s3"], "gcs": CREDENTIALS["gs"]})


CREDENTIALS.update({"abfs": CREDENTIALS["az"], "abfss": CREDENTIALS["az"]})


#: the schemes whose URL may name a container before an ``@``: adlfs reads ``abfs://container@account.dfs.core.
#: windows.net/path``, so there only user-info holding a ``:`` (a key) is refused
_CONTAINER_SCHEMES = ("az", "abfs", "abfss")


def is_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL (``scheme://...``, ``file://`` included) rather than a local path."""
    return path is not None and SCHEME.match(os.fspath(path)) is not None


def redact_url(url: str) -> str:
    """``url`` as it may be shown, logged, recorded or used as a name: without user-info, and over HTTP without query.

    ``https://user:pa'ss@[::1]:8443/db.lmdb?signature=...#x`` becomes ``https://[::1]:8443/db.lmdb``. The user-info is
    all of the authority (what follows ``//``, up to the first ``/``) to its last ``@``. A query and a fragment are cut
    only from ``http(s)://`` URLs: fsspec reads ``?`` and ``#`` as part of the path for every other scheme
    (``file:///data/run#1/db.lmdb`` is a folder ``run#1``), so they stay. A plain URL, and a local path, are returned as
    they are. The full URL is still the one used to read; :func:`redact_text` does the same to a line of text.
    """
    found = SCHEME.match(url)
    if found is None:
        return url
    rest = url[found.end() :]
    if found[1].lower() in QUERY_SCHEMES:
        rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    authority, slash, path = rest.partition("/")
    return f"{url[: found.end()]}{authority.rpartition('@')[2]}{slash}{path}"


def redact_text(text: str) -> str:
    """``text`` (an error from a backend) with every URL in it redacted as :func:`redact_url` does.

    A URL in text ends at the next blank; the closing quotes, brackets and punctuation after a query cut from it stay.
    """

    def redact(found: re.Match[str]) -> str:
        query = found["query"] or ""
        if found["scheme"].lower() in QUERY_SCHEMES:
            query = _QUERY_END.search(query)[0]  # type: ignore[index]
        return f"{found['scheme']}://{found['path']}{query}"

    return _URL.sub(redact, text)


def _split_query(path: str) -> tuple[str, str]:
    """An fsspec path (an http(s) URL keeps its scheme) and its query: ``("https://h/db.lmdb", "?token=x")``.

    Only an http(s) URL has one; a fragment is dropped (it is never sent). Any other path is returned whole, with
    ``""``: fsspec reads ``?`` and ``#`` as part of it.
    """
    cut = re.search(r"[?#]", path) if scheme_of(path) in QUERY_SCHEMES else None
    if cut is None:
        return path, ""
    return path[: cut.start()], f"?{path[cut.end() :].partition('#')[0]}" if cut[0] == "?" else ""


def join(path: str, name: str) -> str:
    """The path of the file ``name`` in the folder ``path``: before its query, over HTTP (``.../db.lmdb/x?token=t``)."""
    base, query = _split_query(path)
    return f"{base.rstrip('/')}/{name}{query}"


def check_local(path: str | os.PathLike[str] | None, argument: str, why: str) -> None:
    """Refuse a URL where a local path is needed.

    Raises:
        InvalidArgumentError: ``path`` is a URL; the message names ``argument`` and says why (``why``).

    """
    if is_url(path):
        shown = redact_url(os.fspath(path))  # type: ignore[arg-type]
        raise InvalidArgumentError(f"`{argument}` {shown!r} is a URL, but {why}.")


def scheme_of(url: str) -> str:
    """The scheme of ``url``, lower case (``""``: a local path)."""
    match = SCHEME.match(url)
    return match.group(1).lower() if match else ""


def _refuse_credentials(url: str, argument: str) -> None:
    """Refuse an object store's URL holding credentials (``s3://KEY:SECRET@bucket/...``), before any request.

    s3fs, gcsfs and adlfs read no credentials from a URL (s3fs takes ``KEY:SECRET@bucket`` for a bucket name, and
    botocore's error then prints it); a secret in a URL ends up in shell histories, job scripts, process lists and
    logs. An Azure URL's container before the ``@`` (``abfs://container@account.dfs.core.windows.net/...``) is kept.

    Raises:
        RemoteStorageError: the URL holds user-info; the message shows it as ``***`` and says where credentials go.

    """
    scheme, found = scheme_of(url), SCHEME.match(url)
    if scheme not in CREDENTIALS or found is None:
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
        f" nothing was read. Remove them from the URL and set {CREDENTIALS[scheme]} instead (or fsspec's"
        f" FSSPEC_{scheme.upper()}_<OPTION> variables): a secret in a URL ends up in shell histories, job scripts,"
        " process lists and logs."
    )


def filesystem(url: str, argument: str = "data_dir") -> tuple[AbstractFileSystem, str]:
    """The fsspec file system of ``url`` and the path in it (no trailing slash); makes no request.

    Over HTTP the path is the URL, with its query: a file's path in it is :func:`join`'s, the name before the query.

    Raises:
        RemoteStorageError: fsspec, or the backend of the URL's scheme, is not installed, or the scheme is unknown; or
            an object store's URL holds credentials (:func:`_refuse_credentials`).

    """
    _refuse_credentials(url, argument)
    scheme, shown = scheme_of(url), redact_url(url)
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
