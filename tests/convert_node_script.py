"""One "node" preparing a ``FastImageDataModule`` on shared storage, run as a script by ``test_ddp.py``.

Usage: ``python convert_node_script.py DATA_DIR CACHE_DIR OUT_DIR NAME [--hold]``. Calls ``prepare_data`` and
``setup("fit")`` as Lightning does on a node's local rank 0, then writes ``OUT_DIR/NAME.json``: whether its
conversion found the database up to date (it waited for another one) or wrote it, and what it then reads.

With ``--hold`` the conversion stops once it holds the target's lock, before writing anything: it creates
``OUT_DIR/NAME.holding`` and goes on when ``OUT_DIR/release`` exists, so a test can start a second node meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning_fastdata import FastImageDataModule, resolve
from lightning_fastdata.store import writer


def _hold_then(write: Any, out: Path, name: str) -> Any:
    """``write`` (the writer's ``_write``), delayed until the test creates ``out/release``."""

    def held(*args: Any, **kwargs: Any) -> Any:
        (out / f"{name}.holding").touch()
        deadline = time.monotonic() + 300
        while not (out / "release").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the held conversion")
            time.sleep(0.05)
        return write(*args, **kwargs)

    return held


def main(data_dir: str, cache_dir: str, out_dir: str, name: str, hold: bool) -> None:
    logging.basicConfig(level=logging.WARNING)  # the writer says when it waits for another conversion
    out = Path(out_dir)
    if hold:
        writer._write = _hold_then(writer._write, out, name)
    summaries = []
    convert = resolve.convert

    def recording_convert(*args: Any, **kwargs: Any) -> Any:
        summaries.append(convert(*args, **kwargs))
        return summaries[-1]

    resolve.convert = recording_convert
    dm = FastImageDataModule(data_dir, cache_dir=cache_dir, image_size=16, short_side=32, num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    train = dm.train_dataset
    assert train is not None
    result = {
        "pid": os.getpid(),
        "up_to_date": [s.up_to_date for s in summaries],
        "written": [s.written for s in summaries],
        "database": str(dm.database_path),
        "labels": [int(train[i][1]) for i in range(len(train))],  # type: ignore[arg-type]
    }
    (out / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], "--hold" in sys.argv[5:])
