"""``LoaderMonitor``: is training waiting for data, how much faster could it go, and what should change?

One module per concern: ``callback`` (the Lightning hooks, logging), ``timing`` (fetch, transfer and step from the
actions Lightning reports to ``trainer.profiler``; CUDA events), ``series`` (the per-step series and the means logged
from them), ``usage`` (GPU and CPU utilization per logging interval), ``gpu`` (the NVML sampler),
``verdict`` (summary statistics, verdict, speedup, advice) and ``report`` (the epoch line, the table, the JSON report
and the chart).
"""

from lightning_fastdata.monitor.callback import LoaderMonitor

__all__ = ["LoaderMonitor"]
