"""Shared fixtures: a small generated image folder with train/val splits and its converted database, a private
cache folder for the whole session, and a way to run Python with folders on a read-only file system.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fastdata import convert, make_image_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run on a real GPU only: skipped, with the reason, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make test-gpu` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker: a parameter id "cuda" is a keyword too
            item.add_marker(skip)


#: The session database downscales to this short side: the source images (40-80 px) straddle it, so the
#: database holds both untouched small JPEGs and downscaled, re-encoded ones.
SESSION_SHORT_SIDE = 64


@pytest.fixture(scope="session")
def split_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only (by convention) generated folder ``src/{train,val}/class_<k>/<n>.jpg``: 3 classes, 8 + 3 each."""
    root = tmp_path_factory.mktemp("split_folder") / "src"
    return make_image_folder(
        root, num_classes=3, train_per_class=8, val_per_class=3, min_size=40, max_size=80, seed=0, num_workers=1
    )


@pytest.fixture(scope="session")
def database(split_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's database of ``split_folder``; tests must not modify it (use ``database_copy``)."""
    dst = tmp_path_factory.mktemp("database") / "db.lmdb"
    summary = convert(split_folder, dst, short_side=SESSION_SHORT_SIDE, num_workers=2, progress=False)
    assert not summary.skipped
    return dst


@pytest.fixture(scope="session")
def make_database(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A factory for a module's own database: ``make_database(name, short_side=256, convert_workers=0, **folder)``.

    Generates an image folder (``make_image_folder(**folder)``, one worker by default) in ``<tmp>/<name>/src`` and
    converts it to ``<tmp>/<name>/db.lmdb``, which it returns; the source folder is ``db.parent / "src"``.
    """

    def make(name: str, short_side: int | None = 256, convert_workers: int | None = 0, **folder: Any) -> Path:
        root = tmp_path_factory.mktemp(name)
        src = make_image_folder(root / "src", **{"num_workers": 1, **folder})
        db = root / "db.lmdb"
        summary = convert(src, db, short_side=short_side, num_workers=convert_workers, progress=False)
        assert not summary.skipped
        return db

    return make


@pytest.fixture(scope="session")
def plain_photo_database(make_database: Callable[..., Path]) -> Path:
    """A plain ImageFolder (no splits) of 2 classes x 40 JPEGs, 64-160 px, converted at short side 96; its source
    folder is ``plain_photo_database.parent / "src"``. Read-only by convention."""
    return make_database(
        "plain_photo", short_side=96, num_classes=2, train_per_class=40, val_per_class=0, min_size=64, max_size=160,
        num_workers=None,
    )  # fmt: skip


@pytest.fixture
def database_copy(database: Path, tmp_path: Path) -> Path:
    """A private copy of the session database that a test may modify."""
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(database, dst)
    return dst


@pytest.fixture
def split_folder_copy(split_folder: Path, tmp_path: Path) -> Path:
    """A private copy of the session image folder (timestamps kept) that a test may modify."""
    dst = tmp_path / "src"
    shutil.copytree(split_folder, dst)
    return dst


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``$LIGHTNING_FASTDATA_CACHE`` in a temporary folder: nothing lands in, or is read from, the user's cache."""
    cache = tmp_path_factory.mktemp("user_cache")
    previous = os.environ.get("LIGHTNING_FASTDATA_CACHE")
    os.environ["LIGHTNING_FASTDATA_CACHE"] = str(cache)
    yield
    if previous is None:
        os.environ.pop("LIGHTNING_FASTDATA_CACHE", None)
    else:
        os.environ["LIGHTNING_FASTDATA_CACHE"] = previous


# Mounts each folder read-only in a private mount namespace, then runs the command: writes there fail with EROFS, as
# on a read-only file system, for this process tree only (exit 97: the mounts could not be made)
_READ_ONLY_SHELL = """
n=$1; shift
while [ "$n" -gt 0 ]; do
    mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" || exit 97
    shift; n=$((n - 1))
done
exec "$@"
"""


@pytest.fixture(scope="session")
def read_only_python() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``python -c CODE ARGS...`` with the given folders on a read-only file system (skips where impossible).

    Uses an unprivileged user and mount namespace (``unshare -rm``), so it works without root and changes nothing
    outside the child.
    """
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unprivileged user and mount namespaces (`unshare -rm`) to make a read-only file system")

    def run(
        read_only: Sequence[Path], code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        folders = [str(Path(p).absolute()) for p in read_only]
        cmd = [unshare, "-rm", "sh", "-c", _READ_ONLY_SHELL, "sh", str(len(folders)), *folders]
        cmd += [sys.executable, "-c", code, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode == 97:
            pytest.skip(f"cannot mount folders read-only here: {proc.stderr.strip()}")
        return proc

    return run
