"""Decode JPEG batches on the GPU (batched nvJPEG through ``torchvision.io.decode_jpeg``) and crop them there.

The workers only read the stored bytes and draw the crop box from the record header (no decode, no pixels), so the
CPU does almost nothing per image; the device decodes the whole batch, crops, flips and resizes each image. Without
CUDA the same code decodes on the CPU, so every path stays testable.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from lightning_fastdata import _format
from lightning_fastdata.dataset import LmdbImageDataset

#: ``(top, left, height, width)`` of the crop in source pixels
Box = tuple[int, int, int, int]


class EncodedImages:
    """A batch of still-encoded images with the crop boxes and flips drawn for them in the workers.

    Not a tensor and not a dataclass on purpose: Lightning's batch transfer leaves it alone, because
    ``decode_jpeg`` on the GPU takes the bytes from host memory.

    Args:
        data: per image, 1-D uint8 JPEG bytes, or an already decoded uint8 CHW tensor (non-JPEG records).
        boxes: ``(B, 4)`` int64 ``(top, left, height, width)``.
        flips: ``(B,)`` bool, horizontal flip after the crop.

    """

    __slots__ = ("boxes", "data", "flips")

    def __init__(self, data: list[Tensor], boxes: Tensor, flips: Tensor) -> None:
        if not len(data) == len(boxes) == len(flips):
            raise ValueError(f"got {len(data)} images, {len(boxes)} boxes and {len(flips)} flips")
        self.data = data
        self.boxes = boxes
        self.flips = flips

    def __len__(self) -> int:
        return len(self.data)

    def pin_memory(self) -> EncodedImages:
        """Called by the DataLoader's pin-memory thread; the bytes are uploaded by nvJPEG itself."""
        return self


class EncodedCropDataset(Dataset):
    """Reads records without decoding and draws each sample's crop box (and flip) from its header.

    Args:
        dataset: the database split to read.
        box_fn: ``(height, width) -> (top, left, h, w)``, e.g. ``RandomResizedCropFlip(...).box``.
        flip_p: probability of a horizontal flip.
        indices: read only these samples (a held-out split), as ``int32``.

    """

    def __init__(
        self,
        dataset: LmdbImageDataset,
        box_fn: Callable[[int, int], Box],
        flip_p: float,
        indices: Any = None,
    ) -> None:
        self.dataset = dataset
        self.box_fn = box_fn
        self.flip_p = flip_p
        self.indices = indices

    def __len__(self) -> int:
        return len(self.dataset) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int) -> tuple[tuple[Tensor, Box, bool], int]:
        if self.indices is not None:
            index = int(self.indices[index])
        header, data = self.dataset.read_record(index)
        if header.encoding == _format.ENCODING_JPEG:
            image = torch.frombuffer(data, dtype=torch.uint8)
        else:  # not JPEG (raw pixels, PNG): nvJPEG cannot take it, so it travels decoded
            image = self.dataset.decode(index, header, data)
        box = self.box_fn(header.height, header.width)
        flip = self.flip_p > 0 and random.random() < self.flip_p
        return (image, box, flip), header.label


def collate_encoded(samples: Sequence[tuple[tuple[Tensor, Box, bool], int]]) -> tuple[EncodedImages, Tensor]:
    """Collate ``EncodedCropDataset`` samples into ``(EncodedImages, labels)``; module level, so spawn can pickle it."""
    data, boxes, flips, labels = [], [], [], []
    for (image, box, flip), label in samples:
        data.append(image)
        boxes.append(box)
        flips.append(flip)
        labels.append(label)
    images = EncodedImages(
        data, torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4), torch.tensor(flips, dtype=torch.bool)
    )
    return images, torch.tensor(labels, dtype=torch.int64)


def decode_crop(encoded: EncodedImages, size: int, device: torch.device) -> Tensor:
    """Decode, crop, flip and resize a batch on ``device``: ``(B, 3, size, size)`` float32 in 0-255.

    On CUDA the JPEGs are decoded together by ``torchvision.io.decode_jpeg(list, device=...)`` (batched nvJPEG);
    elsewhere one by one on the CPU. Each crop is resized with antialiased bilinear interpolation, as on the CPU path.
    """
    jpeg = [i for i, t in enumerate(encoded.data) if t.ndim == 1]
    decoded: list[Tensor | None] = [None] * len(encoded)
    if jpeg:
        inputs = [encoded.data[i] for i in jpeg]
        if device.type == "cuda":
            outputs = decode_jpeg(inputs, mode=ImageReadMode.RGB, device=device)
        else:
            outputs = [decode_jpeg(t, mode=ImageReadMode.RGB) for t in inputs]
        for i, image in zip(jpeg, outputs, strict=True):
            decoded[i] = image
    out = torch.empty((len(encoded), 3, size, size), dtype=torch.float32, device=device)
    boxes = encoded.boxes.tolist()
    flips = encoded.flips.tolist()
    for i, image in enumerate(decoded):
        if image is None:
            image = encoded.data[i].to(device, non_blocking=True)
        top, left, h, w = boxes[i]
        crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
        resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[i] = resized[0].flip(-1) if flips[i] else resized[0]
    return out


def encoded_batch_to_images(batch: Any, size: int, device: torch.device, normalize: Callable[[Tensor], Tensor]) -> Any:
    """Replace an ``EncodedImages`` first element of a batch by its decoded, normalized images on ``device``."""
    if not isinstance(batch, (tuple, list)) or not batch or not isinstance(batch[0], EncodedImages):
        return batch
    images = normalize(decode_crop(batch[0], size, device))
    return type(batch)([images, *batch[1:]]) if isinstance(batch, list) else (images, *batch[1:])
