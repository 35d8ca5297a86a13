"""The per-sample path: a batch of a dataset or transform of one's own, ``dataset[i]`` for each sample, then stacked.

:class:`~lightning_fastdata.pipeline.kernel.BatchReader` reads a split this way when the fused path does not apply
(:func:`~lightning_fastdata.pipeline.kernel.fast_path`). Each sample's transforms draw from its key, as the fused
path's crops do, and the batch carries what the reader was asked for beside it: the samples' true dataset indices,
their colour parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from lightning_fastdata.keyed_random import AugmentKey, sample_key
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.schema import sample_batch
from lightning_fastdata.pipeline.targets import true_index
from lightning_fastdata.skipping import SkipCounter, read_kept
from lightning_fastdata.transforms import epoch_crop_size


def read_samples(
    dataset: Dataset,
    view: np.ndarray | None,
    indices: Sequence[int],
    key: AugmentKey | None,
    crop_size: int | None,
    return_index: bool,
    color: BatchColor | None,
    skip_counter: SkipCounter | None,
) -> Any:
    """The batch of samples ``indices`` of ``dataset``, ``default_collate``'d, with its index and colour if asked.

    ``view``: each sample's index into the split a subset views (:func:`~lightning_fastdata.pipeline.targets.
    subset_view`), or ``None``; ``crop_size``: the epoch's, for the package's crop transforms.
    """
    kept = read_kept(indices, lambda index: (_sample(dataset, index, key, crop_size), index), skip_counter)
    collated = default_collate([sample for sample, _ in kept])
    if not return_index and color is None:
        return collated
    records = [true_index(dataset, view, index) for _, index in kept]
    index = torch.tensor(records, dtype=torch.int64) if return_index else None
    return sample_batch(collated, index, _sample_color(color, collated, key, records))


def _sample(dataset: Dataset, index: int, key: AugmentKey | None, crop_size: int | None) -> Any:
    """One sample through the wrapped dataset, its transforms drawing from its key.

    Within :func:`~lightning_fastdata.keyed_random.sample_key` torch's random functions (every random torchvision
    v2 transform) draw from the sample's key on every engine, so a transform of one's own is reproducible and
    resume-exact; so are :mod:`random` and NumPy's global generator, except on loader threads.
    """
    with sample_key(key, index), epoch_crop_size(crop_size):
        return dataset[index]


def _sample_color(
    color: BatchColor | None, collated: Any, key: AugmentKey | None, records: Sequence[int]
) -> dict[str, Any]:
    """A per-sample batch's beside fields: its colour parameters (keyed by the dataset indices), when drawn."""
    if color is None:
        return {}
    images = collated[0] if isinstance(collated, (tuple, list)) else collated
    # a transform's list of views: each view of a sample its own parameters, as the built-in views'
    views = len(images) if isinstance(images, (tuple, list)) else None
    return {"color": torch.from_numpy(color.draw(key, records, views))}
