"""uint8 crop transforms that crop before they resize, so each image is resampled once and no float work is done.

Two entry points share one kernel, :func:`crop_resize_into`:

* the transforms (:class:`RandomResizedCropFlip`, :class:`CenterCropResize`) take and return ``uint8`` CHW tensors,
  for a user's own ``Dataset`` or ``Compose``;
* the batch path (:class:`~lightning_fastdata.pipeline.kernel.BatchReader`) asks them only for a crop box and writes
  each crop straight into its slot of a preallocated ``uint8`` NHWC batch.

The kernel is OpenCV on HWC ``uint8`` (the layout JPEG decoders produce), antialiased whenever it shrinks, like
torchvision's ``antialias=True`` bilinear:

* shrinking by less than 2x (what ``RandomResizedCrop(224)`` does to most large crops of a 256-pixel image): a small
  blur along each shrunk axis (:func:`_prefilter`), then bilinear. This is cheaper than ``INTER_AREA``, whose box
  filter takes OpenCV's slow general path at non-integer factors; on photo-like images a little further from
  torchvision's output than ``INTER_AREA``, on fine stripes closer
  (measured: docs/benchmarks.md#crop-kernel-a-prefilter-and-bilinear-below-2x);
* shrinking by 2x or more on both axes: ``INTER_AREA`` (a box filter; cheap at integer factors);
* enlarging: bilinear, as torchvision.

Normalization happens later: on the device, or in the loader's threads for CPU training.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fastdata._cv import cv2
from lightning_fastdata._fast_path import inherits
from lightning_fastdata.keyed_random import AugmentKey, current_uniforms, keyed_uniforms

#: ImageNet's per-channel mean and standard deviation on the 0-1 scale: the package's default normalization
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: ``(top, left, height, width)`` of a crop in source pixels
Box = tuple[int, int, int, int]

#: tries at a box within the allowed area and aspect ratio before the centre-crop fallback (as torchvision)
_TRIES = 10


def crop_resize_into(
    image: np.ndarray, box: Box, size: int, flip: bool, out: np.ndarray, scratch: np.ndarray | None = None
) -> np.ndarray:
    """Crop ``box`` out of a ``uint8`` HWC RGB image, resize it to ``size`` x ``size`` into ``out``, maybe flip it.

    ``out`` is a C-contiguous ``(size, size, 3)`` ``uint8`` array (a slot of a batch buffer); it is returned.
    Shrinking is antialiased on every shrunk axis (see the module notes); enlarging is bilinear, as torchvision's.
    ``scratch``, a flat ``uint8`` array of at least ``height * width * 3`` of the box, holds the prefiltered crop
    (allocated when not given). OpenCV releases the GIL, so threads run this in parallel.
    """
    top, left, h, w = box
    crop = image[top : top + h, left : left + w]
    if (h, w) == (size, size):
        out[...] = crop
    elif h >= 2 * size and w >= 2 * size:
        cv2.resize(crop, (size, size), dst=out, interpolation=cv2.INTER_AREA)
    else:
        kernel_y, kernel_x = _prefilter(h, size), _prefilter(w, size)
        if kernel_y is not None or kernel_x is not None:
            blurred = (scratch if scratch is not None else np.empty(h * w * 3, np.uint8))[: h * w * 3]
            crop = cv2.sepFilter2D(
                crop,
                -1,
                _IDENTITY if kernel_x is None else kernel_x,
                _IDENTITY if kernel_y is None else kernel_y,
                dst=blurred.reshape(h, w, 3),
                borderType=cv2.BORDER_REFLECT,
            )
        cv2.resize(crop, (size, size), dst=out, interpolation=cv2.INTER_LINEAR)
    if flip:
        cv2.flip(out, 1, dst=out)  # in place (OpenCV swaps columns pairwise)
    return out


_IDENTITY = np.ones((1, 1), np.float32)


@functools.lru_cache(maxsize=4096)  # a few hundred crop sizes occur: no kernel allocated per image
def _prefilter(source: int, size: int) -> np.ndarray | None:
    """The blur that, followed by bilinear sampling, antialiases a shrink of one axis from ``source`` to ``size``.

    Bilinear sampling averages over a triangle two source pixels wide; torchvision's antialiased bilinear widens it
    to ``2 f`` pixels for a shrink by ``f``. The prefilter makes up the difference: ``[a, 1 - 2a, a]`` with
    ``a = (f**2 - 1) / 8`` (variance ``(f**2 - 1) / 4``, fitted against torchvision on photo-like images and on
    one-pixel stripes, where a sampled Gaussian of that width barely filters at all), a Gaussian of that variance
    once three taps no longer hold it. ``None`` when the axis is not shrunk, or by less than 3% (``a < 0.0075``).
    """
    if source <= size:
        return None
    a = ((source / size) ** 2 - 1) / 8
    if a < 0.0075:
        return None
    if a <= 0.25:
        return np.array([[a], [1 - 2 * a], [a]], np.float32)
    sigma = math.sqrt(2 * a)
    return cv2.getGaussianKernel(2 * math.ceil(2.5 * sigma) + 1, sigma, cv2.CV_32F)


def _hwc(image: Tensor) -> np.ndarray:
    """A uint8 CHW tensor as an HWC NumPy array (a view when its memory is HWC, as decoded images are)."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise TypeError(f"expected a uint8 RGB image tensor of shape (3, H, W), got {image.dtype} {tuple(image.shape)}")
    return image.permute(1, 2, 0).numpy()


#: the crop size of the epoch being read (:func:`epoch_crop_size`), else ``None``
_EPOCH_SIZE: ContextVar[int | None] = ContextVar("lightning_fastdata_epoch_crop_size", default=None)


@contextlib.contextmanager
def epoch_crop_size(size: int | None) -> Iterator[None]:
    """Within the block, the package's single crop transforms crop to ``size`` (``None``: their own ``size``).

    How an epoch's image size (``set_image_size``, ``image_size_schedule``) reaches a crop transform wherever it is
    called, inside a ``Compose`` or a wrapper of one's own, without changing it: the batch reader reads each sample of
    the per-sample path within its loader's epoch size. View crops keep their groups' sizes.
    """
    token = _EPOCH_SIZE.set(size)
    try:
        yield
    finally:
        _EPOCH_SIZE.reset(token)


@dataclass(frozen=True)
class FusedCrops:
    """What the fused batch path makes for a transform: each crop's boxes and flips, cropped from one decode.

    A transform states it (``fused_crops()``) and a dataset passes it on (:meth:`LmdbImageDataset.fast_path
    <lightning_fastdata.LmdbImageDataset.fast_path>`); the batch reader then never calls the transform per sample.
    ``crops``: one crop transform per view, in batch order (one for a single crop, whose size follows the epoch's);
    ``boxes``: draws a batch's boxes and flips from the samples' keys (``boxes(heights, widths, key=, samples=)``:
    ``(boxes, flips)``, a list of them per view for views); ``multiview``: the images are views, handed out as a list.
    """

    crops: tuple[RandomResizedCropFlip | CenterCropResize, ...]
    boxes: Callable[..., Any]
    multiview: bool = False


def _apply(image: Tensor, box: Box, size: int, flip: bool) -> Tensor:
    out = np.empty((size, size, 3), dtype=np.uint8)
    crop_resize_into(_hwc(image), box, size, flip, out)
    return torch.from_numpy(out).permute(2, 0, 1)


class RandomResizedCropFlip:
    """``RandomResizedCrop`` + ``RandomHorizontalFlip`` on a uint8 CHW tensor, one resample per image.

    The crop box is drawn as torchvision's ``RandomResizedCrop.get_params`` draws it (area fraction in ``scale``,
    log-uniform aspect ratio in ``ratio``, ten tries, then a centre-crop fallback).

    Args:
        size: output side length.
        scale: range of the crop area as a fraction of the image area.
        ratio: range of the crop aspect ratio (width / height).
        flip_p: probability of a horizontal flip.

    """

    #: random numbers per image: 10 tries of (area, aspect ratio), then top, left and flip
    draws = 2 * _TRIES + 3

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
    ) -> None:
        if size < 1:
            raise ValueError(f"`size` must be >= 1, got {size}.")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"`scale` must satisfy 0 < min <= max <= 1, got {scale}.")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"`ratio` must satisfy 0 < min <= max, got {ratio}.")
        if not 0 <= flip_p <= 1:
            raise ValueError(f"`flip_p` must be in [0, 1], got {flip_p}.")
        self.size = size
        self.scale = scale
        self.ratio = ratio
        self.flip_p = flip_p
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def box(self, height: int, width: int) -> Box:
        """A random crop box ``(top, left, height, width)`` for an image of the given size."""
        area = height * width
        for _ in range(_TRIES):
            target_area = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*self._log_ratio))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, height - h), random.randint(0, width - w), h, w
        return self._fallback(height, width)

    def _fallback(self, height: int, width: int) -> Box:
        """The box when no try fits: the whole image, cut to the nearest allowed aspect ratio, centred."""
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def flip(self) -> bool:
        """Whether the next image is flipped (drawn with probability ``flip_p``)."""
        return self.flip_p > 0 and random.random() < self.flip_p

    def boxes(
        self,
        heights: Sequence[int],
        widths: Sequence[int],
        seed: int | None = None,
        key: AugmentKey | None = None,
        samples: Sequence[int] | None = None,
        offset: int = 0,
    ) -> tuple[list[Box], list[bool]]:
        """Crop boxes and flips for a batch of images at once: :meth:`box` and :meth:`flip`, vectorized.

        The same draw as :meth:`box` (ten tries, then the centre-crop fallback). With ``key`` and ``samples`` each
        image's numbers are its own (:mod:`lightning_fastdata.keyed_random`): a function of ``(seed, epoch, sample)``
        only, the loaders' way, from its draw ``offset`` on (several crops of one sample draw from offsets of their
        own: :class:`~lightning_fastdata.pipeline.views.MultiViewCrop`). Otherwise from a NumPy generator seeded
        with ``seed``, or else from :mod:`random` (seeded by ``seed_everything`` and per DataLoader worker, as
        :meth:`box` is). A subclass that overrides :meth:`box` or :meth:`flip` gets its own method called per image.
        """
        if not inherits(self, RandomResizedCropFlip, "box", "flip"):
            return [self.box(int(h), int(w)) for h, w in zip(heights, widths, strict=True)], [
                self.flip() for _ in heights
            ]
        if key is not None and samples is not None:
            uniforms = keyed_uniforms(key, samples, self.draws, offset)
        else:
            rng = np.random.default_rng(random.getrandbits(64) if seed is None else seed)
            uniforms = rng.random((len(heights), self.draws))
        return self._boxes_from(heights, widths, uniforms)

    def _boxes_from(
        self, heights: Sequence[int], widths: Sequence[int], uniforms: np.ndarray
    ) -> tuple[list[Box], list[bool]]:
        """Boxes and flips from ``(n, draws)`` uniform numbers in ``[0, 1)``, one row per image."""
        low, high = self.scale
        log_low, log_high = self._log_ratio
        height, width = np.asarray(heights, np.float64)[:, None], np.asarray(widths, np.float64)[:, None]
        target_area = height * width * (low + (high - low) * uniforms[:, :_TRIES])
        aspect = np.exp(log_low + (log_high - log_low) * uniforms[:, _TRIES : 2 * _TRIES])
        w, h = np.rint(np.sqrt(target_area * aspect)), np.rint(np.sqrt(target_area / aspect))
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first, fitted = fits.argmax(axis=1)[:, None], fits.any(axis=1)  # the first try that fits, as `box` takes it
        h = np.where(fitted, np.take_along_axis(h, first, 1)[:, 0], 1).astype(np.int64)  # 1: a fallback follows
        w = np.where(fitted, np.take_along_axis(w, first, 1)[:, 0], 1).astype(np.int64)
        height, width = height[:, 0].astype(np.int64), width[:, 0].astype(np.int64)
        top = np.floor(uniforms[:, 2 * _TRIES] * (height - h + 1)).astype(np.int64)
        left = np.floor(uniforms[:, 2 * _TRIES + 1] * (width - w + 1)).astype(np.int64)
        boxes = list(zip(top.tolist(), left.tolist(), h.tolist(), w.tolist(), strict=True))
        for i in np.flatnonzero(~fitted).tolist():  # rare: only images far outside the allowed aspect ratios
            boxes[i] = self._fallback(int(height[i]), int(width[i]))
        flips = uniforms[:, 2 * _TRIES + 2] < self.flip_p if self.flip_p > 0 else np.zeros(len(boxes), bool)
        return boxes, flips.tolist()

    def __call__(self, image: Tensor) -> Tensor:
        """Crop, maybe flip, and resize one uint8 CHW image.

        Inside a loader the box and flip are the sample's own (:func:`~lightning_fastdata.keyed_random.sample_key`):
        the same the batch path draws for it.
        """
        height, width = image.shape[-2], image.shape[-1]
        size = _EPOCH_SIZE.get() or self.size
        uniforms = current_uniforms(self.draws) if inherits(self, RandomResizedCropFlip, "box") else None
        if uniforms is not None:
            (box,), (flip,) = self._boxes_from([height], [width], uniforms)
            return _apply(image, box, size, flip)
        box = self.box(height, width)
        return _apply(image, box, size, self.flip())

    def fused_crops(self) -> FusedCrops | None:
        """What the fused batch path does for this transform: its boxes and flips, cropped in one pass.

        ``None`` for a subclass that overrides ``__call__``: it does something of its own, which only the per-sample
        path calls.
        """
        return FusedCrops((self,), self.boxes) if inherits(self, RandomResizedCropFlip, "__call__") else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip_p={self.flip_p})"


class CenterCropResize:
    """``Resize(size / crop_fraction)`` then ``CenterCrop(size)``, computed as a crop of the source then one resize.

    Args:
        size: output side length.
        crop_fraction: the share of the resized short side kept by the centre crop (0.875 = 224 of 256).

    """

    flip_p = 0.0
    #: random numbers per image: none
    draws = 0

    def __init__(self, size: int, crop_fraction: float = 0.875) -> None:
        if size < 1:
            raise ValueError(f"`size` must be >= 1, got {size}.")
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"`crop_fraction` must be in (0, 1], got {crop_fraction}.")
        self.size = size
        self.crop_fraction = crop_fraction

    def box(self, height: int, width: int) -> Box:
        """The centre crop box ``(top, left, height, width)`` in source pixels."""
        side = min(height, width) * self.crop_fraction
        h = w = max(1, round(side))
        return (height - h) // 2, (width - w) // 2, h, w

    def flip(self) -> bool:
        """Never: validation crops are not flipped."""
        return False

    def boxes(
        self,
        heights: Sequence[int],
        widths: Sequence[int],
        seed: int | None = None,
        key: AugmentKey | None = None,
        samples: Sequence[int] | None = None,
    ) -> tuple[list[Box], list[bool]]:
        """The centre crop boxes of a batch of images, and no flips (:meth:`box` and :meth:`flip` per image)."""
        return [self.box(int(h), int(w)) for h, w in zip(heights, widths, strict=True)], [self.flip() for _ in heights]

    def __call__(self, image: Tensor) -> Tensor:
        """Centre-crop and resize one uint8 CHW image (to the epoch's size inside a loader, :func:`epoch_crop_size`)."""
        return _apply(image, self.box(image.shape[-2], image.shape[-1]), _EPOCH_SIZE.get() or self.size, False)

    def fused_crops(self) -> FusedCrops | None:
        """What the fused batch path does for this transform (``None`` for a subclass that overrides ``__call__``)."""
        return FusedCrops((self,), self.boxes) if inherits(self, CenterCropResize, "__call__") else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, crop_fraction={self.crop_fraction})"


# ---------------------------------------------------------------------------------------------------------------
# Normalization: ``x / (255 std) - mean / std``
# ---------------------------------------------------------------------------------------------------------------


class Normalizer:
    """Per-channel normalization of 0-255 images, with its constants cached per (device, dtype).

    On a GPU the constants are copied to the device once, on first use: a per-batch ``.to(device)`` of a CPU tensor
    is a blocking copy that makes the host wait for the GPU every step.

    Args:
        mean: per-channel mean on the 0-1 scale (as torchvision's ``Normalize`` takes it).
        std: per-channel standard deviation on the 0-1 scale.

    """

    def __init__(self, mean: tuple[float, ...] | list[float], std: tuple[float, ...] | list[float]) -> None:
        if len(mean) != len(std) or min(std) <= 0:
            raise ValueError(f"`mean` and `std` need as many values and `std` > 0, got {mean} and {std}.")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        #: ``x * scale - shift`` on the 0-255 scale, per channel, as NumPy for the loader's CPU kernel
        self.scale = np.array([1.0 / (255.0 * s) for s in self.std], dtype=np.float32)
        self.shift255 = np.array([255.0 * m for m in self.mean], dtype=np.float32)
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        #: every uint8 value normalized, per channel (``(1, 256, C)``): normalizing is one table lookup a pixel
        values = np.arange(256, dtype=np.float64)[:, None]
        self._table = ((values - self.shift255.astype(np.float64)) * self.scale.astype(np.float64)).astype(np.float32)
        self._table = self._table.reshape(1, 256, -1)
        self._planes = [np.ascontiguousarray(self._table[..., c]) for c in range(len(self.mean))]

    def constants(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(scale, shift)`` shaped ``(1, C, 1, 1)`` on ``device``: created once per (device, dtype)."""
        key = (device, dtype)
        cached = self._cache.get(key)
        if cached is None:
            scale = torch.tensor(self.scale.tolist(), dtype=dtype).view(1, -1, 1, 1)
            shift = torch.tensor([m / s for m, s in zip(self.mean, self.std, strict=True)], dtype=dtype)
            cached = self._cache[key] = (scale.to(device), shift.view(1, -1, 1, 1).to(device))
        return cached

    def into(self, image: np.ndarray, out: np.ndarray, planes: list[np.ndarray] | None = None) -> None:
        """A ``uint8`` HWC image into ``out``, normalized ``float32``: CHW ``(3, H, W)`` or HWC (channels_last).

        One table lookup a pixel (``cv2.LUT`` with the 256 normalized values of each channel), which releases the GIL
        so the loader's threads normalize in parallel, and takes less time than ``cv2.addWeighted`` per plane or
        NumPy passes (measured: docs/benchmarks.md#cpu-normalization-one-table-lookup-a-pixel). CHW splits the image
        into its planes first, into ``planes`` when given: three ``uint8`` ``(H, W)`` scratch arrays.
        """
        if out.shape[-1] == image.shape[-1]:  # HWC: one lookup pass over the interleaved channels
            cv2.LUT(image, self._table, dst=out)
            return
        for c, plane in enumerate(cv2.split(image, planes) if planes is not None else cv2.split(image)):
            cv2.LUT(plane, self._planes[c], dst=out[c])

    def float_(self, images: Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> Tensor:
        """Normalize float images in 0-255 in place, then cast to ``dtype`` (and to ``channels_last`` if asked)."""
        scale, shift = self.constants(images.device, images.dtype)
        images.mul_(scale).sub_(shift)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images.to(dtype) if dtype != images.dtype else images

    def batch(self, images: Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> Tensor:
        """``uint8`` NCHW -> normalized ``dtype`` NCHW on the batch's device (contiguous, or channels_last)."""
        if images.dtype != torch.uint8:
            raise TypeError(f"expected a uint8 image batch, got {images.dtype}; is the batch already normalized?")
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        if images.device.type == "cpu":
            out = _host_empty(images.shape, channels_last)
            out.copy_(images)
        else:
            out = images.to(torch.float32, memory_format=fmt)
        return self.float_(out, dtype, channels_last)


_NORMALIZERS: dict[tuple[tuple[float, ...], tuple[float, ...]], Normalizer] = {}


def _normalizer(mean: Tensor, std: Tensor) -> Normalizer:
    key = (tuple(mean.tolist()), tuple(std.tolist()))  # CPU tensors: no device round trip
    found = _NORMALIZERS.get(key)
    if found is None:
        found = _NORMALIZERS[key] = Normalizer(*key)
    return found


def normalize_batch(
    images: Tensor, mean: Tensor, std: Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = False
) -> Tensor:
    """``uint8`` NCHW -> normalized ``dtype`` NCHW, in one fused pass where possible (runs on the batch's device).

    ``mean`` and ``std`` are per-channel CPU tensors on the 0-1 scale; their device copies are cached.
    """
    return _normalizer(mean, std).batch(images, dtype, channels_last)


def normalize_float(
    images: Tensor, mean: Tensor, std: Tensor, dtype: torch.dtype = torch.float32, channels_last: bool = False
) -> Tensor:
    """Normalize float images in 0-255 in place: ``x / (255 std) - mean / std``, then cast to ``dtype``."""
    return _normalizer(mean, std).float_(images, dtype, channels_last)


def _host_empty(shape: torch.Size, channels_last: bool) -> Tensor:
    """An uninitialized float32 CPU tensor backed by NumPy's allocator.

    NumPy asks the kernel for transparent huge pages on large buffers, so a fresh batch costs a few page faults
    instead of one per 4 KiB page, which were a large part of the cost of normalizing a batch on the CPU
    (measured: docs/benchmarks.md#cpu-float-batches-numpys-allocator).
    """
    if not channels_last:
        return torch.from_numpy(np.empty(tuple(shape), dtype=np.float32))
    n, c, h, w = shape
    return torch.from_numpy(np.empty((n, h, w, c), dtype=np.float32)).permute(0, 3, 1, 2)
