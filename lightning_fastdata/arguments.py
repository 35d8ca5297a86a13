"""The plain checks of ``FastImageDataModule``'s arguments, made in its constructor before anything is saved.

:func:`check_arguments` raises :class:`~lightning_fastdata.errors.InvalidArgumentError` for the first argument out of
range, naming it and the value found, and returns the values the DataModule keeps in another form than it was given
(:class:`CheckedArguments`). Checks that need the data or the Trainer wait for ``setup`` and the loaders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_fastdata import resizing
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.processes import check_nice
from lightning_fastdata.pipeline.views import ViewGroup, check_views
from lightning_fastdata.store import remote
from lightning_fastdata.store.targets import KINDS
from lightning_fastdata.transforms import Normalizer


@dataclass(frozen=True)
class CheckedArguments:
    """The arguments a DataModule keeps in another form than it was given them."""

    #: ``image_size_schedule`` sorted by epoch, or ``None`` (:func:`~.resizing.check_schedule`)
    schedule: dict[int, int] | None
    #: ``views`` as :class:`~lightning_fastdata.pipeline.views.ViewGroup` s, or ``None``
    views: list[ViewGroup] | None
    #: ``mean`` and ``std``
    normalizer: Normalizer
    #: the training batches' colour augmentation (``None``: none), see :mod:`lightning_fastdata.pipeline.color`
    color: BatchColor | None


def check_arguments(
    *,
    cache_dir: str | None,
    image_size: int,
    image_size_schedule: Mapping[int, int] | None,
    batch_size: int,
    num_workers: int | str,
    engine: str,
    prefetch_factor: int | None,
    val_fraction: float,
    mean: Sequence[float],
    std: Sequence[float],
    decode: str,
    on_bad_sample: str,
    max_pixels: int | None,
    targets: str | None,
    views: Sequence[ViewGroup | Mapping[str, object]] | None,
    color_jitter: tuple[float, float, float, float] | None,
    color_jitter_p: float,
    grayscale_p: float,
    blur_p: float,
    blur_sigma: tuple[float, float],
    solarize_p: float,
    worker_nice: int,
) -> CheckedArguments:
    """Check the arguments of ``FastImageDataModule`` of the same names; return those kept in another form.

    Raises:
        InvalidArgumentError: an argument out of range (a ``ValueError``).

    """
    if image_size < 1 or batch_size < 1:
        raise InvalidArgumentError(f"`image_size` ({image_size}) and `batch_size` ({batch_size}) must be >= 1.")
    if num_workers not in ("auto", "tune") and (not isinstance(num_workers, int) or num_workers < 0):
        raise InvalidArgumentError(f"`num_workers` must be 'auto', 'tune' or an int >= 0, got {num_workers!r}.")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise InvalidArgumentError(f"`prefetch_factor` must be >= 1 or None, got {prefetch_factor}.")
    if not 0 <= val_fraction < 1:
        raise InvalidArgumentError(f"`val_fraction` must be in [0, 1), got {val_fraction}.")
    if engine not in ("auto", "threads", "processes"):
        raise InvalidArgumentError(f"`engine` must be 'auto', 'threads' or 'processes', got {engine!r}.")
    if decode not in ("cpu", "device"):
        raise InvalidArgumentError(f"`decode` must be 'cpu' or 'device', got {decode!r}.")
    if on_bad_sample not in ("raise", "skip"):
        raise InvalidArgumentError(f"`on_bad_sample` must be 'raise' or 'skip', got {on_bad_sample!r}.")
    check_nice(worker_nice)
    if max_pixels is not None and max_pixels < 1:
        raise InvalidArgumentError(f"`max_pixels` must be >= 1 or None (no limit), got {max_pixels}.")
    if targets is not None and targets not in KINDS:
        raise InvalidArgumentError(f"`targets` must be one of {', '.join(KINDS)} or None, got {targets!r}.")
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise InvalidArgumentError(f"`mean` and `std` need 3 values each and `std` > 0, got {mean} and {std}.")
    groups = check_views(views, decode, image_size_schedule)
    remote.check_local(
        cache_dir,
        "cache_dir",
        "the cache must be a local folder: its databases are memory-mapped. Pass a folder on the node's local disk",
    )
    return CheckedArguments(
        schedule=resizing.check_schedule(image_size_schedule),
        views=groups,
        normalizer=Normalizer(tuple(mean), tuple(std)),
        color=BatchColor.create(
            color_jitter, color_jitter_p, grayscale_p, blur_p, blur_sigma, solarize_p, views=groups
        ),
    )
