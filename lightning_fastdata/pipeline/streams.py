"""The side CUDA streams of the batch path: one persistent stream per device and role, created on first use.

Its own module, below both users: the copy one step ahead (:mod:`~lightning_fastdata.pipeline.device`) and the
nvJPEG decode (:mod:`~lightning_fastdata.pipeline.device_decode`), which the device stage in turn calls.
"""

from __future__ import annotations

from typing import Any

import torch

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
