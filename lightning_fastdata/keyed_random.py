"""Random augmentation as a pure function of ``(seed, epoch, sample)``: the same crops wherever a sample is read.

The loaders of :class:`~lightning_fastdata.FastImageDataModule` do not draw augmentation from a stream of random
numbers (whose state depends on which thread, worker or rank read what before); every random number a sample needs is
computed from its **key**, ``(seed, epoch)``, its index and the number of the draw (a counter-based generator:
SplitMix64's mixing function over those counters). So a sample is cropped and flipped the same way:

* whichever engine, thread or worker process builds its batch, and however the epoch is cut into batches;
* in a run resumed from a mid-epoch checkpoint, as in the uninterrupted run (bit for bit);
* under DDP, whatever the number of ranks;
* by the fused batch path, the per-sample path (a dataset wrapping an ``LmdbImageDataset``) and ``decode="device"``.

A transform of your own gets the same property from :func:`sample_rng`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

#: ``(seed, epoch)``: with a sample's index, all its random augmentation depends on
AugmentKey = tuple[int, int]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on ``uint64`` arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def _base(key: AugmentKey) -> np.ndarray:
    seed, epoch = key
    z = _mix(np.array([seed & _MASK], dtype=np.uint64))
    return _mix(z ^ np.array([epoch & _MASK], dtype=np.uint64))


def keyed_uniforms(key: AugmentKey, samples: Sequence[int] | np.ndarray, draws: int, offset: int = 0) -> np.ndarray:
    """``(len(samples), draws)`` floats in ``[0, 1)``: draw ``offset + j`` of each sample under ``key``.

    A pure function of ``(seed, epoch, sample, draw)``: no state, no order, the same in every thread and process.

    Args:
        key: ``(seed, epoch)``.
        samples: sample indices (non-negative).
        draws: numbers per sample.
        offset: the number of the first draw (later draws of the same sample continue from it).

    """
    with np.errstate(over="ignore"):
        sample = np.asarray(samples, dtype=np.int64).astype(np.uint64).reshape(-1, 1)
        stream = _mix(_base(key) + (sample + np.uint64(1)) * _GAMMA)
        counter = np.arange(offset + 1, offset + draws + 1, dtype=np.uint64).reshape(1, -1)
        z = _mix(stream + counter * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class _Current(threading.local):
    """The sample this thread is reading: its key and index, and how many draws its transforms took so far."""

    key: AugmentKey | None = None
    sample = 0
    drawn = 0


_current = _Current()


@contextmanager
def sample_key(key: AugmentKey | None, sample: int) -> Iterator[None]:
    """Within the block, transforms on this thread draw from ``(key, sample)`` (no-op when ``key`` is ``None``).

    The loaders wrap each sample they read one by one (a dataset of your own around an ``LmdbImageDataset``) in it.
    """
    if key is None:
        yield
        return
    saved = (_current.key, _current.sample, _current.drawn)
    _current.key, _current.sample, _current.drawn = key, int(sample), 0
    try:
        yield
    finally:
        _current.key, _current.sample, _current.drawn = saved


def current_uniforms(draws: int) -> np.ndarray | None:
    """The next ``draws`` numbers of the sample being read, as a ``(1, draws)`` array; ``None`` outside a sample."""
    key = _current.key
    if key is None:
        return None
    offset = _current.drawn
    _current.drawn = offset + draws
    return keyed_uniforms(key, [_current.sample], draws, offset)


def sample_rng() -> np.random.Generator:
    """A NumPy generator for a transform's own random draws: reproducible and resume-exact inside the loaders.

    Inside a :class:`~lightning_fastdata.FastImageDataModule` loader it is seeded from the sample's key, so the
    transform draws the same numbers for the same sample and epoch in every run, engine and resume; each call within
    one sample gives a new generator. Elsewhere it is seeded from :mod:`random` (so ``seed_everything`` applies).

    Example:
        >>> rng = sample_rng()
        >>> gain = rng.uniform(0.8, 1.2)

    """
    drawn = current_uniforms(2)
    if drawn is None:
        return np.random.default_rng(random.getrandbits(64))
    return np.random.default_rng((drawn[0] * (1 << 53)).astype(np.uint64).tolist())
