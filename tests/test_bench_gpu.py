"""``benchmarks/bench_gpu.py`` runs end to end (on the CPU here: a smoke run whose figures mean nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_returns_nothing(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path) -> None:
    bench = _bench()
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--workdir", str(tmp_path)]) == {}
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing generated


@pytest.mark.slow
def test_smoke_run_prints_both_tables_with_every_column(capsys, tmp_path) -> None:
    bench = _bench()
    args = ["--device", "cpu", "--workdir", str(tmp_path), "--images", "40", "--image-size", "32", "--batch-size", "8"]
    args += [
        "--epochs",
        "2",
        "--workers",
        "1",
        "--models",
        "conv",
        "--scaling",
        "1",
        "--json",
        str(tmp_path / "r.json"),
    ]
    results = bench.main(args)
    out = capsys.readouterr().out
    training = results["training"]["conv"]
    assert set(training) == set(bench.COLUMNS)
    assert all(summary["samples_per_sec"] > 0 for summary in training.values())
    assert set(results["scaling"]) == {"threads", "processes", "imagefolder"}
    assert all(rates[1] > 0 for rates in results["scaling"].values())
    assert results["ceiling"][1] > 0  # one standalone decode process
    assert all(us[1] > 0 for us in results["training_process_us"].values())
    assert "| ceiling: standalone decode processes, no data passing |" in out
    assert 'engine="processes" at 1 workers:' in out
    assert "| one strided conv |" in out
    assert "of data-free" in out
    assert "| torchvision ImageFolder, uint8 |" in out
    assert (tmp_path / "r.json").is_file()


@pytest.mark.slow
def test_smoke_run_prints_the_views_table(capsys, tmp_path) -> None:
    """Table 3 alone (no models, no scaling): DINO's 8 views, shrunk to 24 and 16 px, from every kind of loader."""
    bench = _bench()
    columns = ["data-free", "torchvision-colour", "processes-colour", "threads"]  # each loader, colour or not
    args = ["--device", "cpu", "--workdir", str(tmp_path), "--images", "16", "--image-size", "32", "--batch-size", "8"]
    args += ["--epochs", "2", "--workers", "1", "--models", "--scaling"]
    args += ["--views", "resnet18", "--view-sizes", "24", "16"]
    results = bench.main([*args, "--views-columns", *columns])
    out = capsys.readouterr().out
    views = results["views"]["resnet18"]
    assert list(views) == columns
    assert all(summary["samples_per_sec"] > 0 for summary in views.values())
    assert not results["training"]
    assert not results["scaling"]
    assert "DINO's 8 views (2 x 24 + 6 x 16), the network on every view" in out
    assert "| model | " + " | ".join(bench.VIEW_COLUMNS[c] for c in columns) + " |" in out
    assert "| resnet18 |" in out
