"""A batch's targets and dataset indices: from the records' headers or typed arrays into the batch's memory.

Step 3 of the batch path gives every batch the targets of its database's kind
(:mod:`~lightning_fastdata.store.targets`): class indices are the record headers' labels, already read with the images,
so a class batch costs nothing more; the other kinds are read once a batch from the split's typed arrays
(:meth:`~lightning_fastdata.LmdbImageDataset.targets_of`, a few bytes a sample) straight into the slot or fresh memory
that holds the batch. With ``return_index`` the batch also holds each sample's true dataset index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fastdata.pipeline.schema import FieldSpec
from lightning_fastdata.store.reader import LmdbImageDataset, collate_labels


def fill_targets(base: LmdbImageDataset, labels: Sequence[int], records: Sequence[int], out: np.ndarray) -> Any:
    """The kept samples' targets into ``out`` (``[n, *target_spec.shape]``); ``None``, or those that do not fit it.

    ``labels``: the kept records' header labels (their classes, for a ``class`` database); ``records``: their indices
    in the split. A ``target_transform`` runs per sample: class indices it returns go into ``out``, anything else is
    collated and returned for the batch to carry beside its memory.
    """
    class_kind, transform = base.target_spec.kind == "class", base.target_transform
    if transform is None:
        if class_kind:
            out[:] = labels
        else:
            base.targets_of(records, out=out)
        return None
    samples: list[Any] = list(labels) if class_kind else list(torch.from_numpy(base.targets_of(records)))
    samples = [transform(sample) for sample in samples]
    if class_kind and all(type(sample) is int for sample in samples):
        out[:] = samples
        return None
    return collate_labels(samples)


def new_rows(field: FieldSpec, n: int, pinned: bool) -> Tensor:
    """Fresh memory for ``n`` rows of ``field``, for a batch built without a slot (page-locked when ``pinned``)."""
    shape = (n, *field.shape)
    if pinned:  # torch's caching host allocator reuses pinned blocks safely
        return torch.empty(shape, dtype=getattr(torch, field.dtype), pin_memory=True)
    return torch.from_numpy(np.empty(shape, dtype=field.dtype))


def subset_view(dataset: Any) -> tuple[Any, np.ndarray | None]:
    """``(base, indices)``: the dataset a subset views, through nested subsets, and each sample's index into it.

    A subset is what has the dataset it views as ``dataset`` and its indices into it as ``indices``
    (``torch.utils.data.Subset``, the DataModule's held-out view); the indices of each level are mapped through those
    of the level below, and a negative one counts from the end, as ``dataset[index]`` reads it. ``(dataset, None)``
    for a dataset that is no subset, or whose indices are not integers.
    """
    base, indices = dataset, None
    while getattr(base, "indices", None) is not None and getattr(base, "dataset", None) is not None:
        try:
            level = np.asarray(base.indices, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):  # indices of a kind of one's own: not mapped
            return dataset, None
        inner = base.dataset
        with contextlib.suppress(TypeError):  # a dataset without a length: its indices are what they say
            level = np.where(level < 0, level + len(inner), level)
        indices = level if indices is None else level[indices]
        base = inner
    return base, indices


def true_index(dataset: Any, view: np.ndarray | None, index: int) -> int:
    """Sample ``index``'s dataset index: through subsets (``view``: :func:`subset_view`'s, or found now) what it views.

    Without ``view``, each level's ``indices`` are looked up for this one sample (nested subsets too).
    """
    if view is not None:
        return int(view[index])
    while getattr(dataset, "indices", None) is not None and getattr(dataset, "dataset", None) is not None:
        index, dataset = dataset.indices[index], dataset.dataset
        if index < 0:
            index += len(dataset)
    return int(index)


def records_of(indices: Sequence[int], view: np.ndarray | None) -> list[tuple[int, int]]:
    """``(index, record)`` pairs: each index of a batch with its record in the base split (``view``: a subset's)."""
    positions = [int(i) for i in indices]
    if view is None:
        return list(zip(positions, positions, strict=True))
    return list(zip(positions, view[np.asarray(positions, dtype=np.int64)].tolist(), strict=True))
