"""Tests for ``lightning_fastdata.pipeline.processes``: the process engine's faults, with its batches in shared slots.

Trainings run in child processes, each in its own mount and PID namespace (``unshare``) with a private tmpfs on
``/dev/shm``: what is left there afterwards, and which processes are still alive, is exactly what that training left.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
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
from workers import put_tasks

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


def _broken_receive(monkeypatch: pytest.MonkeyPatch, seen_alive: int) -> tuple[Any, int]:
    """An iterator whose only worker dies while its batch is being received: the fetch of the batch's file descriptors
    fails with ConnectionResetError, and the worker still looks alive the first ``seen_alive`` times (not killed for
    real: torch's SIGCHLD handler would raise its own error first, on whatever line the test is at)."""
    loader = FastLoader(_Numbers(), batch_size=4, num_workers=1)
    iterator = iter(loader)
    worker = iterator._workers[0]
    looks = iter([True] * seen_alive)
    monkeypatch.setattr(worker, "is_alive", lambda: next(looks, False))

    def reset(*args: Any, **kwargs: Any) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(iterator._data_queue, "get", reset)
    # the worker is alive: left to torch's shutdown (a worker marked unavailable mid-epoch exits with an assertion)
    monkeypatch.setattr(iterator, "_mark_worker_as_unavailable", lambda worker_id, shutdown=False: None)
    return iterator, worker.pid


def test_a_worker_dying_as_its_batch_is_received_is_named_not_a_connection_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch looks for dead workers at once after the failed fetch, when the killed worker may still look alive: the
    iterator waits for it and raises torch's RuntimeError naming it (the kill test above raced)."""
    iterator, pid = _broken_receive(monkeypatch, seen_alive=5)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {pid}\) exited unexpectedly") as info:
        next(iterator)
    assert isinstance(info.value.__cause__, ConnectionResetError)
    iterator._shutdown_workers()


def test_a_connection_reset_without_a_dead_worker_is_raised_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken connection whose worker stays alive is not blamed on a worker: after the grace period it is raised."""
    monkeypatch.setattr(processes, "DEATH_GRACE_S", 0.2)
    iterator, _ = _broken_receive(monkeypatch, seen_alive=10**6)
    with pytest.raises(ConnectionResetError):
        iterator._try_get_data()
    iterator._shutdown_workers()


def test_a_recording_profiler_still_sees_each_fetch_from_the_workers() -> None:
    """The worker-process iterator leaves torch's profiler range out only while nothing records: under
    ``torch.profiler`` (Lightning's PyTorchProfiler) every fetch is there as torch names it, and the batches are the
    same either way."""
    loader = FastLoader(_Numbers(), batch_size=16, num_workers=1)
    plain = [batch.clone() for batch in loader]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = [batch.clone() for batch in loader]
    names = [event.name for event in prof.events()]
    fetches = [name for name in names if name == "enumerate(DataLoader)#WorkerIterator.__next__"]
    # 4 batches and the call that ends the epoch
    assert len(fetches) == 5, sorted(set(names))
    assert (
        [b.tolist() for b in plain]
        == [b.tolist() for b in profiled]
        == [[[i] * 4 for i in range(k, k + 16)] for k in range(0, 64, 16)]
    )


def test_the_training_process_writes_each_task_to_its_workers_without_a_feeder_thread() -> None:
    """Each worker's index queue takes its tasks straight into the pipe, and the results come back through a
    :class:`ResultQueue`: no queue feeder thread runs in the training process, over two epochs of persistent
    workers, and every batch arrives, in order."""
    loader = FastLoader(_Numbers(), batch_size=8, num_workers=2, persistent_workers=True)
    for _ in range(2):
        batches = [batch.clone() for batch in loader]
        assert [b.tolist() for b in batches] == [[[i] * 4 for i in range(k, k + 8)] for k in range(0, 64, 8)]
    queues = [*loader._iterator._index_queues, loader._iterator._worker_result_queue]
    assert [type(q) for q in queues] == [processes.TaskQueue, processes.TaskQueue, processes.ResultQueue]
    assert [q._thread for q in queues] == [None] * 3


def _queue(kind: type) -> Any:
    mp_queue = multiprocessing.get_context("fork").Queue()
    processes.watched(mp_queue, kind)
    assert type(mp_queue) is kind
    return mp_queue


def _put_all(index_queue: Any, tasks: list[Any]) -> None:
    """Put ``tasks`` on a thread that must finish at once: nothing reads the queue meanwhile."""
    putter = threading.Thread(target=lambda: [index_queue.put(task) for task in tasks], daemon=True)
    putter.start()
    putter.join(timeout=30)
    assert not putter.is_alive(), "put blocked"


def test_a_task_too_large_for_one_pipe_write_goes_to_the_feeder_and_so_do_the_later_ones() -> None:
    """A task over ``PIPE_BUF`` is left to the queue's feeder thread, and every task after it too: the order holds."""
    index_queue = _queue(processes.TaskQueue)
    tasks = [(0, [1, 2]), (1, list(range(5000))), (2, [3])]
    _put_all(index_queue, tasks[:1])
    assert index_queue._thread is None
    _put_all(index_queue, tasks[1:])
    assert index_queue._thread is not None
    assert [index_queue.get(timeout=10) for _ in tasks] == tasks
    index_queue.close()
    index_queue.join_thread()


def test_a_full_pipe_never_blocks_the_training_process() -> None:
    """With a worker that stopped reading, the tasks that find its pipe full go to the feeder thread (as every
    ``multiprocessing.Queue`` put does) instead of blocking the caller; read again, they all come out in order."""
    index_queue = _queue(processes.TaskQueue)
    tasks = [(i, [i] * 1000) for i in range(100)]  # 2 KB each: 200 KB, far over a pipe's 64 KB
    _put_all(index_queue, tasks)
    assert index_queue._thread is not None
    assert [index_queue.get(timeout=10) for _ in tasks] == tasks
    index_queue.close()
    index_queue.join_thread()


def test_a_write_lock_left_taken_never_blocks_the_training_process() -> None:
    """A process that died holding the queue's write lock (killed as it wrote) leaves it taken: the task goes to the
    feeder thread, as ``multiprocessing.Queue.put`` would, and arrives once the lock is free."""
    index_queue = _queue(processes.TaskQueue)
    index_queue._wlock.acquire()
    _put_all(index_queue, [(0, [1])])
    assert index_queue._thread is not None
    with pytest.raises(queue.Empty):
        index_queue.get(timeout=0.2)
    index_queue._wlock.release()
    assert index_queue.get(timeout=10) == (0, [1])
    index_queue.close()
    index_queue.join_thread()


def test_waiting_on_an_empty_result_queue_times_out_as_multiprocessing_queue_does() -> None:
    """``get`` with a timeout waits that long for nothing, then raises ``queue.Empty`` (torch's cue to look for dead
    workers); a result put meanwhile is returned."""
    results = _queue(processes.ResultQueue)
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        results.get(timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 10
    threading.Timer(0.2, results.put, args=((7, "late"),)).start()
    assert results.get(timeout=30) == (7, "late")
    with pytest.raises(queue.Empty):
        results.get(block=False)
    results.close()
    results.join_thread()


def test_a_task_queue_sent_to_a_spawned_process_writes_its_tasks_there_too() -> None:
    """A :class:`TaskQueue` made as one crosses to another process as one (its pipe watched again there): the tasks
    it writes there arrive."""
    index_queue = processes.TaskQueue(ctx=multiprocessing.get_context("spawn"))
    tasks = [(0, [1, 2]), (1, [3])]
    child = multiprocessing.get_context("spawn").Process(target=put_tasks, args=(index_queue, tasks))
    child.start()
    assert [index_queue.get(timeout=60) for _ in tasks] == tasks
    child.join(timeout=60)
    assert child.exitcode == 0


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
