"""The examples that teach a task end to end: `examples/multilabel_tagger.py` (multi-label targets from a CSV) and
`examples/ssl_dino.py` (self-supervised DINO on several views of each image)."""

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


def test_the_dino_example_trains_a_student_on_large_then_small_views(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The DINO example's training step gets 2 large then 4 small normalized float32 views, its loss stays finite,
    and the student agrees more with the EMA teacher every epoch (a fixed seed: the same numbers every run)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["ssl_dino.py"])
    import ssl_dino

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: 2 threads per pytest worker on 2 cores ran 25x slower
    try:
        result = ssl_dino.main(["--out", str(tmp_path), "--images-per-class", "64", "--epochs", "3"])
    finally:
        torch.set_num_threads(threads)
    dm = result["datamodule"]
    assert (dm.num_large_views, dm.num_small_views) == (2, 4)
    views = result["views"]
    assert isinstance(views, list)
    assert [tuple(v.shape) for v in views] == [(32, 3, 48, 48)] * 2 + [(32, 3, 24, 24)] * 4
    mean, std = torch.tensor(dm.hparams.mean).view(1, 3, 1, 1), torch.tensor(dm.hparams.std).view(1, 3, 1, 1)
    for view in views:
        assert view.dtype == torch.float32
        assert view.device.type == "cpu"
        assert view.min() < 0  # normalized, not [0, 1] or uint8
        pixels = view * std + mean
        assert pixels.min() >= -1e-4
        assert pixels.max() <= 1 + 1e-4
        assert pixels.max() - pixels.min() > 0.5
    assert not torch.equal(views[0], views[1])  # two different crops of each image
    losses, agreement = result["losses"], result["agreement"]
    assert len(losses) == len(agreement) == 3
    assert all(math.isfinite(loss) for loss in losses)
    assert agreement[0] < agreement[1] < agreement[2]
