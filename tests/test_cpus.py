from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fastdata import cpus
from lightning_fastdata.cpus import CpuMeter, cgroup_cpu_quota, usable_cpu_count


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _v2(root: Path, cpu_max: str) -> Path:
    _write(root / "cpu.max", cpu_max)
    return root


def _v1(root: Path, quota: str, period: str = "100000", folder: str = "cpu") -> Path:
    _write(root / folder / "cpu.cfs_quota_us", quota)
    _write(root / folder / "cpu.cfs_period_us", period)
    return root


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("150000 100000", 1.5),
        ("400000 100000", 4.0),
        ("50000 100000", 0.5),
        ("max 100000", None),
        ("max", None),
        ("abc 100000", None),
        ("0 100000", None),
        ("100000 0", None),
    ],
)
def test_cgroup_v2_quota(tmp_path, cpu_max, expected):
    """cgroup v2 ``cpu.max`` gives quota/period in CPUs; ``max`` and unusable values mean no quota."""
    assert cgroup_cpu_quota(_v2(tmp_path, cpu_max)) == expected


@pytest.mark.parametrize(
    ("quota", "period", "expected"),
    [("200000", "100000", 2.0), ("250000", "100000", 2.5), ("-1", "100000", None), ("x", "100000", None)],
)
def test_cgroup_v1_quota(tmp_path, quota, period, expected):
    """cgroup v1 ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; ``-1`` means unlimited."""
    assert cgroup_cpu_quota(_v1(tmp_path, quota, period)) == expected


@pytest.mark.parametrize("folder", ["cpu,cpuacct", "."])
def test_cgroup_v1_other_mount_points(tmp_path, folder):
    """The v1 files are also found under ``cpu,cpuacct`` or directly in the root."""
    assert cgroup_cpu_quota(_v1(tmp_path, "300000", folder=folder)) == 3.0


def test_cgroup_v2_takes_precedence_over_v1(tmp_path):
    """When ``cpu.max`` exists, the v1 files are not consulted."""
    _v1(tmp_path, "300000")
    assert cgroup_cpu_quota(_v2(tmp_path, "max 100000")) is None
    assert cgroup_cpu_quota(_v2(tmp_path, "100000 100000")) == 1.0


def test_no_cgroup_files_means_no_quota(tmp_path):
    """An empty or missing cgroup root gives ``None``."""
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(tmp_path / "missing") is None
    _v1(tmp_path, "200000", period="")  # an incomplete v1 pair is unusable
    assert cgroup_cpu_quota(tmp_path) is None


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "expected"),
    [
        (8, "150000 100000", 2),  # 1.5 CPUs rounds up
        (8, "400000 100000", 4),
        (2, "400000 100000", 2),  # the affinity is the smaller
        (8, "max 100000", 8),
        (8, "10000 100000", 1),  # 0.1 CPU still gives one
        (1, "max 100000", 1),
    ],
)
def test_usable_cpu_count_caps_affinity_by_quota(tmp_path, monkeypatch, affinity, cpu_max, expected):
    """``usable_cpu_count`` is the affinity capped by the quota rounded up, and at least 1."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    assert usable_cpu_count(_v2(tmp_path, cpu_max)) == expected


def test_usable_cpu_count_uses_v1_quota(tmp_path, monkeypatch):
    """The v1 quota caps the count too."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert usable_cpu_count(_v1(tmp_path, "200000")) == 2


def test_usable_cpu_count_without_affinity_uses_cpu_count(tmp_path, monkeypatch):
    """Where ``sched_getaffinity`` does not exist, ``os.cpu_count()`` is the starting point."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cpus._affinity_count() == 6
    assert usable_cpu_count(tmp_path) == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpu_count(tmp_path) == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")
def test_usable_cpu_count_on_this_machine():
    """On the real machine the count is between 1 and the affinity."""
    count = usable_cpu_count()
    assert 1 <= count <= len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------------------------------------------
# Ranks pinned to their own CPUs (SLURM binding, numactl / taskset per rank)
# ----------------------------------------------------------------------------------------------------------------

_SLURM_VARS = ("SLURM_CPUS_PER_TASK", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A 32-CPU node: set this process's affinity with ``node(cpus, cpuset=...)``; no SLURM variables, no quota."""
    for name in _SLURM_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 32)

    def configure(affinity, cpuset="0-31"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
        root = tmp_path / "cgroup"
        if cpuset is not None:
            _write(root / "cpuset.cpus.effective", cpuset)
        return root

    return configure


@pytest.mark.parametrize(
    ("affinity", "cpuset", "processes", "pinned"),
    [
        (range(8, 16), "0-31", 4, True),  # numactl / taskset per rank: a quarter of the node each
        (range(32), "0-31", 4, False),  # every rank sees the whole node: shared
        (range(8), "0-7", 2, False),  # docker --cpuset-cpus=0-7: both ranks inherit the container's CPUs
        (range(8), None, 2, True),  # no cpuset file: the host's CPUs (os.cpu_count) are the pool
        (range(20), "0-31", 2, False),  # larger than a share: inherited, not pinned
        (range(8), "0-31", 1, False),  # one process: nothing to share
        ([0, 1], "0-3,8-11", 4, True),  # the kernel's list syntax
    ],
)
def test_pinned_to_own_cpus_from_affinity_and_cpuset(node, affinity, cpuset, processes, pinned):
    """An affinity that is a strict subset of the cgroup's CPUs, small enough to be one rank's share, is pinned."""
    root = node(affinity, cpuset)
    assert cpus.pinned_to_own_cpus(processes, root) is pinned
    assert cpus.cpu_sharing_processes(processes, root) == (1 if pinned else processes)


@pytest.mark.parametrize(
    ("env", "affinity", "pinned"),
    [
        ({"SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "4"}, range(8), True),  # srun --cpu-bind
        ({"SLURM_CPUS_PER_TASK": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}, range(8), True),
        ({"SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "4"}, range(32), False),  # no binding: whole job
        ({"SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "1"}, range(8), False),  # one task, ranks spawned
    ],
)
def test_pinned_to_own_cpus_under_slurm(node, monkeypatch, env, affinity, pinned):
    """Under SLURM, one task per rank with an affinity of at most ``--cpus-per-task`` CPUs is that task's own share.

    The cgroup is the task's own (SLURM's task/cgroup plugin), so the cpuset alone cannot tell.
    """
    root = node(affinity, cpuset=f"0-{max(affinity)}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpus.pinned_to_own_cpus(4, root) is pinned


def test_datamodule_budget_is_not_divided_twice_for_pinned_ranks(node, monkeypatch):
    """4 ranks pinned to 8 CPUs each of a 32-CPU node get 8 workers each, not 8 / 4 = 2."""
    from unittest.mock import Mock

    from lightning_fastdata import FastImageDataModule

    root = node(range(8, 16))
    cpuset = cpus._cgroup_cpuset
    monkeypatch.setattr(cpus, "_cgroup_cpuset", lambda _root: cpuset(root))  # the default root is the real one
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda *args: None)
    dm = FastImageDataModule("unused")
    dm.trainer = Mock(world_size=4, num_nodes=1)
    assert dm.worker_budget() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert dm.worker_budget() == 8  # every rank sees the whole node: 32 CPUs shared by 4


_BURN = (
    "import sys, time\n"
    "end = time.process_time() + float(sys.argv[1])\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "print('done', flush=True)\n"
    "sys.stdin.read()\n"
)


def _burning_child(cpu_seconds: float) -> subprocess.Popen[str]:
    """A child process that uses ``cpu_seconds`` of CPU, says ``done``, then idles until its stdin closes."""
    return subprocess.Popen(
        [sys.executable, "-c", _BURN, str(cpu_seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_cpu_meter_counts_workers_that_start_after_it():
    """Worker processes started after the meter (persistent DataLoader workers) are in the next reading."""
    meter = CpuMeter(refresh_s=0.0)
    start = time.perf_counter()
    child = _burning_child(0.5)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "done"
        share = meter.take()
        elapsed = time.perf_counter() - start
    finally:
        child.communicate(timeout=30)
    assert share is not None
    # CPU time is measured, not estimated: the child's 0.5 s are in, whatever the load on the machine
    assert share >= 0.9 * 100 * 0.5 / (elapsed * usable_cpu_count())


def test_cpu_meter_counts_a_running_worker_from_when_it_was_first_seen():
    """A process that ran before the meter existed counts only its CPU time from then on, not its whole history."""
    child = _burning_child(0.5)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "done"
        meter = CpuMeter(refresh_s=0.0)
        time.sleep(0.2)
        share = meter.take()
    finally:
        child.communicate(timeout=30)
    assert share is not None
    assert share < 100 * 0.25 / (0.2 * usable_cpu_count())  # well below its 0.5 s burn
