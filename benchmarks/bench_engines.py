"""What each engine costs the training process: worker processes against loader threads, side by side in one run.

Every row is ``FastImageDataModule(..., batch_size=64, num_workers=2, engine=E)`` on the same photo-like JPEGs, each
in its own process, interleaved over rounds (the median is reported):

* ``float``: normalized ``float32`` batches, what the DataModule hands a model training on the CPU;
* ``uint8``: the batches of CUDA training before the copy to the device. Without CUDA this row builds the same
  loader less its page-locking (``pin_memory``) and device copy, and says so;
* ``encoded``: the batches of ``decode="device"``, still-encoded JPEGs (``EncodedImages``) with their crop boxes,
  received and handed over as ``decode_jpeg`` takes them (``.data``) but not decoded: no GPU needed.

For each row: images/s; CPU time per image of the training process (all its threads: ``time.process_time``, which
counts to the nanosecond, not to the scheduler tick) and of its worker processes (psutil); and their sum. The
training process is one interpreter: ``1e6 / (its us per image)`` is a ceiling on images/s that no core count lifts.

    python benchmarks/bench_engines.py --images 3000 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (
    "threads-float",
    "processes-float",
    "threads-uint8",
    "processes-uint8",
    "threads-encoded",
    "processes-encoded",
)


def _worker_cpu_seconds() -> float:
    """CPU time of this process's live children (persistent workers), and of those already waited for."""
    import psutil

    proc = psutil.Process()
    total = proc.cpu_times().children_user + proc.cpu_times().children_system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def run_row(args: argparse.Namespace, row: str) -> dict[str, float]:
    """One row, in this process: a warm-up epoch, then ``args.epochs`` timed ones."""
    import torch

    from lightning_fastdata import FastImageDataModule
    from lightning_fastdata.pipeline.device_decode import EncodedImages

    engine, output = row.split("-")

    class Module(FastImageDataModule):
        def _output(self):  # what CUDA training reads, without CUDA (no pinning, no device copy, no decode)
            return output

    dm = Module(args.db, batch_size=args.batch_size, num_workers=args.workers, engine=engine, val_fraction=0)
    if getattr(dm, "_loaders", None) is not None:  # the loader side picks the output (before, the DataModule did)
        dm._loaders.output = lambda decode, device: output
    dm.setup("fit")
    loader = dm.train_dataloader()
    dtype = torch.float32 if output == "float" else torch.uint8

    def epoch(k: int) -> int:
        loader.sampler.set_epoch(k)
        images = 0
        for i, (batch, _labels) in enumerate(loader):
            if output == "encoded":  # the per-image tensors decode_jpeg is handed, as decode_crop asks for them
                assert isinstance(batch, EncodedImages), type(batch)
                assert len(batch.data) == len(batch)
            elif i == 0:  # checked once an epoch: the loop stays what a training loop asks of the loader
                assert batch.dtype == dtype, batch.dtype
                assert tuple(batch.shape[1:]) == (3, 224, 224), batch.shape
            images += len(batch)
        return images

    epoch(0)
    workers = _worker_cpu_seconds()  # first: psutil's import and its reads are not the training process's cost
    start, own = time.perf_counter(), time.process_time()
    images = sum(epoch(k) for k in range(1, args.epochs + 1))
    seconds = time.perf_counter() - start
    own_us = (time.process_time() - own) / images * 1e6
    workers_us = (_worker_cpu_seconds() - workers) / images * 1e6
    return {
        "images_per_sec": images / seconds,
        "training_us": own_us,
        "workers_us": workers_us,
        "total_us": own_us + workers_us,
        "pinned": bool(torch.cuda.is_available() and output == "uint8"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench", help="where the generated images and the database go")
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--noise", type=float, default=8.0, help="grain of the generated JPEGs (photo-like entropy)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=ROWS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:
        import torch

        torch.set_num_threads(1)  # the consuming process only takes batches: its cores belong to the loader
        print(json.dumps(run_row(args, args.run)))
        return

    from lightning_fastdata import convert, make_image_folder, usable_cpu_count

    folder = Path(args.workdir) / f"images-{args.images}-noise{args.noise:g}"
    if not folder.is_dir():
        make_image_folder(
            folder, num_classes=10, train_per_class=args.images // 10, val_per_class=0, noise=args.noise, seed=0
        )
    db = folder.with_name(folder.name + ".engines.lmdb")
    if not db.is_dir():
        convert(folder, db, short_side=256, quality=90, progress=False)
    rows = args.only or list(ROWS)
    child = [sys.executable, __file__, "--db", str(db), "--batch-size", str(args.batch_size)]
    child += ["--workers", str(args.workers), "--epochs", str(args.epochs)]
    results: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    for r in range(args.rounds):
        for row in rows:
            out = subprocess.run([*child, "--run", row], capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{row} failed:\n{out.stderr[-3000:]}")
            results[row].append(json.loads(out.stdout.strip().splitlines()[-1]))
            m = results[row][-1]
            print(
                f"round {r}: {row:16s} {m['images_per_sec']:6.0f} img/s, training process {m['training_us']:6.1f}"
                f" us/image, workers {m['workers_us']:6.1f}",
                flush=True,
            )
    med = {row: {k: statistics.median(float(m[k]) for m in ms) for k in ms[0]} for row, ms in results.items()}
    print()
    print(
        f"machine: {platform.machine()}, {usable_cpu_count()} usable CPUs ({os.cpu_count()} online), Python"
        f" {platform.python_version()}; {args.images} photo-like JPEGs stored at short side 256, batch"
        f" {args.batch_size}, {args.workers} workers or threads, {args.epochs} epochs timed after a warm-up one,"
        f" median of {args.rounds} interleaved rounds"
    )
    print()
    print("| engine, batches | images/s | training process, us/image | workers, us/image | total, us/image |")
    print("|---|---:|---:|---:|---:|")
    for row, m in med.items():
        workers = f"{m['workers_us']:.0f}" if row.startswith("processes") else "-"
        print(f"| {row} | {m['images_per_sec']:.0f} | {m['training_us']:.1f} | {workers} | {m['total_us']:.0f} |")
    print()
    for output in ("float", "uint8", "encoded"):
        threads, processes = f"threads-{output}", f"processes-{output}"
        if threads in results and processes in results:
            pairs = list(zip(results[processes], results[threads], strict=True))
            rate = statistics.median(p["images_per_sec"] / t["images_per_sec"] for p, t in pairs)
            cpu = statistics.median(p["total_us"] / t["total_us"] for p, t in pairs)
            print(
                f"{output}: processes / threads = {rate:.2f}x images/s, {cpu:.2f}x total CPU per image"
                " (medians of the per-round ratios)"
            )
    if "processes-uint8" in med and not any(m["pinned"] for m in results["processes-uint8"]):
        print("uint8 rows: no CUDA here, so no page-locking and no device copy (what a GPU node adds to them).")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
