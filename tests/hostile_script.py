"""Read hostile databases every way a reader can, one JSON line per read: how it ended, its time and its memory.

Run by ``tests/test_hostile.py`` as ``python hostile_script.py CASES.json``: a crash or a hang here cannot take pytest
with it, and memory is this process's own. ``CASES.json`` lists ``{"name", "db", "index"}`` (``index``: the record
under test, beside the good records 0 and 1; ``None``: the metadata is under test). Each read prints ``START`` first,
so a read that never ends is named by the last line.

Memory: the peak resident set (``VmHWM``) is reset before each read (``/proc/self/clear_refs``) and compared with the
resident set then; where it cannot be reset, the growth is the peak's since this process started, an upper bound.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fastdata import FastDataError, LmdbImageDataset, read_sources
from lightning_fastdata.pipeline import create_loader
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import CenterCropResize

SIZE = 24


def _status(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status``, in bytes."""
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert found is not None, field
    return int(found.group(1)) * 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _loader(db: str, indices: list[int], batch_size: int, skip: bool, output: str = "uint8") -> tuple[int, int]:
    """Read ``indices`` through the batch path (a thread engine): ``(images, skipped)``."""
    counter = SkipCounter() if skip else None
    dataset = LmdbImageDataset(db, transform=CenterCropResize(SIZE))
    loader = create_loader(
        dataset, batch_size, sampler=indices, engine="threads", workers=1, output=output, skip_counter=counter
    )  # type: ignore[arg-type]
    images = sum(len(batch[0]) for batch in loader)
    return images, counter.value if counter is not None else 0


def _dataset(db: str, index: int, output: str) -> tuple[int, int]:
    LmdbImageDataset(db, output=output)[index]  # type: ignore[arg-type]
    return 1, 0


def _everything(db: str) -> tuple[int, int]:
    """Open the database and read what a reader reads: its labels, its sources and its last record."""
    dataset = LmdbImageDataset(db)
    assert len(dataset.targets) == len(dataset)
    read_sources(db)
    dataset[len(dataset) - 1]
    return 1, 0


def _reads(case: dict[str, Any]) -> dict[str, Callable[[], tuple[int, int]]]:
    db, index = case["db"], case["index"]
    if index is None:
        return {
            "dataset": lambda: _everything(db),
            "loader_skip": lambda: _loader(db, list(range(len(LmdbImageDataset(db)))), 2, skip=True),
        }
    batch = [0, index, 1]
    return {
        "dataset": lambda: _dataset(db, index, "tensor"),
        "dataset_pil": lambda: _dataset(db, index, "pil"),
        "loader_raise": lambda: _loader(db, batch, 3, skip=False),
        "loader_skip": lambda: _loader(db, batch, 3, skip=True),
        "encoded_skip": lambda: _loader(db, batch, 3, skip=True, output="encoded"),
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    gc.freeze()  # what the imports made is never garbage: a collection between reads then takes microseconds, not 0.1 s
    resettable = _reset_peak()
    start_rss = _status("VmRSS")
    for case in cases:
        for mode, read in _reads(case).items():
            print(json.dumps({"start": case["name"], "mode": mode}), flush=True)
            gc.collect()
            if resettable:
                _reset_peak()
            before = _status("VmRSS") if resettable else start_rss
            result: dict[str, Any] = {"case": case["name"], "mode": mode}
            began = time.perf_counter()
            try:
                result["images"], result["skipped"] = read()
                result["outcome"] = "skip" if result["skipped"] else "ok"
            except Exception as err:  # every error is reported: the test judges it
                result.update(outcome="error", error=type(err).__name__, message=str(err))
                result["ours"] = isinstance(err, FastDataError)
            result["seconds"] = time.perf_counter() - began
            result["growth"] = _status("VmHWM") - before
            result["resettable"] = resettable
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
