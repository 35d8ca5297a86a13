"""Files planted where the writer and the cache keep their own (issue 43, "Secrets and planted files").

Each test plants, in its own temporary folder, what another program or user could leave under a name this package
writes, locks, renames or reads: a hard link or a symbolic link to a victim file, a file where a folder goes, a link
to a database, a conversion report of the wrong shapes. Each asserts that the victim is byte-identical afterwards and
that the package either says in one line what it found and how to fix it, or carries on around it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_fastdata import FastImageDataModule, convert, make_image_folder, read_meta
from lightning_fastdata.cli import main
from lightning_fastdata.errors import DestinationError
from lightning_fastdata.store import cachedir, inventory, writer
from lightning_fastdata.store.cache import conversion_meta, list_conversions, record_use, remove_conversion, use_path
from lightning_fastdata.store.format import REPORT_FILE, VERIFIED_FILE, lock_path, partial_path

#: what a victim file holds: any change to it is a write through a planted name
VICTIM = b"the victim's own bytes\n"
#: the records of the tiny source folder
IMAGES = 6


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source folder of 6 small JPEGs: 2 classes, 2 training and 1 validation image each."""
    root = tmp_path_factory.mktemp("tiny") / "src"
    return make_image_folder(
        root, num_classes=2, train_per_class=2, val_per_class=1, min_size=20, max_size=30, seed=0, num_workers=1
    )


@pytest.fixture(scope="module")
def tiny_database(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The database of ``tiny_folder``; tests must not modify it (links planted to it must leave it as it is)."""
    dst = tmp_path_factory.mktemp("tiny_database") / "db.lmdb"
    _convert(tiny_folder, dst)
    return dst


def _convert(source: Path, dst: Path, **kwargs: Any) -> Any:
    return convert(source, dst, num_workers=0, progress=False, **kwargs)


def _victim(folder: Path) -> Path:
    """A file outside anything this package writes, holding :data:`VICTIM`."""
    victim = folder / "victim.txt"
    victim.write_bytes(VICTIM)
    return victim


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: equal before and after means nothing there was written.

    But ``verified.json``, which a read of a database writes beside it (its pages were walked).
    """
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != VERIFIED_FILE)
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------------------------------------------------
# Hard links and symbolic links where the writer writes a file
# ---------------------------------------------------------------------------------------------------------------


def test_a_hard_linked_lock_file_is_refused_and_its_other_name_never_written(tiny_folder: Path, tmp_path: Path):
    """``ln victim .DST.lock``: the conversion stops in one line naming the lock file as a hard link; the victim
    (the same file under another name) keeps its bytes. Once the link is removed, the conversion runs."""
    victim = _victim(tmp_path)
    dst = tmp_path / "out" / "db.lmdb"
    dst.parent.mkdir()
    lock = lock_path(dst)
    os.link(victim, lock)
    with pytest.raises(DestinationError, match=r"is a hard link \(2 links\), where this package writes its own file"):
        _convert(tiny_folder, dst)
    with pytest.raises(DestinationError) as info:
        _convert(tiny_folder, dst)
    assert f"{str(lock)!r} is a hard link" in _one_line(info.value)
    assert "nothing was written through it. Remove it" in str(info.value)
    assert victim.read_bytes() == VICTIM
    assert not os.path.lexists(dst)
    lock.unlink()
    assert _convert(tiny_folder, dst).written == IMAGES
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("plant", ["data.mdb as a hard link", "lock.mdb as a symbolic link"])
def test_lmdb_never_opens_a_file_planted_in_the_working_copy(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str
):
    """A file planted in ``.DST.partial`` after the conversion made it, before LMDB opens its files there (another
    process, as the encoding pool starts): LMDB, which follows links, never opens it; one line names it."""
    victim = _victim(tmp_path)
    dst = tmp_path / "db.lmdb"
    name = plant.split()[0]
    real = writer.encode_all

    @contextlib.contextmanager
    def planting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        planted = partial_path(dst) / name
        if "hard" in plant:
            os.link(victim, planted)
        else:
            planted.symlink_to(victim)
        with real(*args, **kwargs) as encoded:
            yield encoded

    monkeypatch.setattr(writer, "encode_all", planting)
    what = r"a hard link \(2 links\)" if "hard" in plant else "a symbolic link"
    with pytest.raises(DestinationError, match=rf"{name}' is {what}, where this package writes its own file") as info:
        _convert(tiny_folder, dst)
    _one_line(info.value)
    assert victim.read_bytes() == VICTIM
    assert not os.path.lexists(dst)
    assert not os.path.lexists(partial_path(dst))  # the working copy is removed: the link with it, not the victim


def test_staging_refuses_a_hard_linked_lock_file_or_data_file(tiny_database: Path, tmp_path: Path):
    """Staging from a ``file://`` URL: a hard link as the staged copy's lock file, or as ``data.mdb`` in a working
    copy that resumes this publication, is refused in one line; the victim keeps its bytes; once removed, staging
    fetches the publication."""
    pytest.importorskip("fsspec")
    from lightning_fastdata.store import remote

    site = tmp_path / "site" / "db.lmdb"
    url = site.as_uri()
    remote.publish(tiny_database, url, progress=False)
    cache = tmp_path / "cache"
    cache.mkdir()
    victim = _victim(tmp_path)
    target = remote.staged_path(url, cache)
    lock = lock_path(target)
    os.link(victim, lock)
    with pytest.raises(DestinationError, match=r"is a hard link \(2 links\)") as info:
        remote.stage(url, cache, progress=False)
    assert str(lock) in _one_line(info.value)
    lock.unlink()
    work = partial_path(target)
    work.mkdir()
    marker = json.loads((site / remote.MARKER).read_text())
    progress = {"marker": marker, "range_size": remote.RANGE_SIZE, "done": {}}
    (work / remote.PROGRESS_FILE).write_text(json.dumps(progress))
    os.link(victim, work / "data.mdb")
    with pytest.raises(DestinationError, match=r"data.mdb' is a hard link \(2 links\)") as info:
        remote.stage(url, cache, progress=False)
    assert "nothing was written through it" in _one_line(info.value)
    assert victim.read_bytes() == VICTIM
    (work / "data.mdb").unlink()
    assert remote.stage(url, cache, progress=False).action == "staged"
    assert victim.read_bytes() == VICTIM


# ---------------------------------------------------------------------------------------------------------------
# The use file, the working copy and the database moved aside
# ---------------------------------------------------------------------------------------------------------------


def test_a_dangling_link_as_the_use_file_makes_no_file_outside_the_cache(
    tiny_folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """``.NAME.used`` a link to a file that does not exist: ``setup`` reads the database but creates nothing where
    the link points, and says why the last use is not recorded; ``cache list`` works, and ``cache remove`` refuses
    (whether a process reads the database cannot be known) rather than lock through the link."""
    cache = tmp_path / "cache"
    dm = FastImageDataModule(str(tiny_folder), cache_dir=str(cache), short_side=None, image_size=16, num_workers=0)
    dm.prepare_data()
    used = use_path(dm.database_path)
    elsewhere = tmp_path / "outside" / "made.txt"
    elsewhere.parent.mkdir()
    used.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="lightning_fastdata.store.cache"):
        dm.setup("fit")
    assert not elsewhere.exists()
    assert f"{str(used)!r} is a symbolic link" in caplog.text
    assert dm.train_dataset is not None
    (conversion,) = list_conversions(cache)
    assert (conversion.state, conversion.in_use) == ("complete", False)
    with pytest.raises(DestinationError, match="is a symbolic link, where this package writes its own file") as info:
        remove_conversion(dm.database_path.name, cache)
    _one_line(info.value)
    assert (dm.database_path / "data.mdb").is_file()
    assert not elsewhere.exists()
    assert used.is_symlink()


@pytest.mark.parametrize("link", ["symbolic", "hard", "another user's"])
def test_a_link_to_a_victim_as_the_use_file_is_never_written_or_touched(
    tiny_database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, link: str
):
    """``.NAME.used`` a symbolic or hard link to an existing file, or another user's file (a cache shared by users):
    recording a use neither writes it nor changes its modification time, nor holds a lock on it."""
    cache = tmp_path / "cache"
    database = cache / "db.lmdb"
    shutil.copytree(tiny_database, database)
    victim = _victim(tmp_path)
    used = use_path(database)
    if link == "hard":
        os.link(victim, used)
    elif link == "symbolic":
        used.symlink_to(victim)
    else:
        victim = used
        victim.write_bytes(VICTIM)
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # as if another user had made it
    os.utime(victim, ns=(10**18, 10**18))
    record_use(database, cache)
    assert victim.read_bytes() == VICTIM
    assert victim.stat().st_mtime_ns == 10**18
    assert str(used) not in cachedir._HELD


@pytest.mark.parametrize("plant", ["a file", "a link to a folder", "a dangling link"])
def test_a_planted_working_copy_name_is_named_not_a_raw_os_error(tiny_folder: Path, tmp_path: Path, plant: str):
    """``.DST.partial`` a file or a symbolic link: the conversion stops in one line naming it and saying to remove
    it (not a bare ``FileExistsError`` or ``NotADirectoryError``); what the link points to is untouched."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(VICTIM)
    victim = _victim(tmp_path)
    dst = tmp_path / "out" / "db.lmdb"
    dst.parent.mkdir()
    work = partial_path(dst)
    if plant == "a file":
        shutil.copy(victim, work)
    elif plant == "a link to a folder":
        work.symlink_to(folder, target_is_directory=True)
    else:
        work.symlink_to(tmp_path / "gone")
    what = "not a folder" if plant == "a file" else "a symbolic link"
    with pytest.raises(DestinationError, match=f"is {what}, where this package writes its own folder") as info:
        _convert(tiny_folder, dst)
    assert f"{str(work)!r} is {what}" in _one_line(info.value)
    assert "Remove it" in str(info.value)
    assert _tree(folder) == {"keep.txt": VICTIM}
    assert victim.read_bytes() == VICTIM
    assert not os.path.lexists(tmp_path / "gone")
    assert not os.path.lexists(dst)


def test_cache_remove_refuses_a_file_planted_at_the_working_copy_name(tiny_database: Path, tmp_path: Path):
    """Removing a conversion renames it to ``.NAME.partial`` first: a file planted there stops the removal in one
    line, the database whole, the file untouched (not a bare ``NotADirectoryError`` after a half-done removal)."""
    cache = tmp_path / "cache"
    database = cache / "db.lmdb"
    shutil.copytree(tiny_database, database)
    work = partial_path(database)
    work.write_bytes(VICTIM)
    with pytest.raises(DestinationError, match=r"is not a folder, where removing db\.lmdb renames it first") as info:
        remove_conversion("db", cache)
    _one_line(info.value)
    assert work.read_bytes() == VICTIM
    assert _tree(database) == _tree(tiny_database)


def test_a_planted_link_as_the_database_moved_aside_is_never_restored_or_renamed_over(
    tiny_folder: Path, tiny_database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """``.victim.lmdb.old`` a link to a database elsewhere: ``convert --clean`` leaves it as it is and says so, never
    making ``victim.lmdb`` a link; beside a database being converted again, ``.db.lmdb.old`` a link stops the
    conversion in one line before it starts, the database and the linked one as they were."""
    before = _tree(tiny_database)
    folder = tmp_path / "out"
    folder.mkdir()
    planted = folder / ".victim.lmdb.old"
    planted.symlink_to(tiny_database, target_is_directory=True)
    assert main(["convert", "--clean", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"left {str(planted)!r} as it is: it is a symbolic link" in out
    assert "nothing was removed, restored or followed through it" in out
    assert not os.path.lexists(folder / "victim.lmdb")
    assert planted.is_symlink()
    assert _tree(tiny_database) == before

    dst = folder / "db.lmdb"
    _convert(tiny_folder, dst)
    converted = _tree(dst)
    aside = folder / ".db.lmdb.old"
    aside.symlink_to(tiny_database, target_is_directory=True)
    with pytest.raises(DestinationError, match=re.escape(f"{str(aside)!r} is a symbolic link")) as info:
        _convert(tiny_folder, dst, short_side=16)  # other settings: the database is converted again
    _one_line(info.value)
    assert _tree(dst) == converted
    assert aside.is_symlink()
    assert not os.path.lexists(partial_path(dst))
    assert _tree(tiny_database) == before


# ---------------------------------------------------------------------------------------------------------------
# Conversion reports of the wrong shapes
# ---------------------------------------------------------------------------------------------------------------


def _bad_reports(good: dict[str, Any]) -> dict[str, bytes]:
    """Reports a planted folder may hold, by name: a real report's with one part of the wrong shape, or no JSON."""
    meta = good["meta"]
    without_source = {k: v for k, v in meta.items() if k != "source"}

    def report(**changed: Any) -> bytes:
        return json.dumps({**good, "meta": {**meta, **changed}}).encode()

    return {
        "source-a-string": report(source="/data/evil"),
        "source-a-list": report(source=["/data/evil"]),
        "source-without-path": report(source={"fingerprint": "0"}),
        "source-path-a-number": report(source={"path": 7, "fingerprint": "0"}),
        "source-missing": json.dumps({**good, "meta": without_source}).encode(),
        "splits-a-string": report(splits="many"),
        "encoding-a-list": report(encoding=["jpeg"]),
        "meta-a-list": json.dumps({**good, "meta": [meta]}).encode(),
        "report-a-list": json.dumps([good]).encode(),
        "not-json": b'{"meta": {"complete": true, "source": "',
        "nested-too-deep": b"[" * 100_000,
    }


def test_planted_reports_of_the_wrong_shapes_leave_listing_and_prepare_data_working(
    tiny_folder: Path, tiny_database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Folders planted in the cache, each with a ``data.mdb`` that is no database and a report whose metadata is of
    the wrong shape (a ``source`` that is a string, a list, without a path...): each is listed as damaged, never as
    complete, by ``cache list`` (table and JSON) and ``list_conversions``; ``prepare_data`` into that cache (which
    lists it to say what other settings it holds) converts; no ``AttributeError``, ``KeyError`` or ``TypeError``."""
    cache = tmp_path / "cache"
    cache.mkdir()
    bad = _bad_reports(json.loads((tiny_database / REPORT_FILE).read_text()))
    for name, report in bad.items():
        planted = cache / f"{name}.lmdb"
        planted.mkdir()
        (planted / "data.mdb").write_bytes(b"\0" * 8192)
        (planted / REPORT_FILE).write_bytes(report)
    listed = {c.key: c for c in list_conversions(cache)}
    assert sorted(listed) == sorted(bad)
    for name in bad:
        assert (listed[name].state, listed[name].source, listed[name].targets) == (
            "damaged: its metadata cannot be read",
            None,
            None,
        ), name
        assert conversion_meta(cache / f"{name}.lmdb") is None
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert out.count("damaged: its metadata cannot be read") == len(bad)
    assert main(["cache", "list", "--cache-dir", str(cache), "--json"]) == 0
    assert {c["key"]: c["state"] for c in json.loads(capsys.readouterr().out)} == {
        name: "damaged: its metadata cannot be read" for name in bad
    }
    dm = FastImageDataModule(str(tiny_folder), cache_dir=str(cache), short_side=None, image_size=16, num_workers=0)
    dm.prepare_data()
    assert read_meta(dm.database_path)["splits"]["train"]["length"] == 4
    assert sorted(c.key for c in list_conversions(cache) if c.state == "complete") == [dm.database_path.name[:-5]]
    for name, report in bad.items():
        assert (cache / f"{name}.lmdb" / REPORT_FILE).read_bytes() == report


@pytest.mark.parametrize("how", ["larger than the cap", "a symbolic link"])
def test_a_report_over_the_size_cap_or_a_link_is_not_read(
    tiny_folder: Path, tiny_database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
):
    """A report larger than the cap on what is read of it (its size checked before reading), or a link to a report
    elsewhere: its forged source is never shown; the metadata is read from the database itself."""
    monkeypatch.setattr(inventory, "MAX_JSON_BYTES", 4096)
    cache = tmp_path / "cache"
    database = cache / "db.lmdb"
    shutil.copytree(tiny_database, database)
    good = json.loads((tiny_database / REPORT_FILE).read_text())
    forged = {**good, "meta": {**good["meta"], "source": {"path": "/forged", "fingerprint": "0"}}}
    report = database / REPORT_FILE
    if how == "a symbolic link":
        elsewhere = tmp_path / "forged.json"
        elsewhere.write_text(json.dumps(forged))
        report.unlink()
        report.symlink_to(elsewhere)
    else:
        forged["skipped"] = [{"path": "x" * 100, "reason": "padding"}] * 100  # some 12 KiB
        report.write_text(json.dumps(forged))
        assert report.stat().st_size > 4096
    meta = conversion_meta(database)
    assert meta is not None
    assert meta["source"]["path"] == str(tiny_folder)
    (conversion,) = list_conversions(cache)
    assert (conversion.source, conversion.state) == (str(tiny_folder), "complete")
