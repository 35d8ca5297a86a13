"""Colour augmentation on whole batches, each sample with its own random parameters, drawn from its key.

The DINO / BYOL / SimCLR colour recipe (colour jitter, random grayscale, Gaussian blur, solarization), each sample
(and each view of a sample) with parameters of its own. (torchvision's v2 transforms draw one set of parameters per
call, which a whole batch would share.)

The parameters are drawn where the batch is built, on the host: a few numbers per sample, a pure function of
``(seed, epoch, sample)`` (:func:`~lightning_fastdata.keyed_random.keyed_uniforms`, ``sample`` the sample's dataset
index: the one ``return_index`` gives), so they are the same on every engine, in any batch, after a resume.

Where the colour is applied:

* **CUDA training**: the parameters are the batch's ``color`` field, ``float32 [B, 7]`` (:data:`COLUMNS`), which
  travels beside the batch, not in it (:mod:`~lightning_fastdata.pipeline.schema`): in the batch slot's memory
  (:mod:`~lightning_fastdata.pipeline.slots`), copied ``non_blocking`` with the ``uint8`` images from page-locked
  memory, never read back. :class:`~lightning_fastdata.pipeline.device.DeviceStage` takes them and colours the batch
  on the side stream before normalizing it (:meth:`BatchColor.apply_batch`: a few batched torch ops, no host sync).
  The training step never sees them.
* **CPU training**: the fused batch path colours each crop in the loader's thread or worker process, right after
  cropping it and before normalizing it into the batch (:meth:`BatchColor.apply_image`: OpenCV's SIMD kernels on the
  ``uint8`` crop, which release the GIL), so the training process does none of it. A batch of one's own transform
  (the per-sample path) carries its parameters and is coloured by the device stage the same way, image by image.

Multi-view batches (:mod:`~lightning_fastdata.pipeline.views`, or a per-sample transform that returns a list of views)
carry ``float32 [B, V, 7]``: each view of each sample its own parameters, a pure function of ``(seed, epoch, sample,
view)`` (view ``v`` draws from ``(1 << 36) + 9 v`` on). Built-in view groups may set their own probabilities (DINO's
blur 1.0 / 0.1 / 0.5 and solarize 0 / 0.2 / 0): :meth:`BatchColor.for_views`.

The ops, in the recipe's order, on the 0-255 scale:

1. colour jitter with probability ``jitter_p``: brightness, contrast, saturation, then hue, each factor uniform in
   ``[max(0, 1 - x), 1 + x]`` (hue: a shift in ``[-h, h]`` of a turn), the grey of contrast and saturation weighted
   0.2989, 0.587, 0.114 as torchvision's. The order is fixed (torchvision's ``ColorJitter`` shuffles it per call);
2. grayscale with probability ``grayscale_p``;
3. Gaussian blur with probability ``blur_p``, sigma uniform in ``blur_sigma``, cut at ``ceil(3 sigma)`` pixels from
   the centre (and at ``blur_kernel_size``, default ``2 * ceil(3 * max sigma) + 1``), reflected borders: torchvision's
   ``gaussian_blur`` with a kernel of ``2 * ceil(3 sigma) + 1``;
4. solarization with probability ``solarize_p``: values ``>= threshold`` become ``255 - value``.

Jitter and grayscale are linear in the pixel, so they are composed into one ``3 x 3`` matrix and an offset per sample
(:func:`color_matrices`) and applied in one pass, clipped to 0-255 once at the end, as DALI's ``color_twist`` does.
The hue turns each pixel about the grey axis in YIQ space (DALI's ``hsv`` / ``color_twist`` and NVIDIA's
approximation), not through torchvision's HSV round trip: the round trip is 9 branchy passes over the image, where the
matrix is one (measured: docs/benchmarks.md#cpu-colour-hue-as-one-matrix-not-an-hsv-round-trip). A pixel's grey
(luma) is kept; a
hue shift of ``h`` turns a saturated colour by about ``h`` of a turn, in HSV's direction (red to yellow for h > 0).
Brightness and contrast alone are torchvision's, up to rounding; combined, the intermediate clipping torchvision does
between the steps is left out.

On the CPU each op runs in ``uint8`` (rounded after each); on CUDA in ``float32``. The two agree to within a few grey
levels. An op a sample did not draw leaves its pixels as they are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.keyed_random import AugmentKey, keyed_uniforms

#: the columns of a sample's parameters: brightness, contrast and saturation factors, hue shift (in turns), grayscale
#: (0 or 1), blur sigma (0: no blur), solarize (0 or 1)
COLUMNS = ("brightness", "contrast", "saturation", "hue", "grayscale", "sigma", "solarize")

#: the probabilities a view group may set for its views (:meth:`BatchColor.for_views`), in this order
VIEW_PROBABILITIES = ("color_jitter_p", "grayscale_p", "blur_p", "solarize_p")

#: the number of the first keyed draw of a sample's colour (its crop and flip take the first ones, its generators for
#: torch, :mod:`random` and NumPy draw ``1 << 40`` on)
_OFFSET = 1 << 36
_DRAWS = 9

#: torchvision's grey: ``0.2989 R + 0.587 G + 0.114 B``
_GREY = (0.2989, 0.587, 0.114)


def _hue_basis() -> np.ndarray:
    """``[4, 3, 3]``: ``I``, the grey projection ``P``, the quarter turn ``Q`` about the grey axis, ``1 w^T``.

    ``P`` sets every channel to the pixel's grey (YIQ's Y); ``1 w^T`` does the same with torchvision's weights ``w``,
    whose sum is 0.9999 (its grayscale and saturation use them).

    A turn by angle ``t`` is ``P + cos(t) (I - P) + sin(t) Q``: YIQ's I and Q plane turned, its Y (the grey) kept.
    ``Q`` is signed so that a positive shift turns hues as HSV's does (red towards yellow).
    """
    grey = np.asarray(_GREY, dtype=np.float64)
    yiq = np.array([grey / grey.sum(), [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    back = np.linalg.inv(yiq)
    project = np.outer(np.ones(3), yiq[0])
    quarter = back[:, 1:] @ np.array([[0.0, 1.0], [-1.0, 0.0]]) @ yiq[1:]
    return np.stack([np.eye(3), project, quarter, np.outer(np.ones(3), grey)])


_BASIS = _hue_basis()


def color_matrices(params: Tensor, basis: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each sample's jitter and grayscale as ``(M, v)``: its pixel ``x`` becomes ``M x + v * mean_grey``.

    ``params``: :meth:`BatchColor.draw`'s ``[..., 7]``; ``M``: ``[..., 3, 3]``; ``v``: ``[..., 3]``, to be scaled by
    the mean grey of the sample's image (contrast blends with it). ``basis``: :data:`_BASIS` on ``params``' device
    (cached there by the caller; made here when not given). Batched torch ops: on CUDA nothing waits for the device.

    Brightness ``b`` and contrast ``c`` scale by ``b c`` and add ``(1 - c) b`` times the mean grey; saturation ``s``
    is ``s I + (1 - s) 1 w^T``; hue turns about the grey axis; grayscale is ``1 w^T``. Composed in that order.
    """
    if basis is None:
        basis = torch.as_tensor(_BASIS, dtype=params.dtype, device=params.device)
    eye, project, quarter, grey = basis.unbind(0)
    b, c, s, h, g = (params[..., i, None, None] for i in range(5))
    saturate = s * eye + (1 - s) * grey
    turn = 2 * math.pi * h
    hue = project + torch.cos(turn) * (eye - project) + torch.sin(turn) * quarter
    grayscale = g * grey + (1 - g) * eye
    linear = grayscale @ hue @ saturate
    return linear * (b * c), linear.sum(dim=-1) * ((1 - c) * b)[..., 0]


class ImagePlan:
    """What :meth:`BatchColor.apply_image` does to each image of a batch, computed once for the batch (on the host).

    Rows in the order of the parameters given (``[n, 7]`` or ``[n, V, 7]`` flattened: sample-major).
    """

    def __init__(self, color: BatchColor, params: np.ndarray) -> None:
        rows = np.asarray(params, dtype=np.float32).reshape(-1, len(COLUMNS))
        linear, offset = color_matrices(torch.from_numpy(rows).double())
        #: each row's ``[3, 4]`` affine map, its last column scaled per image by the mean grey
        self.affine = np.concatenate([linear.numpy(), offset.numpy()[:, :, None]], axis=2).astype(np.float32)
        neutral = np.array([1.0, 1.0, 1.0, 0.0, 0.0], dtype=np.float32)
        self.linear = (rows[:, :5] != neutral).any(axis=1).tolist()
        self.contrast = (rows[:, 1] != 1.0).tolist()
        self.sigma = rows[:, 5].tolist()
        self.solarize = (rows[:, 6] > 0).tolist()


class BatchColor:
    """Colour augmentation with per-sample parameters: :meth:`draw` them on the host, apply on the batch's device.

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
        _check_probabilities(dict(zip(VIEW_PROBABILITIES, (jitter_p, grayscale_p, blur_p, solarize_p), strict=True)))
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
        #: per view, ``(jitter_p, grayscale_p, blur_p, solarize_p)``: :meth:`for_views`; ``None``: the same for all
        self.view_probabilities: tuple[tuple[float, float, float, float], ...] | None = None
        #: constants per device: the matrices' basis, the kernel taps (made once, no host-to-device copy per batch)
        self._cache: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self._solarize_table = np.where(np.arange(256) >= self.solarize_threshold, 255 - np.arange(256), np.arange(256))
        self._solarize_table = self._solarize_table.astype(np.uint8)

    @classmethod
    def create(
        cls,
        jitter: Sequence[float] | None = None,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.0,
        blur_p: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        solarize_p: float = 0.0,
        views: Sequence[Any] | None = None,
    ) -> BatchColor | None:
        """The stage of the DataModule's arguments, checked; ``None`` when no op can happen.

        ``views``: the view groups (:class:`~lightning_fastdata.ViewGroup`), whose own probabilities, where set,
        replace these for their views (:meth:`for_views`).
        """
        color = cls(jitter, jitter_p, grayscale_p, blur_p, blur_sigma, solarize_p)
        if views is not None:
            color = color.for_views(
                [{name: getattr(group, name, None) for name in VIEW_PROBABILITIES} for group in views],
                [getattr(group, "count", 1) for group in views],
            )
        return color if color.active else None

    def for_views(self, groups: Sequence[Mapping[str, float | None]], counts: Sequence[int]) -> BatchColor:
        """This recipe with probabilities of their own for some views: ``groups[i]`` for ``counts[i]`` views.

        A group's mapping takes :data:`VIEW_PROBABILITIES`; a missing or ``None`` one is this recipe's. Returns
        ``self``, changed. DINO: the first global view blurred always, the second with p 0.1 and solarized with p 0.2,
        the local views blurred with p 0.5.

        Raises:
            InvalidArgumentError: a probability out of [0, 1], or a group's jitter probability without
                ``color_jitter`` strengths.

        """
        default = (self.jitter_p, self.grayscale_p, self.blur_p, self.solarize_p)
        per_view = []
        for i, (group, count) in enumerate(zip(groups, counts, strict=True)):
            given = {name: value for name, value in group.items() if value is not None}
            _check_probabilities(given, where=f"`views[{i}]`: ")
            if self.jitter is None and given.get("color_jitter_p", 0.0) > 0:
                raise InvalidArgumentError(
                    f"`views[{i}]` sets `color_jitter_p` but the DataModule has no `color_jitter` strengths: pass"
                    " `color_jitter=(brightness, contrast, saturation, hue)`, e.g. (0.4, 0.4, 0.2, 0.1)."
                )
            row = tuple(float(given.get(name, value)) for name, value in zip(VIEW_PROBABILITIES, default, strict=True))
            per_view.extend([row] * count)
        self.view_probabilities = None if all(row == default for row in per_view) else tuple(per_view)  # type: ignore[assignment]
        return self

    def _probabilities(self, views: int | None) -> np.ndarray:
        """``[V or 1, 4]``: each view's probabilities (:data:`VIEW_PROBABILITIES`)."""
        default = np.array([[self.jitter_p, self.grayscale_p, self.blur_p, self.solarize_p]])
        if self.view_probabilities is None:
            return default
        if views != len(self.view_probabilities):
            raise ValueError(
                f"this colour recipe has probabilities for {len(self.view_probabilities)} views; a batch has"
                f" {views or 1}."
            )
        return np.array(self.view_probabilities)

    def _can(self, column: int) -> bool:
        """Whether op ``column`` of :data:`VIEW_PROBABILITIES` can happen to any view."""
        views = self.view_probabilities or ()
        return (
            max([(self.jitter_p, self.grayscale_p, self.blur_p, self.solarize_p)[column]] + [v[column] for v in views])
            > 0
        )

    @property
    def active(self) -> bool:
        """Whether any op can happen."""
        return any(self._can(column) for column in range(len(VIEW_PROBABILITIES)))

    # -- on the host: the draws ------------------------------------------------------------------------------------

    def draw(self, key: AugmentKey | None, samples: Sequence[int] | np.ndarray, views: int | None = None) -> np.ndarray:
        """The parameters of ``samples`` (dataset indices) under ``key``: ``float32 [n, 7]`` (:data:`COLUMNS`).

        With ``views``, each view of each sample its own: ``float32 [n, views, 7]``, view ``v`` from the draws
        ``(1 << 36) + 9 v`` on (view 0's are a single view's), with its own probabilities (:meth:`for_views`). A pure
        function of ``(seed, epoch, sample[, view])``; without a key, from :mod:`random`.
        """
        if key is None:
            key = (random.getrandbits(63), 0)
        probabilities = self._probabilities(views)
        u = keyed_uniforms(key, samples, _DRAWS * (views or 1), _OFFSET).reshape(-1, views or 1, _DRAWS)
        jitter_p, grayscale_p, blur_p, solarize_p = (probabilities[None, :, i] for i in range(4))
        params = np.zeros((*u.shape[:2], len(COLUMNS)), dtype=np.float64)
        params[..., :3] = 1.0
        if self.jitter is not None:
            jit = u[..., 0] < jitter_p
            for column, strength in enumerate(self.jitter[:3]):
                low = max(0.0, 1.0 - strength)
                params[..., column] = np.where(jit, low + (1.0 + strength - low) * u[..., 1 + column], 1.0)
            hue = self.jitter[3]
            params[..., 3] = np.where(jit, -hue + 2.0 * hue * u[..., 4], 0.0)
        params[..., 4] = u[..., 5] < grayscale_p
        low, high = self.blur_sigma
        params[..., 5] = np.where(u[..., 6] < blur_p, low + (high - low) * u[..., 7], 0.0)
        params[..., 6] = u[..., 8] < solarize_p
        params = params.astype(np.float32)
        return params[:, 0] if views is None else params

    # -- on the CPU: image by image, in the loader's threads -------------------------------------------------------

    def plan(self, params: np.ndarray) -> ImagePlan:
        """What :meth:`apply_image` does to each image of these parameters (``[n, 7]`` or ``[n, V, 7]``)."""
        return ImagePlan(self, params)

    def apply_image(self, image: np.ndarray, plan: ImagePlan, row: int) -> None:
        """Colour one ``uint8`` HWC RGB image in place with row ``row`` of ``plan`` (OpenCV, which releases the GIL).

        The matrix in one ``cv2.transform`` (rounded and clipped to 0-255), then the blur (``uint8``, reflected
        borders), then solarization by table lookup; an op the row did not draw is not run.
        """
        if plan.linear[row]:
            affine = plan.affine[row]
            if plan.contrast[row]:  # the offset scales with the image's mean grey
                red, green, blue, _ = cv2.mean(image)
                affine = affine.copy()
                affine[:, 3] *= red * _GREY[0] + green * _GREY[1] + blue * _GREY[2]
            cv2.transform(image, affine, dst=image)
        sigma = plan.sigma[row]
        # separable float taps: uint8 GaussianBlur is slower (docs/benchmarks.md#cpu-blur-separable-float-taps)
        if sigma > 0:
            kernel = self._kernel(sigma)
            cv2.sepFilter2D(image, -1, kernel, kernel, dst=image, borderType=cv2.BORDER_REFLECT_101)
        if plan.solarize[row]:
            cv2.LUT(image, self._solarize_table, dst=image)

    def _kernel(self, sigma: float) -> np.ndarray:
        """The blur's taps for ``sigma``: a Gaussian cut at ``ceil(3 sigma)`` (at most the kernel's half), sum 1."""
        radius = min(self.blur_kernel_size // 2, math.ceil(3 * sigma))
        taps = np.exp(-0.5 * (np.arange(-radius, radius + 1, dtype=np.float32) / np.float32(sigma)) ** 2)
        return taps / taps.sum()

    def apply_images(self, images: Tensor, params: Tensor) -> Tensor:
        """A CPU ``uint8`` ``[B, 3, H, W]`` batch coloured image by image (:meth:`apply_image`): a new ``uint8`` one.

        The batch of a per-sample transform on a CPU, in the device stage; ``params`` ``[B, 7]``.
        """
        nhwc = images.permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format).numpy()  # never the caller's
        plan = self.plan(params.numpy())
        for row, image in enumerate(nhwc):
            self.apply_image(image, plan, row)
        return torch.from_numpy(nhwc).permute(0, 3, 1, 2)

    # -- on the batch's device: batched torch ops ------------------------------------------------------------------

    def __call__(self, images: Tensor, params: Tensor) -> Tensor:
        """``images`` (``uint8`` ``[B, 3, H, W]``) coloured with ``params`` (:meth:`draw`'s ``[B, 7]``, same device).

        On a CPU a new ``uint8`` batch (:meth:`apply_images`); elsewhere new ``float32`` on the 0-255 scale
        (:meth:`apply_batch`).
        """
        if images.device.type == "cpu" and images.dtype == torch.uint8:
            return self.apply_images(images, params)
        return self.apply_batch(images, params)

    def apply_batch(self, images: Tensor, params: Tensor) -> Tensor:
        """``images`` (``uint8``, or float on the 0-255 scale, ``[B, 3, H, W]``) coloured: new ``float32`` 0-255.

        Batched torch ops, each sample with its own parameters; nothing here waits for the device (CUDA training's
        path, on the side stream). Every op that any sample can draw runs over the whole batch, a sample that did not
        draw it taking the neutral parameter, so nothing depends on the outcome of the draws.
        """
        x = _float_copy(images)
        p = params.to(torch.float32)
        basis, grey, taps = self._constants(x.device)
        if self._can(0) or self._can(1):
            linear, offset = color_matrices(p, basis)
            mean = (x.mean(dim=(-2, -1)) * grey).sum(dim=1)  # [B]: each image's mean grey
            shape = x.shape
            x = torch.baddbmm((offset * mean[:, None]).unsqueeze(-1), linear, x.view(shape[0], 3, -1)).view(shape)
            x.clamp_(0, 255)
        if self._can(2):
            x = _blur(x, p[:, 5], taps)
        if self._can(3):
            x = torch.where((p[:, 6, None, None, None] > 0) & (x >= self.solarize_threshold), 255 - x, x)
        return x

    def _constants(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The matrices' basis ``[4, 3, 3]``, the grey weights ``[3]`` and the kernel's taps ``[K]``, on ``device``."""
        cached = self._cache.get(device)
        if cached is None:
            half = self.blur_kernel_size // 2
            cached = self._cache[device] = (
                torch.as_tensor(_BASIS, dtype=torch.float32).to(device),
                torch.tensor(_GREY).to(device),
                torch.linspace(-half, half, self.blur_kernel_size).to(device),
            )
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}  # device constants stay in their process

    def __repr__(self) -> str:
        views = "" if self.view_probabilities is None else f", view_probabilities={self.view_probabilities}"
        return (
            f"{type(self).__name__}(jitter={self.jitter}, jitter_p={self.jitter_p}, grayscale_p={self.grayscale_p},"
            f" blur_p={self.blur_p}, blur_sigma={self.blur_sigma}, solarize_p={self.solarize_p}{views})"
        )


def _check_probabilities(probabilities: Mapping[str, float], where: str = "") -> None:
    """Each probability in [0, 1], or an error naming it."""
    for name, p in probabilities.items():
        if name not in VIEW_PROBABILITIES:
            raise InvalidArgumentError(f"{where}`{name}` is not a colour probability; those are {VIEW_PROBABILITIES}.")
        if not 0.0 <= p <= 1.0:
            raise InvalidArgumentError(f"{where}`{name}` must be in [0, 1], got {p}.")


def _float_copy(images: Tensor) -> Tensor:
    """A contiguous ``float32`` copy of the batch (the ops read whole planes; host copies on huge pages)."""
    if images.device.type != "cpu":
        return images.to(torch.float32, memory_format=torch.contiguous_format)
    return torch.from_numpy(np.empty(tuple(images.shape), dtype=np.float32)).copy_(images)


def _blur(x: Tensor, sigma: Tensor, taps: Tensor) -> Tensor:
    """Each sample blurred with its ``sigma`` (``[B]``, 0: left as it is), separably, borders reflected."""
    n, c, h, w = x.shape
    size = taps.numel()
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    kernel = torch.exp(-0.5 * (taps.view(1, -1) / safe.view(-1, 1)) ** 2)
    kernel = torch.where(taps.view(1, -1).abs() <= torch.ceil(3 * safe).view(-1, 1), kernel, 0.0)  # cut at 3 sigma
    kernel = kernel / kernel.sum(dim=1, keepdim=True)
    identity = (taps == 0).to(kernel.dtype).view(1, -1)
    kernel = torch.where(sigma.view(-1, 1) > 0, kernel, identity)  # [B, K]
    kernel = kernel.repeat_interleave(c, dim=0)  # one per channel: [B * C, K]
    half = size // 2
    flat = F.pad(x.reshape(1, n * c, h, w), (half, half, half, half), mode="reflect")
    flat = F.conv2d(flat, kernel.view(n * c, 1, size, 1), groups=n * c)
    flat = F.conv2d(flat, kernel.view(n * c, 1, 1, size), groups=n * c)
    return flat.view(n, c, h, w)
