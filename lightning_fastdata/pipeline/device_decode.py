"""Decode JPEG batches on the GPU (batched nvJPEG through ``torchvision.io.decode_jpeg``) and crop them there.

The workers only read the stored bytes and draw the crop box from the record header (no decode, no pixels), so the
CPU does almost nothing per image; the device decodes the whole batch, crops, flips and resizes each image. Without
CUDA the same code decodes on the CPU, so every path stays testable. The batch reader's batches of that kind are
:func:`read_encoded`'s.

What it costs the training thread: the decode runs there (in the loader's look-ahead, or in
``on_after_batch_transfer``), and torchvision's batched nvJPEG decode blocks the calling thread until the batch is
decoded (see :func:`_decode_on_device`). The pixels differ from the CPU path's (``decode="cpu"``) for the same crop
key by about 1.4 grey levels on average, at most about 13 (docs/datamodule.md, ``tests/test_device_decode.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import Dataset, get_worker_info

from lightning_fastdata.errors import CorruptRecordError, SampleError
from lightning_fastdata.keyed_random import AugmentKey
from lightning_fastdata.pipeline.schema import sample_batch
from lightning_fastdata.pipeline.streams import side_stream
from lightning_fastdata.skipping import SkipCounter, read_kept
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.reader import LmdbImageDataset, collate_labels
from lightning_fastdata.transforms import Box


class EncodedImages:
    """A batch of still-encoded images with the crop boxes and flips drawn for them in the workers.

    Not a tensor, not a dataclass and without a ``to`` method on purpose: Lightning's batch transfer leaves it alone,
    because ``decode_jpeg`` on the GPU takes the bytes from host memory.

    Pickled (what a DataLoader worker process does to send it to the training process), the batch is packed: the JPEG
    bytes of all its images in one flat uint8 tensor, allocated in shared memory, with their int64 offsets, boxes and
    flips pickled inline (a few hundred bytes). A worker so sends one shared-memory segment and file descriptor per
    batch, not one per image, each of which the training process would receive at a cost of its own
    (measured: docs/benchmarks.md#device-decode-one-flat-buffer-per-batch-across-processes). Unpickled, ``data`` is
    per-image views of that flat tensor (no copy), which is what ``decode_jpeg`` takes. The pack is done on pickling,
    not in :func:`collate_encoded`, so a batch that stays in its process (the thread engine) is never copied, and
    every reader of ``data`` sees the same list of per-image tensors on either side. Images that are not JPEG (raw
    or PNG records, decoded in the workers) are rare and travel as their own tensors.

    Args:
        data: per image, 1-D uint8 JPEG bytes, or an already decoded uint8 CHW tensor (non-JPEG records).
        boxes: ``(B, 4)`` int64 ``(top, left, height, width)``.
        flips: ``(B,)`` bool, horizontal flip after the crop.
        records: per image, ``(height, width, where)``: the size in the record header, checked after decoding,
            and the split and index, named in errors.

    """

    __slots__ = ("boxes", "data", "flips", "records")

    def __init__(
        self, data: list[Tensor], boxes: Tensor, flips: Tensor, records: list[tuple[int, int, str]] | None = None
    ) -> None:
        if not len(data) == len(boxes) == len(flips) or (records is not None and len(records) != len(data)):
            raise ValueError(f"got {len(data)} images, {len(boxes)} boxes and {len(flips)} flips")
        self.data = data
        self.boxes = boxes
        self.flips = flips
        self.records = records

    def __len__(self) -> int:
        return len(self.data)

    def pin_memory(self) -> EncodedImages:
        """Called by the DataLoader's pin-memory thread; the bytes are uploaded by nvJPEG itself."""
        return self

    def __reduce__(self) -> tuple[Callable[..., EncodedImages], tuple[Any, ...]]:
        """Packed: the JPEG bytes in one flat tensor (in shared memory in a worker process) and their offsets."""
        jpegs = [image for image in self.data if image.ndim == 1]
        offsets = np.zeros(len(self.data) + 1, dtype=np.int64)
        np.cumsum([image.numel() if image.ndim == 1 else 0 for image in self.data], out=offsets[1:])
        flat = torch.empty(0, dtype=torch.uint8)
        if offsets[-1] and get_worker_info() is not None:  # straight into shared memory: no copy by ForkingPickler
            flat.set_(torch.UntypedStorage._new_shared(int(offsets[-1])), 0, (int(offsets[-1]),))
        if jpegs:
            torch.cat(jpegs, out=flat)
        others = [(i, image) for i, image in enumerate(self.data) if image.ndim != 1]
        return _unpack, (flat, offsets, others, self.boxes.numpy(), self.flips.numpy(), self.records)


def _unpack(
    flat: Tensor,
    offsets: np.ndarray,
    others: list[tuple[int, Tensor]],
    boxes: np.ndarray,
    flips: np.ndarray,
    records: list[tuple[int, int, str]] | None,
) -> EncodedImages:
    """An :class:`EncodedImages` from its pickled form: each JPEG a view of ``flat``, the other images in place."""
    data = list(flat.split(np.diff(offsets).tolist()))
    for i, image in others:
        data[i] = image
    return EncodedImages(data, torch.from_numpy(boxes), torch.from_numpy(flips), records)


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
        (image, box, flip, _), label = self.read(index)
        return (image, box, flip), label

    def read(self, index: int) -> tuple[tuple[Tensor, Box, bool, tuple[int, int, str]], Any]:
        """Sample ``index`` with its record's ``(height, width, where)``, checked after decoding on the device."""
        if self.indices is not None:
            index = int(self.indices[index])
        header, data = self.dataset.read_record(index)
        box = self.box_fn(header.height, header.width)
        flip = self.flip_p > 0 and random.random() < self.flip_p
        return encoded_sample(self.dataset, index, header, data, box, flip)


def encoded_sample(
    dataset: LmdbImageDataset,
    index: int,
    header: _format.RecordHeader,
    payload: bytes | bytearray | memoryview,
    box: Box,
    flip: bool,
    with_target: bool = True,
) -> tuple[tuple[Tensor, Box, bool, tuple[int, int, str]], Any]:
    """One sample for device decode: ``(bytes or decoded pixels, box, flip, (height, width, where)), target``.

    The target is the sample's of its database's kind (``dataset.target``, then its ``target_transform``); without
    ``with_target``, the header's label, for a reader that reads the batch's targets at once.

    JPEG bytes are copied out of ``payload`` (which may be a view of the memory map) once their frame header is checked
    against the record's size and ``max_pixels``, and their markers against the reader's limits (at most
    ``MAX_JPEG_SCANS`` scans, a decode within ``DECODE_BUDGET`` with a progressive frame's coefficient buffer): no JPEG
    reaches nvJPEG, or the CPU decode standing in for it, that the CPU path would refuse. Other encodings (raw pixels,
    PNG), which nvJPEG cannot take, travel decoded.
    """
    if header.encoding == _format.ENCODING_JPEG:
        dataset._decoder.check_frame(index, header, payload)
    data = bytearray(payload)
    if header.encoding == _format.ENCODING_JPEG:
        image = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    else:
        image = torch.from_numpy(dataset.decode_hwc(index, header, data)).permute(2, 0, 1)
    if not with_target:
        return (image, box, flip, (header.height, header.width, dataset._where(index))), header.label
    target_transform = dataset.target_transform
    label = dataset.target(index, header)
    label = target_transform(label) if target_transform is not None else label
    return (image, box, flip, (header.height, header.width, dataset._where(index))), label


def collate_encoded(samples: Sequence[tuple[tuple[Any, ...], Any]]) -> tuple[EncodedImages, Any]:
    """Collate ``(image, box, flip[, record]), label`` samples into ``(EncodedImages, labels)``.

    Module level, so spawn can pickle it; a sample may carry its record's ``(height, width, where)`` fourth.
    """
    data, boxes, flips, records, labels = [], [], [], [], []
    for (image, box, flip, *record), label in samples:
        data.append(image)
        boxes.append(box)
        flips.append(flip)
        records.extend(record)
        labels.append(label)
    images = EncodedImages(
        data,
        torch.tensor(boxes, dtype=torch.int64).reshape(-1, 4),
        torch.tensor(flips, dtype=torch.bool),
        records if len(records) == len(data) else None,
    )
    return images, collate_labels(labels)


def check_encodable(base: Dataset, transform: Any) -> None:
    """Refuse a split that ``decode="device"`` cannot read: it needs a database and crop boxes (``box``).

    Raises:
        TypeError: ``base`` is not an :class:`~lightning_fastdata.LmdbImageDataset`, or ``transform`` has no ``box``.

    """
    if not isinstance(base, LmdbImageDataset) or not callable(getattr(transform, "box", None)):
        raise TypeError(
            "`decode='device'` needs `build_dataset` to return an LmdbImageDataset and the transforms to be"
            f" RandomResizedCropFlip / CenterCropResize (objects with a `box(height, width)` method); got"
            f" {type(base).__name__} and {type(transform).__name__}. Use `decode='cpu'` for custom"
            " pipelines."
        )


def read_encoded(
    base: LmdbImageDataset,
    transform: Any,
    pairs: Sequence[tuple[int, int]],
    key: AugmentKey | None,
    skip_counter: SkipCounter | None,
    return_index: bool,
    pin: Callable[[Any], Any],
) -> tuple[Any, ...]:
    """A batch reader's still-encoded JPEGs with their crop boxes and flips (``decode="device"``): no CPU pixels.

    ``pairs``: each sample's ``(index, record)`` in ``base``; bad samples are left out under ``skip_counter``'s policy
    (:func:`~lightning_fastdata.skipping.read_kept`); ``pin``: the labels (and index) into the batch's memory. Targets
    of a kind other than ``class`` are read once for the kept records, as on the fused path.
    """
    per_sample = base.target_spec.kind == "class" or base.target_transform is not None

    def sample(item: tuple[tuple[tuple[int, int], _format.RecordHeader, memoryview], Box, bool]) -> Any:
        ((_, record), header, payload), box, flip = item
        # checks the frame, decodes non-JPEGs
        return encoded_sample(base, record, header, payload, box, flip, with_target=per_sample), record

    with base.records() as read:
        found = read_kept(pairs, lambda pair: (pair, *read(pair[1])), skip_counter)
        boxes, flips = _boxes(transform, found, key)
        kept = read_kept(list(zip(found, boxes, flips, strict=True)), sample, skip_counter)
    encoded, labels = collate_encoded([item for item, _ in kept])
    records = [record for _, record in kept]
    if not per_sample:
        labels = torch.from_numpy(base.targets_of(records))
    index = pin(torch.tensor(records, dtype=torch.int64)) if return_index else None
    return sample_batch((encoded, pin(labels)), index)


def _boxes(transform: Any, found: list[tuple[Any, ...]], key: AugmentKey | None) -> tuple[list[Box], list[bool]]:
    """The crop boxes and flips of the records ``found`` (``((index, record), header, ...)``), from their keys."""
    heights, widths = [item[1].height for item in found], [item[1].width for item in found]
    if not callable(getattr(transform, "boxes", None)):  # a transform of one's own with only `box`
        flip_p = getattr(transform, "flip_p", 0.0)
        flips = [flip_p > 0 and random.random() < flip_p for _ in found]
        return [transform.box(h, w) for h, w in zip(heights, widths, strict=True)], flips
    return transform.boxes(heights, widths, key=key, samples=[item[0][0] for item in found])


def decode_jpeg(data: Any, mode: str = "RGB", device: torch.device | str = "cpu") -> Any:
    """``torchvision.io.decode_jpeg``, imported on first use.

    Importing torchvision takes seconds (it loads ``torch._dynamo``), which every DataLoader worker process reading
    batches would otherwise pay at start-up.
    """
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as decode

    return decode(data, mode=ImageReadMode[mode], device=device)


def _decode_on_device(inputs: list[Tensor], device: torch.device) -> list[Tensor]:
    """Batched nvJPEG decode on a dedicated stream, made safe for the caller's stream.

    torchvision allocates the outputs on the *current* stream but writes them on nvJPEG's own stream without waiting
    for it, so memory that kernels queued on the current stream still read could be overwritten. Here the current
    stream during the decode is a dedicated one that only ever holds decode outputs; the caller's stream then waits
    for it, and ``record_stream`` keeps each output's memory from being reused until the caller's work on it is done.

    This function adds no host synchronization, but torchvision's decode does, and it runs on the calling thread (the
    training thread). In ``decode_jpegs_cuda`` (``torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp``, torchvision
    0.29) the decoder holds a process-wide mutex, and ``CUDAJpegDecoder::decode_images`` calls
    ``cudaStreamSynchronize`` on nvJPEG's own stream before queuing the batch and again after it: the thread waits
    until the whole batch is decoded. Images the hardware decoder cannot take (progressive JPEGs; every image on a GPU
    without nvJPEG's hardware backend, which A100 and H100 have) are decoded one by one, their Huffman stage on the
    host in this thread, with one more ``cudaStreamSynchronize`` each. The wait is on nvJPEG's stream only: kernels
    already queued on the compute stream keep running meanwhile, but the thread launches no new ones until the batch
    is decoded.
    """
    stream = side_stream(device, "decode")
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)  # inputs or earlier work the decode depends on
    with torch.cuda.stream(stream):
        outputs = decode_jpeg(inputs, mode="RGB", device=device)
    caller.wait_stream(stream)
    for image in outputs:
        image.record_stream(caller)
    return outputs


def _decode_all(encoded: EncodedImages, device: torch.device) -> list[Tensor | CorruptRecordError]:
    """Every image of the batch decoded on ``device``, or the error that names the one that failed.

    The JPEGs are decoded together; if that fails, one by one, so a single bad record is found and named instead of
    failing the whole batch. Decoded sizes are checked against the record headers (shapes: no device round trip).
    """
    jpeg = [i for i, t in enumerate(encoded.data) if t.ndim == 1]
    decoded: list[Tensor | CorruptRecordError] = [t for t in encoded.data]
    where = (
        [r[2] for r in encoded.records]
        if encoded.records is not None
        else [f"image {i} of the batch" for i in range(len(encoded))]
    )

    def decode(inputs: list[Tensor]) -> list[Tensor]:
        if device.type == "cuda":
            return _decode_on_device(inputs, device)
        return [decode_jpeg(t, mode="RGB") for t in inputs]

    outputs: list[Tensor | CorruptRecordError] = []
    if jpeg:  # a batch of raw or PNG records has nothing to decode (and batched nvJPEG rejects an empty list)
        try:
            outputs = list(decode([encoded.data[i] for i in jpeg]))
        except RuntimeError:
            outputs = []
            for i in jpeg:
                try:
                    outputs.append(decode([encoded.data[i]])[0])
                except RuntimeError as err:
                    outputs.append(CorruptRecordError(f"{where[i]}: the JPEG does not decode on {device.type}: {err}"))
    for i, image in zip(jpeg, outputs, strict=True):
        decoded[i] = image
    if encoded.records is not None:
        for i, (image, (height, width, _)) in enumerate(zip(decoded, encoded.records, strict=True)):
            if isinstance(image, Tensor) and tuple(image.shape[-2:]) != (height, width):
                decoded[i] = CorruptRecordError(
                    f"{where[i]}: decoded size {tuple(image.shape[-2:])} differs from the stored {(height, width)}"
                )
    return decoded


def decode_crop(encoded: EncodedImages, size: int, device: torch.device) -> Tensor:
    """Decode, crop, flip and resize a batch on ``device``: ``(B, 3, size, size)`` float32 in 0-255.

    On CUDA the JPEGs are decoded together by ``torchvision.io.decode_jpeg(list, device=...)`` (batched nvJPEG), which
    returns only once the batch is decoded (:func:`_decode_on_device`); elsewhere one by one on the CPU. Each crop is
    resized with antialiased bilinear interpolation in float32. The CPU path (``decode="cpu"``) decodes with
    libjpeg-turbo's fast DCT and resizes in uint8 with OpenCV, so for the same boxes the results differ by about 1.4
    grey levels on average (p99 about 5.5, at most about 13).

    Raises:
        CorruptRecordError: an image does not decode, or not to its record's size, naming its split and index.

    """
    return decode_crop_skipping(encoded, size, device)[0]


def decode_crop_skipping(
    encoded: EncodedImages, size: int, device: torch.device, skip: Callable[[CorruptRecordError], None] | None = None
) -> tuple[Tensor, list[int] | None]:
    """:func:`decode_crop`, leaving out (and reporting to ``skip``) the images that fail.

    Args:
        encoded: the batch.
        size: output side length.
        device: where to decode.
        skip: called with the error of each image that does not decode (or decodes to the wrong size), which is then
            left out; without it the first such error is raised.

    Returns:
        The images, and the positions kept when some were left out (``None`` when all were kept).

    Raises:
        CorruptRecordError: an image does not decode, naming its split and index, and ``skip`` is not given.

    """
    decoded = _decode_all(encoded, device)
    keep = [i for i, image in enumerate(decoded) if isinstance(image, Tensor)]
    for image in decoded:
        if isinstance(image, CorruptRecordError):
            if skip is None:
                raise image
            skip(image)
    if not keep:
        raise SampleError(f"all {len(decoded)} images of a batch failed to decode on {device.type} and were skipped.")
    out = torch.empty((len(keep), 3, size, size), dtype=torch.float32, device=device)
    boxes = encoded.boxes.tolist()
    flips = encoded.flips.tolist()
    for slot, i in enumerate(keep):
        image = decoded[i]
        assert isinstance(image, Tensor)
        if image.device != device:
            image = image.to(device, non_blocking=True)
        top, left, h, w = boxes[i]
        crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
        resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[slot] = resized[0].flip(-1) if flips[i] else resized[0]
    return out, (keep if len(keep) < len(decoded) else None)


def encoded_batch_to_images(
    batch: Any,
    size: int,
    device: torch.device,
    normalize: Callable[[Tensor], Tensor],
    skip: Callable[[CorruptRecordError], None] | None = None,
) -> Any:
    """Replace an ``EncodedImages`` first element of a batch by its decoded, normalized images on ``device``.

    Images left out under ``skip`` are left out of the batch's other per-sample tensors too.
    """
    if not isinstance(batch, (tuple, list)) or not batch or not isinstance(batch[0], EncodedImages):
        return batch
    n = len(batch[0])
    images, keep = decode_crop_skipping(batch[0], size, device, skip)
    rest = list(batch[1:])
    if keep is not None:  # rare (a damaged record): index the per-sample tensors with the kept positions
        rest = [t[torch.tensor(keep, device=t.device)] if isinstance(t, Tensor) and len(t) == n else t for t in rest]
    images = normalize(images)
    return type(batch)([images, *rest]) if isinstance(batch, list) else (images, *rest)
