"""Tests for the uint8 crop transforms and the on-device batch normalization."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from lightning_fastdata._fast_path import inherits
from lightning_fastdata.transforms import (
    CenterCropResize,
    Normalizer,
    RandomResizedCropFlip,
    normalize_batch,
)

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


def _smooth_image(height: int, width: int) -> torch.Tensor:
    """A smooth uint8 CHW image (gradients and low-frequency waves) with distinct channels."""
    y = torch.linspace(0, 1, height)[:, None]
    x = torch.linspace(0, 1, width)[None, :]
    channels = [
        128 + 100 * torch.sin(3 * x + 2 * y),
        (128 + 100 * torch.cos(3 * y)).expand(height, width),
        255 * x * y,
    ]
    return torch.stack(channels).clamp(0, 255).to(torch.uint8)


def _random_image(height: int, width: int, seed: int = 0, layout: str = "hwc") -> torch.Tensor:
    """A random uint8 CHW image, by default HWC in memory like the images `torchvision.io` decodes."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "chw":
        return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
    return torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator).permute(2, 0, 1)


@pytest.mark.parametrize(
    ("height", "width"),
    [(120, 90), (90, 120), (600, 40), (40, 600), (10, 500), (500, 10), (7, 9), (1, 1), (32, 32)],
)
@pytest.mark.parametrize("size", [2, 16, 48])
@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_random_resized_crop_flip_output_shape_and_dtype(height: int, width: int, size: int, layout: str) -> None:
    """Any input shape (tall, wide, tiny) and memory layout gives a uint8 (3, size, size) crop."""
    transform = RandomResizedCropFlip(size)
    image = _random_image(height, width, layout=layout)
    random.seed(0)
    for _ in range(5):
        out = transform(image)
        assert out.dtype == torch.uint8
        assert tuple(out.shape) == (3, size, size)


@pytest.mark.parametrize(("height", "width"), [(400, 500), (500, 400), (10, 500), (500, 10), (3, 3), (1, 1), (64, 64)])
def test_random_resized_crop_box_inside_image(height: int, width: int) -> None:
    """Every drawn box is non-empty and lies inside the image, fallback included."""
    transform = RandomResizedCropFlip(32)
    random.seed(1)
    for _ in range(300):
        top, left, h, w = transform.box(height, width)
        assert h >= 1
        assert w >= 1
        assert top >= 0
        assert top + h <= height
        assert left >= 0
        assert left + w <= width


def test_random_resized_crop_box_area_and_ratio_within_range() -> None:
    """Non-fallback boxes have an area fraction in `scale` and an aspect ratio in `ratio` (up to rounding)."""
    scale, ratio = (0.2, 0.5), (3 / 4, 4 / 3)
    transform = RandomResizedCropFlip(32, scale=scale, ratio=ratio)
    height, width = 400, 500
    area = height * width
    random.seed(2)
    drawn = 0
    for _ in range(500):
        _, _, h, w = transform.box(height, width)
        if (h, w) == (height, width):  # the fallback for an in-ratio image: the whole image
            continue
        drawn += 1
        # w and h are rounded from the drawn values, so each may be off by up to half a pixel
        assert (w + 0.5) * (h + 0.5) >= scale[0] * area
        assert (w - 0.5) * (h - 0.5) <= scale[1] * area
        assert (w + 0.5) / (h - 0.5) >= ratio[0]
        assert (w - 0.5) / (h + 0.5) <= ratio[1]
    assert drawn >= 450  # the fallback is rare here, so the checks above really ran


def test_random_resized_crop_box_falls_back_to_center_crop() -> None:
    """An image far outside `ratio` falls back to the central crop of the largest in-ratio box."""
    transform = RandomResizedCropFlip(8, scale=(0.9, 1.0))
    random.seed(0)
    # 10 x 500: no box of area >= 90% with ratio <= 4/3 fits, so all ten tries fail
    assert transform.box(10, 500) == (0, (500 - 13) // 2, 10, 13)
    assert transform.box(500, 10) == ((500 - 13) // 2, 0, 13, 10)


def test_random_resized_crop_boxes_vary_and_are_seeded() -> None:
    """Boxes follow Python's `random`: the same seed repeats them, draws differ from each other."""
    transform = RandomResizedCropFlip(32)
    random.seed(3)
    first = [transform.box(300, 400) for _ in range(20)]
    random.seed(3)
    second = [transform.box(300, 400) for _ in range(20)]
    assert first == second
    assert len(set(first)) > 10


def test_random_resized_crop_flip_probability() -> None:
    """`flip_p=1` always flips and `flip_p=0` never does (same crop under the same seed)."""
    image = _random_image(90, 130, seed=4)
    always = RandomResizedCropFlip(24, flip_p=1.0)
    never = RandomResizedCropFlip(24, flip_p=0.0)
    for seed in range(20):
        random.seed(seed)
        flipped = always(image)
        random.seed(seed)
        plain = never(image)
        assert not torch.equal(flipped, plain)  # a random image is never mirror-symmetric
        assert torch.equal(flipped, plain.flip(-1))


def test_random_resized_crop_flip_half_the_time() -> None:
    """The default `flip_p=0.5` flips some crops and not others."""
    image = _random_image(60, 60, seed=5)
    half = RandomResizedCropFlip(16)
    never = RandomResizedCropFlip(16, flip_p=0.0)
    flips = 0
    for seed in range(100):
        random.seed(seed)
        out = half(image)
        random.seed(seed)
        flips += int(not torch.equal(out, never(image)))
    assert 25 <= flips <= 75


def test_random_resized_crop_content_is_the_resized_box() -> None:
    """The output is the drawn box of the source, resized (no flip with `flip_p=0`)."""
    image = _smooth_image(200, 260)
    transform = RandomResizedCropFlip(40, flip_p=0.0)
    random.seed(6)
    top, left, h, w = transform.box(200, 260)
    random.seed(6)
    out = transform(image)
    crop = image[:, top : top + h, left : left + w]
    expected = v2.Resize((40, 40), antialias=True)(crop)
    assert (out.float() - expected.float()).abs().mean() < 1.5


@pytest.mark.parametrize(("height", "width"), [(300, 420), (420, 300), (256, 256), (90, 600)])
@pytest.mark.parametrize("size", [56, 96, 112, 224])
def test_center_crop_resize_matches_torchvision(height: int, width: int, size: int) -> None:
    """`CenterCropResize` is `Resize(size / 0.875)` + `CenterCrop(size)` up to resampling differences.

    Sizes where torchvision's own rounding (resize side, crop offset) stays within a pixel: at e.g. 32 it resizes
    to 37 and crops at offset 2 of 2.5, half an output pixel off the exact geometry that `CenterCropResize` keeps.
    """
    image = _smooth_image(height, width)
    reference = v2.Compose([v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])(image)
    out = CenterCropResize(size)(image)
    assert out.dtype == torch.uint8
    assert out.shape == reference.shape == (3, size, size)
    assert (out.float() - reference.float()).abs().mean() < 3


def test_center_crop_resize_box_is_centered() -> None:
    """The crop box is the centred square of `crop_fraction` of the short side."""
    assert CenterCropResize(224).box(256, 320) == (16, 48, 224, 224)
    assert CenterCropResize(10, crop_fraction=1.0).box(40, 100) == (0, 30, 40, 40)
    assert CenterCropResize(10, crop_fraction=0.5).box(1, 1) == (0, 0, 1, 1)


def test_center_crop_resize_is_deterministic_for_tiny_images() -> None:
    """Tiny or extreme inputs give a (3, size, size) uint8 image, the same each call."""
    transform = CenterCropResize(16)
    for height, width in [(1, 1), (3, 500), (500, 3)]:
        image = _random_image(height, width)
        out = transform(image)
        assert out.dtype == torch.uint8
        assert tuple(out.shape) == (3, 16, 16)
        assert torch.equal(out, transform(image))


def test_normalize_batch_matches_reference() -> None:
    """Normalization is `(x / 255 - mean) / std` in float32."""
    images = _random_image(12, 10).unsqueeze(0).repeat(4, 1, 1, 1)
    images[1:] = torch.randint(0, 256, images[1:].shape, dtype=torch.uint8)
    expected = (images.float() / 255 - MEAN.view(1, 3, 1, 1)) / STD.view(1, 3, 1, 1)
    out = normalize_batch(images, MEAN, STD)
    assert out.dtype == torch.float32
    assert out.shape == images.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert images.dtype == torch.uint8  # the input is left untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_normalize_batch_dtype(dtype: torch.dtype) -> None:
    """The requested dtype is returned, with values close to the float32 result."""
    images = _random_image(8, 8).unsqueeze(0)
    out = normalize_batch(images, MEAN, STD, dtype=dtype)
    assert out.dtype == dtype
    reference = normalize_batch(images, MEAN, STD)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=2e-2)


def test_normalize_batch_channels_last() -> None:
    """`channels_last=True` gives a channels_last tensor with the same values."""
    images = torch.randint(0, 256, (2, 3, 9, 7), dtype=torch.uint8)
    out = normalize_batch(images, MEAN, STD, channels_last=True)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert not out.is_contiguous()
    assert torch.equal(out, normalize_batch(images, MEAN, STD))
    half = normalize_batch(images, MEAN, STD, dtype=torch.float16, channels_last=True)
    assert half.is_contiguous(memory_format=torch.channels_last)


def test_normalize_batch_rejects_float_input() -> None:
    """A batch that is not uint8 (e.g. already normalized) raises TypeError."""
    with pytest.raises(TypeError, match="uint8"):
        normalize_batch(torch.zeros(1, 3, 4, 4), MEAN, STD)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"size": 0}, "size"),
        ({"size": -3}, "size"),
        ({"size": 8, "scale": (0.0, 1.0)}, "scale"),
        ({"size": 8, "scale": (0.6, 0.4)}, "scale"),
        ({"size": 8, "scale": (0.5, 1.5)}, "scale"),
        ({"size": 8, "ratio": (0.0, 1.0)}, "ratio"),
        ({"size": 8, "ratio": (2.0, 1.0)}, "ratio"),
    ],
)
def test_random_resized_crop_flip_bad_arguments(kwargs: dict, name: str) -> None:
    """Invalid size, scale or ratio raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=f"`{name}`"):
        RandomResizedCropFlip(**kwargs)


@pytest.mark.parametrize(
    ("size", "crop_fraction", "name"), [(0, 0.875, "size"), (8, 0.0, "crop_fraction"), (8, 1.5, "crop_fraction")]
)
def test_center_crop_resize_bad_arguments(size: int, crop_fraction: float, name: str) -> None:
    """Invalid size or crop_fraction raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=f"`{name}`"):
        CenterCropResize(size, crop_fraction=crop_fraction)


class _OwnBox(RandomResizedCropFlip):
    def box(self, height: int, width: int) -> tuple[int, int, int, int]:
        return 0, 0, height, width


class _OwnCall(CenterCropResize):
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image


def test_the_fast_path_contract_is_one_rule() -> None:
    """A fast path is taken by an instance that keeps the methods it stands in for; an override opts out."""
    own_box = _OwnBox(8, flip_p=0.0)
    assert inherits(RandomResizedCropFlip(8), RandomResizedCropFlip, "box", "flip", "__call__")
    assert not inherits(own_box, RandomResizedCropFlip, "box", "flip")
    assert inherits(own_box, RandomResizedCropFlip, "__call__")  # still fused: only the box is its own
    assert not inherits(CenterCropResize(8), RandomResizedCropFlip)
    assert own_box.fused_crops() is not None  # the transform states its fast path: still fused
    assert _OwnCall(8).fused_crops() is None  # its own __call__: read sample by sample
    assert CenterCropResize(8).fused_crops() is not None
    boxes, flips = own_box.boxes([20, 30], [40, 50], seed=0)
    assert (boxes, flips) == ([(0, 0, 20, 40), (0, 0, 30, 50)], [False, False])  # its own box, per image
    assert own_box(torch.zeros(3, 20, 40, dtype=torch.uint8)).shape == (3, 8, 8)


@pytest.mark.parametrize("layout", ["chw", "hwc"])
@pytest.mark.parametrize("with_planes", [False, True])
def test_normalizer_into_matches_the_reference_in_either_layout(layout: str, with_planes: bool) -> None:
    """The CPU kernel (a table lookup per pixel) writes ``(x / 255 - mean) / std`` as float32, CHW or HWC."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    want = (torch.from_numpy(image).double() / 255 - torch.tensor(mean, dtype=torch.float64)) / torch.tensor(
        std, dtype=torch.float64
    )
    out = np.full((3, 5, 7) if layout == "chw" else (5, 7, 3), np.nan, dtype=np.float32)
    planes = list(np.empty((3, 5, 7), np.uint8)) if with_planes else None
    Normalizer(mean, std).into(image, out, planes)
    got = torch.from_numpy(out if layout == "hwc" else out.transpose(1, 2, 0)).double()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
