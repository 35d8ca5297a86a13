"""What ``PredictionWriter`` writes for each sample: ``predict_step``'s output read into rows.

A batch's output is read once, on the process that predicted it, into a row kind and one JSON value per sample
(:func:`per_sample`). What a tensor means depends on its shape and dtype and on the DataModule's targets: logits of
its classes, class indices, multi-label logits, float values; anything else is written as it is. The part files carry
those values (:mod:`~lightning_fastdata.prediction_parts`); at the merge, :class:`RowLayout` turns each into the
output's columns, with what only rank zero knows: the sample's index in the dataset its subsets view, its source and
its class names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_fastdata.errors import InvalidArgumentError

#: the output's columns, in order (a float DataModule's value names go before ``output``); a column appears when some
#: row has it
COLUMNS = ("index", "source", "label", "class", "labels", "classes", "value", "output")
#: a part file's row kinds: a class (``label``, ``class``), the classes of a multi-label sample (``labels``,
#: ``classes``), a float target's values (``value``, or one column per name) or a raw model output (``output``)
CLASS, MULTI, VALUES, RAW = b"c", b"m", b"v", b"r"


@dataclass
class RowLayout:
    """What a row holds besides its prediction, and the columns of the output; filled as the run learns them.

    Attributes:
        classes: the DataModule's class names (``None``: not known; no ``class`` or ``classes`` column).
        sources: each sample's source in the dataset the predict dataset views (``None``: no ``source`` column).
        names: a float target's value names, one column each (``None``: one ``value`` column).
        indices: each sample index of the predict loader's dataset -> its index in the dataset its subsets view
            (``None``: no subset, the same index).

    """

    classes: list[str] | None = None
    sources: list[str] | None = None
    names: list[str] | None = None
    indices: np.ndarray | None = None

    def database_index(self, index: int) -> int:
        """Sample ``index`` of the predict loader's dataset as an index of the dataset its subsets view."""
        if self.indices is None or not 0 <= index < len(self.indices):
            return index
        return int(self.indices[index])

    def source(self, index: int) -> str | None:
        """The source of the viewed dataset's sample ``index``; ``None`` when unknown."""
        if self.sources is None or not 0 <= index < len(self.sources):
            return None
        return self.sources[index]

    def where(self, index: int) -> str:
        """Sample ``index`` of the predict dataset named for a message: its viewed index and source when known."""
        where = f"sample {index}"
        database_index = self.database_index(index)
        if database_index != index:
            where += f" of the predict dataset (index {database_index} of the dataset it views)"
        source = self.source(database_index)
        if source is not None:
            where += f", {source!r},"
        return where

    def columns(self, kinds: set[bytes]) -> list[str]:
        """The output's columns for rows of ``kinds``, in order."""
        columns = [column for column in COLUMNS if self._has(column, kinds)]
        if self.names is not None and VALUES in kinds:  # the value names in place of `value`
            at = columns.index("value")
            columns[at : at + 1] = self.names
        return columns

    def _has(self, column: str, kinds: set[bytes]) -> bool:
        if column == "index":
            return True
        if column == "source":
            return self.sources is not None
        if column == "label":
            return CLASS in kinds
        if column == "class":
            return CLASS in kinds and self.classes is not None
        if column == "labels":
            return MULTI in kinds
        if column == "classes":
            return MULTI in kinds and self.classes is not None
        if column == "value":
            return VALUES in kinds
        return RAW in kinds

    def row(self, index: int, kind: bytes, value: Any) -> dict[str, Any]:
        """The output row of sample ``index`` of the predict dataset, whose part row has ``kind`` and ``value``."""
        # the index and source of the sample itself, not its position in a subset of the dataset
        index = self.database_index(index)
        row: dict[str, Any] = {"index": index}
        if self.sources is not None:
            row["source"] = self.source(index)
        if kind == CLASS:
            row["label"] = value
            if self.classes is not None:
                row["class"] = self.classes[value] if 0 <= value < len(self.classes) else None
        elif kind == MULTI:
            row["labels"] = value
            if self.classes is not None:
                classes = self.classes
                row["classes"] = [classes[i] if 0 <= i < len(classes) else None for i in value]
        elif kind == VALUES:
            if self.names is None:
                row["value"] = value
            else:
                row.update(zip(self.names, value if isinstance(value, list) else [value], strict=True))
        else:
            row["output"] = value
        return row


def per_sample(
    prediction: Any, n: int, classes: Sequence[str] | None, target: tuple[str, int, float] = ("class", 0, 0.5)
) -> tuple[bytes, list[Any]]:
    """``predict_step``'s output for a batch of ``n`` samples: its row kind, and one JSON value per sample.

    ``target``: the DataModule's target kind, values per sample of a ``float`` target, and the multi-label threshold.

    Raises:
        InvalidArgumentError: the output cannot be split into ``n`` samples.

    """
    kind, dim, threshold = target
    floating = isinstance(prediction, torch.Tensor) and prediction.is_floating_point()
    if floating and prediction.ndim and len(prediction) == n:
        if kind == "multilabel" and prediction.ndim == 2 and classes and prediction.shape[1] == len(classes):
            above = (prediction.detach().float().sigmoid() > threshold).cpu()
            return MULTI, [row.nonzero().flatten().tolist() for row in above]
        if kind == "float" and dim >= 1 and prediction.shape[1:] in ((dim,), () if dim == 1 else (dim,)):
            values = prediction.detach().float().cpu()
            return VALUES, [_jsonable(item) for item in (values.reshape(n) if dim == 1 else values).tolist()]
    if isinstance(prediction, torch.Tensor):
        if prediction.is_floating_point() and prediction.ndim == 2 and classes and prediction.shape[1] == len(classes):
            return CLASS, prediction.argmax(dim=1).tolist()
        integer = not (prediction.is_floating_point() or prediction.is_complex() or prediction.dtype == torch.bool)
        if integer and prediction.ndim == 1 and len(prediction) == n:
            return CLASS, prediction.tolist()
    return RAW, _split(prediction, n)


def _split(value: Any, n: int) -> list[Any]:
    """``value`` as ``n`` JSON values, one per sample."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim >= 1 and len(value) == n:
        return [_jsonable(item) for item in value.tolist()]
    if isinstance(value, Mapping):
        columns = {str(key): _split(item, n) for key, item in value.items()}
        return [{key: items[i] for key, items in columns.items()} for i in range(n)]
    if isinstance(value, list | tuple) and len(value) == n:
        return [_jsonable(item) for item in value]
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor | np.ndarray) else ""
    raise InvalidArgumentError(
        f"`PredictionWriter` cannot split `predict_step`'s output ({type(value).__name__}{shape}) into the batch's {n}"
        " samples: return a tensor or array whose first dimension is the batch, a mapping of them, or a list with one"
        " item per sample."
    )


def _jsonable(value: Any) -> Any:
    """``value`` as JSON types: tensors and arrays as lists, a NaN or infinity as ``None``."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)
