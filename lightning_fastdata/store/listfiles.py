"""List files: ``path,label[,split]`` rows of a CSV or TSV file, or a JSON list of objects, scanned into a plan.

:func:`scan_list` reads a list file once (its bytes are its fingerprint), checks it is UTF-8 text and parses its rows
(:func:`_read_list`), reads its labels as the ``targets`` kind, inferred where unambiguous
(:mod:`~lightning_fastdata.store.labels`), and fills a :class:`~lightning_fastdata.store.plan.SourceScan` with one
task per image: a row it cannot convert as listed (no path, no usable label, an image listed again) is skipped and
listed, and an image listed with two targets or in two splits is refused. A cell keeps its text as written, in a JSON
file too (:class:`_JsonNumber`): ``0.30`` is the class ``'0.30'``, and a float parsed from that text.
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fastdata._files import NotRegularFileError, read_regular
from lightning_fastdata.errors import SourceLayoutError
from lightning_fastdata.store.format import parse_json
from lightning_fastdata.store.labels import LABEL_SEPARATOR, infer_list_kind, is_missing, short_repr, split_label
from lightning_fastdata.store.plan import (
    LAYOUT_HELP,
    ConversionPlan,
    SourceScan,
    canonical_split,
    check_targets_option,
    warn_split_typos,
)
from lightning_fastdata.store.summary import SkippedFile
from lightning_fastdata.store.targets import MAX_DIM, TargetSpec, check_target

#: Files accepted as a list source: ``path,label`` rows (CSV or tab-separated TSV, with a header) or a JSON list of
#: objects.
LIST_EXTENSIONS = (".csv", ".tsv", ".json")

#: how far a list file's numeric labels (class indices) may exceed its rows: a class name is made for every index up to
#: the largest, so a label of 3000000000 would otherwise ask for 3 billion of them (the subset of a larger label set
#: still fits: ImageNet-21k's 21,841 classes for a list of any length)
_SPARE_CLASS_INDICES = 2**20


class _JsonNumber(str):
    """A number of a JSON list file as its text (``0.30``, ``1e2``, ``NaN``): what a label is, whichever the kind.

    A class is named by the text as written, a float is parsed from it; a list of them is written as the file does.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_SAVE_AS_UTF8 = (
    "A list file is UTF-8 text: if it was saved as UTF-16 (Excel's 'Unicode Text'), save it again as 'CSV UTF-8'"
)


def _list_text(src: Path) -> tuple[str, bytes]:
    """A list file's text and its bytes (read once: they are the fingerprint too), refused unless it is UTF-8 text.

    Raises:
        SourceLayoutError: ``src`` is no regular file, cannot be read, is not UTF-8, or holds a NUL character.

    """
    try:
        data = read_regular(src)
    except NotRegularFileError as err:  # replaced since the conversion looked: read, it would block or never end
        raise SourceLayoutError(
            f"`src` {str(src)!r} is {err.kind}, not a list file: only regular files are read. Save the list to a"
            " .csv, .tsv or .json file and pass that."
        ) from None
    except OSError as err:
        raise SourceLayoutError(f"`src` {str(src)!r} cannot be read: {err.strerror or err}") from None
    body = data[len(_UTF8_BOM) :] if data.startswith(_UTF8_BOM) else data
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body.count(b"\n", 0, err.start) + 1
        utf16 = " It starts as UTF-16 does." if data.startswith(_UTF16_BOMS) else ""
        raise SourceLayoutError(
            f"`src` {str(src)!r} is not UTF-8 text: byte 0x{body[err.start : err.start + 1].hex()} at line {line}"
            f" ({err.reason}).{utf16} {_SAVE_AS_UTF8}, and replace any byte not meant to be there."
        ) from None
    nul = text.find("\0")
    if nul >= 0:  # Python's csv reads it as a character: a path with it fails, a label keeps it
        line = text.count("\n", 0, nul) + 1
        raise SourceLayoutError(
            f"`src` {str(src)!r} holds a NUL character at line {line}, which no text file does. {_SAVE_AS_UTF8};"
            " otherwise remove the NUL bytes."
        )
    return text, data


def _read_csv(src: Path, text: str) -> list[dict[str, Any]]:
    """The rows of a CSV or TSV list file (with a header), as ``csv.DictReader`` reads them.

    Raises:
        SourceLayoutError: a row cannot be read as CSV (a cell over ``csv.field_size_limit()``, 128 KiB: most often
            a quote left open, which makes the rest of the file one cell), naming the row and its first line.

    """
    reader = csv.DictReader(io.StringIO(text), delimiter="\t" if src.suffix.lower() == ".tsv" else ",")
    rows: list[dict[str, Any]] = []
    where = "the header (line 1)"
    try:
        _ = reader.fieldnames  # the header, read first: an error in it is named as such
        while True:
            where = f"row {len(rows) + 1} (from line {reader.line_num + 1})"  # numbered as skipped rows are
            row = next(reader, None)
            if row is None:
                return rows
            rows.append(row)
    except csv.Error as err:
        limit = csv.field_size_limit()
        fix = (
            f'A cell is {limit:,} characters at most: if a quote (`"`) opens a cell and is never closed, the rest'
            " of the file reads as that cell; close it, or quote the cell whole (a quote inside a quoted cell is"
            ' written twice: `""`)'
            if "field larger than field limit" in str(err)
            else "Check the quoting of that row: a cell that holds the separator or a line break is quoted whole"
        )
        raise SourceLayoutError(f"`src` {str(src)!r}: {where} cannot be read as CSV ({err}). {fix}.") from None


def _read_list(src: Path, columns: tuple[str, ...] = ("path", "label")) -> tuple[list[dict[str, Any]], bytes]:
    """The rows of a CSV or TSV (with a header) or JSON (a list of objects) list file, keys lower-cased; its bytes.

    ``columns``: those the first row must have (``path`` alone where no label is read).
    """
    text, data = _list_text(src)
    if src.suffix.lower() == ".json":
        try:  # numbers keep their text (`0.30` is the class '0.30', never a float's repr '0.3')
            rows = parse_json(text, parse_int=_JsonNumber, parse_float=_JsonNumber, parse_constant=_JsonNumber)
        except ValueError as err:
            raise SourceLayoutError(f"`src` {str(src)!r} is not valid JSON: {err}.\n{LAYOUT_HELP}") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise SourceLayoutError(f"`src` {str(src)!r} must hold a JSON list of objects.\n{LAYOUT_HELP}")
    else:
        rows = _read_csv(src, text)
    rows = [{str(k).strip().lower(): v for k, v in row.items() if k is not None} for row in rows]
    if not rows:
        raise SourceLayoutError(f"`src` {str(src)!r} lists no images.\n{LAYOUT_HELP}")
    missing = set(columns) - set(rows[0])
    if missing:
        raise SourceLayoutError(
            f"`src` {str(src)!r} has no {' or '.join(sorted(missing))} column; its columns are {sorted(rows[0])}."
            " Name the columns `path` and `label` (and optionally `split`); with `--targets float` (`targets='float'`)"
            " the columns other than `path` and `split` are read as values, with `--targets none` no `label` is"
            f" needed.\n{LAYOUT_HELP}"
        )
    return rows, data


def _label_of(row: Mapping[str, Any]) -> Any:
    """A row's ``label`` as the list file holds it: a JSON list as a list, anything else as stripped text."""
    label = row.get("label")
    if isinstance(label, (list, tuple)):
        return list(label)
    return "" if label is None else str(label).strip()


def _has_path(row: Mapping[str, Any]) -> bool:
    return bool(str(row.get("path") or "").strip())


def _index_classes(src: Path, names: list[str], rows: int) -> tuple[list[str], dict[str, int]]:
    """The classes of a list file's label names: their indices when all are ASCII digits, else the sorted names.

    Raises:
        SourceLayoutError: an index exceeds the rows by more than :data:`_SPARE_CLASS_INDICES`.

    """
    # numeric labels keep their value as the class index (ASCII digits: `'²'.isdigit()` too, but int() refuses it)
    if names and all(label.isascii() and label.isdigit() for label in names):
        top = max(int(label) for label in names)
        if top >= rows + _SPARE_CLASS_INDICES:  # checked before a class name is made for every index below it
            raise SourceLayoutError(
                f"`src` {str(src)!r}: the label {top} read as a class index makes {top + 1:,} classes for"
                f" {rows:,} row(s); class indices may exceed the rows by {_SPARE_CLASS_INDICES:,} at most."
                " Number the classes from 0, or label the rows with class names."
            )
        return [str(i) for i in range(top + 1)], {label: int(label) for label in names}
    classes = sorted(set(names))
    return classes, {name: i for i, name in enumerate(classes)}


def _float_columns(src: Path, rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The columns a ``float`` list file's values are in: ``label`` if present, else all but ``path`` and ``split``.

    Raises:
        SourceLayoutError: there is no such column.

    """
    if "label" in rows[0]:
        return ("label",)
    columns = tuple(key for key in rows[0] if key not in ("path", "split"))
    if not columns:
        raise SourceLayoutError(
            f"`src` {str(src)!r} has no column of values for `--targets float`; its columns are {sorted(rows[0])}."
            " Add a `label` column, or one column per value (`path,x,y`).\n" + LAYOUT_HELP
        )
    return columns


def _float_spec(src: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> TargetSpec:
    """The ``float`` kind of a list file: one value per column, or as many as the first ``label`` list holds."""
    if columns != ("label",):
        if len(columns) > MAX_DIM:
            raise SourceLayoutError(
                f"`src` {str(src)!r} has {len(columns)} value columns; at most {MAX_DIM} are stored."
            )
        return TargetSpec("float", dim=len(columns), names=columns)
    first = next((_label_of(row) for row in rows if _has_path(row)), "")
    if isinstance(first, str) and first.startswith("[") and first.endswith("]"):
        first = split_label(first, ",")
    if not isinstance(first, list):
        return TargetSpec("float", dim=1, names=("label",))
    if not 1 <= len(first) <= MAX_DIM:
        raise SourceLayoutError(
            f"`src` {str(src)!r}: the first row's label holds {len(first)} values; 1 to {MAX_DIM} are stored."
        )
    return TargetSpec("float", dim=len(first))


def _float_values(row: Mapping[str, Any], columns: tuple[str, ...]) -> Any:
    """The values of a ``float`` row, to check: its columns' cells, or its ``label`` list (JSON or ``[a, b]`` text)."""
    if columns != ("label",):
        return [row.get(column) for column in columns]
    label = _label_of(row)
    if isinstance(label, str) and label.startswith("[") and label.endswith("]"):
        return split_label(label, ",")
    return label


def scan_list(src: Path, targets: str | None = None, label_separator: str = LABEL_SEPARATOR) -> ConversionPlan:
    """A plan from a list of ``path,label[,split]`` rows; relative paths are relative to the list file's folder.

    Args:
        src: the list file (``.csv``, ``.tsv`` or ``.json``).
        targets: the kind of the labels (:mod:`~lightning_fastdata.store.targets`); ``None``: classes, unless the
            labels could be read otherwise (numbers that are not integers, mostly numbers with a few other labels,
            lists, names joined by ``label_separator``), which is refused naming ``--targets``.
        label_separator: what separates the class names of a ``multilabel`` label (``cat|outdoor``).

    An image listed twice (the same path, relative to the list file's folder, once normalised: ``./a.jpg`` is
    ``a.jpg``) with the same target in the same split is converted once; its later rows are skipped and listed, so
    ``strict`` refuses them as it refuses every row it cannot convert as listed.

    Raises:
        SourceLayoutError: the file cannot be read, lacks a column, lists an image twice with different targets or in
            two splits, or its labels are ambiguous (:class:`~lightning_fastdata.store.labels.AmbiguousTargetsError`).

    """
    check_targets_option(targets, label_separator)
    rows, data = _read_list(src, ("path",) if targets in ("none", "float") else ("path", "label"))
    labels = [_label_of(row) for row in rows]
    if targets is None:
        # the rows that list an image, numbered as the skipped rows are (the first after the header is row 1)
        pairs = enumerate(zip(rows, labels, strict=True), start=1)
        labelled = [(number, label) for number, (row, label) in pairs if _has_path(row)]
        numbers = [number for number, _ in labelled]
        targets = infer_list_kind([label for _, label in labelled], str(src), label_separator, numbers)
    scan = SourceScan()
    scan.digest.update(data)  # the bytes parsed: a second read could meet another file
    if targets == "multilabel":  # the separator decides the classes: another one reads another dataset
        scan.digest.update(f"\0multilabel\0{label_separator}".encode())
    spec, classes, values = _list_targets(src, rows, labels, targets, label_separator)
    split_names = [str(row.get("split") or "train").strip() for row in rows]
    counts = Counter(split_names)
    warn_split_typos({name: f"{n} row(s) with split" for name, n in counts.items()}, f"`src` {str(src)!r}")
    seen: dict[str, tuple[int, str, Any]] = {}  # an image's normalised path: its first row, split and target
    conflicts: list[str] = []
    for number, (row, value, split_name) in enumerate(zip(rows, values, split_names, strict=True), start=1):
        listed = str(row.get("path") or "").strip()
        split = canonical_split(split_name) or split_name
        if not listed or isinstance(value, _Missing):
            reason = value.reason if listed and isinstance(value, _Missing) else _NO_PATH_OR_LABEL
            scan.skipped.append(SkippedFile(f"{src} row {number}", reason))
            continue
        path = str(src.parent / Path(listed).expanduser())
        first, first_split, first_value = seen.setdefault(os.path.normpath(path), (number, split, value))
        if first == number:
            scan.add(split, path, value, listed)
        elif first_split != split or first_value != value:
            conflicts.append(_conflict(listed, (first, rows[first - 1], first_split), (number, row, split), targets))
        else:
            reason = f"{listed!r} again, as in row {first}, with the same target: converted once; remove the row"
            scan.skipped.append(SkippedFile(f"{src} row {number}", reason))
    if conflicts:
        more = (
            f" ({len(conflicts) - 1} more row(s) conflict with an earlier row of their image.)" if conflicts[1:] else ""
        )
        raise SourceLayoutError(f"`src` {str(src)!r}: {conflicts[0]}.{more}")
    plan = scan.plan(src, classes)
    plan.targets = spec
    return plan


_NO_PATH_OR_LABEL = "row without a path or a label"


def _conflict(
    listed: str, first: tuple[int, Mapping[str, Any], str], again: tuple[int, Mapping[str, Any], str], kind: str
) -> str:
    """Why an image listed twice, as ``first`` and ``again`` (row number, row, split), cannot be converted."""
    (row_a, cells_a, split_a), (row_b, cells_b, split_b) = first, again
    if split_a != split_b:  # a leak: whichever split it is dropped from, the conversion would guess
        return (
            f"{listed!r} is listed in split {split_a!r} (row {row_a}) and in split {split_b!r} (row {row_b}): the"
            " model would be evaluated on an image it trained on. Keep each image in one split: remove one of the rows"
        )
    fix = "keep one row per image"
    label_a, label_b = _label_of(cells_a), _label_of(cells_b)
    if kind in ("class", "multilabel") and isinstance(label_a, str) and isinstance(label_b, str):
        both = f"`{label_a}{LABEL_SEPARATOR}{label_b}`" if kind == "class" else "its classes"
        fix += f", or name {both} in one row" + (" and pass `--targets multilabel`" if kind == "class" else "")
    return (
        f"{listed!r} is listed twice with different labels: row {row_a} ({_cells(cells_a)}) and row {row_b}"
        f" ({_cells(cells_b)}). An image has one target: {fix}"
    )


def _cells(row: Mapping[str, Any]) -> str:
    """A row's cells but ``path`` and ``split``, for a message: ``label 'cat'``, ``x '1', y '2'``."""
    return ", ".join(f"{key} {_short_text(value)}" for key, value in row.items() if key not in ("path", "split"))


def _short_text(value: Any) -> str:
    """A list file's cell for a message: a JSON list as it is, anything else as stripped text."""
    cell = value if isinstance(value, (list, tuple)) else str(value if value is not None else "").strip()
    return short_repr(cell, 40)


@dataclass(frozen=True)
class _Missing:
    """A row whose target cannot be stored, and why (it is skipped and listed)."""

    reason: str


def _list_targets(
    src: Path, rows: list[dict[str, Any]], labels: list[Any], kind: str, separator: str
) -> tuple[TargetSpec, list[str], list[Any]]:
    """A list file's target kind, classes, and each row's target as a task holds it (or why it has none)."""
    if kind == "none":
        return TargetSpec("none"), [], [None] * len(rows)
    if kind == "float":
        columns = _float_columns(src, rows)
        spec = _float_spec(src, rows, columns)
        values: list[Any] = []
        for row in rows:
            raw = _float_values(row, columns)
            try:
                values.append(check_target(spec, raw))
            except ValueError as err:
                # a missing value says so (as pandas reads one: `NA`, `n/a`, empty, JSON null), not "not a number"
                items = raw if isinstance(raw, list) else [raw]
                gap = next((i for i in items if i is None or (isinstance(i, str) and is_missing(i.strip()))), False)
                reason = f"a missing value ({_short_text(gap)})" if gap is not False else str(err)
                values.append(_Missing(f"float target: {reason}"))
        return spec, [], values
    kept = [_has_path(row) for row in rows]
    if kind == "multilabel":
        names = [split_label(label, separator) for label in labels]
        every = [name for keep, row_names in zip(kept, names, strict=True) if keep for name in row_names]
        classes, index = _index_classes(src, every, sum(kept))
        if len(classes) > MAX_DIM:
            raise SourceLayoutError(
                f"`src` {str(src)!r}: the labels name {len(classes):,} classes; a multi-label database holds at most"
                f" {MAX_DIM:,}. Check `--label-sep` ({separator!r}), or number the classes from 0."
            )
        targets = [
            tuple(sorted({index[name] for name in row_names})) if keep else None  # an empty label: no class
            for keep, row_names in zip(kept, names, strict=True)
        ]
        return TargetSpec("multilabel"), classes, targets
    texts = [str(label) for label in labels]  # `class`: a list is one class, named as Python writes it
    # the classes of the rows that are kept: a row without a path or a label is skipped, and is no class `''`
    named = [text for keep, text in zip(kept, texts, strict=True) if keep and text]
    classes, index = _index_classes(src, named, len(named))
    missing = _Missing(_NO_PATH_OR_LABEL)
    values = [index[text] if keep and text else missing for keep, text in zip(kept, texts, strict=True)]
    return TargetSpec("class"), classes, values
