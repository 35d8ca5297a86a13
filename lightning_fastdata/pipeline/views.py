"""Several crops of each image, decoded once: the view groups of self-supervised training (DINO, SimCLR, iBOT).

``FastImageDataModule(views=[...])`` takes a list of :class:`ViewGroup`: ``count`` random resized crops of ``size``
pixels, with their own ``scale``, ``ratio`` and ``flip`` probability. :func:`check_views` validates them and orders
the groups by size, largest first; :class:`MultiViewCrop` is the training transform they make.

On the fused batch path (:class:`~lightning_fastdata.pipeline.kernel.BatchReader`) each image is decoded once and
every view is cropped, resized and flipped from those pixels straight into its own region of the batch slot
(:class:`~lightning_fastdata.pipeline.slots.SlotLayout` with ``views``). A batch is ``(views, targets[, index])``,
``views`` a list of ``[B, 3, S, S]`` tensors (one per view, large views first), as lightly and solo-learn hand them.

Every view's box and flip is a function of ``(seed, epoch, sample)`` (:mod:`lightning_fastdata.keyed_random`): view
``v`` draws the numbers ``v * draws`` to ``(v + 1) * draws`` of its sample, so the fused path, the per-sample path
(:meth:`MultiViewCrop.__call__`), every engine and a resumed run crop the same boxes.

With colour augmentation (:mod:`~lightning_fastdata.pipeline.color`) each view of each sample has its own colour
parameters too, a function of ``(seed, epoch, sample, view)``, drawn with its group's probabilities where the group
sets them (DINO's per-view blur and solarization): CPU training colours each view as it is cropped; for CUDA training
the batch carries them as ``float32 [B, V, 7]`` and the device stage colours each view with its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_fastdata._fast_path import inherits
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.keyed_random import AugmentKey
from lightning_fastdata.transforms import Box, FusedCrops, RandomResizedCropFlip, epoch_crop_size


@dataclass(frozen=True)
class ViewGroup:
    """``count`` random resized crops of ``size`` pixels: one group of views of each training image.

    A dataclass so LightningCLI and YAML configs take it as a plain mapping (``{size: 96, count: 6, scale: [0.05,
    0.4]}``); the DataModule's other arguments stay flat keyword arguments.

    Args:
        size: side length of the group's square crops.
        count: views of this size per image.
        scale: ``RandomResizedCrop`` area range, as a share of the image.
        ratio: aspect ratio range (width / height).
        flip: probability of a horizontal flip, per view.
        color_jitter_p: this group's probability of the DataModule's ``color_jitter``; ``None``: the DataModule's.
        grayscale_p: this group's probability of grayscale; ``None``: the DataModule's ``grayscale_p``.
        blur_p: this group's probability of the Gaussian blur; ``None``: the DataModule's ``blur_p``.
        solarize_p: this group's probability of solarization; ``None``: the DataModule's ``solarize_p``.

    DINO's recipe gives its two global views probabilities of their own (blur 1.0, then blur 0.1 and solarize 0.2): two
    groups of one view each, ``{size: 224, blur_p: 1.0}`` and ``{size: 224, blur_p: 0.1, solarize_p: 0.2}``, then
    ``{size: 96, count: 6, blur_p: 0.5}``.
    """

    size: int
    count: int = 1
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    color_jitter_p: float | None = None
    grayscale_p: float | None = None
    blur_p: float | None = None
    solarize_p: float | None = None


def check_views(
    views: Sequence[ViewGroup | Mapping[str, Any]] | None,
    decode: str = "cpu",
    schedule: Mapping[int, int] | None = None,
) -> tuple[ViewGroup, ...] | None:
    """``views`` as :class:`ViewGroup` s sorted by size, largest first (a stable sort); ``None`` when not given.

    Mappings are taken as a group's keyword arguments (what a YAML config or a hyperparameters file holds). ``decode``
    and ``schedule`` are the settings views cannot go with.

    Raises:
        InvalidArgumentError: not a list of groups, a key that is no group field, or a value out of range; views with
            ``decode="device"`` or an ``image_size_schedule``.

    """
    if views is None:
        return None
    if decode == "device":
        raise InvalidArgumentError(
            "`views` are cropped on the CPU from one decode of each image; `decode='device'` decodes a single crop"
            " on the GPU. Pass `decode='cpu'` with `views`."
        )
    if schedule:
        raise InvalidArgumentError(
            "`image_size_schedule` resizes the single training crop; with `views` each group has its own `size`."
            " Pass one or the other."
        )
    if isinstance(views, (str, Mapping)) or not isinstance(views, Sequence) or not views:
        raise InvalidArgumentError(
            f"`views` is a non-empty list of view groups, e.g. [{{size: 224, count: 2, scale: [0.4, 1.0]}}, {{size:"
            f" 96, count: 6, scale: [0.05, 0.4]}}]; got {views!r}."
        )
    groups = [_group(i, view) for i, view in enumerate(views)]
    return tuple(sorted(groups, key=lambda group: -group.size))


def _group(i: int, view: ViewGroup | Mapping[str, Any]) -> ViewGroup:
    """Entry ``i`` of ``views`` as a checked :class:`ViewGroup`."""
    if isinstance(view, Mapping):
        fields = set(ViewGroup.__dataclass_fields__)
        unknown = sorted(set(view) - fields)
        if unknown or "size" not in view:
            raise InvalidArgumentError(
                f"`views[{i}]` takes the keys {', '.join(sorted(fields))} (`size` required); got {dict(view)!r}."
            )
        view = ViewGroup(**{k: tuple(v) if k in ("scale", "ratio") else v for k, v in view.items()})
    if not isinstance(view, ViewGroup):
        raise InvalidArgumentError(f"`views[{i}]` must be a ViewGroup or a mapping of its fields, got {view!r}.")
    if not _is_int(view.size) or view.size < 1 or not _is_int(view.count) or view.count < 1:
        raise InvalidArgumentError(
            f"`views[{i}]`: `size` and `count` must be ints >= 1, got size={view.size!r}, count={view.count!r}."
        )
    try:
        RandomResizedCropFlip(view.size, tuple(view.scale), tuple(view.ratio), view.flip)  # type: ignore[arg-type]
    except (ValueError, TypeError) as err:
        raise InvalidArgumentError(f"`views[{i}]` ({view}): {err}") from None
    return view


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MultiViewCrop:
    """The training transform of view groups: a list of uint8 CHW crops of one image, large views first.

    On the fused batch path it only gives each view's boxes and flips (:meth:`boxes`); the batch reader decodes each
    image once and crops every view from it into the batch slot.

    Args:
        groups: the view groups, largest first (:func:`check_views`).

    """

    def __init__(self, groups: Sequence[ViewGroup]) -> None:
        if not groups:
            raise ValueError("`groups` needs at least one ViewGroup.")
        self.groups = tuple(groups)
        crops = [RandomResizedCropFlip(g.size, tuple(g.scale), tuple(g.ratio), g.flip) for g in groups]  # type: ignore[arg-type]
        #: one crop transform per view, in batch order (a group's views share theirs)
        self.crops = [crop for crop, g in zip(crops, groups, strict=True) for _ in range(g.count)]

    @property
    def sizes(self) -> list[int]:
        """Each view's side, in batch order."""
        return [crop.size for crop in self.crops]

    @property
    def size(self) -> int:
        """The largest view's side."""
        return max(self.sizes)

    @property
    def num_large_views(self) -> int:
        """Views of the largest size."""
        return sum(1 for size in self.sizes if size == self.size)

    def boxes(
        self,
        heights: Sequence[int],
        widths: Sequence[int],
        key: AugmentKey | None = None,
        samples: Sequence[int] | None = None,
    ) -> list[tuple[list[Box], list[bool]]]:
        """Each view's crop boxes and flips for a batch of images: ``[(boxes, flips) per view]``.

        View ``v`` draws its sample's numbers from ``v * RandomResizedCropFlip.draws`` on, so each view is its own.
        """
        draws = RandomResizedCropFlip.draws
        return [
            crop.boxes(heights, widths, key=key, samples=samples, offset=v * draws) for v, crop in enumerate(self.crops)
        ]

    def fused_crops(self) -> FusedCrops | None:
        """What the fused batch path does for these views: every view's boxes, cropped from one decode.

        ``None`` for a subclass that overrides ``__call__`` (only the per-sample path calls it).
        """
        if not inherits(self, MultiViewCrop, "__call__"):
            return None
        return FusedCrops(tuple(self.crops), self.boxes, multiview=True)

    def __call__(self, image: Tensor) -> list[Tensor]:
        """Every view of one uint8 CHW image (the per-sample path), keyed as :meth:`boxes` inside a loader.

        Each view at its group's size, whatever the epoch's crop size.
        """
        with epoch_crop_size(None):
            return [crop(image) for crop in self.crops]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.groups)!r})"
