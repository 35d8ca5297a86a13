"""``DevicePrefetchLoader``: any dataset's batches copied to the GPU one step ahead, on a side CUDA stream.

The look-ahead is the batch path's own (:func:`~lightning_fastdata.pipeline.device.prefetch_to_device`, where the
handshake with the compute stream is described), wrapped for a DataLoader of one's own; the package's loaders,
:class:`~lightning_fastdata.pipeline.factory.FastLoader`, do the same in their iterator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_fastdata.pipeline.device import prefetch_to_device


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
