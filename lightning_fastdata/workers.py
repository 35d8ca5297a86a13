"""A DataModule's loader workers: how many (``num_workers``, budgeted or measured) and on which engine.

``num_workers="auto"`` is the CPU budget of this process (:func:`budget_for`), ``"tune"`` a measured pick cached
under the cache folder (:meth:`WorkerChoice.tuned`, keyed by :func:`tune_key`); ``engine="auto"`` picks worker
processes for CUDA training from :data:`AUTO_PROCESSES_MIN_WORKERS` workers on, threads otherwise
(:meth:`WorkerChoice.engine`). :class:`WorkerChoice` keeps what was picked and said, so each is measured, logged or
warned once per DataModule.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_fastdata import cpus
from lightning_fastdata.keyed_random import draws_process_generators
from lightning_fastdata.pipeline.kernel import fuses
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.tuning import LoaderConfig, TuneCache, quick_tune

#: ``engine="auto"`` picks worker processes for CUDA training from this many workers on (see ``resolved_engine``)
AUTO_PROCESSES_MIN_WORKERS = 4


class _DataModule(Protocol):
    """What the choice reads of a ``FastImageDataModule`` (its methods, so that a subclass's overrides count)."""

    trainer: Any
    num_workers: int | Literal["auto", "tune"]
    engine: Literal["auto", "threads", "processes"]
    batch_size: int
    decode: str
    pin_memory: bool | None
    train_dataset: Dataset | None

    @property
    def cache_root(self) -> Path: ...
    @property
    def database_path(self) -> Path: ...
    def worker_budget(self) -> int: ...
    def resolved_engine(self, workers: int | None = None) -> Literal["threads", "processes"]: ...
    def train_transform(self) -> Callable[[Any], Any]: ...
    def tuning_loader(self, config: LoaderConfig) -> DataLoader: ...
    def _output(self) -> str: ...
    def _on_cuda(self) -> bool: ...


def quiet_lightning_worker_check() -> None:
    """Silence Lightning's "does not have many workers" for this DataModule's loaders, when they build on threads.

    Lightning reads ``DataLoader.num_workers``, which is 0 when batches are built on loader threads, and advises more
    worker processes to a loader that already uses its whole budget. Only that warning, only for the named loaders of
    a Trainer fed by a DataModule (which are all this DataModule's).
    """
    warnings.filterwarnings(
        "ignore",
        message=r"The '(train|val|test|predict)_dataloader' does not have many workers",
        category=PossibleUserWarning,
    )


def _describe(obj: Any) -> str:
    """A stable description of a transform for cache keys: its repr, unless that is the default one (an address)."""
    text = repr(obj)
    if " at 0x" not in text:
        return text
    state = sorted((k, _describe(v)) for k, v in getattr(obj, "__dict__", {}).items())
    return f"{type(obj).__module__}.{type(obj).__qualname__}({state})"


def processes_per_node(trainer: Any) -> int:
    """The training processes on this node: the Trainer's, or 1 without one."""
    return 1 if trainer is None else cpus.processes_per_node(trainer.world_size, trainer.num_nodes)


def budget_for(trainer: Any) -> int:
    """Workers per process that the usable CPUs allow: usable CPUs // training processes sharing them.

    The processes sharing them are the training processes on this node, or only this one when a launcher pinned
    each rank to its own CPUs (see :func:`~lightning_fastdata.cpus.pinned_to_own_cpus`).
    """
    return cpus.worker_budget(1, 1) if trainer is None else cpus.worker_budget(trainer.world_size, trainer.num_nodes)


def engine_for(dm: _DataModule, workers: int) -> Literal["threads", "processes"]:
    """The engine for ``workers`` workers: ``engine``, or ``"auto"``'s choice (see :meth:`WorkerChoice.engine`)."""
    if dm.engine != "auto":
        return dm.engine  # type: ignore[return-value]
    return "processes" if dm._output() == "uint8" and workers >= AUTO_PROCESSES_MIN_WORKERS else "threads"


def tune_key(dm: _DataModule) -> str:
    """The key of ``num_workers="tune"``'s cached pick: the database, the transform and what else changes the pick."""
    meta = _environments.read_meta(dm.database_path)
    transform = dm.train_transform()
    parts = {
        "database": str(dm.database_path),
        "created": meta.get("created"),
        "source": meta.get("source", {}).get("fingerprint"),
        "transform": _describe(transform),
        "batch_size": dm.batch_size,
        "usable_cpus": cpus.usable_cpu_count(),
        "processes_per_node": processes_per_node(dm.trainer),
        "decode": dm.decode,
        "output": dm._output(),
        "engine": dm.engine,  # the setting: "auto" times each count on the engine it picks for that count
    }
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:16]


@dataclass
class WorkerChoice:
    """A DataModule's worker count and engine, and what it measured and said about them (each once)."""

    #: ``num_workers="tune"``'s pick, once measured or read from the cache
    tuned: int | None = None
    #: the engine ``engine="auto"`` chose last (logged when it changes)
    chosen_engine: str | None = None
    #: whether it warned that ``num_workers`` is above the budget
    warned_workers: bool = False
    #: whether it said that loader threads cannot key ``random``'s and NumPy's draws
    said_generators: bool = False

    def num_workers(self, dm: _DataModule) -> int:
        """The worker count the loaders use (``"auto"`` resolved; a value above the budget warns once)."""
        budget = dm.worker_budget()
        if dm.num_workers == "auto":
            return budget
        if dm.num_workers == "tune":
            return self.tuned_workers(dm)
        if dm.num_workers > budget and not self.warned_workers:
            self.warned_workers = True
            sharing = cpus.cpu_sharing_processes(processes_per_node(dm.trainer))
            rank_zero_warn(
                f"`num_workers={dm.num_workers}` is above this process's budget of {budget}:"
                f" {cpus.usable_cpu_count()} usable CPUs shared by {sharing} training process(es)."
                " Workers beyond the budget compete for cores and usually slow loading; use `num_workers='auto'`."
            )
        return int(dm.num_workers)

    def engine(self, dm: _DataModule, workers: int | None = None) -> Literal["threads", "processes"]:
        """The engine the loaders use: ``engine``, or for ``"auto"`` the choice for ``workers``, logged once.

        ``workers`` defaults to the budget, or to ``num_workers`` when it is a number.

        ``"auto"`` follows what issue 18 measured on an H100 node with 16 cores: worker processes fed resnet18 at 8,901
        samples/s against the threads' 5,853, and resnet50 on 4 cores at 3,426 against 3,225, while the threads'
        kernel launches queued behind the loader threads (step p90 71 ms against a p50 of 23 ms). Below 4 workers,
        and for CPU training, threads: no worker start-up, no shared memory for batch slots, and on a CPU worker
        processes only match them (``benchmarks/bench_engines.py``, 2 CPUs).
        """
        if workers is None:
            workers = dm.worker_budget() if dm.num_workers in ("auto", "tune") else int(dm.num_workers)
        choice = engine_for(dm, workers)
        if dm.engine == "auto" and choice != self.chosen_engine:
            self.chosen_engine = choice
            why = (
                f"CUDA training with {workers} workers"
                if choice == "processes"
                else "training on the CPU"
                if dm._output() == "float"
                else "reading encoded bytes for decode='device'"
                if dm._output() == "encoded"
                else f"{workers} worker(s), fewer than {AUTO_PROCESSES_MIN_WORKERS}"
            )
            rank_zero_info(f"FastImageDataModule: engine='auto' chose {choice!r} ({why}).")
        return choice

    def tuned_workers(self, dm: _DataModule) -> int:
        """``num_workers="tune"``: the cached pick for this configuration, or a bounded sweep that makes one."""
        if self.tuned is not None:
            return self.tuned
        cache = TuneCache(dm.cache_root / "tune.json")
        key = tune_key(dm)
        entry = cache.get(key)
        if entry is not None and isinstance(entry.get("num_workers"), int):
            self.tuned = int(entry["num_workers"])
            return self.tuned
        pin_memory = dm._on_cuda() if dm.pin_memory is None else dm.pin_memory
        # each count on the engine it would train on: the loader resolves the engine from the tuned count the same way
        result = quick_tune(
            dm.tuning_loader,
            dm.batch_size,
            dm.worker_budget(),
            engine=lambda workers: engine_for(dm, workers),
            pin_memory=pin_memory,
        )
        self.tuned = result.pick.config.num_workers
        rank_zero_info(f"num_workers='tune' measured the training loader:\n{result.format_table()}")
        try:
            cache.put(key, {"num_workers": self.tuned, **result.to_dict()})
        except OSError as err:
            rank_zero_warn(
                f"num_workers='tune' picked num_workers={self.tuned} for this run, but could not cache the pick in"
                f" {str(cache.path)!r} ({err.strerror or err}), so the next run measures again. Pass `cache_dir=` a"
                " writable folder (or set LIGHTNING_FASTDATA_CACHE) to keep it."
            )
        return self.tuned

    def say_shared_generators(self, dm: _DataModule) -> None:
        """Say once that the training transform draws from :mod:`random` or NumPy's, which loader threads cannot key.

        A transform or dataset of one's own is read sample by sample, within the sample's key
        (:mod:`lightning_fastdata.keyed_random`): its torch draws and :func:`~.keyed_random.sample_rng`'s are keyed on
        every engine, its draws from Python's and NumPy's process-wide generators only in worker processes and on the
        training thread. Two samples are read once here, as a loader thread reads them, to see whether it draws from
        those (a transform that does not is not told to change).
        """
        if self.said_generators or dm.train_dataset is None or fuses(dm.train_dataset):
            return
        workers = self.tuned
        if workers is None:
            workers = dm.worker_budget() if dm.num_workers in ("auto", "tune") else int(dm.num_workers)
        if workers == 0 or dm.resolved_engine(workers) != "threads":
            return
        dataset = dm.train_dataset
        samples = range(min(2, len(dataset)))  # type: ignore[arg-type]
        if not draws_process_generators(dataset.__getitem__, samples, (dm.seed, 0)):
            return
        self.said_generators = True
        rank_zero_warn(
            f"FastImageDataModule: the training transform (or dataset) is your own, read on {workers} loader threads,"
            " and draws from Python's `random` or NumPy's global generator: the threads share those, so its"
            " augmentation differs between runs and after a resume (torch's random draws, as in torchvision's"
            " transforms, are keyed per sample). Draw from `lightning_fastdata.keyed_random.sample_rng()` instead, or"
            " pass `engine='processes'`, which keys those too."
        )
