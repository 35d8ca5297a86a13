"""Tests for ``lightning_fastdata.pipeline.resume``: sampler and loader state, then real runs killed and resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from fakes import fake_trainer, patch_cuda_streams
from kinds import make_kind_database
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from lightning_fastdata import FastImageDataModule, InvalidArgumentError, LmdbImageDataset
from lightning_fastdata.pipeline import FastLoader
from lightning_fastdata.pipeline.resume import ResumableSampler

SCRIPT = Path(__file__).with_name("resume_script.py")

#: variables a DDP launch reads: a stale one from the calling environment must not leak into the run
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK")

#: the unit tests' dataset: 22 samples in batches of 4 are 6 batches, the last one partial (2 samples)
N, BATCH = 22, 4
NUM_BATCHES = 6

#: the training runs: 2 classes x 30 images, no val split; batch size 4, two epochs
NUM_IMAGES, SEED = 60, 3

#: seconds any one training subprocess may take before it is killed and the test fails
RUN_TIMEOUT = 120


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _dataset(n: int = N) -> TensorDataset:
    """Items ``(index,)``: a batch's first element is its sample ids."""
    return TensorDataset(torch.arange(n))


def _loader(
    seed: int = 0,
    epoch: int = 0,
    batch_size: int = BATCH,
    num_replicas: int = 1,
    rank: int = 0,
    dataset: Dataset | None = None,
    **kwargs: Any,
) -> FastLoader:
    """A resumable loader as the DataModule builds it: a seeded, shuffling ``ResumableSampler`` set to ``epoch``."""
    dataset = _dataset() if dataset is None else dataset
    sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return FastLoader(dataset, sampler=sampler, batch_size=batch_size, **kwargs)


def _ids(batches: Any) -> list[list[int]]:
    """The sample ids of each batch."""
    return [batch[0].tolist() for batch in batches]


def _reference(
    seed: int = 0, epoch: int = 0, batch_size: int = BATCH, num_replicas: int = 1, rank: int = 0
) -> list[list[int]]:
    """One uninterrupted epoch from a plain DataLoader and ``DistributedSampler`` (independent of the code tested)."""
    dataset = _dataset()
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return _ids(DataLoader(dataset, sampler=sampler, batch_size=batch_size))


def _take(loader: FastLoader, k: int) -> dict[str, Any]:
    """Hand out ``k`` batches of a fresh epoch of ``loader`` and return its state."""
    batches = iter(loader)
    for _ in range(k):
        next(batches)
    return loader.state_dict()


def _state(epoch: int, batches: int, seed: int = 0, **changes: Any) -> dict[str, Any]:
    """A saved state of the unit tests' loader."""
    state = {"epoch": epoch, "batches": batches, "batch_size": BATCH, "num_samples": N, "seed": seed, "shuffle": True}
    return {**state, **changes}


# ----------------------------------------------------------------------------------------------------------------
# ResumableSampler and FastLoader's position
# ----------------------------------------------------------------------------------------------------------------


def test_reference_epochs_differ() -> None:
    """The reference orders depend on seed and epoch (so the resume tests below can tell them apart)."""
    assert _reference(0, 0) != _reference(0, 1)
    assert _reference(0, 1) != _reference(1, 1)
    assert sorted(i for batch in _reference(0, 1) for i in batch) == list(range(N))
    assert len(_reference()) == NUM_BATCHES


def test_sampler_skips_once_then_yields_full_epochs() -> None:
    """``skip`` leaves out exactly that many of this epoch's indices, once; later epochs are complete."""
    dataset = _dataset()
    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
    plain = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
    full = list(plain)
    sampler.skip = 7
    assert list(sampler) == full[7:]
    assert sampler.skip == 0
    assert len(sampler) == N  # the length stays the full epoch, as Lightning expects
    assert list(sampler) == full
    sampler.set_epoch(1)
    plain.set_epoch(1)
    assert list(sampler) == list(plain) != full


def test_state_dict_counts_handed_out_batches() -> None:
    """The state is the epoch, the batches handed out so far in it, and what the order depends on."""
    loader = _loader(seed=7, epoch=1)
    assert loader.state_dict() == _state(1, 0, seed=7)
    assert _take(loader, 3) == _state(1, 3, seed=7)
    assert _take(loader, 1) == _state(1, 1, seed=7)  # a new iterator starts the count again
    list(loader)
    assert loader.state_dict() == _state(1, NUM_BATCHES, seed=7)


@pytest.mark.parametrize("k", [1, 4, NUM_BATCHES - 1])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_yields_the_rest_of_the_epoch(workers: int, k: int) -> None:
    """A fresh loader given the state after ``k`` batches hands out exactly the epoch's remaining batches.

    Then, with the same (persistent) workers, the next epoch is complete.
    """
    kwargs: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
    state = _take(_loader(seed=2, epoch=1, **kwargs), k)
    assert state == _state(1, k, seed=2)
    resumed = _loader(seed=2, epoch=0, **kwargs)  # Lightning creates the loader at epoch 0, then loads the state
    resumed.load_state_dict(state)
    assert resumed.sampler.epoch == 1
    assert len(resumed) == NUM_BATCHES  # Lightning's batch counter continues at k; the length stays the full epoch
    assert _ids(resumed) == _reference(2, 1)[k:]
    assert resumed.state_dict() == _state(1, NUM_BATCHES, seed=2)  # the resumed epoch is counted from k
    resumed.sampler.set_epoch(2)
    assert _ids(resumed) == _reference(2, 2)
    assert resumed.state_dict() == _state(2, NUM_BATCHES, seed=2)


def test_resume_into_a_loader_with_live_persistent_workers() -> None:
    """Loading a state into a loader whose persistent workers already ran an epoch still skips the right batches."""
    loader = _loader(seed=4, num_workers=2, persistent_workers=True)
    assert _ids(loader) == _reference(4, 0)
    loader.load_state_dict(_state(1, 2, seed=4))
    assert _ids(loader) == _reference(4, 1)[2:]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_order_is_the_epoch_set_after_the_iterator_was_created(workers: int, persistent: bool) -> None:
    """Lightning creates the iterator, then calls ``set_epoch``: the batches follow the epoch set last.

    This is the first epoch of a fit resumed from an end-of-epoch checkpoint (no ``load_state_dict``); with workers,
    which draw their indices when the DataLoader's iterator is made, it used to replay the stale epoch's order.
    """
    loader = _loader(seed=8, epoch=0, num_workers=workers, persistent_workers=persistent and workers > 0)
    if persistent and workers:
        assert _ids(loader) == _reference(8, 0)  # live persistent workers, as after a first epoch
    batches = iter(loader)
    loader.sampler.set_epoch(1)
    assert _ids(batches) == _reference(8, 1)
    assert loader.state_dict() == _state(1, NUM_BATCHES, seed=8)
    loader.load_state_dict(_state(2, 2, seed=8))  # and a mid-epoch state still resumes after its batches
    batches = iter(loader)
    assert _ids(batches) == _reference(8, 2)[2:]


@pytest.mark.cuda
def test_order_is_the_epoch_set_after_the_iterator_was_created_on_cuda() -> None:
    """With device look-ahead on a real GPU and workers, too, the batches follow the epoch set after ``iter()``."""
    loader = _loader(seed=8, num_workers=2, persistent_workers=True, pin_memory=True, device="cuda")
    assert loader.prefetching
    batches = iter(loader)
    loader.sampler.set_epoch(1)
    assert [batch[0].cpu().tolist() for batch in batches] == _reference(8, 1)


def test_ranks_resume_from_rank_zero_state() -> None:
    """Under DDP the checkpoint holds rank zero's state: every rank resumes its own shard from it."""
    state = _take(_loader(seed=1, num_replicas=2, rank=0), 2)
    assert state["num_samples"] == N // 2
    for rank in (0, 1):
        resumed = _loader(seed=1, num_replicas=2, rank=rank)
        resumed.load_state_dict(state)
        assert _ids(resumed) == _reference(1, 0, num_replicas=2, rank=rank)[2:]


def test_state_at_epoch_end_starts_the_next_epoch() -> None:
    """A state whose batches are the whole epoch resumes with the next epoch, from its start."""
    loader = _loader(seed=3, epoch=1)
    list(loader)
    state = loader.state_dict()
    assert state == _state(1, NUM_BATCHES, seed=3)
    resumed = _loader(seed=3)
    resumed.load_state_dict(state)
    assert resumed.sampler.epoch == 2
    assert resumed.sampler.skip == 0
    assert _ids(resumed) == _reference(3, 2)


@pytest.mark.parametrize(("limit", "per_epoch"), [(4, 4), (100, NUM_BATCHES), (0.5, 3), (1.0, NUM_BATCHES)])
def test_epoch_end_under_limit_batches(limit: int | float, per_epoch: int) -> None:
    """With ``limit_train_batches`` the epoch ends after the limit: a state there starts the next epoch.

    A state one batch earlier still continues the same epoch.
    """
    assert _loader(limit_batches=limit).batches_per_epoch() == per_epoch
    at_end = _loader(limit_batches=limit)
    at_end.load_state_dict(_state(1, per_epoch))
    assert at_end.sampler.epoch == 2
    assert _ids(at_end) == _reference(0, 2)
    before_end = _loader(limit_batches=limit)
    before_end.load_state_dict(_state(1, per_epoch - 1))
    assert before_end.sampler.epoch == 1
    assert _ids(before_end) == _reference(0, 1)[per_epoch - 1 :]


@pytest.mark.parametrize(
    ("changes", "found"),
    [
        ({"seed": 1}, "`seed` 0 in the checkpoint, 1 now"),
        ({"batch_size": 2}, "`batch_size` 4 in the checkpoint, 2 now"),
        ({"shuffle": False}, "`shuffle` True in the checkpoint, False now"),
        ({"num_replicas": 2}, "`num_samples` 22 in the checkpoint, 11 now (`num_samples` is the samples each"),
        ({"dataset": _dataset(30)}, "`num_samples` 22 in the checkpoint, 30 now"),
    ],
)
def test_a_state_of_other_data_is_refused(changes: dict[str, Any], found: str) -> None:
    """A state saved for other data or settings (seed, batch size, shuffle, the split's size, the number of
    processes) is refused, saying what differs and how to go on; the loader is left as it was.

    Continued, its epoch would restart from the beginning of its order while the Trainer counts on from the saved
    batch: some samples trained twice and some not at all, which only a warning said before.
    """
    state = _take(_loader(), 2)
    state["epoch"] = 1
    changes = dict(changes)  # the parameter's own dict stays whole
    shuffle = changes.pop("shuffle", True)
    loader = _loader(**changes)
    loader.sampler.shuffle = shuffle
    with pytest.raises(InvalidArgumentError, match="saved for other data or settings") as raised:
        loader.load_state_dict(state)
    message = str(raised.value)
    assert found in message
    assert "epoch 1 cannot be continued where it stopped (after batch 2)" in message
    assert "without `ckpt_path`" in message
    assert "['combined_loader']` set to `{}`" in message
    assert loader.sampler.epoch == 0
    assert loader.sampler.skip == 0


def test_empty_state_is_a_no_op() -> None:
    """An empty state (a checkpoint from before the loader was resumable) changes nothing, and warns nothing."""
    loader = _loader(seed=2, epoch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.load_state_dict({})
    assert loader.sampler.epoch == 1
    assert loader.sampler.skip == 0
    assert _ids(loader) == _reference(2, 1)


@pytest.mark.parametrize("sampler", ["distributed", "default"])
def test_non_resumable_sampler_has_no_state(sampler: str) -> None:
    """With a plain ``DistributedSampler`` (or none) the loader saves ``{}`` and ignores a loaded state."""
    dataset = _dataset()
    if sampler == "distributed":
        plain = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = FastLoader(dataset, sampler=plain, batch_size=BATCH)
        expected = _reference(0, 0)
    else:
        loader = FastLoader(dataset, batch_size=BATCH)
        expected = [list(range(i, min(i + BATCH, N))) for i in range(0, N, BATCH)]
    assert loader.state_dict() == {}
    assert _take(loader, 2) == {}
    loader.load_state_dict(_state(1, 2))
    assert getattr(loader.sampler, "epoch", 0) == 0
    assert _ids(loader) == expected
    assert loader.state_dict() == {}


class _RecordingDataset(Dataset):
    """Items ``(index,)`` that log every index read."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        self.read.append(index)
        return (torch.tensor(index),)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA streams patched so the loader's device look-ahead runs on the CPU (copies are the identity)."""
    patch_cuda_streams(monkeypatch)


@pytest.mark.usefixtures("fake_cuda")
def test_count_is_of_handed_out_batches_under_device_lookahead() -> None:
    """Copying one batch ahead to the device reads batch k + 1 early, but the state counts the k handed out."""
    dataset = _RecordingDataset()
    loader = _loader(seed=6, epoch=1, dataset=dataset, device="cuda:0")
    assert loader.prefetching
    state = _take(loader, 3)
    assert len(dataset.read) == 4 * BATCH  # the look-ahead already read batch 4
    assert state == _state(1, 3, seed=6)
    resumed = _loader(seed=6, dataset=_RecordingDataset(), device="cuda:0")
    resumed.load_state_dict(state)
    assert _ids(resumed) == _reference(6, 1)[3:]  # batch 4, read but never handed out, is not lost


# ----------------------------------------------------------------------------------------------------------------
# FastImageDataModule's training loader
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resume_database(make_database: Callable[..., Path]) -> Path:
    """A converted plain ImageFolder of 60 tiny images in 2 classes (no val split)."""
    return make_database(
        "resume",
        num_classes=2,
        train_per_class=NUM_IMAGES // 2,
        val_per_class=0,
        min_size=20,
        max_size=32,
        num_workers=None,
    )


@pytest.mark.parametrize(("limit", "per_epoch"), [(None, NUM_IMAGES // 4), (10, 10), (0.5, NUM_IMAGES // 8)])
def test_datamodule_loader_takes_the_trainers_limit(
    resume_database: Path, limit: int | float | None, per_epoch: int
) -> None:
    """The training loader knows ``Trainer(limit_train_batches)``, so it knows where Lightning's epoch ends."""
    dm = FastImageDataModule(str(resume_database), image_size=16, batch_size=4, num_workers=0, val_fraction=0, seed=1)
    if limit is not None:
        dm.trainer = Mock(
            world_size=1,
            num_nodes=1,
            precision="32-true",
            distributed_sampler_kwargs=None,
            strategy=Mock(root_device=torch.device("cpu")),
            limit_train_batches=limit,
        )
    loader = dm.train_dataloader()
    assert isinstance(loader, FastLoader)
    assert isinstance(loader.sampler, ResumableSampler)
    assert loader.sampler.seed == 1
    assert loader.batches_per_epoch() == per_epoch


# ----------------------------------------------------------------------------------------------------------------
# Real runs: uninterrupted (A), killed after a checkpoint (B), resumed from it (C)
# ----------------------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(
    database: Path, out: Path, mode: str, devices: int, every: int, slow_after: int = 0, **opts: Any
) -> subprocess.Popen[bytes]:
    """Start ``resume_script.py`` in its own session (so the whole process group can be killed); output to a log."""
    out.mkdir(parents=True)
    args = [mode, str(database), str(out), str(SEED), str(devices), "2", str(every), str(slow_after)]
    args += [str(opts.get("ckpt", "-")), str(opts.get("limit", "1.0")), "1" if opts.get("val") else "0"]
    args += [opts.get("kind", "class")]
    if opts.get("schedule") or opts.get("views"):
        args.append(json.dumps(opts.get("schedule") or {}))
    if opts.get("views"):
        args.append(json.dumps(opts["views"]))
    with open(out / "log.txt", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (DDP ranks and DataLoader workers too) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _log(out: Path) -> str:
    return (out / "log.txt").read_text()[-4000:]


def _finish(proc: subprocess.Popen, out: Path) -> None:
    """Wait for a run to finish (killing it and failing on timeout) and check that it succeeded."""
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"run in {out} did not finish in {RUN_TIMEOUT} s:\n{_log(out)}")
    assert proc.returncode == 0, _log(out)


def _complete_lines(path: Path) -> list[str]:
    """The lines of a JSONL file that are complete (a writer may be part-way through the last one)."""
    if not path.exists():
        return []
    text = path.read_text()
    return text.splitlines()[: text.count("\n")]


def _records(out: Path, rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s per-batch records: ``{"step", "epoch", "batch_idx", "indices", "pixels"}``."""
    return [json.loads(line) for line in _complete_lines(out / f"rank{rank}.jsonl")]


def _train(database: Path, out: Path, mode: str, devices: int, every: int, **opts: Any) -> list[list[dict[str, Any]]]:
    """Run the script to the end; returns each rank's records."""
    _finish(_start(database, out, mode, devices, every, **opts), out)
    return [_records(out, rank) for rank in range(devices)]


def _train_until_killed(database: Path, out: Path, devices: int, every: int, kill_after: int, **opts: Any) -> None:
    """Train, slowing after step ``kill_after``; SIGKILL the run once that checkpoint exists and 2 more steps ran."""
    proc = _start(database, out, "fit", devices, every, slow_after=kill_after, **opts)
    checkpoint = out / "ckpt" / f"step={kill_after}.ckpt"
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"run B ended (exit code {proc.returncode}) before it was killed:\n{_log(out)}")
            if time.monotonic() > deadline:
                pytest.fail(f"run B did not reach step {kill_after + 2} in {RUN_TIMEOUT} s:\n{_log(out)}")
            steps = [
                [json.loads(line)["step"] for line in _complete_lines(out / f"rank{r}.jsonl")] for r in range(devices)
            ]
            if checkpoint.exists() and all(sum(s > kill_after for s in rank) >= 2 for rank in steps):
                break
            time.sleep(0.05)
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL


def _loader_state(checkpoint: Path) -> list[dict[str, Any]]:
    """The training loaders' states that Lightning saved in a checkpoint."""
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"
    ]


def _check_resumed(
    full: list[list[dict[str, Any]]], killed: list[list[dict[str, Any]]], resumed: list[list[dict[str, Any]]], k: int
) -> None:
    """Per rank: the killed run's first ``k`` steps, then the resumed run's steps, are exactly the uninterrupted run.

    Exactly: the same samples, and the same pixels (``"pixels"``, a digest of each batch's images): the same crops
    and flips.
    """
    for a, b, c in zip(full, killed, resumed, strict=True):
        assert [r["step"] for r in b[:k]] == list(range(1, k + 1))
        assert len(b) >= k + 2  # the killed run went past the checkpoint: those steps are replayed by the resumed run
        assert b[: k + 2] == a[: k + 2]
        assert c[0]["step"] == k + 1
        assert b[:k] + c == a
        assert len({tuple(r["indices"]) for r in a}) == len(a)  # the comparison is of distinct batches
        assert len({r["pixels"] for r in a}) == len(a)


@pytest.fixture(scope="module")
def single_runs(resume_database: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One device: run A to the end; run B killed after step 15 (epoch 0's last), checkpoints every 5 steps."""
    root = tmp_path_factory.mktemp("single")
    full = _train(resume_database, root / "a", "fit", devices=1, every=5)
    _train_until_killed(resume_database, root / "b", devices=1, every=5, kill_after=15)
    return {"full": full, "killed": [_records(root / "b", 0)], "ckpt": root / "b" / "ckpt"}


@pytest.mark.slow
@pytest.mark.parametrize("k", [5, 15])
def test_killed_run_resumes_exactly(resume_database: Path, single_runs: dict[str, Any], tmp_path: Path, k: int) -> None:
    """Killed after its step-``k`` checkpoint (mid-epoch at 5, epoch end at 15) and resumed: the same batches as A."""
    full = single_runs["full"]
    assert len(full[0]) == 2 * NUM_IMAGES // 4
    checkpoint = single_runs["ckpt"] / f"step={k}.ckpt"
    assert _loader_state(checkpoint) == [
        {"epoch": 0, "batches": k, "batch_size": 4, "num_samples": NUM_IMAGES, "seed": SEED, "shuffle": True}
    ]
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=1, every=5, ckpt=checkpoint)
    _check_resumed(full, single_runs["killed"], resumed, k)
    first = resumed[0][0]
    if k == NUM_IMAGES // 4:  # the epoch was complete: epoch 1 from its start
        assert (first["epoch"], first["batch_idx"]) == (1, 0)
    else:
        assert (first["epoch"], first["batch_idx"]) == (0, k)


@pytest.mark.slow
def test_a_killed_multilabel_run_resumes_exactly(tmp_path: Path) -> None:
    """A multi-label database through ``return_index`` batches (targets and indices in the slots): killed after its
    step-5 checkpoint and resumed, the same samples, pixels and multi-hot targets as the uninterrupted run."""
    db = make_kind_database(tmp_path / "ml.lmdb", "multilabel", {"train": NUM_IMAGES}, classes=2)
    full = _train(db, tmp_path / "a", "fit", devices=1, every=5, kind="multilabel")
    assert len(full[0]) == 2 * NUM_IMAGES // 4
    reference = LmdbImageDataset(db)
    for record in full[0]:
        assert record["targets"] == reference.targets_of(record["indices"]).tolist()
    _train_until_killed(db, tmp_path / "b", devices=1, every=5, kill_after=5, kind="multilabel")
    checkpoint = tmp_path / "b" / "ckpt" / "step=5.ckpt"
    resumed = _train(db, tmp_path / "c", "resume", devices=1, every=5, ckpt=checkpoint, kind="multilabel")
    _check_resumed(full, [_records(tmp_path / "b", 0)], resumed, 5)


def test_killed_run_with_an_image_size_schedule_resumes_exactly(resume_database: Path, tmp_path: Path) -> None:
    """``image_size_schedule={0: 32, 1: 48}``, killed mid-epoch 1 and resumed: the uninterrupted run, at 48 px.

    Lightning calls no ``on_train_epoch_start`` for an epoch resumed part-way: the training loader sets the size
    from its sampler's epoch.
    """
    schedule = {0: 32, 1: 48}
    full = _train(resume_database, tmp_path / "a", "fit", devices=1, every=5, schedule=schedule)
    per_epoch = NUM_IMAGES // 4
    assert [r["size"] for r in full[0]] == [32] * per_epoch + [48] * per_epoch
    k = per_epoch + 5
    _train_until_killed(resume_database, tmp_path / "b", devices=1, every=5, kill_after=k, schedule=schedule)
    checkpoint = tmp_path / "b" / "ckpt" / f"step={k}.ckpt"
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=1, every=5, ckpt=checkpoint, schedule=schedule)
    _check_resumed(full, [_records(tmp_path / "b", 0)], resumed, k)
    assert (resumed[0][0]["epoch"], resumed[0][0]["batch_idx"], resumed[0][0]["size"]) == (1, 5, 48)


def test_killed_run_with_views_resumes_exactly(resume_database: Path, tmp_path: Path) -> None:
    """``views`` (2 x 24 px, 3 x 12 px), killed after its step-5 checkpoint and resumed: every view of every batch
    as in the uninterrupted run, bit for bit (each view's box and flip keyed by ``(seed, epoch, sample)``)."""
    views = [{"size": 12, "count": 3, "scale": [0.05, 0.4]}, {"size": 24, "count": 2, "scale": [0.4, 1.0]}]
    full = _train(resume_database, tmp_path / "a", "fit", devices=1, every=5, views=views)
    assert len(full[0]) == 2 * NUM_IMAGES // 4
    assert all(record["size"] == [24, 24, 12, 12, 12] for record in full[0])
    _train_until_killed(resume_database, tmp_path / "b", devices=1, every=5, kill_after=5, views=views)
    checkpoint = tmp_path / "b" / "ckpt" / "step=5.ckpt"
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=1, every=5, ckpt=checkpoint, views=views)
    _check_resumed(full, [_records(tmp_path / "b", 0)], resumed, 5)


@pytest.mark.slow
def test_resume_at_epoch_end_under_limit_train_batches(resume_database: Path, tmp_path: Path) -> None:
    """``limit_train_batches=10`` ends each epoch after 10 of its 15 batches: resuming there starts epoch 1."""
    full = _train(resume_database, tmp_path / "a", "fit", devices=1, every=5, limit=10)
    assert [r["epoch"] for r in full[0]] == [0] * 10 + [1] * 10
    checkpoint = tmp_path / "a" / "ckpt" / "step=10.ckpt"
    assert _loader_state(checkpoint)[0]["batches"] == 10
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=1, every=5, ckpt=checkpoint, limit=10)
    assert resumed[0] == full[0][10:]


def _sampler_order(epoch: int, n: int) -> list[list[int]]:
    """The batches of 4 that ``DistributedSampler(seed=SEED)`` gives one process in ``epoch``, over ``n`` samples."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + 4] for i in range(0, n, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("val", [False, True], ids=["on_train_epoch_end", "on_validation_end"])
def test_resume_from_end_of_epoch_checkpoint(resume_database: Path, tmp_path: Path, val: bool) -> None:
    """Resumed from ``ModelCheckpoint``'s default end-of-epoch checkpoint, epoch 1 is the uninterrupted run's epoch 1.

    Without validation the checkpoint is saved in ``on_train_epoch_end`` (Lightning then does not restart the epoch
    and calls no ``load_state_dict``); with validation in ``on_validation_end``. ``num_workers=2``.
    """
    images = NUM_IMAGES - (NUM_IMAGES // 5 if val else 0)
    per_epoch = images // 4
    full = _train(resume_database, tmp_path / "a", "fit", devices=1, every=0, val=val)[0]
    assert [r["epoch"] for r in full] == [0] * per_epoch + [1] * per_epoch
    if not val:  # the indices are the sampler's (no held-out split): each epoch in DistributedSampler's order
        assert [r["indices"] for r in full] == _sampler_order(0, images) + _sampler_order(1, images)
    checkpoint = tmp_path / "a" / "ckpt" / f"step={per_epoch}.ckpt"
    assert _loader_state(checkpoint)[0]["batches"] == per_epoch
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=1, every=0, ckpt=checkpoint, val=val)[0]
    assert resumed == full[per_epoch:]


@pytest.fixture(scope="module")
def ddp_runs(resume_database: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two-rank DDP on CPU: run A to the end; run B killed after step 8 (epoch 0's last), checkpoints every 4 steps.

    30 samples per rank in batches of 4 (``drop_last=False``) are 8 batches per epoch, the last one of 2 samples.
    """
    root = tmp_path_factory.mktemp("ddp")
    full = _train(resume_database, root / "a", "fit", devices=2, every=4)
    _train_until_killed(resume_database, root / "b", devices=2, every=4, kill_after=8)
    killed = [_records(root / "b", rank) for rank in range(2)]
    return {"full": full, "killed": killed, "ckpt": root / "b" / "ckpt"}


@pytest.mark.slow
@pytest.mark.parametrize("k", [4, 8])
def test_killed_ddp_run_resumes_exactly(
    resume_database: Path, ddp_runs: dict[str, Any], tmp_path: Path, k: int
) -> None:
    """DDP, killed after the step-``k`` checkpoint (mid-epoch at 4, epoch end at 8): every rank replays A's batches."""
    full = ddp_runs["full"]
    assert [len(rank) for rank in full] == [16, 16]
    assert [len(r["indices"]) for r in full[0][:8]] == [4] * 7 + [2]
    shards = [{i for r in rank[:8] for i in r["indices"]} for rank in full]
    assert len(shards[0]) == len(shards[1]) == NUM_IMAGES // 2
    assert not shards[0] & shards[1]  # epoch 0: each rank its own half
    checkpoint = ddp_runs["ckpt"] / f"step={k}.ckpt"
    assert _loader_state(checkpoint) == [
        {"epoch": 0, "batches": k, "batch_size": 4, "num_samples": NUM_IMAGES // 2, "seed": SEED, "shuffle": True}
    ]
    resumed = _train(resume_database, tmp_path / "c", "resume", devices=2, every=4, ckpt=checkpoint)
    _check_resumed(full, ddp_runs["killed"], resumed, k)
    for rank in resumed:
        assert (rank[0]["epoch"], rank[0]["batch_idx"]) == ((1, 0) if k == 8 else (0, k))


def _epoch_batches(loader: Any, stop: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the batches of one epoch of ``loader`` (the first ``stop`` of them, when given)."""
    batches = []
    for images, labels in loader:
        batches.append((images.clone(), labels.clone()))
        if stop is not None and len(batches) == stop:
            break
    return batches


def _resumed_against_full(
    make: Any, k: int = 2, epoch: int = 1
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Epoch ``epoch`` of a fresh loader from ``make()``, and the same epoch interrupted after ``k`` batches (state
    saved) and finished by another fresh loader that loaded that state: ``(full, head + tail)``."""
    first = make()
    first.sampler.set_epoch(epoch)
    full = _epoch_batches(first)
    interrupted = make()
    interrupted.sampler.set_epoch(epoch)
    head = _epoch_batches(interrupted, stop=k)
    state = interrupted.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    return full, head + _epoch_batches(resumed)


def _assert_same_batches(batches: list[Any], expected: list[Any], what: str) -> None:
    assert len(batches) == len(expected), what
    for (images, labels), (expected_images, expected_labels) in zip(batches, expected, strict=True):
        torch.testing.assert_close(images, expected_images, rtol=0, atol=0, msg=what)
        assert labels.tolist() == expected_labels.tolist(), what


def _resume_datamodule(database: Path, device: str, **kwargs: Any) -> FastImageDataModule:
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, val_fraction=0, seed=5, **kwargs)
    dm.trainer = fake_trainer(device)
    dm.setup("fit")
    return dm


@pytest.mark.slow
def test_a_resumed_epoch_is_bit_identical_on_every_engine(database: Path) -> None:
    """Mid-epoch resume continues with the same samples *and the same crops and flips*, on every engine.

    Every engine also builds the same batches as the others: a sample's augmentation is a function of the seed,
    the epoch and the sample, not of the thread or worker that reads it.
    """
    full: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for engine, workers in (("threads", 2), ("processes", 2), ("threads", 0)):
        name = f"{engine}-{workers}"
        full[name], resumed = _resumed_against_full(
            lambda: _resume_datamodule(database, "cpu", num_workers=workers, engine=engine).train_dataloader()  # noqa: B023
        )
        assert len(full[name]) == 6
        _assert_same_batches(resumed, full[name], name)
    for name, batches in full.items():
        _assert_same_batches(batches, full["threads-2"], name)


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_a_resumed_epoch_is_bit_identical_on_cuda(database: Path, decode: str) -> None:
    """On a GPU (prefetch to the device, and with ``decode="device"`` nvJPEG), a resumed epoch is bit-identical."""
    full, resumed = _resumed_against_full(
        lambda: _resume_datamodule(database, "cuda", num_workers=2, decode=decode).train_dataloader()
    )
    assert full[0][0].is_cuda
    _assert_same_batches(resumed, full, decode)


# ----------------------------------------------------------------------------------------------------------------
# ResumeCheckpoint: a killed fit, run again with ckpt_path="last", from Python and from a YAML config
# ----------------------------------------------------------------------------------------------------------------

#: ResumeCheckpoint saves last.ckpt every EVERY steps; runs slow down after the first save, to be killed 2 steps later
EVERY = 5


def _kill_after_last_checkpoint(proc: subprocess.Popen, out: Path, last: Path) -> int:
    """SIGKILL the run once ``last`` exists and 2 steps past its first save ran; returns the step ``last`` holds."""
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit code {proc.returncode}) before it was killed:\n{_log(out)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the run did not reach step {EVERY + 2} in {RUN_TIMEOUT} s:\n{_log(out)}")
            if last.exists() and sum(r["step"] > EVERY for r in _records(out, 0)) >= 2:
                break
            time.sleep(0.05)
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    return int(torch.load(last, map_location="cpu", weights_only=True)["global_step"])


def _check_resumed_from_last(killed: list[dict[str, Any]], resumed: list[dict[str, Any]], k: int) -> None:
    """The resumed run starts at step ``k + 1`` (not 1), mid-epoch, and replays the killed run's later steps exactly."""
    per_epoch = NUM_IMAGES // 4
    assert k >= EVERY
    assert k % EVERY == 0
    assert k % per_epoch != 0  # mid-epoch: the loader state, not an epoch boundary, places the next batch
    assert [r["step"] for r in killed[:k]] == list(range(1, k + 1))
    assert [r["step"] for r in resumed] == list(range(k + 1, 2 * per_epoch + 1))
    assert (resumed[0]["epoch"], resumed[0]["batch_idx"]) == (k // per_epoch, k % per_epoch)
    replayed = killed[k:]
    assert resumed[: len(replayed)] == replayed  # the same samples and pixels as before the kill
    whole = killed[:k] + resumed
    assert len({tuple(r["indices"]) for r in whole}) == len(whole)
    for epoch in (0, 1):  # each epoch saw every image once: nothing skipped, nothing repeated
        assert sorted(i for r in whole if r["epoch"] == epoch for i in r["indices"]) == list(range(NUM_IMAGES))


@pytest.mark.slow
def test_a_killed_fit_resumes_from_last_with_resume_checkpoint(resume_database: Path, tmp_path: Path) -> None:
    """``ResumeCheckpoint`` + ``fit(ckpt_path="last")``: killed part-way, the same call resumes from its last step."""
    root = tmp_path / "run"
    proc = _start(resume_database, tmp_path / "b", "fit-last", 1, EVERY, slow_after=EVERY, ckpt=root)
    k = _kill_after_last_checkpoint(proc, tmp_path / "b", root / "checkpoints" / "last.ckpt")
    resumed = _train(resume_database, tmp_path / "c", "resume-last", devices=1, every=EVERY, ckpt=root)
    _check_resumed_from_last(_records(tmp_path / "b", 0), resumed[0], k)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["last.ckpt"]


_CONFIG = """
seed_everything: 3
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: resume_script.SlowDown
      init_args:
        after: {every}
    - class_path: lightning_fastdata.ResumeCheckpoint
      init_args:
        every_n_train_steps: {every}
model:
  class_path: resume_script.RecordingModel
  init_args:
    out_dir: {out}
data:
  class_path: indexed.IndexedDataModule
  init_args:
    data_dir: {data}
    image_size: 16
    batch_size: 4
    num_workers: 2
    val_fraction: 0
    seed: {seed}
    drop_last: false
"""


def _start_cli(out: Path, *args: str) -> subprocess.Popen[bytes]:
    """``lightning-fastdata fit ARGS`` from the tests folder (its modules importable), in its own session."""
    out.mkdir(parents=True, exist_ok=True)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    with open(out / "log.txt", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "lightning_fastdata.cli", "fit", *args],
            cwd=SCRIPT.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.slow
def test_a_killed_cli_fit_resumes_from_last_with_a_yaml_config(resume_database: Path, tmp_path: Path) -> None:
    """The same from a YAML config naming ``lightning_fastdata.ResumeCheckpoint``, run again with ``--ckpt_path last``.

    The resumed run only adds ``--ckpt_path last`` (and its own records folder).
    """
    root, killed, resumed = tmp_path / "run", tmp_path / "b", tmp_path / "c"
    config = tmp_path / "config.yaml"
    config.write_text(_CONFIG.format(root=root, every=EVERY, out=killed, data=resume_database, seed=SEED))
    k = _kill_after_last_checkpoint(
        _start_cli(killed, "--config", str(config)), killed, root / "checkpoints" / "last.ckpt"
    )
    proc = _start_cli(
        resumed, "--config", str(config), "--model.init_args.out_dir", str(resumed), "--ckpt_path", "last"
    )
    _finish(proc, resumed)
    _check_resumed_from_last(_records(killed, 0), _records(resumed, 0), k)
