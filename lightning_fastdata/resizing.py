"""Progressive resizing and FixRes: the crop size changes between epochs, the datasets stay.

:meth:`FastImageDataModule.set_image_size <lightning_fastdata.FastImageDataModule.set_image_size>` (and its
``image_size_schedule``, applied by the training loader as each epoch starts) changes the size of the crops the
DataModule's datasets make, in place: the package's crop transforms
(:class:`~lightning_fastdata.transforms.RandomResizedCropFlip`,
:class:`~lightning_fastdata.transforms.CenterCropResize`) found on each dataset and the datasets it wraps (the
``val_fraction`` holdout's view, a ``Subset``, a wrapper of one's own that keeps the wrapped dataset as ``dataset``).
The datasets themselves are kept, so the holdout's indices, the sampler's order and each sample's crop box (drawn
from its key ``(seed, epoch, sample)``, whatever the output size) are those of a run at one size: only the resize
differs. The loaders follow at their next epoch (``FastLoader(before_epoch=...)``): batch slots of the new shape, and
persistent worker processes, which hold a copy of the dataset made when they started, restarted.

The DataModule's ``set_image_size`` (and its loaders' ``before_epoch``, which calls it, so that a subclass's override
counts) checks the size (:func:`check_size`) and hands a new one to :func:`apply_size`, the one place a size reaches
the loaders: the device stage, the datasets (:func:`resize_splits`) and the check of the stored images
(:func:`check_stored_size`); the schedule's size of an epoch is :func:`size_at`. Call it before ``fit``, or
from a callback's ``on_train_epoch_start`` (before the epoch's first batch is drawn); with ``image_size_schedule`` the
schedule sets the size again as each training epoch starts. It logs the change, and warns for each built dataset
without a crop transform to resize and, once the database is open, when its stored images are too small for the size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata import resolve
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.device import DeviceStage
from lightning_fastdata.pipeline.views import MultiViewCrop
from lightning_fastdata.plans import DataPlan
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.transforms import CenterCropResize, RandomResizedCropFlip


def check_schedule(schedule: Mapping[int, int] | None) -> dict[int, int] | None:
    """``image_size_schedule`` as a dict sorted by epoch, epochs ints >= 0 and sizes ints >= 1; ``None`` if empty.

    Raises:
        InvalidArgumentError: an epoch or a size of another type, or out of range.

    """
    if not isinstance(schedule, Mapping):
        if schedule is None:
            return None
        raise InvalidArgumentError(
            f"`image_size_schedule` maps epochs to image sizes, e.g. {{0: 128, 10: 160, 15: 224}}; got {schedule!r}."
        )
    if not schedule:
        return None
    for epoch, size in schedule.items():
        if not _is_int(epoch) or epoch < 0 or not _is_int(size) or size < 1:
            raise InvalidArgumentError(
                f"`image_size_schedule` maps epochs (ints >= 0) to image sizes (ints >= 1); got {epoch!r}: {size!r}."
            )
    return {int(epoch): int(schedule[epoch]) for epoch in sorted(schedule)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def size_at(schedule: Mapping[int, int], epoch: int, default: int) -> int:
    """The image size of ``epoch``: the schedule's entry for the last epoch up to ``epoch``, else ``default``."""
    started = [e for e in schedule if e <= epoch]
    return schedule[max(started)] if started else default


def crop_transforms(dataset: Any) -> list[RandomResizedCropFlip | CenterCropResize]:
    """The package's crop transforms ``dataset`` reads through: its ``transform`` and its wrapped datasets'.

    Each ``transform`` found is taken when it is one of the crop transforms, or else looked into, one level: a crop
    transform it holds as an attribute (a wrapper's ``self.base``) or in a list (torchvision ``Compose.transforms``).
    """
    found: list[RandomResizedCropFlip | CenterCropResize] = []
    seen: set[int] = set()
    node = dataset
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        transform = getattr(node, "transform", None)
        for candidate in [transform, *_held(transform)]:
            if isinstance(candidate, (RandomResizedCropFlip, CenterCropResize)) and id(candidate) not in seen:
                seen.add(id(candidate))
                found.append(candidate)
        node = getattr(node, "dataset", None)
    return found


def _held(transform: Any) -> list[Any]:
    """What a transform holds in its attributes, lists and tuples opened (nothing for a crop transform itself)."""
    if transform is None or isinstance(transform, (RandomResizedCropFlip, CenterCropResize)):
        return []
    held: list[Any] = []
    for value in getattr(transform, "__dict__", {}).values():
        held.extend(value if isinstance(value, (list, tuple)) else [value])
    return held


def resize(datasets: Iterable[Any], size: int) -> list[Any]:
    """Set the crop size of every dataset's crop transforms to ``size``; returns the datasets that have none.

    A dataset of views (:class:`~lightning_fastdata.pipeline.views.MultiViewCrop`) keeps the sizes its view groups set,
    and is not one that has none.
    """
    missed = []
    for dataset in datasets:
        transforms = crop_transforms(dataset)
        for transform in transforms:
            transform.size = size
        if not transforms and not _views_of(dataset):
            missed.append(dataset)
    return missed


def _views_of(dataset: Any) -> bool:
    """Whether ``dataset`` (or one it wraps) crops views: its sizes are its view groups', not ``image_size``."""
    seen: set[int] = set()
    while dataset is not None and id(dataset) not in seen:
        seen.add(id(dataset))
        if isinstance(getattr(dataset, "transform", None), MultiViewCrop):
            return True
        dataset = getattr(dataset, "dataset", None)
    return False


def check_size(size: Any) -> int:
    """``size`` for ``set_image_size``: an int >= 1.

    Raises:
        InvalidArgumentError: ``size`` is not an int >= 1.

    """
    if not _is_int(size) or size < 1:
        raise InvalidArgumentError(f"`set_image_size` needs an int >= 1, got {size!r}.")
    return int(size)


def resize_splits(built: Mapping[str, Any], size: int, previous: int, others: Iterable[Any] = ()) -> None:
    """Crop the built datasets (``{split: dataset or None}``, and ``others``) to ``size``, from ``previous``.

    The datasets stay, with their samples, order and ``val_fraction`` holdout; only their crop transforms
    (:class:`~lightning_fastdata.transforms.RandomResizedCropFlip`,
    :class:`~lightning_fastdata.transforms.CenterCropResize`) change size (:func:`resize`). Logs the change; warns
    for each named dataset without a crop transform to resize.
    """
    missed = resize([d for d in (*built.values(), *others) if d is not None], size)
    rank_zero_info(
        f"FastImageDataModule: image_size {previous} -> {size}; the loaders follow as their next epoch starts"
        " (new batch slots, and any persistent worker processes restart with the new crop size)."
    )
    for name, dataset in built.items():
        if dataset is not None and any(dataset is d for d in missed):
            rank_zero_warn(
                f"`set_image_size`: the {name} dataset's transform is not RandomResizedCropFlip or"
                " CenterCropResize, so its crops keep their size. Override `set_image_size` to resize it too."
            )


def apply_size(
    size: int,
    previous: int,
    built: Mapping[str, Any],
    others: Iterable[Any],
    stage: DeviceStage | None,
    opened: DataPlan | None,
) -> None:
    """What a change of the image size from ``previous`` to ``size`` changes, as ``set_image_size`` makes it.

    The device stage of the last loader built (``decode="device"`` crops there), the built datasets (``{split: dataset
    or None}`` and ``others``, :func:`resize_splits`) and, when the database is open (``opened``, its plan), the check
    that its stored images suit crops of ``size`` (:func:`check_stored_size`).
    """
    if stage is not None:
        stage.image_size = size
    resize_splits(built, size, previous, others)
    if opened is not None:
        check_stored_size(opened, size)


def check_stored_size(plan: DataPlan, size: int) -> None:
    """Warn when the stored images of ``plan``'s (open) database are too small for crops of ``size``."""
    stored = _environments.read_meta(plan.database_path).get("encoding", {}).get("short_side")
    resolve.check_store_size(stored, size, plan.crop_fraction, plan.is_database, plan.data_dir)
