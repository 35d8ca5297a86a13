"""Real DDP on CPU: two processes shard ``FastImageDataModule``'s training set with its seeded sampler."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import fake_trainer
from indexed import IndexedDataModule

SCRIPT = Path(__file__).with_name("ddp_script.py")

#: 2 classes x 25 images, no val split: `val_fraction=0.1` holds out 5 and leaves an odd 45 for training
NUM_IMAGES = 50

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")


@pytest.fixture(scope="module")
def ddp_database(make_database: Callable[..., Path]) -> Path:
    """A converted plain ImageFolder of 50 small images in 2 classes."""
    return make_database("ddp", num_classes=2, train_per_class=25, val_per_class=0, min_size=40, max_size=60)


def _run(database: Path, out: Path, seed: int, epochs: int) -> list[dict[str, Any]]:
    """Run the DDP script and return the records of rank 0 and rank 1."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(database), str(out), str(seed), str(epochs)],
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
    padded = math.ceil(n / 2) * 2
    for epoch in range(2):
        first, second = rank0["epochs"][epoch], rank1["epochs"][epoch]
        assert len(first) == len(second) == padded // 2
        seen = first + second
        assert len(seen) == padded
        assert set(seen) == set(train)
        duplicates = sum(count - 1 for count in Counter(seen).values())
        assert duplicates == padded - n
        assert len(set(first)) == len(first)  # no sample twice within a rank
        assert len(set(second)) == len(second)
        assert len(set(first) & set(second)) == duplicates  # the padding is the only overlap


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
