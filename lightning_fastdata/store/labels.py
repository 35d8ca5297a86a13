"""Targets from elsewhere: a list file's labels and a dataset's target values, and the kind each implies.

What :mod:`~lightning_fastdata.store.targets` stores is of one kind per database; this module reads where targets come
from before they are stored. A list file's ``label`` column (:func:`infer_list_kind`, :func:`split_label`, the cells
that say a value is missing: :func:`is_missing`) and a dataset's first target (:func:`kind_of_value`) give a kind only
where it is unambiguous; otherwise the conversion refuses in one line that names the option to pass
(:class:`AmbiguousTargetsError`).

It imports nothing of the store: the targets module, the list-file reader and the dataset adapter all read it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_fastdata.errors import SourceLayoutError

#: the separator of several class names in one list-file label (``cat|outdoor``)
LABEL_SEPARATOR = "|"


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class AmbiguousTargetsError(SourceLayoutError):
    """A source's labels could be read as more than one kind of target: the message names ``--targets``."""


def _option(kind: str) -> str:
    return f"`--targets {kind}` (`targets={kind!r}` in Python)"


#: the cells that say a value is missing: pandas' ``read_csv`` defaults (``na_values``, pandas 2.x), matched exactly
#: as it matches them, case and all (``NA`` and ``nan`` are missing, ``Na`` and ``NONE`` are text). ``-`` and ``?``
#: are not among them: pandas reads them as text, and so does this module (a column of numbers holding one is refused,
#: naming its rows). Nor is ``inf``: to pandas a float, which a ``float`` target cannot store (its row is skipped)
MISSING_MARKERS = frozenset(
    {
        "",
        "#N/A",
        "#N/A N/A",
        "#NA",
        "-1.#IND",
        "-1.#QNAN",
        "-NaN",
        "-nan",
        "1.#IND",
        "1.#QNAN",
        "<NA>",
        "N/A",
        "NA",
        "NULL",
        "NaN",
        "None",
        "n/a",
        "nan",
        "null",
    }
)
#: a number as pandas' ``read_csv`` parses one (ASCII digits, no ``_``): ``3``, ``-0.5``, ``.5``, ``1e-3``, ``inf``
_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity))")
#: how many of the labels that are not numbers a refusal names
_SHOWN = 5


def is_missing(text: str) -> bool:
    """Whether a list-file cell (stripped) says its value is missing: one of :data:`MISSING_MARKERS`."""
    return text in MISSING_MARKERS


def _is_number(text: str) -> bool:
    """Whether ``text`` is a number as pandas reads one (``inf`` too; the missing markers, ``nan`` among them, not)."""
    return _NUMBER.fullmatch(text) is not None


def _looks_like_list(label: Any) -> bool:
    return isinstance(label, (list, tuple)) or (
        isinstance(label, str) and label.strip().startswith("[") and label.strip().endswith("]")
    )


def infer_list_kind(
    labels: Sequence[Any], where: str, separator: str = LABEL_SEPARATOR, rows: Sequence[int] | None = None
) -> str:
    """The kind of a list file's ``label`` column without ``--targets``: ``class``, or a one-line refusal.

    Labels are read as classes (names, or indices when all are integers) unless that would misread them. A label is a
    number as pandas parses one, or missing when it is one of :data:`MISSING_MARKERS` (pandas' defaults).

    Args:
        labels: the labels of the rows that list an image.
        where: the list file, for messages.
        separator: what separates the class names of a multi-label label.
        rows: each label's row number as a refusal names it (the first row after the header is 1); ``1, 2, ...`` if
            not given.

    Raises:
        AmbiguousTargetsError: the labels look like lists or contain ``separator``; or they are numbers (or missing)
            and not all class indices; or they are mostly numbers, at least 2 and more than the labels that are not,
            with a few that are not (``high``, ``-``, ``cat`` among integers): the message names those rows and the
            ``--targets`` option for each reading.

    """
    numbered = list(zip(range(1, len(labels) + 1) if rows is None else rows, labels, strict=True))
    texts = [(row, label) for row, label in numbered if not isinstance(label, str) or label.strip()]
    if not texts:
        return "class"
    listed = next((label for _, label in texts if _looks_like_list(label)), None)
    if listed is not None:
        raise AmbiguousTargetsError(
            f"`src` {where!r}: the label {short_repr(listed)} is a list: pass {_option('multilabel')} to store each"
            f" sample's classes, or {_option('class')} to make each list one class."
        )
    strings = [(row, str(label).strip()) for row, label in texts]
    separated = next((label for _, label in strings if separator in label), None)
    if separated is not None:
        raise AmbiguousTargetsError(
            f"`src` {where!r}: the label {separated!r} holds the separator {separator!r}: pass"
            f" {_option('multilabel')} to store the classes it separates, or {_option('class')} to make each label"
            " one class."
        )
    is_number = [_is_number(label) for _, label in strings]
    numbers = sum(is_number)
    others = [
        (row, label) for (row, label), n in zip(strings, is_number, strict=True) if not n and not is_missing(label)
    ]
    # numbers that are not all class indices (ASCII digits, as classes read them): values, or a class per value?
    # a missing value among them (`nan`, `NA`, empty) is a regression list with a gap, not a class of its own
    if not others:
        example = next((label for _, label in strings if not (label.isascii() and label.isdigit())), None)
        if example is not None:
            raise AmbiguousTargetsError(
                f"`src` {where!r}: the labels are numbers, not all class indices ({example!r}): pass"
                f" {_option('float')} to store them as values (regression), or {_option('class')} to make each"
                " distinct value a class."
            )
    # mostly numbers and a few labels that are not: stray text in a column of values, or names among class indices;
    # as classes they would each be one more class, silently, so the rows are named for the user to decide
    elif numbers >= 2 and numbers > len(others):
        shown = ", ".join(f"row {row} {short_repr(label)}" for row, label in others[:_SHOWN])
        more = f" and {len(others) - _SHOWN} more" if len(others) > _SHOWN else ""
        verb = "is" if len(others) == 1 else "are"
        raise AmbiguousTargetsError(
            f"`src` {where!r}: the labels are mostly numbers ({numbers} of {len(strings)}), but {len(others)} {verb}"
            f" not: {shown}{more}. Correct those rows (a missing value is an empty cell or a marker pandas reads,"
            f" such as `NA` or `n/a`), or pass {_option('float')} to store the numbers as values (regression),"
            f" skipping and listing the rows that are not numbers, or {_option('class')} to make each distinct label"
            " a class, named as written."
        )
    return "class"


def split_label(label: Any, separator: str = LABEL_SEPARATOR) -> list[str]:
    """A multi-label list-file label as class names: a JSON list, ``[a, b]`` text, or ``a|b``; empty for none."""
    if isinstance(label, (list, tuple)):
        return [str(item).strip() for item in label if str(item).strip()]
    text = "" if label is None else str(label).strip()
    if text.startswith("[") and text.endswith("]"):
        parts = text[1:-1].split(",")
        return [part.strip().strip("'\"").strip() for part in parts if part.strip().strip("'\"").strip()]
    return [part.strip() for part in text.split(separator) if part.strip()]


def kind_of_value(value: Any) -> str | None:
    """The kind a dataset's target value implies when it is unambiguous, else ``None`` (``targets=`` decides).

    An integer is a class, a float or an array of floats a ``float`` target, a list of strings class names of a
    ``multilabel`` one; a list or array of integers could be class indices, a multi-hot vector or values: ``None``.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return "class"
    if isinstance(value, (float, np.floating)):
        return "float"
    if value is None:
        return "none"
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "shape"):  # a NumPy array or a torch tensor
        text = str(dtype)
        return "float" if "float" in text else None
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(item, str) for item in value):
            return "multilabel"
        if all(isinstance(item, (float, np.floating)) for item in value):
            return "float"
    return None
