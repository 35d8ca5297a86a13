"""How many CPUs this process can really use: affinity, capped by the cgroup CPU quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: str | os.PathLike[str] = _CGROUP_ROOT) -> float | None:
    """The CPU quota of this cgroup in CPUs (``1.5`` = one and a half), or ``None`` when unlimited or unknown.

    Reads cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) and, failing that, cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1`` is unlimited).
    """
    root = Path(root)
    v2 = _read(root / "cpu.max")
    if v2:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        quota_text, period_text = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            continue
        try:
            quota, period = int(quota_text), int(period_text)
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpu_count(cgroup_root: str | os.PathLike[str] = _CGROUP_ROOT) -> int:
    """The CPUs this process may use: its CPU affinity, capped by the cgroup quota (rounded up), at least 1.

    ``os.cpu_count()`` reports the host's CPUs, which overcounts inside containers, under ``taskset`` and on
    shared nodes; this does not.
    """
    count = _affinity_count()
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)
