"""Loader throughput against the peers, side by side in one run, on the same images and the same cores.

Every loader reads the same photo-like JPEGs (stored at short side 256, quality 90), does the same work —
RandomResizedCrop(224) + horizontal flip, batch 64, shuffled epochs (``--epochs``, default 2, after a warm-up one) —
with the same number of workers or threads, each in its own process, interleaved over rounds (the median is reported):

* torchvision ``ImageFolder`` + PIL transforms (the baseline), normalized float32;
* ``FastImageDataModule`` (threads), normalized float32 and uint8 (what a GPU trainer receives); and with
  ``engine="processes"``, to show the engine choice;
* FFCV 1.0.2 (float32 and uint8, channels_last as FFCV gives them) and NVIDIA DALI (CPU-only, float32), when
  installed (``bash benchmarks/install_peers.sh``, then run this with ``.venv-peers/bin/python``);
* target kinds: ``FastImageDataModule`` (uint8, threads) on three databases of the very same stored JPEGs, holding
  classes, multi-label targets (2-3 of the 10 classes a sample) and float targets (4 values a sample): what reading
  the targets of a kind other than ``class`` costs (the ``kind-*`` rows; the aim is at least 0.97x of ``class``);
* limit B: ``simplejpeg`` (fast DCT and upsampling) + ``cv2.resize(INTER_AREA)`` of the crop, one core, times the
  usable cores (no engine at all); and the same with this package's crop kernel, which shrinks with a 3-tap prefilter
  and bilinear instead of ``INTER_AREA``: the ceiling our engine is measured against.

Each row reports images/s and CPU-seconds per 1,000 images (the process and its children): the second figure says
how many cores it takes to feed a GPU at a given rate. The timed epochs follow a warm-up one (worker start-up, JIT
compilation and pipeline building are left out for every loader).

    python benchmarks/bench_loader.py --images 3000 --rounds 3
    python benchmarks/bench_loader.py --only kind-class kind-multilabel kind-float

To measure a change of ours, run the rows of ours at another commit beside this checkout's, in the same rounds:

    git worktree add /tmp/base HEAD~1
    python benchmarks/bench_loader.py --only fast-float fast-uint8 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224


# ---------------------------------------------------------------------------------------------------------------
# One loader, in its own process
# ---------------------------------------------------------------------------------------------------------------


def _cpu_seconds() -> float:
    import psutil

    proc = psutil.Process()
    times = proc.cpu_times()  # this process, and its children that have exited (per-epoch DataLoader workers)
    total = times.user + times.system + times.children_user + times.children_system
    for child in proc.children(recursive=True):  # and the ones still running
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def _own_cpu_seconds() -> float:
    """CPU time of this process alone (all its threads), without its worker processes.

    ``CLOCK_PROCESS_CPUTIME_ID``, to the nanosecond: ``psutil``'s ``cpu_times`` counts in the kernel's 10 ms ticks,
    which read 0 for a training process that only takes slot numbers from its workers over a short run.
    """
    return time.process_time()


def _timed_epoch(make_epoch, check, epochs: int, finish=None) -> dict[str, float]:
    """Run one warm-up epoch, then time the next ``epochs``.

    Returns images/s, and CPU-seconds per 1,000 images: of the whole loader (this process and its workers), of the
    training process alone (``own``: what a GIL-bound consumer must do per image), and of its main thread alone.
    ``finish`` runs on each batch in the training process before it is checked (a device stage on a CPU).
    """
    finish = finish or (lambda batch: batch)
    for batch in make_epoch(0):
        check(finish(batch))
    start, cpu, own, main_thread, images = (
        time.perf_counter(),
        _cpu_seconds(),
        _own_cpu_seconds(),
        time.thread_time(),
        0,
    )
    for k in range(1, epochs + 1):
        for batch in make_epoch(k):
            images += check(finish(batch))
    seconds = time.perf_counter() - start
    per_1000 = 1000 / images
    return {
        "images_per_sec": images / seconds,
        "cpu_per_1000": (_cpu_seconds() - cpu) * per_1000,
        "own_cpu_per_1000": (_own_cpu_seconds() - own) * per_1000,
        "main_thread_cpu_per_1000": (time.thread_time() - main_thread) * per_1000,
    }


def _gil_held_us(reader, batch_size: int, batches: int = 20) -> float:
    """Microseconds per image that ``read_batch`` holds the GIL: its CPU time on one thread, less the time inside
    the kernels that release it (libjpeg-turbo decode, the OpenCV crop kernel, the normalization).

    Threads building batches in one process serialize on this: it bounds the threaded engine at
    ``1e6 / (GIL-held + the main thread's per-image time)`` images/s, however many cores there are. Includes the
    probe's own timers (about 1 us per image).
    """
    import simplejpeg

    from lightning_fastdata.pipeline.kernel import KeyedIndices

    try:  # where the fused path calls the crop kernel: its own module, or (a baseline before it) the reader's
        from lightning_fastdata.pipeline import crop as loader_module
    except ImportError:
        from lightning_fastdata.pipeline import kernel as loader_module
    from lightning_fastdata.transforms import Normalizer

    inside = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] += time.thread_time() - start

        return wrapper

    originals = (simplejpeg.decode_jpeg, loader_module.crop_resize_into, Normalizer.into)
    simplejpeg.decode_jpeg = timed(originals[0])
    loader_module.crop_resize_into = timed(originals[1])
    Normalizer.into = timed(originals[2])
    try:
        n = len(reader)
        order = [(k * 7919) % n for k in range(batches * batch_size)]  # spread over the split, no sampler
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        reader.read_batch(KeyedIndices(chunks[0], (0, 0)))  # warm: buffers, the environment
        inside[0] = 0.0
        start = time.thread_time()
        for chunk in chunks:
            reader.read_batch(KeyedIndices(chunk, (0, 1)))
        total = time.thread_time() - start
    finally:
        simplejpeg.decode_jpeg, loader_module.crop_resize_into, Normalizer.into = originals
    return (total - inside[0]) / len(order) * 1e6


def _checker(dtype):
    import torch

    def check(batch) -> int:
        images = batch[0]
        assert images.dtype == dtype, images.dtype
        assert tuple(images.shape[1:]) == (3, SIZE, SIZE), images.shape
        return int(images.shape[0])

    return check, torch


def run_imagefolder(args) -> dict[str, float]:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    standard = transforms.Compose(
        [
            transforms.RandomResizedCrop(SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    loader = DataLoader(
        datasets.ImageFolder(args.resized, transform=standard),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        drop_last=True,
    )
    check, _ = _checker(torch.float32)
    return _timed_epoch(lambda epoch: loader, check, args.epochs)


def run_fast(args, output: str, engine: str, db: str | None = None) -> dict[str, float]:
    import torch

    from lightning_fastdata import FastImageDataModule

    class DataModule(FastImageDataModule):
        def _output(self):  # uint8: what CUDA training reads, before its copy to the device (no CUDA here)
            return output

    # as a user gets it: the DataModule's training loader with its defaults (persistent workers, batch slots);
    # on a CPU it hands out normalized float32 batches, to a CUDA trainer uint8 ones in NHWC memory
    dm = DataModule(db or args.db, batch_size=args.batch_size, num_workers=args.workers, engine=engine, val_fraction=0)
    if getattr(dm, "_loaders", None) is not None:  # the loader side picks the output (before, the DataModule did)
        dm._loaders.output = lambda decode, device: output
    dm.setup("fit")
    loader = dm.train_dataloader()

    def epoch(k: int):
        loader.sampler.set_epoch(k)
        return loader

    check, _ = _checker(torch.float32 if output == "float" else torch.uint8)
    result = _timed_epoch(epoch, check, args.epochs)
    result["gil_us"] = _gil_held_us(loader.dataset, args.batch_size)
    return result


def run_ffcv(args, output: str) -> dict[str, float]:
    import numpy as np
    import torch
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    image = [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip()]
    if output == "float":
        image.append(NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32))
    image += [ToTensor(), ToTorchImage()]
    loader = Loader(
        args.beton,
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption.RANDOM,
        drop_last=True,
        os_cache=True,
        pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]},
    )
    check, _ = _checker(torch.float32 if output == "float" else torch.uint8)
    return _timed_epoch(lambda epoch: loader, check, args.epochs)


def run_dali(args) -> dict[str, float]:
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=args.resized, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[m * 255 for m in MEAN],
            std=[s * 255 for s in STD],
            mirror=fn.random.coin_flip(),
        )
        return images, labels

    p = pipe()
    p.build()
    loader = DALIGenericIterator(
        p, ["images", "labels"], reader_name="reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )
    check, _ = _checker(torch.float32)
    return _timed_epoch(lambda epoch: ((b[0]["images"], b[0]["labels"]) for b in loader), check, args.epochs)


def run_limit_b(args, kernel: str, parallel: bool = False) -> dict[str, float]:
    """Limit B: decode + crop-resize at full speed with no engine at all (no batches, no queue, no GIL contention).

    ``kernel="inter_area"`` is limit B as issue 11 defines it: ``simplejpeg`` (fast DCT and upsampling), then
    ``cv2.resize(INTER_AREA)`` of the crop. ``kernel="ours"`` keeps that decode and uses this package's crop kernel
    (:func:`~lightning_fastdata.transforms.crop_resize_into`), the ceiling of our own kernels.

    By default one core's rate is multiplied by the usable cores (the issue's definition). ``parallel=True`` runs one
    forked process per usable core at once instead: what these cores deliver together, with whatever they share
    (caches, memory bandwidth, a host's hyper-threads behind the virtual CPUs) taking its toll.
    """
    import multiprocessing
    import random

    import cv2
    import numpy as np
    import simplejpeg

    from lightning_fastdata import usable_cpu_count
    from lightning_fastdata.transforms import RandomResizedCropFlip, crop_resize_into

    cv2.setNumThreads(1)
    blobs = [f.read_bytes() for f in sorted(Path(args.resized).rglob("*.jpg"))] * args.epochs  # as many as loaders
    crop, out, scratch = RandomResizedCropFlip(SIZE), np.empty((SIZE, SIZE, 3), np.uint8), np.empty(1 << 20, np.uint8)

    def one(blob: bytes) -> None:
        image = simplejpeg.decode_jpeg(blob, "RGB", fastdct=True, fastupsample=True)
        box, flip = crop.box(*image.shape[:2]), crop.flip()
        if kernel == "ours":
            crop_resize_into(image, box, SIZE, flip, out, scratch)
            return
        top, left, h, w = box
        cv2.resize(image[top : top + h, left : left + w], (SIZE, SIZE), dst=out, interpolation=cv2.INTER_AREA)
        if flip:
            cv2.flip(out, 1, dst=out)

    def timed(part: list[bytes], seed: int, ready=None, results=None) -> tuple[float, float, float]:
        random.seed(seed)
        for blob in part[:20]:
            one(blob)
        if ready is not None:
            ready.wait()
        start, cpu = time.perf_counter(), time.process_time()
        for blob in part:
            one(blob)
        times = (start, time.perf_counter(), time.process_time() - cpu)
        if results is not None:
            results.put(times)
        return times

    cores = usable_cpu_count()
    if not parallel:
        start, end, cpu = timed(blobs, 0)
        return {"images_per_sec": len(blobs) / (end - start) * cores, "cpu_per_1000": cpu / len(blobs) * 1000}
    fork = multiprocessing.get_context("fork")
    ready, results = fork.Barrier(cores), fork.Queue()
    procs = [fork.Process(target=timed, args=(blobs[k::cores], k, ready, results)) for k in range(cores)]
    for proc in procs:
        proc.start()
    times = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(end for _, end, _ in times) - min(start for start, _, _ in times)
    return {"images_per_sec": len(blobs) / seconds, "cpu_per_1000": sum(cpu for *_, cpu in times) / len(blobs) * 1000}


RUNNERS = {
    "imagefolder": ("torchvision ImageFolder + PIL transforms, normalized float32", run_imagefolder),
    "fast-float": ("**FastImageDataModule, normalized float32**", lambda a: run_fast(a, "float", "threads")),
    "fast-uint8": (
        "**FastImageDataModule, uint8 (what a GPU trainer receives)**",
        lambda a: run_fast(a, "uint8", "threads"),
    ),
    "fast-float-processes": (
        'FastImageDataModule, float32, `engine="processes"`',
        lambda a: run_fast(a, "float", "processes"),
    ),
    "fast-uint8-processes": (
        'FastImageDataModule, uint8, `engine="processes"`',
        lambda a: run_fast(a, "uint8", "processes"),
    ),
    "kind-class": (
        "FastImageDataModule, uint8, class targets (`kind-*`: one database per kind, the same JPEGs)",
        lambda a: run_fast(a, "uint8", "threads", _kind_db(a.db, "class")),
    ),
    "kind-multilabel": (
        "FastImageDataModule, uint8, multi-label targets: float32 [B, 10] multi-hot",
        lambda a: run_fast(a, "uint8", "threads", _kind_db(a.db, "multilabel")),
    ),
    "kind-float": (
        "FastImageDataModule, uint8, float targets: float32 [B, 4]",
        lambda a: run_fast(a, "uint8", "threads", _kind_db(a.db, "float")),
    ),
    "ffcv-float": ("FFCV 1.0.2, normalized float32 (channels_last)", lambda a: run_ffcv(a, "float")),
    "ffcv-uint8": ("FFCV 1.0.2, uint8", lambda a: run_ffcv(a, "uint8")),
    "dali-float": ("NVIDIA DALI, CPU-only, normalized float32", run_dali),
    "limit-b": (
        "limit B: simplejpeg (fast) + `cv2.resize(INTER_AREA)`, one core x usable cores",
        lambda a: run_limit_b(a, "inter_area"),
    ),
    "limit-b-ours": (
        "limit B with our crop kernel: simplejpeg (fast) + `crop_resize_into`, one core x usable cores",
        lambda a: run_limit_b(a, "ours"),
    ),
    "limit-b-ours-parallel": (
        "limit B with our crop kernel, one process per usable core at once",
        lambda a: run_limit_b(a, "ours", parallel=True),
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# The driver: data, conversions, interleaved rounds, table
# ---------------------------------------------------------------------------------------------------------------


def _kind_db(db: str, kind: str) -> str:
    """Where the database of ``kind`` of the same stored JPEGs as ``db`` is (see :func:`_make_kind_dbs`)."""
    return str(Path(db).with_name(f"{Path(db).stem}.{kind}.lmdb"))


def _make_kind_dbs(db: Path, workers: int) -> None:
    """The ``kind-*`` rows' databases: ``db``'s stored JPEG bytes as they are, with class, multi-label or float
    targets (made again from ``db`` each run: it is converted again each run too)."""
    import numpy as np

    from lightning_fastdata import LmdbImageDataset, convert_dataset

    source = LmdbImageDataset(db, output="encoded")
    jpegs = [bytes(source[i][0].numpy()) for i in range(len(source))]
    labels = source.targets

    class Items(list):
        classes = source.classes

    for kind in ("class", "multilabel", "float"):
        if kind == "class":
            targets = labels
        elif kind == "multilabel":
            targets = [sorted({c, (c + 1 + i % 3) % 10, (c + 7) % 10} if i % 2 else {c, (c + 3) % 10}) for i, c in
                       enumerate(labels)]  # fmt: skip
        else:
            targets = [np.array([c, i % 17, 0.5 * c, -i / 100], dtype=np.float32) for i, c in enumerate(labels)]
        items = Items(zip(jpegs, targets, strict=True))
        convert_dataset(
            items, _kind_db(str(db), kind), short_side=None, keep_original=True, num_workers=workers, force=True,
            progress=False, targets=kind,
        )  # fmt: skip


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _resize_one(path: Path, out: Path, short_side: int, quality: int) -> None:
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        scale = short_side / min(im.size)
        if scale < 1:
            im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.BILINEAR)
        out.parent.mkdir(parents=True, exist_ok=True)
        im.save(out, quality=quality)


def _resize_folder(src: Path, dst: Path, short_side: int, quality: int, workers: int = 1) -> None:
    """The images at short side ``short_side``, quality ``quality``: what ImageFolder, DALI and limit B read.

    ``workers`` > 1 resizes in that many processes.
    """
    from concurrent.futures import ProcessPoolExecutor

    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    paths = sorted(src.rglob("*.jpg"))
    outs = [tmp / path.relative_to(src) for path in paths]
    n = len(paths)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_resize_one, paths, outs, [short_side] * n, [quality] * n, chunksize=64))
    else:
        for path, out in zip(paths, outs, strict=True):
            _resize_one(path, out, short_side, quality)
    os.replace(tmp, dst)


def _write_beton(src: Path, beton: Path, workers: int) -> float:
    """FFCV's file from the original photos, resized to short side 256 in its writer workers (as we convert)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(src, transform=transforms.Resize(256))
    start = time.perf_counter()
    writer = DatasetWriter(
        str(beton),
        {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
        num_workers=workers,
    )
    writer.from_indexed_dataset(dataset)
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _print_proxies(med: dict[str, dict[str, float]], cores: int) -> None:
    """What limits each loader on a many-core node, from figures this small machine can measure.

    The training process is one interpreter: whatever it must do per image under the GIL serializes, whatever the
    cores. Threads: the GIL-held time of building an image plus the main thread's per-image time. Worker processes:
    the training process's own CPU time per image (receiving batches, the pin-memory thread). One core's rate times
    the cores is the other bound.
    """
    print("Proxies for a many-core node (from this run; a ceiling is what the engine allows, not a measurement):")
    print()
    print(
        "| loader | one core's rate x cores | training process CPU-s / 1,000 | main thread CPU-s / 1,000"
        " | GIL-held us / image | engine ceiling, images/s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in sorted(med.items()):
        # FFCV and DALI build batches on GIL-free native threads inside the training process: their CPU there is
        # their whole work, not a serial part of it, so this bound does not apply to them
        if name != "imagefolder" and not name.startswith("fast"):
            continue
        per_core = 1000 / m["cpu_per_1000"] * cores if m["cpu_per_1000"] else float("nan")
        if "gil_us" in m and "processes" not in name:
            serial_us = m["gil_us"] + m["main_thread_cpu_per_1000"] * 1000
            gil, bound = f"{m['gil_us']:.0f}", f"{1e6 / serial_us:.0f} (GIL: 1e6 / (GIL-held + main thread))"
        else:
            gil = f"{m['gil_us']:.0f} (in each worker)" if "gil_us" in m else "-"
            own_us = m["own_cpu_per_1000"] * 1000
            # a process that spent no measurable CPU over the timed epochs reads 0
            bound = f"{1e6 / own_us:.0f}" if own_us else "unbounded here (under the CPU clock's resolution)"
            bound += " (1e6 / training process CPU)"
        print(
            f"| {LABELS[name]} | {per_core:.0f} | {m['own_cpu_per_1000']:.3f} | {m['main_thread_cpu_per_1000']:.3f}"
            f" | {gil} | {bound} |"
        )


#: the table's label of each loader; a ``--baseline`` run adds one per row of ours
LABELS = {name: label for name, (label, _) in RUNNERS.items()}
BASELINE = "@baseline"


def _baseline_env(checkout: Path) -> dict[str, str]:
    """The environment whose Python imports ``lightning_fastdata`` from ``checkout`` (checked: a typo would
    silently benchmark this checkout twice)."""
    checkout = checkout.resolve()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    code = "import lightning_fastdata; print(lightning_fastdata.__file__)"
    found = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, check=False)
    if found.returncode != 0 or not Path(found.stdout.strip()).resolve().is_relative_to(checkout):
        raise SystemExit(
            f"--baseline {checkout}: lightning_fastdata is not imported from there ({found.stdout.strip()}"
            f"{found.stderr.strip()[-300:]}). Pass the root of a checkout of this repository."
        )
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench", help="where the generated images and stores go")
    parser.add_argument("--images", type=int, default=3000, help="photo-like JPEGs to generate (300-640 px)")
    parser.add_argument("--noise", type=float, default=8.0, help="grain of the generated JPEGs (photo-like entropy)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="workers or threads, for every loader")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--convert-rounds", type=int, default=3, help="interleaved conversions of each store")
    parser.add_argument("--only", nargs="*", help="run these loaders only (names: " + ", ".join(RUNNERS) + ")")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--baseline",
        help="a checkout of this package at another commit (`git worktree add /tmp/base REV`): its rows run beside"
        " this checkout's in every round, so a change is measured against what it changes, side by side",
    )
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--resized", help=argparse.SUPPRESS)
    parser.add_argument("--beton", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed after the warm-up epoch, per loader")
    args = parser.parse_args()

    if args.run:  # a child: one loader, one round; prints its JSON line
        import torch

        torch.set_num_threads(1)  # the consuming process only takes batches; its cores belong to the loader
        print(json.dumps(RUNNERS[args.run][1](args)))
        return

    from lightning_fastdata import convert, make_image_folder, usable_cpu_count

    workdir = Path(args.workdir)
    folder = workdir / f"images-{args.images}-noise{args.noise:g}"
    if not folder.is_dir():
        make_image_folder(
            folder, num_classes=10, train_per_class=args.images // 10, val_per_class=0, noise=args.noise, seed=0
        )
    resized = folder.with_name(folder.name + "-256")
    if not resized.is_dir():
        _resize_folder(folder, resized, 256, 90)
    db = folder.with_name(folder.name + ".bench.lmdb")
    beton = workdir / f"{folder.name}.beton"
    ffcv = _available("ffcv")
    seconds: dict[str, list[float]] = {"lightning_fastdata": [], "FFCV .beton": []}
    for _ in range(args.convert_rounds):  # conversions interleaved too: one conversion each is a noisy figure
        summary = convert(folder, db, short_side=256, quality=90, num_workers=args.workers, force=True, progress=False)
        seconds["lightning_fastdata"].append(summary.seconds)
        if ffcv:
            beton.unlink(missing_ok=True)
            with contextlib.redirect_stderr(io.StringIO()):  # FFCV's writer draws a progress bar
                seconds["FFCV .beton"].append(_write_beton(folder, beton, args.workers))
    source_bytes = _dir_bytes(folder)
    stores = {
        "lightning_fastdata": (_dir_bytes(db), statistics.median(seconds["lightning_fastdata"])),
        "same JPEGs as plain files": (_dir_bytes(resized), None),
    }
    names = [n for n in RUNNERS if not args.only or n in args.only]
    if any(n.startswith("kind-") for n in names):
        _make_kind_dbs(db, args.workers)
    notes = []
    if not ffcv:
        names = [n for n in names if not n.startswith("ffcv")]
        notes.append("FFCV is not installed (bash benchmarks/install_peers.sh): its rows are left out.")
    else:
        stores["FFCV .beton"] = (_dir_bytes(beton), statistics.median(seconds["FFCV .beton"]))
        args.beton = str(beton)
    if not _available("nvidia.dali"):
        names = [n for n in names if not n.startswith("dali")]
        notes.append("NVIDIA DALI is not installed (bash benchmarks/install_peers.sh): its row is left out.")

    envs = dict.fromkeys(names, os.environ)
    if args.baseline:
        env = _baseline_env(Path(args.baseline))
        for name in [n for n in names if n.startswith("fast")]:
            names.insert(names.index(name) + 1, f"{name}{BASELINE}")
            envs[f"{name}{BASELINE}"] = env
            LABELS[f"{name}{BASELINE}"] = f"{LABELS[name].strip('*')}, baseline {args.baseline}"

    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    child = [sys.executable, __file__, "--db", str(db), "--resized", str(resized), "--beton", str(args.beton)]
    child += ["--batch-size", str(args.batch_size), "--workers", str(args.workers), "--epochs", str(args.epochs)]
    for r in range(args.rounds):
        for name in names:
            run = ["--run", name.removesuffix(BASELINE)]
            out = subprocess.run([*child, *run], capture_output=True, text=True, check=False, env=envs[name])
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {name:22s} {results[name][-1]['images_per_sec']:7.0f} img/s", flush=True)

    med = {n: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for n, ms in results.items()}
    base = med.get("imagefolder", {}).get("images_per_sec")
    cores = usable_cpu_count()
    print()
    machine = f"{platform.machine()}, {cores} usable CPUs ({os.cpu_count()} online)"
    print(f"machine: {machine}, Python {platform.python_version()}")
    print(
        f"{args.images} photo-like JPEGs (300-640 px, noise {args.noise:g}) stored at short side 256, q90;"
        f" batch {args.batch_size}, {args.workers} workers or threads each, RandomResizedCrop({SIZE}) + flip,"
        f" {args.epochs} epochs timed after a warm-up one, median of {args.rounds} interleaved rounds, each loader in"
        " its own process"
    )
    print()
    print("| loader | images/s | vs ImageFolder | CPU-s per 1,000 images |")
    print("|---|---:|---:|---:|")
    for name, m in sorted(med.items(), key=lambda item: item[1]["images_per_sec"]):
        ratio = f"{m['images_per_sec'] / base:.2f}x" if base else "-"
        print(f"| {LABELS[name]} | {m['images_per_sec']:.0f} | {ratio} | {m['cpu_per_1000']:.2f} |")
    print()

    def ratio(a: str, b: str) -> str:
        """Median of the per-round ratios (each round runs both within a minute: slow drifts of a shared host
        cancel), and the ratio of the medians in the table."""
        if a not in med or b not in med:
            return "n/a"
        rounds = zip(results[a], results[b], strict=True)
        paired = statistics.median(x["images_per_sec"] / y["images_per_sec"] for x, y in rounds)
        of_medians = med[a]["images_per_sec"] / med[b]["images_per_sec"]
        return f"{paired:.2f}x per round (ratio of the medians above: {of_medians:.2f}x)"

    print(f"float32: FastImageDataModule / FFCV = {ratio('fast-float', 'ffcv-float')}")
    print(f"uint8:   FastImageDataModule / FFCV = {ratio('fast-uint8', 'ffcv-uint8')}")
    print(f"uint8:   FastImageDataModule / limit B = {ratio('fast-uint8', 'limit-b')}")
    print(f"uint8:   FastImageDataModule / limit B with our kernel = {ratio('fast-uint8', 'limit-b-ours')}")
    print(
        "uint8:   FastImageDataModule / limit B with our kernel, all cores at once ="
        f" {ratio('fast-uint8', 'limit-b-ours-parallel')}"
    )
    print(f"float32: FastImageDataModule / DALI = {ratio('fast-float', 'dali-float')}")
    print(f"targets: multilabel / class = {ratio('kind-multilabel', 'kind-class')}")
    print(f"targets: float / class = {ratio('kind-float', 'kind-class')}")
    for name in [n for n in names if n.endswith(BASELINE)]:
        print(f"{name.removesuffix(BASELINE)}: this checkout / baseline = {ratio(name.removesuffix(BASELINE), name)}")
    print()
    _print_proxies(med, cores)
    print()
    print(
        f"| store | size | vs source ({source_bytes / 2**20:.1f} MiB) | conversion (median of {args.convert_rounds}) |"
    )
    print("|---|---:|---:|---:|")
    for store, (size, seconds) in stores.items():
        rate = f"{args.images / seconds:.0f} images/s" if seconds else "-"
        print(f"| {store} | {size / 2**20:.1f} MiB | {size / source_bytes:.2f}x | {rate} |")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "rounds": results, "stores": stores}, indent=1))


if __name__ == "__main__":
    main()
