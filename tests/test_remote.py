"""Databases at a URL (store/remote.py), against a real S3 server: moto's, on 127.0.0.1, with the real s3fs client.

The endpoint and credentials reach s3fs through the environment only (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...),
as they would on a cluster; nothing in the package is given them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, convert, read_meta
from lightning_fastdata.cli import main
from lightning_fastdata.errors import DestinationError, InvalidArgumentError, RemoteStorageError
from lightning_fastdata.store import ondisk, remote
from lightning_fastdata.store.format import lock_path
from lightning_fastdata.store.remote import fetch, replies, staging

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

SCRIPT = Path(__file__).with_name("remote_ddp_script.py")
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server in a thread for the session; its endpoint and test credentials set in the environment."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    settings = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    _fresh_clients()
    yield endpoint
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _fresh_clients()
    server.stop()


def _fresh_clients() -> None:
    """Forget fsspec's cached S3 clients, so the next one reads the environment as it is now."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def _range_checksum_server(corrupt: bool) -> Any:
    """moto's S3 app (the session server's objects) behind a server that, as Ceph RGW before its 2025 fix and
    ``rclone serve s3`` do, sends the whole object's checksum with every range, which a range of part of it does not
    match; ``corrupt`` also flips the first byte of each such range."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)

    def misbehaving(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        partial = []  # a 206 of part of the object (a range covering it whole, such as the marker's, is not)

        def start(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
            sent = {key.lower(): value for key, value in headers}
            found = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", sent.get("content-range", ""))
            if status.startswith("206") and found and (int(found[1]), int(found[2]) + 1) != (0, int(found[3])):
                partial.append(True)
                headers = [*headers, ("x-amz-checksum-crc32", "AAAAAA==")]
            return start_response(status, headers, *args)

        body = b"".join(app(environ, start))
        if corrupt and partial and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        return [body]

    server = make_server("127.0.0.1", 0, misbehaving, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def range_checksum_endpoint(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """Switch this test's S3 clients to a server that sends wrong checksums with ranges (see above)."""
    servers = []

    def switch(corrupt: bool) -> None:
        servers.append(_range_checksum_server(corrupt))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{servers[-1].server_port}")
        _fresh_clients()

    yield switch
    for server in servers:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    _fresh_clients()


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the session's S3 server: ``s3://<name>``."""
    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(name)
    return f"s3://{name}"


@pytest.fixture
def published(bucket: str, database: Path) -> str:
    """The session database published at ``<bucket>/db.lmdb``."""
    url = f"{bucket}/db.lmdb"
    remote.publish(database, url, progress=False)
    return url


def _requests(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    """The requests the S3 server logged for the bucket of ``url``."""
    name = url.removeprefix("s3://").split("/", 1)[0]
    return [r.getMessage() for r in caplog.records if r.name == "werkzeug" and f"/{name}" in r.getMessage()]


class _Tiny(LightningModule):
    """A linear classifier on the mean colour that counts the samples it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.samples = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.samples += len(labels)
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(epochs: int) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def test_a_url_is_never_taken_for_a_local_path(
    s3_endpoint: str, split_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`convert SRC s3://...` writes no local folder `s3:` (nor converts for a missing bucket); a URL is refused as
    `cache_dir` or `src`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: no request leaves the machine
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _fresh_clients()
    try:
        assert main(["convert", str(split_folder), "s3://no-such-bucket/x.lmdb", "--quiet"]) == 1  # a network failure
    finally:
        _fresh_clients()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    with pytest.raises(DestinationError, match=r"the bucket 'no-such-bucket' does not exist.*nothing was converted"):
        convert(split_folder, "s3://no-such-bucket/x.lmdb")
    with pytest.raises(InvalidArgumentError, match=r"`cache_dir` 's3://bucket/cache' is a URL"):
        FastImageDataModule(str(split_folder), cache_dir="s3://bucket/cache")
    with pytest.raises(InvalidArgumentError, match=r"`src` 's3://bucket/images' is a URL"):
        convert("s3://bucket/images", tmp_path / "db.lmdb")


def test_a_missing_backend_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch):
    """A URL whose fsspec backend (or fsspec itself) is missing fails with one line naming the pip install."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(RemoteStorageError, match=r"pip install 'lightning-fastdata\[remote\]' gcsfs"):
        remote.filesystem("gs://bucket/db.lmdb")
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(RemoteStorageError, match=r"`data_dir` 's3://b/db.lmdb' is a URL, which needs fsspec"):
        FastImageDataModule("s3://b/db.lmdb").prepare_data()


def test_convert_publishes_then_two_epochs_train_from_the_url(
    bucket: str, split_folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """`convert SRC URL` publishes; a DataModule on the URL stages it, trains 2 epochs, and a rerun makes 1 request."""
    url = f"{bucket}/imgs.lmdb"
    assert main(["convert", str(split_folder), url, "--quiet", "--short-side", "64"]) == 0
    cache = tmp_path / "cache"
    dm = FastImageDataModule(url, cache_dir=str(cache), image_size=16, batch_size=4, num_workers=0, val_fraction=0)
    model = _Tiny()
    _trainer(epochs=2).fit(model, datamodule=dm)
    assert dm.staging is not None
    assert dm.staging.action == "staged"
    assert dm.database_path == dm.staging.path
    assert dm.database_path.parent == cache
    assert model.samples == 2 * 24
    assert read_meta(dm.database_path)["splits"]["train"]["length"] == 24

    again = FastImageDataModule(url, cache_dir=str(cache), image_size=16, batch_size=4, num_workers=0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        again.prepare_data()
        again.setup("fit")
    assert again.staging is not None
    assert again.staging.action == "reused"
    assert len(_requests(caplog, url)) == 1, _requests(caplog, url)


def test_converting_to_a_url_again_neither_converts_nor_uploads(
    bucket: str, split_folder: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
):
    """The local conversion stays in the cache; a rerun finds it and the URL's marker up to date: no upload.

    Once the URL holds something else, the same rerun uploads the kept conversion again, without converting.
    """
    url = f"{bucket}/again.lmdb"
    args = ["convert", str(split_folder), url, "--short-side", "48"]
    assert main(args) == 0
    first = json.loads(_remote_marker(url))
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        assert main(args) == 0
    assert f"{url} is up to date (" in capsys.readouterr().out
    assert not [r for r in _requests(caplog, url) if '"PUT ' in r or '"POST ' in r or '"DELETE ' in r]
    assert json.loads(_remote_marker(url)) == first

    other = f"{bucket}/other.lmdb"
    assert main(["convert", str(split_folder), other, "--short-side", "40"]) == 0
    import fsspec

    fs = fsspec.filesystem("s3")
    for name in ("data.mdb", "published.json"):  # another database's files under the first URL
        fs.pipe_file(f"{url.removeprefix('s3://')}/{name}", fs.cat_file(f"{other.removeprefix('s3://')}/{name}"))
    capsys.readouterr()
    assert main(args) == 0
    assert f"images); uploaded it to {url}." in capsys.readouterr().out
    again = json.loads(_remote_marker(url))
    assert again["id"] != first["id"]
    assert again["files"]["data.mdb"]["sha256"] == first["files"]["data.mdb"]["sha256"]


def test_converting_again_republishes_objects_that_no_longer_match_their_marker(
    bucket: str, split_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """A marker that still lists the same files does not vouch for objects changed or removed since: they go again."""
    import fsspec

    fs = fsspec.filesystem("s3")
    url = f"{bucket}/repair.lmdb"
    data = f"{url.removeprefix('s3://')}/data.mdb"
    args = ["convert", str(split_folder), url, "--short-side", "48", "--quiet"]
    assert main(args) == 0
    original = fs.cat_file(data)
    fs.pipe_file(data, bytes([original[0] ^ 0xFF]) + original[1:])  # same size, other bytes: a new ETag
    capsys.readouterr()
    assert main(args) == 0
    assert "uploaded it to" in capsys.readouterr().out
    assert fs.cat_file(data) == original
    fs.rm_file(data)
    assert main(args) == 0
    assert "uploaded it to" in capsys.readouterr().out
    staged = remote.stage(url, tmp_path / "cache", progress=False)
    assert (staged.path / "data.mdb").read_bytes() == original


def test_keep_original_or_force_to_a_url_leave_the_datamodules_slot_alone(bucket: str, split_folder: Path):
    """The DataModule never keeps originals: such a conversion, or a rebuild on demand, goes to a temporary folder."""
    from lightning_fastdata.store.cache import converted_path
    from lightning_fastdata.store.format import default_cache_dir

    slot = converted_path(split_folder.absolute(), default_cache_dir(), 44, 90, "jpeg")
    for extra in (["--keep-original"], ["--force"]):
        assert main(["convert", str(split_folder), f"{bucket}/k.lmdb", "--short-side", "44", "--quiet", *extra]) == 0
        assert not slot.exists()
    assert main(["convert", str(split_folder), f"{bucket}/k.lmdb", "--short-side", "44", "--quiet"]) == 0
    assert slot.is_dir()


def _remote_marker(url: str) -> bytes:
    import fsspec

    return fsspec.filesystem("s3").cat_file(f"{url.removeprefix('s3://')}/published.json")


@pytest.mark.parametrize(("cpus", "setting", "expected"), [(1, None, 4), (4, None, 8), (32, None, 10), (32, 3, 3)])
def test_staging_keeps_more_reads_in_flight_on_more_cores(
    monkeypatch: pytest.MonkeyPatch, cpus: int, setting: int | None, expected: int
):
    """Twice the usable CPUs, 4 to 10 (s3fs's connection pool), unless READ_THREADS is set."""
    monkeypatch.setattr(fetch, "usable_cpu_count", lambda: cpus)
    monkeypatch.setattr(remote, "READ_THREADS", setting)
    assert remote.read_threads() == expected


def test_a_server_sending_the_whole_objects_checksum_with_ranges_still_stages(
    published: str,
    database: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    range_checksum_endpoint: Callable[[bool], None],
):
    """botocore's FlexibleChecksumError on a range is read past once, said, and the SHA-256 checks the copy."""
    pytest.importorskip("botocore.httpchecksum")
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    range_checksum_endpoint(False)
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        staged = remote.stage(published, tmp_path / "cache", progress=False)
    assert staged.action == "staged"
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()
    warnings = [r.getMessage() for r in caplog.records if "whole object's checksum" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_ranges_read_past_a_wrong_checksum_are_checked_by_sha256(
    published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, range_checksum_endpoint: Callable[[bool], None]
):
    """When that server also alters the bytes, the SHA-256 check refuses the copy and nothing is published."""
    pytest.importorskip("botocore.httpchecksum")
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    range_checksum_endpoint(True)
    with pytest.raises(RemoteStorageError, match="does not match the SHA-256"):
        remote.stage(published, tmp_path / "cache", progress=False)
    assert remote.find_staged(published, tmp_path / "cache") is None


def _cut_off_after_five_ranges(monkeypatch: pytest.MonkeyPatch) -> Callable[..., bytes]:
    """8 KiB ranges read one at a time, the sixth failing as a dropped connection; returns the real reader."""
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    monkeypatch.setattr(remote, "READ_THREADS", 1)
    real, calls = replies._read_range, []

    def flaky(fs: Any, path: str, start: int, end: int) -> bytes:
        calls.append(start)
        if len(calls) > 5:
            raise ConnectionResetError("connection reset by peer")
        return real(fs, path, start, end)

    monkeypatch.setattr(replies, "_read_range", flaky)
    return real


def test_ranges_altered_before_an_interruption_are_found_by_sha256_and_fetched_again(
    published: str,
    database: Path,
    s3_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    range_checksum_endpoint: Callable[[bool], None],
):
    """Ranges a server altered past wrong checksums before an interruption: the resume hashes them, finds the copy
    wrong, says so and fetches the file again, whole, once; what is published is the publication's bytes."""
    pytest.importorskip("botocore.httpchecksum")
    real = _cut_off_after_five_ranges(monkeypatch)
    range_checksum_endpoint(True)
    with pytest.raises(RemoteStorageError, match="network failure"):
        remote.stage(published, tmp_path, progress=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # the resume reads from a server that alters nothing
    _fresh_clients()
    monkeypatch.setattr(replies, "_read_range", real)
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        staged = remote.stage(published, tmp_path, progress=False)
    assert staged.action == "staged"
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()
    assert "does not match the SHA-256 its published.json lists" in caplog.text
    assert "fetching it again" in caplog.text


def test_a_failed_staging_resumes_and_nothing_half_copied_is_read(
    published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """A staging cut off after 5 ranges publishes nothing; the next one fetches only the ranges left."""
    real = _cut_off_after_five_ranges(monkeypatch)
    with pytest.raises(RemoteStorageError, match=r"network failure while staging 's3://.*db.lmdb'.*resumes"):
        remote.stage(published, tmp_path, progress=False)
    target = remote.staged_path(published, tmp_path)
    assert not target.exists()
    dm = FastImageDataModule(published, cache_dir=str(tmp_path))
    with pytest.raises(RemoteStorageError, match="not staged yet"):
        dm.classes  # noqa: B018 - the property raises

    ranges = sum(-(-f["size"] // 8192) for f in json.loads(_marker(published))["files"].values())
    monkeypatch.setattr(replies, "_read_range", real)
    counted: list[int] = []
    monkeypatch.setattr(replies, "_read_range", lambda *a: counted.append(a[2]) or real(*a))
    with caplog.at_level(logging.INFO, logger=remote.__name__):
        result = remote.stage(published, tmp_path, progress=False)
    assert result.action == "staged"
    assert len(counted) == ranges - 5
    assert "resuming a staging interrupted" in caplog.text
    assert read_meta(target)["splits"]["train"]["length"] == 24


_STAGE_THEN_HANG = """
import sys, time
from pathlib import Path
from lightning_fastdata.store import remote
from lightning_fastdata.store.remote import replies
remote.RANGE_SIZE, remote.READ_THREADS = 8192, 1
real, calls = replies._read_range, []
def hang_after_five(*args):
    calls.append(1)
    if len(calls) > 5:
        time.sleep(600)  # killed here
    return real(*args)
replies._read_range = hang_after_five
remote.stage(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_killed_staging_resumes(published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A staging process killed (SIGKILL) after 5 ranges leaves no database; the next run fetches only the rest."""
    proc = subprocess.Popen([sys.executable, "-c", _STAGE_THEN_HANG, published, str(tmp_path)])
    progress = remote.partial_path(remote.staged_path(published, tmp_path)) / remote.PROGRESS_FILE
    try:
        for _ in range(1200):  # up to 2 minutes on a loaded machine
            state = json.loads(progress.read_text()) if progress.is_file() else {}
            if sum(len(v) for v in state.get("done", {}).values()) == 5:
                break
            assert proc.poll() is None, "the staging process ended before it was killed"
            threading.Event().wait(0.1)
        else:
            pytest.fail("the staging process never fetched 5 ranges")
    finally:
        proc.kill()
        proc.wait()
    assert not remote.staged_path(published, tmp_path).exists()
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    real = replies._read_range
    counted: list[int] = []
    monkeypatch.setattr(replies, "_read_range", lambda *a: counted.append(a[2]) or real(*a))
    assert remote.stage(published, tmp_path, progress=False).action == "staged"
    ranges = sum(-(-f["size"] // 8192) for f in json.loads(_marker(published))["files"].values())
    assert len(counted) == ranges - 5
    assert read_meta(remote.staged_path(published, tmp_path))["splits"]["train"]["length"] == 24


def _marker(url: str) -> bytes:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs.cat_file(f"{path}/{remote.MARKER}")


def test_a_changed_object_is_staged_again_and_says_why(
    published: str, plain_photo_database: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Publishing another database at the URL makes the next run stage it again, logging why."""
    first = remote.stage(published, tmp_path, progress=False)
    assert first.action == "staged"
    remote.publish(plain_photo_database, published, progress=False)
    dm = FastImageDataModule(published, cache_dir=str(tmp_path), num_workers=0)
    with caplog.at_level(logging.INFO):
        dm.prepare_data()
    assert dm.staging is not None
    assert dm.staging.action == "restaged"
    assert "was published again" in (dm.staging.reason or "")
    assert "was published again" in caplog.text
    assert dm.database_path == first.path
    assert read_meta(dm.database_path)["splits"]["train"]["length"] == 80


def test_an_unfinished_upload_is_refused(published: str, tmp_path: Path):
    """A database whose marker is missing (an upload under way or interrupted) is not staged, and says so."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(published)
    fs.rm_file(f"{path}/{remote.MARKER}")
    with pytest.raises(RemoteStorageError, match=r"holds data.mdb but no published.json.*upload is under way"):
        remote.stage(published, tmp_path, progress=False)
    assert not remote.staged_path(published, tmp_path).exists()


_PREPARE = """
import sys
from lightning_fastdata import FastImageDataModule
from lightning_fastdata.errors import ReadOnlyDestinationError
dm = FastImageDataModule(sys.argv[1], cache_dir=sys.argv[2])
try:
    dm.prepare_data()
except ReadOnlyDestinationError as err:
    print(err)
    sys.exit(3)
dm.setup("fit")
print(dm.staging.action)
"""


def test_a_read_only_cache_names_the_setting_and_still_reads_a_staged_copy(
    published: str, tmp_path: Path, read_only_python: Callable[..., subprocess.CompletedProcess]
):
    """A read-only `cache_dir` without the copy says to pass a writable one; holding the copy, it is read."""
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = read_only_python([cache], _PREPARE, published, str(cache))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"`cache_dir` '{cache}' is read-only" in proc.stdout
    assert "cannot be staged into it" in proc.stdout
    remote.stage(published, cache, progress=False)
    proc = read_only_python([cache], _PREPARE, published, str(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["reused"]


def test_a_missing_bucket_or_database_is_named(bucket: str, tmp_path: Path):
    """A bucket that does not exist and a prefix with no database each get their own one-line error."""
    with pytest.raises(RemoteStorageError, match=r"the bucket 'no-such-bucket-x' of 's3://no-such-bucket-x/db"):
        remote.stage("s3://no-such-bucket-x/db.lmdb", tmp_path, progress=False)
    with pytest.raises(RemoteStorageError, match=r"no database at 's3://.*/nothing.lmdb'.*convert SRC s3://"):
        remote.stage(f"{bucket}/nothing.lmdb", tmp_path, progress=False)


def test_missing_credentials_and_a_network_failure_are_named(
    published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """No credentials names the variables to set; an endpoint nobody answers names the endpoint setting."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    _fresh_clients()
    try:
        with pytest.raises(RemoteStorageError, match=r"no credentials found for 's3://.*'.*Set AWS_ACCESS_KEY_ID"):
            remote.stage(published, tmp_path, progress=False)
        monkeypatch.undo()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        _fresh_clients()
        with pytest.raises(RemoteStorageError, match=r"network failure while reading 's3://.*'.*AWS_ENDPOINT_URL"):
            remote.stage(published, tmp_path, progress=False)
    finally:
        monkeypatch.undo()
        _fresh_clients()
    assert not remote.staged_path(published, tmp_path).exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_publish_refuses_a_prefix_holding_other_objects(bucket: str, database: Path):
    """Publishing onto a prefix that holds other objects uploads nothing and names them."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{bucket.removeprefix('s3://')}/db.lmdb/notes.txt", b"mine")
    with pytest.raises(DestinationError, match=r"holds objects that are not a published database's \(notes.txt\)"):
        remote.publish(database, f"{bucket}/db.lmdb", progress=False)
    assert not fs.exists(f"{bucket.removeprefix('s3://')}/db.lmdb/data.mdb")


_STAGE_ONCE = """
import json, sys
from lightning_fastdata.store import remote
result = remote.stage(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"action": result.action, "path": str(result.path)}))
"""


def test_two_jobs_staging_into_one_cache_at_once_fetch_once(published: str, tmp_path: Path):
    """Two processes (two jobs on one node) staging one URL into one cache: one fetches, the other waits and reuses."""
    cmd = [sys.executable, "-c", _STAGE_ONCE, published, str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["action"] for r in results) == ["reused", "staged"]
    assert len({r["path"] for r in results}) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0]["path"]).name]


@pytest.fixture
def http_site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A plain ``http.server`` (no Range support, no listings used) serving a folder: ``(folder, base URL)``."""
    site = tmp_path / "site"
    site.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_database_over_plain_http_is_staged_from_its_marker(
    http_site: tuple[Path, str], database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Published with a file:// URL and served by http.server, it stages over HTTP, checked by SHA-256, and reused."""
    pytest.importorskip("aiohttp")
    site, base = http_site
    remote.publish(database, (site / "db.lmdb").as_uri(), progress=False)
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)  # ranges the server ignores: it sends whole files
    cache = tmp_path / "cache"
    first = remote.stage(f"{base}/db.lmdb", cache, progress=False)
    assert first.action == "staged"
    assert read_meta(first.path)["splits"]["train"]["length"] == 24
    assert (first.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()
    assert remote.stage(f"{base}/db.lmdb", cache, progress=False).action == "reused"


@pytest.mark.slow
def test_two_nodes_of_two_ranks_stage_once_per_node_and_cover_every_sample(published: str, tmp_path: Path) -> None:
    """2 launches (nodes) x 2 CPU DDP ranks, one cache per node: each node stages once, each epoch covers all once."""
    port = str(_free_port())
    procs = []
    for node in range(2):
        out = tmp_path / f"node{node}"
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        cmd = [sys.executable, str(SCRIPT), published, str(out / "cache"), str(out), "2"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, output[-4000:]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node*/rank*.json"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    for node in range(2):
        on_node = [r for r in records if r["node_rank"] == node]
        assert sorted(r["staging"] for r in on_node) == ["found", "staged"]
        assert len({r["database"] for r in on_node}) == 1
        assert [p.name for p in (tmp_path / f"node{node}" / "cache").glob("*.lmdb")] == [
            Path(on_node[0]["database"]).name
        ]
    for epoch in range(2):
        seen = sorted(i for r in records for i in r["epochs"][epoch])
        assert seen == list(range(24))


def test_cache_list_shows_a_staged_copys_url(published: str, tmp_path: Path, capsys: pytest.CaptureFixture):
    """`cache list` names the URL a staged copy came from, beside the folder it was converted from."""
    from lightning_fastdata.store.cache import list_conversions

    cache = tmp_path / "cache"
    remote.stage(published, cache, progress=False)
    (entry,) = list_conversions(cache)
    assert entry.staged_from == published
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    assert f"source {published} (staged; converted from " in capsys.readouterr().out


def test_the_stage_command_stages_ahead_of_training(published: str, tmp_path: Path, capsys: pytest.CaptureFixture):
    """`lightning-fastdata stage URL` stages where the DataModule looks, which then reuses it; a path is refused."""
    cache = tmp_path / "cache"
    assert main(["stage", published, "--cache-dir", str(cache), "--quiet"]) == 0
    assert f"{published}: staged at {remote.staged_path(published, cache)}" in capsys.readouterr().out
    assert main(["stage", published, "--cache-dir", str(cache), "--quiet"]) == 0
    assert f"{published}: already staged at" in capsys.readouterr().out
    dm = FastImageDataModule(published, cache_dir=str(cache), image_size=16, batch_size=4, num_workers=0)
    dm.prepare_data()
    assert dm.staging is not None
    assert dm.staging.action == "reused"
    assert main(["stage", str(tmp_path), "--cache-dir", str(cache)]) == 2
    assert "is not a URL" in capsys.readouterr().err
    assert main(["stage", published, "--cache-dir", "s3://bucket/cache"]) == 2
    assert "--cache-dir" in capsys.readouterr().err


def test_convert_clean_names_what_an_interrupted_staging_left(
    published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    """`convert --clean` removes a staging's working copy, calling it what it is."""
    _cut_off_after_five_ranges(monkeypatch)
    with pytest.raises(RemoteStorageError, match="network failure"):
        remote.stage(published, tmp_path, progress=False)
    work = remote.partial_path(remote.staged_path(published, tmp_path))
    assert work.is_dir()
    assert main(["convert", "--clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {work} (" in out
    assert "), left by an interrupted staging" in out
    assert not work.exists()


def test_the_cli_logs_its_own_lines_not_botos(published: str, tmp_path: Path):
    """`lightning-fastdata stage URL` says what it stages, without botocore's "Found credentials..." lines."""
    code = "import sys; from lightning_fastdata.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "stage", published, "--cache-dir", str(tmp_path), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"staging {published} into {remote.staged_path(published, tmp_path)}" in proc.stderr
    assert "Found credentials" not in proc.stderr
    assert "Found endpoint" not in proc.stderr


#: URLs with no user-info (and over HTTP no query): each is staged where it was before user-info and queries were cut
#: from names; fsspec reads ``?`` and ``#`` as part of the path but for http(s)
_PLAIN_URLS = (
    "s3://bucket/imagenet.lmdb",
    "gs://b/x/y.lmdb/",
    "https://host:8443/data/db.lmdb",
    "http://[::1]:9000/db.lmdb",
    "file:///d/db",
    "file:///data/run#1/db.lmdb",
    "file:///data/run#2/db.lmdb",
    "file:///data/run?x=1/db.lmdb",
    "file:///data/it's@home/db.lmdb",
    "s3://bucket/exp?a/db.lmdb",
    "s3://bucket/exp?b/db.lmdb",
    "az://container/runs#3/db.lmdb",
)


def test_a_plain_urls_cache_folder_keeps_its_name_and_secrets_never_make_one(tmp_path: Path):
    """Plain URLs, ``?`` and ``#`` in a file:// or s3:// path included, are staged where they always were, each in a
    folder of its own; user-info and an HTTP query (a signature) are no part of the name."""
    for url in _PLAIN_URLS:
        clean = url.rstrip("/")
        digest = hashlib.sha256(json.dumps(["remote", clean]).encode()).hexdigest()[:10]
        name = clean.rsplit("/", 1)[-1].removesuffix(".lmdb")
        assert remote.staged_path(url, tmp_path) == tmp_path / f"{name}-{digest}.lmdb", url
        assert remote.redact_url(url) == url
    assert len({remote.staged_path(url, tmp_path) for url in _PLAIN_URLS}) == len(_PLAIN_URLS)
    signed = "https://reader:pa%40ss@host:8443/data/db.lmdb?X-Amz-Signature=abc&X-Amz-Credential=AKIA#frag"
    assert remote.redact_url(signed) == "https://host:8443/data/db.lmdb"
    assert remote.staged_path(signed, tmp_path) == remote.staged_path("https://host:8443/data/db.lmdb", tmp_path)
    assert remote.redact_text("GET 'https://u:p@h/x?sig=1' failed, see s3://u:p@b/k?versionId=2.") == (
        "GET 'https://h/x' failed, see s3://b/k?versionId=2."
    )


def test_two_file_urls_that_differ_after_a_hash_sign_are_staged_apart(database: Path, tmp_path: Path):
    """``file://.../run#1/db.lmdb`` and ``.../run#2/db.lmdb`` (two folders to fsspec) stage into two copies: neither
    replaces the other, and each is found as its own."""
    urls = [(tmp_path / f"run#{k}" / "db.lmdb").as_uri().replace("%23", "#") for k in (1, 2)]
    for url in urls:
        remote.publish(database, url, progress=False)
    cache = tmp_path / "cache"
    first, second = (remote.stage(url, cache, progress=False) for url in urls)
    assert (first.action, second.action) == ("staged", "staged")
    assert first.path != second.path
    assert [remote.find_staged(url, cache) for url in urls] == [first.path, second.path]
    assert remote.stage(urls[0], cache, progress=False).action == "reused"
    marker = json.loads((tmp_path / "run#1" / "db.lmdb" / remote.MARKER).read_text())
    assert json.loads((first.path / remote.STAGED_RECORD).read_text())["marker"] == marker


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:pa'ss@host/db.lmdb", "https://host/db.lmdb"),
        ('https://user:p"w@host/db.lmdb', "https://host/db.lmdb"),
        ("s3://AKIAX:se'cret@bucket/db.lmdb", "s3://bucket/db.lmdb"),
        ("https://u:p@[::1]:8080/db?sig=1", "https://[::1]:8080/db"),
        ("https://u%40x:p%2F@host/db", "https://host/db"),
        ("https://a@b:c@host:1/a@b/db.lmdb", "https://host:1/a@b/db.lmdb"),
        ("https://host/it's/db.lmdb?X-Amz-Signature=SE'CRET", "https://host/it's/db.lmdb"),
        ("file://me:pw@/data/run#1/db.lmdb", "file:///data/run#1/db.lmdb"),
    ],
)
def test_user_info_with_quotes_or_brackets_is_cut_from_a_url_and_from_text(tmp_path: Path, url: str, shown: str):
    """User-info is all of the authority up to its last ``@`` whatever it holds (a quote, a ``"``), host, port and IPv6
    brackets stay; alone or in a line of text, the URL is shown without it, and names the folder it would."""
    assert remote.redact_url(url) == shown
    assert remote.staged_path(url, tmp_path) == remote.staged_path(shown, tmp_path)
    assert remote.redact_text(f"GET '{url}' failed: 403 ({url}).") == f"GET '{shown}' failed: 403 ({shown})."


def test_credentials_in_a_url_appear_in_no_error_log_progress_bar_record_or_name(
    http_site: tuple[Path, str],
    database: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture,
):
    """A URL with ``user:password@`` (and, where it fails, a signed query) stages with it, and every place that shows
    or records the URL (errors, logs, the progress bar, staged.json, `stage`, `cache list`, folder names) shows it
    without them."""
    pytest.importorskip("aiohttp")
    site, base = http_site
    remote.publish(database, (site / "db.lmdb").as_uri(), progress=False)
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    secret = base.replace("http://", "http://reader:s3cr3t-pw@") + "/db.lmdb"
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="lightning_fastdata"):
        staged = remote.stage(secret, cache, progress=True)
        assert main(["stage", secret, "--cache-dir", str(cache)]) == 0
        assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
        with pytest.raises(RemoteStorageError) as missing:
            remote.stage(secret.replace("db.lmdb", "none.lmdb?X-Amz-Signature=t0ken"), cache, progress=False)
        dm = FastImageDataModule(secret, cache_dir=str(cache / "other"), num_workers=0)
        with pytest.raises(RemoteStorageError) as not_staged:
            dm.classes  # noqa: B018 - the property raises
    out, err = capsys.readouterr()
    assert staged.action == "staged"
    assert staged.path == remote.staged_path(f"{base}/db.lmdb", cache)
    assert f"{base}/db.lmdb: already staged at" in out
    assert f"source {base}/db.lmdb (staged;" in out
    assert f"staging {base}/db.lmdb" in err  # the progress bar
    records = [(p / "staged.json").read_text() for p in cache.glob("*.lmdb")]
    shown = [out, err, caplog.text, str(missing.value), str(not_staged.value), *records, *os.listdir(cache)]
    assert [text for text in shown if "s3cr3t" in text or "reader" in text or "t0ken" in text] == []


def test_a_urls_secrets_stay_out_of_the_saved_hyperparameters(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """What the loggers log (``hparams_initial``) and checkpoints keep (``hparams``) holds ``data_dir`` without its
    user-info and query; the DataModule still reads the full URL, and a plain URL is saved as it is."""
    secret = "https://reader:s3cr3t-pw@127.0.0.1:9/data/db.lmdb?X-Amz-Signature=t0ken"
    with caplog.at_level(logging.INFO):
        dm = FastImageDataModule(secret, cache_dir=str(tmp_path), num_workers=0)
    assert dm.data_dir == secret
    assert dm.hparams["data_dir"] == dm.hparams_initial["data_dir"] == "https://127.0.0.1:9/data/db.lmdb"
    saved = f"{dict(dm.hparams)} {dict(dm.hparams_initial)} {caplog.text}"
    assert [word for word in ("s3cr3t", "t0ken", "reader") if word in saved] == []
    assert dm.hparams["batch_size"] == dm.batch_size  # the other arguments are saved as before
    plain = FastImageDataModule("s3://bucket/db.lmdb", cache_dir=str(tmp_path), num_workers=0)
    assert plain.hparams["data_dir"] == plain.hparams_initial["data_dir"] == "s3://bucket/db.lmdb"


# ---------------------------------------------------------------------------------------------------------------
# Data you did not make: what a bucket (its marker, its bytes) and the cache folder hold is checked before it is used
# ---------------------------------------------------------------------------------------------------------------


#: names a hostile marker lists beside data.mdb; `{outside}` is the folder the test watches, outside the cache
_HOSTILE_NAMES = [
    "{outside}/victim.txt",  # absolute: replaces the whole path
    "/{outside}/victim.txt",
    "../../outside/victim.txt",  # from the working copy .NAME.partial, out of the cache
    "../../../outside/victim.txt",
    "../outside-sibling.txt",
    "a/../../b",
    "data.mdb/../../../outside/victim.txt",
    "./data.mdb",
    "data.mdb/",
    "sub/data.mdb",
    "..",
    ".",
    "",
    "data.mdb\x00../../outside/victim.txt",  # a NUL byte
    "data.mdb\n",  # a line break: the error stays one line
    "x" * 5000,  # very long
    "../" * 300 + "outside/victim.txt",
    "d\u0430ta.mdb",  # a Cyrillic a
    "data\uff0emdb",  # a fullwidth dot
    "DATA.MDB",
    "data.mdb ",
    "progress.json",  # staging's own files: writing them would forge its state
    "staged.json",
    "published.json",
    "lock.mdb",
    "verified.json",
    "..\\..\\outside\\victim.txt",
    "~/victim.txt",
    "%2e%2e/%2e%2e/outside/victim.txt",
]


#: (field, value) of data.mdb's entry that a hostile marker sets: sizes and SHA-256 that are not ones
_HOSTILE_FIELDS = [
    ("size", -1),
    ("size", True),
    ("size", 2**70),
    ("size", "135168"),
    ("size", 1.5),
    ("size", None),
    ("sha256", "0" * 63),
    ("sha256", "Z" * 64),
    ("sha256", None),
    ("etag", 12),
]


def _tree(root: Path, skip: tuple[Path, ...]) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` but ``skip``: kind, size, mtime and SHA-256 of contents (a link: its target)."""
    found: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) not in skip]
        for name in [*dirs, *names]:
            path = Path(folder, name)
            st = path.lstat()
            if path.is_symlink():
                found[str(path)] = ("link", os.readlink(path))
            elif path.is_file():
                found[str(path)] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                found[str(path)] = ("other", st.st_mode, st.st_mtime_ns)
    return found


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    assert len(text) < 1000, text
    return text


@pytest.fixture
def hostile(
    request: pytest.FixtureRequest, bucket: str, database: Path, tmp_path: Path
) -> tuple[str, Callable[[dict[str, Any]], None]]:
    """The session database published on moto's S3 (``s3``) or a ``file://`` folder; and a way to replace its
    marker, uploading the report's bytes under each name it lists that is not published (what an attacker would)."""
    import fsspec

    url = f"{bucket}/db.lmdb" if request.param == "s3" else (tmp_path / "site" / "db.lmdb").as_uri()
    remote.publish(database, url, progress=False)
    fs, path = fsspec.core.url_to_fs(url)
    report = fs.cat_file(f"{path}/convert_report.json")

    def write(marker: dict[str, Any]) -> None:
        if request.param == "s3":  # file:// objects outside the site would be the watched files themselves
            for name in marker["files"]:
                if name not in remote.PUBLISHED_FILES:
                    with contextlib.suppress(Exception):
                        fs.pipe_file(f"{path}/{name}", report)
        fs.pipe_file(f"{path}/{remote.MARKER}", json.dumps(marker).encode())
        fs.invalidate_cache()

    return url, write


@pytest.mark.parametrize("hostile", ["s3", "file"], indirect=True)
def test_a_hostile_marker_or_a_planted_link_changes_nothing_outside_the_cache(
    hostile: tuple[str, Callable[[dict[str, Any]], None]], tmp_path: Path
):
    """29 file names, 11 sizes or checksums a marker may list and 5 links or folders planted in the cache: each is
    refused with one line before anything is written through it, and no file outside the cache is created or changed."""
    url, write_marker = hostile
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.txt").write_text("the victim's own bytes\n")
    (outside / "dir" / "keep.txt").write_text("keep me\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    watched = (cache, tmp_path / "site")
    before = _tree(tmp_path, watched)
    good = json.loads(_marker(url))
    report = good["files"]["convert_report.json"]
    tried = refused = 0
    for template in _HOSTILE_NAMES:
        name = template.replace("{outside}", str(outside))
        write_marker({**good, "files": {**good["files"], name: dict(report)}})
        tried += 1
        with pytest.raises(RemoteStorageError) as info:
            remote.stage(url, cache, progress=False)
        assert "nothing was fetched or written" in _one_line(info.value)
        assert ascii(name)[:50] in str(info.value)
        refused += 1
        assert not remote.partial_path(remote.staged_path(url, cache)).exists()
    for field, value in _HOSTILE_FIELDS:
        entry = {**good["files"]["data.mdb"], field: value}
        write_marker({**good, "files": {**good["files"], "data.mdb": entry}})
        tried += 1
        with pytest.raises(RemoteStorageError, match="is not a marker written by lightning_fastdata") as info:
            remote.stage(url, cache, progress=False)
        _one_line(info.value)
        refused += 1
    huge = {**good["files"]["data.mdb"], "size": 2**50}  # larger than the object, and than any disk
    write_marker({**good, "files": {**good["files"], "data.mdb": huge}})
    tried += 1
    with pytest.raises((RemoteStorageError, DestinationError)) as info:
        remote.stage(url, cache, progress=False)
    _one_line(info.value)
    refused += 1
    write_marker(good)

    target = remote.staged_path(url, cache)
    work, lock = remote.partial_path(target), lock_path(target)
    victim = outside / "victim.txt"
    planted: list[tuple[bool, Callable[[], Any]]] = [  # (inside a working copy resuming this publication, plant)
        (True, lambda: (work / "data.mdb").symlink_to(victim)),
        (True, lambda: (work / "convert_report.json").symlink_to(victim)),
        (True, lambda: (work / "data.mdb").mkdir()),
        (False, lambda: work.symlink_to(outside / "dir")),
        (False, lambda: lock.symlink_to(victim)),
    ]
    for resuming, plant in planted:
        if resuming:
            work.mkdir()
            progress = {"marker": good, "range_size": remote.RANGE_SIZE, "done": {}}
            (work / remote.PROGRESS_FILE).write_text(json.dumps(progress))
        plant()
        tried += 1
        with pytest.raises(DestinationError, match=r"is a symbolic link|is not a regular file") as info:
            remote.stage(url, cache, progress=False)
        assert "nothing was written through it" in _one_line(info.value)
        refused += 1
        for path in (work, lock):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
    after = _tree(tmp_path, watched)
    touched = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert (tried, refused, touched) == (len(_HOSTILE_NAMES) + len(_HOSTILE_FIELDS) + 1 + 5, tried, [])
    assert remote.stage(url, cache, progress=False).action == "staged"  # the cache is usable afterwards


def _damage(rng: random.Random, work: Path) -> str:
    """Damage the working copy an interrupted staging left, in one of six ways (or none); returns which."""
    progress, data = work / remote.PROGRESS_FILE, work / "data.mdb"
    state = json.loads(progress.read_text())
    done = state["done"].get("data.mdb", [])
    how = rng.choice(["none", "zeros over a done range", "a byte flipped", "all claimed done", "garbage", "cut short"])
    if how in ("zeros over a done range", "a byte flipped") and done:
        start = rng.choice(done)
        with open(data, "r+b") as fh:
            fh.seek(start)
            chunk = fh.read(remote.RANGE_SIZE)
            fh.seek(start)
            fh.write(bytes(len(chunk)) if how.startswith("zeros") else bytes([chunk[0] ^ 0xFF]) + chunk[1:])
    elif how == "all claimed done":  # progress.json says every range is there: most are holes
        size = state["marker"]["files"]["data.mdb"]["size"]
        state["done"]["data.mdb"] = list(range(0, size, remote.RANGE_SIZE))
        progress.write_text(json.dumps(state))
    elif how == "garbage":
        progress.write_text('{"marker": tru')
    elif how == "cut short":
        os.truncate(data, data.stat().st_size // 3)
    return how


@pytest.mark.parametrize("hostile", ["s3", "file"], indirect=True)
def test_stagings_cut_off_at_random_and_damaged_never_publish_a_wrong_copy(
    hostile: tuple[str, Callable[[dict[str, Any]], None]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    """20 stagings cut off after a random number of ranges (seeded), once or twice, the working copy damaged in some
    (zeros over done ranges, a flipped byte, progress.json claiming every range, garbage, a file cut short), then
    resumed: each publishes a copy with the marker's SHA-256."""
    url = hostile[0]
    monkeypatch.setattr(remote, "RANGE_SIZE", 16384)
    monkeypatch.setattr(remote, "READ_THREADS", 1)
    marker = json.loads(_marker(url))
    want = {name: info["sha256"] for name, info in marker["files"].items()}
    ranges = sum(-(-f["size"] // remote.RANGE_SIZE) for f in marker["files"].values())
    real = replies._read_range
    rng = random.Random(33)
    damaged: list[str] = []
    published: list[dict[str, str]] = []  # the SHA-256 of each copy staging published

    def stage(cache: Path) -> bool:
        """Stage into ``cache``; whether it published (an interrupted staging raises a network failure)."""
        try:
            staged = remote.stage(url, cache, progress=False, check=False)
        except RemoteStorageError as err:
            if "network failure" not in str(err):  # the cut, and nothing else
                raise
            damaged.append(_damage(rng, remote.partial_path(remote.staged_path(url, cache))))
            return False
        if staged.action == "staged":
            published.append({n: hashlib.sha256((staged.path / n).read_bytes()).hexdigest() for n in want})
        return True

    for trial in range(20):
        cache = tmp_path / f"cache{trial}"
        for _ in range(rng.choice([1, 1, 2])):
            calls, cut = [], rng.randrange(1, ranges)

            def flaky(*args: Any, calls: list[int] = calls, cut: int = cut) -> bytes:
                calls.append(1)
                if len(calls) > cut:
                    raise ConnectionResetError("connection reset by peer")
                return real(*args)

            monkeypatch.setattr(replies, "_read_range", flaky)
            if stage(cache):  # a resume that needed no more than `cut` reads
                break
        monkeypatch.setattr(replies, "_read_range", real)
        assert stage(cache)
    assert [sha256 for sha256 in published if sha256 != want] == []
    assert len(published) == 20
    assert len(damaged) >= 20
    assert len(set(damaged)) == 6, damaged  # every kind of damage was tried


# Mounts a tmpfs of SIZE on FOLDER in a private mount namespace, stages URL into it with the CLI, then prints the CLI's
# exit status and the bytes the cache holds (exit 97: the mount could not be made)
_SMALL_DISK = """
mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97
"$3" -c 'import sys; from lightning_fastdata.cli import main; sys.exit(main())' stage "$4" --cache-dir "$2" --quiet
echo "exit $?"
du -sb "$2"
"""


def _on_a_small_disk(script: str, size: str, folder: Path, url: str) -> subprocess.CompletedProcess[str]:
    """Run the shell ``script`` with the arguments SIZE FOLDER PYTHON URL in a private mount namespace (``unshare
    -rm``); skips the test where none can be made, or where the script could not mount its disk (exit 97)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unprivileged user and mount namespaces (`unshare -rm`) to mount a small disk")
    folder.mkdir()
    cmd = [unshare, "-rm", "sh", "-c", script, "sh", size, str(folder), sys.executable, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return proc


def test_staging_onto_a_disk_too_small_says_what_it_needs_in_one_line(published: str, tmp_path: Path):
    """A cache on a 64 KiB disk: `stage` fetches nothing and says, in one `error:` line, how much it needs and how
    much is free (no traceback)."""
    cache = tmp_path / "cache"
    proc = _on_a_small_disk(_SMALL_DISK, "64k", cache, published)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        rf"error: staging {published} needs 13\d\.\d KiB more on the disk of '{cache}', but \d+\.\d KiB is free there;"
        r" nothing more was fetched\. Free space there .*, or pass a `cache_dir` \(`--cache-dir`\) on a larger disk\.",
        lines[0],
    ), lines[0]
    assert "exit 2" in proc.stdout
    assert int(proc.stdout.split("\n")[1].split()[0]) < 8192  # the lock and progress.json: no data was written


def _chown_tree(root: Path, uid: int) -> None:
    for folder, _, names in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in names)]:
            os.chown(name, uid, uid)


_PLANTS = [
    "a link as the copy",
    "another user's copy",
    "a link as the copy moved aside",
    "another user's copy moved aside",
]


@pytest.mark.parametrize("plant", _PLANTS)
def test_a_staged_copy_planted_in_a_shared_cache_is_refused_never_read(
    published: str, database: Path, tmp_path: Path, plant: str
):
    """A copy of the current publication, 4 bytes altered, planted where staging keeps its copy (or the copy a
    publish moved aside, ``.NAME.old``) as a symbolic link or another user's folder: refused in one line before it is
    read, restored, removed or followed; once it is gone, staging fetches the publication."""
    if "user" in plant and os.geteuid() != 0:
        pytest.skip("making another user's folder needs root")
    copy = remote.stage(published, tmp_path / "elsewhere", progress=False).path
    with open(copy / "data.mdb", "r+b") as fh:
        fh.seek(30000)
        fh.write(b"EVIL")
    cache = tmp_path / "cache"
    cache.mkdir()
    target = remote.staged_path(published, cache)
    planted = cache / f".{target.name}.old" if plant.endswith("moved aside") else target
    if "link" in plant:
        planted.symlink_to(copy, target_is_directory=True)
    else:
        shutil.copytree(copy, planted)
        _chown_tree(planted, 4242)
    before = _tree(tmp_path, ())
    del before[str(cache)]  # its lock file comes and goes
    refused = r"is (a symbolic link|owned by another user \(uid 4242\)): a copy this user did not stage"
    with pytest.raises(DestinationError, match=refused) as info:
        remote.stage(published, cache, progress=False)
    assert "nothing was read, restored or removed through it" in _one_line(info.value)
    assert str(planted) in str(info.value)
    if planted == target:
        with pytest.raises(DestinationError, match=refused):
            remote.find_staged(published, cache)
    assert {name: found for name, found in _tree(tmp_path, ()).items() if name != str(cache)} == before
    if planted.is_symlink():
        planted.unlink()
    else:
        shutil.rmtree(planted)
    staged = remote.stage(published, cache, progress=False)
    assert staged.action == "staged"
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()


def test_a_staged_copy_is_reused_beside_another_users_lock_file_never_written(published: str, tmp_path: Path):
    """Another user's lock file beside this user's staged copy (in a shared cache): the copy of the current
    publication is reused without the lock; a new publication is one line naming the lock file and its owner. The
    lock file is never written."""
    import fsspec

    if os.geteuid() != 0:
        pytest.skip("making another user's file needs root")
    first = remote.stage(published, tmp_path, progress=False)
    lock = lock_path(first.path)
    lock.write_text('{"pid": 1, "host": "their-node"}')
    os.chown(lock, 4242, 4242)
    assert remote.stage(published, tmp_path, progress=False).action == "reused"
    assert remote.find_staged(published, tmp_path) == first.path
    fs, path = fsspec.core.url_to_fs(published)
    marker = {**json.loads(_marker(published)), "id": "a-new-publication"}  # to be staged: not without the lock
    fs.pipe_file(f"{path}/{remote.MARKER}", json.dumps(marker).encode())
    with pytest.raises(DestinationError, match=r"its lock file '.*' belongs to another user \(uid 4242\)") as info:
        remote.stage(published, tmp_path, progress=False)
    assert str(lock) in _one_line(info.value)
    assert lock.read_text() == '{"pid": 1, "host": "their-node"}'
    assert os.stat(lock).st_uid == 4242


# Stages URL into a cache on a tmpfs of SIZE in a private mount namespace, range 16384 of data.mdb altered on its first
# read (so data.mdb is fetched again after its SHA-256 did not match); prints what staging did (exit 97: no mount)
_REFETCH_ON_A_SMALL_DISK = """
mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97
"$3" - "$4" "$2" <<'END'
import sys
from lightning_fastdata.store import remote
from lightning_fastdata.store.remote import replies
remote.RANGE_SIZE, real, seen = 16384, replies._read_range, []
def altered_once(fs, path, start, end):
    data = real(fs, path, start, end)
    if path.endswith("data.mdb") and start == 16384 and not seen:
        seen.append(start)
        data = bytes([data[0] ^ 1]) + data[1:]
    return data
replies._read_range = altered_once
try:
    print("action", remote.stage(sys.argv[1], sys.argv[2], progress=False, check=False).action)
except Exception as err:
    print(type(err).__name__, err)
END
"""


def test_fetching_a_file_again_counts_the_space_it_already_holds(database: Path, tmp_path: Path):
    """A cache on a 200 KiB disk holding the 132 KiB data.mdb whose SHA-256 did not match: fetching it again overwrites
    its blocks, so it needs no more space, and staging publishes the publication's bytes."""
    url = (tmp_path / "site" / "db.lmdb").as_uri()
    remote.publish(database, url, progress=False)
    proc = _on_a_small_disk(_REFETCH_ON_A_SMALL_DISK, "200k", tmp_path / "cache", url)
    assert proc.stdout.strip() == "action staged", proc.stdout + proc.stderr
    assert "does not match the SHA-256" in proc.stderr


def test_a_file_whose_sha256_did_not_match_is_fetched_again_by_the_next_run_too(
    published: str, database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A staging stopped after data.mdb did not match its SHA-256, before fetching it again (the disk was full), has
    already dropped its ranges from progress.json: the next run fetches them all, not trusting the damaged copy."""
    monkeypatch.setattr(remote, "RANGE_SIZE", 16384)
    real, check = replies._read_range, fetch._check_free_space
    checks: list[int] = []

    def altered(fs: Any, path: str, start: int, end: int) -> bytes:
        data = real(fs, path, start, end)
        return bytes([data[0] ^ 1]) + data[1:] if path.endswith("data.mdb") and start == 16384 else data

    def full_the_second_time(work: Path, shown: str, needed: int) -> None:
        checks.append(needed)
        if len(checks) == 2:
            raise DestinationError("the disk filled up meanwhile")
        check(work, shown, needed)

    monkeypatch.setattr(replies, "_read_range", altered)
    monkeypatch.setattr(fetch, "_check_free_space", full_the_second_time)
    with pytest.raises(DestinationError, match="filled up"):
        remote.stage(published, tmp_path, progress=False)
    work = remote.partial_path(remote.staged_path(published, tmp_path))
    assert json.loads((work / remote.PROGRESS_FILE).read_text())["done"].get("data.mdb", []) == []
    fetched: list[int] = []
    monkeypatch.setattr(replies, "_read_range", lambda *a: fetched.append(a[2]) or real(*a))
    staged = remote.stage(published, tmp_path, progress=False)
    assert staged.action == "staged"
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()
    assert sorted(fetched) == list(range(0, (database / "data.mdb").stat().st_size, 16384))


def test_a_staged_copy_that_no_longer_opens_is_staged_again_once_and_said(
    published: str, database: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A staged copy damaged since (its LMDB meta pages zeroed) is thrown away and staged again, with a warning."""
    first = remote.stage(published, tmp_path, progress=False)
    data = first.path / "data.mdb"
    damaged = tmp_path / "damaged"
    damaged.write_bytes(bytes(8192) + data.read_bytes()[8192:])
    os.replace(damaged, data)  # a new file: no environment this process opened holds it
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        again = remote.stage(published, tmp_path, progress=False)
    assert again.action == "restaged"
    assert again.path == first.path
    assert "does not open" in (again.reason or "")
    assert "staging it again" in caplog.text
    assert data.read_bytes() == (database / "data.mdb").read_bytes()
    assert remote.stage(published, tmp_path, progress=False).action == "reused"


def test_a_publication_that_matches_its_marker_but_does_not_open_is_refused(
    bucket: str, database: Path, tmp_path: Path
):
    """A database published damaged (its SHA-256 is the marker's) is refused in one line, and not left in the cache."""
    broken = tmp_path / "broken.lmdb"
    shutil.copytree(database, broken)
    data = broken / "data.mdb"
    data.write_bytes(bytes(8192) + data.read_bytes()[8192:])
    url = f"{bucket}/broken.lmdb"
    remote.publish(broken, url, progress=False)
    cache = tmp_path / "cache"
    with pytest.raises(RemoteStorageError, match=r"is damaged: its files have the SHA-256 .* do not open") as info:
        remote.stage(url, cache, progress=False)
    _one_line(info.value)
    assert not remote.staged_path(url, cache).exists()


def test_a_range_counts_as_done_only_once_its_bytes_are_on_disk(
    published: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """progress.json lists a range only after its file was synced since the range was written; the copy and its
    record are synced before the rename that publishes it, and the rename is synced."""
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    monkeypatch.setattr(remote, "SYNC_SECONDS", 0.0, raising=False)  # a record after every range
    events: list[tuple[Any, ...]] = []
    real_pwrite, real_datasync, real_fsync = os.pwrite, os.fdatasync, os.fsync
    real_write, real_publish = ondisk.write_json, ondisk.move_into_place

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        events.append(("write", os.readlink(f"/proc/self/fd/{fd}"), offset))
        return real_pwrite(fd, data, offset)

    def sync(fd: int, real: Callable[[int], None]) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("sync folder" if os.path.isdir(path) else "sync", path))
        real(fd)

    def record(path: Path, value: dict[str, Any]) -> None:
        events.append(("record", path.name, json.loads(json.dumps(value))))
        real_write(path, value)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", lambda fd: sync(fd, real_datasync))
    monkeypatch.setattr(os, "fsync", lambda fd: sync(fd, real_fsync))
    monkeypatch.setattr(staging, "write_json", record)
    monkeypatch.setattr(fetch, "write_json", record)
    monkeypatch.setattr(
        staging, "move_into_place", lambda tmp, dst: events.append(("publish",)) or real_publish(tmp, dst)
    )
    staged = remote.stage(published, tmp_path, progress=False)
    work = remote.partial_path(staged.path)
    checked = 0
    for i, event in enumerate(events):
        if event[:2] != ("record", remote.PROGRESS_FILE):
            continue
        for name, starts in event[2]["done"].items():
            path = str(work / name)
            for start in starts:
                written = max(j for j, e in enumerate(events[:i]) if e == ("write", path, start))
                assert ("sync", path) in events[written:i], (name, start)
                checked += 1
    assert checked >= 17  # every range of data.mdb, at least once
    publish = events.index(("publish",))
    last_write = max(j for j, e in enumerate(events) if e[0] == "write")
    synced = {e[1] for e in events[last_write:publish] if e[0] == "sync"}
    assert synced >= {str(work / "data.mdb"), str(work / "convert_report.json")}
    assert ("record", remote.STAGED_RECORD) in [e[:2] for e in events[last_write:publish]]
    assert ("sync folder", str(work)) in events[last_write:publish]
    assert ("sync folder", str(tmp_path)) in events[publish:]


# ---------------------------------------------------------------------------------------------------------------
# A server that ignores ranges, or answers them out of turn: what is hashed is what is published
# ---------------------------------------------------------------------------------------------------------------

#: what a scripted server sends for a GET of ``(file, range start or None, range end or None)``: (status, body)
_Answer = Callable[[Path, "int | None", "int | None"], tuple[int, bytes]]


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """Serves the files under ``site`` as ``answer`` says; a 206 is sent with its Content-Range."""

    site: Path
    answer: _Answer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        path = self.site / self.path.lstrip("/")
        self.send_response(200 if path.is_file() else 404)
        self.send_header("Content-Length", str(path.stat().st_size if path.is_file() else 0))
        self.end_headers()

    def do_GET(self) -> None:
        path = self.site / self.path.lstrip("/")
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        asked = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        start, end = (int(asked[1]), int(asked[2]) + 1) if asked else (None, None)
        status, body = self.answer(path, start, end)
        self.send_response(status)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{path.stat().st_size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        view = memoryview(body)  # sent in slices: the server allocates nothing per reply
        with contextlib.suppress(ConnectionError):  # a client that stopped reading
            for at in range(0, len(view), 2**16):
                self.wfile.write(view[at : at + 2**16])


def _honest(path: Path, start: int | None, end: int | None) -> tuple[int, bytes]:
    data = path.read_bytes()
    return (200, data) if start is None else (206, data[start:end])


@pytest.fixture
def scripted_site(tmp_path: Path, database: Path) -> Iterator[tuple[Path, str, Callable[[_Answer], None]]]:
    """The session database published under a folder served over HTTP as a test scripts it: ``(the database's
    published folder, its URL, a way to set the answer)``; honest until set."""
    site = tmp_path / "site"
    remote.publish(database, (site / "db.lmdb").as_uri(), progress=False)
    handler = type("Handler", (_ScriptedHandler,), {"site": site, "answer": staticmethod(_honest)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()

    def script(answer: _Answer) -> None:
        handler.answer = staticmethod(answer)

    yield site / "db.lmdb", f"http://127.0.0.1:{server.server_address[1]}/db.lmdb", script
    server.shutdown()
    server.server_close()


def _when_hashed(monkeypatch: pytest.MonkeyPatch, size: int, offset: int) -> threading.Event:
    """An event set once staging has hashed a file of ``size`` bytes up to ``offset``."""
    hashed, real = threading.Event(), fetch._FileHash.advance

    def advance(self: Any, done: set[int]) -> None:
        real(self, done)
        if self.size == size and self.offset >= offset:
            hashed.set()

    monkeypatch.setattr(fetch._FileHash, "advance", advance)
    return hashed


@pytest.mark.parametrize("late", ["a whole file altered after range 0 was hashed", "ranges after the whole file"])
def test_what_a_server_ignoring_ranges_sends_late_is_never_published(
    scripted_site: tuple[Path, str, Callable[[_Answer], None]],
    database: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    late: str,
):
    """A server that answers range 0 honestly, then sends the whole file with range 0 altered once range 0 is
    hashed; or that sends the whole file for one range and answers the ranges in flight, altered, once it is all
    hashed: each range is written once, from the first reply that brings it, so the copy is the publication's."""
    pytest.importorskip("aiohttp")
    published, url, script = scripted_site
    monkeypatch.setattr(remote, "RANGE_SIZE", 8192)
    monkeypatch.setattr(remote, "READ_THREADS", 4)
    good = (published / "data.mdb").read_bytes()
    if late.startswith("a whole file"):
        hashed = _when_hashed(monkeypatch, len(good), 8192)
        altered = bytes(b ^ 0xFF for b in good[:8192]) + good[8192:]
    else:
        hashed = _when_hashed(monkeypatch, len(good), len(good))
        altered = bytes(b ^ 0xFF for b in good)

    def answer(path: Path, start: int | None, end: int | None) -> tuple[int, bytes]:
        if path.name != "data.mdb" or start is None:
            return _honest(path, start, end)
        if late.startswith("a whole file"):
            if start == 0:
                return 206, good[:end]
            hashed.wait(10)
            return 200, altered
        if start == 8192:
            return 200, good
        hashed.wait(10)
        return 206, altered[start:end]

    script(answer)
    staged = remote.stage(url, tmp_path / "cache", progress=False, check=False)
    assert staged.action == "staged"
    assert hashed.is_set()
    assert hashlib.sha256((staged.path / "data.mdb").read_bytes()).hexdigest() == hashlib.sha256(good).hexdigest()
    assert (staged.path / "data.mdb").read_bytes() == (database / "data.mdb").read_bytes()


@contextlib.contextmanager
def _peak_memory() -> Iterator[list[int]]:
    """The most bytes Python allocated at once while the block ran, beyond what it held before (tracemalloc)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("reply", ["the whole file for every range", "a range longer than asked"])
def test_a_server_ignoring_ranges_costs_a_few_ranges_of_memory_not_the_file(
    scripted_site: tuple[Path, str, Callable[[_Answer], None]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reply: str,
):
    """A 32 MiB file sent whole for every ranged read of 256 KiB is staged one range at a time, with no read issued
    after the first whole reply and the others closed unread; a reply longer than its range is refused unread. Python
    holds under half the file at once (tracemalloc: a range per read, and what aiohttp buffers of each reply before it
    is closed: 2-7 MiB here, 9.6 MiB once on a loaded machine), where reading each reply whole held the file several
    times over."""
    pytest.importorskip("aiohttp")
    published, url, script = scripted_site
    remote.stage(url, tmp_path / "warm", progress=False)  # imports and the HTTP session: allocated before the count
    monkeypatch.setattr(remote, "RANGE_SIZE", 2**18)
    monkeypatch.setattr(remote, "READ_THREADS", 4)
    data = random.Random(9).randbytes(2**25)
    (published / "data.mdb").write_bytes(data)
    marker = {"files": {"data.mdb": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}, "id": "big"}
    (published / remote.MARKER).write_text(json.dumps(marker))
    longer = data + b"!"  # a 206 for any range: longer than the range, and than the file
    reads: list[int | None] = []

    def answer(path: Path, start: int | None, end: int | None) -> tuple[int, bytes]:
        if path.name != "data.mdb":
            return _honest(path, start, end)
        reads.append(start)
        return (200, data) if reply.startswith("the whole") else (206, longer)

    script(answer)
    with _peak_memory() as peak:
        if reply.startswith("the whole"):
            staged = remote.stage(url, tmp_path / "cache", progress=False, check=False)
        else:
            with pytest.raises(
                RemoteStorageError, match=r"bytes \d+-\d+ of data.mdb with more than 262144 bytes: noth"
            ):
                remote.stage(url, tmp_path / "cache", progress=False, check=False)
    assert peak[0] < len(data) // 2, peak
    if reply.startswith("the whole"):
        assert (staged.path / "data.mdb").read_bytes() == data
        assert len(reads) <= remote.read_threads(), reads


def test_a_marker_larger_than_1_mib_is_refused_unread(
    scripted_site: tuple[Path, str, Callable[[_Answer], None]], tmp_path: Path
):
    """A server sending 32 MiB for published.json (whatever the range asked) is refused in one line, having read
    1 MiB: Python holds under 8 MiB at once (tracemalloc)."""
    pytest.importorskip("aiohttp")
    _, url, script = scripted_site
    remote.stage(url, tmp_path / "warm", progress=False)  # imports and the HTTP session: allocated before the count
    huge = b" " * 2**25
    script(lambda path, start, end: (200, huge) if path.name == remote.MARKER else _honest(path, start, end))
    with _peak_memory() as peak, pytest.raises(RemoteStorageError, match=r"larger than 1048576 bytes") as info:
        remote.stage(url, tmp_path / "cache", progress=False)
    assert "nothing was fetched" in _one_line(info.value)
    assert peak[0] < 2**23, peak


def test_a_marker_nested_too_deep_is_refused_in_one_line(tmp_path: Path):
    """A published.json of 100,000 nested arrays is refused as not a marker, in one line, not a RecursionError."""
    site = tmp_path / "site" / "db.lmdb"
    site.mkdir(parents=True)
    (site / remote.MARKER).write_text("[" * 100_000 + "]" * 100_000)
    nested = r"is not a marker written by .* \(its arrays and objects nest too deeply to parse\)"
    with pytest.raises(RemoteStorageError, match=nested) as info:
        remote.stage(site.as_uri(), tmp_path / "cache", progress=False)
    assert "nothing was fetched" in _one_line(info.value)
