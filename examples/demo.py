"""`make demo`: the same training fed by torchvision `ImageFolder` and by `FastImageDataModule`, side by side.

Generates a folder of photo-like JPEGs (nothing is downloaded), trains on it twice with the same batch size, crop
size and worker count, under `LoaderMonitor`, and prints both verdicts, the throughputs and the speed-up.

* On a machine with CUDA it shows the GPU story: torchvision's resnet18 (random init) in `16-mixed` with
  `channels_last` batches, fed by `ImageFolder`'s standard recipe (one worker per usable CPU, float32, pinned) and by
  `FastImageDataModule`'s GPU defaults (uint8 batches, prefetched to the device and normalized there), plus the
  model's data-free rate (one batch already on the GPU, over and over): how close each loader gets, and how busy it
  keeps the GPU.
* On a CPU it trains a tiny network (one strided convolution), so the loader, not the model, sets the pace.

python examples/demo.py [--workdir .demo] [--device auto|cpu|cuda] [--train-per-class N] [--epochs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torchvision
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from lightning_fastdata import FastImageDataModule, LoaderMonitor, make_image_folder, usable_cpu_count
from lightning_fastdata.store.sources import train_folder
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `make demo` trains on this machine: the same settings for every loader."""

    device: str
    arch: str
    precision: str | None
    classes: int
    train_per_class: int
    image_size: int
    batch_size: int
    epochs: int
    workers: int
    channels_last: bool
    data_free: bool

    @property
    def images(self) -> int:
        """Training images generated."""
        return self.classes * self.train_per_class


def plan(device: str = "auto", **overrides: Any) -> Plan:
    """The demo's settings: the GPU story where CUDA is (``device="auto"``), else the CPU one; ``overrides`` win."""
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    workers = usable_cpu_count()
    if cuda:  # three steady epochs of 40 steps in well under 3 minutes on one H100 with 16 cores
        base = Plan("cuda", "resnet18", "16-mixed", 10, 1000, 224, 256, 3, workers, True, True)
    else:  # a tiny network: the loader, not the model, sets the pace
        base = Plan("cpu", "tinynet", None, 4, 250, 224, 32, 3, workers, False, False)
    return dataclasses.replace(base, **overrides)


class _Classifier(LightningModule):
    """Cross-entropy on ``self.net``, SGD with momentum; logs nothing (a logged GPU tensor is read back each log)."""

    net: torch.nn.Module

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        return torch.nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TinyNet(_Classifier):
    """A few thousand parameters: a strided convolution, pooling and a linear head (cheap next to decoding)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 5, stride=4),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, num_classes),
        )


class TorchvisionNet(_Classifier):
    """A torchvision architecture (random init), in ``channels_last`` memory when the batches are."""

    def __init__(self, arch: str, num_classes: int, channels_last: bool) -> None:
        super().__init__()
        self.net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)


def model(p: Plan) -> _Classifier:
    """The plan's model, freshly initialized."""
    if p.arch == "tinynet":
        return TinyNet(p.classes)
    return TorchvisionNet(p.arch, p.classes, p.channels_last)


def trainer_kwargs(p: Plan) -> dict[str, Any]:
    """The Trainer's arguments: one GPU in 16-mixed, or the CPU."""
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if p.device == "cuda" else "cpu",
        "devices": 1,
        "max_epochs": p.epochs,
        "limit_val_batches": 0,
        "log_every_n_steps": 5,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if p.precision is not None:
        kwargs["precision"] = p.precision
    if p.device == "cuda":
        kwargs["benchmark"] = True  # cuDNN picks its fastest kernels in the warmup epoch
    return kwargs


def _fit(p: Plan, report_dir: Path | None, net: LightningModule | None = None, **fit: Any) -> LoaderMonitor:
    """Train ``net`` (default: the plan's model) under a LoaderMonitor; ``fit``: the loaders or the datamodule."""
    warnings.filterwarnings("ignore", message="You passed in a `val_dataloader` but have no `validation_step`")
    monitor = LoaderMonitor(report_dir=report_dir, verbose=False)
    Trainer(callbacks=[monitor], **trainer_kwargs(p)).fit(net if net is not None else model(p), **fit)
    return monitor


def imagefolder_loader(images: Path, p: Plan, uint8: bool = False) -> DataLoader:
    """The usual first attempt: ImageFolder, the standard torchvision transforms, one worker per usable CPU.

    ``uint8``: the same crop and flip, images left as uint8 tensors for the model to normalize on the device.
    """
    to_input = (
        [transforms.PILToTensor()]
        if uint8
        else [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    standard = transforms.Compose(
        [transforms.RandomResizedCrop(p.image_size), transforms.RandomHorizontalFlip(), *to_input]
    )
    train = datasets.ImageFolder(str(train_folder(images)), transform=standard)  # images/train/ when it has splits
    return DataLoader(
        train,
        batch_size=p.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=p.workers,
        persistent_workers=p.workers > 0,
        pin_memory=p.device == "cuda",
    )


def fast_datamodule(images: Path, workdir: Path, p: Plan, **kwargs: Any) -> FastImageDataModule:
    """FastImageDataModule with the plan's settings and its own defaults otherwise (``kwargs`` win)."""
    return FastImageDataModule(
        str(images),
        cache_dir=str(workdir / "cache"),
        image_size=p.image_size,
        batch_size=p.batch_size,
        num_workers=p.workers,
        val_fraction=0,
        channels_last=p.channels_last,
        **kwargs,
    )


class DataFree:
    """``steps`` times one batch already on the device: the model's rate when data costs nothing."""

    def __init__(self, p: Plan, steps: int) -> None:
        device = torch.device(p.device)
        fmt = torch.channels_last if p.channels_last else torch.contiguous_format
        images = torch.randn(p.batch_size, 3, p.image_size, p.image_size, device=device)
        self.batch = (images.contiguous(memory_format=fmt), torch.randint(0, p.classes, (p.batch_size,), device=device))
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.steps):
            yield self.batch


#: (row label, LoaderMonitor summary key, format)
ROWS = (
    ("verdict", "verdict", "s"),
    ("data wait mean (ms)", "wait_mean_ms", ".1f"),
    ("step mean (ms)", "step_mean_ms", ".1f"),
    ("data fraction", "data_fraction", ".1%"),
    ("throughput (samples/s)", "samples_per_sec", ".0f"),
    ("GPU utilization", "gpu_util", ".0%"),
    ("faster if data were free", "speedup_if_data_free", ".2f"),
)


def side_by_side(slow: dict[str, Any], fast: dict[str, Any], free: dict[str, Any] | None = None) -> str:
    """The LoaderMonitor summaries as one table, the speed-up in samples/s and, with the data-free run, how close
    each loader gets to it."""

    def cell(summary: dict[str, Any], key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else format(value, fmt)

    runs = [("ImageFolder", slow), ("FastImageDataModule", fast)] + ([("data-free", free)] if free else [])
    rows = [("", *(name for name, _ in runs))]
    for label, key, fmt in ROWS:
        if key == "gpu_util" and not any(key in summary for _, summary in runs):
            continue
        rows.append((label, *(cell(summary, key, fmt) for _, summary in runs)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  " + "  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))])
        for row in rows
    ]
    if slow.get("samples_per_sec") and fast.get("samples_per_sec"):
        ratio = fast["samples_per_sec"] / slow["samples_per_sec"]
        lines.append(f"  speed-up: {ratio:.2f}x the samples/s of ImageFolder")
    if free and free.get("samples_per_sec"):
        shares = ", ".join(
            f"{name} {summary['samples_per_sec'] / free['samples_per_sec']:.0%}"
            for name, summary in runs[:2]
            if summary.get("samples_per_sec")
        )
        lines.append(f"  of the data-free rate ({free['samples_per_sec']:.0f} samples/s): {shares}")
    return "\n".join(lines)


def compare(
    workdir: Path,
    classes: int | None = None,
    train_per_class: int | None = None,
    min_size: int = 300,
    max_size: int = 640,
    image_size: int | None = None,
    batch_size: int | None = None,
    epochs: int | None = None,
    workers: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Generate (once), convert (once), train from each loader (and data-free on CUDA); returns the summaries.

    Arguments left at ``None`` follow :func:`plan` for the device.
    """
    given = {
        "classes": classes,
        "train_per_class": train_per_class,
        "image_size": image_size,
        "batch_size": batch_size,
        "epochs": epochs,
        "workers": workers,
    }
    p = plan(device, **{k: v for k, v in given.items() if v is not None})
    steps = 5 if p.data_free else 4
    images = workdir / ("images" if p.device == "cpu" else f"images-{p.images}")
    if not images.is_dir():
        start = time.perf_counter()
        make_image_folder(images, p.classes, p.train_per_class, 0, min_size=min_size, max_size=max_size, noise=8)
        print(f"[1/{steps}] generated {p.images} photo-like JPEGs in {time.perf_counter() - start:.1f} s")
    else:
        print(f"[1/{steps}] reusing {images}")

    dm = fast_datamodule(images, workdir, p)
    start = time.perf_counter()
    dm.prepare_data()  # the one-time conversion, outside every timing
    print(f"[2/{steps}] converted once into {dm.database_path} in {time.perf_counter() - start:.1f} s")

    what = f"{p.arch} on {p.device}{f', {p.precision}' if p.precision else ''}, {p.epochs} epochs"
    print(f"[3/{steps}] {what}, from ImageFolder ({p.workers} workers, batch {p.batch_size}, {p.image_size} px)")
    slow = _fit(p, workdir / "report_imagefolder", train_dataloaders=imagefolder_loader(images, p))
    print(f"[4/{steps}] the same from FastImageDataModule")
    fast = _fit(p, workdir / "report_fastdata", datamodule=dm)
    free = None
    if p.data_free:
        print("[5/5] the same model with no data to wait for (one batch already on the GPU)")
        free = _fit(p, None, train_dataloaders=DataFree(p, p.images // p.batch_size)).summary
    speedup = None
    if slow.summary.get("samples_per_sec") and fast.summary.get("samples_per_sec"):
        speedup = fast.summary["samples_per_sec"] / slow.summary["samples_per_sec"]
    return {
        "plan": p,
        "imagefolder": slow.summary,
        "fastdata": fast.summary,
        "data_free": free,
        "speedup": speedup,
        "tables": (slow.format_table(), fast.format_table()),
        "reports": (workdir / "report_imagefolder", workdir / "report_fastdata"),
    }


def closing_line(now: float, started: float, make_started: float | None = None) -> str:
    """What the demo took, saying what was timed: from this process's start (``started``; Python's imports included)
    to ``now``, and with ``make_started`` (``make``'s start, passed by ``make demo``) the time creating ``.venv`` too.

    All three are seconds since the epoch.
    """
    demo = now - started
    if make_started is None:
        return f"the demo took {demo:.0f} s from its process's start (creating .venv, if `make` did, not included)"
    venv = max(0.0, started - make_started)
    if venv < 5:  # make found .venv ready: its start to the demo's is make's own few tenths of a second
        return f"make demo took {now - make_started:.0f} s (.venv was ready)"
    return f"make demo took {now - make_started:.0f} s: {venv:.0f} s creating .venv, then {demo:.0f} s the demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".demo", help="where the generated folder, database and reports go")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if there is one")
    parser.add_argument("--classes", type=int, default=None)
    parser.add_argument("--train-per-class", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="the first is warmup, left out of the verdicts")
    args = parser.parse_args()
    # the workers take the cores; the training process keeps one intra-op thread, so OpenMP spin-waits in the
    # (tiny, on a CPU) training step do not take cores from them, for every loader alike
    torch.set_num_threads(1)
    result = compare(
        Path(args.workdir),
        classes=args.classes,
        train_per_class=args.train_per_class,
        image_size=args.image_size,
        batch_size=args.batch_size,
        epochs=args.epochs,
        device=args.device,
    )
    for name, table in zip(("ImageFolder", "FastImageDataModule"), result["tables"], strict=True):
        print(f"\n{name}: {table}")
    p = result["plan"]
    machine = torch.cuda.get_device_name() if p.device == "cuda" else "CPU"
    cpus = usable_cpu_count()
    print(f"\nSide by side ({p.arch}, {machine}, {cpus} usable CPUs; LoaderMonitor, warmup epoch left out):")
    print(side_by_side(result["imagefolder"], result["fastdata"], result["data_free"]))
    for report in result["reports"]:
        chart = report / "loader_report.png"
        print(f"report: {report / 'loader_report.json'}" + (f", chart {chart}" if chart.is_file() else ""))
    since = os.environ.get("MAKE_DEMO_STARTED")  # set by `make demo`, before it creates .venv
    print(closing_line(time.time(), psutil.Process().create_time(), float(since) if since else None))


if __name__ == "__main__":
    main()
