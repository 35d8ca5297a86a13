"""Real DDP on CPU: two processes shard ``FastImageDataModule``'s training set with its seeded sampler."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import fake_trainer
from indexed import IndexedDataModule
from kinds import make_kind_database
from lightning.pytorch import Trainer

from lightning_fastdata import FastImageDataModule, convert, cpus, make_image_folder
from lightning_fastdata.errors import DestinationError
from lightning_fastdata.store import ondisk

SCRIPT = Path(__file__).with_name("ddp_script.py")

#: 2 classes x 25 images, no val split: `val_fraction=0.1` holds out 5 and leaves an odd 45 for training
NUM_IMAGES = 50

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture(scope="module")
def ddp_database(make_database: Callable[..., Path]) -> Path:
    """A converted plain ImageFolder of 50 small images in 2 classes."""
    return make_database("ddp", num_classes=2, train_per_class=25, val_per_class=0, min_size=40, max_size=60)


def _run(database: Path, out: Path, seed: int, epochs: int, kind: str = "class") -> list[dict[str, Any]]:
    """Run the DDP script and return the records of rank 0 and rank 1."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(database), str(out), str(seed), str(epochs), kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def two_epochs(ddp_database: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of a two-epoch DDP run with seed 0."""
    return _run(ddp_database, tmp_path_factory.mktemp("ddp_seed0") / "out", seed=0, epochs=2)


@pytest.mark.slow
def test_ddp_shards_cover_the_training_set(two_epochs: list[dict[str, Any]]) -> None:
    """Each epoch, the two ranks together see every training sample once, apart from the sampler's padding."""
    rank0, rank1 = two_epochs
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert (
        rank0["sampler"] == rank1["sampler"] == "ResumableSampler"
    )  # a DistributedSampler subclass that can start mid-epoch
    assert rank0["dtypes"] == rank1["dtypes"] == ["torch.float32"]  # normalized on the device in each process
    train = rank0["train_indices"]
    assert train == rank1["train_indices"]  # the same seeded hold-out split in both processes
    n = len(train)
    assert n == NUM_IMAGES - round(NUM_IMAGES * 0.1)
    assert n % 2 == 1  # odd: the sampler must pad one sample
    for epoch in range(2):
        _assert_cover_once(rank0["epochs"][epoch], rank1["epochs"][epoch], train)


def _assert_cover_once(first: list[int], second: list[int], train: list[int]) -> None:
    """One epoch's indices on rank 0 (``first``) and rank 1 cover ``train`` once: each rank half of the padded set,
    no sample twice within a rank, and the ``DistributedSampler``'s padding the only overlap."""
    n = len(train)
    padded = math.ceil(n / 2) * 2
    assert len(first) == len(second) == padded // 2
    seen = first + second
    assert set(seen) == set(train)
    duplicates = sum(count - 1 for count in Counter(seen).values())
    assert duplicates == padded - n
    assert len(set(first)) == len(first)  # no sample twice within a rank
    assert len(set(second)) == len(second)
    assert len(set(first) & set(second)) == duplicates  # the padding is the only overlap


@pytest.mark.slow
def test_ddp_shards_of_a_multilabel_database_cover_it(tmp_path: Path) -> None:
    """A multi-label database through ``return_index`` batches: the two ranks' indices cover the training set, and
    each batch held its samples' own multi-hot targets (checked in the script)."""
    db = make_kind_database(tmp_path / "ml.lmdb", "multilabel", {"train": NUM_IMAGES}, classes=2)
    rank0, rank1 = _run(db, tmp_path / "out", seed=0, epochs=1, kind="multilabel")
    train = rank0["train_indices"]
    padded = math.ceil(len(train) / 2) * 2
    seen = rank0["epochs"][0] + rank1["epochs"][0]
    assert len(seen) == padded
    assert set(seen) == set(train)
    assert len(set(rank0["epochs"][0])) == padded // 2


@pytest.mark.slow
def test_ddp_shards_of_views_cover_the_training_set(ddp_database: Path, tmp_path: Path) -> None:
    """A ``views`` DataModule (``ddp_script.VIEWS``: 3 small views, 2 large) with ``return_index``: each epoch the
    two ranks' indices cover the training set once, both ranks run the same batches, and every batch holds the 5
    views, large first, each ``[B, 3, S, S]`` of its batch's size."""
    rank0, rank1 = _run(ddp_database, tmp_path / "out", seed=0, epochs=2, kind="views")
    assert rank0["sampler"] == rank1["sampler"] == "ResumableSampler"
    train = rank0["train_indices"]
    assert train == rank1["train_indices"]
    assert len(train) % 2 == 1  # odd: the sampler must pad one sample
    for epoch in range(2):
        _assert_cover_once(rank0["epochs"][epoch], rank1["epochs"][epoch], train)
    shard = math.ceil(len(train) / 2)
    sizes = [4] * (shard // 4) + ([shard % 4] if shard % 4 else [])  # batch_size 4, drop_last=False
    for rank in (rank0, rank1):
        assert rank["batches"] == [len(sizes)] * 2
        assert rank["batch_sizes"] == sizes * 2
        assert rank["view_shapes"] == [[[b, 3, 32, 32]] * 2 + [[b, 3, 16, 16]] * 3 for b in sizes * 2]
        assert rank["dtypes"] == ["torch.float32"]  # every view normalized on the device


@pytest.mark.slow
def test_ddp_ranks_run_the_same_number_of_batches(two_epochs: list[dict[str, Any]]) -> None:
    """Both ranks run the same number of batches each epoch (no rank waits on a collective forever)."""
    rank0, rank1 = two_epochs
    expected = math.ceil(math.ceil(len(rank0["train_indices"]) / 2) / 4)  # batch_size 4, drop_last=False
    assert rank0["batches"] == rank1["batches"] == [expected, expected]


@pytest.mark.slow
def test_ddp_shuffle_changes_with_epoch(two_epochs: list[dict[str, Any]]) -> None:
    """The sampler is re-seeded each epoch: the order and the split between ranks change."""
    for rank in two_epochs:
        assert rank["epochs"][0] != rank["epochs"][1]
    assert set(two_epochs[0]["epochs"][0]) != set(two_epochs[0]["epochs"][1])


def _seeded_orders(database: Path, seed: int, rank: int, epochs: int) -> list[list[int]]:
    """The sample order a rank of 2 gets from ``ddp_script.py``'s DataModule, computed here, in one process."""
    dm = IndexedDataModule(
        str(database), image_size=16, batch_size=4, num_workers=0, val_fraction=0.1, seed=seed, drop_last=False
    )
    dm.trainer = fake_trainer("cpu", world_size=2, distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
    dm.setup("fit")
    sampler = dm.train_dataloader().sampler
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append([int(dm.train_dataset.indices[i]) for i in sampler])
    return orders


@pytest.mark.slow
def test_ddp_order_is_reproducible_from_seed(ddp_database: Path, two_epochs: list[dict[str, Any]]) -> None:
    """Each rank's order in the real DDP run is the one the seeded sampler gives its rank and epoch, computed in
    another process: a function of the seed alone, so every run repeats it; another seed gives another order.

    (test_resume's DDP runs also repeat a seeded run's batches across two launches.)
    """
    for rank, record in enumerate(two_epochs):
        assert record["epochs"] == _seeded_orders(ddp_database, seed=0, rank=rank, epochs=2)
        assert _seeded_orders(ddp_database, seed=1, rank=rank, epochs=1)[0] != record["epochs"][0]


# ----------------------------------------------------------------------------------------------------------------
# Several nodes, one shared cache: one conversion, the others wait for it (docs/ddp.md)
# ----------------------------------------------------------------------------------------------------------------

NODE_SCRIPT = Path(__file__).with_name("convert_node_script.py")


def _wait_for(condition: Callable[[], bool], what: str, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` (with the children's logs) when a child dies first."""
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"a node exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_nodes_converting_into_one_shared_cache_convert_once(tmp_path: Path) -> None:
    """Two independent processes (two "nodes", not ranks of one job) prepare the same folder into one cache: one
    converts, the other waits on the target's lock, then reads the finished database without converting again."""
    src = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=6, val_per_class=2, min_size=40, max_size=60, num_workers=1
    )
    cache, out = tmp_path / "shared_cache", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    logs = {name: (out / f"{name}.log").open("w") for name in ("first", "second")}

    def start(name: str, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, str(NODE_SCRIPT), str(src), str(cache), str(out), name, *extra]
        return subprocess.Popen(cmd, env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    first = start("first", "--hold")
    procs = [first]
    try:
        _wait_for((out / "first.holding").exists, "the first node held the conversion lock", procs)
        procs.append(start("second"))
        _wait_for(lambda: "waiting for another conversion" in (out / "second.log").read_text(), "the wait", procs)
        assert not (out / "second.json").exists()  # it waits: it neither converted nor read anything yet
        (out / "release").touch()
        for proc in procs:
            assert proc.wait(timeout=300) == 0, (out / "first.log").read_text() + (out / "second.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for fh in logs.values():
            fh.close()
    converted, waited = (json.loads((out / f"{name}.json").read_text()) for name in ("first", "second"))
    assert converted["up_to_date"] == [False]
    assert converted["written"] == [16]
    assert waited["up_to_date"] == [True]  # found the first node's database complete and up to date
    assert waited["database"] == converted["database"]
    assert waited["labels"] == converted["labels"]
    # no second copy, no lock or working copy (the `.NAME.used` beside a conversion records its last use)
    databases_and_leftovers = [
        p.name for p in cache.iterdir() if (p.suffix == ".lmdb" or p.name.startswith(".")) and p.suffix != ".used"
    ]
    assert databases_and_leftovers == [Path(converted["database"]).name]


# ----------------------------------------------------------------------------------------------------------------
# What each rank sees under SLURM and torchrun (Lightning's environment detection), in one process
# ----------------------------------------------------------------------------------------------------------------

#: rank 3 of 4: the second process of the second node, as `srun` (2 nodes x 2 tasks) and `torchrun` set it
_LAUNCHERS = {
    "slurm": (
        "SLURMEnvironment",
        {
            "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242",
            "SLURM_NODELIST": "gpu[01-02]",
        },
    ),
    "torchrun": (
        "TorchElasticEnvironment",
        {
            "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1",
            "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
        },
    ),
}  # fmt: skip


def _launched_as(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cpus_per_task: int | None = None) -> None:
    """This process as one rank a launcher started on an 8-CPU node: its variables set, no other launcher's."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")) or name in (*_DIST_VARS, "GROUP_RANK"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if cpus_per_task is not None:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cpus_per_task))
    affinity = set(range(cpus_per_task or 8))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity, raising=False)
    monkeypatch.setattr(cpus, "_cgroup_cpuset", lambda root: set(range(8)))
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda *args: None)


@pytest.mark.parametrize("launcher", sorted(_LAUNCHERS))
def test_a_launched_rank_shards_and_budgets_as_lightning_detects_it(
    ddp_database: Path, monkeypatch: pytest.MonkeyPatch, launcher: str
) -> None:
    """Under ``srun`` or ``torchrun`` Lightning detects the launcher; the DataModule then reads rank 3 of 4 (node 1)
    from the Trainer: its shard, ``batch_size`` per process, and 8 CPUs // 2 processes on this node = 4 workers."""
    environment, env = _LAUNCHERS[launcher]
    _launched_as(monkeypatch, env)
    trainer = Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    assert type(trainer.strategy.cluster_environment).__name__ == environment
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (4, 3, 1, 1)
    dm = IndexedDataModule(str(ddp_database), image_size=16, batch_size=4, num_workers="auto", val_fraction=0.1)
    dm.trainer = trainer
    assert dm.worker_budget() == dm.resolved_num_workers() == 4
    assert dm.resolved_engine() == "threads"  # training on the CPU
    loader = dm.train_dataloader()
    assert loader.workers == 4
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (4, 3)
    train = dm.train_dataset.indices.tolist()
    shard = [train[i] for i in loader.sampler]
    assert len(shard) == math.ceil(len(train) / 4)  # a quarter of the training split
    dm.num_workers = 0  # read the batches in this process
    batches = [indices.tolist() for _, _, indices in dm.train_dataloader()]
    assert [len(b) for b in batches] == [4] * (len(shard) // 4)  # `batch_size` per process; `drop_last` drops the rest
    assert [i for batch in batches for i in batch] == shard[: len(batches) * 4]


def test_ranks_bound_to_their_own_cpus_by_srun_are_not_divided_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``srun --cpus-per-task=4`` with CPU binding: each of the 2 tasks on an 8-CPU node has its own 4 CPUs, which
    ``num_workers="auto"`` gives it whole (4, not 4 // 2 tasks per node)."""
    _launched_as(monkeypatch, _LAUNCHERS["slurm"][1], cpus_per_task=4)
    trainer = Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False)
    dm = FastImageDataModule("unused", num_workers="auto")
    dm.trainer = trainer
    assert cpus.usable_cpu_count() == 4
    assert dm.worker_budget() == dm.resolved_num_workers() == 4


@pytest.mark.slow
def test_torchrun_launch_shards_with_batch_size_per_process(ddp_database: Path, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc_per_node 2`` runs the same script: Lightning detects torchrun and starts no
    processes of its own, each rank reads its own shard in batches of ``batch_size``, and each counts 2 processes on
    its node (what ``num_workers="auto"`` divides the CPUs by)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(SCRIPT), str(ddp_database), str(out), "0", "1"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(ranks):
        assert record["environment"] == "TorchElasticEnvironment"
        assert (record["rank"], record["local_rank"], record["node_rank"], record["world_size"]) == (rank, rank, 0, 2)
        assert record["processes_per_node"] == 2
        assert record["epochs"] == _seeded_orders(ddp_database, seed=0, rank=rank, epochs=1)
        shard = math.ceil(len(record["train_indices"]) / 2)
        assert record["batch_sizes"] == [4] * (shard // 4) + ([shard % 4] if shard % 4 else [])  # drop_last=False
    assert set(ranks[0]["epochs"][0]) | set(ranks[1]["epochs"][0]) == set(ranks[0]["train_indices"])


def test_a_shared_folder_without_file_locks_is_named_and_its_database_still_read(
    split_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system without ``flock`` (NFS without its lock service, Lustre without ``-o flock``) a conversion
    stops before writing, with an error naming the folder and what to do, instead of a bare ``OSError``; a complete,
    up-to-date database there is still read (reading takes no lock)."""
    real_flock = ondisk.fcntl.flock

    def no_locks(fd: Any, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(ondisk.fcntl, "flock", no_locks)
    dst = tmp_path / "shared" / "db.lmdb"
    with pytest.raises(DestinationError, match="without file locks") as info:
        convert(split_folder, dst, short_side=32, num_workers=0, progress=False)
    assert str(dst.parent) in str(info.value)
    assert "`data_dir`" in str(info.value)
    assert list(dst.parent.iterdir()) == []  # no database, no working copy, no lock file
    monkeypatch.setattr(ondisk.fcntl, "flock", real_flock)
    convert(split_folder, dst, short_side=32, num_workers=0, progress=False)  # where locks work
    monkeypatch.setattr(ondisk.fcntl, "flock", no_locks)
    summary = convert(split_folder, dst, short_side=32, num_workers=0, progress=False)
    assert summary.up_to_date
    dm = FastImageDataModule(str(split_folder), cache_dir=str(tmp_path / "cache"), short_side=32, num_workers=0)
    with pytest.raises(DestinationError, match="without file locks"):
        dm.prepare_data()  # the same message through the DataModule
