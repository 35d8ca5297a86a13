"""One ranged read of a published file and its reply, read as it is used; past wrong response checksums of S3.

Over HTTP a reply is read from the connection (:class:`HttpReply`), so a server that ignores the range or sends more
cannot make staging hold more than a range; other backends read a range whole (:class:`Reply`).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

from lightning_fastdata.store.remote.urls import redact_text, redact_url

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)


class RangeReader:
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

    def open(self, path: str, start: int, end: int, size: int) -> Reply:
        """The reply to a ranged read of bytes ``start:end`` of ``path``, a file of ``size`` bytes (one GET).

        Over HTTP the reply is read from the connection as it is used (:class:`HttpReply`); other backends read it
        whole (``cat_file``), and a reply of ``size`` bytes for a shorter range is then the whole file.
        """
        if reads_http(self.fs):
            return HttpReply(self.fs, path, start, end)
        data = self.read(path, start, end)
        return Reply(data, whole=len(data) == size and end - start != size)

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


class BadReply(OSError):
    """A reply that is not what was asked: a range of another length or start, or a whole file of another size."""


class Reply:
    """The reply to a ranged read, read as it is used; ``whole``: the server ignored the range and sends the whole file.

    This one holds a reply read whole (``cat_file``); :class:`HttpReply` reads one from the connection.
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

    def __enter__(self) -> Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpReply(Reply):
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
            raise BadReply(f"answered a read from byte {start} of {name} with bytes from {found[1]}")

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


def reads_http(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is fsspec's HTTP file system, whose replies :class:`HttpReply` reads as they are used."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "http" in protocols and hasattr(fs, "set_session")


def _without_response_checksums(fs: AbstractFileSystem) -> AbstractFileSystem:
    """A new instance of the S3 file system ``fs``, with its options, whose client checks no response checksum."""
    options = dict(fs.storage_options)
    config = {**(options.get("config_kwargs") or {}), "response_checksum_validation": "when_required"}
    return type(fs)(**{**options, "config_kwargs": config, "skip_instance_cache": True})


def _read_range(fs: AbstractFileSystem, path: str, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of ``path`` (one ranged GET)."""
    return bytes(fs.cat_file(path, start=start, end=end))
