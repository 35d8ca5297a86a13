"""Random augmentation as a pure function of ``(seed, epoch, sample)``: the same crops wherever a sample is read.

The loaders of :class:`~lightning_fastdata.FastImageDataModule` do not draw augmentation from a stream of random
numbers (whose state depends on which thread, worker or rank read what before); every random number a sample needs is
computed from its **key**, ``(seed, epoch)``, its index and the number of the draw (a counter-based generator:
SplitMix64's mixing function over those counters). So a sample is cropped and flipped the same way:

* whichever engine, thread or worker process builds its batch, and however the epoch is cut into batches;
* in a run resumed from a mid-epoch checkpoint, as in the uninterrupted run (bit for bit);
* under DDP, whatever the number of ranks;
* by the fused batch path, the per-sample path (a dataset wrapping an ``LmdbImageDataset``) and ``decode="device"``.

A transform of your own (or a dataset of your own, read by the loaders) gets the same property:

* **torch's random functions** (``torch.rand``, ``randint``, ``randperm``, ``Tensor.uniform_``..., so every random
  torchvision v2 transform: ``RandAugment``, ``ColorJitter``, ``RandomResizedCrop``) draw, on CPU tensors and without
  a ``generator`` of their own, from a generator seeded from the sample's key, on every engine. The generator is the
  sample's own and is handed to them by a thread-local :class:`~torch.overrides.TorchFunctionMode`: loader threads
  draw in parallel, and the training thread's draws (dropout, ``torch.randperm`` in a model) are not touched.
* **Python's** :mod:`random` **and NumPy's global generator** are process-wide, so they can be keyed only where no
  other thread reads samples at the same time: in a worker process (``engine="processes"``) and on the training
  thread itself (``num_workers=0``). Each sample then draws from them seeded from its key, and their state is put back
  afterwards. On loader threads they stay shared: draw from :func:`sample_rng` instead.
* :func:`sample_rng` gives a NumPy generator keyed the same way, on every engine.

The draws depend on the DataModule's ``seed`` (the loader's), the epoch and the sample, not on ``seed_everything``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import get_worker_info

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


#: the draw numbers of a sample that seed its generators for torch, :mod:`random` and NumPy (no transform draws as
#: many numbers from :func:`current_uniforms`)
_GLOBAL_DRAWS = 1 << 40

#: torch's functions and tensor methods that draw random numbers and take a ``generator``
_TORCH_RANDOM = frozenset(
    [getattr(torch, name) for name in ("rand", "randn", "randint", "randperm", "rand_like", "randn_like")]
    + [getattr(torch, name) for name in ("randint_like", "multinomial", "bernoulli", "normal", "poisson")]
    + [getattr(torch.Tensor, name) for name in ("uniform_", "normal_", "random_", "exponential_", "bernoulli_")]
    + [getattr(torch.Tensor, name) for name in ("geometric_", "log_normal_", "cauchy_", "multinomial", "bernoulli")]
)


def _mix_int(z: int) -> int:
    """:func:`_mix` on one Python integer (a few times faster than on a NumPy array of one)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _sample_seed(key: AugmentKey, sample: int, stream: int) -> int:
    """A 53-bit seed for the sample's generator number ``stream`` (0: torch, 1: :mod:`random`, 2: NumPy).

    :func:`keyed_uniforms`'s draw ``_GLOBAL_DRAWS + stream`` of the sample, as an integer, in plain Python.
    """
    seed, epoch = key
    base = _mix_int(_mix_int(seed & _MASK) ^ (epoch & _MASK))
    gamma = 0x9E3779B97F4A7C15
    stream_base = _mix_int((base + (sample + 1) * gamma) & _MASK)
    return _mix_int((stream_base + (_GLOBAL_DRAWS + stream + 1) * gamma) & _MASK) >> 11


def _on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a random function's tensors and ``device`` are all on the CPU (the sample's generator is a CPU one)."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    return all(arg.device.type == "cpu" for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor))


class _KeyedTorchRandom(TorchFunctionMode):
    """Hands torch's random functions called on this thread the sample's generator, when they bring none.

    Modes are thread-local: the other loader threads and the training thread draw as they would without it.
    """

    def __init__(self, key: AugmentKey, sample: int) -> None:
        super().__init__()
        self.key, self.sample = key, sample
        self.generator: torch.Generator | None = None  # made at the first draw: a transform may draw nothing

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _TORCH_RANDOM and kwargs.get("generator") is None and _on_cpu(args, kwargs):
            if self.generator is None:
                self.generator = torch.Generator().manual_seed(_sample_seed(self.key, self.sample, 0))
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


@contextmanager
def _keyed_process_generators(key: AugmentKey, sample: int) -> Iterator[None]:
    """:mod:`random` and NumPy's global generator seeded from the sample's key within the block, then put back.

    Only where no other thread reads samples at once: the main thread of its process (a worker process's, or the
    training thread reading on its own with ``num_workers=0``), see :func:`keys_process_generators`.
    """
    if not keys_process_generators():
        yield
        return
    # a worker process draws from them for its samples only: nothing to put back, and saving NumPy's state is not free
    # (docs/benchmarks.md#keyed-random-numbers-worker-processes-save-no-state)
    saved = None if get_worker_info() is not None else (random.getstate(), np.random.get_state())
    random.seed(_sample_seed(key, sample, 1))
    np.random.seed(_sample_seed(key, sample, 2) & 0xFFFFFFFF)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])


def keys_process_generators() -> bool:
    """Whether samples read on this thread draw from :mod:`random` and NumPy's global generator by their key.

    True on the main thread of a process (a worker process of ``engine="processes"``, or the training thread reading
    batches itself, ``num_workers=0``); false on loader threads (``engine="threads"``), which share those generators
    with each other and with the training thread.
    """
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sample_key(key: AugmentKey | None, sample: int) -> Iterator[None]:
    """Within the block, transforms on this thread draw from ``(key, sample)`` (no-op when ``key`` is ``None``).

    The loaders wrap each sample they read one by one (a transform or a dataset of your own) in it: the package's
    transforms and :func:`sample_rng` draw from the key, and so do torch's random functions (on CPU tensors, without a
    ``generator``), and :mod:`random` and NumPy's global generator where :func:`keys_process_generators`.
    """
    if key is None:
        yield
        return
    saved = (_current.key, _current.sample, _current.drawn)
    _current.key, _current.sample, _current.drawn = key, int(sample), 0
    try:
        with _KeyedTorchRandom(key, int(sample)), _keyed_process_generators(key, int(sample)):
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


def draws_process_generators(read: Callable[[int], Any], samples: Sequence[int], key: AugmentKey) -> bool | None:
    """Whether reading ``samples`` as a loader thread does draws from :mod:`random` or NumPy's global generator.

    Each sample is read by ``read(sample)`` within its key (:func:`sample_key`) on a thread of its own, as on a loader
    thread, where those process-wide generators cannot be keyed; their states before and after tell, and are put back.
    ``None`` when a read raised (nothing can be said). The caller's threads must not draw from them meanwhile.
    """
    found: list[bool | None] = [None]

    def probe() -> None:
        python, numpy = random.getstate(), np.random.get_state()
        try:
            for sample in samples:
                with sample_key(key, sample):
                    read(sample)
            now = np.random.get_state()
            found[0] = random.getstate() != python or now[2] != numpy[2] or not np.array_equal(now[1], numpy[1])
        except Exception:
            return
        finally:
            random.setstate(python)
            np.random.set_state(numpy)

    thread = threading.Thread(target=probe, name="lightning_fastdata-probe", daemon=True)
    thread.start()
    thread.join()
    return found[0]
