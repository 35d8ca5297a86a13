"""The errors of calls on a URL: one line naming the URL and what to set, and never the URL's secrets.

:func:`remote_errors` turns what fsspec and its backend raise into :func:`remote_error`'s one line;
:func:`keeping_secrets` keeps a URL's user-info and http(s) query out of what a call raises (the chain of a backend's
error included) and out of fsspec's HTTP log records while the call runs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import traceback
import urllib.parse
from collections.abc import Iterator

from lightning_fastdata.errors import FastDataError, RemoteStorageError
from lightning_fastdata.store.remote.urls import (
    CREDENTIALS,
    QUERY_SCHEMES,
    SCHEME,
    redact_text,
    redact_url,
    scheme_of,
)

#: a secret of a URL shorter than this is not looked for in free text (an error, a log record), where it would be found
#: by chance (``?a=1`` in "line 1"); it is still cut from every URL shown (:func:`redact_url`)
_SECRET_MIN = 4


def _secrets(url: str) -> list[str]:
    """What ``url`` holds that is never shown, longest first.

    Its user-info (whole, the user, the password) and, over HTTP, its query and fragment (whole, each ``key=value`` and
    each value); each as written and percent-decoded.
    """
    found = SCHEME.match(url)
    if found is None:
        return []
    rest, parts = url[found.end() :], []
    if found[1].lower() in QUERY_SCHEMES and (cut := re.search(r"[?#]", rest)) is not None:
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

    Installed on its logger only while a call with a secret in its URL runs (:func:`keeping_secrets`):
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
def keeping_secrets(url: str, doing: str) -> Iterator[None]:
    """Keep the secrets of ``url`` out of what a call raises and what fsspec's HTTP file system logs.

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
                raise remote_error(err, url, doing) from None
        except FastDataError as err:
            err.__cause__ = err.__context__ = None  # `raise` below re-raises it as it is: no new context
            err.__suppress_context__ = True
            err.args = tuple(_scrub(arg, secrets) if isinstance(arg, str) else arg for arg in err.args)
            raise


def remote_error(err: BaseException, url: str, doing: str) -> RemoteStorageError:
    """The one-line error for ``err``, raised by fsspec while ``doing`` (``"reading"``...) ``url``.

    The URL, and any URL in the backend's message, is shown without user-info and an http(s) query (:func:`redact_url`,
    :func:`redact_text`).
    """
    scheme, url = scheme_of(url), redact_url(url)
    if isinstance(err, FileNotFoundError) and getattr(err.__cause__, "status", None) in (401, 403):
        err = err.__cause__  # fsspec's HTTP file system reports a size it was refused (a HEAD's 403) as not found
    names = {cls.__name__ for cls in type(err).__mro__}
    detail = redact_text(str(err).strip().splitlines()[0]) if str(err).strip() else type(err).__name__
    where = CREDENTIALS.get(scheme, "the credentials your fsspec backend reads")
    if scheme in QUERY_SCHEMES:  # what a server of signed URLs refuses: an expired or wrong signature, or password
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
def remote_errors(url: str, doing: str) -> Iterator[None]:
    """Turn what fsspec and its backend raise into :func:`remote_error`'s one line."""
    try:
        yield
    except FastDataError:
        raise
    except Exception as err:
        raise remote_error(err, url, doing) from err
