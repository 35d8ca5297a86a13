"""The crop-resize kernels on one core: time per image and distance from torchvision, on the loader's crop boxes.

Decodes photo-like JPEGs stored at short side 256 (as ``bench_loader.py`` stores them), draws
``RandomResizedCrop(224)`` boxes, and resizes each crop three ways, interleaved over rounds:

* ``INTER_AREA`` when shrinking, bilinear when enlarging (the kernel before; limit B's ``INTER_AREA``);
* bilinear only (no antialiasing);
* ``crop_resize_into`` (3-tap prefilter + bilinear below 2x, ``INTER_AREA`` from 2x, bilinear when enlarging).

For each it prints the mean time per image (all crops) and per shrunk crop, and the mean absolute difference from
``torchvision.transforms.v2.functional.resized_crop(antialias=True)`` in levels of 255, by kind of crop.

    python benchmarks/bench_kernels.py --images 400 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import simplejpeg
import torch
import torchvision.transforms.v2.functional as TF

from lightning_fastdata import LmdbImageDataset, convert, make_image_folder
from lightning_fastdata._cv import cv2
from lightning_fastdata.transforms import RandomResizedCropFlip, crop_resize_into

SIZE = 224


def _area_or_linear(image: np.ndarray, box, out: np.ndarray, scratch: np.ndarray) -> None:
    top, left, h, w = box
    interpolation = cv2.INTER_AREA if h >= SIZE and w >= SIZE else cv2.INTER_LINEAR
    cv2.resize(image[top : top + h, left : left + w], (SIZE, SIZE), dst=out, interpolation=interpolation)


def _linear(image: np.ndarray, box, out: np.ndarray, scratch: np.ndarray) -> None:
    top, left, h, w = box
    cv2.resize(image[top : top + h, left : left + w], (SIZE, SIZE), dst=out, interpolation=cv2.INTER_LINEAR)


def _ours(image: np.ndarray, box, out: np.ndarray, scratch: np.ndarray) -> None:
    crop_resize_into(image, box, SIZE, False, out, scratch)


KERNELS = {
    "INTER_AREA shrinking, bilinear enlarging": _area_or_linear,
    "bilinear only (not antialiased)": _linear,
    "crop_resize_into (prefilter + bilinear)": _ours,
}


def _kind(box) -> str:
    _, _, h, w = box
    if h > SIZE and w > SIZE:
        return "shrunk"
    return "enlarged" if h <= SIZE and w <= SIZE else "mixed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        make_image_folder(folder, num_classes=4, train_per_class=args.images // 4, val_per_class=0, noise=8, seed=0)
        convert(folder, Path(tmp) / "db", short_side=256, quality=90, progress=False)
        dataset = LmdbImageDataset(Path(tmp) / "db")
        images = []
        for i in range(len(dataset)):
            _, payload = dataset.read_record(i)
            images.append(simplejpeg.decode_jpeg(payload, "RGB", fastdct=True, fastupsample=True))
    random.seed(0)
    crop = RandomResizedCropFlip(SIZE)
    cases = [(image, crop.box(*image.shape[:2])) for image in images]
    kinds = [_kind(box) for _, box in cases]
    out, scratch = np.empty((SIZE, SIZE, 3), np.uint8), np.empty(1 << 21, np.uint8)

    distance: dict[str, dict[str, list[float]]] = {name: {} for name in KERNELS}
    for (image, box), kind in zip(cases, kinds, strict=True):
        reference = TF.resized_crop(torch.from_numpy(image).permute(2, 0, 1), *box, [SIZE, SIZE], antialias=True)
        reference = reference.permute(1, 2, 0).numpy().astype(np.float32)
        for name, kernel in KERNELS.items():
            kernel(image, box, out, scratch)
            distance[name].setdefault(kind, []).append(float(np.abs(out.astype(np.float32) - reference).mean()))

    per_image: dict[str, list[float]] = {name: [] for name in KERNELS}
    per_shrunk: dict[str, list[float]] = {name: [] for name in KERNELS}
    shrunk = [case for case, kind in zip(cases, kinds, strict=True) if kind == "shrunk"]
    for _ in range(args.rounds):
        for name, kernel in KERNELS.items():
            start = time.perf_counter()
            for image, box in cases:
                kernel(image, box, out, scratch)
            per_image[name].append((time.perf_counter() - start) / len(cases) * 1e6)
            start = time.perf_counter()
            for image, box in shrunk:
                kernel(image, box, out, scratch)
            per_shrunk[name].append((time.perf_counter() - start) / max(1, len(shrunk)) * 1e6)

    counts = {kind: kinds.count(kind) for kind in ("shrunk", "mixed", "enlarged")}
    print(f"{len(cases)} crops of photo-like 256-px images: {counts}; one core, median of {args.rounds} rounds")
    print()
    print("| kernel | µs / image | µs / shrunk crop | vs torchvision: shrunk | mixed | enlarged |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in KERNELS:
        d = {kind: statistics.mean(v) for kind, v in distance[name].items()}
        print(
            f"| {name} | {statistics.median(per_image[name]):.0f} | {statistics.median(per_shrunk[name]):.0f} |"
            f" {d.get('shrunk', float('nan')):.2f} | {d.get('mixed', float('nan')):.2f} |"
            f" {d.get('enlarged', float('nan')):.2f} |"
        )


if __name__ == "__main__":
    main()
