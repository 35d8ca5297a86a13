"""Secrets in a database's URL (issue 43, points 9 and 13), against real servers on 127.0.0.1 and the real clients.

A URL may hold secrets: user-info (``https://user:password@host/...``) and, over HTTP, a signed query
(``?X-Amz-Signature=...&token=...``). They are never shown: not in an error's message, not in the exceptions chained
to it (``__cause__``, ``__context__``, which every traceback prints), not in a log record (fsspec's DEBUG records
included), not in a progress bar or a file name. A token in the query is sent with every file's request: the file
name goes into the path, before the query. An object store's URL holding credentials is refused before any request.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import logging
import os
import re
import socket
import threading
import traceback
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lightning_fastdata import FastImageDataModule
from lightning_fastdata.cli import main
from lightning_fastdata.errors import RemoteStorageError
from lightning_fastdata.store import remote
from lightning_fastdata.store.remote import staging, urls

pytest.importorskip("aiohttp")

#: the secrets of the URLs below: each is long enough to be found by chance nowhere else
USER, PASSWORD, SIGNATURE, TOKEN = "reader-Jm7q", "pa55-Wr93x", "s1gnature-Kx42", "t0ken-Zq81"
SECRETS = (USER, PASSWORD, SIGNATURE, TOKEN)
QUERY = f"X-Amz-Signature={SIGNATURE}&token={TOKEN}"


@dataclass
class _Site:
    """A database published under ``folder``, served at ``base`` to requests whose query holds ``token=TOKEN``."""

    folder: Path
    base: str
    #: every request's path and query, as the server received it
    seen: list[str] = field(default_factory=list)
    #: file name -> what the server does instead of serving it: "401", "403", "403 echoing the query" (in the reason
    #: phrase), "cut" (its Content-Length, then half of it, then the connection closed)
    misbehave: dict[str, str] = field(default_factory=dict)

    def url(self, path: str = "db.lmdb", port: int | None = None) -> str:
        """``path`` on this server (or on ``port``), with user-info and the signed query."""
        host = f"127.0.0.1:{port or urllib.parse.urlsplit(self.base).port}"
        return f"http://{USER}:{PASSWORD}@{host}/{path}?{QUERY}"


class _TokenHandler(http.server.SimpleHTTPRequestHandler):
    """Serves its folder only to a request whose query holds ``token=TOKEN`` (403 otherwise), as a server of signed
    URLs does; a file the site says to misbehave on is answered so. No Range support: files are sent whole."""

    site: _Site

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answered(self) -> bool:
        """Answer a request that must not be served (and say so); ``False``: serve it."""
        self.site.seen.append(self.path)
        path, _, query = self.path.partition("?")
        how = self.site.misbehave.get(path.rsplit("/", 1)[-1], "")
        if urllib.parse.parse_qs(query).get("token") != [TOKEN] or how.startswith(("401", "403")):
            status = 401 if how == "401" else 403
            reason = http.HTTPStatus(status).phrase + (f" {urllib.parse.unquote(query)}" if "echoing" in how else "")
            self.send_response(status, reason)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if how == "cut" and self.command == "GET":
            data = Path(self.translate_path(self.path)).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return True
        return False

    def do_GET(self) -> None:
        if not self._answered():
            super().do_GET()

    def do_HEAD(self) -> None:
        if not self._answered():
            super().do_HEAD()


@pytest.fixture
def site(database: Path, tmp_path: Path) -> Iterator[_Site]:
    """The session database published at ``<site>/db.lmdb`` and served by :class:`_TokenHandler`."""
    folder = tmp_path / "site"
    remote.publish(database, (folder / "db.lmdb").as_uri(), progress=False)
    found = _Site(folder, "")
    handler = type("Handler", (_TokenHandler,), {"site": found})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    found.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield found
    server.shutdown()
    server.server_close()


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and every exception chained to it (``__cause__`` and ``__context__``, a suppressed context included)."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [err]
    while todo:
        one = todo.pop()
        if one is not None and all(one is not known for known in found):
            found.append(one)
            todo += [one.__cause__, one.__context__]
    return found


def _leaks(err: BaseException | None, *texts: str) -> list[tuple[str, str]]:
    """Each secret found in ``err`` (its message, arguments, chain and printed traceback) or in ``texts``, with the
    text around it."""
    shown = list(texts)
    if err is not None:
        shown.append("".join(traceback.format_exception(err)))
        shown += [f"{one!s} {one!r} {one.args!r}" for one in _chain(err)]
    return [
        (secret, text[max(0, text.index(secret) - 80) : text.index(secret) + 40])
        for text in shown
        for secret in SECRETS
        if secret in text
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_token_in_the_query_goes_after_each_file_name_and_is_shown_nowhere(
    site: _Site,
    database: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
):
    """A URL with a query the server requires stages: every request is ``/db.lmdb/<file>?<the query>``. The copy is
    the publication's, the URL with a trailing slash reuses it, and neither token nor password is in a log
    record (DEBUG, fsspec's included), the progress bar, ``staged.json`` or a name; fsspec's logger is left as it
    was."""
    cache = tmp_path / "cache"
    with caplog.at_level(logging.DEBUG):
        staged = remote.stage(site.url(), cache, progress=True)
        again = remote.stage(site.url("db.lmdb/"), cache, progress=False)
    assert (staged.action, again.action, again.path) == ("staged", "reused", staged.path)
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()
    assert staged.path == remote.staged_path(f"{site.base}/db.lmdb", cache)
    requested = [urllib.parse.urlsplit(seen) for seen in site.seen]
    assert {(r.path, r.query) for r in requested} == {
        (f"/db.lmdb/{name}", QUERY) for name in (remote.MARKER, *remote.PUBLISHED_FILES)
    }
    assert requested[0].path == f"/db.lmdb/{remote.MARKER}"
    out, err = capsys.readouterr()
    assert f"staging {site.base}/db.lmdb" in err  # the progress bar
    assert any(r.name == "fsspec.http" for r in caplog.records)  # fsspec's DEBUG records were there to redact
    record = (staged.path / remote.STAGED_RECORD).read_text()
    assert json.loads(record)["url"] == f"{site.base}/db.lmdb"
    assert _leaks(None, caplog.text, out, err, record, *os.listdir(cache)) == []
    assert logging.getLogger("fsspec.http").filters == []


#: (what the server or the network does, the file it does it to, what the error says)
_HOSTILE_HTTP = [
    ("403", remote.MARKER, r"access to 'http://127\.0\.0\.1:\d+/db\.lmdb' was denied while reading it"),
    ("401", remote.MARKER, r"access to .* was denied .*the signed query of the URL, which may have expired"),
    ("403 echoing the query", remote.MARKER, r"access to .* was denied .*Forbidden \*\*\*"),
    ("403", "data.mdb", r"access to .* was denied"),
    ("403 echoing the query", "data.mdb", r"access to .* was denied"),
    ("cut", "data.mdb", r"network failure while staging 'http://127\.0\.0\.1:\d+/db\.lmdb'"),
    ("404", "", r"no database at 'http://127\.0\.0\.1:\d+/none\.lmdb' \(no published\.json there\)"),
    ("connection refused", "", r"network failure while reading 'http://127\.0\.0\.1:\d+/db\.lmdb'"),
    ("a damaged marker", remote.MARKER, r"published\.json is not a marker written by .* or it is damaged"),
    ("a marker naming a file outside", remote.MARKER, r"published\.json lists a file named '\.\./\.\./x'"),
    ("altered bytes", "data.mdb", r"data\.mdb does not match the SHA-256 its published\.json lists, fetched twice"),
]


@pytest.mark.parametrize(("how", "name", "said"), _HOSTILE_HTTP, ids=[f"{h} {n}" for h, n, _ in _HOSTILE_HTTP])
def test_no_secret_of_a_url_is_in_an_error_its_chain_or_a_log_record(
    site: _Site,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    how: str,
    name: str,
    said: str,
):
    """A URL with user-info and a signed query that fails (a 401, a 403, one whose reason phrase echoes the query, a
    file cut off, a 404, a closed port, a damaged or hostile marker, altered bytes) fails in one clear line, from
    `stage`, the `stage` command and `FastImageDataModule.prepare_data` (what `trainer.fit` calls): no secret in the
    message, in any chained exception, in the printed traceback, or in any log record at DEBUG level."""
    url = site.url()
    marker = site.folder / "db.lmdb" / remote.MARKER
    if how.startswith(("401", "403")) or how == "cut":
        site.misbehave[name] = how
    elif how == "404":
        url = site.url("none.lmdb")
    elif how == "connection refused":
        url = site.url(port=_free_port())
    elif how == "a damaged marker":
        marker.write_bytes(b"\x00not json")
    elif how == "a marker naming a file outside":
        good = json.loads(marker.read_text())
        marker.write_text(json.dumps({**good, "files": {**good["files"], "../../x": good["files"]["data.mdb"]}}))
    elif how == "altered bytes":
        data = site.folder / "db.lmdb" / "data.mdb"
        data.write_bytes(bytes([data.read_bytes()[0] ^ 0xFF]) + data.read_bytes()[1:])
    cache = tmp_path / "cache"
    errors = []
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(RemoteStorageError, match=said) as staged:
            remote.stage(url, cache, progress=False)
        errors.append(staged.value)
        dm = FastImageDataModule(url, cache_dir=str(tmp_path / "dm-cache"), num_workers=0)
        with pytest.raises(RemoteStorageError, match=said) as prepared:
            dm.prepare_data()
        errors.append(prepared.value)
        assert main(["stage", url, "--cache-dir", str(tmp_path / "cli-cache"), "--quiet"]) == 1
    out, err = capsys.readouterr()
    line = err.rstrip("\n").rpartition("\n")[2]  # the command's one line, after prepare_data's progress bar
    assert line.startswith("error: "), err
    assert re.search(said, line), err
    for error in errors:
        assert "\n" not in str(error)
        assert _leaks(error) == []
    assert _leaks(None, caplog.text, out, err) == []
    assert not remote.staged_path(url, cache).exists()


def test_an_unwrapped_error_naming_the_url_becomes_one_line_and_a_bug_stays_itself(
    site: _Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An error that reaches `stage` unwrapped (no backend's wrapper caught it) and names the full URL becomes the
    one-line error of staging, raised without it; one that names no secret (a bug) is raised as it is."""
    url = site.url()

    def unwrapped(fs: Any, path: str, shown: str, name: str, want: Any) -> None:
        raise OSError(f"unexpected reply for {urls.join(path, name)}")

    monkeypatch.setattr(staging, "check_source", unwrapped)
    with pytest.raises(
        RemoteStorageError, match=r"network failure while staging 'http://127\.0\.0\.1:\d+/db\.lm"
    ) as info:
        remote.stage(url, tmp_path / "cache", progress=False)
    assert "unexpected reply for http://127.0.0.1" in str(info.value)
    assert _leaks(info.value) == []

    def bug(fs: Any, path: str, shown: str, name: str, want: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(staging, "check_source", bug)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        remote.stage(url, tmp_path / "cache", progress=False)


#: (an object store's URL with credentials, as shown, where its credentials go)
_CREDENTIAL_URLS = [
    (f"s3://AKIAX:{PASSWORD}@bkt/db.lmdb", "s3://***@bkt/db.lmdb", "AWS_ACCESS_KEY_ID"),
    (f"S3://{USER}@bkt/db.lmdb", "S3://***@bkt/db.lmdb", "AWS_ACCESS_KEY_ID"),
    (f"s3a://AKIAX:{PASSWORD}@bkt/db.lmdb", "s3a://***@bkt/db.lmdb", "AWS_ACCESS_KEY_ID"),
    (f"gs://{USER}:{PASSWORD}@bkt/db.lmdb", "gs://***@bkt/db.lmdb", "GOOGLE_APPLICATION_CREDENTIALS"),
    (f"gcs://{USER}@bkt/db.lmdb", "gcs://***@bkt/db.lmdb", "GOOGLE_APPLICATION_CREDENTIALS"),
    (f"az://acct:{PASSWORD}@container/db.lmdb", "az://***@container/db.lmdb", "AZURE_STORAGE_ACCOUNT_KEY"),
    (f"abfss://c:{PASSWORD}@acct.dfs.core.windows.net/d", "abfss://***@acct.dfs.core.windows.net/d", "AZURE_STORAGE"),
]


@pytest.mark.parametrize(
    ("url", "shown", "where"), _CREDENTIAL_URLS, ids=[u[0].split(":")[0] for u in _CREDENTIAL_URLS]
)
def test_credentials_in_an_object_store_url_are_refused_before_any_request(
    url: str, shown: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """``s3://KEY:SECRET@bucket/...`` (s3fs takes it for a bucket name, and botocore's error, chained, printed it) and
    its kind on gs://, az://: staging, publishing and checking a destination each refuse it before any request, the
    URL shown as ``s3://***@bucket/...``, saying where credentials go; no secret anywhere, in the chain or a log."""
    for key, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)  # without the refusal: botocore's own error, made before any request
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    with caplog.at_level(logging.DEBUG):
        calls: list[Callable[[], Any]] = [
            lambda: remote.stage(url, tmp_path / "cache", progress=False),
            lambda: remote.publish(tmp_path / "db.lmdb", url, progress=False),
            lambda: remote.check_destination(url),
        ]
        for call in calls:
            with pytest.raises(RemoteStorageError, match="holds credentials before its '@'") as info:
                call()
            assert f"{shown!r}" in str(info.value)
            assert re.search(f"Remove them from the URL and set [^;]*{where}", str(info.value))
            assert "nothing was read" in str(info.value)
            assert _leaks(info.value) == []
    assert _leaks(None, caplog.text) == []
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_an_azure_container_before_the_at_sign_is_no_credential(tmp_path: Path):
    """``abfs://container@account.dfs.core.windows.net/path``, adlfs's own form, is not refused as credentials."""
    if importlib.util.find_spec("adlfs") is not None:
        pytest.skip("adlfs is installed: the URL would be read")
    with pytest.raises(RemoteStorageError, match=r"needs fsspec's abfs:// backend \(adlfs\)") as info:
        remote.stage("abfs://container@acct.dfs.core.windows.net/db.lmdb", tmp_path, progress=False)
    assert "credentials" not in str(info.value)


def test_an_http_url_with_a_query_names_each_file_before_the_query(tmp_path: Path):
    """The path of each file of a database at an http(s) URL with a query: the name goes before the query, a fragment
    is dropped, a trailing slash is not doubled; any other scheme's ``?`` and ``#`` are part of the path. A URL signed
    again is staged into the same copy."""
    assert urls.join("https://h/db.lmdb?token=abc", "published.json") == "https://h/db.lmdb/published.json?token=abc"
    assert urls.join("https://h/db.lmdb/?a=1&b=2#frag", "data.mdb") == "https://h/db.lmdb/data.mdb?a=1&b=2"
    assert urls.join("http://h/db.lmdb#frag?x", "data.mdb") == "http://h/db.lmdb/data.mdb"
    assert urls.join("s3://bucket/exp?a", "data.mdb") == "s3://bucket/exp?a/data.mdb"
    assert urls.join("/data/run#1/db.lmdb", "data.mdb") == "/data/run#1/db.lmdb/data.mdb"
    first, second = (remote.staged_path(f"https://h/db.lmdb?token={t}", tmp_path) for t in ("a", "b"))
    assert first == second == remote.staged_path("https://h/db.lmdb", tmp_path)


def test_a_staging_record_is_read_only_as_a_small_regular_file_of_its_own_name(tmp_path: Path, monkeypatch):
    """``progress.json`` and ``staged.json`` are read without following a link, without waiting on a FIFO, and only
    up to :data:`staging.RECORD_LIMIT` bytes: any other is no record (the copy is staged again)."""
    record = tmp_path / remote.PROGRESS_FILE
    record.write_text(json.dumps({"range_size": 1}))
    assert staging._read_json(record) == {"range_size": 1}
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"range_size": 2}))
    link = tmp_path / remote.STAGED_RECORD
    link.symlink_to(elsewhere)
    assert staging._read_json(link) is None
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert staging._read_json(fifo) is None  # never opened: an open would wait for a writer
    monkeypatch.setattr(staging, "RECORD_LIMIT", len(record.read_bytes()) - 1)
    assert staging._read_json(record) is None
