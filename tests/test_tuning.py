from __future__ import annotations

import json
import multiprocessing
import os
import time
import warnings

import psutil
import pytest
import torch
from fakes import fake_trainer, hide_cuda
from torch.utils.data import Dataset

import lightning_fastdata.tuning as tuning
from lightning_fastdata import FastImageDataModule, make_image_folder
from lightning_fastdata.tuning import (
    LoaderConfig,
    Measurement,
    SweepResult,
    TuneCache,
    measure,
    plot_sweep,
    sweep,
)
from lightning_fastdata.workers import tune_key

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Tensors(Dataset):
    """``n`` small in-memory samples ``(image, label)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 8, 8), index, dtype=torch.uint8), index


class _Sleepy(Dataset):
    """Every sample costs a fixed sleep: no CPU, so more workers help even on a small machine."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        return torch.zeros(3, 4, 4), index


def _m(workers: int, rate: float, batch_size: int = 64, prefetch: int | None = None, pin: bool = False) -> Measurement:
    return Measurement(LoaderConfig(workers, batch_size, prefetch, pin), rate, None, 10, 1.0)


def _result(*measurements: Measurement, tolerance: float = 0.05) -> SweepResult:
    return SweepResult(list(measurements), tolerance, usable_cpus=4)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _no_new_worker_processes(before: set[int]) -> None:
    """No worker started by the code under test is still alive (other tests' leftovers do not count)."""
    assert {p.pid for p in multiprocessing.active_children()} <= before
    assert _children() <= before


# ---------------------------------------------------------------------------------------------------------------
# SweepResult: best, pick, to_dict, format_table
# ---------------------------------------------------------------------------------------------------------------


def test_pick_of_a_tie_is_the_cheaper_config():
    """Equal throughput: the pick is the configuration with fewer workers, the best is still a fastest one."""
    result = _result(_m(2, 1000.0), _m(1, 1000.0), _m(3, 1000.0))
    assert result.pick.config.num_workers == 1
    assert result.best.images_per_sec == 1000.0


@pytest.mark.parametrize(("share", "picked"), [(0.96, 1), (0.94, 4)])
def test_pick_is_the_cheapest_within_tolerance(share, picked):
    """With tolerance 0.05 a cheaper config at 96% of the best is picked; at 94% the best is."""
    result = _result(_m(4, 1000.0), _m(1, 1000.0 * share), _m(0, 500.0), tolerance=0.05)
    assert result.best.config.num_workers == 4
    assert result.pick.config.num_workers == picked


def test_pick_tolerance_zero_is_the_best():
    """``tolerance=0`` picks the fastest configuration even when a cheaper one is within 1%."""
    result = _result(_m(1, 995.0), _m(2, 1000.0), tolerance=0.0)
    assert result.pick is result.best


def test_pick_cost_order_workers_prefetch_pin_batch_size():
    """Cost orders workers first, then prefetch_factor, then pin_memory, then batch size (all at equal speed)."""
    workers = _result(_m(1, 100.0, batch_size=8), _m(0, 100.0, batch_size=256, prefetch=4, pin=True))
    assert workers.pick.config == LoaderConfig(0, 256, 4, True)
    prefetch = _result(_m(2, 100.0, batch_size=8, prefetch=4), _m(2, 100.0, batch_size=256, pin=True))
    assert prefetch.pick.config == LoaderConfig(2, 256, None, True)
    pin = _result(_m(2, 100.0, batch_size=8, pin=True), _m(2, 100.0, batch_size=256))
    assert pin.pick.config == LoaderConfig(2, 256, None, False)
    batch = _result(_m(2, 100.0, batch_size=256), _m(2, 100.0, batch_size=32))
    assert batch.pick.config == LoaderConfig(2, 32, None, False)


def test_loader_kwargs_drop_prefetch_without_workers():
    """``prefetch_factor`` reaches the DataLoader only with workers (PyTorch rejects it otherwise)."""
    assert "prefetch_factor" not in LoaderConfig(0, 16, 4).loader_kwargs()
    assert LoaderConfig(2, 16, 4, True).loader_kwargs() == {
        "batch_size": 16,
        "num_workers": 2,
        "pin_memory": True,
        "prefetch_factor": 4,
    }


def test_to_dict_has_every_measurement_best_and_pick():
    """``to_dict`` lists every point with its config and numbers, the best and the pick, and is JSON-ready."""
    result = _result(_m(0, 400.0), _m(1, 980.0), _m(2, 1000.0), _m(2, 900.0, prefetch=4))
    result.notes.append("a note")
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["measurements"]) == 4
    assert [(p["num_workers"], p["prefetch_factor"], p["images_per_sec"]) for p in data["measurements"]] == [
        (0, None, 400.0),
        (1, None, 980.0),
        (2, None, 1000.0),
        (2, 4, 900.0),
    ]
    assert set(data["measurements"][0]) == {
        "engine",
        "num_workers",
        "batch_size",
        "prefetch_factor",
        "pin_memory",
        "images_per_sec",
        "cpu_util",
        "batches",
        "seconds",
    }
    assert data["best"] == {
        "num_workers": 2,
        "batch_size": 64,
        "prefetch_factor": None,
        "pin_memory": False,
        "engine": "processes",
    }
    assert data["pick"] == {
        "num_workers": 1,
        "batch_size": 64,
        "prefetch_factor": None,
        "pin_memory": False,
        "engine": "processes",
    }
    assert data["tolerance"] == 0.05
    assert data["usable_cpus"] == 4
    assert data["notes"] == ["a note"]


def test_format_table_marks_the_pick_once():
    """The table has a row per point and marks the pick's row, once, even when another point equals it."""
    twin = _m(1, 990.0)
    result = _result(_m(0, 300.0), twin, _m(1, 990.0), _m(2, 1000.0))
    table = result.format_table()
    assert table.count("**pick**") == 1
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    marked = [i for i, row in enumerate(rows) if "**pick**" in row]
    assert marked == [result.measurements.index(result.pick)]
    assert rows[marked[0]].startswith("| 1 | 64 |")
    assert "pick: num_workers=1, batch_size=64" in table
    assert rows[0].endswith("| 300 | 30% | - |  |")  # images/s, share of the best, no CPU reading, no mark


# ---------------------------------------------------------------------------------------------------------------
# measure
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_measure_counts_batches_and_stops_at_max_batches(workers):
    """``measure`` times whole batches, stops at ``max_batches`` long before ``seconds``, leaves no workers."""
    before = _children()
    m = measure(_Tensors(100), LoaderConfig(workers, 8), seconds=60.0, max_batches=3)
    assert m.batches == 3  # not ``seconds``: 3 batches of 8 from memory take far less than 60 s
    assert m.images_per_sec > 0
    assert m.config == LoaderConfig(workers, 8)
    _no_new_worker_processes(before)


def test_measure_dataset_smaller_than_a_batch():
    """Sampling with replacement: 3 samples fill batches of 8 and timing runs for ``seconds``."""
    before = _children()
    m = measure(_Tensors(3), LoaderConfig(1, 8), seconds=0.2)
    assert m.batches > 0
    assert m.images_per_sec > 0
    assert m.seconds >= 0.2
    assert m.images_per_sec == pytest.approx(8 * m.batches / m.seconds)
    _no_new_worker_processes(before)


def test_measure_does_not_warn_about_workers_beyond_the_cpus(monkeypatch):
    """Going past the CPU count is what a sweep does: PyTorch's "suggested max" warning is silenced."""
    before = _children()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measure(_Tensors(16), LoaderConfig(2, 4), seconds=0.05, max_batches=1)
    assert [str(w.message) for w in caught if "worker processes in total" in str(w.message)] == []
    _no_new_worker_processes(before)


# ---------------------------------------------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------------------------------------------


def test_sweep_measures_each_worker_count_of_a_sleepy_dataset():
    """Workers 0..max_workers are measured in order and the pick is one of them; without workers, the rate is within
    the dataset's 5 ms sleep per sample (a bound load cannot break: it only slows a run down)."""
    before = _children()
    result = sweep(
        _Sleepy(64, 0.005),
        batch_sizes=(8,),
        max_workers=3,
        prefetch_factors=(),
        pin_memory=(False,),
        seconds=0.3,
        early_stop=1.0,
    )
    assert [m.config for m in result.measurements] == [LoaderConfig(w, 8) for w in range(4)]
    rates = [m.images_per_sec for m in result.measurements]
    assert all(rate > 0 for rate in rates)
    assert rates[0] <= 1.0 / 0.005  # in this process, one sample after another: each costs its sleep
    assert result.pick in result.measurements
    assert result.notes == []
    _no_new_worker_processes(before)


class _FakeMeasure:
    """Stands in for ``measure``: a rate per configuration, every call recorded."""

    def __init__(self, rates: dict[int, float], prefetch_rate: float = 0.0, pin_rate: float = 0.0) -> None:
        self.rates = rates
        self.prefetch_rate = prefetch_rate
        self.pin_rate = pin_rate
        self.calls: list[LoaderConfig] = []

    def __call__(self, dataset: Dataset, config: LoaderConfig, seconds: float = 1.0) -> Measurement:
        self.calls.append(config)
        if config.pin_memory:
            rate = self.pin_rate
        elif config.prefetch_factor is not None:
            rate = self.prefetch_rate
        else:
            rate = self.rates[config.num_workers] * 64 / config.batch_size
        return Measurement(config, rate, None, 1, seconds)


def _fake_sweep(monkeypatch, fake: _FakeMeasure, **kwargs) -> SweepResult:
    monkeypatch.setattr(tuning, "measure", fake)
    kwargs = {"batch_sizes": (64,), "max_workers": 5, "prefetch_factors": (), "pin_memory": (False,), **kwargs}
    return sweep(_Tensors(4), **kwargs)


def test_sweep_stops_early_once_throughput_falls(monkeypatch):
    """A drop of more than ``early_stop`` below the best stops the sweep: higher counts are not measured."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0, 2: 300.0, 3: 260.0, 4: 400.0, 5: 500.0})
    result = _fake_sweep(monkeypatch, fake, early_stop=0.1)
    assert [c.num_workers for c in fake.calls] == [0, 1, 2, 3]
    assert len(result.notes) == 1
    assert "batch_size=64: stopped at num_workers=3" in result.notes[0]
    assert "note: batch_size=64: stopped at num_workers=3" in result.format_table()
    assert result.pick.config.num_workers == 2


def test_sweep_goes_on_through_a_drop_within_early_stop(monkeypatch):
    """A drop smaller than ``early_stop`` does not stop the sweep."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0, 2: 300.0, 3: 280.0, 4: 400.0, 5: 500.0})
    result = _fake_sweep(monkeypatch, fake, early_stop=0.1)
    assert [c.num_workers for c in fake.calls] == [0, 1, 2, 3, 4, 5]
    assert result.notes == []
    assert result.pick.config.num_workers == 5


def test_sweep_one_worker_slower_than_none_does_not_stop_it(monkeypatch):
    """One worker is often slower than loading in the main process; that alone must not end the sweep."""
    fake = _FakeMeasure({0: 1000.0, 1: 700.0, 2: 1400.0, 3: 1200.0})
    result = _fake_sweep(monkeypatch, fake, max_workers=3)
    assert [c.num_workers for c in fake.calls] == [0, 1, 2, 3]
    assert result.pick.config.num_workers == 2
    assert len(result.notes) == 1
    assert "stopped at num_workers=3" in result.notes[0]


def test_sweep_each_batch_size_gets_its_own_worker_sweep(monkeypatch):
    """Every batch size is swept from 0 workers, with its own early stop."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0, 2: 100.0, 3: 500.0})
    _fake_sweep(monkeypatch, fake, batch_sizes=(32, 64), max_workers=3)
    assert [(c.batch_size, c.num_workers) for c in fake.calls] == [(32, w) for w in range(3)] + [
        (64, w) for w in range(3)
    ]


def test_sweep_default_max_workers_is_usable_cpus_plus_one(monkeypatch):
    """Without ``max_workers`` the sweep goes one beyond the usable CPUs."""
    monkeypatch.setattr(tuning, "usable_cpu_count", lambda: 3)
    fake = _FakeMeasure({w: 100.0 * (w + 1) for w in range(5)})
    result = _fake_sweep(monkeypatch, fake, max_workers=None)
    assert [c.num_workers for c in fake.calls] == [0, 1, 2, 3, 4]
    assert result.usable_cpus == 3


def test_sweep_prefetch_points_at_the_best_worker_count(monkeypatch):
    """``prefetch_factors`` are tried at the best worker count, 2 (PyTorch's default) not twice."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0, 2: 300.0, 3: 250.0}, prefetch_rate=310.0)
    result = _fake_sweep(monkeypatch, fake, max_workers=3, prefetch_factors=(2, 4, 8))
    assert fake.calls[4:] == [LoaderConfig(2, 64, 4), LoaderConfig(2, 64, 8)]
    assert result.best.config == LoaderConfig(2, 64, 4)


def test_sweep_no_prefetch_points_when_zero_workers_is_best(monkeypatch):
    """When no workers is fastest there is no prefetching to tune."""
    fake = _FakeMeasure({0: 1000.0, 1: 300.0, 2: 200.0}, prefetch_rate=5000.0)
    result = _fake_sweep(monkeypatch, fake, max_workers=2, prefetch_factors=(4,))
    assert all(c.prefetch_factor is None for c in fake.calls)
    assert result.pick.config == LoaderConfig(0, 64)


def test_sweep_pin_memory_adds_a_pinned_point_at_the_best(monkeypatch):
    """``pin_memory=(False, True)`` adds one pinned point at the best configuration (prefetch included)."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0, 2: 300.0}, prefetch_rate=350.0, pin_rate=340.0)
    result = _fake_sweep(monkeypatch, fake, max_workers=2, prefetch_factors=(4,), pin_memory=(False, True))
    assert fake.calls[-1] == LoaderConfig(2, 64, 4, True)
    assert sum(c.pin_memory for c in fake.calls) == 1
    assert result.best.config == LoaderConfig(2, 64, 4)
    assert result.pick.config == LoaderConfig(2, 64, 4)  # the pinned point is within 5% but costs more


def test_sweep_pin_memory_default_follows_cuda(monkeypatch):
    """Without ``pin_memory`` the pinned point is measured only when CUDA is available."""
    fake = _FakeMeasure({0: 100.0, 1: 200.0}, pin_rate=50.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fake_sweep(monkeypatch, fake, max_workers=1, pin_memory=None)
    assert not any(c.pin_memory for c in fake.calls)
    fake.calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_sweep(monkeypatch, fake, max_workers=1, pin_memory=None)
    assert fake.calls[-1] == LoaderConfig(1, 64, None, True)


# ---------------------------------------------------------------------------------------------------------------
# TuneCache
# ---------------------------------------------------------------------------------------------------------------


def test_tune_cache_round_trip(tmp_path):
    """``put`` then ``get`` returns the entry, keeps other keys, creates the folder, leaves no temp file."""
    cache = TuneCache(tmp_path / "sub" / "tune.json")
    assert cache.get("a") is None
    cache.put("a", {"num_workers": 2, "notes": ["x"]})
    cache.put("b", {"num_workers": 0})
    assert cache.get("a") == {"num_workers": 2, "notes": ["x"]}
    assert TuneCache(tmp_path / "sub" / "tune.json").get("b") == {"num_workers": 0}
    cache.put("a", {"num_workers": 3})
    assert cache.get("a") == {"num_workers": 3}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["tune.json"]


@pytest.mark.parametrize(
    ("text", "after"),
    [
        ("{not json", {}),
        ("", {}),
        ("[1, 2]", {}),
        ('{"a": 5}', {"a": 5}),  # a key whose entry is not a dict: no entry, but the file is a cache
    ],
)
def test_tune_cache_unreadable_reads_as_empty(tmp_path, text, after):
    """A corrupt or foreign file gives no entry, and the next ``put`` writes a valid file."""
    path = tmp_path / "tune.json"
    path.write_text(text)
    cache = TuneCache(path)
    assert cache.get("a") is None
    cache.put("b", {"num_workers": 1})
    assert json.loads(path.read_text()) == {**after, "b": {"num_workers": 1}}
    assert cache.get("b") == {"num_workers": 1}


def test_tune_cache_failed_write_keeps_the_old_file(tmp_path):
    """An entry that cannot be written leaves the previous file intact and no temporary file behind."""
    path = tmp_path / "tune.json"
    cache = TuneCache(path)
    cache.put("a", {"num_workers": 1})
    before = path.read_text()
    with pytest.raises(TypeError):
        cache.put("b", {"num_workers": object()})
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tune.json"]


# ---------------------------------------------------------------------------------------------------------------
# plot_sweep
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plot_sweep_writes_a_png(tmp_path):
    """``plot_sweep`` saves a PNG of the sweep."""
    pytest.importorskip("matplotlib")
    result = _result(_m(0, 100.0), _m(1, 180.0), _m(2, 250.0), _m(2, 260.0, prefetch=4), _m(0, 90.0, batch_size=32))
    out = tmp_path / "sweep.png"
    plot_sweep(result, out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert out.stat().st_size > 1000


# ---------------------------------------------------------------------------------------------------------------
# FastImageDataModule(num_workers="tune")
# ---------------------------------------------------------------------------------------------------------------


def _key(dm: FastImageDataModule) -> str:
    """The key ``dm``'s ``num_workers="tune"`` pick is cached under (its loader plan, database, transform, output)."""
    return tune_key(
        dm.loader_plan, dm.database_path, dm.train_transform(), dm._loaders.output(dm.decode, dm._device()), dm.trainer
    )


def test_datamodule_tune_picks_the_cheapest_count_within_5_percent_and_caches_it(tmp_path, monkeypatch):
    """`num_workers="tune"` measures 0 up to the budget on the training loader, keeps the cheapest count within 5%.

    The rates are scripted (a timed assertion flakes on a loaded machine); the real tuned-vs-exhaustive comparison
    is ``benchmarks/bench_tune.py``.
    """
    rates = {0: 100.0, 1: 180.0, 2: 190.0, 3: 195.0}
    seen = []
    hide_cuda(monkeypatch)  # CPU training: no page-locked point after the counts (the CUDA sweep is the next test's)

    def scripted(source, config, seconds=1.0, **kwargs):
        loader = source(config)  # the training loader, as `fit` builds it, with this configuration
        seen.append((type(loader.dataset).__name__, config.engine, loader.workers))
        return tuning.Measurement(config, rates[config.num_workers], None, 5, seconds)

    monkeypatch.setattr(tuning, "measure", scripted)
    monkeypatch.setattr(FastImageDataModule, "worker_budget", lambda self: 3)
    src = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=4, val_per_class=0, min_size=40, max_size=48
    )
    settings = {"cache_dir": str(tmp_path / "cache"), "num_workers": "tune", "batch_size": 4}
    dm = FastImageDataModule(str(src), **settings)
    dm.prepare_data()
    dm.setup("fit")
    tuned = dm.resolved_num_workers()
    assert tuned == 2  # 195 is the best; 190 is within 5% of it, 180 is not
    assert (dm.num_workers, dm.hparams["num_workers"]) == (2, "tune")  # the pick is readable; the setting is saved
    assert seen == [("BatchReader", "threads", n) for n in range(4)]  # the loader training uses
    assert dm.train_dataloader().workers == 2

    cache_file = tmp_path / "cache" / "tune.json"
    assert dm.cache_root / "tune.json" == cache_file
    entry = json.loads(cache_file.read_text())[_key(dm)]
    assert entry["num_workers"] == tuned
    assert [p["num_workers"] for p in entry["measurements"]] == [0, 1, 2, 3]

    def no_sweep(*args, **kwargs):
        raise AssertionError("the cached pick should have been used")

    monkeypatch.setattr("lightning_fastdata.workers.quick_tune", no_sweep)
    again = FastImageDataModule(str(src), **settings)
    again.prepare_data()
    assert again.resolved_num_workers() == tuned
    assert _key(again) == _key(dm)

    other = FastImageDataModule(str(src), **{**settings, "batch_size": 16})
    assert _key(other) != _key(dm)
    with pytest.raises(AssertionError, match="cached pick"):
        other.resolved_num_workers()


def test_datamodule_tune_times_each_count_on_the_engine_it_trains_on(tmp_path, monkeypatch):
    """On CUDA with `engine="auto"`, counts below 4 are timed on threads and 4 up on worker processes, as `fit` would
    run them; the pick then trains on the engine it was timed on."""
    rates = {0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0, 4: 400.0, 5: 405.0}
    seen = []

    def scripted(source, config, seconds=1.0, **kwargs):
        loader = source(config)
        seen.append((config.num_workers, config.engine, loader.engine))
        return tuning.Measurement(config, rates[config.num_workers], None, 5, seconds)

    monkeypatch.setattr(tuning, "measure", scripted)
    monkeypatch.setattr(FastImageDataModule, "worker_budget", lambda self: 5)
    src = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=4, val_per_class=0, min_size=40, max_size=48
    )
    dm = FastImageDataModule(str(src), cache_dir=str(tmp_path / "cache"), num_workers="tune", batch_size=4)
    dm.trainer = fake_trainer("cuda")
    dm.prepare_data()
    dm.setup("fit")
    assert dm.resolved_num_workers() == 4  # 405 is the best; 400 is within 5% of it
    engines = ["threads"] * 4 + ["processes"] * 2
    built = ["main", *engines[1:]]  # no workers: batches built on the calling thread
    assert seen[:6] == list(zip(range(6), engines, built, strict=True))
    assert seen[6:] == [(5, "processes", "processes")]  # page-locked, at the best count
    loader = dm.train_dataloader()
    assert (loader.engine, loader.workers) == ("processes", 4)  # what was timed for the pick
    del loader


def test_datamodule_tune_stays_within_the_budget(tmp_path, monkeypatch):
    """A budget of 1 worker bounds the quick sweep and the pick (a sleepy dataset would want more)."""
    monkeypatch.setattr(FastImageDataModule, "worker_budget", lambda self: 1)
    monkeypatch.setattr(FastImageDataModule, "build_dataset", lambda self, split, transform: _Sleepy(16, 0.003))
    src = make_image_folder(
        tmp_path / "src", num_classes=2, train_per_class=4, val_per_class=0, min_size=40, max_size=48
    )
    dm = FastImageDataModule(str(src), cache_dir=str(tmp_path / "cache"), num_workers="tune", batch_size=4)
    dm.prepare_data()
    assert dm.resolved_num_workers() <= 1
    assert dm.num_workers == dm.resolved_num_workers()  # read back after `prepare_data` measured it
    entry = TuneCache(tmp_path / "cache" / "tune.json").get(_key(dm))
    assert entry is not None
    # 0 and 1 workers, and with CUDA the page-locked point at the pick: never a count above the budget
    assert sorted({p["num_workers"] for p in entry["measurements"]}) == [0, 1]


@pytest.mark.parametrize("value", ["bogus", -1, 1.5])
def test_datamodule_rejects_bad_num_workers(tmp_path, value):
    """Anything but ``"auto"``, ``"tune"`` or an int >= 0 is a ValueError naming ``num_workers``."""
    with pytest.raises(ValueError, match="`num_workers`"):
        FastImageDataModule(str(tmp_path), cache_dir=str(tmp_path / "cache"), num_workers=value)


def test_sweep_rejects_empty_batch_sizes_and_negative_workers():
    """Bad sweep arguments are clear ``ValueError``s, before anything is measured."""
    with pytest.raises(ValueError, match="batch_sizes"):
        sweep([0], batch_sizes=())
    with pytest.raises(ValueError, match="max_workers"):
        sweep([0], max_workers=-1)


def test_tune_key_is_stable_for_transforms_without_a_repr():
    """A transform with the default ``repr`` (a memory address) still gives the same cache key every time."""
    from lightning_fastdata.workers import _describe

    class Jitter:
        def __init__(self, strength):
            self.strength = strength

    assert _describe(Jitter(0.2)) == _describe(Jitter(0.2))
    assert _describe(Jitter(0.2)) != _describe(Jitter(0.3))
    assert " at 0x" not in _describe(Jitter(0.2))


def test_a_batch_of_views_counts_its_samples_not_its_views() -> None:
    """A ``(views, targets)`` batch of 2 views of 4 samples is 4 images to the tuner, as ``(images, targets)`` is."""
    from lightning_fastdata.tuning import _batch_len

    views = [torch.zeros(4, 3, 8, 8), torch.zeros(4, 3, 4, 4)]
    assert _batch_len((views, torch.zeros(4))) == 4
    assert _batch_len((torch.zeros(4, 3, 8, 8), torch.zeros(4))) == 4
