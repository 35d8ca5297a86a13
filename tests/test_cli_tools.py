from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fastdata import convert, make_image_folder
from lightning_fastdata.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def database(plain_photo_database: Path) -> Path:
    return plain_photo_database


@pytest.fixture(scope="module")
def folder(plain_photo_database: Path) -> Path:
    return plain_photo_database.parent / "src"


def test_bench_prints_the_table_and_writes_json_and_plot(database, tmp_path, capsys):
    """``bench`` sweeps the database, prints the marked table and writes the JSON and the plot."""
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    args = ["bench", str(database), "--seconds", "0.2", "--max-workers", "1", "--batch-sizes", "16"]
    assert main([*args, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    training_loader = "FastImageDataModule's training loader, engine='threads'"
    assert out.startswith(f"bench: database {database} ({training_loader}), 80 samples, 0.2 s per point")
    assert out.count("**pick**") == 1
    data = json.loads(out_json.read_text())
    assert set(data["pick"]) == {"num_workers", "batch_size", "prefetch_factor", "pin_memory", "engine"}
    assert [m["num_workers"] for m in data["measurements"]][:2] == [0, 1]
    assert {m["engine"] for m in data["measurements"]} == {"threads"}
    assert all(m["batch_size"] == 16 for m in data["measurements"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_bench_image_folder(folder, capsys):
    """``bench`` on an image folder measures torchvision's pipeline and says so."""
    assert main(["bench", str(folder), "--seconds", "0.1", "--max-workers", "0", "--image-size", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bench: image folder {folder} (torchvision ImageFolder + standard transforms,")
    assert ", 80 samples" in out.splitlines()[0]
    assert "| 0 | 64 | - | False |" in out


def test_bench_missing_path_returns_2(tmp_path, capsys):
    """A path that is neither a database nor a folder exits 2 with ``error:`` on stderr."""
    assert main(["bench", str(tmp_path / "missing"), "--seconds", "0.1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert "missing" in captured.err
    assert "**pick**" not in captured.out


def test_profile_prints_both_tables_and_writes_json(folder, database, tmp_path, capsys):
    """``profile FOLDER --db DB`` prints both tables, their conclusions and the comparison; JSON lists both."""
    out_json = tmp_path / "profile.json"
    args = ["profile", str(folder), "--db", str(database), "--samples", "40", "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"folder ({folder}), 40 samples" in out
    assert f"database ({database}), 40 samples" in out
    assert out.count("| total |") == 2
    assert "less work per sample" in out
    assert "per sample: " in out
    data = json.loads(out_json.read_text())
    assert [p["name"] for p in data] == ["folder", "database"]
    assert all(p["samples"] == 40 for p in data)
    assert "normalize" in data[1]["stages_ms"]
    assert data[1]["conclusion"].startswith("database: ")


def test_profile_missing_path_returns_2(tmp_path, capsys):
    """A missing path exits 2 with ``error:``."""
    assert main(["profile", str(tmp_path / "missing"), "--samples", "4"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_names_a_damaged_file_and_profile_skips_it(tmp_path, capsys):
    """A damaged file in the folder: ``bench`` exits 2 with an error naming it, no traceback; ``profile`` skips and
    lists it, as ``convert`` does."""
    root = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=3, val_per_class=0, min_size=20, max_size=30
    )
    bad = root / "class_0" / "00001.jpg"
    bad.write_bytes(b"not a jpeg")
    assert main(["bench", str(root), "--seconds", "0.1", "--max-workers", "1", "--batch-sizes", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {str(bad)!r} cannot be read as an image")
    assert "Traceback" not in err
    (tmp_path / "plain").mkdir()
    assert main(["profile", str(root), "--db", str(tmp_path / "plain"), "--samples", "6"]) == 2
    assert "is not a database" in capsys.readouterr().err
    out_json = tmp_path / "profile.json"
    assert main(["profile", str(root), "--samples", "6", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert f"folder ({root}), 5 samples" in out
    assert f"  skipped {bad}: not a readable image: " in out
    [folder] = json.loads(out_json.read_text())
    assert [item["path"] for item in folder["skipped"]] == [str(bad)]


def test_a_truncated_jpeg_has_one_reason_in_convert_profile_and_bench(tmp_path, capsys):
    """A JPEG cut in half is skipped by ``convert`` (libjpeg-turbo's downscale meets it) and ``profile`` (Pillow's
    decode), and stops ``bench``, all with the same reason."""
    root = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=3, val_per_class=0, min_size=120, max_size=160
    )
    bad = root / "class_0" / "00001.jpg"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # past its header: the decoders meet the cut
    reason = "the image file is truncated: it ends before its image data does"
    db = tmp_path / "db.lmdb"
    assert main(["convert", str(root), str(db), "--short-side", "32", "--workers", "0", "--quiet"]) == 0
    capsys.readouterr()
    report = json.loads((db / "convert_report.json").read_text())
    assert report["skipped"] == [{"path": str(bad), "reason": reason}]
    assert main(["profile", str(root), "--db", str(db), "--samples", "6", "--batch-size", "4"]) == 0
    assert f"  skipped {bad}: {reason}\n" in capsys.readouterr().out
    assert main(["bench", str(root), "--seconds", "0.1", "--max-workers", "1", "--batch-sizes", "6"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {str(bad)!r} cannot be read as an image ({reason})")


def test_profile_of_a_database_whose_source_holds_bad_files(tmp_path, capsys):
    """``profile DB`` of a conversion whose source folder holds an empty JPEG profiles both, listing the file."""
    root = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=3, val_per_class=0, min_size=20, max_size=30
    )
    empty = root / "class_1" / "empty.jpg"
    empty.write_bytes(b"")
    db = tmp_path / "db.lmdb"
    convert(root, db, num_workers=0, progress=False)
    assert main(["profile", str(db), "--samples", "6", "--batch-size", "4"]) == 0
    captured = capsys.readouterr()
    assert f"  skipped {empty}: empty file (0 bytes)" in captured.out
    assert f"database ({db}), 6 samples" in captured.out
    assert "error" not in captured.err


def test_profile_missing_path_names_it(tmp_path, capsys):
    """A missing path: a sentence naming it and what to pass, not a bare errno."""
    assert main(["profile", str(tmp_path / "missing")]) == 2
    assert f"`data` {str(tmp_path / 'missing')!r} does not exist. Pass an image folder" in capsys.readouterr().err


def test_profile_advice_mentions_device_decode_only_with_cuda(monkeypatch):
    """The database conclusion suggests ``decode='device'`` only when CUDA is available."""
    import torch

    from lightning_fastdata.profiling import PipelineProfile

    profile = PipelineProfile("database", "db", {"read": 0.1, "decode": 1.0, "transforms": 0.2})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "decode='device'" not in profile.conclusion()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "decode='device'" in profile.conclusion()


def test_bench_num_workers_0_runs_with_one_intra_op_thread():
    """The ``num_workers=0`` row loads with one intra-op thread (as a worker does), and restores the count after."""
    import torch

    from lightning_fastdata.tuning import LoaderConfig, measure

    seen: set[int] = set()

    class Threads(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> torch.Tensor:
            seen.add(torch.get_num_threads())
            return torch.zeros(1)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        measure(Threads(), LoaderConfig(num_workers=0, batch_size=2), seconds=0.05, max_batches=3)
        assert seen == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_bench_and_profile_say_a_missing_path_does_not_exist(tmp_path, capsys):
    """``bench data/nope`` and ``profile --db dbs/nope.lmdb`` say "does not exist", naming the path (exit 2)."""
    missing = tmp_path / "nope"
    assert main(["bench", str(missing), "--seconds", "0.1"]) == 2
    assert capsys.readouterr().err.startswith(f"error: `data` {str(missing)!r} does not exist. Pass an image folder")
    root = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=2, val_per_class=0, min_size=20, max_size=30
    )
    missing_db = tmp_path / "dbs" / "nope.lmdb"
    assert main(["profile", str(root), "--db", str(missing_db), "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: `database` (`--db`) {str(missing_db)!r} does not exist.")
    assert "is not a database" not in err


def test_bench_and_profile_accept_an_empty_class_folder_as_convert_does(tmp_path, capsys):
    """Empty and hidden class folders, which ``convert`` ignores, are left out by ``bench`` and ``profile`` too."""
    root = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=4, val_per_class=0, min_size=20, max_size=30
    )
    (root / "empty_class").mkdir()
    (root / ".ipynb_checkpoints").mkdir()
    assert main(["bench", str(root), "--seconds", "0.05", "--max-workers", "0", "--batch-sizes", "4"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"bench: image folder {root} (")
    assert ", 8 samples" in header
    db = tmp_path / "db"
    convert(root, db, num_workers=0, progress=False)
    assert main(["profile", str(root), "--db", str(db), "--samples", "4", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"folder ({root}), 4 samples" in out
    assert f"database ({db}), 4 samples" in out
