from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_fastdata import FastImageDataModule, convert, make_image_folder, read_meta, resolve
from lightning_fastdata.cli import main
from lightning_fastdata.errors import DestinationError, InvalidArgumentError
from lightning_fastdata.store import cache as cache_module
from lightning_fastdata.store.cache import (
    cache_root,
    converted_path,
    default_cache_dir,
    list_conversions,
    parse_age,
    parse_size,
    prune_cache,
    remove_conversion,
    use_path,
)
from lightning_fastdata.store.ondisk import target_lock


def test_converted_path_keeps_the_slot_names_of_earlier_versions():
    """The slot of a source is a fixed function of its path and settings: a changed name would convert again."""
    assert converted_path(Path("/data/pets"), Path("/cache"), 256, 90, "jpeg") == Path("/cache/pets-0fb5ace5b9.lmdb")
    slots = {
        converted_path(Path("/data/pets"), Path("/cache"), *settings)
        for settings in ((256, 90, "jpeg"), (None, 90, "jpeg"), (256, 80, "jpeg"), (256, 90, "raw"))
    }
    assert len(slots) == 4


def test_cache_root_is_cache_dir_else_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``cache_dir`` wins (``~`` expanded); without it ``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("LIGHTNING_FASTDATA_CACHE", raising=False)
    assert cache_root("~/mine") == tmp_path / "mine"
    assert cache_root(None) == default_cache_dir() == tmp_path / ".cache" / "lightning_fastdata"
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"


# ----------------------------------------------------------------------------------------------------------------
# The conversions a DataModule leaves in the cache: list, last use, remove, prune
# ----------------------------------------------------------------------------------------------------------------

DAY = 86400.0


def _datamodule(source: Path, cache: Path, short_side: int, **kwargs: Any) -> FastImageDataModule:
    """A DataModule converting ``source`` into ``cache`` at ``short_side`` (prepared, not set up)."""
    dm = FastImageDataModule(str(source), cache_dir=str(cache), short_side=short_side, image_size=16, **kwargs)
    dm.prepare_data()
    return dm


def _convert_into(source: Path, cache: Path, short_side: int) -> Path:
    """Convert ``source`` into its cache slot for ``short_side``, as a DataModule would, without opening it."""
    target = converted_path(source, cache, short_side, 90, "jpeg")
    convert(source, target, short_side=short_side, num_workers=0, progress=False)
    return target


def _used(database: Path, days_ago: float) -> None:
    """Date ``database``'s conversion and last use ``days_ago`` days back."""
    when = time.time() - days_ago * DAY
    use_path(database).touch()
    for path in (use_path(database), database / "data.mdb"):
        os.utime(path, (when, when))


def test_list_shows_each_conversion_with_source_settings_size_and_last_use(split_folder: Path, tmp_path: Path):
    """Two settings of one source are two conversions, each listed with its source, settings, size and last use."""
    first = _datamodule(split_folder, tmp_path, 48).database_path
    second = _datamodule(split_folder, tmp_path, 96).database_path
    _used(first, 3)
    listed = list_conversions(tmp_path)
    assert [c.path for c in listed] == [second, first]  # most recently used first
    assert {c.source for c in listed} == {str(split_folder)}
    assert [c.settings["short_side"] for c in listed] == [96, 48]
    assert all(c.settings["quality"] == 90 and c.settings["encoding"] == "jpeg" for c in listed)
    assert all(c.state == "complete" and not c.in_use for c in listed)
    assert listed[1].key == first.name.removesuffix(".lmdb")
    assert listed[1].size >= (first / "data.mdb").stat().st_size > 0
    assert 2.9 * DAY < time.time() - listed[1].last_used < 3.1 * DAY


def test_opening_a_conversion_records_its_last_use(split_folder: Path, tmp_path: Path):
    """``setup`` touches the conversion's use file: an old conversion opened now was last used now."""
    dm = _datamodule(split_folder, tmp_path, 48, num_workers=0)
    _used(dm.database_path, 10)
    dm.setup("fit")
    (conversion,) = list_conversions(tmp_path)
    assert time.time() - conversion.last_used < DAY
    assert conversion.in_use  # this process reads it


def test_remove_frees_the_conversion_and_the_next_run_converts_again(split_folder: Path, tmp_path: Path):
    """``remove_conversion`` by key deletes the database and its use file; a DataModule then converts afresh."""
    target = _convert_into(split_folder, tmp_path, 48)
    _used(target, 1)
    message = remove_conversion(target.name.removesuffix(".lmdb"), tmp_path)
    assert message.startswith(f"removed {target} (")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    dm = _datamodule(split_folder, tmp_path, 48)
    assert dm.database_path == target
    assert (target / "data.mdb").is_file()


def test_remove_takes_the_digest_or_the_path_and_names_the_keys_it_knows(split_folder: Path, tmp_path: Path):
    """A digest or a path works; a wrong key or a path outside the cache is refused, naming what is there."""
    first, second = _convert_into(split_folder, tmp_path, 48), _convert_into(split_folder, tmp_path, 96)
    remove_conversion(first.name.removesuffix(".lmdb").rsplit("-", 1)[1], tmp_path)
    with pytest.raises(InvalidArgumentError, match=rf"no conversion `nope`.*it holds: {second.name[:-5]}"):
        remove_conversion("nope", tmp_path)
    with pytest.raises(InvalidArgumentError, match="not a conversion in the cache folder"):
        remove_conversion(str(split_folder), tmp_path)
    remove_conversion(str(second), tmp_path)
    assert list_conversions(tmp_path) == []


def test_remove_refuses_a_conversion_being_written(split_folder: Path, tmp_path: Path):
    """While a converter holds the target's lock, nothing is removed and the converter is named."""
    target = _convert_into(split_folder, tmp_path, 48)
    with target_lock(target):
        assert list_conversions(tmp_path)[0].state.startswith(f"being written by process {os.getpid()}")
        with pytest.raises(DestinationError, match=rf"being written by process {os.getpid()}.*nothing was removed"):
            remove_conversion(str(target), tmp_path)
    assert (target / "data.mdb").is_file()


_READER = """
import sys, time
from lightning_fastdata.store.cache import record_use
record_use(sys.argv[1], sys.argv[2])
print("ready", flush=True)
time.sleep(120)
"""


def test_remove_refuses_a_conversion_another_process_reads(split_folder: Path, tmp_path: Path):
    """A process that opened the conversion holds it: removal is refused until that process ends."""
    target = _convert_into(split_folder, tmp_path, 48)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(target), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == "ready"
        assert list_conversions(tmp_path)[0].in_use
        with pytest.raises(DestinationError, match="is in use: a running process reads it"):
            remove_conversion(str(target), tmp_path)
        assert (target / "data.mdb").is_file()
    finally:
        reader.kill()
        reader.wait(timeout=30)
    assert not list_conversions(tmp_path)[0].in_use
    remove_conversion(str(target), tmp_path)
    assert not target.exists()


def test_an_interrupted_removal_leaves_nothing_that_passes_for_a_database(
    split_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Killed while deleting, a removal leaves only an unfinished working copy, which ``prune_cache`` removes."""
    target = _convert_into(split_folder, tmp_path, 48)
    real_rmtree = shutil.rmtree

    def interrupted(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).is_dir() and not kwargs.get("ignore_errors"):
            raise KeyboardInterrupt  # the deletion itself, after the rename
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(cache_module.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        remove_conversion(str(target), tmp_path)
    monkeypatch.setattr(cache_module.shutil, "rmtree", real_rmtree)
    assert not target.exists()
    with pytest.raises(FileNotFoundError):
        read_meta(target)
    (leftover,) = list_conversions(tmp_path)
    assert (leftover.key, leftover.state) == (f"{target.name[:-5]} (unfinished)", "incomplete")
    lines = prune_cache(tmp_path, older_than=365 * DAY)
    assert len(lines) == 1
    assert "interrupted" in lines[0]
    assert list_conversions(tmp_path) == []


def test_prune_removes_old_conversions_then_the_least_recently_used_to_fit(split_folder: Path, tmp_path: Path):
    """``older_than`` removes those unused that long; ``max_size`` then removes the least recently used first."""
    old, middle, new = (_convert_into(split_folder, tmp_path, side) for side in (40, 48, 64))
    _used(old, 40)
    _used(middle, 5)
    _used(new, 1)
    assert prune_cache(tmp_path, older_than=30 * DAY, dry_run=True)[0].startswith(f"would remove {old} (")
    assert old.exists()
    assert prune_cache(tmp_path, older_than=30 * DAY)[0].startswith(f"removed {old} (")
    sizes = {c.path: c.size for c in list_conversions(tmp_path)}
    lines = prune_cache(tmp_path, max_size=sizes[new])
    assert [line.split(" (")[0] for line in lines] == [f"removed {middle}"]
    assert [c.path for c in list_conversions(tmp_path)] == [new]
    with pytest.raises(InvalidArgumentError, match="needs `--max-size` or `--older-than`"):
        prune_cache(tmp_path)


def test_prune_keeps_a_conversion_in_use(split_folder: Path, tmp_path: Path):
    """A conversion this process reads is kept by ``prune_cache``, which says why."""
    dm = _datamodule(split_folder, tmp_path, 48, num_workers=0)
    dm.setup("fit")
    (line,) = prune_cache(tmp_path, max_size=0)
    assert line.startswith(f"kept {dm.database_path.name[:-5]}: ")
    assert "is in use" in line
    assert (dm.database_path / "data.mdb").is_file()


@pytest.mark.parametrize(
    ("text", "size"),
    [("20GB", 20 * 10**9), ("500MB", 500 * 10**6), ("20GiB", 20 * 2**30), ("1.5G", 3 * 2**29), ("4096", 4096)],
)
def test_parse_size(text: str, size: int):
    """Sizes in decimal (GB) and binary (GiB, G) units, or bytes."""
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * DAY), ("12h", 12 * 3600), ("2w", 14 * DAY), ("7", 7 * DAY)])
def test_parse_age(text: str, seconds: float):
    """Ages in seconds to weeks; a bare number is days."""
    assert parse_age(text) == seconds


def test_parse_rejects_what_is_not_a_size_or_an_age():
    """A bad size or age names the option and shows valid forms."""
    with pytest.raises(InvalidArgumentError, match=r"`--max-size` '20 parsecs' is not a size; write e\.g\. 20GB"):
        parse_size("20 parsecs")
    with pytest.raises(InvalidArgumentError, match=r"`--older-than` 'soon' is not an age"):
        parse_age("soon")


# ----------------------------------------------------------------------------------------------------------------
# Why a DataModule converts again
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def infos(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The DataModule's ``rank_zero_info`` lines about its conversions (:mod:`lightning_fastdata.resolve` logs them)."""
    lines: list[str] = []
    monkeypatch.setattr(resolve, "rank_zero_info", lambda message, *a, **k: lines.append(str(message)))
    return lines


def test_new_settings_say_which_setting_differs_from_the_conversions_kept(
    split_folder: Path, tmp_path: Path, infos: list[str]
):
    """Converting a source the cache already holds under other settings names the setting and the old conversion."""
    first = _datamodule(split_folder, tmp_path, 48).database_path
    assert not any("again" in line for line in infos)
    infos.clear()
    _datamodule(split_folder, tmp_path, 96, quality=80)
    (note,) = [line for line in infos if "again" in line]
    assert f"converting {str(split_folder)!r} again" in note
    assert f"{first.name[:-5]} (" in note
    assert "short_side=96 (it has 48), quality=80 (it has 90)" in note
    assert "lightning-fastdata cache remove" in note
    infos.clear()
    _datamodule(split_folder, tmp_path, 48)  # up to date: nothing to explain
    assert not any("again" in line for line in infos)


def _photos_and_their_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """A generated folder ``photos``, ``convert photos photos.lmdb`` (short side 48), and a private default cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_FASTDATA_CACHE", str(cache))
    photos = make_image_folder(
        tmp_path / "photos", num_classes=2, train_per_class=3, val_per_class=0, min_size=40, max_size=56
    )
    assert main(["convert", str(photos), str(tmp_path / "photos.lmdb"), "--short-side", "48", "--quiet"]) == 0
    return photos, tmp_path / "photos.lmdb", cache


def test_a_datamodule_names_the_database_convert_made_of_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, infos: list[str]
):
    """After ``convert photos photos.lmdb``, a DataModule given ``photos`` with the same settings says, before it
    converts into the cache, that ``photos.lmdb`` exists and may be passed as ``data_dir``; other settings do not."""
    photos, database, cache = _photos_and_their_database(tmp_path, monkeypatch)
    _datamodule(photos, cache, 96)
    assert not any(str(database) in line for line in infos)
    dm = _datamodule(photos, cache, 48)
    (note,) = [line for line in infos if str(database) in line]
    assert note.startswith(f"converting {str(photos)!r} into the cache ({dm.database_path.name}), but")
    assert "Pass it as `data_dir`" in note
    infos.clear()
    shutil.rmtree(dm.database_path)
    shutil.rmtree(database)  # gone: nothing to point at
    _datamodule(photos, cache, 48)
    assert not any(str(database) in line for line in infos)


def test_cache_list_shows_databases_convert_wrote_elsewhere_and_never_removes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """``cache list`` lists ``convert SRC DST``'s database, marked as outside the cache folder; ``cache remove`` and
    ``cache prune`` leave it alone."""
    photos, database, _ = _photos_and_their_database(tmp_path, monkeypatch)
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "outside the cache folder" in out
    assert f"{database}  " in out
    assert f"    source {photos}  short_side=48 quality=90" in out
    assert main(["cache", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["path"], listed["source"]) == (str(database), str(photos))
    assert listed["state"] == "complete, outside the cache folder"
    assert main(["cache", "remove", str(database)]) == 2
    assert main(["cache", "prune", "--max-size", "0"]) == 0
    assert (database / "data.mdb").is_file()


@pytest.mark.parametrize(
    "damage",
    [b"{not json", b"[" * 100_000, b'["a", "b"]', b'{"/x": "y", "/z": [1, {}]}', b"\xff\xfe"],
    ids=["not-json", "nested-100k", "a-list", "wrong-shapes", "not-utf8"],
)
def test_a_damaged_registry_never_stops_a_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], damage: bytes
):
    """A registry of conversions elsewhere that is not JSON, nests too deeply or holds the wrong shapes is read as
    empty: ``convert`` writes it anew and ``cache list`` works."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / cache_module.ELSEWHERE_FILE).write_bytes(damage)
    _, database, _ = _photos_and_their_database(tmp_path, monkeypatch)
    assert (database / "data.mdb").is_file()
    assert main(["cache", "list"]) == 0
    assert f"{database}  " in capsys.readouterr().out


def test_a_changed_source_says_what_changed(split_folder_copy: Path, tmp_path: Path, infos: list[str]):
    """Converting the same slot again after a split was added names the new split."""
    _datamodule(split_folder_copy, tmp_path, 48)
    shutil.copytree(split_folder_copy / "val", split_folder_copy / "test")
    infos.clear()
    dm = _datamodule(split_folder_copy, tmp_path, 48)
    (note,) = [line for line in infos if "again" in line]
    assert note.startswith(f"converted {dm.database_path.name} again because its source changed since ")
    assert "split 'test' is new (9 images)" in note


# ----------------------------------------------------------------------------------------------------------------
# lightning-fastdata cache
# ----------------------------------------------------------------------------------------------------------------


def test_cache_command_lists_removes_and_prunes(split_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """``cache list`` (table and JSON), ``cache remove KEY``, ``cache prune``; a bad key is one ``error:`` line."""
    first, second = _convert_into(split_folder, tmp_path, 48), _convert_into(split_folder, tmp_path, 96)
    _used(first, 2)
    assert main(["cache", "--cache-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert out.index(second.name[:-5]) < out.index(first.name[:-5])
    assert f"source {split_folder}  short_side=48 quality=90 encoding=jpeg" in out
    assert "last used 2.0 days ago  complete" in out
    assert out.strip().splitlines()[-1].startswith("2 conversion(s), ")
    assert main(["cache", "--cache-dir", str(tmp_path), "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["key"], c["source"], c["state"]) for c in listed] == [
        (second.name[:-5], str(split_folder), "complete"),
        (first.name[:-5], str(split_folder), "complete"),
    ]
    assert main(["cache", "--cache-dir", str(tmp_path), "remove", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: no conversion `nope` in the cache folder")
    assert main(["cache", "--cache-dir", str(tmp_path), "prune", "--older-than", "1d"]) == 0
    assert capsys.readouterr().out.startswith(f"removed {first} (")
    assert main(["cache", "--cache-dir", str(tmp_path), "remove", second.name]) == 0
    assert main(["cache", "--cache-dir", str(tmp_path), "list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"no conversions in {tmp_path}"


@pytest.mark.parametrize("action", [["list"], ["prune", "--older-than", "1d"], ["remove", "nope"]])
def test_cache_dir_may_follow_the_action(
    split_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture, action: list[str]
) -> None:
    """``cache list --cache-dir DIR`` reads DIR as ``cache --cache-dir DIR list`` does (no "unrecognized arguments")."""
    _convert_into(split_folder, tmp_path, 48)
    outputs = []
    for args in (["cache", "--cache-dir", str(tmp_path), *action], ["cache", *action, "--cache-dir", str(tmp_path)]):
        code = main(args)
        captured = capsys.readouterr()
        outputs.append((code, captured.out, captured.err))
    assert outputs[0] == outputs[1]
    assert "unrecognized" not in outputs[1][2]


def test_last_use_is_recorded_once_per_setup_not_per_sample(split_folder: Path, tmp_path: Path):
    """Reading a whole epoch leaves the use file alone: only ``setup`` touches it."""
    dm = _datamodule(split_folder, tmp_path, 48, num_workers=0, batch_size=4)
    dm.setup("fit")
    _used(dm.database_path, 2)
    before = use_path(dm.database_path).stat().st_mtime_ns
    assert sum(len(labels) for _, labels in dm.train_dataloader()) > 0
    assert use_path(dm.database_path).stat().st_mtime_ns == before


def test_cache_list_shows_each_conversions_target_kind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``cache list`` (table and JSON) says what each conversion's targets are: classes, multi-label, values."""
    from lightning_fastdata import make_image_folder

    src = make_image_folder(tmp_path / "src", num_classes=2, train_per_class=2, val_per_class=0, min_size=20,
                            max_size=30, num_workers=1)  # fmt: skip
    images = sorted(p.relative_to(tmp_path).as_posix() for p in src.rglob("*.jpg"))
    cache = tmp_path / "cache"
    (tmp_path / "ml.csv").write_text("path,label\n" + "".join(f"{p},a|b\n" for p in images))
    (tmp_path / "xy.csv").write_text("path,x,y\n" + "".join(f"{p},0.5,1\n" for p in images))
    for source, kind in ((src, None), (tmp_path / "ml.csv", "multilabel"), (tmp_path / "xy.csv", "float")):
        target = converted_path(source, cache, 64, 90, "jpeg", kind)
        convert(source, target, short_side=64, num_workers=0, progress=False, targets=kind)
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "encoding=jpeg keep_original=False  targets class (2 classes)" in out
    assert "targets multilabel (2 classes)" in out
    assert "targets float (2 values: x, y)" in out
    assert main(["cache", "list", "--cache-dir", str(cache), "--json"]) == 0
    listed = {Path(c["source"]).name: c["targets"] for c in json.loads(capsys.readouterr().out)}
    assert listed == {
        "src": "class (2 classes)",
        "ml.csv": "multilabel (2 classes)",
        "xy.csv": "float (2 values: x, y)",
    }
