"""Colour augmentation on whole batches, each sample with its own random parameters, drawn from its key.

The DINO / BYOL / SimCLR colour recipe (colour jitter, random grayscale, Gaussian blur, solarization), written in
plain torch over a ``[B, 3, H, W]`` batch, vectorized: every op runs once per batch, with a parameter per sample.
(torchvision's v2 transforms draw one set of parameters per call, which a whole batch would share.)

The parameters are drawn where the batch is built, on the host: a few numbers per sample, a pure function of
``(seed, epoch, sample)`` (:func:`~lightning_fastdata.keyed_random.keyed_uniforms`, ``sample`` the sample's dataset
index: the one ``return_index`` gives), so they are the same on every engine, in any batch, after a resume. They
ride at the end of the batch as a :class:`ColorParams` tensor, ``float32 [B, 7]`` (:data:`COLUMNS`), in the batch
slot's memory (:mod:`~lightning_fastdata.pipeline.slots`): copied ``non_blocking`` with the images from page-locked
memory, never drawn on the device, never read back. :class:`~lightning_fastdata.pipeline.device.DeviceStage` takes
them off the batch and runs :class:`BatchColor` on the ``uint8`` images before normalizing them: on the side CUDA
stream for CUDA training, in ``on_after_batch_transfer`` for CPU training (whose loader then gives ``uint8`` batches
instead of normalizing in its threads). The training step never sees them.

Multi-view batches (:mod:`~lightning_fastdata.pipeline.views`, or a per-sample transform that returns a list of views)
carry ``float32 [B, V, 7]``: each view of each sample its own parameters, a pure function of ``(seed, epoch, sample,
view)`` (view ``v`` draws from ``(1 << 36) + 9 v`` on), and the device stage colours each view with its own. One recipe
(the same probabilities) serves every view; DINO's per-view blur and solarize probabilities are not expressed.

The ops, in the recipe's order, each on the 0-255 scale without rounding in between:

1. colour jitter with probability ``jitter_p``: brightness, contrast, saturation, then hue, each factor uniform in
   ``[max(0, 1 - x), 1 + x]`` (hue: a shift in ``[-h, h]`` of a turn), torchvision's ``adjust_*`` formulas (the
   grey of contrast and saturation weighted 0.2989, 0.587, 0.114; hue through HSV). The order is fixed (torchvision's
   ``ColorJitter`` shuffles it per call);
2. grayscale with probability ``grayscale_p``;
3. Gaussian blur with probability ``blur_p``, sigma uniform in ``blur_sigma``, a kernel of ``blur_kernel_size``
   (default ``2 * ceil(3 * max sigma) + 1``), reflected borders: torchvision's ``gaussian_blur``;
4. solarization with probability ``solarize_p``: values ``>= threshold`` become ``255 - value``.

An op whose probability is 0 costs nothing; the others run over the whole batch, a sample that does not draw it
getting the neutral parameter (factor 1, shift 0, a one-tap kernel), so nothing depends on the draws' outcome and the
device is never asked how many samples drew what.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.keyed_random import AugmentKey, keyed_uniforms

#: the columns of a sample's parameters: brightness, contrast and saturation factors, hue shift (in turns), grayscale
#: (0 or 1), blur sigma (0: no blur), solarize (0 or 1)
COLUMNS = ("brightness", "contrast", "saturation", "hue", "grayscale", "sigma", "solarize")

#: the number of the first keyed draw of a sample's colour (its crop and flip take the first ones, its generators for
#: torch, :mod:`random` and NumPy draw ``1 << 40`` on)
_OFFSET = 1 << 36
_DRAWS = 9

#: torchvision's grey: ``0.2989 R + 0.587 G + 0.114 B``
_GREY = (0.2989, 0.587, 0.114)


class ColorParams(Tensor):
    """The colour parameters of a batch's samples, ``float32 [B, 7]`` (:data:`COLUMNS`): the batch's last element.

    ``[B, V, 7]`` for a batch of ``V`` views, each view of a sample its own.

    A tensor subclass, so it moves, pins and slices as any tensor (and stays a :class:`ColorParams`), while
    :func:`split_params` tells it from the user's elements.
    """


def split_params(batch: Any) -> tuple[Any, Tensor | None]:
    """``(batch without its colour parameters, the parameters)``; ``(batch, None)`` when it carries none."""
    if isinstance(batch, (tuple, list)) and len(batch) > 1 and isinstance(batch[-1], ColorParams):
        rest = batch[:-1]
        return (list(rest) if isinstance(batch, list) else tuple(rest)), batch[-1]
    return batch, None


def with_params(batch: Any, params: np.ndarray | Tensor) -> Any:
    """``batch`` (a tuple or a list) with ``params`` appended as :class:`ColorParams`."""
    tensor = torch.from_numpy(params) if isinstance(params, np.ndarray) else params
    tensor = tensor.as_subclass(ColorParams)
    return [*batch, tensor] if isinstance(batch, list) else (*batch, tensor)


class BatchColor:
    """Colour augmentation of a batch with per-sample parameters: :meth:`draw` them on the host, apply on the batch.

    Args:
        jitter: ``(brightness, contrast, saturation, hue)`` strengths, as torchvision's ``ColorJitter`` takes them
            (hue <= 0.5); ``None``: no jitter.
        jitter_p: probability of the jitter.
        grayscale_p: probability of grayscale.
        blur_p: probability of the Gaussian blur.
        blur_sigma: its sigma range ``(low, high)``, ``0 < low <= high``.
        solarize_p: probability of solarization.
        solarize_threshold: values at or above it are inverted (0-255 scale).
        blur_kernel_size: an odd kernel side; default ``2 * ceil(3 * high) + 1``.

    Raises:
        InvalidArgumentError: an argument out of range, naming it (a ``ValueError``).

    """

    def __init__(
        self,
        jitter: Sequence[float] | None = None,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.0,
        blur_p: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        solarize_p: float = 0.0,
        solarize_threshold: float = 128.0,
        blur_kernel_size: int | None = None,
    ) -> None:
        for name, p in (("color_jitter_p", jitter_p), ("grayscale_p", grayscale_p), ("blur_p", blur_p)):
            if not 0.0 <= p <= 1.0:
                raise InvalidArgumentError(f"`{name}` must be in [0, 1], got {p}.")
        if not 0.0 <= solarize_p <= 1.0:
            raise InvalidArgumentError(f"`solarize_p` must be in [0, 1], got {solarize_p}.")
        if jitter is not None and (len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5):
            raise InvalidArgumentError(
                "`color_jitter` must be 4 strengths >= 0 (brightness, contrast, saturation, hue <= 0.5), got"
                f" {jitter!r}. Pass e.g. (0.4, 0.4, 0.2, 0.1), or None for no jitter."
            )
        if len(blur_sigma) != 2 or not 0 < blur_sigma[0] <= blur_sigma[1]:
            raise InvalidArgumentError(f"`blur_sigma` must be (low, high) with 0 < low <= high, got {blur_sigma!r}.")
        self.jitter = None if jitter is None else tuple(float(x) for x in jitter)
        self.jitter_p = float(jitter_p) if jitter is not None else 0.0
        self.grayscale_p = float(grayscale_p)
        self.blur_p = float(blur_p)
        self.blur_sigma = (float(blur_sigma[0]), float(blur_sigma[1]))
        self.solarize_p = float(solarize_p)
        self.solarize_threshold = float(solarize_threshold)
        size = 2 * math.ceil(3 * self.blur_sigma[1]) + 1 if blur_kernel_size is None else int(blur_kernel_size)
        if size < 1 or size % 2 == 0:
            raise InvalidArgumentError(f"`blur_kernel_size` must be odd and >= 1, got {blur_kernel_size}.")
        self.blur_kernel_size = size
        #: constants per (device, dtype): the grey weights, the hue sectors, the kernel taps
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor, Tensor]] = {}

    @classmethod
    def create(
        cls,
        jitter: Sequence[float] | None = None,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.0,
        blur_p: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        solarize_p: float = 0.0,
    ) -> BatchColor | None:
        """The stage of the DataModule's arguments, checked; ``None`` when no op can happen."""
        color = cls(jitter, jitter_p, grayscale_p, blur_p, blur_sigma, solarize_p)
        return color if color.active else None

    @property
    def active(self) -> bool:
        """Whether any op can happen."""
        return max(self.jitter_p, self.grayscale_p, self.blur_p, self.solarize_p) > 0

    # -- on the host: the draws ------------------------------------------------------------------------------------

    def draw(self, key: AugmentKey | None, samples: Sequence[int] | np.ndarray, views: int | None = None) -> np.ndarray:
        """The parameters of ``samples`` (dataset indices) under ``key``: ``float32 [n, 7]`` (:data:`COLUMNS`).

        With ``views``, each view of each sample its own: ``float32 [n, views, 7]``, view ``v`` from the draws
        ``(1 << 36) + 9 v`` on (view 0's are a single view's). A pure function of ``(seed, epoch, sample[, view])``;
        without a key, from :mod:`random`.
        """
        if key is None:
            key = (random.getrandbits(63), 0)
        u = keyed_uniforms(key, samples, _DRAWS * (views or 1), _OFFSET).reshape(-1, _DRAWS)
        params = np.zeros((len(u), len(COLUMNS)), dtype=np.float64)
        params[:, :3] = 1.0
        if self.jitter is not None:
            jit = u[:, 0] < self.jitter_p
            for column, strength in enumerate(self.jitter[:3]):
                low = max(0.0, 1.0 - strength)
                params[:, column] = np.where(jit, low + (1.0 + strength - low) * u[:, 1 + column], 1.0)
            hue = self.jitter[3]
            params[:, 3] = np.where(jit, -hue + 2.0 * hue * u[:, 4], 0.0)
        params[:, 4] = u[:, 5] < self.grayscale_p
        low, high = self.blur_sigma
        params[:, 5] = np.where(u[:, 6] < self.blur_p, low + (high - low) * u[:, 7], 0.0)
        params[:, 6] = u[:, 8] < self.solarize_p
        params = params.astype(np.float32)
        return params if views is None else params.reshape(-1, views, len(COLUMNS))

    # -- on the batch's device: the ops ----------------------------------------------------------------------------

    def __call__(self, images: Tensor, params: Tensor) -> Tensor:
        """``images`` (``uint8``, or float on the 0-255 scale, ``[B, 3, H, W]``) coloured: new ``float32`` 0-255.

        ``params``: :meth:`draw`'s ``[B, 7]``, on the images' device. Nothing here waits for the device.
        """
        x = _float_copy(images)
        p = params.to(torch.float32).view(-1, len(COLUMNS), 1, 1)
        grey, sectors, taps = self._constants(x.device)
        if self.jitter is not None:
            brightness, contrast, saturation = p[:, 0:1], p[:, 1:2], p[:, 2:3]
            x.mul_(brightness).clamp_(0, 255)
            mean = (x.mean(dim=(-2, -1), keepdim=True) * grey).sum(dim=1, keepdim=True)
            x.mul_(contrast).add_(mean * (1 - contrast)).clamp_(0, 255)
            grey_image = _grey(x, grey) * (1 - saturation)
            x.mul_(saturation).add_(grey_image).clamp_(0, 255)
            if self.jitter[3] > 0:
                x = _shift_hue(x, p[:, 3:4], sectors)
        if self.grayscale_p > 0:
            x = torch.where(p[:, 4:5] > 0, _grey(x, grey), x)
        if self.blur_p > 0:
            x = _blur(x, p[:, 5, 0, 0], taps)
        if self.solarize_p > 0:
            x = torch.where((p[:, 6:7] > 0) & (x >= self.solarize_threshold), 255 - x, x)
        return x

    def _constants(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The grey weights, the HSV sectors of R, G, B and the kernel's taps, made on ``device`` once.

        No per-batch host-to-device copy: ``(1, 3, 1, 1)``, ``(1, 3, 1, 1)`` and ``(K,)``.
        """
        key = (device, torch.float32)
        cached = self._cache.get(key)
        if cached is None:
            half = self.blur_kernel_size // 2
            cached = self._cache[key] = (
                torch.tensor(_GREY).view(1, 3, 1, 1).to(device),
                torch.tensor((5.0, 3.0, 1.0)).view(1, 3, 1, 1).to(device),
                torch.linspace(-half, half, self.blur_kernel_size).to(device),
            )
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}  # device constants stay in their process

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(jitter={self.jitter}, jitter_p={self.jitter_p}, grayscale_p={self.grayscale_p},"
            f" blur_p={self.blur_p}, blur_sigma={self.blur_sigma}, solarize_p={self.solarize_p})"
        )


def _float_copy(images: Tensor) -> Tensor:
    """A contiguous ``float32`` copy of the batch (the ops read whole planes; host copies on huge pages)."""
    if images.device.type != "cpu":
        return images.to(torch.float32, memory_format=torch.contiguous_format)
    return torch.from_numpy(np.empty(tuple(images.shape), dtype=np.float32)).copy_(images)


def _grey(x: Tensor, grey: Tensor) -> Tensor:
    """The grey of each pixel, ``[B, 1, H, W]``."""
    r, g, b = x.unbind(dim=1)
    return (r * grey[0, 0] + g * grey[0, 1] + b * grey[0, 2]).unsqueeze(1)


def _shift_hue(x: Tensor, shift: Tensor, sectors: Tensor) -> Tensor:
    """Each sample's hue turned by its ``shift`` (turns, ``[B, 1, 1, 1]``): the HSV round trip, vectorized.

    RGB -> HSV as torchvision computes it; back with the closed form ``c = v - v s clamp(min(k, 4 - k), 0, 1)``,
    ``k = (n + 6 h) mod 6`` (``n`` = 5, 3, 1 for R, G, B).
    """
    r, g, b = x.unbind(dim=1)
    maxc, minc = torch.maximum(torch.maximum(r, g), b), torch.minimum(torch.minimum(r, g), b)
    chroma = maxc - minc
    safe = torch.where(chroma == 0, 1.0, chroma)
    is_r, is_g = maxc == r, maxc == g
    # the hue in sixths of a turn, as torchvision's: (g - b) / c where R is the largest, 2 + (b - r) / c where G is
    # (and R is not), else 4 + (r - g) / c; then turned by the shift
    numerator = torch.where(is_r, g - b, torch.where(is_g, b - r, r - g))
    hue6 = torch.where(is_r, 0.0, torch.where(is_g, 2.0, 4.0)).add_(numerator.div_(safe)).add_(6.0 * shift[:, 0])
    # v s = chroma: c = v - chroma * clamp(min(k, 4 - k), 0, 1); a grey pixel (chroma 0) keeps its value
    k = torch.remainder(sectors + hue6.unsqueeze(1), 6.0)
    return maxc.unsqueeze(1) - chroma.unsqueeze(1) * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


def _blur(x: Tensor, sigma: Tensor, taps: Tensor) -> Tensor:
    """Each sample blurred with its ``sigma`` (``[B]``, 0: left as it is), separably, borders reflected."""
    n, c, h, w = x.shape
    size = taps.numel()
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    kernel = torch.exp(-0.5 * (taps.view(1, -1) / safe.view(-1, 1)) ** 2)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)
    identity = (taps == 0).to(kernel.dtype).view(1, -1)
    kernel = torch.where(sigma.view(-1, 1) > 0, kernel, identity)  # [B, K]
    kernel = kernel.repeat_interleave(c, dim=0)  # one per channel: [B * C, K]
    half = size // 2
    flat = F.pad(x.reshape(1, n * c, h, w), (half, half, half, half), mode="reflect")
    flat = F.conv2d(flat, kernel.view(n * c, 1, size, 1), groups=n * c)
    flat = F.conv2d(flat, kernel.view(n * c, 1, 1, size), groups=n * c)
    return flat.view(n, c, h, w)
