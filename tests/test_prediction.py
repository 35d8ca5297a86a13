"""``PredictionWriter``: one row per sample, in the split's order, from Python, the CLI and two DDP processes."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kinds import CLASSES, kind_target, make_kind_database
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from prediction_script import FailingModel, LabelModel, OneHotModel, RawModel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from lightning_fastdata import FastImageDataModule, InvalidArgumentError, PredictionWriter, SampleError
from lightning_fastdata.cli import lightning_cli, main
from lightning_fastdata.prediction_parts import agree
from lightning_fastdata.prediction_rows import per_sample

SCRIPT = Path(__file__).with_name("prediction_script.py")

#: the session database's predict split (`val`: no `test`): 3 classes x 3 images, an odd number
SAMPLES = 9

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")


def _dm(database: Path, **kwargs: Any) -> FastImageDataModule:
    return FastImageDataModule(str(database), **{"image_size": 16, "batch_size": 4, "num_workers": 0, **kwargs})


def _predict(model: LightningModule, dm: FastImageDataModule, writer: PredictionWriter) -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[writer],
    )
    trainer.predict(model, datamodule=dm, return_predictions=False)


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _leftovers(folder: Path) -> list[str]:
    """Hidden files a writer may leave in ``folder``: part files and temporary outputs."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _check_class_rows(rows: list[dict[str, Any]], database: Path) -> None:
    """Every sample once, in the split's order, each named by its source and given the class of its folder."""
    dm = _dm(database)
    sources = dm.predict_sources()
    assert len(rows) == len(sources) == SAMPLES
    assert [int(row["index"]) for row in rows] == list(range(SAMPLES))
    assert [row["source"] for row in rows] == sources
    for row in rows:
        folder = Path(row["source"]).parent.name
        assert row["class"] == folder
        assert int(row["label"]) == dm.classes.index(folder)


def test_logits_to_csv_name_each_file_and_its_class(database: Path, tmp_path: Path) -> None:
    """Logits of shape (N, classes) give one CSV row per sample: index, source, arg-max label, class name."""
    out = tmp_path / "preds" / "predictions.csv"
    _predict(OneHotModel(), _dm(database), PredictionWriter(str(out)))
    assert out.read_text().splitlines()[0] == "index,source,label,class"
    _check_class_rows(_csv(out), database)
    assert _leftovers(out.parent) == []


@pytest.mark.parametrize("engine", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_rows_follow_the_samples_on_each_engine(database: Path, tmp_path: Path, engine: str) -> None:
    """Two loader threads or worker processes build batches ahead: each row still names its own sample."""
    out = tmp_path / "predictions.csv"
    dm = _dm(database, batch_size=2, num_workers=2, engine=engine)
    _predict(OneHotModel(), dm, PredictionWriter(str(out)))
    _check_class_rows(_csv(out), database)


def test_class_indices_to_jsonl(database: Path, tmp_path: Path) -> None:
    """An int tensor of shape (N,) is a class index per sample; a `.jsonl` path writes JSON Lines."""
    out = tmp_path / "predictions.jsonl"
    _predict(LabelModel(), _dm(database), PredictionWriter(str(out)))
    rows = _jsonl(out)
    assert set(rows[0]) == {"index", "source", "label", "class"}
    _check_class_rows(rows, database)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_other_outputs_are_written_raw(database: Path, tmp_path: Path, fmt: str) -> None:
    """An output that is no class (here a mapping of tensors) is written per sample as a JSON value."""
    out = tmp_path / "predictions.txt"
    _predict(RawModel(), _dm(database), PredictionWriter(str(out), format=fmt))  # type: ignore[arg-type]
    dm = _dm(database)
    rows = _csv(out) if fmt == "csv" else _jsonl(out)
    assert len(rows) == SAMPLES
    for index, row in enumerate(rows):
        assert set(row) == {"index", "source", "output"}
        label = dm.classes.index(Path(row["source"]).parent.name)
        output = json.loads(row["output"]) if fmt == "csv" else row["output"]
        assert output == {"twice": 2 * label, "pair": [float(label), float(label + 1)]}
        assert int(row["index"]) == index


def test_plain_dataloaders_get_index_and_label_rows(tmp_path: Path) -> None:
    """Without a DataModule the rows have the dataset's index and the output, no source or class name."""
    out = tmp_path / "predictions.csv"
    labels = torch.tensor([2, 0, 1, 1, 0])
    loader = DataLoader(TensorDataset(torch.zeros(5, 3, 4, 4), labels), batch_size=2)
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[PredictionWriter(str(out))],
    )  # fmt: skip
    trainer.predict(LabelModel(), dataloaders=loader, return_predictions=False)
    assert _csv(out) == [{"index": str(i), "label": str(int(label))} for i, label in enumerate(labels)]


def test_a_plain_subset_gets_the_index_of_the_sample_it_views(tmp_path: Path) -> None:
    """A plain `DataLoader` of a `Subset`: each row has the index in the dataset the subset views, in its order."""
    out = tmp_path / "predictions.csv"
    labels = torch.tensor([2, 0, 1, 1, 0])
    loader = DataLoader(Subset(TensorDataset(torch.zeros(5, 3, 4, 4), labels), [4, 0, 2]), batch_size=2)
    _predict_loader(loader, out)
    assert _csv(out) == [{"index": str(i), "label": str(int(labels[i]))} for i in (4, 0, 2)]


def test_what_a_batch_output_means() -> None:
    """Logits need as many columns as classes; class indices an int vector; anything else is raw, or an error."""
    classes = ["a", "b", "c"]
    assert per_sample(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]), 2, classes) == (b"c", [1, 0])
    assert per_sample(torch.tensor([2, 0]), 2, classes) == (b"c", [2, 0])
    assert per_sample(torch.tensor([[0.0, 2.0], [3.0, 0.0]]), 2, classes) == (b"r", [[0.0, 2.0], [3.0, 0.0]])
    assert per_sample(torch.tensor([[0.0, 2.0, 1.0]]), 1, None) == (b"r", [[0.0, 2.0, 1.0]])  # no classes known
    assert per_sample(torch.tensor([0.5, float("nan")]), 2, classes) == (b"r", [0.5, None])
    assert per_sample(["x", "y"], 2, classes) == (b"r", ["x", "y"])
    with pytest.raises(InvalidArgumentError, match=r"cannot split .*\(Tensor of shape \(3,\)\) into the batch's 2"):
        per_sample(torch.tensor([1.0, 2.0, 3.0]), 2, classes)


def test_arguments_are_checked(tmp_path: Path) -> None:
    """The format comes from the suffix unless given; an unknown suffix, a bad format or a folder is refused."""
    assert PredictionWriter(str(tmp_path / "p.CSV")).format == "csv"
    assert PredictionWriter(str(tmp_path / "p.ndjson")).format == "jsonl"
    assert PredictionWriter(str(tmp_path / "p.out"), format="jsonl").format == "jsonl"
    with pytest.raises(InvalidArgumentError, match=r"`output_path` '.*p\.json' does not say the format.*`\.jsonl`"):
        PredictionWriter(str(tmp_path / "p.json"))
    with pytest.raises(InvalidArgumentError, match=r"`format` must be 'csv', 'jsonl' or None .*got 'parquet'"):
        PredictionWriter(str(tmp_path / "p.csv"), format="parquet")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"`output_path` '.*' is a folder"):
        PredictionWriter(str(tmp_path), format="csv")


def test_a_failed_run_publishes_nothing(database: Path, tmp_path: Path) -> None:
    """A run that fails after writing a batch leaves no new file and no part file; an older file stays as it was."""
    out = tmp_path / "predictions.csv"
    with pytest.raises(RuntimeError, match="failed on batch 1"):
        _predict(FailingModel(), _dm(database), PredictionWriter(str(out)))
    assert not out.exists()
    assert _leftovers(tmp_path) == []
    out.write_text("an earlier run's file\n")
    with pytest.raises(RuntimeError, match="failed on batch 1"):
        _predict(FailingModel(), _dm(database), PredictionWriter(str(out)))
    assert out.read_text() == "an earlier run's file\n"
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_an_interrupted_run_publishes_nothing(database: Path, tmp_path: Path) -> None:
    """Ctrl-C (a `KeyboardInterrupt` in the predict loop) after a written batch leaves no file and no part file."""
    out = tmp_path / "predictions.csv"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(database), str(out), "interrupt"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-4000:]  # Lightning's graceful shutdown
    assert "Detected KeyboardInterrupt" in proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_skip_policy_is_refused_before_predicting(database: Path, tmp_path: Path) -> None:
    """With `on_bad_sample='skip'` a batch may lose samples, so rows could not be matched: refused at setup."""
    out = tmp_path / "predictions.csv"
    with pytest.raises(InvalidArgumentError, match=r"`on_bad_sample='skip'`.*Predict with `on_bad_sample='raise'`"):
        _predict(OneHotModel(), _dm(database, on_bad_sample="skip"), PredictionWriter(str(out)))
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def _write_rows(writer: PredictionWriter, *ranks: list[tuple[int, bytes, Any]]) -> None:
    """Part files of ``(index, kind, value)`` rows, one per rank."""
    for rank, rows in enumerate(ranks):
        writer.part_path(rank).write_bytes(
            b"".join(b"%d\t%s\t%s\n" % (i, k, json.dumps(v).encode()) for i, k, v in rows)
        )


def test_merge_keeps_each_sample_once_in_order(tmp_path: Path) -> None:
    """Parts of interleaved ranks, padded with a repeat and out of order, merge into each sample once, in order."""
    writer = PredictionWriter(str(tmp_path / "p.jsonl"))
    rank0 = [(0, b"c", 1), (2, b"c", 0), (4, b"r", [4]), (6, b"c", 2)]
    rank1 = [(3, b"c", 1), (1, b"c", 2), (5, b"c", 0), (0, b"c", 1)]  # the last one repeats sample 0: padding
    _write_rows(writer, rank0, rank1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the padding repeat is no error and no warning: every sample is there
        assert writer._parts.merge(2, writer._rows, samples=7) == 7
    rows = _jsonl(tmp_path / "p.jsonl")
    assert rows == [
        {"index": 0, "label": 1},
        {"index": 1, "label": 2},
        {"index": 2, "label": 0},
        {"index": 3, "label": 1},
        {"index": 4, "output": [4]},
        {"index": 5, "label": 0},
        {"index": 6, "label": 2},
    ]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("first", "again", "shown"),
    [
        ((b"c", 1), (b"c", 2), "class 1 by rank 0 and class 2 by rank 1"),
        ((b"v", [1.0, 2.0]), (b"v", [1.0, 2.5]), r"values \[1.0, 2.0\] by rank 0 and values \[1.0, 2.5\] by rank 1"),
        ((b"r", {"p": 0.5}), (b"r", {"q": 0.5}), r'output \{"p": 0.5\} by rank 0 and output \{"q": 0.5\} by rank 1'),
        ((b"c", 1), (b"r", [1.0]), r"class 1 by rank 0 and output \[1.0\] by rank 1"),
        ((b"m", [0, 2]), (b"m", [0]), r"classes \[0, 2\] by rank 0 and classes \[0\] by rank 1"),
    ],
    ids=["class", "float beyond noise", "keys", "kind", "multilabel"],
)
def test_repeats_that_disagree_are_refused_and_the_parts_kept(
    tmp_path: Path, first: tuple[bytes, Any], again: tuple[bytes, Any], shown: str
) -> None:
    """A sample predicted twice with different results (a random `predict_step`, another sample under that index on
    another rank) is a `SampleError` naming the sample, its file and both predictions: the file could hold either.
    Nothing is written and the parts stay, as for missing samples. Before, the second was dropped silently."""
    out = tmp_path / "p.csv"
    writer = PredictionWriter(str(out))
    writer._rows.sources = ["a.jpg", "b.jpg", "c.jpg"]
    _write_rows(writer, [(0, b"c", 0), (2, *first)], [(1, b"c", 1), (2, *again)])
    match = rf"^sample 2, 'c.jpg', was predicted twice with different results: {shown}\. .*part files are kept"
    with pytest.raises(SampleError, match=match):
        writer._parts.merge(2, writer._rows, samples=3)
    assert not out.exists()
    assert _leftovers(tmp_path) == [".p.csv.rank0.part", ".p.csv.rank1.part"]


def test_repeats_within_float_noise_agree(tmp_path: Path) -> None:
    """A padded sample predicted again in another batch may differ by float noise (a GPU's other summation order,
    TF32, bf16-mixed): within two steps of bfloat16 of the prediction's largest value it is the same prediction."""
    assert agree([8.0, 0.01, -3.0], [8.0 + 8 * 2**-7, 0.01 + 0.1, -3.0])  # one bf16 step at 8, noise near 0
    assert not agree([8.0, 0.01, -3.0], [8.0, 0.01 + 0.2, -3.0])
    assert agree({"p": [1e-6]}, {"p": [1.01e-6]})  # relative to the values' own scale
    assert not agree({"p": [1e-6]}, {"p": [2e-6]})
    assert agree([None, 1], [None, 1])  # a NaN is written as None; integers must be equal
    assert not agree([2, 1], [1, 1])
    assert not agree([1.0, 2.0], [1.0, 2.0, 3.0])
    writer = PredictionWriter(str(tmp_path / "p.jsonl"))
    _write_rows(writer, [(0, b"v", [8.0, 1.0]), (1, b"v", [2.0, 2.0])], [(2, b"v", [0.5, 0.5]), (0, b"v", [8.03, 1.0])])
    assert writer._parts.merge(2, writer._rows, samples=3) == 3
    assert _jsonl(tmp_path / "p.jsonl")[0] == {"index": 0, "value": [8.0, 1.0]}  # the first row is kept


def test_more_repeats_than_the_padding_warn(tmp_path: Path) -> None:
    """More repeated rows than `DistributedSampler` pads the ranks with (here every sample read by both ranks) warn
    with the count and the likely cause; the file has each sample once."""
    writer = PredictionWriter(str(tmp_path / "p.jsonl"))
    _write_rows(writer, [(i, b"c", i % 3) for i in range(5)], [(i, b"c", i % 3) for i in range(5)])
    with pytest.warns(UserWarning, match=r"5 prediction rows repeat samples already predicted, more than the 1 repeats"
                      r" `DistributedSampler` pads 2 processes with for 5 samples.*`num_replicas=1`"):  # fmt: skip
        assert writer._parts.merge(2, writer._rows, samples=5) == 5
    assert [row["index"] for row in _jsonl(tmp_path / "p.jsonl")] == [0, 1, 2, 3, 4]
    _write_rows(writer, [(0, b"c", 0), (1, b"c", 1), (0, b"c", 0)])  # one process: no padding at all
    with pytest.warns(UserWarning, match=r"1 prediction row repeats a sample already predicted, more than the 0"):
        writer._parts.merge(1, writer._rows, samples=2)


@pytest.mark.parametrize(
    ("subset", "indices"),
    [
        (lambda ds: Subset(ds, [8, 9, 10, 11]), [8, 9, 10, 11]),
        (lambda ds: Subset(Subset(ds, range(4, 24)), [19, 0, 7, -1]), [23, 4, 11, 23]),
    ],
    ids=["subset", "nested subsets"],
)
def test_a_subset_names_the_files_it_views(database: Path, tmp_path: Path, subset: Any, indices: list[int]) -> None:
    """Predicting a `Subset` of the split (which the writer's error advises), each row has the index and file of the
    sample the subset views, through nested subsets, and that sample's prediction. They named files 0-3 before."""
    out = tmp_path / "predictions.csv"
    dm = _dm(database, predict_split="train")
    dm.predict_dataset = subset(dm.build_dataset("train", dm.val_transform()))
    _predict(LabelModel(), dm, PredictionWriter(str(out)))
    rows = _csv(out)
    sources = dm.sources("train")
    assert [row["source"] for row in rows] == [sources[i] for i in indices]
    assert [int(row["index"]) for row in rows] == indices
    for row in rows:  # the label predicted is that of the file named: the row is that sample's
        assert row["class"] == Path(row["source"]).parent.name


def test_a_subset_of_another_split_names_that_splits_files(database: Path, tmp_path: Path) -> None:
    """A predict dataset of one's own over `train` while `predict_split` is `val`: the rows name `train`'s files, of
    the samples viewed (they named `val`'s files of those indices)."""
    out = tmp_path / "predictions.csv"
    dm = _dm(database, predict_split="val")
    dm.predict_dataset = Subset(dm.build_dataset("train", dm.val_transform()), [8, 9, 10, 11])
    _predict(LabelModel(), dm, PredictionWriter(str(out)))
    rows = _csv(out)
    sources = dm.sources("train")
    assert [row["source"] for row in rows] == [sources[i] for i in (8, 9, 10, 11)]
    for row in rows:
        assert row["class"] == Path(row["source"]).parent.name


def _write_parts(writer: PredictionWriter, *ranks: list[int]) -> None:
    """Part files of class rows (label 0) for the sample indices of each rank."""
    for rank, indices in enumerate(ranks):
        writer.part_path(rank).write_bytes(b"".join(b"%d\tc\t0\n" % i for i in indices))


def test_a_merge_missing_samples_raises_and_keeps_the_parts(tmp_path: Path) -> None:
    """Parts missing 2 of 8 samples (padded with a repeat) write nothing: the error counts and names them, and the
    parts stay; samples beyond the split are refused too."""
    out = tmp_path / "p.csv"
    out.write_text("an earlier run's file\n")
    writer = PredictionWriter(str(out))
    _write_parts(writer, [0, 2, 4, 0], [1, 3, 7])
    match = (
        r"2 of 8 samples of the predicted split have no prediction \(indices \[5, 6\]\): `output_path` '.*p\.csv'"
        r" was not written; the part files are kept: .*\.p\.csv\.rank0\.part.*`drop_last=True`"
    )
    with pytest.raises(RuntimeError, match=match):
        writer._parts.merge(2, writer._rows, samples=8)
    assert out.read_text() == "an earlier run's file\n"
    assert _leftovers(tmp_path) == [".p.csv.rank0.part", ".p.csv.rank1.part"]
    _write_parts(writer, [0, 1, 2, 3], [4, 5, 6, 7, 9])
    with pytest.raises(RuntimeError, match=r"name an index beyond the split's 8 samples \(indices \[9\]\)"):
        writer._parts.merge(2, writer._rows, samples=8)


def _predict_loader(loader: DataLoader, out: Path, **options: Any) -> None:
    writer = PredictionWriter(str(out))
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[writer],
        **options,
    )  # fmt: skip
    trainer.predict(LabelModel(), dataloaders=loader, return_predictions=False)


def test_a_sampler_that_leaves_samples_out_raises_but_a_limit_on_purpose_does_not(tmp_path: Path) -> None:
    """A sampler of one's own giving every other sample leaves 3 of 6 out: the run raises and keeps its part. Under
    `limit_predict_batches` only the batches that ran are written, with no error."""
    out = tmp_path / "predictions.csv"
    dataset = TensorDataset(torch.zeros(6, 3, 4, 4), torch.arange(6))
    half = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    with pytest.raises(RuntimeError, match=r"^3 of 6 samples .* no prediction \(indices \[1, 3, 5\]\)"):
        _predict_loader(DataLoader(dataset, batch_size=2, sampler=half), out)
    assert not out.exists()
    assert _leftovers(tmp_path) == [".predictions.csv.rank0.part"]
    _predict_loader(DataLoader(dataset, batch_size=2), out, limit_predict_batches=1)
    assert _csv(out) == [{"index": "0", "label": "0"}, {"index": "1", "label": "1"}]
    assert _leftovers(tmp_path) == []


def test_a_missing_part_names_shared_storage(tmp_path: Path) -> None:
    """Rank zero missing another rank's part (another node's disk) says the output needs shared storage."""
    writer = PredictionWriter(str(tmp_path / "p.csv"))
    writer.part_path(0).write_bytes(b"0\tc\t1\n")
    with pytest.raises(FileNotFoundError, match=r"\.p\.csv\.rank1\.part.*must be on storage that every node shares"):
        writer._parts.merge(2, writer._rows)
    assert not (tmp_path / "p.csv").exists()


def test_cli_parses_the_callback(database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trainer.callbacks+=lightning_fastdata.PredictionWriter` with its arguments makes the Trainer's writer."""
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    out = tmp_path / "predictions.jsonl"
    cli = lightning_cli(
        [
            "--model=prediction_script.OneHotModel",
            "--data=lightning_fastdata.FastImageDataModule",
            f"--data.data_dir={database}",
            "--trainer.logger=false",
            "--trainer.callbacks+=lightning_fastdata.PredictionWriter",
            f"--trainer.callbacks.output_path={out}",
            "--trainer.callbacks.format=jsonl",
        ],
        run=False,
    )
    assert isinstance(cli, LightningCLI)
    writers = [cb for cb in cli.trainer.callbacks if isinstance(cb, PredictionWriter)]
    assert len(writers) == 1
    assert writers[0].output_path == out
    assert writers[0].format == "jsonl"


def test_the_predict_command_writes_the_file(
    database: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lightning-fastdata predict ... --trainer.callbacks+=lightning_fastdata.PredictionWriter` writes the rows."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    out = tmp_path / "predictions.csv"
    code = main(
        [
            "predict",
            "--model=prediction_script.OneHotModel",
            "--data=lightning_fastdata.FastImageDataModule",
            f"--data.data_dir={database}",
            "--data.image_size=16",
            "--data.batch_size=4",
            "--data.num_workers=0",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=lightning_fastdata.PredictionWriter",
            f"--trainer.callbacks.output_path={out}",
            "--return_predictions=false",
        ]
    )
    assert code == 0, capsys.readouterr().err
    _check_class_rows(_csv(out), database)


def test_the_command_list_says_how_to_keep_predictions(capsys: pytest.CaptureFixture[str]) -> None:
    """`lightning-fastdata --help` names the writer beside the predict command."""
    with pytest.raises(SystemExit):
        main(["--help"])
    predict = capsys.readouterr().out.split("predict ", 1)[1]
    assert "lightning_fastdata.PredictionWriter" in " ".join(predict.split())


@pytest.mark.slow
def test_ddp_writes_each_sample_once_in_order(database: Path, tmp_path: Path) -> None:
    """Two DDP processes on an odd number of samples: the sampler pads one; the file has each sample once, in order."""
    out = tmp_path / "predictions.csv"
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(database), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    predicted = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert predicted == [(SAMPLES + 1) // 2] * 2  # one sample predicted twice
    assert "already predicted" not in proc.stdout + proc.stderr  # the padding's repeat agrees: no warning
    _check_class_rows(_csv(out), database)
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_ddp_ranks_that_disagree_on_the_padded_sample_publish_nothing(database: Path, tmp_path: Path) -> None:
    """Two DDP processes whose predictions of the sample the sampler pads with differ (each adds its rank to the
    label): rank zero refuses the merge naming the sample and both classes, the other rank fails with it, nothing is
    written, and the parts stay for a look. Before, rank 0's prediction was written and rank 1's dropped silently."""
    out = tmp_path / "predictions.csv"
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(database), str(out), "disagree"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stderr[-4000:]
    source = _dm(database).predict_sources()[0]
    assert f"SampleError: sample 0, {source!r}, was predicted twice with different results" in proc.stderr
    assert not out.exists()
    assert _leftovers(tmp_path) == [".predictions.csv.rank0.part", ".predictions.csv.rank1.part"]


def test_a_killed_merges_leftover_is_removed_and_a_live_ones_kept(database: Path, tmp_path: Path) -> None:
    """A `.NAME.<pid>.tmp` nobody holds (its merge was killed) goes at the next merge; one a live merge holds stays."""
    fcntl = pytest.importorskip("fcntl")
    out = tmp_path / "predictions.csv"
    dead, live = tmp_path / ".predictions.csv.999999.tmp", tmp_path / ".predictions.csv.999998.tmp"
    dead.write_text("index,label\n0,")
    live.write_text("index,label\n")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        _predict(OneHotModel(), _dm(database), PredictionWriter(str(out)))
        assert out.is_file()
        assert _leftovers(tmp_path) == [live.name]


@pytest.fixture(scope="module")
def kind_databases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A multilabel and a float database, each with a ``test`` split of 5 images: the predict split."""
    root = tmp_path_factory.mktemp("prediction_kinds")
    return {kind: make_kind_database(root / kind, kind, {"train": 4, "test": 5}) for kind in ("multilabel", "float")}


class _TargetsModel(LightningModule):
    """Predicts each sample's own targets: multi-hot ones as logits (+4 / -4), float ones as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        targets = batch[1]
        return targets * 8 - 4 if self.trainer.datamodule.target_kind == "multilabel" else targets


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_multilabel_logits_are_written_as_the_classes_above_the_threshold(
    kind_databases: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    """A multilabel DataModule's (N, C) logits: the classes whose sigmoid is above ``threshold``, indices and names."""
    out = tmp_path / f"predictions.{fmt}"
    dm = _dm(kind_databases["multilabel"])
    _predict(_TargetsModel(), dm, PredictionWriter(str(out), threshold=0.7))
    rows = _csv(out) if fmt == "csv" else _jsonl(out)
    assert list(rows[0]) == ["index", "source", "labels", "classes"]
    expected = [kind_target("multilabel", 4 + i) for i in range(5)]
    for i, row in enumerate(rows):
        labels, classes = (json.loads(row[k]) if fmt == "csv" else row[k] for k in ("labels", "classes"))
        assert classes == expected[i]
        assert labels == [CLASSES.index(name) for name in expected[i]]
    assert any(not row for row in expected)  # a sample of no class is an empty list


def test_float_outputs_are_written_as_values(kind_databases: dict[str, Path], tmp_path: Path) -> None:
    """A float DataModule's (N, K) output: each sample's K values in ``value``."""
    out = tmp_path / "predictions.csv"
    _predict(_TargetsModel(), _dm(kind_databases["float"]), PredictionWriter(str(out)))
    rows = _csv(out)
    assert list(rows[0]) == ["index", "source", "value"]
    for i, row in enumerate(rows):
        np.testing.assert_allclose(json.loads(row["value"]), kind_target("float", 4 + i), rtol=1e-6)


def test_a_float_output_under_its_names_and_the_threshold_checked(tmp_path: Path) -> None:
    """Named float values get a column each; one value a sample is a number; ``threshold`` must be in [0, 1]."""
    writer = PredictionWriter(str(tmp_path / "p.jsonl"))
    writer._kind, writer._dim, writer._rows.names = "float", 2, ["x", "y"]
    kind, values = per_sample(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 2, None, writer._target())
    assert writer._rows.row(0, kind, values[1]) == {"index": 0, "x": 3.0, "y": 4.0}
    assert per_sample(torch.tensor([0.5, 1.5]), 2, None, ("float", 1, 0.5)) == (b"v", [0.5, 1.5])
    assert per_sample(torch.tensor([[0.0, 2.0, -1.0]]), 1, ["a", "b", "c"], ("multilabel", 0, 0.5)) == (b"m", [[1]])
    with pytest.raises(InvalidArgumentError, match=r"`threshold` must be in \[0, 1\]"):
        PredictionWriter(str(tmp_path / "p.csv"), threshold=1.5)
