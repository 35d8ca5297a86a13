"""The examples that teach a task end to end: ``examples/multilabel_tagger.py`` (multi-label targets from a CSV) and
``examples/ssl_dino.py`` (self-supervised views)."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_multilabel_tagger_trains_on_the_tags_its_csv_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The tagger converts a ``red|blue`` CSV with ``targets="multilabel"``, trains on multi-hot ``float32 [B, 4]``
    batches whose rows are each image's listed tags, and its validation loss falls."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["multilabel_tagger.py"])
    import multilabel_tagger

    result = multilabel_tagger.main(["--out", str(tmp_path), "--images", "120", "--epochs", "3"])
    dm = result["datamodule"]
    assert result["classes"] == sorted(multilabel_tagger.TAGS)
    assert dm.target_kind == "multilabel"
    targets = result["targets"]
    assert targets.dtype == torch.float32
    assert targets.shape == (len(targets), 4)
    with open(tmp_path / "tags.csv") as fh:
        listed = {row["path"]: set(filter(None, row["label"].split("|"))) for row in csv.DictReader(fh)}
    sources = dm.sources("train")
    held_out = dm.val_dataset.indices[: len(targets)]  # the first validation batch, in order
    for row, index in zip(targets.tolist(), held_out.tolist(), strict=True):
        assert {name for name, hot in zip(dm.classes, row, strict=True) if hot == 1.0} == listed[sources[index]]
    assert set(targets.flatten().tolist()) <= {0.0, 1.0}
    losses = result["val_losses"]
    assert len(losses) == 3
    assert losses[-1] < losses[0]


def test_the_dino_example_trains_on_a_list_of_views_large_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``examples/ssl_dino.py``: its training batches are lightly's and solo-learn's ``(views, targets)``, 2 large
    views then 4 small ones, normalized ``float32`` (coloured per view); its DINO loss stays finite."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["ssl_dino.py"])
    import ssl_dino

    result = ssl_dino.main(["--out", str(tmp_path), "--images", "8", "--epochs", "2"])
    views, targets = result["batch"][0], result["batch"][1]
    assert isinstance(views, list)
    assert [tuple(v.shape[1:]) for v in views] == [(3, 48, 48)] * 2 + [(3, 24, 24)] * 4
    assert all(v.dtype == torch.float32 for v in views)
    assert all(-3.0 < float(v.mean()) < 3.0 for v in views)  # normalized, not 0-255
    assert targets.shape == (views[0].shape[0],)
    assert result["datamodule"].num_large_views == 2
    assert result["datamodule"].num_small_views == 4
    losses = result["losses"]
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)
