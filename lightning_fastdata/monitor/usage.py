"""GPU and CPU utilization over a fit's logging intervals: what ``LoaderMonitor`` logs beside the times.

On CUDA an NVML sampler thread polls the training device (:mod:`~lightning_fastdata.monitor.gpu`); on any device a
:class:`~lightning_fastdata.cpus.CpuMeter` reads the CPU time of this process and its loader workers. At each logging
point both are averaged over the interval and kept, one value an interval, for the end-of-fit summary.
"""

from __future__ import annotations

from array import array

import torch

from lightning_fastdata import cpus
from lightning_fastdata.monitor.gpu import GpuSampler, nvml_handles


class UsageMeters:
    """The training GPU's utilization and memory (NVML, on CUDA) and the CPU utilization, per logging interval.

    Args:
        gpu_poll_interval: seconds between NVML samples.

    """

    def __init__(self, gpu_poll_interval: float) -> None:
        self.gpu_poll_interval = gpu_poll_interval
        self.gpu: GpuSampler | None = None
        self.cpu: cpus.CpuMeter | None = None
        #: one value (0-1) per logging interval
        self.gpu_util = array("d")
        self.cpu_util = array("d")

    def start(self, device: torch.device) -> str | None:
        """Start measuring for training on ``device``; returns why the GPU is not measured when on CUDA it is not."""
        self.cpu = cpus.CpuMeter()
        if device.type != "cuda":
            return None
        found = nvml_handles(device.index if device.index is not None else torch.cuda.current_device())
        if isinstance(found, str):
            return found
        nvml, handles = found
        self.gpu = GpuSampler(nvml, handles, self.gpu_poll_interval)
        self.gpu.start()
        return None

    def take(self) -> dict[str, float]:
        """The metrics of the interval that ends now: ``loader/gpu_util``, ``loader/gpu_mem_gb``, ``loader/cpu_util``.

        Each is left out when it was not measured.
        """
        metrics: dict[str, float] = {}
        if self.gpu is not None:
            gpu = self.gpu.take()
            if gpu is not None:
                metrics["loader/gpu_util"], metrics["loader/gpu_mem_gb"] = gpu[0] / 100.0, gpu[1]
                self.gpu_util.append(gpu[0] / 100.0)
        if self.cpu is not None:
            cpu = self.cpu.take()
            if cpu is not None:
                metrics["loader/cpu_util"] = cpu / 100.0
                self.cpu_util.append(cpu / 100.0)
        return metrics

    def finish(self) -> None:
        """At the end of fit: with no interval logged (a fit shorter than ``log_every_n_steps``), the CPU over it."""
        if self.cpu is not None and not self.cpu_util:
            cpu = self.cpu.take()
            if cpu is not None:
                self.cpu_util.append(cpu / 100.0)

    def stop(self) -> None:
        """Stop the NVML thread (idempotent)."""
        if self.gpu is not None:
            self.gpu.stop()
