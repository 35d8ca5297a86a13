"""Tests for ``lightning_fastdata.pipeline.processes``: the process engine's faults, with its batches in shared slots.

Trainings run in child processes, each in its own mount and PID namespace (``unshare``) with a private tmpfs on
``/dev/shm``: what is left there afterwards, and which processes are still alive, is exactly what that training left.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fastdata.pipeline import processes
from lightning_fastdata.pipeline.factory import FastLoader

#: a training on worker processes that can end in several ways: ``finish``, ``exception`` (in ``training_step``),
#: ``sigint`` (Ctrl-C to its process group) or ``sigkill`` (of the training process alone), sent by the wrapper below
_TRAIN = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning_fastdata import FastImageDataModule

    db, cache, how, image_size, batch_size, epochs = sys.argv[1:7]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a shell's `&` job ignores it)

    class Net(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, index):
            if index == 1:
                maps = open("/proc/self/maps").read()
                print("TRAINING", "memfd" if "memfd:lightning_fastdata-slots" in maps else "no-memfd", flush=True)
            if how == "exception" and index == 2:
                raise ValueError("boom in training_step")
            if how in ("sigint", "sigkill"):
                time.sleep(0.05)
            return self.layer(batch[0].float().mean((2, 3))).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = FastImageDataModule(
        db, cache_dir=cache, image_size=int(image_size), batch_size=int(batch_size), num_workers=2,
        engine="processes", val_fraction=0,
    )
    trainer = Trainer(
        accelerator="cpu", max_epochs=int(epochs), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Net(), dm)
    print("FINISHED", trainer.global_step, flush=True)
    """
)

#: runs inside the namespaces: a fresh tmpfs on /dev/shm, the training, the signal, then waits until no Python
#: process is left (workers notice a dead parent within seconds) and lists what /dev/shm still holds
_WRAPPER = textwrap.dedent(
    """
    mount -t tmpfs -o size="$SHM_SIZE" tmpfs /dev/shm || exit 97
    setsid "$@" >> "$OUT" 2>&1 &
    child=$!
    if [ "$HOW" = sigint ] || [ "$HOW" = sigkill ]; then
        for i in $(seq 1200); do grep -q TRAINING "$OUT" && break; sleep 0.1; done
        if [ "$HOW" = sigint ]; then kill -INT -"$child"; else kill -KILL "$child"; fi
    fi
    wait "$child"
    echo "EXIT $?" >> "$OUT"
    alive() {  # processes of this namespace running Python, this shell aside (its arguments name python)
        n=0
        for d in /proc/[0-9]*; do
            [ "${d#/proc/}" = "$$" ] && continue
            case "$(tr '\\000' '\\n' < "$d/cmdline" 2>/dev/null | head -n 1)" in *python*) n=$((n + 1));; esac
        done
        echo "$n"
    }
    for i in $(seq 600); do
        left=$(alive)
        [ "$left" = 0 ] && break
        sleep 0.1
    done
    echo "LEFT $left" >> "$OUT"
    echo "SHM [$(ls -A /dev/shm | tr '\\n' ' ')]" >> "$OUT"
    echo "SHM-USED-KB $(df -k /dev/shm | awk 'NR == 2 {print $3}')" >> "$OUT"
    """
)


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _namespaces_work(), reason="needs `unshare` with user, mount and PID namespaces (a private /dev/shm)"
)


def _train(
    tmp_path: Path,
    db: Path,
    how: str,
    shm_size: str = "64m",
    image_size: int = 32,
    batch_size: int = 4,
    epochs: int = 9,
) -> str:
    """The training's output, then ``EXIT <code>``, ``LEFT <python processes>``, ``SHM [<entries>]`` and its use."""
    args = (str(db), str(tmp_path / "cache"), how, str(image_size), str(batch_size), str(epochs))
    return _in_private_shm(tmp_path, _TRAIN, *args, how=how, shm_size=shm_size)


def _in_private_shm(tmp_path: Path, code: str, *args: str, how: str = "finish", shm_size: str = "64m") -> str:
    """``python -c code args`` in its own namespaces with a ``shm_size`` tmpfs on ``/dev/shm`` (see ``_WRAPPER``)."""
    out = tmp_path / "out.txt"
    command = [
        *("unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc"),
        *("sh", "-c", _WRAPPER, "wrapper", sys.executable, "-c", code, *args),
    ]
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOW": how, "OUT": str(out), "SHM_SIZE": shm_size}
    # the repository, then the caller's PYTHONPATH: where the installed packages may be (`pip install --target`)
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    subprocess.run(command, env=env, timeout=300, check=False)
    return out.read_text()


@pytest.fixture(scope="module")
def train_db(make_database: Callable[..., Path]) -> Path:
    """128 small photos in 2 classes: two batches of 64."""
    return make_database(
        "processes_db", short_side=64, num_classes=2, train_per_class=64, val_per_class=0, min_size=40, max_size=80
    )


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize("how", ["exception", "sigint", "sigkill"])
def test_no_shared_memory_is_left_behind_however_training_ends(tmp_path: Path, train_db: Path, how: str) -> None:
    """An exception in ``training_step``, Ctrl-C and a SIGKILL of the training process each end a training on
    worker processes with batch slots in use; afterwards no process of it is alive and ``/dev/shm`` is empty."""
    out = _train(tmp_path, train_db, how)
    assert "TRAINING memfd" in out, out  # the batch slots were in use when it ended
    assert "FINISHED" not in out, out
    assert re.search(r"^EXIT [1-9]\d*$", out, re.MULTILINE), out
    if how == "exception":
        assert "ValueError: boom in training_step" in out, out
    assert "LEFT 0" in out, out
    assert "SHM []" in out, out


@pytest.mark.slow
@needs_namespaces
def test_a_64_mib_dev_shm_trains_with_slots_far_larger(tmp_path: Path, train_db: Path) -> None:
    """Docker's default 64 MiB /dev/shm: float batches of 64 at 224 px need 16 slots of 38 MiB, none of it there."""
    out = _train(tmp_path, train_db, "finish", shm_size="64m", image_size=224, batch_size=64, epochs=2)
    assert "TRAINING memfd" in out, out
    assert "FINISHED 4" in out, out  # 2 epochs of 2 batches
    assert "EXIT 0" in out, out
    used_kb = int(re.search(r"SHM-USED-KB (\d+)", out).group(1))  # type: ignore[union-attr]
    assert used_kb < 1024, out
    assert "Bus error" not in out, out


#: an epoch on worker processes whose every batch the loop keeps: most miss a slot and are built in fresh memory;
#: each is compared with a fresh read of its sample, in this process
_KEEP_EVERY_BATCH = textwrap.dedent(
    """
    import sys
    import torch
    from lightning_fastdata import LmdbImageDataset
    from lightning_fastdata.pipeline import BatchReader, KeyedIndices, create_loader
    from lightning_fastdata.transforms import RandomResizedCropFlip

    dataset = LmdbImageDataset(sys.argv[1], transform=RandomResizedCropFlip(int(sys.argv[2])))
    loader = create_loader(dataset, 1, shuffle=True, seed=5, engine="processes", workers=2, output="uint8")
    kept = list(loader)
    print("KEPT", len(kept), "MISSES", loader.slot_misses, flush=True)
    reader = BatchReader(dataset, output="uint8")
    for (images, labels), index in zip(kept, loader.sampler, strict=True):
        want_images, want_labels = reader.read_batch(KeyedIndices([index], (5, 0)))
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels), index
    print("SAME", flush=True)
    """
)


@pytest.mark.slow
@needs_namespaces
def test_batches_that_miss_a_slot_need_no_dev_shm(tmp_path: Path, train_db: Path) -> None:
    """A loop keeping every batch of an epoch runs the slots out: the batches built in fresh memory go to the training
    process as memfds too, so a 256 KiB /dev/shm (2 MiB of batches) is enough, and they hold the right samples."""
    out = _in_private_shm(tmp_path, _KEEP_EVERY_BATCH, str(train_db), "64", shm_size="256k")
    assert "KEPT 128 MISSES 112" in out, out  # 16 slots: 112 batches of 12 KiB in fresh memory
    assert "SAME" in out, out
    assert "EXIT 0" in out, out
    assert "SHM []" in out, out


_KILL_MID_BATCH = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from lightning_fastdata import FastImageDataModule, LmdbImageDataset

    def kill_in_a_worker(index):
        if index == 5 and torch.utils.data.get_worker_info() is not None:  # a worker, part-way into a batch
            os.kill(os.getpid(), signal.SIGKILL)

    class PerSample(LmdbImageDataset):  # overrides __getitem__: the per-sample path, batches in PyTorch's memory
        def __getitem__(self, index):
            kill_in_a_worker(index)
            return super().__getitem__(index)

    class IntoSlots(LmdbImageDataset):  # keeps __getitem__ and decode: the fused path, into batch slots
        def decode_hwc(self, index, *args, **kwargs):
            kill_in_a_worker(index)
            return super().decode_hwc(index, *args, **kwargs)

    class KillingModule(FastImageDataModule):
        def build_dataset(self, split, transform):
            dataset = IntoSlots if sys.argv[3] == "slots" else PerSample
            return dataset(self.database_path, split=split, transform=transform)

    dm = KillingModule(sys.argv[1], cache_dir=sys.argv[2], image_size=32, batch_size=4, num_workers=2, val_fraction=0,
                      engine="processes")
    loader = dm.train_dataloader()
    print("FUSED", loader.dataset.fused, flush=True)
    try:
        for epoch in range(3):
            for batch in loader:
                pass
    except RuntimeError as err:
        print(f"RAISED {type(err).__name__}: {err}", flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["slots", "per-sample"])
def test_a_worker_killed_mid_batch_raises_naming_it(tmp_path: Path, train_db: Path, path: str) -> None:
    """A worker dying of SIGKILL part-way into a batch (into its slot, or on the per-sample path) makes iteration
    raise a RuntimeError naming the worker by its pid, within a timeout: never a hang."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_MID_BATCH, str(train_db), str(tmp_path / "cache"), path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert f"FUSED {path == 'slots'}" in out, out
    assert proc.returncode == 3, out
    named = r"RAISED RuntimeError: DataLoader worker \(pid.*(killed by signal: Killed|exited unexpectedly)"
    assert re.search(named, out), out


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), index)


def _numbers(start: int, stop: int, size: int) -> list[list[list[int]]]:
    return [[[i] * 4 for i in range(k, k + size)] for k in range(start, stop, size)]


def test_persistent_workers_serve_every_epoch_in_order_without_a_thread_in_the_training_process() -> None:
    """The loader's own worker pool keeps its processes across epochs, returns every batch in order, and the
    training process writes tasks and reads results itself: no queue feeder or pin-memory thread starts."""
    threads = threading.active_count()
    loader = FastLoader(_Numbers(), batch_size=8, num_workers=2, persistent_workers=True)
    pools = []
    for _ in range(2):
        batches = [batch.clone() for batch in loader]
        assert [b.tolist() for b in batches] == _numbers(0, 64, 8)
        pools.append(loader._iterator)
        assert threading.active_count() == threads
    assert isinstance(pools[0], processes.WorkerPool)
    assert pools[0] is pools[1]
    assert pools[0].running
    pids = pools[0].pids
    loader._iterator = None  # what Lightning's teardown does: the workers stop with the pool
    del pools
    for pid in pids:
        assert _gone(pid), pid


def _gone(pid: int | None, within: float = 30) -> bool:
    assert pid is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        time.sleep(0.05)
    return False


def test_workers_without_persistence_stop_with_their_epoch() -> None:
    """``persistent_workers=False``: each epoch starts its own workers, and they are gone when the epoch ends, even
    one left part-way."""
    loader = FastLoader(_Numbers(), batch_size=8, num_workers=2, persistent_workers=False)
    epoch = iter(loader)
    assert next(epoch).tolist() == _numbers(0, 8, 8)[0]
    children = multiprocessing.active_children()
    assert len(children) >= 2
    del epoch
    assert all(_gone(child.pid) for child in children)
    assert loader._iterator is None
    assert [b.tolist() for b in loader] == _numbers(0, 64, 8)


def test_an_epoch_left_part_way_is_drained_before_the_next_one() -> None:
    """A loop that stops part-way leaves tasks in flight: the next epoch of the same workers drops their results
    and starts from its first batch."""
    loader = FastLoader(_Numbers(), batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=3)
    epoch = iter(loader)
    assert [next(epoch).tolist() for _ in range(2)] == _numbers(0, 8, 4)
    assert [b.tolist() for b in loader] == _numbers(0, 64, 4)
    with pytest.raises(StopIteration):  # the earlier epoch ended when the next one started
        next(epoch)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_workers_start_in_the_loaders_context_seeded_and_told_who_they_are_as_torchs(method: str) -> None:
    """Workers start with the loader's ``multiprocessing_context``; in each, ``get_worker_info()`` names it, and
    :mod:`random`, NumPy and torch are seeded as torch's own DataLoader workers seed them: the same samples."""
    from workers import WorkerFacts

    def facts(loader: torch.utils.data.DataLoader) -> list[list[Any]]:
        torch.manual_seed(7)  # the workers' base seed is drawn from torch's generator
        return [[list(map(float, column)) for column in batch] for batch in loader]

    ours = FastLoader(WorkerFacts(), batch_size=2, num_workers=2, multiprocessing_context=method)
    torchs = torch.utils.data.DataLoader(WorkerFacts(), batch_size=2, num_workers=2, multiprocessing_context=method)
    got = facts(ours)
    assert [batch[0] for batch in got] == [[0.0, 0.0], [1.0, 1.0]] * 2  # worker ids, in turn
    assert [batch[1] for batch in got] == [[2.0, 2.0]] * 4
    assert got == facts(torchs)


def _failing_init(worker_id: int) -> None:
    raise ValueError(f"init of worker {worker_id} failed")


class _Failing(_Numbers):
    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 10:
            raise KeyError(f"sample {index}")
        return super().__getitem__(index)


def test_a_workers_exception_is_raised_with_its_type_and_traceback_and_the_workers_go_on() -> None:
    """An exception in a worker comes back as torch's DataLoader raises it (its type, the worker's traceback in the
    message); the workers keep running, and the next epoch is whole."""
    loader = FastLoader(_Failing(), batch_size=4, num_workers=2, persistent_workers=True)
    with pytest.raises(KeyError, match=r"Caught KeyError in DataLoader worker process 0(.|\n)*sample 10"):
        list(loader)
    with pytest.raises(KeyError):
        list(loader)
    with pytest.raises(ValueError, match="init of worker 0 failed"):
        list(FastLoader(_Numbers(), batch_size=4, num_workers=2, worker_init_fn=_failing_init))


class _Slow(_Numbers):
    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(3)
        return super().__getitem__(index)


def test_a_result_later_than_timeout_raises_and_stops_the_workers() -> None:
    """The DataLoader's ``timeout``: no result within it is an error naming it, not a hang."""
    loader = FastLoader(_Slow(), batch_size=1, num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 seconds"):
        next(iter(loader))


def test_a_worker_killed_while_its_batch_is_awaited_is_named_with_its_signal() -> None:
    """A worker killed while the training process waits for its batch: its sentinel wakes the wait, and the error
    names its pid, its place and the signal; the other worker is stopped too, and the next epoch starts new ones."""
    loader = FastLoader(_Slow(), batch_size=1, num_workers=2, persistent_workers=True)
    epoch = iter(loader)
    pool = None
    deadline = time.monotonic() + 60
    while pool is None and time.monotonic() < deadline:  # the first task goes out with the first `next`
        threading.Timer(1.0, lambda: os.kill(loader._iterator.pids[0], 9)).start()
        try:
            next(epoch)
        except RuntimeError as err:
            pool = err
    pid = re.search(r"pid (\d+)", str(pool)).group(1)  # type: ignore[union-attr]
    assert re.search(
        rf"DataLoader worker \(pid {pid}, worker 0 of 2\) was killed by signal: Killed \(SIGKILL\)", str(pool)
    ), pool
    assert not loader._iterator.running
    assert all(_gone(int(p)) for p in [pid])


def test_a_worker_dying_as_its_batch_is_received_is_named_not_a_connection_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors of a batch are fetched from the worker that made it as it is received: a worker killed meanwhile
    breaks that connection a moment before its death shows. The pool waits for the death and names the worker; a
    broken connection whose worker stays alive is raised as it is, after :data:`DEATH_GRACE_S`."""
    monkeypatch.setattr(processes, "DEATH_GRACE_S", 0.5)
    pool = processes.WorkerPool(_Numbers(), torch.stack, 1)
    connection = pool._results[0]

    class _Broken:
        def recv(self) -> Any:
            connection.recv()
            raise ConnectionResetError(104, "Connection reset by peer")

        def close(self) -> None:
            connection.close()

    pool._results[0] = _Broken()  # type: ignore[assignment]
    with pytest.raises(ConnectionResetError):
        next(pool.run([[1, 2]]))
    pid = pool.pids[0]
    threading.Timer(0.1, lambda: os.kill(pid, 9)).start()  # type: ignore[arg-type]
    monkeypatch.setattr(processes, "DEATH_GRACE_S", 30)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {pid}, worker 0 of 1\) was killed") as info:
        next(pool.run([[3, 4]]))
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert not pool.running


def test_a_shut_down_pool_refuses_to_run() -> None:
    """A pool shut down (or found with a dead worker) says so; shutting it down again does nothing."""
    pool = processes.WorkerPool(_Numbers(), torch.stack, 2)
    assert [b.tolist() for b in pool.run([[0], [1], [2]])] == [[[0] * 4], [[1] * 4], [[2] * 4]]
    pids = pool.pids
    pool.shutdown()
    pool.shutdown()
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.run([[0]])


def test_a_recording_profiler_sees_the_same_batches() -> None:
    """Under ``torch.profiler`` (Lightning's PyTorchProfiler) the worker processes give the same batches."""
    loader = FastLoader(_Numbers(), batch_size=16, num_workers=1)
    plain = [batch.clone() for batch in loader]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = [batch.clone() for batch in loader]
    assert [b.tolist() for b in plain] == [b.tolist() for b in profiled] == _numbers(0, 64, 16)


class _Priorities(torch.utils.data.Dataset):
    """Each sample is the nice value of the process that reads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.parametrize("nice", [0, 7])
def test_worker_nice_lowers_the_worker_processes_priority_only(nice: int) -> None:
    """``worker_nice`` raises each worker process's nice value by that much; the training process keeps its own."""
    from lightning_fastdata.pipeline import create_loader

    own = os.getpriority(os.PRIO_PROCESS, 0)
    loader = create_loader(_Priorities(), 2, engine="processes", workers=2, output=None, worker_nice=nice)
    seen = {int(value) for batch in loader for value in batch}
    assert seen == {min(19, own + nice)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
    del loader


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True])
def test_worker_nice_outside_0_to_19_is_refused(bad: Any) -> None:
    """A nice increment outside 0-19 is an error naming ``worker_nice``, from the loader and the DataModule."""
    from lightning_fastdata import FastImageDataModule
    from lightning_fastdata.pipeline import create_loader

    with pytest.raises(ValueError, match="`worker_nice` must be an int from 0"):
        create_loader(_Priorities(), 2, engine="processes", workers=1, output=None, worker_nice=bad)
    with pytest.raises(ValueError, match="`worker_nice` must be an int from 0"):
        FastImageDataModule("some/where", worker_nice=bad)


_LARGE = """
import sys
import torch
from lightning_fastdata.pipeline import processes

class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        return index

def collate(items):  # a collate of one's own that returns large non-tensor data
    return bytes(400_000)

pool = processes.WorkerPool(Items(), collate, 1, tasks_ahead=4)
tasks = [list(range(i, i + 8000)) for i in range(20_000, 100_000, 8000)]  # 40 KB each, pickled
print(sum(len(result) for result in pool.run(tasks)))
pool.shutdown()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_large_tasks_and_results_do_not_stall_the_loop(tmp_path: Path) -> None:
    """Tasks of thousands of indices and results over Linux's default 64 KiB pipe (a collate of one's own that
    returns large data): the task pipe full while the worker is blocked writing its result stalled both before the
    pipes were widened; the run ends, with every result."""
    script = tmp_path / "large.py"
    script.write_text(_LARGE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool stalled: the task pipe full while the worker waited to write its result")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(10 * 400_000)
