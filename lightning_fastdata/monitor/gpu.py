"""GPU utilization and memory from NVML: the handle of the training device, and a sampler thread that polls it."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)


def nvml_handles(device_index: int) -> tuple[Any, list[Any]] | str:
    """NVML and the handle of CUDA device ``device_index``, or the reason GPU utilization is unavailable.

    Args:
        device_index: the CUDA device (as torch numbers it; NVML's order can differ, so the lookup goes by UUID).

    Returns:
        ``(pynvml, [handle])``, or one sentence that says why NVML cannot be used (not installed, or not usable).

    """
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (`pip install nvidia-ml-py`)"
    try:
        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception as err:
        return f"NVML is not usable here ({err})"
    return pynvml, [handle]


class GpuSampler:
    """Polls NVML for the utilization and memory of some GPUs in a daemon thread; ``take()`` averages and resets.

    Args:
        nvml: the ``pynvml`` module (or a stand-in with ``nvmlDeviceGetUtilizationRates`` and
            ``nvmlDeviceGetMemoryInfo``).
        handles: the NVML handles of the GPUs to average over.
        interval: seconds between samples.

    """

    def __init__(self, nvml: Any, handles: list[Any], interval: float) -> None:
        self.nvml = nvml
        self.handles = handles
        self.interval = interval
        self._lock = threading.Lock()
        self._util_sum = 0.0
        self._mem_sum = 0.0
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="LoaderMonitor-nvml", daemon=True)

    def start(self) -> None:
        """Start polling in the background."""
        self._thread.start()

    def sample(self) -> None:
        """Read every GPU's utilization and memory once and add their means to the running sums."""
        util = mem = 0.0
        for handle in self.handles:
            util += float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            mem += float(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
        with self._lock:
            self._util_sum += util / len(self.handles)
            self._mem_sum += mem / len(self.handles)
            self._count += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as err:  # NVML errors must never take training down
                log.debug("NVML sampling stopped: %s", err)
                return

    def take(self) -> tuple[float, float] | None:
        """Mean utilization (%) and memory used (GiB) since the last call, or ``None`` without samples."""
        with self._lock:
            if not self._count:
                return None
            util, mem = self._util_sum / self._count, self._mem_sum / self._count / 2**30
            self._util_sum = self._mem_sum = 0.0
            self._count = 0
        return util, mem

    def stop(self) -> None:
        """Stop polling and wait for the thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
