"""`make demo`: generate an image folder, convert it to LMDB, read it back, and train a small model on it.

Everything runs on generated images: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from classifier import ImageClassifier
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_fastdata import FastImageDataModule, LmdbImageDataset, convert, make_image_folder, usable_cpu_count


class _Throughput(Callback):
    """Training images per second after the first step (worker start-up left out)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.images = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        else:
            self.images += batch[0].shape[0]

    @property
    def rate(self) -> float:
        return self.images / (time.perf_counter() - self.start) if self.start else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=".demo", help="where the generated folder and database go")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=80)
    parser.add_argument("--val-per-class", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
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

    print("[4/4] training resnet18 on 96 px crops (CPU)")
    dm = FastImageDataModule(str(database), image_size=96, batch_size=32)
    model = ImageClassifier(arch="resnet18", lr=0.05)
    speed = _Throughput()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[speed],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    metrics = trainer.callback_metrics
    print(
        f"  {args.epochs} epochs in {time.perf_counter() - start:.1f} s, {speed.rate:.0f} training images/s,"
        f" num_workers={dm.resolved_num_workers()}, val/acc={float(metrics['val/acc']):.2f},"
        f" val/loss={float(metrics['val/loss']):.3f}"
    )


if __name__ == "__main__":
    main()
