"""`make demo`: the same small training fed by torchvision `ImageFolder` and by `FastImageDataModule`, side by side.

Generates a folder of photo-like JPEGs (nothing is downloaded), trains a tiny network on it twice, with the same
batch size, crop size and worker count, under `LoaderMonitor`, and prints both verdicts, the throughputs and the
speed-up. The network is tiny on purpose: the loader, not the model, decides how fast it trains.

python examples/demo.py [--workdir .demo] [--train-per-class 250] [--epochs 3]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from lightning_fastdata import FastImageDataModule, LoaderMonitor, make_image_folder, usable_cpu_count
from lightning_fastdata.convert import train_folder
from lightning_fastdata.datamodule import IMAGENET_MEAN, IMAGENET_STD


class TinyNet(LightningModule):
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

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        loss = torch.nn.functional.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _trainer(monitor: LoaderMonitor, epochs: int) -> Trainer:
    warnings.filterwarnings("ignore", message="You passed in a `val_dataloader` but have no `validation_step`")
    return Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=[monitor],
        limit_val_batches=0,
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def train_imagefolder(
    images: Path, report_dir: Path, image_size: int, batch_size: int, workers: int, epochs: int
) -> LoaderMonitor:
    """The usual first attempt: ImageFolder with the standard torchvision transforms, decoding every file."""
    standard = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    train = datasets.ImageFolder(str(train_folder(images)), transform=standard)  # images/train/ when it has splits
    loader = DataLoader(
        train,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    monitor = LoaderMonitor(report_dir=report_dir, verbose=False)
    _trainer(monitor, epochs).fit(TinyNet(len(train.classes)), loader)
    return monitor


def train_fastdata(dm: FastImageDataModule, report_dir: Path, epochs: int) -> LoaderMonitor:
    """The same training from the converted database: uint8 crops in the workers, normalization after transfer."""
    monitor = LoaderMonitor(report_dir=report_dir, verbose=False)
    _trainer(monitor, epochs).fit(TinyNet(dm.num_classes), datamodule=dm)
    return monitor


#: (row label, LoaderMonitor summary key, format)
ROWS = (
    ("verdict", "verdict", "s"),
    ("data wait p50 (ms)", "wait_p50_ms", ".1f"),
    ("step p50 (ms)", "step_p50_ms", ".1f"),
    ("data fraction", "data_fraction", ".1%"),
    ("throughput (samples/s)", "samples_per_sec", ".0f"),
    ("faster if data were free", "speedup_if_data_free", ".2f"),
)


def side_by_side(slow: dict[str, Any], fast: dict[str, Any]) -> str:
    """The two LoaderMonitor summaries as one table, and the speed-up in samples/s."""

    def cell(summary: dict[str, Any], key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else format(value, fmt)

    rows = [("", "ImageFolder", "FastImageDataModule")]
    rows += [(label, cell(slow, key, fmt), cell(fast, key, fmt)) for label, key, fmt in ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"  {a.ljust(widths[0])}  {b.rjust(widths[1])}  {c.rjust(widths[2])}" for a, b, c in rows]
    if slow.get("samples_per_sec") and fast.get("samples_per_sec"):
        ratio = fast["samples_per_sec"] / slow["samples_per_sec"]
        lines.append(f"  speed-up: {ratio:.2f}x the samples/s of ImageFolder")
    return "\n".join(lines)


def compare(
    workdir: Path,
    classes: int = 4,
    train_per_class: int = 250,
    min_size: int = 300,
    max_size: int = 640,
    image_size: int = 224,
    batch_size: int = 32,
    epochs: int = 3,
    workers: int | None = None,
) -> dict[str, Any]:
    """Generate (once), convert (once), train twice; returns both summaries, the speed-up and the report paths."""
    images = workdir / "images"
    workers = usable_cpu_count() if workers is None else workers
    if not images.is_dir():
        start = time.perf_counter()
        make_image_folder(images, classes, train_per_class, 0, min_size=min_size, max_size=max_size, noise=8)
        print(f"[1/4] generated {classes * train_per_class} photo-like JPEGs in {time.perf_counter() - start:.1f} s")
    else:
        print(f"[1/4] reusing {images}")

    dm = FastImageDataModule(
        str(images),
        cache_dir=str(workdir / "cache"),
        image_size=image_size,
        batch_size=batch_size,
        num_workers=workers,
        val_fraction=0,
    )
    start = time.perf_counter()
    dm.prepare_data()  # the one-time conversion, outside both timings
    print(f"[2/4] converted once into {dm.database_path} in {time.perf_counter() - start:.1f} s")

    print(f"[3/4] training from ImageFolder ({epochs} epochs, {workers} workers, batch {batch_size}, {image_size} px)")
    slow = train_imagefolder(images, workdir / "report_imagefolder", image_size, batch_size, workers, epochs)
    print("[4/4] training from FastImageDataModule (same settings)")
    fast = train_fastdata(dm, workdir / "report_fastdata", epochs)
    speedup = None
    if slow.summary.get("samples_per_sec") and fast.summary.get("samples_per_sec"):
        speedup = fast.summary["samples_per_sec"] / slow.summary["samples_per_sec"]
    return {
        "imagefolder": slow.summary,
        "fastdata": fast.summary,
        "speedup": speedup,
        "tables": (slow.format_table(), fast.format_table()),
        "reports": (workdir / "report_imagefolder", workdir / "report_fastdata"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".demo", help="where the generated folder, database and reports go")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=250)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warmup, left out of the verdicts")
    args = parser.parse_args()
    # the workers take the cores; the training process keeps one intra-op thread, so OpenMP spin-waits in the
    # (tiny) training step do not take cores from them, for both loaders alike
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    result = compare(
        workdir,
        classes=args.classes,
        train_per_class=args.train_per_class,
        image_size=args.image_size,
        batch_size=args.batch_size,
        epochs=args.epochs,
    )
    for name, table in zip(("ImageFolder", "FastImageDataModule"), result["tables"], strict=True):
        print(f"\n{name}: {table}")
    print("\nSide by side (LoaderMonitor, warmup epoch left out):")
    print(side_by_side(result["imagefolder"], result["fastdata"]))
    for report in result["reports"]:
        chart = report / "loader_report.png"
        print(f"report: {report / 'loader_report.json'}" + (f", chart {chart}" if chart.is_file() else ""))


if __name__ == "__main__":
    main()
