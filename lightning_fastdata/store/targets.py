"""Target kinds: what a database stores per sample beside its image, typed, and how a batch reads it back.

One kind per database, recorded in its metadata as ``meta["targets"]`` (a database without that entry holds classes,
as every database did before kinds):

=============  ==========================================================  ===================================
kind           stored per split (little-endian arrays, never pickled)      in a batch
=============  ==========================================================  ===================================
``class``      the record header's label, and ``__labels__/<split>``:     ``int64 [B]``
               ``int32 [N]``
``multilabel`` ``__targets__/<split>/offsets``: ``int64 [N + 1]``, and     multi-hot ``float32 [B, C]``
               ``__targets__/<split>/indices``: ``int32 [M]``, the class
               indices of sample ``i`` at ``offsets[i]:offsets[i + 1]``
``float``      ``__targets__/<split>``: ``float32 [N, K]``                ``float32 [B, K]``, ``[B]`` if K = 1
``none``       nothing                                                     ``int64 [B]`` of ``-1``
=============  ==========================================================  ===================================

Records of the kinds other than ``class`` carry the label ``-1`` in their header. The arrays of a split are checked
once per process, when a batch first needs them (:class:`SplitTargets`): their sizes against the split's length, a
CRC32 stored in the metadata, and for multi-label offsets that ascend and indices below the class count; then each
batch reads its samples' targets straight from the memory map, a few bytes each. Nothing is held per sample but, for
a ``float`` split whose values are not all finite (NaN, infinities: the writer stores none), one bit marking each
sample that holds one: such a sample is damaged, refused wherever it is read (:meth:`SplitTargets.check_records`) as a
record that fails its checksum is. A class label outside ``0 <= label < C`` is refused alike (:func:`first_bad_label`).

Reading targets from elsewhere, a list file's labels and a dataset's values, and inferring their kind is
:mod:`~lightning_fastdata.store.labels`' job; its names are importable from here too.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError
from lightning_fastdata.store.labels import (
    LABEL_SEPARATOR,
    MISSING_MARKERS,
    AmbiguousTargetsError,
    infer_list_kind,
    is_missing,
    kind_of_value,
    short_repr,
    split_label,
)

__all__ = [
    "KINDS",
    "LABEL_SEPARATOR",
    "MAX_DIM",
    "MISSING_MARKERS",
    "MIXED_KINDS",
    "NO_LABEL",
    "AmbiguousTargetsError",
    "SplitTargets",
    "TargetColumn",
    "TargetKind",
    "TargetSpec",
    "arrays_crc",
    "check_target",
    "first_bad_label",
    "infer_list_kind",
    "is_missing",
    "kind_of_value",
    "short_repr",
    "split_label",
    "targets_key",
]

TargetKind = Literal["class", "multilabel", "float", "none"]
KINDS: tuple[str, ...] = ("class", "multilabel", "float", "none")
#: the most values a ``float`` target may have per sample, and the most classes a multilabel database may have
MAX_DIM = 1 << 16
#: how a conversion's skip reason starts when a dataset's target is of another kind than the one inferred from its first
MIXED_KINDS = "a target of another kind:"
#: what ``none`` targets are in a batch, and what the header of a record holds for every kind but ``class``
NO_LABEL = -1


def targets_key(split: str, part: str | None = None) -> bytes:
    """The LMDB key of ``split``'s target array (``part``: ``"offsets"`` or ``"indices"`` of a multilabel split)."""
    return f"__targets__/{split}".encode() if part is None else f"__targets__/{split}/{part}".encode()


@dataclass(frozen=True)
class TargetSpec:
    """The target kind of a database: ``kind``, and its ``num_classes`` (multilabel) or ``dim`` (float).

    Args:
        kind: ``"class"``, ``"multilabel"``, ``"float"`` or ``"none"``.
        num_classes: the classes of a ``class`` or ``multilabel`` database (``C``).
        dim: the values per sample of a ``float`` database (``K`` >= 1).
        names: a ``float`` database's names of its values (the list file's columns), if known.

    """

    kind: str = "class"
    num_classes: int = 0
    dim: int = 0
    names: tuple[str, ...] = field(default=())

    @property
    def shape(self) -> tuple[int, ...]:
        """One sample's target shape in a batch: ``()``, ``(C,)`` multi-hot, ``(K,)`` (``()`` when K = 1)."""
        if self.kind == "multilabel":
            return (self.num_classes,)
        if self.kind == "float" and self.dim > 1:
            return (self.dim,)
        return ()

    @property
    def dtype(self) -> str:
        """The NumPy dtype of a batch's targets: ``int64`` for classes and ``none``, else ``float32``."""
        return "float32" if self.kind in ("multilabel", "float") else "int64"

    def to_meta(self) -> dict[str, Any]:
        """What the metadata records: ``{"kind": ...}`` and ``dim`` and ``names`` for ``float``."""
        if self.kind == "float":
            return {"kind": "float", "dim": self.dim, "names": list(self.names)}
        return {"kind": self.kind}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], path: Any = "") -> TargetSpec:
        """The kind a database's validated metadata records (``class`` when it records none).

        Raises:
            DatasetFormatError: the entry is not one of the shapes the writer writes.

        """
        entry = meta.get("targets", {"kind": "class"})
        classes = len(meta.get("classes", []))
        kind = entry.get("kind") if isinstance(entry, dict) else None
        problem = None
        if kind not in KINDS:
            problem = f"the target kind {kind!r} is not one of {', '.join(KINDS)}"
        elif kind == "float":
            dim, names = entry.get("dim"), entry.get("names", [])
            if type(dim) is not int or not 1 <= dim <= MAX_DIM:
                problem = f"a float target of {dim!r} values"
            elif not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > dim:
                problem = "the names of the float values are not a list of at most `dim` strings"
            else:
                return cls("float", 0, dim, tuple(names))
        elif kind == "multilabel" and classes > MAX_DIM:
            problem = f"{classes:,} classes for multi-label targets (at most {MAX_DIM:,})"
        if problem:
            raise DatasetFormatError(
                f"the metadata of {str(path)!r} is damaged: {problem}. Convert the source again with"
                " `lightning-fastdata convert`, or copy the database again from an intact copy."
            )
        return cls(str(kind), classes if kind in ("class", "multilabel") else 0)

    def describe(self) -> str:
        """``"class (10 classes)"``, ``"multilabel (20 classes)"``, ``"float (2 values: x, y)"``, ``"none"``."""
        if self.kind in ("class", "multilabel"):
            return f"{self.kind} ({self.num_classes} classes)"
        if self.kind == "float":
            names = f": {', '.join(self.names)}" if self.names else ""
            return f"float ({self.dim} value{'s' if self.dim > 1 else ''}{names})"
        return "none"


# ---------------------------------------------------------------------------------------------------------------
# Writing: a split's targets as typed arrays
# ---------------------------------------------------------------------------------------------------------------


class TargetColumn:
    """The targets of one split as the writer collects them, record by record; then its arrays and statistics.

    ``add`` takes what :func:`check_target` returns: a class index, a tuple of class indices, a tuple of floats, or
    ``None`` (kind ``none``).
    """

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self._labels: list[int] = []  # class: the index; multilabel: how many
        self._values: list[Any] = []  # multilabel: class indices; float: values

    def __len__(self) -> int:
        return len(self._labels)

    def add(self, target: Any) -> int:
        """Collect one record's target; returns the label its header holds (the class, else ``-1``)."""
        kind = self.spec.kind
        if kind == "class":
            self._labels.append(int(target))
            return int(target)
        if kind == "multilabel":
            self._labels.append(len(target))
            self._values.extend(target)
        elif kind == "float":
            self._labels.append(0)
            self._values.extend(target)
        else:
            self._labels.append(NO_LABEL)
        return NO_LABEL

    def arrays(self, split: str) -> dict[bytes, bytes]:
        """The split's arrays, by LMDB key (the ``class`` kind's is ``labels_key(split)``, written by the writer)."""
        kind = self.spec.kind
        if kind == "multilabel":
            offsets = np.zeros(len(self._labels) + 1, dtype="<i8")
            np.cumsum(self._labels, out=offsets[1:])
            return {
                targets_key(split, "offsets"): offsets.tobytes(),
                targets_key(split, "indices"): np.asarray(self._values, dtype="<i4").tobytes(),
            }
        if kind == "float":
            return {targets_key(split): np.asarray(self._values, dtype="<f4").tobytes()}
        return {}

    def top(self) -> int:
        """The largest class index collected (``class`` and ``multilabel``), ``-1`` for none."""
        values = self._labels if self.spec.kind == "class" else self._values
        return max(values, default=-1)

    def labels(self) -> np.ndarray:
        """The ``int32`` labels array of a ``class`` split."""
        return np.asarray(self._labels, dtype="<i4")

    def split_meta(self, split: str) -> dict[str, Any]:
        """What the split's metadata records of its targets: class counts, a CRC32 of its arrays, float statistics.

        ``class_counts``: records per class (``class``), records naming each class (``multilabel``), else empty.
        """
        kind, classes = self.spec.kind, self.spec.num_classes
        info: dict[str, Any] = {"class_counts": []}
        if kind == "class":
            labels = np.asarray(self._labels, dtype=np.int64)
            info["class_counts"] = np.bincount(labels, minlength=classes).tolist()
        elif kind == "multilabel":
            values = np.asarray(self._values, dtype=np.int64)
            info["class_counts"] = np.bincount(values, minlength=classes).tolist()
        if kind in ("multilabel", "float"):
            info["targets_crc32"] = arrays_crc(self.arrays(split).values())
        if kind == "float" and self._labels:
            values = np.asarray(self._values, dtype=np.float64).reshape(len(self._labels), self.spec.dim)
            info["target_stats"] = {
                "min": values.min(axis=0).tolist(),
                "mean": values.mean(axis=0).tolist(),
                "max": values.max(axis=0).tolist(),
            }
        return info


def first_bad_label(labels: np.ndarray, num_classes: int) -> int | None:
    """The position of the first of ``labels`` (class indices) outside ``0 <= label < num_classes``, else ``None``.

    One vectorised pass: what every reader of class labels checks (a record header's label, the split's label array).
    """
    if not labels.size or (labels.min() >= 0 and labels.max() < num_classes):
        return None
    return int(np.flatnonzero((labels < 0) | (labels >= num_classes))[0])


def arrays_crc(arrays: Any) -> int:
    """The CRC32 of a split's target arrays, one after the other (in key order: offsets, then indices)."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(array, crc)
    return crc


def check_target(spec: TargetSpec, value: Any, class_to_idx: dict[str, int] | None = None) -> Any:
    """One sample's target as the writer stores it, from what a dataset or list file gave.

    Returns:
        ``class``: the index; ``multilabel``: a sorted tuple of distinct class indices (names are looked up in
        ``class_to_idx``); ``float``: a tuple of ``dim`` finite floats; ``none``: ``None``.

    Raises:
        ValueError: the value does not fit the kind (the reason, for the conversion's list of skipped inputs).

    """
    kind = spec.kind
    if kind == "none":
        return None
    if kind == "class":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or int(value) < 0:
            raise ValueError(f"label must be a non-negative int, got {short_repr(value)}")
        return int(value)
    items = _as_items(value)
    if kind == "multilabel":
        if len(items) > 1 and all(isinstance(i, (float, np.floating, bool, np.bool_)) and i in (0, 1) for i in items):
            raise ValueError(
                f"{short_repr(value)} looks like a multi-hot vector: give each sample's class indices"
                " (`np.flatnonzero(v)`) or names"
            )
        indices = set()
        for item in items:
            if isinstance(item, str) and class_to_idx is not None and item in class_to_idx:
                indices.add(class_to_idx[item])
            elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
                if not 0 <= int(item) < spec.num_classes:
                    raise ValueError(f"class index {int(item)} is outside the {spec.num_classes} classes")
                indices.add(int(item))
            else:
                raise ValueError(f"{short_repr(item)} is not one of the classes")
        return tuple(sorted(indices))
    values = []
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, float, np.integer, np.floating, str)):
            raise ValueError(f"{short_repr(item)} is not a number")
        try:
            number = float(item)
        except ValueError:
            raise ValueError(f"{short_repr(item)} is not a number") from None
        if not math.isfinite(number) or abs(number) > float(np.finfo(np.float32).max):
            raise ValueError(f"the value {short_repr(item)} is not a finite float32")
        values.append(number)
    if len(values) != spec.dim:
        raise ValueError(f"{len(values)} value(s), where every sample has {spec.dim}")
    return tuple(values)


def _as_items(value: Any) -> list[Any]:
    """A target value as a list of items: a list, tuple or array as it is, a scalar as one item."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist()
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # a torch tensor
        out = value.tolist()
        return out if isinstance(out, list) else [out]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


# ---------------------------------------------------------------------------------------------------------------
# Reading: a split's targets, checked once per process, then gathered per batch from the memory map
# ---------------------------------------------------------------------------------------------------------------

#: splits whose arrays passed their check, by (database path, data file identity, split), each with the samples of a
#: ``float`` split whose values are not all finite, a bit a sample (``np.packbits``), or ``None`` (none, or another
#: kind): inherited by forked workers
_CHECKED: dict[tuple[str, tuple[int, ...], str], np.ndarray | None] = {}


class SplitTargets:
    """The targets of one split of a database: ``gather`` fills a batch's from the arrays in a read transaction.

    Args:
        spec: the database's target kind.
        split: the split.
        length: its records.
        crc: the CRC32 its metadata records for its arrays (``None`` for kinds without arrays).
        where: names the database in errors.

    """

    def __init__(self, spec: TargetSpec, split: str, length: int, crc: int | None, where: str) -> None:
        self.spec = spec
        self.split = split
        self.length = length
        self.crc = crc
        self.where = where

    def check_sizes(self, txn: Any) -> tuple[Any, ...]:
        """The split's arrays as read in ``txn`` (views), each of the size the split's length and kind need: O(1).

        What a reader checks when it opens the split, before a batch's memory is sized by the kind's ``C`` or ``K``.

        Raises:
            CorruptRecordError: an array is missing, or not of the size the metadata says.

        """
        spec, n = self.spec, self.length
        if spec.kind == "multilabel":
            raw = (txn.get(targets_key(self.split, "offsets")), txn.get(targets_key(self.split, "indices")))
            expected: list[int | None] = [8 * (n + 1), None]
        elif spec.kind == "float":
            raw, expected = (txn.get(targets_key(self.split)),), [4 * n * spec.dim]
        else:
            return ()
        for value, size in zip(raw, expected, strict=True):
            if value is None or (size is not None and len(value) != size) or len(value) % 4:
                needed = size or "a multiple of 4"
                found = "missing" if value is None else f"{len(value)} bytes where {needed} are needed"
                raise self._damaged(f"its target array is {found}")
        return raw

    def _arrays(self, txn: Any, identity: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """The split's arrays as views of the memory map (valid in ``txn``), checked once per data file."""
        raw = self.check_sizes(txn)
        dtypes = ("<i8", "<i4") if self.spec.kind == "multilabel" else ("<f4",)
        arrays = tuple(np.frombuffer(value, dtype=dtype) for value, dtype in zip(raw, dtypes, strict=True))
        key = (self.where, identity, self.split)
        if key not in _CHECKED:
            _CHECKED[key] = self._check(raw, arrays)
        return arrays

    def _check(self, raw: Sequence[Any], arrays: Sequence[np.ndarray]) -> np.ndarray | None:
        """Check the arrays once: raise if the split is damaged, else the bits of samples holding a value not finite."""
        if arrays_crc(raw) != self.crc:
            raise self._damaged("its target arrays fail their checksum: they were modified after conversion")
        if self.spec.kind == "multilabel":
            offsets, indices = arrays
            if offsets[0] != 0 or offsets[-1] != len(indices) or np.any(np.diff(offsets) < 0):
                raise self._damaged("its multi-label offsets do not ascend from 0 to the number of indices")
            if indices.size and (indices.min() < 0 or indices.max() >= self.spec.num_classes):
                raise self._damaged(f"a multi-label class index is outside the {self.spec.num_classes} classes")
            return None
        # values the writer refuses, NaN and infinities, in a checksum that holds: the database was written by
        # something else; the samples that hold one are damaged, the others are not (one pass, once per process)
        if np.isfinite(arrays[0]).all():
            return None
        return np.packbits(~np.isfinite(arrays[0].reshape(self.length, self.spec.dim)).all(axis=1))

    def check_records(self, txn: Any, identity: tuple[int, ...], records: np.ndarray | int) -> None:
        """Refuse samples ``records`` (an index, or an array of them) whose stored targets are not what the kind allows.

        The arrays' check (the checksum, once per process) marks the samples of a ``float`` split that hold a value that
        is not finite; each is refused where it is read, by every read path, as a record failing its checksum is. Costs
        a dictionary look-up while no sample is marked. Other kinds' arrays are checked whole: nothing to do here.

        Raises:
            CorruptRecordError: a sample holds a NaN or an infinity, naming the split, its index and its values; or the
                split's arrays are damaged.

        """
        if self.spec.kind != "float":
            return
        key = (self.where, identity, self.split)
        if key not in _CHECKED:
            self._arrays(txn, identity)
        bad = _CHECKED[key]
        if bad is None:
            return
        records = np.asarray(records, dtype=np.int64).reshape(-1)
        hit = np.flatnonzero(bad[records >> 3] & (0x80 >> (records & 7)).astype(np.uint8))
        if not hit.size:
            return
        index = int(records[hit[0]])
        values = self._arrays(txn, identity)[0].reshape(self.length, self.spec.dim)[index]
        shown = short_repr(values.tolist() if self.spec.dim > 1 else float(values[0]))
        raise CorruptRecordError(
            f"split {self.split!r} index {index} of {self.where!r}: its float target {shown} is not finite (NaN or"
            " infinite: the writer stores none). The database is damaged: convert the source again with"
            " `lightning-fastdata convert --force`."
        )

    def _damaged(self, problem: str) -> CorruptRecordError:
        return CorruptRecordError(
            f"split {self.split!r} of {self.where!r}: {problem}. The database is damaged: convert the source again"
            " with `lightning-fastdata convert --force`."
        )

    def class_lists(self, txn: Any, identity: tuple[int, ...]) -> list[list[int]]:
        """Every sample's class indices of a ``multilabel`` split, from the arrays (no ``N x C`` matrix is made)."""
        offsets, indices = self._arrays(txn, identity)
        return [part.tolist() for part in np.split(indices, offsets[1:-1])]

    def gather(self, txn: Any, identity: tuple[int, ...], records: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out`` (``[len(records), *spec.shape]`` of ``spec.dtype``) with the targets of ``records``."""
        kind = self.spec.kind
        if kind == "none":
            out[...] = NO_LABEL
            return
        arrays = self._arrays(txn, identity)
        if kind == "float":
            self.check_records(txn, identity, records)
            out.reshape(len(records), -1)[...] = arrays[0].reshape(self.length, self.spec.dim)[records]
            return
        offsets, indices = arrays
        out[...] = 0
        starts, ends = offsets[records], offsets[records + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        if total == 0:
            return
        rows = np.repeat(np.arange(len(records)), lengths)
        firsts = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        out[rows, indices[firsts + np.arange(total)]] = 1.0
