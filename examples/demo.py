"""`make demo`: generate an image folder, convert it to LMDB, read it back, and train a small model on it.

Everything runs on generated images: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from classifier import ImageClassifier
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_fastdata import (
    FastImageDataModule,
    LmdbImageDataset,
    LoaderMonitor,
    convert,
    make_image_folder,
    usable_cpu_count,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=".demo", help="where the generated folder and database go")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=80)
    parser.add_argument("--val-per-class", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warmup, left out of the verdict")
    args = parser.parse_args()

    workdir = Path(args.workdir)
    images, database = workdir / "images", workdir / "images.lmdb"
    if not (images / "train").is_dir():
        start = time.perf_counter()
        make_image_folder(images, args.classes, args.train_per_class, args.val_per_class)
        print(f"[1/4] generated {images} in {time.perf_counter() - start:.1f} s")
    else:
        print(f"[1/4] reusing {images}")

    print(f"[2/4] converting {images} -> {database}")
    print(convert(images, database).format())

    print("[3/4] reading it back")
    workers = usable_cpu_count()
    for split in ("train", "val"):
        dataset = LmdbImageDataset(database, split=split)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers, shuffle=split == "train")
        start, labels = time.perf_counter(), torch.zeros(len(dataset.classes), dtype=torch.long)
        for image, label in loader:
            if image.dtype != torch.uint8 or image.shape[0] != 3:
                raise RuntimeError(f"unexpected image {image.dtype} {tuple(image.shape)}")
            labels[label] += 1
        seconds = time.perf_counter() - start
        if labels.tolist() != dataset.class_counts:
            raise RuntimeError(f"read back {labels.tolist()}, expected {dataset.class_counts}")
        print(f"  {split:5s} {len(dataset)} images, per class {labels.tolist()}, {len(dataset) / seconds:.0f} images/s")

    print("[4/4] training resnet18 on 96 px crops (CPU) with LoaderMonitor")
    dm = FastImageDataModule(str(database), image_size=96, batch_size=32)
    model = ImageClassifier(arch="resnet18", lr=0.05)
    monitor = LoaderMonitor(report_dir=workdir / "loader_report", verbose=False)  # the table is printed below
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[monitor],
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    metrics = trainer.callback_metrics
    print(
        f"  {args.epochs} epochs in {time.perf_counter() - start:.1f} s, num_workers={dm.resolved_num_workers()},"
        f" val/acc={float(metrics['val/acc']):.2f}, val/loss={float(metrics['val/loss']):.3f}"
    )
    print(f"  report: {workdir / 'loader_report'}/loader_report.json (+ .png with matplotlib)")
    print(monitor.format_table())


if __name__ == "__main__":
    main()
