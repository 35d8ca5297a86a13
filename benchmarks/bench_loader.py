"""Loader throughput, side by side in one run on the same images (issue 3's benchmark).

(a) torchvision ImageFolder + DataLoader with the standard transforms
    (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize);
(b) FastImageDataModule on the converted database: same batch size and workers, same output
    (normalized float32 [B, 3, 224, 224]; the normalization is inside the timing);
(c) the machine's limit: one core's read + decode + crop rate on the database, times the usable cores.
(b-raw) and (c-raw): the same on a database converted with encoding="raw" (uint8 pixels, no decode).

    python benchmarks/bench_loader.py --images 3000
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from lightning_fastdata import FastImageDataModule, LmdbImageDataset, convert, make_image_folder, usable_cpu_count
from lightning_fastdata.transforms import RandomResizedCropFlip


def throughput(batches, warmup: int, measure: int, finish=lambda b: b) -> float:
    """Images/s over `measure` batches after `warmup` batches (worker start-up left out)."""
    it = iter(batches)
    for _ in range(warmup):
        finish(next(it))
    start, count = time.perf_counter(), 0
    for _ in range(measure):
        images = finish(next(it))[0]
        count += images.shape[0]
    return count / (time.perf_counter() - start)


def single_core_rate(db: Path, size: int, samples: int) -> float:
    """Read + decode + crop rate of one core (this process, one thread)."""
    torch.set_num_threads(1)
    dataset = LmdbImageDataset(db, split="train", transform=RandomResizedCropFlip(size))
    n = min(samples, len(dataset))
    for i in range(20):
        dataset[i]
    start = time.perf_counter()
    for i in range(n):
        dataset[i]
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench", help="where the generated images and database go")
    parser.add_argument("--images", type=int, default=3000, help="images to generate (300-640 px JPEGs)")
    parser.add_argument(
        "--noise", type=float, default=8.0, help="photo-like grain of the generated JPEGs (0 = smooth, decodes fast)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=25, help="batches measured per round (after warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument(
        "--main-threads",
        type=int,
        default=1,
        help="intra-op threads of this (the consuming) process; it only normalizes, and with more threads OpenMP"
        " spin-waits take cores from the workers (measured: 1 thread is fastest on 2 cores)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.main_threads)

    workdir = Path(args.workdir)
    folder = workdir / f"images-{args.images}-noise{args.noise:g}"
    db = folder.with_suffix(".lmdb")
    classes = 10
    if not folder.is_dir():
        t = time.perf_counter()
        make_image_folder(
            folder, num_classes=classes, train_per_class=args.images // classes, val_per_class=0, noise=args.noise
        )
        print(f"generated {args.images} JPEGs (300-640 px, noise {args.noise:g}) in {time.perf_counter() - t:.1f} s")
    print(convert(folder, db, progress=False).format())
    raw_db = folder.with_suffix(".raw.lmdb")
    print(convert(folder, raw_db, encoding="raw", progress=False).format())

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    standard = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    loader_a = DataLoader(
        datasets.ImageFolder(folder, transform=standard),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        drop_last=True,
    )

    def fast_loader(database: Path) -> tuple[FastImageDataModule, DataLoader]:
        dm = FastImageDataModule(str(database), batch_size=args.batch_size, num_workers=args.workers, val_fraction=0)
        dm.setup("fit")
        return dm, dm.train_dataloader()

    def finisher(dm: FastImageDataModule):
        def finish(batch):
            out = dm.on_after_batch_transfer(batch, 0)
            assert out[0].dtype == torch.float32
            assert out[0].shape == (args.batch_size, 3, 224, 224)
            return out

        return finish

    dm_b, loader_b = fast_loader(db)
    dm_r, loader_r = fast_loader(raw_db)
    rates: dict[str, list[float]] = {"a": [], "b": [], "r": []}
    for epoch in range(args.rounds):
        loader_b.sampler.set_epoch(epoch)
        loader_r.sampler.set_epoch(epoch)
        rates["a"].append(throughput(loader_a, warmup=3, measure=args.batches))
        rates["b"].append(throughput(loader_b, warmup=3, measure=args.batches, finish=finisher(dm_b)))
        rates["r"].append(throughput(loader_r, warmup=3, measure=args.batches, finish=finisher(dm_r)))
        print("round {}: (a) {:.0f}  (b) {:.0f}  (b-raw) {:.0f} img/s".format(epoch, *(r[-1] for r in rates.values())))
    cores = usable_cpu_count()
    core, core_raw = single_core_rate(db, 224, samples=600), single_core_rate(raw_db, 224, samples=600)
    a, b, r = (statistics.median(v) for v in rates.values())
    c, c_raw = core * cores, core_raw * cores
    print()
    print(f"machine: {platform.machine()}, {cores} usable CPUs ({os.cpu_count()} online), torch {torch.__version__}")
    print(
        f"{args.images} JPEGs of 300-640 px, noise {args.noise:g}; batch_size={args.batch_size},"
        f" num_workers={args.workers}, {args.main_threads} main-process thread(s), median of {args.rounds} rounds"
    )
    print("| pipeline | images/s | vs (a) |")
    print("|---|---:|---:|")
    print(f"| (a) ImageFolder + standard transforms | {a:.0f} | 1.00x |")
    print(f"| (b) FastImageDataModule, JPEG database (default) | {b:.0f} | {b / a:.2f}x |")
    print(f"| (c) limit: JPEG read + decode + crop, {core:.0f}/s on one core x {cores} | {c:.0f} | {c / a:.2f}x |")
    print(f'| (b-raw) FastImageDataModule, `encoding="raw"` database | {r:.0f} | {r / a:.2f}x |')
    print(
        f"| (c-raw) limit: raw read + crop, {core_raw:.0f}/s on one core x {cores} | {c_raw:.0f} | {c_raw / a:.2f}x |"
    )
    print(
        f"(b)/(a) = {b / a:.2f}x  (b)/(c) = {b / c:.2f}  (b-raw)/(a) = {r / a:.2f}x  (b-raw)/(c-raw) = {r / c_raw:.2f}"
    )


if __name__ == "__main__":
    main()
