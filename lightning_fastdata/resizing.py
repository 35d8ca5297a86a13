"""Progressive resizing and FixRes: the crop size changes between epochs; datasets and transforms stay as built.

:meth:`FastImageDataModule.set_image_size <lightning_fastdata.FastImageDataModule.set_image_size>` (and its
``image_size_schedule``, applied by the training loader as each epoch starts) changes the DataModule's current
``image_size``, and nothing else in place. Each loader asks for the size as its next epoch starts (its
``before_epoch``) and gives it to its batch reader
(:meth:`BatchReader.start_epoch <lightning_fastdata.pipeline.kernel.BatchReader.start_epoch>`): the fused path cuts
its crops to it, and on the per-sample path the package's crop transforms
(:class:`~lightning_fastdata.transforms.RandomResizedCropFlip`,
:class:`~lightning_fastdata.transforms.CenterCropResize`) read it wherever the dataset calls them, inside a ``Compose``
or a wrapper of one's own (:func:`~lightning_fastdata.transforms.epoch_crop_size`). The datasets are kept, so the
holdout's indices, the sampler's order and each sample's crop box (drawn from its key ``(seed, epoch, sample)``,
whatever the output size) are those of a run at one size: only the resize differs. A new size gets batch slots of the
new shape, and persistent worker processes, which hold a copy of the reader made when they started, restart.

The DataModule's ``set_image_size`` (and its loaders' ``before_epoch``, which calls it, so that a subclass's override
counts) checks the size (:func:`check_size`) and hands a new one to :func:`apply_size`: the device stage of
``decode="device"``, the log line and warnings, and the check of the stored images (:func:`check_stored_size`); the
schedule's size of an epoch is :func:`size_at`. Call it before ``fit``, or from a callback's ``on_train_epoch_start``
(before the epoch's first batch is drawn). It warns for each built dataset read sample by sample whose transform is
not the package's crop (the size reaches only the package's crop transforms such a transform calls) and, once the
database is open, when its stored images are too small for the size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata import resolve
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.device import DeviceStage
from lightning_fastdata.pipeline.kernel import fuses
from lightning_fastdata.plans import DataPlan
from lightning_fastdata.store import environments as _environments


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


def check_size(size: Any) -> int:
    """``size`` for ``set_image_size``: an int >= 1.

    Raises:
        InvalidArgumentError: ``size`` is not an int >= 1.

    """
    if not _is_int(size) or size < 1:
        raise InvalidArgumentError(f"`set_image_size` needs an int >= 1, got {size!r}.")
    return int(size)


def say_new_size(built: Mapping[str, Any], size: int, previous: int) -> None:
    """Log the change from ``previous`` to ``size``, and warn for each built dataset read sample by sample.

    ``built``: ``{split: dataset or None}``. A dataset read sample by sample follows the size only where its transform
    calls the package's crop transforms.
    """
    rank_zero_info(
        f"FastImageDataModule: image_size {previous} -> {size}; the loaders follow as their next epoch starts"
        " (new batch slots, and any persistent worker processes restart with the new crop size)."
    )
    for name, dataset in built.items():
        if dataset is not None and not fuses(dataset):
            rank_zero_warn(
                f"`set_image_size`: the {name} dataset's transform is not RandomResizedCropFlip or CenterCropResize:"
                " the new size reaches only the package's crop transforms it calls (in a Compose, say); other"
                " transforms keep their size. Override `set_image_size` to resize it too."
            )


def apply_size(
    size: int,
    previous: int,
    built: Mapping[str, Any],
    stage: DeviceStage | None,
    opened: DataPlan | None,
) -> None:
    """What a change of the image size from ``previous`` to ``size`` changes at once, as ``set_image_size`` makes it.

    The device stage of the last loader built (``decode="device"`` crops there), what is said of the built datasets
    (``{split: dataset or None}``, :func:`say_new_size`) and, when the database is open (``opened``, its plan), the
    check that its stored images suit crops of ``size`` (:func:`check_stored_size`). The loaders' readers take the
    size as their next epoch starts.
    """
    if stage is not None:
        stage.image_size = size
    say_new_size(built, size, previous)
    if opened is not None:
        check_stored_size(opened, size)


def check_stored_size(plan: DataPlan, size: int) -> None:
    """Warn when the stored images of ``plan``'s (open) database are too small for crops of ``size``."""
    stored = _environments.read_meta(plan.database_path).get("encoding", {}).get("short_side")
    resolve.check_store_size(stored, size, plan.crop_fraction, plan.is_database, plan.data_dir)
