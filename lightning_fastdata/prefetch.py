"""Copy batch N+1 to the GPU on a side CUDA stream while batch N computes.

Integration point: a :class:`~torch.utils.data.DataLoader` subclass whose iterator does the look-ahead (the
package's own :class:`~lightning_fastdata.pipeline.FastLoader`, or :class:`DevicePrefetchLoader` around one's own
dataset). Lightning still sees a real DataLoader, so everything it does with loaders keeps working unchanged: the
sampler stays reachable for ``set_epoch`` (and for injection, when Lightning injects one), ``len()`` and
``limit_train_batches`` use the loader's length, Lightning's own one-batch look-ahead still detects the last batch,
and checkpoint/resume treats it as any loader. A batch-hook cannot overlap anything (Lightning calls
``transfer_batch_to_device`` only when the step is about to start), and replacing the loop's data fetcher would
reach into private Trainer state.

The handshake is apex's ``data_prefetcher``: copies (and the uint8 -> float normalization) are issued on one
persistent side stream per device — never one per epoch, which grows memory (timm issue 2781) — the compute stream
waits on the side stream before a batch is handed out, and ``record_stream`` tells the caching allocator that the
compute stream uses those tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

#: (role, device index) -> the stream: one cache for every side stream of the package
_SIDE_STREAMS: dict[tuple[str, int], Any] = {}


def side_stream(device: torch.device, role: str = "copy") -> Any:
    """The one persistent stream of a CUDA device for ``role`` (created on first use).

    ``"copy"``: host-to-device copies of the next batch; ``"decode"``: nvJPEG decodes (``decode="device"``).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get((role, index))
    if stream is None:
        stream = _SIDE_STREAMS[role, index] = torch.cuda.Stream(device=index)
    return stream


def _apply(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``fn`` on every tensor of a batch (Lightning's ``apply_to_collection``).

    Imported where it is used: worker processes import this module to unpickle a batch reader, and importing
    Lightning costs them seconds.
    """
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(batch, Tensor, fn)


def _to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in the batch to ``device``, asynchronously (pinned sources copy without blocking the host)."""
    return _apply(batch, lambda t: t.to(device, non_blocking=True))


def _record_stream(batch: Any, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's tensors (they were allocated on the side stream)."""
    _apply(batch, lambda t: t.record_stream(stream) if t.is_cuda else None)


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


class DevicePrefetchLoader(DataLoader):
    """A DataLoader that hands out batches already on ``device``, copied one step ahead on a side CUDA stream.

    On any device other than CUDA it is a plain DataLoader (a clean no-op). Pass ``pin_memory=True`` so the copies
    are truly asynchronous.

    Args:
        *args: the arguments of :class:`~torch.utils.data.DataLoader`.
        device: where batches go; ``None`` or a non-CUDA device disables the look-ahead.
        on_device: applied to each batch on the side stream after the copy.
        **kwargs: the keyword arguments of :class:`~torch.utils.data.DataLoader`.

    Example:
        >>> loader = DevicePrefetchLoader(dataset, batch_size=64, pin_memory=True, device="cuda:0")  # doctest: +SKIP

    """

    def __init__(
        self,
        *args: Any,
        device: torch.device | str | None = None,
        on_device: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device(device) if device is not None else None
        self.on_device = on_device

    @property
    def prefetching(self) -> bool:
        """Whether batches are copied ahead (only on CUDA)."""
        return self.device is not None and self.device.type == "cuda"

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Iterate like a DataLoader; on CUDA each batch arrives on the device, copied one step ahead."""
        batches = super().__iter__()
        if not self.prefetching:
            return batches
        assert self.device is not None
        return prefetch_to_device(batches, self.device, self.on_device)
