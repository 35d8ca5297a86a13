"""Replace a database again and again while loader threads decode its records straight from the memory map.

Run by ``tests/test_hostile_format.py`` as ``python replaced_script.py FOLDER [ROUNDS] [THREADS]``: a crash here
(a loader thread inside ``simplejpeg.decode_jpeg`` on pages unmapped under it) cannot take pytest with it. Each round
writes a new database, renames its ``data.mdb`` over the one being read, and opens the path again, as a new
``LmdbImageDataset`` or DataModule of the same path does. The reader threads read as the batch path does: one read
transaction per batch, each JPEG decoded from its view of the memory map. A thread whose dataset says the database
was replaced makes a new dataset, as a user would.

Prints one JSON line: the batches read, the "replaced" errors seen and any other error (each a failure); exits 0 when
there was none, 1 otherwise. A signal that kills it is the crash under test.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import hostile

from lightning_fastdata import DatasetFormatError, LmdbImageDataset
from lightning_fastdata.store.environments import read_meta
from lightning_fastdata.store.format import (
    DATA_FILE,
    ENCODING_JPEG,
)

RECORDS = 24
SIDE = 160


def _records(seed: int) -> list[bytes | None]:
    return [
        hostile.record(ENCODING_JPEG, i % 2, SIDE, SIDE, hostile.jpeg(SIDE, SIDE, seed * RECORDS + i))
        for i in range(RECORDS)
    ]


def main(folder: Path, rounds: int, threads: int) -> int:
    generations = [_records(0), _records(1)]  # alternately: every replacement holds other bytes
    path = hostile.write_database(folder / "db.lmdb", generations[0], ["a", "b"])
    current = {"dataset": LmdbImageDataset(path)}
    counts = {"batches": 0, "replaced": 0}
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def read() -> None:
        while not stop.is_set():
            dataset = current["dataset"]
            try:
                with dataset.records() as get:
                    for index in range(len(dataset)):
                        header, payload = get(index)
                        dataset.decode_hwc(index, header, payload)  # from the memory map, the GIL released
                with lock:
                    counts["batches"] += 1
            except DatasetFormatError as err:
                if "was replaced or deleted" not in str(err):
                    errors.append(f"{type(err).__name__}: {err}")
                    return
                with lock:
                    counts["replaced"] += 1
                current["dataset"] = LmdbImageDataset(path)
            except Exception as err:  # wrong bytes (a checksum), or any other error: a failure
                errors.append(f"{type(err).__name__}: {err}")
                return
            time.sleep(0.001)  # between batches, as a loader's threads are: the old environment falls idle

    workers = [threading.Thread(target=read, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for round_ in range(1, rounds + 1):
        new = hostile.write_database(folder / f"new{round_}", generations[round_ % 2], ["a", "b"])
        os.replace(new / DATA_FILE, path / DATA_FILE)
        read_meta(path)  # opens the path again: the cached environment of the replaced file is let go
        time.sleep(0.02)
    stop.set()
    for worker in workers:
        worker.join(60)
    print(json.dumps({**counts, "errors": errors}), flush=True)
    return 1 if errors or any(worker.is_alive() for worker in workers) else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(Path(args[0]), int(args[1]) if len(args) > 1 else 20, int(args[2]) if len(args) > 2 else 4))
