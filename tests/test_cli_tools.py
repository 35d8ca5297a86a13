from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_fastdata import convert, make_image_folder
from lightning_fastdata.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain ImageFolder of 2 classes x 40 JPEGs, 64-160 px."""
    root = tmp_path_factory.mktemp("cli_tools") / "src"
    return make_image_folder(root, num_classes=2, train_per_class=40, val_per_class=0, min_size=64, max_size=160)


@pytest.fixture(scope="module")
def database(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder converted at short side 96."""
    dst = tmp_path_factory.mktemp("cli_tools_db") / "db"
    convert(folder, dst, short_side=96, num_workers=0, progress=False)
    return dst


def test_bench_prints_the_table_and_writes_json_and_plot(database, tmp_path, capsys):
    """``bench`` sweeps the database, prints the marked table and writes the JSON and the plot."""
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    args = ["bench", str(database), "--seconds", "0.2", "--max-workers", "1", "--batch-sizes", "16"]
    assert main([*args, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bench: database {database}, 80 samples, 0.2 s per point")
    assert out.count("**pick**") == 1
    data = json.loads(out_json.read_text())
    assert set(data["pick"]) == {"num_workers", "batch_size", "prefetch_factor", "pin_memory", "engine"}
    assert [m["num_workers"] for m in data["measurements"]][:2] == [0, 1]
    assert all(m["batch_size"] == 16 for m in data["measurements"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_bench_image_folder(folder, capsys):
    """``bench`` on an image folder measures torchvision's pipeline and says so."""
    assert main(["bench", str(folder), "--seconds", "0.1", "--max-workers", "0", "--image-size", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bench: image folder {folder}, 80 samples")
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
