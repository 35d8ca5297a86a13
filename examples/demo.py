"""`make demo`: generate an image folder, convert it to LMDB, read it back, and print a summary.

Everything runs on generated images: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lightning_fastdata import LmdbImageDataset, convert, make_image_folder, usable_cpu_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default=".demo", help="where the generated folder and database go")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--train-per-class", type=int, default=80)
    parser.add_argument("--val-per-class", type=int, default=20)
    args = parser.parse_args()

    workdir = Path(args.workdir)
    images, database = workdir / "images", workdir / "images.lmdb"
    if not (images / "train").is_dir():
        start = time.perf_counter()
        make_image_folder(images, args.classes, args.train_per_class, args.val_per_class)
        print(f"[1/3] generated {images} in {time.perf_counter() - start:.1f} s")
    else:
        print(f"[1/3] reusing {images}")

    print(f"[2/3] converting {images} -> {database}")
    print(convert(images, database).format())

    print("[3/3] reading it back")
    workers = usable_cpu_count()
    for split in ("train", "val"):
        dataset = LmdbImageDataset(database, split=split)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers, shuffle=split == "train")
        start, pixels, labels = time.perf_counter(), 0, torch.zeros(len(dataset.classes), dtype=torch.long)
        for image, label in loader:
            assert image.dtype == torch.uint8
            assert image.shape[0] == 3
            pixels += image[0].numel()
            labels[label] += 1
        seconds = time.perf_counter() - start
        print(
            f"  {split:5s} {len(dataset)} images in {seconds:.2f} s ({len(dataset) / seconds:.0f} images/s,"
            f" {workers} workers), mean {pixels / len(dataset):.0f} px, per class {labels.tolist()}"
        )
        assert labels.tolist() == dataset.class_counts


if __name__ == "__main__":
    main()
