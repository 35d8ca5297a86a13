"""Generate a synthetic ImageFolder of smooth, learnable JPEGs, for demos, tests and benchmarks (no download)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
from PIL import Image

from lightning_fastdata.cpus import usable_cpu_count


def _render(
    class_idx: int, num_classes: int, height: int, width: int, rng: np.random.Generator, noise: float = 0.0
) -> np.ndarray:
    """A smooth image whose stripe orientation and colour depend on the class, with random phase and blobs.

    ``noise`` adds per-pixel Gaussian grain (standard deviation on the 0-255 scale), which makes the JPEGs as
    costly to decode as photographs of the same size.
    """
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    angle = np.pi * class_idx / num_classes + rng.normal(0.0, 0.08)
    freq = 3.0 + 2.0 * (class_idx % 3) + rng.uniform(-0.5, 0.5)
    wave = np.sin(2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)) + rng.uniform(0, 2 * np.pi))
    hue = 2 * np.pi * class_idx / num_classes
    base = np.array([np.cos(hue), np.cos(hue - 2.1), np.cos(hue + 2.1)], dtype=np.float32) * 0.3 + 0.5
    img = base[None, None, :] + 0.25 * wave[..., None] * base[None, None, ::-1]
    for _ in range(2):
        cy, cx, radius = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.05, 0.2)
        blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * radius**2))
        img += blob[..., None] * rng.uniform(-0.3, 0.3, size=3).astype(np.float32)
    img *= 255.0
    if noise > 0:
        img += rng.normal(0.0, noise, size=img.shape).astype(np.float32)
    return np.clip(img, 0.0, 255.0).astype(np.uint8)


def _write_one(job: tuple[str, int, int, int, int, int, float, int]) -> int:
    path, class_idx, num_classes, min_size, max_size, quality, noise, seed = job
    rng = np.random.default_rng(seed)
    height, width = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    Image.fromarray(_render(class_idx, num_classes, height, width, rng, noise)).save(path, quality=quality)
    return os.path.getsize(path)


def make_image_folder(
    root: str | os.PathLike[str],
    num_classes: int = 4,
    train_per_class: int = 64,
    val_per_class: int = 16,
    min_size: int = 300,
    max_size: int = 640,
    quality: int = 90,
    noise: float = 0.0,
    seed: int = 0,
    num_workers: int | None = None,
) -> Path:
    """Write a synthetic image folder of JPEGs whose class is visible (stripe angle and colour).

    With ``val_per_class > 0`` the layout is ``root/{train,val}/class_<k>/<n>.jpg``; with ``0`` it is a plain
    ImageFolder ``root/class_<k>/<n>.jpg``. Sizes are drawn per image in ``[min_size, max_size]``. ``noise`` adds
    photo-like grain (pixel standard deviation on the 0-255 scale; 0 gives smooth images that decode unusually
    fast, 12 gives file sizes and decode costs close to photographs). The output is a deterministic function of the
    arguments.

    Returns:
        ``root`` as a :class:`~pathlib.Path`.

    Example:
        >>> from lightning_fastdata.synthetic import make_image_folder
        >>> root = make_image_folder("/tmp/synth", num_classes=3, train_per_class=20, val_per_class=5)

    """
    if num_classes < 1 or train_per_class < 1 or val_per_class < 0:
        raise ValueError(
            f"`num_classes`={num_classes}, `train_per_class`={train_per_class} must be >= 1 and"
            f" `val_per_class`={val_per_class} >= 0."
        )
    if not 1 <= min_size <= max_size:
        raise ValueError(f"`min_size`={min_size} and `max_size`={max_size} must satisfy 1 <= min_size <= max_size.")
    root = Path(root)
    splits = {"train": train_per_class, "val": val_per_class} if val_per_class else {"": train_per_class}
    jobs = []
    for split_idx, (split, per_class) in enumerate(splits.items()):
        for class_idx in range(num_classes):
            folder = root / split / f"class_{class_idx}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(per_class):
                job_seed = ((seed * 7919 + split_idx) * 1009 + class_idx) * 100_003 + n
                jobs.append(
                    (str(folder / f"{n:05d}.jpg"), class_idx, num_classes, min_size, max_size, quality, noise, job_seed)
                )
    workers = min(num_workers or usable_cpu_count(), max(1, len(jobs) // 64))
    if workers <= 1:
        for job in jobs:
            _write_one(job)
    else:
        with multiprocessing.get_context().Pool(workers) as pool:
            for _ in pool.imap_unordered(_write_one, jobs, chunksize=16):
                pass
    return root
