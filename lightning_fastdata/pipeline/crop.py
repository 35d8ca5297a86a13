"""One image of the fused path: decoded once, then each view cropped, resized and flipped into its slot.

:class:`CropKernel` is what :class:`~lightning_fastdata.pipeline.kernel.BatchReader` runs per image of a fused batch,
once the batch's records are read and its crop boxes drawn: decode (libjpeg-turbo's fast DCT, straight from the memory
map), crop, resize (antialiased when shrinking) and flip each view's box into its slot of the batch's memory, and for
``float`` output (CPU training) colour (:mod:`~lightning_fastdata.pipeline.color`) and normalize it in the same
thread.

Every thread that builds batches (a loader thread, a worker process's main thread) decodes an image into a flat
buffer, prefilters its crop into another and, for ``float`` output, crops into a ``uint8`` image of the crop size
before normalizing it: made once per thread and size, reused for every image after, so no image costs a page fault.
The buffers belong to the thread and the process that made them: pickled (a batch reader sent to a worker process),
:class:`ScratchBuffers` arrives empty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from lightning_fastdata.errors import SampleError
from lightning_fastdata.pipeline.color import BatchColor, ImagePlan
from lightning_fastdata.store.format import RecordHeader
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.transforms import Box, Normalizer, crop_resize_into


class ScratchBuffers(threading.local):
    """This thread's reusable buffers, by name and size; each thread sees its own, and a copy sent away none."""

    def buffer(self, name: str, nbytes: int) -> np.ndarray:
        """This thread's reusable flat buffer ``name`` (decoded image, prefiltered crop): no page faults per image."""
        buffer = getattr(self, name, None)
        if buffer is None or buffer.size < nbytes:
            buffer = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            setattr(self, name, buffer)
        return buffer

    def float_crop(self, size: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """This thread's uint8 crop ``(size, size, 3)`` and its three planes, made once a size: none made per image."""
        sizes = getattr(self, "float", None)
        if sizes is None:
            sizes = self.float = {}
        cached = sizes.get(size)
        if cached is None:
            crop = np.empty((size, size, 3), dtype=np.uint8)
            cached = sizes[size] = (crop, list(np.empty((3, size, size), dtype=np.uint8)))
        return cached

    def __reduce__(self) -> tuple[Callable[[], ScratchBuffers], tuple[()]]:
        """Scratch buffers stay in their process: a copy elsewhere starts empty."""
        return ScratchBuffers, ()


class CropKernel:
    """Decodes a record of ``base`` once and crops each view's box into the batch's memory, through scratch buffers.

    Args:
        base: the database split the records are read from.
        output: ``"uint8"`` crops straight into the batch (NHWC); ``"float"`` crops normalized into it.
        normalizer: the mean and std for ``output="float"``.
        channels_last: ``float`` batches in NHWC memory (else NCHW).
        color: the colour augmentation of crops coloured here (``float`` output), or ``None``.

    """

    def __init__(
        self,
        base: LmdbImageDataset,
        output: str,
        normalizer: Normalizer | None,
        channels_last: bool,
        color: BatchColor | None,
    ) -> None:
        self.base = base
        self.output = output
        self.normalizer = normalizer
        self.channels_last = channels_last
        self.color = color
        self.scratch = ScratchBuffers()

    def into(
        self,
        record: int,
        header: RecordHeader,
        payload: memoryview,
        boxes: Sequence[Box],
        flips: Sequence[bool],
        outs: Sequence[np.ndarray],
        color: tuple[ImagePlan, int] | None = None,
    ) -> None:
        """Decode one record once, then crop, resize and flip (and colour and normalize) each view's box into ``outs``.

        A crop's side is its ``out``'s (the batch's memory, made for the crop size when its epoch started), not the
        transform's: a ``set_image_size`` during an epoch takes effect at the next one, never mid-batch. ``color``:
        the batch's colour plan and the row of this sample's first view (``float`` output only).
        """
        base, buffers = self.base, self.scratch
        nbytes = header.height * header.width * 3
        image = base.decode_hwc(record, header, payload, buffers.buffer("decode", nbytes), fast=True)
        scratch = buffers.buffer("prefilter", nbytes)
        for view, (box, flip, out) in enumerate(zip(boxes, flips, outs, strict=True)):
            size = out.shape[0] if self.output == "uint8" or self.channels_last else out.shape[1]
            try:
                if self.output == "float":  # the uint8 crop in a scratch buffer, (coloured,) normalized into the batch
                    assert self.normalizer is not None
                    crop, planes = buffers.float_crop(size)
                    crop_resize_into(image, box, size, flip, crop, scratch)
                    if color is not None:
                        assert self.color is not None
                        self.color.apply_image(crop, color[0], color[1] + view)
                    self.normalizer.into(crop, out, planes)
                else:
                    crop_resize_into(image, box, size, flip, out, scratch)
            except Exception as err:  # cv2.error and friends: name the sample
                raise SampleError(f"{base._where(record)}: cropping {box} failed: {err}") from err
