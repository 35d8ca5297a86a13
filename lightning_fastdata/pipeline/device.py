"""The device stage: batch N+1 copied to the GPU on a side CUDA stream while batch N computes, then made model input.

The handshake is apex's ``data_prefetcher``: copies (and the uint8 -> float normalization) are issued on one
persistent side stream per device (:func:`~lightning_fastdata.pipeline.streams.side_stream`) — never one per epoch,
which grows memory (timm issue 2781) — the compute stream waits on the side stream before a batch is handed out, and
``record_stream`` tells the caching allocator that the compute stream uses those tensors.

The look-ahead lives in a :class:`~torch.utils.data.DataLoader` subclass's iterator (the package's own
:class:`~lightning_fastdata.pipeline.factory.FastLoader`, or :class:`~lightning_fastdata.DevicePrefetchLoader`
around one's own dataset). Lightning still sees a real DataLoader, so everything it does with loaders keeps working
unchanged: the sampler stays reachable for ``set_epoch`` (and for injection, when Lightning injects one), ``len()``
and ``limit_train_batches`` use the loader's length, Lightning's own one-batch look-ahead still detects the last
batch, and checkpoint/resume treats it as any loader. A batch-hook cannot overlap anything (Lightning calls
``transfer_batch_to_device`` only when the step is about to start), and replacing the loop's data fetcher would
reach into private Trainer state.

:class:`DeviceStage` runs on the side stream right after each copy: ``uint8`` images to normalized floats of the
model's dtype, still-encoded JPEGs (``decode="device"``) decoded by nvJPEG first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_fastdata.errors import CorruptRecordError
from lightning_fastdata.pipeline.color import BatchColor
from lightning_fastdata.pipeline.device_decode import EncodedImages, encoded_batch_to_images
from lightning_fastdata.pipeline.schema import split_beside, with_beside
from lightning_fastdata.pipeline.streams import side_stream
from lightning_fastdata.transforms import Normalizer

_PRECISION_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}


class DeviceStage:
    """The last stage: a batch's images, ``uint8`` or still encoded, to model input on the device.

    ``uint8`` images become normalized floats of ``dtype`` (``channels_last`` if asked); still-encoded ones
    (``decode="device"``) are decoded, cropped and resized on the device first; floats already normalized by the
    loader threads only take ``dtype`` where it differs. A list (or tuple) of such image batches, the views of a
    transform that returns several (``[B, 3, H, W]`` each, sizes of their own), is treated view by view and keeps its
    container. Anything else passes through, as do the batch's other elements. Constants live on the device
    (:class:`~lightning_fastdata.transforms.Normalizer` caches them): nothing here waits for the device.

    Runs on the side stream right after each copy when the loader looks ahead (``FastLoader(on_device=...)``), else
    in ``FastImageDataModule.on_after_batch_transfer``.

    Args:
        normalizer: the mean and std.
        dtype: the model's input dtype.
        channels_last: batches in ``channels_last`` memory.
        device: where still-encoded images are decoded.
        image_size: the side of decoded crops.
        skip: called with the error of a still-encoded image that fails to decode (then left out); ``None``: raise.
        color: a batch that carries colour parameters (training batches, :mod:`~lightning_fastdata.pipeline.color`)
            has them taken off, and its ``uint8`` images coloured by it before they are normalized; a list of views,
            each view with its own parameters (``[B, V, 7]``).

    """

    def __init__(
        self,
        normalizer: Normalizer,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        device: torch.device | None = None,
        image_size: int | None = None,
        skip: Callable[[CorruptRecordError], None] | None = None,
        color: BatchColor | None = None,
    ) -> None:
        self.normalizer = normalizer
        self.dtype = dtype
        self.channels_last = channels_last
        self.device = device
        self.image_size = image_size
        self.skip = skip
        self.color = color

    def __call__(self, batch: Any, beside: Mapping[str, Any] | None = None) -> Any:
        """The batch with its first element, the images, as model input: a plain tuple (or list) for the step.

        ``beside``: the fields that travel beside the batch (:mod:`~lightning_fastdata.pipeline.schema`), its colour
        parameters; default: those the batch carries (:attr:`Batch.beside
        <lightning_fastdata.pipeline.schema.Batch.beside>`).
        """
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        batch, carried = split_beside(batch)
        params = (carried if beside is None else beside).get("color")
        first = batch[0]
        if isinstance(first, EncodedImages):
            if self.device is None or self.image_size is None:
                raise ValueError("Still-encoded images need `DeviceStage(device=..., image_size=...)` to decode.")
            return encoded_batch_to_images(batch, self.image_size, self.device, self._finish, skip=self.skip)
        if isinstance(first, torch.Tensor):
            if params is not None and params.dim() != 2:
                raise ValueError(f"one image batch takes colour parameters [B, 7], got {tuple(params.shape)}.")
            images: Any = self._images(first, params)
            unchanged = images is first
        elif isinstance(first, (list, tuple)) and first and all(isinstance(view, torch.Tensor) for view in first):
            # several views of each sample (built-in views, a transform's list): each view as a single-view batch,
            # coloured with its own parameters (`[B, V, 7]`), same container
            if params is not None and (params.dim() != 3 or params.shape[1] != len(first)):
                raise ValueError(
                    f"{len(first)} views take colour parameters [B, {len(first)}, 7], got {tuple(params.shape)}."
                )
            images = type(first)(
                self._images(view, None if params is None else params[:, v]) for v, view in enumerate(first)
            )
            unchanged = all(new is old for new, old in zip(images, first, strict=True))
        else:
            return batch
        if unchanged:
            return batch
        return type(batch)([images, *batch[1:]]) if isinstance(batch, list) else (images, *batch[1:])

    def _images(self, images: Tensor, params: Tensor | None = None) -> Tensor:
        """One ``[B, C, H, W]`` image batch as model input (``images`` itself when it already is, or is no images).

        With colour parameters (and a colour stage), uint8 images are coloured (on a CPU image by image, in uint8; on
        a GPU as a batch, in floats in 0-255), then normalized.
        """
        if params is not None and self.color is not None:
            params = params.to(images.device, non_blocking=True)  # there already, unless they came beside the transfer
            if images.dtype != torch.uint8:
                raise TypeError(f"colour augmentation needs uint8 images (0-255), got {images.dtype} ones.")
            on_cuda = self.device is not None and self.device.type == "cuda"
            colored = self.color.apply_batch(images, params) if on_cuda else self.color(images, params)
            if colored.dtype == torch.uint8:
                return self.normalizer.batch(colored, self.dtype, self.channels_last)
            return self.normalizer.float_(colored, self.dtype, self.channels_last)
        if images.dtype == torch.uint8:
            return self.normalizer.batch(images, self.dtype, self.channels_last)
        if images.is_floating_point() and images.dtype != self.dtype:  # normalized by the loader threads
            return images.to(self.dtype)
        return images

    def _finish(self, images: torch.Tensor) -> torch.Tensor:
        """Decoded float images in 0-255 -> normalized ``dtype``."""
        return self.normalizer.float_(images, self.dtype, self.channels_last)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, channels_last={self.channels_last}, device={self.device})"


# ----------------------------------------------------------------------------------------------------------------
# What the Trainer trains on: the DataModule's choices of device, dtype, look-ahead and what its loaders read
# ----------------------------------------------------------------------------------------------------------------


def batch_dtype(trainer: Any) -> torch.dtype:
    """The dtype images are converted to: float32, or the Trainer's true-precision dtype."""
    if trainer is None:
        return torch.float32
    return _PRECISION_DTYPES.get(str(trainer.precision), torch.float32)


def trainer_device(trainer: Any) -> torch.device:
    """The device the Trainer trains on; without a Trainer, CUDA when it is available, else the CPU."""
    if trainer is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return trainer.strategy.root_device


def trains_on_cuda(trainer: Any) -> bool:
    """Whether the Trainer trains on CUDA; without a Trainer, whether CUDA is available."""
    if trainer is None:
        return torch.cuda.is_available()
    return trainer.strategy.root_device.type == "cuda"


def uses_prefetch(prefetch_to_device: bool | None, device: torch.device) -> bool:
    """Whether loaders copy batches ahead on a side CUDA stream (``prefetch_to_device``, resolved for ``device``)."""
    on_cuda = device.type == "cuda"
    return on_cuda if prefetch_to_device is None else (prefetch_to_device and on_cuda)


def loader_output(device_decode: bool, device: torch.device) -> Literal["uint8", "float", "encoded"]:
    """What the loaders read: encoded for device decode, uint8 for CUDA, normalized float on a CPU.

    One of :data:`~lightning_fastdata.pipeline.kernel.Output`.
    """
    if device_decode:
        return "encoded"
    return "uint8" if device.type == "cuda" else "float"


def _apply(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``fn`` on every tensor of a batch (Lightning's ``apply_to_collection``).

    Imported where it is used: worker processes import this module to unpickle a batch reader, and importing
    Lightning costs them seconds.
    """
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(batch, Tensor, fn)


def _to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in the batch to ``device``, asynchronously (pinned sources copy without blocking the host).

    The fields beside the batch (:mod:`~lightning_fastdata.pipeline.schema`) go with it, and stay beside it.
    """
    batch, beside = split_beside(batch)
    moved = _apply(batch, lambda t: t.to(device, non_blocking=True))
    return with_beside(moved, _apply(beside, lambda t: t.to(device, non_blocking=True))) if beside else moved


def _record_stream(batch: Any, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's tensors (they were allocated on the side stream)."""
    batch, beside = split_beside(batch)
    _apply((batch, beside), lambda t: t.record_stream(stream) if t.is_cuda else None)


def prefetch_to_device(
    batches: Iterator[Any], device: torch.device, on_device: Callable[[Any], Any] | None = None
) -> Iterator[Any]:
    """Yield the batches of ``batches`` on ``device``, each copied (and transformed) one step ahead on a side stream.

    Args:
        batches: host batches, ideally in pinned memory.
        device: a CUDA device.
        on_device: applied to each batch on the side stream after the copy (e.g. uint8 -> normalized float).

    """
    stream = side_stream(device)
    pending: Any = None
    has_pending = False
    for host_batch in batches:
        with torch.cuda.stream(stream):
            ready = _to_device(host_batch, device)
            if on_device is not None:
                ready = on_device(ready)
        if has_pending:
            yield pending  # batch N computes while the side stream copies batch N + 1
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)  # the step that uses `ready` starts after its copy
        _record_stream(ready, compute)
        pending, has_pending = ready, True
    if has_pending:
        yield pending
