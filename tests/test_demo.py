"""``make demo``'s comparison (examples/demo.py) runs end to end on a tiny folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = {"input-bound", "balanced", "compute-bound"}


def test_demo_compares_imagefolder_and_fastimagedatamodule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both trainings run under LoaderMonitor; the side-by-side shows both verdicts, throughputs and the speed-up."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import demo

    result = demo.compare(
        tmp_path,
        classes=2,
        train_per_class=12,
        min_size=24,
        max_size=40,
        image_size=24,
        batch_size=4,
        epochs=2,
        workers=0,
    )
    slow, fast = result["imagefolder"], result["fastdata"]
    assert slow["verdict"] in VERDICTS
    assert fast["verdict"] in VERDICTS
    assert slow["measured_steps"] == fast["measured_steps"] == 6  # 24 images / 4 per batch, warmup epoch left out
    assert result["speedup"] == pytest.approx(fast["samples_per_sec"] / slow["samples_per_sec"])
    table = demo.side_by_side(slow, fast)
    assert "ImageFolder  FastImageDataModule" in table
    verdict_row = next(line for line in table.splitlines() if line.strip().startswith("verdict"))
    assert verdict_row.split()[1:] == [slow["verdict"], fast["verdict"]]
    assert f"speed-up: {result['speedup']:.2f}x the samples/s of ImageFolder" in table
    for report in result["reports"]:
        assert json.loads((report / "loader_report.json").read_text())["summary"]["verdict"] in VERDICTS
    if pytest.importorskip("matplotlib"):
        assert all((report / "loader_report.png").is_file() for report in result["reports"])
