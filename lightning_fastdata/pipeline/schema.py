"""The batch schema: what a batch holds, field by field, and the one place a training step's batch is built.

A batch is a few named fields, one row per sample, each with its dtype, one sample's shape and its producer:

- ``images``: ``uint8`` ``(H, W, 3)`` (``channels_last`` memory) or ``float32`` ``(3, H, W)``; one field per view of a
  multi-view batch (``view0``, ``view1``, ...). Produced by the crop kernel straight into the batch's memory
  (:class:`~lightning_fastdata.pipeline.kernel.BatchReader`).
- ``target``: the database's kind (:class:`~lightning_fastdata.store.targets.TargetSpec`: ``int64 ()`` classes,
  ``float32 (C,)`` multi-hot, ``float32 (K,)`` values). Produced from the record headers (classes) or the split's
  target arrays (:func:`~lightning_fastdata.pipeline.targets.fill_targets`).
- ``index``: ``int64 ()``, the sample's dataset index (``return_index``). Produced from the records read.
- ``color``: ``float32 (7,)``, ``(V, 7)`` for ``V`` views: the colour parameters, drawn from the sample's key
  (:meth:`BatchColor.draw <lightning_fastdata.pipeline.color.BatchColor.draw>`). Travels *beside* the batch.

A :class:`BatchSchema` lists a loader's fields. From it come where each field lives in a batch slot
(:class:`~lightning_fastdata.pipeline.slots.SlotLayout`) and what reaches the training step
(:meth:`BatchSchema.assemble`): ``(images, target[, index])``, a plain tuple as the docs promise (``images`` a list of
``V`` tensors for views), so every training step written for a ``DataLoader`` runs unchanged. A field marked
``beside`` (the colour parameters) is not in that tuple: it travels beside it, as :attr:`Batch.beside`, to the device
stage that uses it (:class:`~lightning_fastdata.pipeline.device.DeviceStage`); a training step never sees it.

Adding a field starts here: its :class:`FieldSpec` (dtype and shape rule) in :meth:`BatchSchema.of`, then its producer
in the fused path's table (``PRODUCERS`` in :mod:`~lightning_fastdata.pipeline.kernel`). Slots, hand-outs, copies to
the device and batches built in fresh memory follow from the schema; :meth:`BatchSchema.assemble` puts every field that
is not ``beside`` in order after the images.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_fastdata.pipeline.color import COLUMNS

#: the colour parameters' columns per sample (per view)
COLOR_COLUMNS = len(COLUMNS)


@dataclass(frozen=True)
class FieldSpec:
    """One field of a batch: its name, dtype and one sample's shape (in memory order).

    ``beside``: the field travels beside the training step's batch (:attr:`Batch.beside`), for the device stage.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    beside: bool = False

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample's value."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BatchSchema:
    """The fields of a loader's batches: the images (one field per view) and the fields after them, in order."""

    #: one field per image region: the images, or each view's
    images: tuple[FieldSpec, ...]
    #: the fields after the images, in the order the training step's batch holds them (``beside`` ones aside)
    fields: tuple[FieldSpec, ...] = ()
    #: whether the images are views, handed out as a list (even of one)
    multiview: bool = False

    @classmethod
    def of(
        cls,
        image_shapes: Sequence[tuple[int, ...]],
        dtype: str = "uint8",
        target: tuple[tuple[int, ...], str] = ((), "int64"),
        index: bool = False,
        color: bool = False,
        multiview: bool | None = None,
    ) -> BatchSchema:
        """The schema of a fused batch: each image region's sample shape, its dtype, the target's shape and dtype.

        ``index``: with each sample's dataset index; ``color``: with its colour parameters, beside the batch (one row
        of :data:`COLOR_COLUMNS` per view). ``multiview`` (default: more than one image shape) hands the images out as
        a list.
        """
        multiview = len(image_shapes) > 1 if multiview is None else multiview
        names = [f"view{v}" for v in range(len(image_shapes))] if multiview else ["images"]
        images = tuple(FieldSpec(name, dtype, tuple(shape)) for name, shape in zip(names, image_shapes, strict=True))
        fields = [FieldSpec("target", target[1], tuple(target[0]))]
        if index:
            fields.append(FieldSpec("index", "int64", ()))
        if color:
            rows = (len(image_shapes), COLOR_COLUMNS) if multiview else (COLOR_COLUMNS,)
            fields.append(FieldSpec("color", "float32", rows, beside=True))
        return cls(images, tuple(fields), multiview)

    @property
    def all_fields(self) -> tuple[FieldSpec, ...]:
        """Every field, images first: the order of a batch slot."""
        return self.images + self.fields

    def field(self, name: str) -> FieldSpec | None:
        """The field ``name``, or ``None`` when batches do not hold it."""
        return next((field for field in self.all_fields if field.name == name), None)

    def assemble(self, images: Sequence[Any], values: Mapping[str, Any]) -> tuple[Any, ...]:
        """What the training step takes: ``(images, *fields)``, and the ``beside`` fields beside it.

        ``images``: each image region's tensor (one per view); ``values``: every other field's, by name. Returns a
        plain tuple, or a :class:`Batch` when a field travels beside it.
        """
        batch: list[Any] = [list(images) if self.multiview else images[0]]
        beside: dict[str, Any] = {}
        for field in self.fields:
            if field.beside:
                beside[field.name] = values[field.name]
            else:
                batch.append(values[field.name])
        return Batch(batch, beside) if beside else tuple(batch)


class Batch(tuple):
    """A training step's batch, a plain tuple, with the fields that travel beside it: ``beside``, by name.

    The device stage takes ``beside`` (:func:`split_beside`) and hands the training step a plain tuple. Pickled with
    its ``beside`` (a worker process's batch).
    """

    beside: dict[str, Any]

    def __new__(cls, fields: Iterable[Any] = (), beside: Mapping[str, Any] | None = None) -> Batch:  # noqa: D102
        batch = super().__new__(cls, fields)
        batch.beside = dict(beside or {})
        return batch

    def __reduce__(self) -> Any:
        return type(self), (tuple(self), self.beside)


class BatchList(list):
    """:class:`Batch` for a batch that is a list (a per-sample path's, as ``default_collate`` makes them)."""

    beside: dict[str, Any]

    def __init__(self, fields: Iterable[Any] = (), beside: Mapping[str, Any] | None = None) -> None:
        super().__init__(fields)
        self.beside = dict(beside or {})

    def __reduce__(self) -> Any:
        return type(self), (list(self), self.beside)


def sample_batch(collated: Any, index: Any = None, beside: Mapping[str, Any] | None = None) -> Any:
    """A batch not built from slots (the per-sample path's, still-encoded images'): ``collated`` (and ``index``).

    ``collated``'s elements, then ``index`` when given, and ``beside`` beside them.

    ``collated``: what ``default_collate`` made of the samples (a list of their elements, for tuples), or the batch's
    elements as a tuple. The index goes last, in the same container (a list after ``collated`` itself when that is no
    tuple or list, as ``default_collate`` makes of samples that end with their index).
    """
    if index is not None:
        collated = (
            (*collated, index)
            if isinstance(collated, tuple)
            else [*(collated if isinstance(collated, list) else [collated]), index]
        )
    return with_beside(collated, beside or {}) if isinstance(collated, (tuple, list)) else collated


def with_beside(batch: Sequence[Any], beside: Mapping[str, Any]) -> Any:
    """``batch`` (a tuple or a list) with ``beside``: a :class:`Batch` or :class:`BatchList`; ``batch`` if empty."""
    if not beside:
        return batch
    return BatchList(batch, beside) if isinstance(batch, list) else Batch(batch, beside)


def split_beside(batch: Any) -> tuple[Any, dict[str, Any]]:
    """``(the plain batch, its beside fields)``: ``(batch, {})`` for a batch that carries none."""
    beside = getattr(batch, "beside", None)
    if type(batch) is Batch:
        return tuple(batch), beside  # type: ignore[return-value]
    if type(batch) is BatchList:
        return list(batch), beside  # type: ignore[return-value]
    return batch, {}
