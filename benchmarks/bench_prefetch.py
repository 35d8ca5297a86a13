"""GPU benchmark (issue 5): step time with and without prefetch-to-device, and CPU vs GPU JPEG decode.

Needs CUDA; on a machine without it, it says so and exits 0.

1. Prefetch: a model where the copy matters (large uint8 batches, a light network in 16-mixed) trained from pinned
   in-memory batches, with `prefetch_to_device` off (Lightning's synchronous copy + normalization in
   `on_after_batch_transfer`) and on (copy + normalization of batch N+1 on a side stream while batch N computes).
2. Decode: FastImageDataModule loader throughput over a generated JPEG database with `decode="cpu"` vs
   `decode="device"` (batched nvJPEG), normalized batches on the GPU included.

    python benchmarks/bench_prefetch.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lightning_fastdata import FastImageDataModule, convert, make_image_folder
from lightning_fastdata.prefetch import DevicePrefetchLoader


class _Uint8Batches(Dataset):
    """`n` random uint8 images (made once), as a DataLoader sees a decoded dataset."""

    def __init__(self, n: int, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


def step_time_ms(prefetch: bool, args: argparse.Namespace) -> float:
    """Median ms per step of a light model on large batches, copy and normalization included."""
    device = torch.device("cuda", 0)
    dm = FastImageDataModule("unused", batch_size=args.batch_size, num_workers=0, prefetch_to_device=prefetch)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 7, stride=4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    ).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _Uint8Batches(args.batch_size * 8, args.image_size)
    on_device = dm.to_model_input
    loader = DevicePrefetchLoader(
        data, batch_size=args.batch_size, pin_memory=True, device=device if prefetch else None, on_device=on_device
    )
    times = []
    for _ in range(args.epochs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps = 0
        for batch in loader:
            if not prefetch:  # what Lightning does without prefetch: a blocking copy, then the hook
                batch = on_device([t.to(device, non_blocking=True) for t in batch])
            images, labels = batch
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start) / steps)
    return statistics.median(times[1:] if len(times) > 1 else times)


def decode_rate(decode: str, db: Path, args: argparse.Namespace) -> float:
    """Images/s of normalized GPU batches from the database with the given decode mode."""
    dm = FastImageDataModule(str(db), batch_size=args.batch_size, decode=decode, val_fraction=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(3):
        dm.to_model_input([t.cuda(non_blocking=True) if torch.is_tensor(t) else t for t in next(it)])
    torch.cuda.synchronize()
    start, count = time.perf_counter(), 0
    for batch in it:
        batch = dm.to_model_input([t.cuda(non_blocking=True) if torch.is_tensor(t) else t for t in batch])
        count += batch[0].shape[0]
    torch.cuda.synchronize()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images", type=int, default=4000, help="JPEGs generated for the decode comparison")
    parser.add_argument("--workdir", default=".bench")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefetch: no CUDA device here; this benchmark needs a GPU. Nothing measured.")
        return
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    off, on = step_time_ms(False, args), step_time_ms(True, args)
    print(f"| prefetch_to_device | ms / step (batch {args.batch_size} uint8 {args.image_size}px, 16-mixed) |")
    print("|---|---:|")
    print(f"| off (synchronous copy, then normalize) | {off:.2f} |")
    print(f"| on (side stream, one batch ahead) | {on:.2f} |")
    print(f"speedup: {off / on:.2f}x")

    folder = Path(args.workdir) / f"gpu-images-{args.images}"
    if not folder.is_dir():
        make_image_folder(folder, num_classes=10, train_per_class=args.images // 10, val_per_class=0, noise=8)
    db = folder.with_suffix(".lmdb")
    convert(folder, db, progress=False)
    cpu, gpu = decode_rate("cpu", db, args), decode_rate("device", db, args)
    print("| decode | images/s |")
    print("|---|---:|")
    print(f"| cpu (workers decode + crop) | {cpu:.0f} |")
    print(f"| device (nvJPEG batch decode + crop on GPU) | {gpu:.0f} |")


if __name__ == "__main__":
    main()
