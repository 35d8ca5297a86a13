"""A DataModule's loader workers: how many (``num_workers``, budgeted or measured) and on which engine.

``num_workers="auto"`` is the CPU budget of this process (:func:`budget_for`), ``"tune"`` a measured pick cached
under the cache folder (:meth:`WorkerChoice.tuned`, keyed by :func:`tune_key`); ``engine="auto"`` picks worker
processes for CUDA training from :data:`AUTO_PROCESSES_MIN_WORKERS` workers on, threads otherwise
(:meth:`WorkerChoice.engine`). :class:`WorkerChoice` keeps what was picked and said, so each is measured, logged or
warned once per DataModule. The functions take the DataModule's :class:`~lightning_fastdata.plans.LoaderPlan` and the
values (or, where asking costs, the DataModule's methods) they need, and return the choice.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_fastdata import cpus
from lightning_fastdata.keyed_random import draws_process_generators
from lightning_fastdata.pipeline.kernel import fuses
from lightning_fastdata.plans import LoaderPlan
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.tuning import LoaderConfig, TuneCache, quick_tune

#: ``engine="auto"`` picks worker processes for CUDA training from this many workers on (see ``resolved_engine``)
AUTO_PROCESSES_MIN_WORKERS = 4


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


def engine_for(engine: str, output: str, workers: int) -> Literal["threads", "processes"]:
    """The engine for ``workers`` workers: ``engine``, or ``"auto"``'s choice for the loader ``output``.

    See :meth:`WorkerChoice.engine`.
    """
    if engine != "auto":
        return engine  # type: ignore[return-value]
    return "processes" if output == "uint8" and workers >= AUTO_PROCESSES_MIN_WORKERS else "threads"


def default_workers(plan: LoaderPlan, budget: Callable[[], int]) -> int:
    """The worker count an engine is chosen for when none is given: the ``budget()``, or ``num_workers``'s number."""
    return budget() if plan.num_workers in ("auto", "tune") else int(plan.num_workers)


def tune_key(plan: LoaderPlan, database: Path, transform: Any, output: str, trainer: Any) -> str:
    """The key of ``num_workers="tune"``'s cached pick: the database, the transform and what else changes the pick.

    Args:
        plan: the DataModule's loader settings.
        database: the database the training loader reads.
        transform: the training transform.
        output: what the batch reader gives.
        trainer: the Trainer, for the training processes on this node (``None``: one).

    """
    meta = _environments.read_meta(database)
    parts = {
        "database": str(database),
        "created": meta.get("created"),
        "source": meta.get("source", {}).get("fingerprint"),
        "transform": _describe(transform),
        "batch_size": plan.batch_size,
        "usable_cpus": cpus.usable_cpu_count(),
        "processes_per_node": processes_per_node(trainer),
        "decode": plan.decode,
        "output": output,
        "engine": plan.engine,  # the setting: "auto" times each count on the engine it picks for that count
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

    def num_workers(self, plan: LoaderPlan, budget: int, trainer: Any, tune: Callable[[], int]) -> int:
        """The worker count the loaders use (``"auto"``: ``budget``; ``"tune"``: ``tune()``; above it, warned once).

        ``trainer`` tells how many training processes share the CPUs (``None``: one).
        """
        if plan.num_workers == "auto":
            return budget
        if plan.num_workers == "tune":
            return tune()
        if plan.num_workers > budget and not self.warned_workers:
            self.warned_workers = True
            sharing = cpus.cpu_sharing_processes(processes_per_node(trainer))
            rank_zero_warn(
                f"`num_workers={plan.num_workers}` is above this process's budget of {budget}:"
                f" {cpus.usable_cpu_count()} usable CPUs shared by {sharing} training process(es)."
                " Workers beyond the budget compete for cores and usually slow loading; use `num_workers='auto'`."
            )
        return int(plan.num_workers)

    def engine(self, plan: LoaderPlan, output: Callable[[], str], workers: int) -> Literal["threads", "processes"]:
        """The engine the loaders use: ``engine``, or for ``"auto"`` the choice for ``workers``, logged once.

        ``output()`` says what the batch reader gives (asked only for ``"auto"``).

        ``"auto"`` takes worker processes for CUDA training: on a GPU node they fed the GPU faster than threads, whose
        work delayed the training loop's kernel launches. Below 4 workers, and for CPU training, threads: no worker
        start-up, no shared memory for batch slots, and on a CPU worker processes only match them
        (measured: docs/benchmarks.md#engine-auto-worker-processes-for-cuda-training-from-4-workers).
        """
        if plan.engine != "auto":
            return plan.engine
        loader_output = output()
        choice = engine_for(plan.engine, loader_output, workers)
        if choice != self.chosen_engine:
            self.chosen_engine = choice
            why = (
                f"CUDA training with {workers} workers"
                if choice == "processes"
                else "training on the CPU"
                if loader_output == "float"
                else "reading encoded bytes for decode='device'"
                if loader_output == "encoded"
                else f"{workers} worker(s), fewer than {AUTO_PROCESSES_MIN_WORKERS}"
            )
            rank_zero_info(f"FastImageDataModule: engine='auto' chose {choice!r} ({why}).")
        return choice

    def tuned_workers(
        self,
        plan: LoaderPlan,
        cache_root: Path,
        key: Callable[[], str],
        budget: Callable[[], int],
        loader: Callable[[LoaderConfig], DataLoader],
        output: Callable[[], str],
        pin_memory: bool,
    ) -> int:
        """``num_workers="tune"``: the cached pick for this configuration, or a bounded sweep that makes one.

        Args:
            plan: the DataModule's loader settings.
            cache_root: the cache folder, which holds ``tune.json``.
            key: the configuration's key (:func:`tune_key`).
            budget: the most workers to try.
            loader: the training loader with a configuration (``FastImageDataModule.tuning_loader``).
            output: what the batch reader gives (for ``engine="auto"``'s choice at each count).
            pin_memory: whether the loader pins its batches.

        """
        if self.tuned is not None:
            return self.tuned
        cache = TuneCache(cache_root / "tune.json")
        entry_key = key()
        entry = cache.get(entry_key)
        if entry is not None and isinstance(entry.get("num_workers"), int):
            self.tuned = int(entry["num_workers"])
            return self.tuned
        # each count on the engine it would train on: the loader resolves the engine from the tuned count the same way
        result = quick_tune(
            loader,
            plan.batch_size,
            budget(),
            engine=lambda workers: engine_for(plan.engine, output(), workers),
            pin_memory=pin_memory,
        )
        self.tuned = result.pick.config.num_workers
        rank_zero_info(f"num_workers='tune' measured the training loader:\n{result.format_table()}")
        try:
            cache.put(entry_key, {"num_workers": self.tuned, **result.to_dict()})
        except OSError as err:
            rank_zero_warn(
                f"num_workers='tune' picked num_workers={self.tuned} for this run, but could not cache the pick in"
                f" {str(cache.path)!r} ({err.strerror or err}), so the next run measures again. Pass `cache_dir=` a"
                " writable folder (or set LIGHTNING_FASTDATA_CACHE) to keep it."
            )
        return self.tuned

    def say_shared_generators(
        self, dataset: Dataset | None, plan: LoaderPlan, budget: Callable[[], int], engine: Callable[[int], str]
    ) -> None:
        """Say once that the training transform draws from :mod:`random` or NumPy's, which loader threads cannot key.

        A transform or dataset of one's own is read sample by sample, within the sample's key
        (:mod:`lightning_fastdata.keyed_random`): its torch draws and :func:`~.keyed_random.sample_rng`'s are keyed on
        every engine, its draws from Python's and NumPy's process-wide generators only in worker processes and on the
        training thread. Two samples are read once here, as a loader thread reads them, to see whether it draws from
        those (a transform that does not is not told to change).

        Args:
            dataset: the training dataset.
            plan: the DataModule's loader settings.
            budget: the worker budget (asked only when ``num_workers`` is not a number).
            engine: the engine for a worker count (``FastImageDataModule.resolved_engine``).

        """
        if self.said_generators or dataset is None or fuses(dataset):
            return
        workers = self.tuned if self.tuned is not None else default_workers(plan, budget)
        if workers == 0 or engine(workers) != "threads":
            return
        samples = range(min(2, len(dataset)))  # type: ignore[arg-type]
        if not draws_process_generators(dataset.__getitem__, samples, (plan.seed, 0)):
            return
        self.said_generators = True
        rank_zero_warn(
            f"FastImageDataModule: the training transform (or dataset) is your own, read on {workers} loader threads,"
            " and draws from Python's `random` or NumPy's global generator: the threads share those, so its"
            " augmentation differs between runs and after a resume (torch's random draws, as in torchvision's"
            " transforms, are keyed per sample). Draw from `lightning_fastdata.keyed_random.sample_rng()` instead, or"
            " pass `engine='processes'`, which keys those too."
        )
