"""Self-supervised multi-view loading against the peers: DINO's 8 views, side by side in one run (issue 35).

Every loader reads the same photo-like JPEGs (stored at short side 256, quality 90) and makes DINO's views of each
image — 2 x 224 at scale (0.4, 1) and 6 x 96 at scale (0.05, 0.4), each flipped with probability 0.5 — in batches
of 64, with the same number of workers or threads, each in its own process, interleaved over rounds (the median is
reported), ``--epochs`` (default 2) timed after a warm-up one:

* torchvision ``ImageFolder`` + v2 per view: PIL decodes each image once, then 8 ``v2.RandomResizedCrop`` + flip on
  the PIL image, ``v2.PILToTensor`` (uint8): the lightly / solo-learn CPU path, a ``DataLoader`` with workers;
* NVIDIA DALI, CPU-only, both ways: ``fn.decoders.image_random_crop`` per view (each view decodes its image again),
  and one ``fn.decoders.image`` + ``fn.random_resized_crop`` per view (solo-learn's DALI pipeline); uint8 CHW.
  DALI runs from the peers' interpreter (``--peers-python``, default this checkout's ``.venv-peers/bin/python``, made
  by ``bash benchmarks/install_peers.sh``) when this one has no DALI;
* ``FastImageDataModule(views=DINO)``: threads and ``engine="processes"``, uint8 (what a GPU trainer receives) and
  normalized float32 (CPU training);
* the limit: ``simplejpeg`` (fast DCT and upsampling) decodes each image once, then 8 ``cv2.resize(INTER_AREA)`` of
  random boxes (+ ``cv2.flip``), one process per usable core at once, no loader, no batches.

"With colour" rows add DINO's colour recipe per view (jitter (0.4, 0.4, 0.2, 0.1) with p 0.8, grayscale p 0.2,
Gaussian blur sigma (0.1, 2) with p 1.0 / 0.1 / 0.5 for the first global view, the second and the local ones,
solarize p 0.2 on the second global view): torchvision v2 ops on the PIL views, DALI ops on the views of its
decode-once pipeline; ours with ``views`` whose groups set DINO's per-view probabilities (CPU training: each view
coloured in the loader as it is cropped; uint8: the parameters drawn for the GPU, not coloured here); and two limits:
the same ops as ours in OpenCV (one ``cv2.transform`` for jitter + grayscale with the hue turned in YIQ,
``cv2.sepFilter2D`` blur, ``cv2.LUT`` solarize) and OpenCV with torchvision's formulas (an HSV round trip for hue).
``single-*`` rows: one RandomResizedCrop(224) + flip, with and without ``color_jitter`` etc.; ``single-uint8-processes``
is there for the training process's CPU per image on the processes engine, a single view's beside all 8 views'.

Each row reports images/s (an image is all 8 of its views) and CPU-seconds per 1,000 images (the process and its
children).

    python benchmarks/bench_views.py --images 800 --rounds 3
    python benchmarks/bench_views.py --only views-uint8 limit --images 200 --rounds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_loader import _resize_folder
from bench_loader import _timed_epoch as _timed

#: DINO's views: (size, count, scale); flip 0.5, ratio (3/4, 4/3) for all
GROUPS = ((224, 2, (0.4, 1.0)), (96, 6, (0.05, 0.4)))
SIZES = [size for size, count, _ in GROUPS for _ in range(count)]
SCALES = [scale for _, count, scale in GROUPS for _ in range(count)]
JITTER, JITTER_P, GRAY_P, SIGMA, SOLARIZE = (0.4, 0.4, 0.2, 0.1), 0.8, 0.2, (0.1, 2.0), 128
#: per view: (blur probability, solarize probability), DINO's: global 1, global 2, then the local views
VIEW_COLOUR = [(1.0, 0.0), (0.1, 0.2)] + [(0.5, 0.0)] * 6
BLUR_KERNEL = 2 * 6 + 1  # 2 * ceil(3 * max sigma) + 1: what ours uses by default (torchvision needs one given)
SINGLE = 224
#: DINO's views with its per-view blur and solarize probabilities: the groups ours takes
COLOUR_GROUPS = (
    {"size": 224, "scale": (0.4, 1.0), "blur_p": 1.0},
    {"size": 224, "scale": (0.4, 1.0), "blur_p": 0.1, "solarize_p": 0.2},
    {"size": 96, "count": 6, "scale": (0.05, 0.4), "blur_p": 0.5},
)


# ---------------------------------------------------------------------------------------------------------------
# One loader, in its own process
# ---------------------------------------------------------------------------------------------------------------


def _views_checker(dtype):
    def check(batch) -> int:
        views = batch[0]
        assert [tuple(v.shape[1:]) for v in views] == [(3, s, s) for s in SIZES], [v.shape for v in views]
        assert all(v.dtype == dtype for v in views), views[0].dtype
        return int(views[0].shape[0])

    return check


class TorchvisionViews:
    """DINO's views of a PIL image as the lightly / solo-learn CPU path makes them: ``v2.RandomResizedCrop`` + flip
    per view (with ``colour``, DINO's v2 colour ops on each PIL view), then ``v2.PILToTensor`` (uint8 CHW).

    ``sizes``: the large and the small views' sides (DINO's 224 and 96).
    """

    def __init__(self, colour: bool, sizes: tuple[int, int] = (GROUPS[0][0], GROUPS[1][0])) -> None:
        from torchvision.transforms import v2

        def view(size: int, scale, blur_p: float, solarize_p: float):
            ops = [v2.RandomResizedCrop(size, scale=scale, antialias=True), v2.RandomHorizontalFlip()]
            if colour:
                ops += [
                    v2.RandomApply([v2.ColorJitter(*JITTER)], p=JITTER_P),
                    v2.RandomGrayscale(GRAY_P),
                    v2.RandomApply([v2.GaussianBlur(BLUR_KERNEL, sigma=SIGMA)], p=blur_p),
                    v2.RandomSolarize(SOLARIZE, p=solarize_p),
                ]
            return v2.Compose([*ops, v2.PILToTensor()])

        sides = [sizes[0] if size == GROUPS[0][0] else sizes[1] for size in SIZES]  # (large, small)
        self.views = [view(s, sc, *c) for s, sc, c in zip(sides, SCALES, VIEW_COLOUR, strict=True)]

    def __call__(self, image):  # decoded once by ImageFolder's PIL loader
        return [v(image) for v in self.views]


def run_torchvision(args, colour: bool) -> dict[str, float]:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets

    loader = DataLoader(
        datasets.ImageFolder(args.resized, transform=TorchvisionViews(colour)),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        drop_last=True,
    )
    return _timed(lambda epoch: loader, _views_checker(torch.uint8), args.epochs)


def run_dali(args, once: bool, colour: bool = False) -> dict[str, float]:
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    def coin(p: float):
        return fn.random.coin_flip(probability=p, dtype=types.UINT8)

    def coloured(image, blur_p: float, solarize_p: float):
        # jitter with p 0.8 (neutral factors otherwise), grayscale p 0.2 as saturation 0 (solo-learn's DALI way)
        on, grey = fn.cast(coin(JITTER_P), dtype=types.FLOAT), fn.cast(coin(GRAY_P), dtype=types.FLOAT)
        b, c, s, h = JITTER
        brightness = on * fn.random.uniform(range=[1 - b, 1 + b]) + (1 - on)
        contrast = on * fn.random.uniform(range=[1 - c, 1 + c]) + (1 - on)
        saturation = (on * fn.random.uniform(range=[1 - s, 1 + s]) + (1 - on)) * (1 - grey)
        hue = on * fn.random.uniform(range=[-h * 360, h * 360])
        image = fn.color_twist(image, brightness=brightness, contrast=contrast, saturation=saturation, hue=hue)
        if blur_p > 0:  # DALI has no per-sample "apply": blur all, keep the blurred ones (solo-learn does the same)
            blurred = fn.gaussian_blur(image, window_size=BLUR_KERNEL, sigma=fn.random.uniform(range=list(SIGMA)))
            image = (
                blurred
                if blur_p >= 1
                else fn.cast(blurred * coin(blur_p) + image * (1 - coin(blur_p)), dtype=types.UINT8)
            )
        if solarize_p > 0:
            keep = fn.cast(image < SOLARIZE, dtype=types.UINT8)
            solar = fn.cast(image * keep + (255 - image) * (1 - keep), dtype=types.UINT8)
            m = coin(solarize_p)
            image = fn.cast(solar * m + image * (1 - m), dtype=types.UINT8)
        return image

    @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=args.resized, random_shuffle=True, name="reader")
        decoded = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB) if once else None
        outputs = []
        for size, scale, (blur_p, solarize_p) in zip(SIZES, SCALES, VIEW_COLOUR, strict=True):
            if once:
                image = fn.random_resized_crop(decoded, size=[size, size], random_area=list(scale))
            else:
                image = fn.decoders.image_random_crop(jpegs, output_type=types.RGB, random_area=list(scale))
                image = fn.resize(image, resize_x=size, resize_y=size)
            if colour:
                image = coloured(image, blur_p, solarize_p)
            image = fn.crop_mirror_normalize(
                image, dtype=types.UINT8, output_layout="CHW", mirror=fn.random.coin_flip(), mean=[0.0], std=[1.0]
            )
            outputs.append(image)
        return (*outputs, labels)

    p = pipe()
    p.build()
    names = [f"v{i}" for i in range(len(SIZES))]
    loader = DALIGenericIterator(
        p, [*names, "labels"], reader_name="reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )
    epoch = lambda k: (([b[0][n] for n in names], b[0]["labels"]) for b in loader)  # noqa: E731
    return _timed(epoch, _views_checker(torch.uint8), args.epochs)


def _datamodule(args, output: str, engine: str, **kwargs):
    from lightning_fastdata import FastImageDataModule

    class DataModule(FastImageDataModule):
        def _output(self):  # uint8: what CUDA training reads, before its copy to the device (no CUDA here)
            return output

    dm = DataModule(args.db, batch_size=args.batch_size, num_workers=args.workers, engine=engine, val_fraction=0,
                    **kwargs)  # fmt: skip
    if getattr(dm, "_loaders", None) is not None:  # the loader side picks the output (before, the DataModule did)
        dm._loaders.output = lambda decode, device: output
    dm.setup("fit")
    loader = dm.train_dataloader()

    def epoch(k: int):
        loader.sampler.set_epoch(k)
        return loader

    return dm, epoch


def run_views(args, output: str, engine: str, colour: bool = False) -> dict[str, float]:
    """Ours with ``views=DINO``; with colour, DINO's recipe (on a CPU, float32: coloured in the loader)."""

    from lightning_fastdata import ViewGroup

    views = [ViewGroup(size, count=count, scale=scale) for size, count, scale in GROUPS]
    kwargs = {}
    if colour:
        views = [ViewGroup(**group) for group in COLOUR_GROUPS]
        kwargs = {"color_jitter": JITTER, "color_jitter_p": JITTER_P, "grayscale_p": GRAY_P, "blur_sigma": SIGMA}
    _, epoch = _datamodule(args, output, engine, views=views, **kwargs)
    return _timed(epoch, _views_checker(_ours_dtype(output)), args.epochs)


def _ours_dtype(output: str):
    """What ours hands over: uint8 on a CPU-only machine; on a CUDA one, every batch is copied to the GPU and a uint8
    one is coloured and normalized there (without a Trainer the DataModule trains on CUDA where there is one)."""
    import torch

    return torch.float32 if output == "float" or torch.cuda.is_available() else torch.uint8


def run_single(args, output: str, colour: bool, engine: str = "threads") -> dict[str, float]:
    """Ours, one RandomResizedCrop(224) + flip, with or without the colour stage. With colour, ``float`` (CPU
    training) colours each crop in the loader; ``uint8`` draws the parameters and leaves the colouring to the GPU
    (not run here)."""

    kwargs = {}
    if colour:
        kwargs = {"color_jitter": JITTER, "color_jitter_p": JITTER_P, "grayscale_p": GRAY_P, "blur_p": 0.5,
                  "blur_sigma": SIGMA, "solarize_p": 0.2}  # fmt: skip
    _, epoch = _datamodule(args, output, engine, **kwargs)
    dtype = _ours_dtype(output)

    def check(batch) -> int:
        assert batch[0].dtype == dtype, batch[0].dtype
        assert tuple(batch[0].shape[1:]) == (3, SINGLE, SINGLE), batch[0].shape
        return int(batch[0].shape[0])

    return _timed(epoch, check, args.epochs)


def _cv2_colour(image, blur_p: float, solarize_p: float, rng) -> None:
    """DINO's colour ops on one uint8 RGB view, in place, with OpenCV and torchvision's formulas (HSV hue)."""
    import cv2
    import numpy as np

    if rng.random() < JITTER_P:
        b, c, s, h = JITTER
        cv2.convertScaleAbs(image, dst=image, alpha=rng.uniform(1 - b, 1 + b))  # brightness
        grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        f = rng.uniform(1 - c, 1 + c)  # contrast: blend with the mean grey
        cv2.addWeighted(image, f, image, 0, (1 - f) * float(grey.mean()), dst=image)
        f = rng.uniform(1 - s, 1 + s)  # saturation: blend with the grey image
        grey = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
        cv2.addWeighted(image, f, grey, 1 - f, 0, dst=image)
        hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)  # hue: H in [0, 180)
        shift = round(rng.uniform(-h, h) * 180)
        lut = ((np.arange(256) + shift) % 180).astype(np.uint8)
        hsv[..., 0] = cv2.LUT(hsv[..., 0], lut)
        cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=image)
    if rng.random() < GRAY_P:
        cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB, dst=image)
    if rng.random() < blur_p:
        sigma = rng.uniform(*SIGMA)
        cv2.GaussianBlur(image, (BLUR_KERNEL, BLUR_KERNEL), sigma, dst=image, borderType=cv2.BORDER_REFLECT_101)
    if rng.random() < solarize_p:
        cv2.LUT(image, _SOLARIZE_LUT, dst=image)


_SOLARIZE_LUT = None


def _matrix_colour(image, blur_p: float, solarize_p: float, rng) -> None:
    """The same ops as ours on one uint8 RGB view, in place, in OpenCV: jitter and grayscale as one ``3 x 4``
    ``cv2.transform`` (brightness x contrast, saturation, the hue turned about the grey axis in YIQ, grayscale),
    ``cv2.sepFilter2D`` with a Gaussian cut at 3 sigma, solarize by ``cv2.LUT``."""
    import math

    import cv2
    import numpy as np

    eye, project, quarter, grey = _BASIS
    linear, jitter = eye, rng.random() < JITTER_P
    b = c = 1.0
    if jitter:
        jb, jc, js, jh = JITTER
        b, c, sat, hue = (rng.uniform(1 - jb, 1 + jb), rng.uniform(1 - jc, 1 + jc), rng.uniform(1 - js, 1 + js),
                          rng.uniform(-jh, jh))  # fmt: skip
        turn = 2 * math.pi * hue
        linear = (project + math.cos(turn) * (eye - project) + math.sin(turn) * quarter) @ (
            sat * eye + (1 - sat) * grey
        )
    if rng.random() < GRAY_P:
        linear = grey @ linear
    if linear is not eye:  # jitter or grayscale drawn
        red, green, blue, _ = cv2.mean(image)
        offset = linear.sum(axis=1) * (1 - c) * b * (0.2989 * red + 0.587 * green + 0.114 * blue)
        cv2.transform(image, np.hstack([linear * (b * c), offset[:, None]]).astype(np.float32), dst=image)
    if rng.random() < blur_p:
        sigma = rng.uniform(*SIGMA)
        radius = min(BLUR_KERNEL // 2, math.ceil(3 * sigma))
        taps = np.exp(-0.5 * (np.arange(-radius, radius + 1, dtype=np.float32) / np.float32(sigma)) ** 2)
        taps /= taps.sum()
        cv2.sepFilter2D(image, -1, taps, taps, dst=image, borderType=cv2.BORDER_REFLECT_101)
    if rng.random() < solarize_p:
        cv2.LUT(image, _SOLARIZE_LUT, dst=image)


_BASIS = None


def run_limit(args, colour: bool | str, kernel: str = "inter_area") -> dict[str, float]:
    """Decode once with simplejpeg (fast DCT), 8 ``cv2.resize(INTER_AREA)`` of random boxes (+ flip): one forked
    process per usable core at once, each over its share of the images (as many as the loaders read).

    ``kernel="ours"`` crops with this package's kernel (:func:`~lightning_fastdata.transforms.crop_resize_into`: a
    3-tap prefilter and bilinear instead of ``INTER_AREA``), as bench_loader.py's ``limit-b-ours``. ``colour``:
    ``True`` for torchvision's formulas in OpenCV, ``"matrix"`` for ours."""
    global _SOLARIZE_LUT, _BASIS
    import multiprocessing
    import random

    import cv2
    import numpy as np
    import simplejpeg

    from lightning_fastdata import usable_cpu_count
    from lightning_fastdata.transforms import RandomResizedCropFlip, crop_resize_into

    cv2.setNumThreads(1)
    scratch = np.empty(1 << 20, np.uint8)
    _SOLARIZE_LUT = np.array([v if v < SOLARIZE else 255 - v for v in range(256)], np.uint8)
    from lightning_fastdata.pipeline.color import _BASIS as basis  # the constant matrices of the ops, not the code

    _BASIS = basis
    paint = _matrix_colour if colour == "matrix" else _cv2_colour
    blobs = [f.read_bytes() for f in sorted(Path(args.resized).rglob("*.jpg"))] * args.epochs
    crops = [RandomResizedCropFlip(s, sc) for s, sc in zip(SIZES, SCALES, strict=True)]
    outs = [np.empty((s, s, 3), np.uint8) for s in SIZES]

    def one(blob: bytes, rng) -> None:
        image = simplejpeg.decode_jpeg(blob, "RGB", fastdct=True, fastupsample=True)
        for crop, out, (blur_p, solarize_p) in zip(crops, outs, VIEW_COLOUR, strict=True):
            box, size = crop.box(*image.shape[:2]), out.shape[0]
            if kernel == "ours":
                crop_resize_into(image, box, size, crop.flip(), out, scratch)
                if colour:
                    paint(out, blur_p, solarize_p, rng)
                continue
            top, left, h, w = box
            cv2.resize(image[top : top + h, left : left + w], (size, size), dst=out, interpolation=cv2.INTER_AREA)
            if crop.flip():
                cv2.flip(out, 1, dst=out)
            if colour:
                paint(out, blur_p, solarize_p, rng)

    def timed(part: list[bytes], seed: int, ready, results) -> None:
        random.seed(seed)
        rng = random.Random(seed)
        for blob in part[:20]:
            one(blob, rng)
        ready.wait()
        start, cpu = time.perf_counter(), time.process_time()
        for blob in part:
            one(blob, rng)
        results.put((start, time.perf_counter(), time.process_time() - cpu))

    cores = usable_cpu_count()
    fork = multiprocessing.get_context("fork")
    ready, results = fork.Barrier(cores), fork.Queue()
    procs = [fork.Process(target=timed, args=(blobs[k::cores], k, ready, results)) for k in range(cores)]
    for proc in procs:
        proc.start()
    times = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(end for _, end, _ in times) - min(start for start, _, _ in times)
    cpu = sum(c for *_, c in times)
    return {"images_per_sec": len(blobs) / seconds, "cpu_per_1000": cpu / len(blobs) * 1000}


RUNNERS = {
    "torchvision": (
        "torchvision ImageFolder + v2 per view (PIL, decoded once), uint8",
        lambda a: run_torchvision(a, False),
    ),
    "dali-per-view": ("DALI CPU, `image_random_crop` per view (decodes per view), uint8", lambda a: run_dali(a, False)),
    "dali-once": ("DALI CPU, decode once + `random_resized_crop` per view, uint8", lambda a: run_dali(a, True)),
    "views-uint8": (
        "**ours, `views=DINO`, threads, uint8 (what a GPU trainer receives)**",
        lambda a: run_views(a, "uint8", "threads"),
    ),
    "views-uint8-processes": (
        'ours, `views=DINO`, `engine="processes"`, uint8',
        lambda a: run_views(a, "uint8", "processes"),
    ),
    "views-float": (
        "**ours, `views=DINO`, threads, normalized float32 (CPU training)**",
        lambda a: run_views(a, "float", "threads"),
    ),
    "views-float-processes": (
        'ours, `views=DINO`, `engine="processes"`, float32',
        lambda a: run_views(a, "float", "processes"),
    ),
    "limit": (
        "limit: simplejpeg (fast DCT) once + 8 `cv2.resize(INTER_AREA)`, one process per core",
        lambda a: run_limit(a, False),
    ),
    "limit-ours": (
        "limit with our crop kernel: simplejpeg (fast DCT) once + 8 `crop_resize_into`",
        lambda a: run_limit(a, False, "ours"),
    ),
    "torchvision-colour": ("torchvision v2 per view + DINO colour (PIL), uint8", lambda a: run_torchvision(a, True)),
    "dali-colour": ("DALI CPU, decode once + crop + DINO colour per view, uint8", lambda a: run_dali(a, True, True)),
    "limit-colour": (
        "limit + DINO colour per view, OpenCV with torchvision's formulas (HSV hue)",
        lambda a: run_limit(a, True),
    ),
    "limit-colour-matrix": (
        "limit + DINO colour per view, OpenCV with our ops (one matrix, YIQ hue)",
        lambda a: run_limit(a, "matrix"),
    ),
    "views-float-colour": (
        "**ours, `views=DINO` + DINO colour, threads, float32 (CPU training: coloured in the loader)**",
        lambda a: run_views(a, "float", "threads", colour=True),
    ),
    "views-float-colour-processes": (
        'ours, `views=DINO` + DINO colour, `engine="processes"`, float32',
        lambda a: run_views(a, "float", "processes", colour=True),
    ),
    "views-uint8-colour": (
        "ours, `views=DINO` + DINO colour, threads, uint8 + parameters (coloured on the GPU, not here)",
        lambda a: run_views(a, "uint8", "threads", colour=True),
    ),
    "single-float": ("ours, single view 224, threads, float32, no colour", lambda a: run_single(a, "float", False)),
    "single-float-colour": (
        "ours, single view 224, float32, colour stage on the CPU",
        lambda a: run_single(a, "float", True),
    ),
    "single-uint8": ("ours, single view 224, threads, uint8, no colour", lambda a: run_single(a, "uint8", False)),
    "single-uint8-colour": (
        "ours, single view 224, uint8 + colour parameters (coloured on the GPU, not here)",
        lambda a: run_single(a, "uint8", True),
    ),
    "single-uint8-processes": (
        'ours, single view 224, `engine="processes"`, uint8, no colour',
        lambda a: run_single(a, "uint8", False, "processes"),
    ),
}
LABELS = {name: label for name, (label, _) in RUNNERS.items()}
CROPS = ["torchvision", "dali-per-view", "dali-once", "views-uint8", "views-uint8-processes", "views-float",
         "views-float-processes", "limit", "limit-ours"]  # fmt: skip
COLOUR = ["torchvision-colour", "dali-colour", "limit-colour", "limit-colour-matrix", "views-float-colour",
          "views-float-colour-processes", "views-uint8-colour"]  # fmt: skip
SINGLES = ["single-float", "single-float-colour", "single-uint8", "single-uint8-colour", "single-uint8-processes"]


# ---------------------------------------------------------------------------------------------------------------
# The driver: data, interleaved rounds, tables
# ---------------------------------------------------------------------------------------------------------------


def _has_dali(python: str) -> bool:
    code = "import nvidia.dali"
    return subprocess.run([python, "-c", code], capture_output=True, check=False).returncode == 0


def _peers_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter DALI runs in, and a note saying which (or why none)."""
    if importlib.util.find_spec("nvidia.dali") is not None:
        return sys.executable, ""
    root = Path(__file__).resolve().parent.parent
    candidates = [given] if given else [str(root / ".venv-peers/bin/python")]
    for python in candidates:
        if python and Path(python).exists() and _has_dali(python):
            return python, f"DALI runs from {python}"
    return None, "NVIDIA DALI is not installed (bash benchmarks/install_peers.sh, or --peers-python): no DALI rows."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".bench", help="where the generated images and stores go")
    parser.add_argument("--images", type=int, default=800, help="photo-like JPEGs to generate (300-640 px)")
    parser.add_argument("--noise", type=float, default=8.0, help="grain of the generated JPEGs (photo-like entropy)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="workers or threads, for every loader")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed after the warm-up epoch, per loader")
    parser.add_argument("--only", nargs="*", help="run these loaders only (names: " + ", ".join(RUNNERS) + ")")
    parser.add_argument("--peers-python", help="the interpreter with NVIDIA DALI (default: .venv-peers)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--baseline",
        help="a checkout of this package at another commit (`git worktree add /tmp/base REV`): each row of ours runs"
        " beside that checkout's in every round",
    )
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--resized", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: one loader, one round; prints its JSON line
        import torch

        # the consuming process only takes batches; its cores belong to the loader
        torch.set_num_threads(1)
        print(json.dumps(RUNNERS[args.run][1](args)))
        return

    from lightning_fastdata import convert, make_image_folder, usable_cpu_count

    unknown = sorted(set(args.only or ()) - set(RUNNERS))
    if unknown:
        parser.error(f"--only: unknown loaders {unknown}; the names: {', '.join(RUNNERS)}")
    workdir = Path(args.workdir)
    folder = workdir / f"images-{args.images}-noise{args.noise:g}"
    if not folder.is_dir():
        make_image_folder(
            folder, num_classes=10, train_per_class=args.images // 10, val_per_class=0, noise=args.noise, seed=0
        )
    resized = folder.with_name(folder.name + "-256")
    if not resized.is_dir():
        _resize_folder(folder, resized, 256, 90, workers=args.workers)
    db = folder.with_name(folder.name + ".views.lmdb")
    if not db.exists():
        convert(folder, db, short_side=256, quality=90, num_workers=args.workers, progress=False)
    names = [n for n in RUNNERS if not args.only or n in args.only]
    notes: list[str] = []
    pythons = dict.fromkeys(names, sys.executable)
    if any(n.startswith("dali") for n in names):
        peers, note = _peers_python(args.peers_python)
        if note:
            notes.append(note)
        for name in [n for n in names if n.startswith("dali")]:
            if peers is None:
                names.remove(name)
            else:
                pythons[name] = peers

    envs: dict[str, Any] = {name: os.environ for name in names}
    if args.baseline:  # each row of ours beside the same row of another checkout, in every round
        from bench_loader import BASELINE, _baseline_env

        env = _baseline_env(Path(args.baseline))
        for name in [n for n in names if n.startswith(("views", "single"))]:
            names.insert(names.index(name) + 1, f"{name}{BASELINE}")
            pythons[f"{name}{BASELINE}"], envs[f"{name}{BASELINE}"] = pythons[name], env
            LABELS[f"{name}{BASELINE}"] = f"{LABELS[name].strip('*')}, baseline {args.baseline}"
            for rows in (CROPS, COLOUR, SINGLES):
                if name in rows:
                    rows.append(f"{name}{BASELINE}")

    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    child = [__file__, "--db", str(db), "--resized", str(resized), "--batch-size", str(args.batch_size)]
    child += ["--workers", str(args.workers), "--epochs", str(args.epochs)]
    for r in range(args.rounds):
        for name in names:
            run = [pythons[name], *child, "--run", name.split("@")[0]]
            out = subprocess.run(run, capture_output=True, text=True, check=False, env=envs[name])
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {name:22s} {results[name][-1]['images_per_sec']:7.0f} img/s", flush=True)

    med = {n: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for n, ms in results.items()}
    cores = usable_cpu_count()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).resolve().parent).stdout.strip()  # fmt: skip
    print()
    import torch

    gpu = "no GPU used"
    if torch.cuda.is_available():  # without a Trainer, ours trains on CUDA where there is one
        gpu = f"GPU {torch.cuda.get_device_name()} (ours' batches go to it, uint8 ones coloured and normalized there)"
    print(f"machine: {platform.machine()}, {cores} usable CPUs ({os.cpu_count()} online), {gpu};"
          f" Python {platform.python_version()}; commit {commit or '?'}")  # fmt: skip
    print(
        f"{args.images} photo-like JPEGs (300-640 px, noise {args.noise:g}) stored at short side 256, q90; batch"
        f" {args.batch_size}, {args.workers} workers or threads each; DINO's 8 views (2 x 224 at (0.4, 1), 6 x 96 at"
        f" (0.05, 0.4), flip 0.5); {args.epochs} epochs timed after a warm-up one, median of {args.rounds}"
        " interleaved rounds, each loader in its own process. An image is all 8 of its views."
    )

    def table(title: str, rows: list[str], base: str | None) -> None:
        rows = [n for n in rows if n in med]
        if not rows:
            return
        print()
        print(f"{title}:")
        print()
        print(f"| loader | images/s | vs {base or '-'} | CPU-s per 1,000 images |")
        print("|---|---:|---:|---:|")
        for name in sorted(rows, key=lambda n: med[n]["images_per_sec"]):
            m = med[name]
            ratio = f"{m['images_per_sec'] / med[base]['images_per_sec']:.2f}x" if base in med else "-"
            print(f"| {LABELS[name]} | {m['images_per_sec']:.0f} | {ratio} | {m['cpu_per_1000']:.2f} |")

    table("Crops only (DINO's 8 views)", CROPS, "torchvision")
    table("With DINO's colour augmentation per view", COLOUR, "torchvision-colour")
    table("Ours' colour stage, single view (RandomResizedCrop(224) + flip)", SINGLES, "single-float")
    print()

    def ratio(a: str, b: str) -> str:
        """Median of the per-round ratios, and the ratio of the medians in the tables."""
        if a not in med or b not in med:
            return "n/a"
        rounds = zip(results[a], results[b], strict=True)
        paired = statistics.median(x["images_per_sec"] / y["images_per_sec"] for x, y in rounds)
        of_medians = med[a]["images_per_sec"] / med[b]["images_per_sec"]
        return f"{paired:.2f}x per round (ratio of the medians: {of_medians:.2f}x)"

    dali = max((n for n in ("dali-per-view", "dali-once") if n in med), key=lambda n: med[n]["images_per_sec"],
               default="dali-once")  # fmt: skip
    print("Crops only (target: >= 0.85x the limit, ~3x torchvision, ~4x DALI CPU):")
    for ours in ("views-uint8", "views-uint8-processes", "views-float"):
        print(f"- {ours} / limit = {ratio(ours, 'limit')}")
        print(f"- {ours} / limit with our kernel = {ratio(ours, 'limit-ours')}")
        print(f"- {ours} / torchvision = {ratio(ours, 'torchvision')}")
        print(f"- {ours} / DALI ({dali}, the faster) = {ratio(ours, dali)}")
    print(f"- DALI decode once / DALI decode per view = {ratio('dali-once', 'dali-per-view')}")
    print("With colour (target: >= 3x torchvision, >= 3x DALI CPU, >= 0.75x the limit with the same ops):")
    for ours in ("views-float-colour", "views-float-colour-processes"):
        for peer in ("torchvision-colour", "dali-colour", "limit-colour-matrix", "limit-colour"):
            print(f"- {ours} / {peer} = {ratio(ours, peer)}")
    print(f"- limit-colour-matrix / limit-colour = {ratio('limit-colour-matrix', 'limit-colour')}")
    print(f"- colour cost on our single-view CPU path: single-float-colour / single-float = "
          f"{ratio('single-float-colour', 'single-float')}")  # fmt: skip
    if "single-float-colour" in med and "single-float" in med:
        extra = med["single-float-colour"]["cpu_per_1000"] - med["single-float"]["cpu_per_1000"]
        print(f"  (+{extra * 1000:.0f} CPU-us per image for the colour ops in the loader)")
    print(f"- loader-side cost of drawing the parameters: single-uint8-colour / single-uint8 = "
          f"{ratio('single-uint8-colour', 'single-uint8')}")  # fmt: skip
    for name in [n for n in names if "@" in n]:
        print(f"- {name.split('@')[0]}: this checkout / baseline = {ratio(name.split('@')[0], name)}")
    print()
    # what limits each loader on a many-core node: the training process is one interpreter; what it does per image
    # serializes, whatever the cores (threads engine: it does all the work, under the GIL for its Python part)
    print("Proxies for a many-core node (CPU-us per image; a ceiling is what one training process allows, not a"
          " measurement):")  # fmt: skip
    print()
    print("| loader | whole loader | training process | its main thread | in workers | one core's rate x cores |"
          " ceiling, images/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in [n for n in names if n in med and "own_cpu_per_1000" in med[n]]:
        m = med[name]
        keys = ("cpu_per_1000", "own_cpu_per_1000", "main_thread_cpu_per_1000")
        total, own, main_thread = (m[k] * 1000 for k in keys)
        threads = not name.endswith("processes") and not name.startswith(("torchvision", "dali"))
        if name.startswith("dali"):  # native GIL-free threads in the training process: not a serial part
            ceiling = "- (native threads)"
        elif min(own, main_thread) <= 0:  # below the CPU clock's resolution (a tiny run)
            ceiling = "-"
        elif threads:
            ceiling = f"{1e6 / main_thread:.0f} (1e6 / main thread; GIL-held time not measured)"
        else:
            ceiling = f"{1e6 / own:.0f} (1e6 / training process)"
        print(f"| {LABELS[name]} | {total:.0f} | {own:.1f} | {main_thread:.1f} | {max(total - own, 0):.0f} |"
              f" {1e6 / total * cores:.0f} | {ceiling} |")  # fmt: skip
    if "views-uint8-processes" in med:
        own = {n: med[n]["own_cpu_per_1000"] * 1000 for n in ("views-uint8-processes", "single-uint8-processes")
               if n in med}  # fmt: skip
        line = f"{own['views-uint8-processes']:.1f} us"
        if "single-uint8-processes" in own:
            line += f", {own['single-uint8-processes']:.1f} us for a single view in the same run"
        if "views-uint8-processes@baseline" in med:
            line += f"; baseline {med['views-uint8-processes@baseline']['own_cpu_per_1000'] * 1000:.1f} us"
        print(f"Training process on the processes engine, all 8 views of an image (target: at most 5 us): {line}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "rounds": results, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
