"""Opening a database of ImageNet's size: the page walk is paid once per data file, not once per process.

Generates (once, then reuses) a database of ImageNet's shape: 1,281,167 ``train`` and 50,000 ``val`` records in 1,000
classes, each a tiny JPEG (one 8x8 JPEG per class, encoded once), written in the package's own record format with LMDB
appends, so it takes seconds, not a conversion. Then, each in a fresh process as a training process or a worker is:

1. the first open: it walks every lookup in a child process (damaged pages become a clear error instead of a crash)
   and records the walk in ``verified.json``; before this change every process paid it. With the data file evicted
   from the page cache first ("cold") and in it ("warm");
2. later opens: the walk is skipped; ``--opens`` processes each time ``LmdbImageDataset(db, "train")`` and its first
   record, with the data file in the page cache ("warm") and evicted from it first ("cold", ``posix_fadvise``);
3. a reader's memory: resident set before and after the open and after reading 1,000 random records, private
   (anonymous) and file-backed apart, for this database and one of ``--small-records`` records: a reader keeps no
   per-record state, so the private memory is the same for both.

    python benchmarks/bench_open.py                        # in .bench/open: about 1.1 GB of disk, ~2 minutes
    python benchmarks/bench_open.py --records 100000       # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import simplejpeg

from lightning_fastdata.__about__ import __version__
from lightning_fastdata.errors import DatasetFormatError
from lightning_fastdata.store import environments as store_environments
from lightning_fastdata.store import format as store_format

# One process: import the reader (not timed), then time the open and the first record, then read 1,000 more
_OPEN = r"""
import json, os, random, sys, time

def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "RssAnon", "RssFile")}  # MiB

from lightning_fastdata.store import environments as store_environments
from lightning_fastdata.store import format as store_format
from lightning_fastdata.store.reader import LmdbImageDataset

path = sys.argv[1]
if sys.argv[2] == "cold":  # evict the data file from the page cache, as after a reboot or on another node
    fd = os.open(os.path.join(path, store_format.DATA_FILE), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
before = memory()
walks = []
walk = store_environments._check_structure
store_environments._check_structure = lambda p: walks.append(1) or walk(p)
start = time.perf_counter()
dataset = LmdbImageDataset(path, "train")
dataset[0]
seconds = time.perf_counter() - start
opened = memory()
rng = random.Random(0)
for _ in range(1000):
    dataset.read_record(rng.randrange(len(dataset)))
print(json.dumps({"seconds": seconds, "walked": bool(walks), "before": before, "opened": opened, "read": memory()}))
"""


def generate(path: Path, train: int, val: int, classes: int) -> float:
    """Write the database at ``path`` unless it is already there; the seconds it took (0 when reused)."""
    try:
        meta = store_environments.read_meta(path)
        if {name: s["length"] for name, s in meta["splits"].items()} == {"train": train, "val": val}:
            return 0.0
    except (FileNotFoundError, DatasetFormatError):
        pass
    start = time.perf_counter()
    tmp = store_format.partial_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(0)
    records = []
    for label in range(classes):  # one JPEG per class; the label is in the record's header (and its CRC)
        pixels = np.empty((8, 8, 3), np.uint8)
        pixels[:] = rng.integers(0, 256, 3)
        payload = simplejpeg.encode_jpeg(pixels, quality=90, colorspace="RGB")
        records.append(store_format.pack_record(store_format.ENCODING_JPEG, label, 8, 8, payload))
    splits = {"train": train, "val": val}
    labels = {name: (np.arange(n, dtype=np.int64) * classes // n).astype("<i4") for name, n in splits.items()}
    size = sum(n * (len(records[0]) + 64) for n in splits.values()) * 3 // 2 + (256 << 20)
    env = lmdb.open(str(tmp), map_size=size, subdir=True, readahead=False, meminit=False, sync=False)
    meta = {
        "format_version": store_format.FORMAT_VERSION,
        "complete": True,
        "classes": [f"n{c:08d}" for c in range(classes)],
        "splits": {
            name: {"length": n, "class_counts": np.bincount(labels[name], minlength=classes).tolist()}
            for name, n in splits.items()
        },
        "encoding": {"short_side": None, "quality": 90, "keep_original": True, "encoding": "jpeg"},
        "source": {"path": "<bench_open>", "fingerprint": None},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "writer": f"lightning_fastdata {__version__} (benchmarks/bench_open.py)",
    }
    with env.begin(write=True) as txn:
        txn.put(store_format.META_KEY, store_format.dump_meta(meta))
        for name in splits:
            txn.put(store_format.labels_key(name), labels[name].tobytes())
            sources = [f"n{c:08d}/{i:08d}.JPEG" for i, c in enumerate(labels[name].tolist())]
            txn.put(store_format.sources_key(name), json.dumps(sources).encode())
    for name, n in splits.items():  # keys in sorted order: appends, no B-tree searches
        split_labels = labels[name].tolist()
        for start_index in range(0, n, 100_000):
            with env.begin(write=True) as txn:
                for i in range(start_index, min(n, start_index + 100_000)):
                    txn.put(store_format.record_key(name, i), records[split_labels[i]], append=True)
    env.sync(True)
    env.close()
    os.replace(tmp, path)
    return time.perf_counter() - start


def open_in_a_new_process(path: Path, cache: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _OPEN, str(path), cache], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def forget_walks(path: Path) -> None:
    """Remove the records of earlier walks, so that the next open is a first open."""
    (path / store_format.VERIFIED_FILE).unlink(missing_ok=True)
    for marker in (store_format.default_cache_dir() / "verified").glob("*.json"):
        if json.loads(marker.read_text()).get("database") == str(path.absolute()):
            marker.unlink()


def report(name: str, path: Path, opens: int) -> dict:
    first = {}
    for cache in ("cold", "warm"):
        forget_walks(path)
        first[cache] = open_in_a_new_process(path, cache)
        assert first[cache]["walked"], "the first open must walk the pages"
    later = {cache: [open_in_a_new_process(path, cache) for _ in range(opens)] for cache in ("warm", "cold")}
    assert not any(run["walked"] for runs in later.values() for run in runs), "a later open walked again"
    records = sum(s["length"] for s in store_environments.read_meta(path)["splits"].values())
    size = (path / store_format.DATA_FILE).stat().st_size
    print(f"{name}: {records:,} records, {size / 2**20:,.0f} MiB data file")
    for cache, run in first.items():
        print(f"  first open, {cache} page cache (walks every lookup, records it): {run['seconds'] * 1000:,.0f} ms")
    for cache, runs in later.items():
        times = [run["seconds"] * 1000 for run in runs]
        print(
            f"  later open, {cache} page cache ({opens} processes): median {statistics.median(times):.1f} ms,"
            f" max {max(times):.1f} ms"
        )
    run = later["warm"][0]
    growth = {key: run["opened"][key] - run["before"][key] for key in ("RssAnon", "RssFile")}
    after_reads = {key: run["read"][key] - run["before"][key] for key in ("RssAnon", "RssFile")}
    print(
        f"  reader memory: {run['before']['VmRSS']} MiB resident after imports; the open adds {growth['RssAnon']} MiB"
        f" private + {growth['RssFile']} MiB file-backed; after 1,000 random records {after_reads['RssAnon']} MiB"
        f" private + {after_reads['RssFile']} MiB file-backed (shared page cache)"
    )
    return {"records": records, "first": first, "later": later}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".bench/open", help="where the databases go (default .bench/open)")
    parser.add_argument("--records", type=int, default=1_281_167, help="train records (default ImageNet's 1,281,167)")
    parser.add_argument("--val", type=int, default=50_000, help="val records (default 50,000)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--small-records", type=int, default=10_000, help="the small database's train records")
    parser.add_argument("--opens", type=int, default=5, help="fresh processes per measurement (default 5)")
    args = parser.parse_args()

    root = Path(args.dir).absolute()
    results = {}
    for name, train, val in (("large", args.records, args.val), ("small", args.small_records, 0)):
        path = root / f"{name}-{train}.lmdb"
        seconds = generate(path, train, val, args.classes)
        if seconds:
            print(f"generated {path} in {seconds:.1f} s")
        results[name] = report(name, path, args.opens)
    large = statistics.median(run["seconds"] for run in results["large"]["later"]["cold"]) * 1000
    verdict = "met" if large < 50 else "missed"
    print(f"target: a later open of {results['large']['records']:,} records under 50 ms (cold): {verdict}")


if __name__ == "__main__":
    main()
