"""GPU benchmark (issue 18): how close each loader gets a model to its data-free rate, and how the loaders scale.

Generates photo-like JPEGs (300-640 px, nothing is downloaded), converts them once with FastImageDataModule's
defaults, then prints two tables from one run:

1. **Training**, ``precision="16-mixed"``, batch 256, crop 224, ``channels_last``, no validation: samples/s over the
   epochs after the first (LoaderMonitor leaves the warmup epoch out; it synchronizes the GPU at epoch edges), with
   the data fraction and GPU utilization it measured. Rows: one strided convolution (the loader sets the pace),
   resnet18, resnet50. Columns: data-free (one normalized batch already on the GPU), torchvision ``ImageFolder``
   float32 (the standard recipe), ``ImageFolder`` uint8 normalized on the GPU, FastImageDataModule with each engine,
   worker processes below the training process's priority (``worker_nice=19``), and with ``decode="device"``. Every
   loader gets the same workers (default: every usable CPU).
2. **The loader alone**, batches copied into GPU memory (FastImageDataModule's are normalized there), over 1, 4, 8
   and 16 workers or threads: each engine and ``ImageFolder`` uint8, with the training process's CPU time per image
   beside each rate. Above them, **the ceiling**: as many standalone processes decoding, cropping and resizing the
   same database with the same kernel, each into its own memory, with no data passing between processes at all.

3. **Self-supervised views** (``--views MODEL ...``): DINO's 8 views of each image (2 x 224 + 6 x 96, as
   ``bench_views.py`` makes them), the network on every view (one forward per size: the student's share of a DINO
   step) in ``16-mixed``: samples/s (a sample is an image with all its views) from one set of views already on the
   GPU (data-free), torchvision ``ImageFolder`` + v2 per view (the lightly / solo-learn CPU path, decoding once; it
   reads the images stored at the same short side 256 as the database), and ``FastImageDataModule(views=...)`` on
   each engine; crops only, and with DINO's colour recipe per view (torchvision: v2 ops on the PIL views in the
   workers; ours: the parameters drawn in the loader, the colour applied to the batch on the GPU).

    python benchmarks/bench_gpu.py                      # tables 1 and 2, ~16,000 images
    python benchmarks/bench_gpu.py --models --scaling --views resnet18  # table 3 only
    python benchmarks/bench_gpu.py --models resnet50 --columns data-free threads processes device
    taskset -c 0-3 python benchmarks/bench_gpu.py --models resnet50 --scaling 4   # a CPU-poor node

On a machine without CUDA it says so and exits 0; ``--device cpu`` runs the same code on the CPU (a smoke run, with
small ``--images`` / ``--image-size``: the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from demo import DataFree, Plan, TinyNet, TorchvisionNet, _fit, fast_datamodule, imagefolder_loader
from ssl_dino import DINO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_loader import _resize_folder
from bench_views import COLOUR_GROUPS, GRAY_P, GROUPS, JITTER, JITTER_P, SIGMA, TorchvisionViews
from torchvision import datasets

from lightning_fastdata import ViewGroup, make_image_folder, usable_cpu_count
from lightning_fastdata.store.sources import train_folder
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, Normalizer

MODELS = {"conv": "one strided conv", "resnet18": "resnet18", "resnet50": "resnet50"}
COLUMNS = {
    "data-free": "data-free",
    "imagefolder-float": "ImageFolder float",
    "imagefolder-uint8": "ImageFolder uint8 + GPU normalize",
    "threads": "FastImageDataModule (threads)",
    "processes": 'engine="processes"',
    "processes-nice": 'engine="processes", worker_nice=19',
    "device": 'decode="device"',
}
VIEW_COLUMNS = {
    "data-free": "data-free",
    "torchvision": "ImageFolder + v2 per view",
    "processes": 'ours, engine="processes"',
    "threads": "ours, threads",
    "torchvision-colour": "ImageFolder + v2 per view + DINO colour",
    "processes-colour": 'ours, engine="processes" + DINO colour',
    "threads-colour": "ours, threads + DINO colour",
}
SCALING = {"threads": 'FastImageDataModule, engine="threads"', "processes": 'engine="processes"'}
SCALING_BASELINE = "torchvision ImageFolder, uint8"


class _GpuNormalized:
    """Mixin: a uint8 batch (``ImageFolder`` uint8, or a list of uint8 views) is normalized on the device, with
    constants cached there."""

    normalizer = Normalizer(IMAGENET_MEAN, IMAGENET_STD)
    channels_last: bool

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images = batch[0]
        if isinstance(images, list) and images and images[0].dtype == torch.uint8:
            return [self.normalizer.batch(view, torch.float32, self.channels_last) for view in images], *batch[1:]
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
            return batch  # float already (the DataModule's own hook normalizes its batches)
        return self.normalizer.batch(images, torch.float32, self.channels_last), *batch[1:]


class ConvNet(_GpuNormalized, TinyNet):
    def __init__(self, num_classes: int, channels_last: bool) -> None:
        super().__init__(num_classes)
        self.channels_last = channels_last


class Net(_GpuNormalized, TorchvisionNet):
    def __init__(self, arch: str, num_classes: int, channels_last: bool) -> None:
        super().__init__(arch, num_classes, channels_last)
        self.channels_last = channels_last


def _model(p: Plan) -> Any:
    if p.arch == "conv":
        return ConvNet(p.classes, p.channels_last)
    return Net(p.arch, p.classes, p.channels_last)


class ViewsNet(Net):
    """The student's share of a DINO step: the network on every view, one forward per view size (``ssl_dino``'s
    MultiCropWrapper), a cross-entropy on each output."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, labels = batch[0], batch[1]
        outputs = DINO._each_view(self.net, views)
        return sum(torch.nn.functional.cross_entropy(out, labels) for out in outputs)  # type: ignore[return-value]


def view_groups(sizes: tuple[int, int], colour: bool) -> list[ViewGroup]:
    """DINO's view groups (``bench_views``'), the large and the small views ``sizes`` pixels; with ``colour``, with
    DINO's per-view blur and solarize probabilities."""
    large = GROUPS[0][0]
    groups = COLOUR_GROUPS if colour else [{"size": s, "count": c, "scale": sc} for s, c, sc in GROUPS]
    return [ViewGroup(**{**g, "size": sizes[0] if g["size"] == large else sizes[1]}) for g in groups]


class DataFreeViews(DataFree):
    """``steps`` times one set of DINO's views (of ``sizes``) already on the device."""

    def __init__(self, p: Plan, steps: int, sizes: tuple[int, int]) -> None:
        super().__init__(p, steps)
        fmt = torch.channels_last if p.channels_last else torch.contiguous_format
        sides = [g.size for g in view_groups(sizes, False) for _ in range(g.count)]
        views = [torch.randn(p.batch_size, 3, s, s, device=p.device).contiguous(memory_format=fmt) for s in sides]
        self.batch = (views, self.batch[1])  # type: ignore[assignment]


def _resized_folder(images: Path, workers: int) -> Path:
    """The images at short side 256, quality 90 (what the database stores): what torchvision reads in table 3."""
    resized = images.with_name(images.name + "-256")
    if not resized.is_dir():
        start = time.perf_counter()
        _resize_folder(images, resized, 256, 90, workers=workers)
        print(f"resized the images for ImageFolder in {time.perf_counter() - start:.1f} s", flush=True)
    return resized


def views_cell(column: str, images: Path, workdir: Path, p: Plan, sizes: tuple[int, int]) -> dict[str, Any]:
    """One table-3 run: DINO's views (of ``sizes``) for ``ViewsNet``; returns LoaderMonitor's summary."""
    colour = column.endswith("-colour")
    loader = column.removesuffix("-colour")
    fit: dict[str, Any]
    if loader == "data-free":
        fit = {"train_dataloaders": DataFreeViews(p, p.images // p.batch_size, sizes)}
    elif loader == "torchvision":
        folder = train_folder(_resized_folder(images, p.workers))
        dataset = datasets.ImageFolder(str(folder), transform=TorchvisionViews(colour, sizes))
        batches = DataLoader(dataset, batch_size=p.batch_size, shuffle=True, drop_last=True, num_workers=p.workers,
                             persistent_workers=p.workers > 0, pin_memory=p.device == "cuda")  # fmt: skip
        fit = {"train_dataloaders": batches}
    else:
        dino = {"color_jitter": JITTER, "color_jitter_p": JITTER_P, "grayscale_p": GRAY_P, "blur_sigma": SIGMA}
        recipe = dino if colour else {}
        dm = fast_datamodule(images, workdir, p, engine=loader, views=view_groups(sizes, colour), **recipe)
        fit = {"datamodule": dm}
    monitor = _fit(p, None, net=ViewsNet(p.arch, p.classes, p.channels_last), **fit)
    summary = dict(monitor.summary)
    del monitor, fit
    gc.collect()
    return summary


def train_cell(column: str, images: Path, workdir: Path, p: Plan) -> dict[str, Any]:
    """One training run; returns LoaderMonitor's summary (samples/s, data fraction, GPU utilization)."""
    fit: dict[str, Any]
    if column == "data-free":
        fit = {"train_dataloaders": DataFree(p, p.images // p.batch_size)}
    elif column == "imagefolder-float":
        fit = {"train_dataloaders": imagefolder_loader(images, p)}
    elif column == "imagefolder-uint8":
        fit = {"train_dataloaders": imagefolder_loader(images, p, uint8=True)}
    elif column == "device":
        fit = {"datamodule": fast_datamodule(images, workdir, p, decode="device")}
    elif column == "processes-nice":  # the training thread before the workers, for every core
        fit = {"datamodule": fast_datamodule(images, workdir, p, engine="processes", worker_nice=19)}
    else:
        fit = {"datamodule": fast_datamodule(images, workdir, p, engine=column)}
    monitor = _fit(p, None, net=_model(p), **fit)
    summary = dict(monitor.summary)
    del monitor, fit
    gc.collect()  # persistent workers of the last run stop before the next starts
    return summary


def loader_rate(make: Callable[[], Any], device: torch.device, warmup: int = 3) -> tuple[float, float]:
    """Images/s over one epoch after ``warmup`` batches, every batch in ``device`` memory (synchronized at the end),
    and the training process's CPU time per image in us (all its threads: ``time.process_time``)."""
    loader = make()
    seen, start, cpu = 0, 0.0, 0.0
    for i, batch in enumerate(loader):
        images = batch[0]
        if images.device != device:
            images = images.to(device, non_blocking=True)
        if i + 1 == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, cpu = time.perf_counter(), time.process_time()
        elif i + 1 > warmup:
            seen += images.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = seen / (time.perf_counter() - start) if seen else float("nan")
    us = (time.process_time() - cpu) / seen * 1e6 if seen else float("nan")
    del loader
    gc.collect()
    return rate, us


def _decode_alone(db: str, size: int, batch_size: int, part: list[list[int]], ready: Any, results: Any) -> None:
    from lightning_fastdata import LmdbImageDataset
    from lightning_fastdata.pipeline import BatchReader, KeyedIndices
    from lightning_fastdata.transforms import RandomResizedCropFlip

    torch.set_num_threads(1)
    # decoded as FastImageDataModule's datasets decode (its build_dataset): the fast DCT
    dataset = LmdbImageDataset(db, transform=RandomResizedCropFlip(size), fast_decode=True)
    reader = BatchReader(dataset, output="uint8")
    reader.read_batch(KeyedIndices(part[0], (0, 0)))  # warm: the environment, the buffers
    ready.wait()
    start = time.perf_counter()
    images = sum(len(reader.read_batch(KeyedIndices(indices, (0, 1)))[1]) for indices in part)
    results.put((start, time.perf_counter(), images))


def ceiling_rate(db: Path, p: Plan, processes: int) -> float:
    """Images/s of ``processes`` standalone processes reading ``db`` with the batch kernel, no data passing at all.

    Each forked process builds the same number of full batches (at least 4, together at least one epoch), taken in
    turn from the epoch's, into its own memory; the rate is every image over the span from the first start to the
    last end. (An epoch split as it falls would leave some processes a batch more than others, or idle: with 6,000
    images, 23 batches over 16 processes, that halved the ceiling.)
    """
    import multiprocessing

    from lightning_fastdata import LmdbImageDataset

    n = len(LmdbImageDataset(db))
    batches = [list(range(i, i + p.batch_size)) for i in range(0, n - p.batch_size + 1, p.batch_size)]
    each = max(4, -(-len(batches) // processes))
    parts = [[batches[(k + i * processes) % len(batches)] for i in range(each)] for k in range(processes)]
    fork = multiprocessing.get_context("fork")
    ready, results = fork.Barrier(processes), fork.Queue()
    procs = [
        fork.Process(target=_decode_alone, args=(str(db), p.image_size, p.batch_size, part, ready, results))
        for part in parts
    ]
    for proc in procs:
        proc.start()
    spans = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    return sum(images for *_, images in spans) / seconds


def scaling_row(name: str, images: Path, workdir: Path, p: Plan, workers: int) -> tuple[float, float]:
    q = dataclasses.replace(p, workers=workers)
    device = torch.device(p.device)
    if name == "imagefolder":
        return loader_rate(lambda: imagefolder_loader(images, q, uint8=True), device)

    def make() -> DataLoader:
        dm = fast_datamodule(images, workdir, q, engine=name)
        dm.setup("fit")
        return dm.train_dataloader()

    return loader_rate(make, device)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(summary: dict[str, Any] | None, free: dict[str, Any] | None) -> str:
    if not summary or not summary.get("samples_per_sec"):
        return "-"
    rate = summary["samples_per_sec"]
    parts = [f"{rate:,.0f}"]
    if free and free.get("samples_per_sec"):
        parts.append(f"{rate / free['samples_per_sec']:.0%} of data-free")
    if summary.get("data_fraction") is not None:
        parts.append(f"data {summary['data_fraction']:.0%}")
    if summary.get("gpu_util") is not None:
        parts.append(f"GPU {summary['gpu_util']:.0%} busy")
    return f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]


def _fits_table(fits: dict[str, dict[str, Any]], columns: list[str], labels: dict[str, str]) -> str:
    """A row per model, a cell per column of training runs, each against the model's data-free run."""
    rows = []
    for arch, row in fits.items():
        free = row.get("data-free")
        rows.append([MODELS[arch], *(_cell(row.get(c), free if c != "data-free" else None) for c in columns)])
    return _table(["model", *(labels[c] for c in columns)], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench_gpu", help="where the generated images and database go")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--images", type=int, default=16000, help="photo-like JPEGs to generate, in 10 classes")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warmup, left out")
    parser.add_argument("--workers", type=int, default=None, help="every loader's workers (default: usable CPUs)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--columns", nargs="*", choices=list(COLUMNS), default=list(COLUMNS))
    parser.add_argument("--scaling", nargs="*", type=int, default=[1, 4, 8, 16], help="table 2's worker counts")
    parser.add_argument("--views", nargs="*", choices=["resnet18", "resnet50"], default=[], help="table 3's models")
    parser.add_argument("--views-columns", nargs="*", choices=list(VIEW_COLUMNS), default=list(VIEW_COLUMNS))
    parser.add_argument("--view-sizes", nargs=2, type=int, default=[224, 96], help="table 3's large and small views")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if args.device != "cpu" and not cuda:
        print("bench_gpu: no CUDA GPU here; run it on a GPU node (or pass --device cpu for a smoke run).")
        return {}
    device = "cuda" if args.device in ("auto", "cuda") else "cpu"
    workdir = Path(args.workdir)
    classes = 10
    per_class = max(1, args.images // classes)
    workers = args.workers if args.workers is not None else usable_cpu_count()
    images = workdir / f"images-{classes * per_class}"
    if not images.is_dir():
        start = time.perf_counter()
        make_image_folder(images, classes, per_class, 0, min_size=300, max_size=640, noise=8)
        print(f"generated {classes * per_class} photo-like JPEGs in {time.perf_counter() - start:.1f} s", flush=True)
    base = Plan(
        device, "conv", "16-mixed" if device == "cuda" else None, classes, per_class, args.image_size,
        args.batch_size, args.epochs, workers, device == "cuda", True,
    )  # fmt: skip
    start = time.perf_counter()
    converted = fast_datamodule(images, workdir, base)
    converted.prepare_data()  # the one-time conversion, outside every timing
    print(f"converted once in {time.perf_counter() - start:.1f} s", flush=True)

    machine = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    results: dict[str, Any] = {
        "machine": machine,
        "usable_cpus": usable_cpu_count(),
        "workers": workers,
        "torch": torch.__version__,
        "training": {},
        "views": {},
        "scaling": {},
        "ceiling": {},
    }
    for arch in args.models:
        p = dataclasses.replace(base, arch=arch)
        row = results["training"][arch] = {}
        for column in args.columns:
            print(f"training {MODELS[arch]} from {COLUMNS[column]} ...", flush=True)
            row[column] = train_cell(column, images, workdir, p)
    for arch in args.views:
        p = dataclasses.replace(base, arch=arch)
        row = results["views"][arch] = {}
        for column in args.views_columns:
            print(f"training {MODELS[arch]} on DINO's views from {VIEW_COLUMNS[column]} ...", flush=True)
            row[column] = views_cell(column, images, workdir, p, tuple(args.view_sizes))
    for w in args.scaling:
        print(f"ceiling: {w} standalone decode processes ...", flush=True)
        results["ceiling"][w] = ceiling_rate(converted.database_path, base, w)
    for name in (*SCALING, "imagefolder"):
        for w in args.scaling:
            print(f"loader alone: {name}, {w} workers ...", flush=True)
            rate, us = scaling_row(name, images, workdir, base, w)
            results["scaling"].setdefault(name, {})[w] = rate
            results.setdefault("training_process_us", {}).setdefault(name, {})[w] = us

    print(
        f"\n{machine}, {results['usable_cpus']} usable CPUs, torch {torch.__version__}; {classes * per_class} images"
        f" (300-640 px JPEGs, stored at short side 256), batch {args.batch_size}, crop {args.image_size},"
        f" {'16-mixed, channels_last, ' if device == 'cuda' else ''}{workers} workers each, {args.epochs} epochs"
        " (the first left out)\n"
    )
    if results["training"]:
        print("Training, samples/s:\n" + _fits_table(results["training"], args.columns, COLUMNS))
    if results["views"]:
        large, small = args.view_sizes
        title = f"\nDINO's 8 views (2 x {large} + 6 x {small}), the network on every view, images/s:\n"
        print(title + _fits_table(results["views"], args.views_columns, VIEW_COLUMNS))
    if results["scaling"]:
        counts = list(args.scaling)
        names = {**SCALING, "imagefolder": SCALING_BASELINE}
        us = results["training_process_us"]
        rows = [
            [
                "ceiling: standalone decode processes, no data passing",
                *(f"{results['ceiling'][w]:,.0f}" for w in counts),
            ]
        ]
        rows += [
            [names[name], *(f"{results['scaling'][name][w]:,.0f} ({us[name][w]:.0f} us)" for w in counts)]
            for name in results["scaling"]
        ]
        title = "\nThe loader alone, batches into device memory, images/s (training process CPU us / image):\n"
        print(title + _table(["workers", *map(str, counts)], rows))
        top = counts[-1]
        share = results["scaling"]["processes"][top] / results["ceiling"][top]
        print(f'engine="processes" at {top} workers: {share:.2f}x the ceiling of {top} standalone decode processes')
    if args.json:
        with contextlib.suppress(OSError):
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
