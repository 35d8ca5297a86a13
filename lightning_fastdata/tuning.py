"""Tune a DataLoader by measuring it: sweep ``num_workers`` (and batch size, ``prefetch_factor``, ``pin_memory``).

The founding advice: raise ``num_workers`` step by step and stop where throughput stops growing. Each point is a
fresh DataLoader, timed after its warm-up batches (worker start-up left out) for a bounded time; the sweep over
workers stops early once throughput falls. The pick is the cheapest configuration within ``tolerance`` of the best.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_fastdata.cpus import CpuMeter, usable_cpu_count


@dataclass(frozen=True)
class LoaderConfig:
    """One DataLoader configuration of a sweep."""

    num_workers: int
    batch_size: int
    prefetch_factor: int | None = None
    pin_memory: bool = False
    #: ``"processes"`` (DataLoader workers) or ``"threads"`` (a
    #: :class:`~lightning_fastdata.pipeline.factory.FastLoader`'s)
    engine: str = "processes"

    def cost(self) -> tuple[int, int, int, int]:
        """Orders configurations from cheapest: fewer workers, less prefetch, no pinning, smaller batches."""
        return (self.num_workers, self.prefetch_factor or 0, int(self.pin_memory), self.batch_size)

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a DataLoader (or, with threads, a ``FastLoader``) with this configuration."""
        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "pin_memory": self.pin_memory}
        if self.engine == "threads":
            kwargs["threads"] = self.num_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_batches"] = self.prefetch_factor * max(1, self.num_workers)
            return kwargs
        kwargs["num_workers"] = self.num_workers
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


@dataclass
class Measurement:
    """Throughput of one configuration."""

    config: LoaderConfig
    images_per_sec: float
    cpu_util: float | None
    batches: int
    seconds: float


@dataclass
class SweepResult:
    """Every measurement of a sweep, and the pick: the cheapest configuration within ``tolerance`` of the best."""

    measurements: list[Measurement]
    tolerance: float
    usable_cpus: int
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Measurement:
        """The fastest measurement."""
        return max(self.measurements, key=lambda m: m.images_per_sec)

    @property
    def pick(self) -> Measurement:
        """The cheapest measurement within ``tolerance`` of the best."""
        floor = (1.0 - self.tolerance) * self.best.images_per_sec
        return min((m for m in self.measurements if m.images_per_sec >= floor), key=lambda m: m.config.cost())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every point, the best and the pick."""
        return {
            "usable_cpus": self.usable_cpus,
            "tolerance": self.tolerance,
            "measurements": [
                {**asdict(m.config), **{k: v for k, v in asdict(m).items() if k != "config"}} for m in self.measurements
            ],
            "best": asdict(self.best.config),
            "pick": asdict(self.pick.config),
            "notes": self.notes,
        }

    def format_table(self) -> str:
        """The sweep as a Markdown table, the pick marked."""
        best, pick = self.best.images_per_sec, self.pick
        lines = [
            "| num_workers | batch_size | prefetch_factor | pin_memory | images/s | vs best | CPU use | |",
            "|---:|---:|---:|---|---:|---:|---:|---|",
        ]
        for m in self.measurements:
            c = m.config
            cpu = f"{m.cpu_util:.0f}%" if m.cpu_util is not None else "-"
            mark = "**pick**" if m is pick else ""
            lines.append(
                f"| {c.num_workers} | {c.batch_size} | {c.prefetch_factor or '-'} | {c.pin_memory} |"
                f" {m.images_per_sec:.0f} | {m.images_per_sec / best:.0%} | {cpu} | {mark} |"
            )
        lines.append(
            f"pick: num_workers={pick.config.num_workers}, batch_size={pick.config.batch_size}, prefetch_factor="
            f"{pick.config.prefetch_factor or 'default'}, pin_memory={pick.config.pin_memory} — the cheapest within"
            f" {self.tolerance:.0%} of the best ({best:.0f} images/s); {self.usable_cpus} usable CPUs"
        )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


#: builds the loader to time for a configuration: for a database, the training loader as ``fit`` builds it
#: (:meth:`~lightning_fastdata.FastImageDataModule.tuning_loader`)
LoaderFactory = Callable[[LoaderConfig], Iterable[Any]]


def measure(
    source: Dataset | LoaderFactory,
    config: LoaderConfig,
    seconds: float = 1.0,
    warmup_batches: int = 2,
    max_batches: int | None = None,
    seed: int = 0,
) -> Measurement:
    """Images/s of ``source`` with ``config``, after ``warmup_batches``.

    ``source`` is a loader factory (a training loader as it runs in ``fit``: its epochs are read one after another) or
    a dataset (read through a fresh DataLoader, samples drawn at random with replacement, so a small dataset never
    runs out). Timing stops after ``seconds`` (or ``max_batches``); batches that arrive on a GPU are waited for before
    the clock stops. CPU use counts this process and its workers, as a share of the usable CPUs. With
    ``num_workers=0`` the loading runs in this process with one intra-op thread, as in a worker: with all of them,
    OpenMP spin-waits made that row slow and erratic on a loaded machine.
    """
    if config.num_workers == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _measure(source, config, seconds, warmup_batches, max_batches, seed)
        finally:
            torch.set_num_threads(threads)
    return _measure(source, config, seconds, warmup_batches, max_batches, seed)


def _measure(
    source: Dataset | LoaderFactory,
    config: LoaderConfig,
    seconds: float,
    warmup_batches: int,
    max_batches: int | None,
    seed: int,
) -> Measurement:
    with warnings.catch_warnings():  # a sweep goes past the CPU count and the budget on purpose: no warning for it
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        warnings.filterwarnings("ignore", message=".*is above this process's budget.*")
        if callable(source) and not isinstance(source, Dataset):
            loader = source(config)
            iterator = _epochs(loader)
        else:
            generator = torch.Generator().manual_seed(seed)
            total = (warmup_batches + (max_batches or 10**6)) * config.batch_size
            sampler = RandomSampler(source, replacement=True, num_samples=total, generator=generator)  # type: ignore[arg-type]
            loader = _loader(source, sampler, config)  # warns here as well as in iter()
            iterator = iter(loader)
    try:
        batch = None
        for _ in range(warmup_batches):
            batch = next(iterator)
        _wait_for(batch)
        meter = CpuMeter()
        start = time.perf_counter()
        images = batches = 0
        while True:
            batch = next(iterator)
            images += _batch_len(batch)
            batches += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds or (max_batches is not None and batches >= max_batches):
                _wait_for(batch)
                elapsed = time.perf_counter() - start
                break
        cpu = meter.take()
    finally:
        del iterator, loader  # shuts the workers down now, not at garbage collection
    return Measurement(config, images / elapsed, cpu, batches, elapsed)


def _epochs(loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``loader``'s epochs, one epoch after another (a training loader has a fixed length)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader to measure yields no batch: is its dataset smaller than one batch?")


def _wait_for(batch: Any) -> None:
    """Wait for the GPU to finish a batch that was copied (and normalized) there asynchronously."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, torch.Tensor) and first.is_cuda:
        torch.cuda.synchronize(first.device)


def _loader(dataset: Dataset, sampler: Any, config: LoaderConfig) -> DataLoader:
    """A loader of ``dataset`` as it comes (a ``BatchReader`` reads whole batches), built as every loader is."""
    from lightning_fastdata.pipeline import create_loader

    return create_loader(
        dataset,
        config.batch_size,
        sampler=sampler,
        engine="threads" if config.engine == "threads" else "processes",
        workers=config.num_workers,
        prefetch_factor=config.prefetch_factor,
        persistent_workers=False,  # a fresh loader per point: its workers stop with it
        output=None,
        pin_memory=config.pin_memory,
    )


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its images, or of its first view (``views``: a list of them)."""
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first[0]) if isinstance(first, (list, tuple)) else len(first)


def sweep(
    source: Dataset | LoaderFactory,
    batch_sizes: Sequence[int] = (64,),
    max_workers: int | None = None,
    prefetch_factors: Sequence[int] = (2, 4),
    pin_memory: Iterable[bool] | None = None,
    seconds: float = 1.0,
    tolerance: float = 0.05,
    early_stop: float = 0.1,
    engine: str | Callable[[int], str] = "processes",
) -> SweepResult:
    """Measure ``num_workers`` from 0 up to the usable CPUs plus one, then the other knobs at the best worker count.

    Args:
        source: a loader factory (:data:`LoaderFactory`: the training loader for a configuration), or a dataset to
            read through a DataLoader (with its transforms).
        batch_sizes: batch sizes to try (each gets its own worker sweep).
        max_workers: the highest worker count; default: usable CPUs + 1 (one beyond the budget, to show it).
        prefetch_factors: tried at the best worker count (when it is > 0).
        pin_memory: values tried at the best configuration; default: ``(False, True)`` with CUDA, else ``(False,)``.
        seconds: timed length of each point (worker start-up excluded).
        tolerance: the pick is the cheapest configuration within this share of the best.
        early_stop: stop raising workers once throughput falls this share below the best so far with workers
            (``num_workers=0`` is not compared: one worker does the same serial work plus the copying).
        engine: ``"processes"`` (DataLoader workers) or ``"threads"`` (a ``FastLoader`` over a ``BatchReader``), or
            a function of the worker count giving one of them: each count is timed on the engine it would run on
            (``FastImageDataModule(engine="auto")`` picks it by count).

    """
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"`batch_sizes` needs at least one size >= 1, got {list(batch_sizes)}.")
    if max_workers is not None and max_workers < 0:
        raise ValueError(f"`max_workers` must be >= 0, got {max_workers}.")
    engine_for = engine if callable(engine) else lambda workers: engine
    cpus = usable_cpu_count()
    top = cpus + 1 if max_workers is None else max_workers
    pins = tuple(pin_memory) if pin_memory is not None else ((False, True) if torch.cuda.is_available() else (False,))
    result = SweepResult([], tolerance, cpus)
    for batch_size in batch_sizes:
        best_rate = 0.0
        for workers in range(top + 1):
            m = measure(source, LoaderConfig(workers, batch_size, engine=engine_for(workers)), seconds)
            result.measurements.append(m)
            if workers == 0:  # loading in the main process is off the curve: one worker is rarely faster, two may be
                continue
            best_rate = max(best_rate, m.images_per_sec)
            if m.images_per_sec < (1.0 - early_stop) * best_rate:
                result.notes.append(
                    f"batch_size={batch_size}: stopped at num_workers={workers}, {m.images_per_sec:.0f} images/s is"
                    f" more than {early_stop:.0%} below the best"
                )
                break
    best = result.best.config
    if best.num_workers > 0:
        for factor in prefetch_factors:
            if factor != 2:  # 2 is PyTorch's default, already measured
                config = LoaderConfig(best.num_workers, best.batch_size, factor, engine=best.engine)
                result.measurements.append(measure(source, config, seconds))
    for pin in pins:
        if pin:
            c = result.best.config
            result.measurements.append(
                measure(source, LoaderConfig(c.num_workers, c.batch_size, c.prefetch_factor, True, c.engine), seconds)
            )
    return result


def quick_tune(
    source: Dataset | LoaderFactory,
    batch_size: int,
    budget: int,
    seconds: float = 0.4,
    engine: str | Callable[[int], str] = "processes",
    pin_memory: bool = False,
) -> SweepResult:
    """The bounded sweep of ``num_workers="tune"``.

    Workers 0 up to ``budget`` at one batch size (and the training loader's ``pin_memory``), a fraction of a second
    each, stopping early once throughput falls; each count on its ``engine`` (see :func:`sweep`).
    """
    return sweep(
        source,
        batch_sizes=(batch_size,),
        max_workers=budget,
        prefetch_factors=(),
        pin_memory=(pin_memory,),
        seconds=seconds,
        tolerance=0.05,
        engine=engine,
    )


class TuneCache:
    """Picked worker counts on disk, keyed by what they depend on (dataset, transforms, batch size, CPUs)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached entry for ``key``, or ``None``."""
        entry = self._load().get(key)
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` under ``key`` (written to a temporary file, then renamed).

        Raises:
            OSError: the cache cannot be written (a read-only folder, a full disk); no temporary file is left.

        """
        data = self._load()
        data[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


def plot_sweep(result: SweepResult, path: str | os.PathLike[str]) -> None:
    """Images/s against ``num_workers``, one line per batch size, the pick marked (needs matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for batch_size in sorted({m.config.batch_size for m in result.measurements}):
        points = sorted(
            (m.config.num_workers, m.images_per_sec)
            for m in result.measurements
            if m.config.batch_size == batch_size and m.config.prefetch_factor is None and not m.config.pin_memory
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"batch_size={batch_size}")
    pick = result.pick
    ax.scatter(
        [pick.config.num_workers], [pick.images_per_sec], s=160, facecolors="none", edgecolors="red", label="pick"
    )
    ax.axvline(result.usable_cpus, color="grey", linestyle=":", label=f"{result.usable_cpus} usable CPUs")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("num_workers")
    ax.set_ylabel("images/s")
    ax.set_title("lightning-fastdata bench")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
