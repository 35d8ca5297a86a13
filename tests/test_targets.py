"""Target kinds (``class``, ``multilabel``, ``float``, ``none``): the module's helpers, and what list files and
datasets of each kind convert into."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

from lightning_fastdata import ConversionSummary, LmdbImageDataset, SourceLayoutError, convert, convert_dataset
from lightning_fastdata.errors import CorruptRecordError
from lightning_fastdata.store import targets as tg
from lightning_fastdata.store.format import dump_meta, load_meta
from lightning_fastdata.store.targets import (
    AmbiguousTargetsError,
    SplitTargets,
    TargetColumn,
    TargetSpec,
    check_target,
    infer_list_kind,
    split_label,
)
from lightning_fastdata.synthetic import _render


def _image(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(_render(seed % 3, 3, 24, 32, rng))


def _images(folder: Path, count: int) -> list[str]:
    """Write ``count`` small JPEGs ``folder/<n>.jpg``; their names."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        _image(n).save(folder / f"{n}.jpg", quality=90)
    return [f"{n}.jpg" for n in range(count)]


def _run(src: Path | list, dst: Path, **kwargs) -> ConversionSummary:
    kwargs.setdefault("num_workers", 0)
    kwargs.setdefault("progress", False)
    if isinstance(src, Path):
        return convert(src, dst, **kwargs)
    return convert_dataset(src, dst, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The module's helpers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("error")  # 1e39 once warned "overflow encountered in cast" on its way to the refusal
def test_check_target_returns_what_the_writer_stores_or_says_why_not():
    """``check_target`` gives an index, sorted distinct indices, K finite floats or None; anything else a reason."""
    assert check_target(TargetSpec("class"), np.int64(3)) == 3
    ml = TargetSpec("multilabel", num_classes=4)
    assert check_target(ml, ["dog", 3, "cat", "dog"], {"cat": 0, "dog": 1}) == (0, 1, 3)
    assert check_target(ml, np.array([2, 0])) == (0, 2)
    assert check_target(ml, []) == ()
    assert check_target(TargetSpec("float", dim=2), np.array([0.5, -1], dtype=np.float32)) == (0.5, -1.0)
    assert check_target(TargetSpec("float", dim=1), "0.25") == (0.25,)
    assert check_target(TargetSpec("none"), "anything") is None
    refused = [
        (TargetSpec("class"), True, "non-negative int"),
        (TargetSpec("class"), -1, "non-negative int"),
        (TargetSpec("class"), 1.0, "non-negative int"),
        (ml, [4], "outside the 4 classes"),
        (ml, ["bird"], "not one of the classes"),
        (ml, [True], "not one of the classes"),
        (ml, np.array([1.0, 0.0, 1.0, 0.0], dtype=np.float32), "a multi-hot vector: give each sample's class indices"),
        (TargetSpec("float", dim=1), float("nan"), "not a finite float32"),
        (TargetSpec("float", dim=1), 1e39, "not a finite float32"),
        (TargetSpec("float", dim=1), "abc", "not a number"),
        (TargetSpec("float", dim=1), None, "not a number"),
        (TargetSpec("float", dim=2), [1.0], "1 value"),
    ]
    for spec, value, reason in refused:
        with pytest.raises(ValueError, match=reason):
            check_target(spec, value)


@pytest.mark.parametrize(
    ("labels", "kind"),
    [
        (["cat", "dog"], "class"),
        (["0", "3", ""], "class"),
        (["0.5", "cat"], "class"),  # not all numbers: names
        (["cat", "dog", "7", "Na", "NONE"], "class"),  # mostly names: `Na` and `NONE` are names to pandas too
        (["1", "cat", "dog"], "class"),  # one number is not "mostly numbers"
        ([], "class"),
    ],
)
def test_infer_list_kind_reads_classes_where_that_is_unambiguous(labels, kind):
    """Names, integer labels and mixed labels are classes."""
    assert infer_list_kind(labels, "list.csv") == kind


@pytest.mark.parametrize(
    ("labels", "separator", "match"),
    [
        (["0.374", "1"], "|", "numbers, not all class indices .'0.374'.: pass `--targets float`"),
        (["23.5", "41.25", "nan"], "|", "numbers, not all class indices .'23.5'.: pass `--targets float`"),
        (["1", "2", "NA"], "|", "numbers, not all class indices .'NA'."),  # a gap in values, not a class `NA`
        (["1.0", "10.0", "2.0"], "|", "not all class indices .'1.0'."),  # would be classes '1.0' < '10.0' < '2.0'
        (["-3", "4"], "|", "not all class indices .'-3'."),
        (["1", "2", "#N/A"], "|", "not all class indices .'#N/A'."),  # one of pandas' missing markers
        (["1", "2", "inf"], "|", "not all class indices .'inf'."),  # a float to pandas, not a missing value
        (["1", "2", "3", "cat"], "|", r"mostly numbers .3 of 4., but 1 is not: row 4 'cat'\. Correct those rows"),
        (["0.5", "1.5", "-", "2", "?"], "|", r"mostly numbers .3 of 5., but 2 are not: row 3 '-', row 5 '\?'\."),
        (["1", "2", "NONE"], "|", "mostly numbers .2 of 3., but 1 is not: row 3 'NONE'"),  # pandas: `None` only
        ([["a", "b"], "c"], "|", "is a list: pass `--targets multilabel`"),
        (["[a, b]"], "|", "is a list: pass `--targets multilabel`"),
        (["cat|outdoor", "dog"], "|", "holds the separator '|': pass `--targets multilabel`"),
        (["cat;outdoor"], ";", "holds the separator ';'"),
    ],
)
def test_infer_list_kind_refuses_labels_of_another_kind_in_one_line(labels, separator, match):
    """Floats, lists and separated names are refused in one line naming `--targets`."""
    with pytest.raises(AmbiguousTargetsError, match=match) as err:
        infer_list_kind(labels, "list.csv", separator)
    assert "\n" not in str(err.value)
    assert "`--targets class`" in str(err.value)
    assert isinstance(err.value, SourceLayoutError)


def test_the_missing_markers_are_pandas_defaults_matched_as_pandas_matches_them():
    """pandas' default ``na_values`` are missing values, case and all; ``-``, ``?``, ``inf`` and ``NAN`` are not."""
    pandas_defaults = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                       "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]  # fmt: skip
    assert sorted(tg.MISSING_MARKERS) == sorted(pandas_defaults)
    assert all(tg.is_missing(marker) for marker in pandas_defaults)
    assert not any(tg.is_missing(text) for text in ["-", "?", "inf", "NAN", "Na", "none", "NONE", "n/A", "0"])


def test_a_mostly_numeric_label_column_names_at_most_five_rows_that_are_not_numbers():
    """38 numbers, ``n/a`` (missing) and 7 words: refused in one line naming the first 5 rows (as given) and a count;
    the missing value is not among them."""
    labels = [f"{0.1 * n}" for n in range(38)] + ["n/a"] + [f"word{n}" for n in range(7)]
    rows = list(range(2, 2 + len(labels)))
    with pytest.raises(AmbiguousTargetsError) as err:
        infer_list_kind(labels, "list.csv", rows=rows)
    message = str(err.value)
    assert "\n" not in message
    assert "the labels are mostly numbers (38 of 46), but 7 are not: row 41 'word0', row 42 'word1'," in message
    assert "row 45 'word4' and 2 more." in message
    assert "'n/a'" not in message
    assert "`--targets float`" in message
    assert "`--targets class`" in message


def test_split_label_reads_separated_names_json_lists_and_bracketed_text():
    """``a|b``, ``["a", "b"]`` and ``[a, 'b']`` are the same names; empty parts and an empty label name nothing."""
    assert split_label("a| b |") == ["a", "b"]
    assert split_label(["a", " b"]) == ["a", "b"]
    assert split_label("[a, 'b']") == ["a", "b"]
    assert split_label("a;b", ";") == ["a", "b"]
    assert split_label("") == split_label(None) == split_label("[]") == []


def test_target_column_round_trips_through_split_targets():
    """What ``TargetColumn`` writes, ``SplitTargets.gather`` reads back, with the statistics of ``split_meta``."""
    spec = TargetSpec("float", dim=2, names=("x", "y"))
    column = TargetColumn(spec)
    values = [(0.5, -1.0), (2.0, 3.0), (-4.0, 0.25)]
    assert [column.add(v) for v in values] == [-1, -1, -1]
    arrays = column.arrays("train")
    info = column.split_meta("train")
    assert info["target_stats"] == {"min": [-4.0, -1.0], "mean": [-0.5, 0.75], "max": [2.0, 3.0]}
    reader = SplitTargets(spec, "train", 3, info["targets_crc32"], "round-trip")
    out = np.empty((2, 2), dtype=np.float32)
    reader.gather(arrays, (1,), np.array([2, 0]), out)
    assert out.tolist() == [[-4.0, 0.25], [0.5, -1.0]]

    classes = TargetColumn(TargetSpec("class", num_classes=3))
    assert [classes.add(c) for c in (2, 0, 2)] == [2, 0, 2]
    assert classes.labels().tolist() == [2, 0, 2]
    assert classes.split_meta("train")["class_counts"] == [1, 0, 2]
    assert classes.arrays("train") == {}


def test_split_targets_gather_is_multi_hot_as_a_naive_loop():
    """Multi-hot rows gathered for any records equal a loop setting ``row[c] = 1`` for each class of each sample."""
    rng = np.random.default_rng(0)
    spec = TargetSpec("multilabel", num_classes=7)
    samples = [tuple(sorted(set(rng.integers(0, 7, size=rng.integers(0, 5)).tolist()))) for _ in range(200)]
    column = TargetColumn(spec)
    for sample in samples:
        column.add(sample)
    info = column.split_meta("train")
    assert info["class_counts"] == [sum(c in s for s in samples) for c in range(7)]
    reader = SplitTargets(spec, "train", len(samples), info["targets_crc32"], "multi-hot")
    for records in (np.arange(200), rng.integers(0, 200, size=64), np.array([5]), np.array([], dtype=np.int64)):
        out = np.full((len(records), 7), 9.0, dtype=np.float32)
        reader.gather(column.arrays("train"), (2,), records, out)
        expected = np.zeros((len(records), 7), dtype=np.float32)
        for row, record in enumerate(records):
            for c in samples[record]:
                expected[row, c] = 1.0
        assert np.array_equal(out, expected)


def test_split_targets_refuse_damaged_arrays_naming_the_split():
    """A target array of the wrong size, or whose bytes changed, is a ``CorruptRecordError`` naming the split."""
    spec = TargetSpec("float", dim=1)
    column = TargetColumn(spec)
    for value in (1.0, 2.0):
        column.add((value,))
    raw = column.arrays("val")
    crc = column.split_meta("val")["targets_crc32"]
    key = tg.targets_key("val")
    out = np.empty((1,), dtype=np.float32)
    with pytest.raises(CorruptRecordError, match=r"split 'val' of 'w1': its target array is 4 bytes where 8"):
        SplitTargets(spec, "val", 2, crc, "w1").gather({key: raw[key][:4]}, (3,), np.array([0]), out)
    flipped = bytes([raw[key][0] ^ 1]) + raw[key][1:]
    with pytest.raises(CorruptRecordError, match="split 'val' of 'w2': its target arrays fail their checksum"):
        SplitTargets(spec, "val", 2, crc, "w2").gather({key: flipped}, (4,), np.array([0]), out)


# ---------------------------------------------------------------------------------------------------------------
# List files
# ---------------------------------------------------------------------------------------------------------------


def test_float_labels_are_refused_without_targets_and_stored_as_values_with_float(tmp_path):
    """``path,label`` with ``0.374``-like labels: refused (not 3 classes); ``targets='float'`` stores the values."""
    names = _images(tmp_path, 3)
    src = tmp_path / "list.csv"
    src.write_text("path,label\n" + "".join(f"{n},{v}\n" for n, v in zip(names, ("0.374", "1.5", "2"), strict=True)))
    with pytest.raises(AmbiguousTargetsError, match="pass `--targets float`"):
        _run(src, tmp_path / "db")
    assert not (tmp_path / "db").exists()
    _run(src, tmp_path / "db", targets="float")
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.target_spec == TargetSpec("float", dim=1, names=("label",))
    assert ds.classes == []
    assert ds.targets == pytest.approx([0.374, 1.5, 2.0])
    assert ds[0][1].dtype.is_floating_point
    _run(src, tmp_path / "classes", targets="class")  # explicit: each distinct value a class, as before kinds
    assert LmdbImageDataset(tmp_path / "classes").classes == ["0.374", "1.5", "2"]


def test_a_numeric_column_with_stray_text_is_refused_and_converts_with_either_kind(tmp_path):
    """Issue 42's list: 38 numbers, ``n/a`` and ``high``. Refused without ``targets`` naming row 40 (not 40 classes);
    ``float`` stores the 38 values, skipping the missing one and the word with their reasons; ``class`` makes each
    distinct label a class named as written (``0.30``, never ``0.3`` or ``0.30000000000000004``)."""
    names = _images(tmp_path, 40)
    labels = ["0.30", "0.1", "1e1"] + [str(n) for n in range(3, 38)] + ["n/a", "high"]
    src = tmp_path / "list.csv"
    src.write_text("path,label\n" + "".join(f"{n},{v}\n" for n, v in zip(names, labels, strict=True)))
    with pytest.raises(AmbiguousTargetsError, match=r"mostly numbers \(38 of 40\), but 1 is not: row 40 'high'\."):
        _run(src, tmp_path / "db")
    assert not (tmp_path / "db").exists()
    summary = _run(src, tmp_path / "db", targets="float")
    assert LmdbImageDataset(tmp_path / "db").targets == pytest.approx([0.3, 0.1, 10.0, *range(3, 38)])
    assert [(Path(s.path).name, s.reason) for s in summary.skipped] == [
        ("list.csv row 39", "float target: a missing value ('n/a')"),
        ("list.csv row 40", "float target: 'high' is not a number"),
    ]
    _run(src, tmp_path / "classes", targets="class")
    classes = LmdbImageDataset(tmp_path / "classes").classes
    assert len(classes) == 40
    assert {"0.30", "0.1", "1e1", "n/a", "high"} <= set(classes)


def test_a_json_lists_number_labels_keep_their_text(tmp_path):
    """JSON numbers are labels as written: ``0.30`` and ``1e2`` are the classes '0.30' and '1e2' (never a float's repr
    '0.3' or '100.0'), a list of them one class written as the file writes it; as floats they are their values."""
    names = _images(tmp_path, 4)
    src = tmp_path / "list.json"
    src.write_text(
        f'[{{"path": "{names[0]}", "label": 0.30}}, {{"path": "{names[1]}", "label": 1e2}},'
        f' {{"path": "{names[2]}", "label": 0.1}}, {{"path": "{names[3]}", "label": 0.30}}]'
    )
    _run(src, tmp_path / "classes", targets="class")
    ds = LmdbImageDataset(tmp_path / "classes")
    assert (ds.classes, ds.targets) == (["0.1", "0.30", "1e2"], [1, 2, 0, 1])
    _run(src, tmp_path / "values", targets="float")
    assert LmdbImageDataset(tmp_path / "values").targets == pytest.approx([0.3, 100.0, 0.1, 0.3])
    src.write_text(f'[{{"path": "{names[0]}", "label": [1, 2.50]}}, {{"path": "{names[1]}", "label": [3, 4]}}]')
    _run(src, tmp_path / "lists", targets="class")
    assert LmdbImageDataset(tmp_path / "lists").classes == ["[1, 2.50]", "[3, 4]"]


@pytest.mark.parametrize("suffix", ["csv", "tsv", "json"])
def test_value_columns_are_a_float_target_with_their_names(tmp_path, suffix):
    """``path,x,y`` (CSV, TSV, JSON keys in the first object's order): K = 2 values named x and y; a row whose
    value does not parse or is not finite is skipped and listed, never stored as something else."""
    names = _images(tmp_path, 4)
    rows = [(names[0], "0.5", "-1"), (names[1], "nan", "2"), (names[2], "abc", "1"), (names[3], "3", "1e3")]
    src = tmp_path / f"list.{suffix}"
    if suffix == "json":
        objects = [{"path": p, "y": float(y), "x": x, "split": "train"} for p, x, y in rows]  # x: "nan", "abc"
        src.write_text(json.dumps(objects))
        order = ("y", "x")
    else:
        sep = "\t" if suffix == "tsv" else ","
        src.write_text(f"path{sep}x{sep}y\n" + "".join(sep.join(row) + "\n" for row in rows))
        order = ("x", "y")
    summary = _run(src, tmp_path / "db", targets="float")
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.target_spec == TargetSpec("float", dim=2, names=order)
    by_name = [dict(zip(order, values, strict=True)) for values in ds.targets]
    assert by_name == [{"x": 0.5, "y": -1.0}, {"x": 3.0, "y": 1000.0}]
    assert len(summary.skipped) == 2
    assert all(s.reason.startswith("float target: ") for s in summary.skipped)
    assert summary.target_stats["x"] == {"min": 0.5, "mean": 1.75, "max": 3.0}


def test_a_label_list_of_numbers_is_a_float_target(tmp_path):
    """A JSON ``label`` holding a list of numbers is K values; a row with another count is skipped and listed."""
    names = _images(tmp_path, 3)
    src = tmp_path / "list.json"
    src.write_text(json.dumps([{"path": names[0], "label": [1, 2.5]}, {"path": names[1], "label": [3, 4]},
                               {"path": names[2], "label": [5]}]))  # fmt: skip
    summary = _run(src, tmp_path / "db", targets="float")
    ds = LmdbImageDataset(tmp_path / "db")
    assert (ds.target_spec.dim, ds.targets) == (2, [[1.0, 2.5], [3.0, 4.0]])
    assert [s.reason for s in summary.skipped] == ["float target: 1 value(s), where every sample has 2"]


@pytest.mark.parametrize("suffix", ["csv", "tsv", "json"])
def test_separated_and_listed_labels_are_refused_without_targets_and_multi_label_with_it(tmp_path, suffix):
    """``cat|outdoor`` and JSON lists: refused without `targets`; ``multilabel``: each sample's classes (an empty
    label: none, a negative sample), multi-hot in a batch."""
    names = _images(tmp_path, 4)
    labels = [["cat", "outdoor"], ["dog"], [], ["outdoor", "cat", "cat"]]
    src = tmp_path / f"list.{suffix}"
    if suffix == "json":
        src.write_text(json.dumps([{"path": n, "label": lab} for n, lab in zip(names, labels, strict=True)]))
    else:
        sep = "\t" if suffix == "tsv" else ","
        body = "".join(f"{n}{sep}{'|'.join(lab)}\n" for n, lab in zip(names, labels, strict=True))
        src.write_text(f"path{sep}label\n{body}")
    with pytest.raises(AmbiguousTargetsError, match="`--targets multilabel`"):
        _run(src, tmp_path / "db")
    summary = _run(src, tmp_path / "db", targets="multilabel")
    assert summary.skipped == []
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.target_spec == TargetSpec("multilabel", num_classes=3)
    assert ds.classes == ["cat", "dog", "outdoor"]
    assert ds.targets == [[0, 2], [1], [], [0, 2]]
    assert ds[2][1].tolist() == [0.0, 0.0, 0.0]
    assert ds.targets_of([0, 1]).tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert summary.class_counts == {"cat": 2, "dog": 1, "outdoor": 2}
    text = summary.format()
    assert "  targets   multilabel (3 classes)" in text
    assert "samples naming each class: cat 2, outdoor 2, dog 1" in text


def test_multi_label_indices_another_separator_and_bracketed_text(tmp_path):
    """Labels ``0;3`` with ``label_separator=';'`` are class indices (classes '0'..'3'); ``[a, b]`` text is read too;
    a class label made with ``targets='class'`` keeps the whole text."""
    names = _images(tmp_path, 3)
    src = tmp_path / "list.csv"
    src.write_text(f"path,label\n{names[0]},0;3\n{names[1]},2\n{names[2]},\n")
    _run(src, tmp_path / "db", targets="multilabel", label_separator=";")
    ds = LmdbImageDataset(tmp_path / "db")
    assert (ds.classes, ds.targets) == (["0", "1", "2", "3"], [[0, 3], [2], []])
    src.write_text(f'path,label\n{names[0]},"[a, b]"\n{names[1]},[b]\n')
    _run(src, tmp_path / "brackets", targets="multilabel")
    assert LmdbImageDataset(tmp_path / "brackets").targets == [[0, 1], [1]]
    src.write_text(f"path,label\n{names[0]},a|b\n{names[1]},b\n")
    _run(src, tmp_path / "whole", targets="class")
    assert LmdbImageDataset(tmp_path / "whole").classes == ["a|b", "b"]


def test_multi_label_indices_are_capped_before_a_class_is_made_for_each(tmp_path):
    """A multi-label index far beyond the rows is one error, as for class indices."""
    names = _images(tmp_path, 1)
    src = tmp_path / "list.csv"
    src.write_text(f"path,label\n{names[0]},0|3000000000\n")
    with pytest.raises(SourceLayoutError, match="the label 3000000000 read as a class index makes"):
        _run(src, tmp_path / "db", targets="multilabel")


def test_targets_none_needs_no_label_column_and_stores_no_classes(tmp_path):
    """A list of paths alone converts with ``targets='none'``; batches get ``-1``; without it, ``label`` is missing."""
    names = _images(tmp_path, 2)
    src = tmp_path / "list.csv"
    src.write_text("path\n" + "".join(f"{n}\n" for n in names))
    with pytest.raises(SourceLayoutError, match=r"no label column.*with `--targets none` no `label` is needed"):
        _run(src, tmp_path / "db")
    _run(src, tmp_path / "db", targets="none")
    ds = LmdbImageDataset(tmp_path / "db")
    assert (ds.target_spec.kind, ds.classes, ds.targets) == ("none", [], [-1, -1])


def test_a_folder_converts_with_targets_none_and_refuses_other_kinds(tmp_path):
    """An image folder: ``targets='none'`` stores no labels; ``multilabel``/``float`` are refused naming a list file."""
    _images(tmp_path / "src" / "a", 2)
    _images(tmp_path / "src" / "b", 1)
    _run(tmp_path / "src", tmp_path / "db", targets="none")
    ds = LmdbImageDataset(tmp_path / "db")
    assert (ds.target_spec.kind, ds.classes, ds.targets) == ("none", [], [-1, -1, -1])
    for kind in ("multilabel", "float"):
        with pytest.raises(SourceLayoutError, match=f"`targets` '{kind}' needs a list file"):
            _run(tmp_path / "src", tmp_path / kind, targets=kind)
    with pytest.raises(ValueError, match="`targets` must be one of class, multilabel, float, none"):
        _run(tmp_path / "src", tmp_path / "bad", targets="regression")
    with pytest.raises(ValueError, match="`label_separator` must be a visible string"):
        _run(tmp_path / "src", tmp_path / "bad", label_separator="")


def test_another_kind_of_the_same_list_converts_again(tmp_path):
    """Converting the same list with other `targets` (or separator) converts again, never "up to date"."""
    names = _images(tmp_path, 2)
    src = tmp_path / "list.csv"
    src.write_text(f"path,label\n{names[0]},a|b\n{names[1]},b\n")
    dst = tmp_path / "db"
    assert not _run(src, dst, targets="class").up_to_date
    assert _run(src, dst, targets="class").up_to_date
    assert not _run(src, dst, targets="multilabel").up_to_date
    assert LmdbImageDataset(dst).targets == [[0, 1], [1]]
    assert _run(src, dst, targets="multilabel").up_to_date
    assert not _run(src, dst, targets="multilabel", label_separator=";").up_to_date
    assert LmdbImageDataset(dst).classes == ["a|b", "b"]
    assert not _run(src, dst, targets="none").up_to_date


def test_the_cache_slot_of_a_conversion_is_keyed_by_the_target_kind(tmp_path):
    """``converted_path`` differs per kind (and multi-label separator); classes keep the slot they had before kinds."""
    from lightning_fastdata.store.cache import converted_path

    args = (tmp_path / "list.csv", tmp_path, 256, 90, "jpeg")
    before = converted_path(*args)
    assert converted_path(*args, "class") == converted_path(*args, None, ";") == before
    slots = {converted_path(*args, kind) for kind in ("multilabel", "float", "none")}
    slots.add(converted_path(*args, "multilabel", ";"))
    assert len(slots) == 4
    assert before not in slots


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


class _Named(list):
    classes = ("cat", "dog", "sky")


def test_a_dataset_of_class_names_or_indices_converts_multi_label(tmp_path):
    """Targets that are lists of names convert without `targets`; lists of indices need ``targets='multilabel'``."""
    names = [["cat", "sky"], [], ["dog"]]
    _run(_Named((_image(i), n) for i, n in enumerate(names)), tmp_path / "names")
    ds = LmdbImageDataset(tmp_path / "names")
    assert (ds.target_spec.kind, ds.targets) == ("multilabel", [[0, 2], [], [1]])
    indices = [(_image(i), t) for i, t in enumerate([[0, 2], [], [1, 1]])]
    with pytest.raises(AmbiguousTargetsError, match="pass `targets='multilabel'`"):
        _run(indices, tmp_path / "refused")
    _run(indices, tmp_path / "indices", targets="multilabel", classes=["a", "b", "c"])
    assert LmdbImageDataset(tmp_path / "indices").targets == [[0, 2], [], [1]]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.5, -2.0], [0.5, -2.0]),
        ([[0.5, 1.0], [2.0, -3.0]], [[0.5, 1.0], [2.0, -3.0]]),
        ([np.array([0.5, 1.0], dtype=np.float32), np.array([2.0, -3.0], dtype=np.float32)], [[0.5, 1.0], [2, -3]]),
    ],
)
def test_a_dataset_of_floats_converts_to_a_float_target(tmp_path, values, expected):
    """A float, a list of floats, or a float32 array per sample: a ``float`` target without `targets`."""
    summary = _run([(_image(i), v) for i, v in enumerate(values)], tmp_path / "db")
    ds = LmdbImageDataset(tmp_path / "db")
    assert ds.target_spec.kind == "float"
    assert ds.targets == expected
    assert "targets   float" in summary.format()


def test_a_dataset_sample_that_does_not_fit_the_kind_is_skipped_with_the_reason(tmp_path):
    """A NaN, or a different count of values, is skipped and listed; the others are stored."""
    values = [(1.0, 2.0), (math.nan, 1.0), (3.0,), (4.0, 5.0)]
    summary = _run([(_image(i), list(v)) for i, v in enumerate(values)], tmp_path / "db")
    assert [s.path for s in summary.skipped] == ["train[1]", "train[2]"]
    assert "not a finite float32" in summary.skipped[0].reason
    assert LmdbImageDataset(tmp_path / "db").targets == [[1.0, 2.0], [4.0, 5.0]]


def test_a_hugging_face_dataset_of_float_and_sequence_features(tmp_path):
    """Real ``datasets`` features decide the kind: ``Sequence(ClassLabel)`` multi-label, float values ``float``."""
    datasets = pytest.importorskip("datasets")
    images = [_image(i) for i in range(3)]
    features = datasets.Features(
        {"image": datasets.Image(), "labels": datasets.Sequence(datasets.ClassLabel(names=["ant", "bee", "cow"]))}
    )
    ml = datasets.Dataset.from_dict({"image": images, "labels": [[0, 2], [], [1]]}, features=features)
    _run(ml, tmp_path / "ml")
    ds = LmdbImageDataset(tmp_path / "ml")
    assert (ds.target_spec.kind, ds.classes, ds.targets) == ("multilabel", ["ant", "bee", "cow"], [[0, 2], [], [1]])
    for name, feature, values, expected in [
        ("one", datasets.Value("float32"), [0.5, 1.5, -2.0], [0.5, 1.5, -2.0]),
        (
            "two",
            datasets.Sequence(datasets.Value("float32"), length=2),
            [[1, 2], [3, 4], [5, 6]],
            [[1, 2], [3, 4], [5, 6]],
        ),
    ]:
        features = datasets.Features({"image": datasets.Image(), "label": feature})
        table = datasets.Dataset.from_dict({"image": images, "label": values}, features=features)
        _run(table, tmp_path / name)
        ds = LmdbImageDataset(tmp_path / name)
        assert (ds.target_spec.kind, ds.targets) == ("float", expected)


# ---------------------------------------------------------------------------------------------------------------
# Damaged or forged databases
# ---------------------------------------------------------------------------------------------------------------


def _float_database(tmp_path: Path) -> Path:
    _run([(_image(i), [float(i), -float(i)]) for i in range(4)], tmp_path / "db")
    return tmp_path / "db"


@pytest.mark.parametrize(
    "entry",
    [{"kind": "regression"}, {"kind": "float", "dim": 10**9}, {"kind": "float", "dim": 2, "names": [1, 2]}, "float"],
)
def test_a_forged_target_kind_is_a_format_error_at_open(tmp_path, entry):
    """An unknown kind, a dim of 10**9 or names that are not strings in ``meta["targets"]``: refused when opened."""
    from lightning_fastdata import DatasetFormatError
    from lightning_fastdata.store.format import META_KEY

    db = _float_database(tmp_path)
    env = lmdb.open(str(db), subdir=True)
    with env.begin(write=True) as txn:
        meta = load_meta(txn.get(META_KEY), db)
        meta["targets"] = entry
        txn.put(META_KEY, dump_meta(meta))
    env.close()
    (db / "convert_report.json").unlink()
    with pytest.raises(DatasetFormatError, match="is damaged"):
        LmdbImageDataset(db)


@pytest.mark.parametrize("damage", ["flip", "short"])
def test_a_damaged_target_array_is_a_corrupt_record_error_naming_the_split(tmp_path, damage):
    """A flipped byte, or an array of the wrong length, in ``__targets__/train``: an error naming the split when the
    targets are read (``targets_of``, ``__getitem__``), never wrong targets."""
    db = _float_database(tmp_path)
    key = tg.targets_key("train")
    env = lmdb.open(str(db), subdir=True)
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(key))
        if damage == "flip":
            raw[5] ^= 0x10
        txn.put(key, bytes(raw if damage == "flip" else raw[:-4]))
    env.close()
    if damage != "flip":  # a size the metadata does not give is refused at open, before a batch is sized by it
        with pytest.raises(CorruptRecordError, match=r"split 'train' of .*: its target array is 28 bytes where 32"):
            LmdbImageDataset(db)
        return
    ds = LmdbImageDataset(db)
    with pytest.raises(CorruptRecordError, match=r"split 'train' of .*: its target arrays? "):
        ds.targets_of([0, 1])
    with pytest.raises(CorruptRecordError, match="split 'train'"):
        ds[0]


def test_a_row_with_a_label_but_no_path_is_skipped_and_listed(tmp_path):
    """A ``path,label`` row without a path (``,orphan``) is skipped with its reason; its label makes no class."""
    names = _images(tmp_path / "imgs", 2)
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\nimgs/{names[0]},cat\nimgs/{names[1]},dog\n,orphan\n")
    summary = _run(listing, tmp_path / "db")
    assert summary.written == 2
    assert [s.reason for s in summary.skipped] == ["row without a path or a label"]
    assert LmdbImageDataset(tmp_path / "db").classes == ["cat", "dog"]


def test_a_dataset_whose_targets_change_kind_after_the_first_is_refused_naming_targets(tmp_path):
    """Ints, then floats, with no ``targets=``: the kind the first sample implied is wrong, so nothing is written and
    the error names ``targets=`` (it skipped the floats as bad class labels, silently); a negative int still skips."""
    images = [_image(n) for n in range(4)]
    with pytest.raises(SourceLayoutError, match=r"not all of one kind: train\[1\]'s 2.5 is float.* Pass `targets=`"):
        _run([(images[0], 3), (images[1], 2.5), (images[2], 1.7), (images[3], 4)], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    summary = _run([(images[0], 3), (images[1], -1)], tmp_path / "negative")
    assert summary.written == 1
    assert "non-negative int" in summary.skipped[0].reason
    summary = _run([(images[0], 0.5), (images[1], 2.5)], tmp_path / "floats", targets="float")
    assert summary.written == 2
