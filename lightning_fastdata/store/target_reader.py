"""A split's targets as the reader gives them: :class:`TargetReader`, of every kind, checked as they are read.

:class:`~lightning_fastdata.store.reader.LmdbImageDataset` reads records and hands its targets here: a batch's in one
read (``targets_of``) and the whole split's (``targets``). A ``class`` split's labels come from its label array
(``__labels__/<split>``), the other kinds' from their typed arrays through
:class:`~lightning_fastdata.store.targets.SplitTargets`, and ``none`` targets are ``-1`` without a read. A label
outside the classes, or a ``float`` value that is not finite, is refused naming its sample, as every read of it is.

The dataset keeps its LMDB environment (opened lazily in the process that reads, never pickled): this object reads
through the dataset's own transactions, given as a callable, and names samples as the dataset does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np

from lightning_fastdata.errors import CorruptRecordError
from lightning_fastdata.store.format import labels_key
from lightning_fastdata.store.targets import NO_LABEL, SplitTargets, TargetSpec, first_bad_label

#: a read transaction of the dataset's database, yielding ``(txn, identity of its data file)``; LMDB's errors in it
#: become the dataset's for the activity named
Transaction = Callable[[str], AbstractContextManager[tuple[Any, tuple[int, ...]]]]


class TargetReader:
    """The targets of one split of an open database, read from its arrays in one read transaction a call.

    Args:
        arrays: the split's typed arrays (:class:`~lightning_fastdata.store.targets.SplitTargets`), its kind, split,
            length and database path.
        num_classes: the database's classes.
        transaction: opens a read transaction (the dataset's ``_transaction``).
        where: names sample ``index`` in errors (the dataset's ``_where``).

    """

    def __init__(
        self, arrays: SplitTargets, num_classes: int, transaction: Transaction, where: Callable[[int], str]
    ) -> None:
        self.arrays = arrays
        self.num_classes = num_classes
        self.transaction = transaction
        self.where = where

    @property
    def spec(self) -> TargetSpec:
        """The database's target kind."""
        return self.arrays.spec

    def of(self, records: Sequence[int] | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The targets of samples ``records`` as one array (``LmdbImageDataset.targets_of``).

        Raises:
            IndexError: a record is out of range.
            CorruptRecordError: the target arrays are missing or damaged, or a sample's target is, naming the first.

        """
        spec, split, length = self.spec, self.arrays.split, self.arrays.length
        records = np.asarray(records, dtype=np.int64)
        if records.size and (records.min() < 0 or records.max() >= length):
            raise IndexError(f"a record index is out of range for split {split!r} of length {length}")
        if out is None:
            out = np.empty((len(records), *spec.shape), dtype=spec.dtype)
        if spec.kind == "class":
            with self._label_array() as labels:
                out[...] = labels[records]
            bad = first_bad_label(out, self.num_classes)
            if bad is not None:
                raise self.bad_label(int(records[bad]), int(out[bad]))
            return out
        if spec.kind == "none":
            out[...] = NO_LABEL
            return out
        with self.transaction(self._reading("targets")) as (txn, identity):
            self.arrays.gather(txn, identity, records, out)
        return out

    def all(self) -> list[Any]:
        """The target of every sample (``LmdbImageDataset.targets``).

        Raises:
            CorruptRecordError: a class label is outside the classes, a float value is not finite, or the arrays are
                damaged, naming the first such sample.

        """
        kind = self.spec.kind
        if kind == "none":
            return [NO_LABEL] * self.arrays.length
        if kind == "multilabel":
            with self.transaction(self._reading("targets")) as (txn, identity):
                return self.arrays.class_lists(txn, identity)
        if kind == "float":  # a value that is not finite is refused, naming its sample (`SplitTargets.check_records`)
            return self.of(np.arange(self.arrays.length)).tolist()
        with self._label_array() as labels:
            bad = first_bad_label(labels, self.num_classes)  # as every other read of a label refuses it
            if bad is not None:
                raise self.bad_label(bad, int(labels[bad]))
            return labels.tolist()

    def bad_label(self, index: int, label: int) -> CorruptRecordError:
        """The error for sample ``index``'s class ``label`` outside the classes (its header's or the label array's)."""
        return CorruptRecordError(
            f"{self.where(index)}: label {label} is outside the {self.num_classes} classes. The database is damaged:"
            " convert the source again with `lightning-fastdata convert --force`."
        )

    @contextmanager
    def _label_array(self) -> Iterator[np.ndarray]:
        """The ``int32`` label array of a ``class`` split, a view of the memory map valid in the ``with`` block."""
        split, path = self.arrays.split, self.arrays.where  # its `where` is the database's path
        with self.transaction(self._reading("labels")) as (txn, _):
            raw = txn.get(labels_key(split))
            if raw is None or len(raw) != 4 * self.arrays.length:
                raise CorruptRecordError(f"the label array of split {split!r} of {path!r} is missing or damaged")
            yield np.frombuffer(raw, dtype="<i4")

    def _reading(self, part: str) -> str:
        """What a read of the split's ``part`` (``"targets"``, ``"labels"``) is called in an error."""
        return f"reading the {part} of split {self.arrays.split!r} of {self.arrays.where!r}"
