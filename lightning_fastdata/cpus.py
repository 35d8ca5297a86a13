"""How many CPUs this process can really use: affinity, capped by the cgroup CPU quota."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

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


def processes_per_node(world_size: int, num_nodes: int) -> int:
    """Training processes on each node (devices per node under DDP), at least 1."""
    return max(1, world_size // max(1, num_nodes))


def _parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``"0-3,8,10-11"``) as a set of CPU ids; empty when unreadable."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            return set()
    return cpus


def _cgroup_cpuset(root: Path) -> set[int]:
    """The CPUs this cgroup (the container, the batch job) may run on: cgroup v2, then v1; empty when unknown."""
    for path in ("cpuset.cpus.effective", "cpuset/cpuset.effective_cpus", "cpuset/cpuset.cpus"):
        text = _read(root / path)
        if text:
            return _parse_cpu_list(text)
    return set()


def _slurm_tasks_per_node() -> int:
    """Tasks per node of this SLURM job (``SLURM_NTASKS_PER_NODE``, or the first count of ``SLURM_TASKS_PER_NODE``)."""
    text = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    digits = text.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else 0


def pinned_to_own_cpus(processes: int, cgroup_root: str | os.PathLike[str] = _CGROUP_ROOT) -> bool:
    """Whether a launcher pinned this process to its own share of the node's CPUs (then it is not shared again).

    SLURM ``--cpus-per-task`` with CPU binding and ``numactl`` / ``taskset`` per rank give each training process an
    affinity of its own; dividing that by the processes per node would count the other ranks twice. Without talking
    to the other ranks this is known when:

    - SLURM runs one task per training process (``SLURM_NTASKS_PER_NODE`` >= ``processes``) and the affinity is at
      most ``SLURM_CPUS_PER_TASK`` CPUs: the task's own CPUs (without binding it would be the whole allocation); or
    - the affinity is a strict subset of the CPUs the cgroup may use (``cpuset.cpus.effective``; the host's CPUs
      when unknown) and ``processes`` such shares fit in them: ranks inheriting one affinity (``docker --cpuset-cpus``,
      a plain ``taskset`` of the launcher) have an affinity equal to the cgroup's CPUs, or too large to be a share.

    Args:
        processes: training processes on this node.
        cgroup_root: where the cgroup file system is mounted.

    """
    if processes <= 1 or not hasattr(os, "sched_getaffinity"):
        return False
    affinity = os.sched_getaffinity(0)
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and _slurm_tasks_per_node() >= processes and len(affinity) <= int(per_task):
        return True
    pool = _cgroup_cpuset(Path(cgroup_root)) or set(range(os.cpu_count() or len(affinity)))
    return affinity < pool and len(affinity) * processes <= len(pool)


def cpu_sharing_processes(processes: int, cgroup_root: str | os.PathLike[str] = _CGROUP_ROOT) -> int:
    """The training processes that share this process's usable CPUs: ``processes``, or 1 when pinned to its own."""
    return 1 if pinned_to_own_cpus(processes, cgroup_root) else max(1, processes)


def worker_budget(world_size: int = 1, num_nodes: int = 1) -> int:
    """Loader workers per training process that the usable CPUs allow: usable CPUs // processes sharing them.

    The processes sharing them are the training processes on this node (``world_size / num_nodes``), or only this
    one when a launcher pinned each rank to its own CPUs (see :func:`pinned_to_own_cpus`).
    """
    return usable_cpu_count() // cpu_sharing_processes(processes_per_node(world_size, num_nodes))


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


class CpuMeter:
    """CPU time of this process and its descendants (DataLoader workers), as a share of the usable CPUs.

    Listing the descendants scans ``/proc``, so the list is refreshed at most every ``refresh_s`` seconds, and at the
    next reading after one has gone; reading the listed processes' times is cheap
    (docs/benchmarks.md#cpu-meter-the-process-list-refreshed-not-read-each-time).
    A process found at a later listing started after the previous one, so all its CPU time counts (none of it was
    counted before); one running when the meter starts counts from then on. A process that exits loses its time
    since the last reading.

    Args:
        refresh_s: seconds between listings of the descendants.

    """

    def __init__(self, refresh_s: float = 1.0) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            self._proc = None
        else:
            self._proc = psutil.Process(os.getpid())
        self._cpus = usable_cpu_count()
        self._refresh_s = refresh_s
        self._listed_at = -math.inf  # perf_counter of the last listing
        #: pid -> (process, its CPU seconds at the last reading)
        self._children: dict[int, tuple[Any, float]] = {}
        self._own = self._seconds(self._proc) if self._proc is not None else 0.0
        if self._proc is not None:
            self._list(first=True)
        self._last = time.perf_counter()

    @staticmethod
    def _seconds(proc: Any) -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    def _list(self, first: bool = False) -> None:
        """List the descendants again: new ones count from their start (or, at the ``first`` listing, from now)."""
        assert self._proc is not None
        try:
            found = self._proc.children(recursive=True)
        except Exception:
            found = []
        for proc in found:
            if proc.pid in self._children:
                continue
            try:
                seconds = self._seconds(proc) if first else 0.0
            except Exception:  # it exited meanwhile
                continue
            self._children[proc.pid] = (proc, seconds)
        self._listed_at = time.perf_counter()

    def _used(self) -> float:
        """CPU seconds this process and its descendants used since the last reading."""
        assert self._proc is not None
        if time.perf_counter() - self._listed_at >= self._refresh_s:
            self._list()
        own = self._seconds(self._proc)
        used, self._own = own - self._own, own
        for pid, (proc, before) in list(self._children.items()):
            try:
                seconds = self._seconds(proc)
            except Exception:  # it exited: list again at the next reading
                del self._children[pid]
                self._listed_at = -math.inf
                continue
            used += seconds - before
            self._children[pid] = (proc, seconds)
        return used

    def take(self) -> float | None:
        """Mean CPU use (% of the usable CPUs) since the last call."""
        if self._proc is None:
            return None
        used = self._used()
        now = time.perf_counter()
        then, self._last = self._last, now
        if now <= then:
            return None
        # Clamped: CPU time cannot exceed wall time x usable CPUs; a reading above that is the meter's own artefact
        # (a process found at a refresh brings CPU time from before the interval with it).
        return min(100.0, max(0.0, 100.0 * used / ((now - then) * self._cpus)))
