"""Convert an image folder (or any indexed dataset) once, in parallel, into a compact LMDB image database.

The writer mirrors :class:`~lightning_fastdata.dataset.LmdbImageDataset`; both share :mod:`lightning_fastdata._format`.
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import errno
import hashlib
import io
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import lmdb
import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError
from tqdm.auto import tqdm

from lightning_fastdata import _format
from lightning_fastdata.__about__ import __version__
from lightning_fastdata._cv import cv2
from lightning_fastdata._format import fcntl  # advisory lock so two converters never build one target at once
from lightning_fastdata.cpus import usable_cpu_count
from lightning_fastdata.errors import (
    ConversionError,
    DatasetFormatError,
    DestinationError,
    ReadOnlyDestinationError,
    SampleError,
    SourceLayoutError,
)

log = logging.getLogger(__name__)

#: what ``mkdir``/``open`` raise in a folder this process may not write to
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)

#: File extensions read as images (matched case-insensitively), as torchvision's ``ImageFolder``.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: Folder names (matched case-insensitively) read as splits, and the split name each is stored under.
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validation": "val",
    "dev": "val",
    "test": "test",
    "testing": "test",
}

#: Files accepted as a list source: ``path,label`` rows (CSV with a header) or a JSON list of objects.
LIST_EXTENSIONS = (".csv", ".json")

_LAYOUT_HELP = """Expected an ImageFolder tree:
    SRC/<class_a>/<image>.jpg
    SRC/<class_b>/<image>.png
or a root holding one such tree per split (train/training, val/valid/validation/dev, test/testing, any case):
    SRC/train/<class>/<image>.jpg
    SRC/val/<class>/<image>.jpg
or a list file SRC.csv (header `path,label`, optional `split`) or SRC.json ([{"path": ..., "label": ...}, ...])."""

_INITIAL_MAP_SIZE = 1 << 28  # 256 MiB; doubled whenever the database fills it
_TXN_RECORDS = 512
_TXN_BYTES = 64 << 20


@dataclass(frozen=True)
class SkippedFile:
    """A source image that was not written, and why."""

    path: str
    reason: str


@dataclass
class ConversionSummary:
    """What a conversion did; ``format()`` renders it for people, ``to_dict()`` for JSON."""

    destination: str
    written: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)
    splits: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    workers: int = 0
    up_to_date: bool = False

    @property
    def images_per_sec(self) -> float:
        """Images read per second of wall time (written and skipped)."""
        return (self.written + len(self.skipped)) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary, as written to the report beside the database."""
        out = asdict(self)
        out["images_per_sec"] = self.images_per_sec
        return out

    def format(self, max_skipped: int = 20) -> str:
        """A human-readable summary, listing at most ``max_skipped`` skipped files."""
        if self.up_to_date:
            return f"{self.destination} is up to date ({self.written} images); nothing to do."
        splits = ", ".join(f"{name}={count}" for name, count in self.splits.items())
        lines = [
            f"wrote {self.written} images ({splits}) to {self.destination}",
            f"  skipped   {len(self.skipped)}",
            f"  bytes in  {_human_bytes(self.bytes_in)}",
            f"  bytes out {_human_bytes(self.bytes_out)}"
            + (f" ({self.bytes_out / self.bytes_in:.0%} of the source)" if self.bytes_in else ""),
            f"  time      {self.seconds:.1f} s, {self.images_per_sec:.0f} images/s ({self.workers} worker processes)",
        ]
        if self.ignored:
            lines.insert(2, f"  ignored   {len(self.ignored)} (not images: other files, empty class folders)")
        for kind, items in (("skipped", self.skipped), ("ignored", self.ignored)):
            for item in items[:max_skipped]:
                lines.append(f"  {kind} {item.path}: {item.reason}")
            if len(items) > max_skipped:
                lines.append(f"  ... and {len(items) - max_skipped} more, listed in {_format.REPORT_FILE}")
        return "\n".join(lines)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------------------
# Encoding one image (runs in the worker processes)
# ---------------------------------------------------------------------------------------------------------------


class _Skip(Exception):
    """An input that cannot become a record; the message is the reason shown to the user."""


Encoding = Literal["jpeg", "raw"]


@dataclass(frozen=True)
class _Options:
    short_side: int | None
    quality: int
    keep_original: bool
    encoding: Encoding = "jpeg"


def _target_size(width: int, height: int, short_side: int | None) -> tuple[int, int] | None:
    """The (width, height) that makes the short side ``short_side``, or ``None`` when no downscale is needed."""
    short = min(width, height)
    if not short_side or short <= short_side:
        return None
    if width <= height:
        return short_side, max(1, round(height * short_side / width))
    return max(1, round(width * short_side / height)), short_side


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: 16-bit and float grayscale are rescaled, palette transparency handled."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I") or mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        high = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        if mode == "F" and arr.max(initial=0) <= 1.0:
            high = 1.0
        gray = np.clip(arr * (255.0 / high), 0, 255).round().astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if mode == "P" and "transparency" in img.info:
        return img.convert("RGBA").convert("RGB")
    return img.convert("RGB")


def _encode_image(source: Any, opts: _Options) -> tuple[int, int, int, bytes]:
    """Turn encoded bytes or a PIL image into ``(encoding, height, width, payload)``; raise ``_Skip`` if unusable."""
    raw: bytes | None = None
    if isinstance(source, Image.Image):
        img = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        raw = bytes(source)
        if not raw:
            raise _Skip("empty file (0 bytes)")
        try:
            img = Image.open(io.BytesIO(raw))
        except UnidentifiedImageError:
            raise _Skip("not an image: the content is in no format Pillow can read") from None
        except (OSError, SyntaxError, ValueError) as err:
            raise _Skip(f"unreadable image header: {err}") from None
    else:
        raise _Skip(f"expected a PIL image or encoded image bytes, got {type(source).__name__}")
    try:
        width, height = img.size
        target = _target_size(width, height, opts.short_side)
        if (
            opts.encoding == "jpeg"
            and raw is not None
            and img.format == "JPEG"
            and img.mode in ("RGB", "L")
            and (target is None or opts.keep_original)
        ):
            # Store the source bytes untouched (no generation loss), after checking the whole stream decodes;
            # draft mode makes that check an 1/8-scale decode.
            img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            img.load()
            return _format.ENCODING_JPEG, height, width, raw
        jpeg_in_jpeg_out = raw is not None and img.format == "JPEG" and opts.encoding == "jpeg"
        if target is not None and jpeg_in_jpeg_out and img.mode in ("RGB", "L"):
            return _downscale_jpeg(raw, target, opts.quality)  # type: ignore[arg-type]
        if target is not None and img.format == "JPEG":
            img.draft("RGB", target)  # DCT-domain downscale to the smallest scale still >= target
        img.load()
        img = _to_rgb(img)
        if target is not None:
            img = img.resize(target, Image.Resampling.BICUBIC, reducing_gap=3.0)
        if opts.encoding == "raw":
            return _format.ENCODING_RAW, img.height, img.width, img.tobytes()
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=opts.quality)
        return _format.ENCODING_JPEG, img.height, img.width, out.getvalue()
    except _Skip:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise _Skip(f"corrupt or truncated image: {err}") from None


def _downscale_jpeg(raw: bytes, target: tuple[int, int], quality: int) -> tuple[int, int, int, bytes]:
    """The common case, fast: an RGB or grayscale JPEG to ``target`` (width, height), re-encoded as JPEG.

    libjpeg-turbo decodes (at half scale in the DCT when the source is at least twice the target: exact and SIMD);
    a Gaussian prefilter then a bilinear resize shrink it, antialiased; libjpeg-turbo encodes with 4:2:0 chroma, as
    Pillow does. The prefilter's sigma, ``0.5 * sqrt(ratio**2 - 1)``, blurs about as much as an antialiased bilinear
    (triangle) filter of the same ratio, Pillow's and torchvision's: files come out the size Pillow's give (16.3 vs
    16.0 KiB per photo here), where scikit-image's weaker ``(ratio - 1) / 2`` kept grain that made them 20% larger,
    and slower to decode in every epoch. Measured on one core here, per 300-640 px photo: 2.2 ms, against 4.8 ms
    with Pillow's decode, bicubic resize and encode (3.1 ms with OpenCV's ``INTER_AREA``).
    """
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(raw)
        half = min(height, width) >= 2 * min(target)
        image = simplejpeg.decode_jpeg(raw, "RGB", min_factor=2 if half else 1, strict=True)
        ratio = min(image.shape[:2]) / min(target)
        sigma = 0.5 * math.sqrt(max(0.0, ratio * ratio - 1.0))
        if sigma > 0.05:
            image = cv2.GaussianBlur(image, (0, 0), sigmaX=sigma)
        resized = cv2.resize(image, target, interpolation=cv2.INTER_LINEAR)
        payload = simplejpeg.encode_jpeg(resized, quality=quality, colorspace="RGB", colorsubsampling="420")
    except (ValueError, cv2.error) as err:
        raise _Skip(f"corrupt or truncated image: {err}") from None
    return _format.ENCODING_JPEG, target[1], target[0], payload


# Per-worker state, installed by the pool initializer (inherited under fork, pickled once under spawn).
_STATE: dict[str, Any] = {}


def _init_worker(datasets: Mapping[str, Any] | None, opts: _Options) -> None:
    # Ctrl-C reaches the whole process group: the main process handles it (and stops the pool); a worker would only
    # print its own KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STATE["datasets"] = datasets
    _STATE["opts"] = opts
    with contextlib.suppress(Exception):  # one thread per worker: the pool already uses every core
        import torch

        torch.set_num_threads(1)


def _load_task(task: tuple[str, str | int, int]) -> tuple[Any, int, int]:
    """Read the task's input: ``(source, label, bytes_in)``."""
    split, item, label = task
    if isinstance(item, str):
        try:
            with open(item, "rb") as fh:
                raw = fh.read()
        except OSError as err:
            raise _Skip(f"cannot read file: {err.strerror or err}") from None
        return raw, label, len(raw)
    try:
        source, label = _STATE["datasets"][split][item]
    except Exception as err:  # a user's dataset may raise anything; the sample is skipped and reported
        raise _Skip(f"dataset raised {type(err).__name__}: {err}") from None
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or int(label) < 0:
        raise _Skip(f"label must be a non-negative int, got {label!r}")
    size = len(source) if isinstance(source, (bytes, bytearray, memoryview)) else 0
    return source, int(label), size


def _work(task: tuple[str, str | int, int]) -> tuple[int, int, int, int, int, bytes | None, str | None]:
    """Pool entry point: ``(label, bytes_in, encoding, height, width, payload, None)`` or a skip reason."""
    label, size = task[2], 0
    try:
        source, label, size = _load_task(task)
        encoding, height, width, payload = _encode_image(source, _STATE["opts"])
    except _Skip as skip:
        return label, size, 0, 0, 0, None, str(skip)
    return label, size, encoding, height, width, payload, None


# ---------------------------------------------------------------------------------------------------------------
# Scanning a source
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Everything to convert: ``tasks[split]`` lists ``(split, path-or-index, label)``.

    ``names[split]`` holds, in the same order, what identifies each input to the user (a path relative to the source,
    a path as listed, or a dataset index): it is stored beside the records so predictions map back to their files.
    """

    classes: list[str] | None
    tasks: dict[str, list[tuple[str, str | int, int]]]
    fingerprint: str | None
    source: str
    names: dict[str, list[str]] = field(default_factory=dict)
    #: the size of the source files (0 for datasets): estimates the space a conversion needs
    source_bytes: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)


def canonical_split(name: str) -> str | None:
    """The split a folder or list entry named ``name`` is stored as (``"train"``, ``"val"``, ``"test"``), else None."""
    return SPLIT_ALIASES.get(name.strip().lower())


_KNOWN_SPLITS = "train/training, val/valid/validation/dev, test/testing (any case)"


def _warn_split_typos(names: Mapping[str, str], where: str) -> None:
    """Warn about each split name that is not a known one but close to one (``trian``): most likely a typo.

    ``names`` maps each name to what carries it (``"the split folder"``, ``"3 row(s) with split"``); names far from
    every known one are custom splits, kept silently as documented.
    """
    for name, carrier in names.items():
        if canonical_split(name) is not None:
            continue
        close = difflib.get_close_matches(name.strip().lower(), list(SPLIT_ALIASES), n=1, cutoff=0.7)
        if close:
            warnings.warn(
                f"{where}: {carrier} {name!r}, which is not a known split name; it is stored as a split named"
                f" {name!r}. Did you mean {close[0]!r}? Known names: {_KNOWN_SPLITS}.",
                UserWarning,
                stacklevel=4,
            )


def _class_dirs(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _walk_files(folder: Path) -> Iterator[str]:
    """Every file under ``folder`` (following links), sorted, skipping hidden files and folders."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield os.path.join(dirpath, name)


def _is_image_name(path: str) -> bool:
    return path.lower().endswith(IMG_EXTENSIONS)


def _has_image(folder: Path) -> bool:
    return any(_is_image_name(path) for path in _walk_files(folder))


def _split_folders(src: Path) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """The split roots of ``src`` and the class folders of each; raises ``SourceLayoutError`` on a bad layout.

    ``src`` is a root of splits when one of its folders has a split name (:data:`SPLIT_ALIASES`, any case) and holds
    class folders; otherwise it is one ImageFolder tree, stored as split ``train``, and a top-level folder with a split
    name is read as a class, with a warning.
    """
    if not src.exists():
        raise SourceLayoutError(f"`src` {str(src)!r} does not exist.\n{_LAYOUT_HELP}")
    if not src.is_dir():
        raise SourceLayoutError(f"`src` {str(src)!r} is a file, not a folder.\n{_LAYOUT_HELP}")
    top = _class_dirs(src)
    if not top:
        raise SourceLayoutError(f"`src` {str(src)!r} has no sub-folders (one per class are needed).\n{_LAYOUT_HELP}")
    split_like = [name for name in top if canonical_split(name)]
    split_mode = any(_class_dirs(src / name) for name in split_like)
    if not split_mode:
        for name in split_like:
            warnings.warn(
                f"`src` {str(src)!r}: the folder {name!r} has a split name but holds no class folders, so it is read"
                f" as a class of images. If it is a split, put its images in {name}/<class>/; otherwise rename it.",
                UserWarning,
                stacklevel=3,
            )
        split_roots = {"train": src}
    else:
        split_roots = {}
        _warn_split_typos(dict.fromkeys(top, "the split folder"), f"`src` {str(src)!r}")
        for name in top:
            split = canonical_split(name) or name
            if split in split_roots:
                raise SourceLayoutError(
                    f"`src` {str(src)!r} holds two folders for split {split!r}: {split_roots[split].name!r} and"
                    f" {name!r}. Merge them, or move one out of `src`."
                )
            split_roots[split] = src / name
    per_split = {}
    for split, root in split_roots.items():
        classes = _class_dirs(root)
        if not classes:
            raise SourceLayoutError(
                f"split folder {str(root)!r} has no class sub-folders, but {str(src)!r} looks like a root of"
                f" splits because it holds {', '.join(repr(n + '/') for n in split_like)}.\n{_LAYOUT_HELP}"
            )
        per_split[split] = classes
    return split_roots, per_split


def _nonempty_classes(split_roots: dict[str, Path], per_split: dict[str, list[str]]) -> list[str]:
    """The class names (sorted, across splits) whose folder holds an image file in at least one split."""
    names = sorted(set().union(*per_split.values()))
    classes = [n for n in names if any(n in per_split[s] and _has_image(root / n) for s, root in split_roots.items())]
    if len(classes) == 1:
        _refuse_nested_classes(split_roots, classes[0])
    return classes


def _refuse_nested_classes(split_roots: dict[str, Path], name: str) -> None:
    """Refuse a single class folder whose images all lie in two or more sub-folders: the classes one level deeper.

    ``root/dataset/<class>/<image>`` would otherwise convert to one class, ``dataset``, and train a 1-class model.
    """
    nested: dict[Path, list[str]] = {}
    for root in split_roots.values():
        folder = root / name
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            if any(e.is_file() and _is_image_name(e.name) and not e.name.startswith(".") for e in entries):
                return
        subfolders = [d for d in _class_dirs(folder) if _has_image(folder / d)]
        if len(subfolders) < 2:
            return
        nested[folder] = subfolders
    if not nested:
        return
    folder, subfolders = next(iter(nested.items()))
    shown = ", ".join(repr(d) for d in subfolders[:5])
    shown += f" and {len(subfolders) - 5} more" if len(subfolders) > 5 else ""
    if folder.parent in split_roots.values() and len(split_roots) == 1:
        fix = f"Pass {str(folder)!r} as `src` (`data_dir`) instead."
    else:
        fix = f"Move the class folders of {str(folder)!r} up one level, into {str(folder.parent)!r}."
    raise SourceLayoutError(
        f"{str(folder.parent)!r} holds a single class folder, {name!r}, and all its images are in its sub-folders"
        f" {shown}: the classes seem to be nested one level deeper, and converting would make a 1-class dataset."
        f" {fix} (To convert one class whose images lie in sub-folders, list them in a CSV file: path,label.)"
    )


def train_folder(src: str | os.PathLike[str]) -> Path:
    """The ImageFolder tree of ``src``'s training split (``src`` itself when it has no split folders).

    Raises:
        SourceLayoutError: ``src`` is missing or not an image folder, or has split folders but no training split.

    """
    path = Path(src).expanduser()
    split_roots, _ = _split_folders(path)
    if "train" not in split_roots:
        raise SourceLayoutError(f"`src` {str(path)!r} has split folders but no training split (train/, training/).")
    return split_roots["train"]


def image_folder(root: str | os.PathLike[str], transform: Any = None) -> Any:
    """An ``ImageFolder`` (torchvision's) over ``root``, with the tolerance of :func:`convert`.

    Hidden and empty class folders are left out (torchvision refuses a class folder without images), and images are
    opened with :func:`open_image_file`, whose errors name the file.

    Raises:
        SourceLayoutError: no class folder of ``root`` holds an image file.

    """
    from torchvision import datasets

    path = Path(root)
    classes = _nonempty_classes({"train": path}, {"train": _class_dirs(path)})
    if not classes:
        raise SourceLayoutError(
            f"found no image files under {str(path)!r} (looked for {' '.join(IMG_EXTENSIONS)}, any case, in the class"
            f" folders).\n{_LAYOUT_HELP}"
        )

    class _Folder(datasets.ImageFolder):
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            return classes, {name: i for i, name in enumerate(classes)}

    return _Folder(str(path), transform=transform, loader=open_image_file)


def open_image_file(path: str, data: bytes | None = None) -> Image.Image:
    """Open an image file (or its bytes, already read) as RGB, as ``ImageFolder`` does, with errors naming the file.

    Raises:
        SampleError: the file cannot be read or decoded.

    """
    try:
        if data is None:
            with open(path, "rb") as fh:
                data = fh.read()
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise SampleError(
            f"{path!r} cannot be read as an image ({type(err).__name__}: {err}). Fix or remove it, or convert the"
            " folder with `lightning-fastdata convert` (it skips and lists bad files) and use the database."
        ) from None


def folder_classes(src: str | os.PathLike[str]) -> list[str]:
    """The class names a conversion of ``src`` will have (sorted, across splits; empty class folders left out)."""
    path = Path(src).expanduser()
    if path.is_file() and path.suffix.lower() in LIST_EXTENSIONS:
        return list(_scan_list(path.absolute()).classes or [])
    return _nonempty_classes(*_split_folders(path))


class _Scan:
    """Collects tasks, the source fingerprint, and the inputs skipped before conversion (unreadable paths)."""

    def __init__(self) -> None:
        self.tasks: dict[str, list[tuple[str, str | int, int]]] = {}
        self.names: dict[str, list[str]] = {}
        self.skipped: list[SkippedFile] = []
        self.ignored: list[SkippedFile] = []
        self.digest = hashlib.sha256()
        self.bytes = 0

    def add(self, split: str, path: str, label: int, name: str) -> None:
        self.tasks.setdefault(split, [])
        self.names.setdefault(split, [])
        try:
            st = os.stat(path)
        except OSError as err:
            dangling = os.path.islink(path)
            reason = "dangling symbolic link (its target does not exist)" if dangling else f"cannot read file: {err}"
            self.skipped.append(SkippedFile(path, reason))
            return
        self.tasks[split].append((split, path, label))
        self.names[split].append(name)
        self.bytes += st.st_size
        self.digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())

    def plan(self, src: Path, classes: list[str]) -> _Plan:
        if not any(self.tasks.values()) and not self.skipped:
            exts = " ".join(IMG_EXTENSIONS)
            raise SourceLayoutError(
                f"found no image files under {str(src)!r} (looked for {exts}, any case, in the class folders).\n"
                f"{_LAYOUT_HELP}"
            )
        return _Plan(
            classes=classes,
            tasks=self.tasks,
            fingerprint=self.digest.hexdigest(),
            source=str(src),
            names=self.names,
            skipped=self.skipped,
            ignored=self.ignored,
            source_bytes=self.bytes,
        )


def _scan_folder(src: Path) -> _Plan:
    split_roots, per_split = _split_folders(src)
    classes = _nonempty_classes(split_roots, per_split)
    scan = _Scan()
    for name in sorted(set().union(*per_split.values())):
        if name not in classes:
            folders = [str(root / name) for split, root in split_roots.items() if name in per_split[split]]
            scan.ignored.append(SkippedFile(folders[0], "empty class folder: no image files in it; left out"))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    for split, root in split_roots.items():
        scan.tasks[split], scan.names[split] = [], []
        for name in per_split[split]:
            if name not in class_to_idx:
                continue
            for path in _walk_files(root / name):
                if not _is_image_name(path):
                    reason = f"not an image file name (looked for {' '.join(IMG_EXTENSIONS)})"
                    scan.ignored.append(SkippedFile(path, reason))
                    continue
                scan.add(split, path, class_to_idx[name], Path(os.path.relpath(path, src)).as_posix())
    return scan.plan(src, classes)


def _read_list(src: Path) -> list[dict[str, Any]]:
    """The rows of a CSV (with a header) or JSON (a list of objects) list file, keys lower-cased."""
    try:
        text = src.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise SourceLayoutError(f"`src` {str(src)!r} cannot be read as a UTF-8 list file: {err}") from None
    if src.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise SourceLayoutError(f"`src` {str(src)!r} is not valid JSON: {err}.\n{_LAYOUT_HELP}") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise SourceLayoutError(f"`src` {str(src)!r} must hold a JSON list of objects.\n{_LAYOUT_HELP}")
    else:
        rows = list(csv.DictReader(io.StringIO(text)))
    rows = [{str(k).strip().lower(): v for k, v in row.items() if k is not None} for row in rows]
    if not rows:
        raise SourceLayoutError(f"`src` {str(src)!r} lists no images.\n{_LAYOUT_HELP}")
    missing = {"path", "label"} - set(rows[0])
    if missing:
        raise SourceLayoutError(
            f"`src` {str(src)!r} has no {' or '.join(sorted(missing))} column; its columns are {sorted(rows[0])}."
            f" Name the columns `path` and `label` (and optionally `split`).\n{_LAYOUT_HELP}"
        )
    return rows


def _scan_list(src: Path) -> _Plan:
    """A plan from a list of ``path,label[,split]`` rows; relative paths are relative to the list file's folder."""
    rows = _read_list(src)
    labels = [str(row.get("label", "")).strip() for row in rows]
    if all(label.isdigit() for label in labels):  # numeric labels keep their value as the class index
        classes = [str(i) for i in range(max(int(label) for label in labels) + 1)]
        index = {label: int(label) for label in labels}
    else:
        classes = sorted(set(labels))
        index = {name: i for i, name in enumerate(classes)}
    scan = _Scan()
    scan.digest.update(src.read_bytes())
    split_names = [str(row.get("split") or "train").strip() for row in rows]
    counts = Counter(split_names)
    _warn_split_typos({name: f"{n} row(s) with split" for name, n in counts.items()}, f"`src` {str(src)!r}")
    for line, (row, label, split_name) in enumerate(zip(rows, labels, split_names, strict=True), start=2):
        listed = str(row.get("path") or "").strip()
        split = canonical_split(split_name) or split_name
        if not listed or not label:
            scan.skipped.append(SkippedFile(f"{src} row {line - 1}", "row without a path or a label"))
            continue
        scan.add(split, str(src.parent / Path(listed).expanduser()), index[label], listed)
    return scan.plan(src, classes)


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


class _LmdbWriter:
    """Batches puts into transactions and grows ``map_size`` (doubling) whenever the database is full."""

    def __init__(self, path: Path, map_size: int) -> None:
        self.map_size = map_size
        self.env = lmdb.open(str(path), map_size=map_size, subdir=True, readahead=False, meminit=False, sync=False)
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def put(self, key: bytes, value: bytes) -> None:
        self._pending.append((key, value))
        self._pending_bytes += len(value)
        if len(self._pending) >= _TXN_RECORDS or self._pending_bytes >= _TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value)
            except lmdb.MapFullError:
                self.map_size *= 2
                log.debug("LMDB map full; growing map_size to %d bytes", self.map_size)
                self.env.set_mapsize(self.map_size)
                continue
            self._pending.clear()
            self._pending_bytes = 0

    def close(self) -> None:
        self.flush()
        self.env.sync(True)
        self.env.close()


def _existing_meta(dst: Path) -> dict[str, Any] | None:
    """The metadata of a complete database at ``dst``, ``None`` if there is none; refuse to clobber other data."""
    if not dst.exists():
        return None
    if dst.is_dir() and not any(dst.iterdir()):
        return None
    try:
        return _format.read_meta(dst)
    except DatasetFormatError as err:
        if (dst / _format.DATA_FILE).is_file() and _has_meta_record(dst):
            return None  # our own incomplete or outdated database: safe to replace
        raise DestinationError(
            f"`dst` {str(dst)!r} exists and is not a lightning_fastdata database; refusing to replace it."
            " Pass a new or empty path."
        ) from err


def _has_meta_record(dst: Path) -> bool:
    """Whether the LMDB at ``dst`` holds a ``__meta__`` record, i.e. was written by lightning_fastdata."""
    try:
        with _format.open_readonly(dst).begin() as txn:
            return txn.get(_format.META_KEY) is not None
    except (DatasetFormatError, lmdb.Error):
        return False


@contextlib.contextmanager
def _target_lock(dst: Path, wait: bool = True) -> Iterator[OSError | None]:
    """Hold the conversion lock of ``dst`` while the block runs; yields the error when its folder cannot be written.

    The lock file holds this converter's pid and host (readers name it: "is being converted by process N") and is
    removed at the end while still held: a waiter that then gets the lock sees that its file is gone and locks the new
    one, so no zero-byte lock file stays beside each database.

    Raises:
        BlockingIOError: ``wait`` is false and another process holds the lock.

    """
    if fcntl is None:  # pragma: no cover - Windows
        yield None
        return
    path = _format.lock_path(dst)
    while True:
        try:
            fh = open(path, "a+b")  # noqa: SIM115 - held for the whole block, closed in `finally`
        except OSError as err:
            if err.errno not in _READ_ONLY:
                raise
            yield err  # a read-only folder: no conversion can happen here, but a complete database can be used
            return
        try:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise
                holder = _format.converter_of(dst) or {}
                log.warning(
                    "waiting for another conversion to %s to finish (%s holds %s); this one then reuses or replaces"
                    " its result",
                    dst,
                    _format.describe_converter(holder),
                    path,
                )
                fcntl.flock(fh, fcntl.LOCK_EX)
            if _same_file(fh.fileno(), path):
                break
        except BaseException:
            fh.close()
            raise
        fh.close()  # the converter we waited for removed this lock file: lock the current one
    try:
        fh.truncate(0)
        fh.write(_format.converter_record())
        fh.flush()
        yield None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _make_parent(dst: Path) -> None:
    """Create the folder ``dst`` goes into; a file in the way or a read-only folder is a ``DestinationError``."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [dst.parent, *dst.parent.parents] if p.exists() and not p.is_dir()), dst.parent)
        raise DestinationError(
            f"`dst` {str(dst)!r} cannot be created: {str(blocker)!r} is a file, not a folder. Choose a `dst` whose"
            " parent folders are folders, or move that file away."
        ) from None
    except OSError as err:
        if err.errno in _READ_ONLY:
            raise _read_only_error(dst, err) from err
        raise


def _read_only_error(dst: Path, err: OSError | None = None, outdated: bool = False) -> ReadOnlyDestinationError:
    """The error for a conversion into a folder this process cannot write to."""
    reason = f" ({err.strerror})" if err is not None and err.strerror else ""
    what = (
        "holds a database that is out of date (its source or the conversion settings changed), and"
        if outdated
        else "cannot be written:"
    )
    return ReadOnlyDestinationError(
        f"`dst` {str(dst)!r} {what} its folder {str(dst.parent)!r} is read-only{reason}. Convert into a writable"
        " folder, or convert there first and make it read-only afterwards."
    )


def _recover_interrupted_publish(dst: Path) -> None:
    """Put back the previous database if a conversion died between moving it aside and moving the new one in."""
    old = dst.parent / f".{dst.name}.old"
    if old.is_dir() and not dst.exists():
        log.warning("restoring %s from %s, left by a conversion interrupted while it replaced it", dst, old)
        os.replace(old, dst)


def stale_conversions(folder: str | os.PathLike[str]) -> list[Path]:
    """What interrupted conversions left in ``folder``: working copies and lock files that no running converter holds.

    Each ``.NAME.partial`` (an unfinished database), ``.NAME.old`` (a replaced one) and ``.NAME.lock`` whose lock is
    not held by a live converter is listed; those of a conversion under way are not.
    """
    root = Path(folder).expanduser().absolute()
    try:
        names = sorted(e.name for e in os.scandir(root) if e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    stale = []
    for name in names:
        for suffix in (".partial", ".old", ".lock"):
            if name.endswith(suffix) and len(name) > len(suffix) + 1:
                path, target = root / name, root / name[1 : -len(suffix)]
                if _is_ours(path, target) and _format.converter_of(target) is None:
                    stale.append(path)
    return stale


def _is_ours(path: Path, target: Path) -> bool:
    """Whether ``path`` (``.NAME.partial``, ``.NAME.old`` or ``.NAME.lock``) was left by a conversion.

    Not another program's: a database folder (or a working copy not yet started), or a lock file beside one or
    holding a converter's record.
    """
    if path.suffix == ".lock":
        if not path.is_file():
            return False
        if (target / _format.DATA_FILE).is_file() or _format.partial_path(target).is_dir():
            return True
        with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
            record = json.loads(path.read_text() or "null")
            return isinstance(record, dict) and "pid" in record and "host" in record
        return False
    return path.is_dir() and ((path / _format.DATA_FILE).is_file() or not any(path.iterdir()))


def clean_stale_conversions(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what interrupted conversions left in ``folder`` (:func:`stale_conversions`); one line per action.

    A ``.NAME.old`` whose database ``NAME`` is missing (a conversion died while replacing it) is put back as
    ``NAME`` rather than removed. Each ``NAME``'s leftovers are removed while holding its conversion lock, so a
    conversion that starts meanwhile is never touched.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ReadOnlyDestinationError: ``folder`` is read-only.

    """
    root = Path(folder).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"`folder` {str(root)!r} does not exist or is not a folder. Pass the folder to clean.")
    leftovers: dict[Path, list[Path]] = {}
    for path in stale_conversions(root):
        leftovers.setdefault(root / path.name[1 : -len(path.suffix)], []).append(path)
    done = []
    for target, paths in leftovers.items():
        try:
            with _target_lock(target, wait=False) as read_only:
                if read_only is not None:
                    raise _read_only_error(target, read_only) from read_only
                done += [_clean(path, target) for path in paths]
        except BlockingIOError:
            continue  # a conversion to `target` started meanwhile: its files are in use
    return done


def _clean(path: Path, target: Path) -> str:
    """Remove (or, for a database moved aside, put back) one leftover of a conversion to ``target``."""
    if path.suffix == ".old" and not target.exists():
        os.replace(path, target)
        return f"restored {target} from {path.name}, left by a conversion interrupted while replacing it"
    if path.is_dir():
        size = _dir_size(path)
        shutil.rmtree(path, ignore_errors=True)
        return f"removed {path} ({_human_bytes(size)}), left by an interrupted conversion"
    return f"removed {path}, the lock file of a conversion that is no longer running"  # removed when the lock ends


def _report_stale(dst: Path) -> None:
    """Name the working copies that dead converters left beside ``dst`` (this one's own is replaced anyway)."""
    own = _format.partial_path(dst)
    stale = [p for p in stale_conversions(dst.parent) if p.suffix == ".partial" and p != own]
    if stale:
        sizes = sum(_dir_size(p) for p in stale if p.is_dir())
        log.warning(
            "%d incomplete conversion(s) left by converters that are no longer running take %s in %s: %s. Remove them"
            " with `lightning-fastdata convert --clean %s`.",
            len(stale),
            _human_bytes(sizes),
            dst.parent,
            ", ".join(p.name for p in stale),
            dst.parent,
        )


def _write_failure(err: BaseException, tmp: Path, dst: Path, plan: _Plan, summary: ConversionSummary) -> str:
    """Why writing failed: a full disk, named with the free space and an estimate of what the database needs."""
    try:
        free: int | None = shutil.disk_usage(dst.parent).free
    except OSError:
        free = None
    try:
        written = (tmp / _format.DATA_FILE).stat().st_size
    except OSError:
        written = 0
    total = sum(len(tasks) for tasks in plan.tasks.values())
    if summary.written > 0:  # the records handed to LMDB so far, committed or not
        needed = summary.bytes_out / summary.written * total
        basis = f"{_human_bytes(round(summary.bytes_out / summary.written))} per image so far, for {total} images"
    else:
        needed = float(plan.source_bytes)
        basis = f"the {_human_bytes(plan.source_bytes)} of the {total} source images"
    code = getattr(err, "errno", None)
    full = code in (errno.ENOSPC, errno.EDQUOT) or isinstance(err, lmdb.DiskError)
    full = full or (free is not None and needed > 0 and free < needed - written)
    if not full:
        return (
            f"writing the database under {str(tmp)!r} failed: {err}. Check free disk space and permissions of"
            f" {str(dst.parent)!r}, then run the conversion again; nothing was published."
        )
    missing = max(0.0, needed - written - (free or 0))
    return (
        f"writing the database under {str(tmp)!r} failed: the disk is full (ENOSPC; LMDB said: {err})."
        f" {_human_bytes(free or 0)} is free on the disk of {str(dst.parent)!r}; the database needs about"
        f" {_human_bytes(round(needed))} (estimated from {basis}), so free about {_human_bytes(round(missing))}"
        " more, or convert onto another disk, then run the conversion again; nothing was published."
    )


def _run(
    plan: _Plan,
    dst: str | os.PathLike[str],
    datasets: Mapping[str, Any] | None,
    opts: _Options,
    num_workers: int | None,
    strict: bool,
    force: bool,
    progress: bool,
    initial_map_size: int,
) -> ConversionSummary:
    dst = Path(dst).absolute()
    _make_parent(dst)
    encoding_meta = asdict(opts)
    workers = usable_cpu_count() if num_workers is None else num_workers
    if workers < 0:
        raise ValueError(f"`num_workers` must be >= 0 (0 converts in this process), got {workers}.")
    summary = ConversionSummary(destination=str(dst), workers=workers, ignored=list(plan.ignored))
    start = time.perf_counter()
    with _target_lock(dst) as read_only:
        if read_only is None:
            _recover_interrupted_publish(dst)
        old = _existing_meta(dst)
        old_source = old.get("source", {}).get("path") if old is not None else None
        # a dataset's source is only its type name: two datasets cannot be told apart, and re-running must work
        both_datasets = str(old_source).startswith("<") and plan.source.startswith("<")
        if old is not None and not force and old_source != plan.source and not both_datasets:
            raise DestinationError(
                f"`dst` {str(dst)!r} holds a database converted from {old_source!r}, not from {plan.source!r};"
                " refusing to replace it (it may be the only copy of that data). Choose another `dst`, or pass"
                " --force (`force=True`) to replace it."
            )
        if (
            old is not None
            and not force
            and plan.fingerprint is not None
            and old.get("source", {}).get("fingerprint") == plan.fingerprint
            and old.get("encoding") == encoding_meta
        ):
            summary.up_to_date = True
            summary.written = sum(s["length"] for s in old["splits"].values())
            summary.splits = {name: s["length"] for name, s in old["splits"].items()}
            return summary
        if read_only is not None:
            raise _read_only_error(dst, read_only, outdated=old is not None) from read_only

        _report_stale(dst)
        tmp = _format.partial_path(dst)
        if tmp.exists():
            log.info("removing %s (%s), left by an interrupted conversion", tmp, _human_bytes(_dir_size(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(dst.parent / f".{dst.name}.old", ignore_errors=True)
        tmp.mkdir()
        summary.skipped.extend(plan.skipped)
        try:
            try:
                meta = _write(plan, tmp, datasets, opts, workers, progress, initial_map_size, summary)
            except (lmdb.Error, OSError) as err:
                raise ConversionError(_write_failure(err, tmp, dst, plan, summary)) from err
            summary.seconds = time.perf_counter() - start
            if strict and summary.skipped:
                raise ConversionError(
                    f"{len(summary.skipped)} input(s) could not be converted and `strict` is set; nothing was"
                    f" written to {str(dst)!r}. First: {summary.skipped[0].path}: {summary.skipped[0].reason}."
                    " Fix or remove those files, or convert without --strict to skip them."
                )
            if summary.written == 0:
                first = f" First: {summary.skipped[0].path}: {summary.skipped[0].reason}." if summary.skipped else ""
                raise ConversionError(f"none of the {len(summary.skipped)} inputs could be converted.{first}")
            summary.bytes_out = _dir_size(tmp)
            report = {"meta": meta, **summary.to_dict()}
            try:
                (tmp / _format.REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
            except OSError as err:
                raise ConversionError(
                    f"writing {_format.REPORT_FILE} under {str(tmp)!r} failed: {err}. Check free disk space; nothing"
                    " was published."
                ) from err
            _publish(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return summary


def _publish(tmp: Path, dst: Path) -> None:
    """Move the finished database into place; an interruption leaves either the old or the new one, or none."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _write(
    plan: _Plan,
    tmp: Path,
    datasets: Mapping[str, Any] | None,
    opts: _Options,
    workers: int,
    progress: bool,
    initial_map_size: int,
    summary: ConversionSummary,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "format_version": _format.FORMAT_VERSION,
        "complete": False,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "writer": f"lightning_fastdata {__version__}",
        "encoding": asdict(opts),
        "source": {"path": plan.source, "fingerprint": plan.fingerprint},
    }
    all_tasks = [task for split_tasks in plan.tasks.values() for task in split_tasks]
    all_names = [name for split in plan.tasks for name in plan.names.get(split, [])]
    if len(all_names) != len(all_tasks):
        all_names = [f"{task[0]}[{task[1]}]" for task in all_tasks]
    labels: dict[str, list[int]] = {split: [] for split in plan.tasks}
    sources: dict[str, list[str]] = {split: [] for split in plan.tasks}
    bar = tqdm(total=len(all_tasks), unit="img", desc=f"convert {Path(plan.source).name}", disable=not progress)
    # The pool starts before the LMDB environment opens: a forked child must never inherit an open environment.
    with bar, _results(all_tasks, datasets, opts, workers) as results:
        writer = _LmdbWriter(tmp, initial_map_size)
        try:
            writer.put(_format.META_KEY, _format.dump_meta(meta))  # complete=False until the very end
            writer.flush()
            for task, name, result in zip(all_tasks, all_names, results, strict=True):
                label, size, encoding, height, width, payload, reason = result
                split = task[0]
                summary.bytes_in += size
                if reason is not None or payload is None:
                    shown = task[1] if isinstance(task[1], str) else f"{split}[{task[1]}]"
                    summary.skipped.append(SkippedFile(str(shown), str(reason)))
                    bar.set_postfix(skipped=len(summary.skipped), refresh=False)
                else:
                    record = _format.pack_record(encoding, label, height, width, payload)
                    writer.put(_format.record_key(split, len(labels[split])), record)
                    labels[split].append(label)
                    sources[split].append(name)
                    summary.written += 1  # live, with bytes_out: a full disk's message estimates the space needed
                    summary.bytes_out += len(record)
                bar.update()
            classes = plan.classes
            if classes is None:
                top = max((max(ls) for ls in labels.values() if ls), default=-1)
                classes = [str(i) for i in range(top + 1)]
            elif any(ls and max(ls) >= len(classes) for ls in labels.values()):
                raise ConversionError(f"a label is >= the number of classes ({len(classes)}); pass the full `classes`.")
            for split, split_labels in labels.items():
                writer.put(_format.labels_key(split), np.asarray(split_labels, dtype="<i4").tobytes())
                writer.put(_format.sources_key(split), json.dumps(sources[split]).encode())
            meta["classes"] = classes
            meta["splits"] = {
                split: {"length": len(ls), "class_counts": np.bincount(ls, minlength=len(classes)).tolist()}
                for split, ls in labels.items()
            }
            meta["complete"] = True
            writer.put(_format.META_KEY, _format.dump_meta(meta))
        except BaseException:
            writer.env.close()  # drop pending writes: the partial directory is deleted by the caller
            raise
        writer.close()
    summary.splits = {split: len(ls) for split, ls in labels.items()}
    summary.written = sum(summary.splits.values())
    return meta


@contextlib.contextmanager
def _results(
    tasks: list[tuple[str, str | int, int]], datasets: Mapping[str, Any] | None, opts: _Options, workers: int
) -> Iterator[Iterator[tuple[Any, ...]]]:
    """Results of ``_work`` in task order, from a process pool (``workers > 0``) or this process."""
    if workers == 0:
        # not `_init_worker`: its one-thread cap is for pool workers and must not stick to the caller's process
        _STATE["datasets"] = datasets
        _STATE["opts"] = opts
        try:
            yield map(_work, tasks)
        finally:
            _STATE.clear()
        return
    chunksize = max(1, min(32, len(tasks) // (workers * 8)))
    with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(datasets, opts)) as pool:
        yield pool.imap(_work, tasks, chunksize=chunksize)


def _check_options(short_side: int | None, quality: int, keep_original: bool, encoding: str) -> _Options:
    if short_side is not None and short_side < 0:
        raise ValueError(f"`short_side` must be >= 0 (0 or None keeps the original size), got {short_side}.")
    if not 1 <= quality <= 100:
        raise ValueError(f"`quality` must be in 1..100, got {quality}.")
    if encoding not in ("jpeg", "raw"):
        raise ValueError(f"`encoding` must be 'jpeg' or 'raw', got {encoding!r}.")
    if encoding == "raw" and keep_original:
        raise ValueError("`keep_original` stores JPEG bytes and cannot be combined with `encoding='raw'`.")
    return _Options(short_side or None, quality, keep_original, encoding)  # type: ignore[arg-type]


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    short_side: int | None = 256,
    quality: int = 90,
    keep_original: bool = False,
    encoding: Encoding = "jpeg",
    num_workers: int | None = None,
    strict: bool = False,
    force: bool = False,
    progress: bool = True,
    initial_map_size: int = _INITIAL_MAP_SIZE,
) -> ConversionSummary:
    """Convert an ImageFolder tree, a root of split trees, or a ``path,label`` list file into an LMDB image database.

    Split folders are recognised by name, in any case: ``train``/``training``, ``val``/``valid``/``validation``/``dev``
    and ``test``/``testing`` are stored as ``train``, ``val`` and ``test``. Each record's path relative to ``src`` is
    stored too (:func:`~lightning_fastdata.read_sources`). Non-image files and empty class folders are left out and
    listed in ``ConversionSummary.ignored``; unreadable paths (a dangling link) are skipped and listed.

    The conversion runs once: re-running on an unchanged source with the same options does nothing (also in a
    read-only folder). It writes into a hidden sibling of ``dst`` and renames it into place at the end, so an
    interruption never leaves anything that reads as a complete database; running again starts over. While it runs,
    the lock file ``.<dst>.lock`` beside ``dst`` names its process; :func:`clean_stale_conversions` removes what a
    killed conversion left.

    Args:
        src: an ImageFolder root (``src/<class>/<image>``), a root of split trees (``src/train/<class>/<image>``),
            or a list file: ``.csv`` with a header holding ``path`` and ``label`` (and optionally ``split``), or
            ``.json``, a list of such objects. Listed paths are relative to the list file's folder; labels are class
            names, or class indices when all are non-negative integers. ``~`` is expanded.
        dst: the database directory to create or replace. Only a lightning_fastdata database converted from the same
            ``src`` is replaced; one converted from another source needs ``force``.
        short_side: downscale images whose short side is larger to this many pixels (256 fits training at 224) and
            store them as JPEG; ``None`` or ``0`` keeps the original size. Smaller images are never upscaled.
        quality: JPEG quality of re-encoded images.
        keep_original: store the source bytes untouched wherever the source already is an RGB or grayscale JPEG, even
            when larger than ``short_side``. Small JPEGs are always stored untouched.
        encoding: ``"jpeg"`` (compact, decoded per read) or ``"raw"`` (uint8 pixels: about 10x the size, no decode
            at all when reading; for datasets that fit the page cache and CPU-bound input pipelines).
        num_workers: worker processes; default: the CPUs this process may use (affinity and cgroup quota). ``0``
            converts in this process.
        strict: fail, writing nothing, if any file is skipped (corrupt, truncated, empty, not an image).
        force: rebuild even if ``dst`` is up to date, or replace a database converted from another source.
        progress: show a progress bar with images/s and ETA.
        initial_map_size: the first LMDB map size in bytes; it doubles by itself whenever the database fills it.

    Returns:
        A :class:`ConversionSummary`; skipped and ignored files are also listed in ``dst/convert_report.json``.

    Raises:
        SourceLayoutError: ``src`` is missing, empty, or not laid out as an image folder or a list file (including a
            single class folder whose images lie in two or more sub-folders: classes nested one level too deep).
        DestinationError: ``dst`` holds other data, or (without ``force``) a database of another source, or a file
            stands where one of its parent folders must go.
        ReadOnlyDestinationError: the folder of ``dst`` is read-only and ``dst`` is not an up-to-date database.
        ConversionError: nothing could be converted, a file was skipped under ``strict``, or writing failed (a full
            disk is named, with the space the database needs).

    Example:
        >>> from lightning_fastdata import convert
        >>> summary = convert("data/imagenette", "data/imagenette.lmdb", short_side=256)
        >>> print(summary.format())

    """
    opts = _check_options(short_side, quality, keep_original, encoding)
    src_path, dst_path = Path(src).expanduser().absolute(), Path(dst).expanduser().absolute()
    is_list = src_path.is_file() and src_path.suffix.lower() in LIST_EXTENSIONS
    if dst_path == src_path:
        raise ValueError(f"`dst` {str(dst)!r} and `src` {str(src)!r} are the same path. Choose another `dst`.")
    if not is_list and dst_path.is_relative_to(src_path):
        raise ValueError(
            f"`dst` {str(dst)!r} is inside `src` {str(src)!r}; it must be outside (inside, it would be read as a class"
            " or a split on the next run). Choose a path beside the image folder, e.g. `data/images.lmdb`."
        )
    if src_path.is_relative_to(dst_path):
        raise ValueError(
            f"`src` {str(src)!r} is inside `dst` {str(dst)!r}: converting would replace the folder holding the source."
            " Choose a `dst` outside it, e.g. `data/images.lmdb` beside the image folder."
        )
    plan = _scan_list(src_path) if is_list else _scan_folder(src_path)
    return _run(plan, dst_path, None, opts, num_workers, strict, force, progress, initial_map_size)


class _Rows:
    """A dataset seen as ``(image, label)`` pairs.

    Tuples pass through; mapping rows (Hugging Face ``datasets``) are read by column, and an undecoded ``Image``
    feature (``{"bytes": ..., "path": ...}``) gives its stored bytes.
    """

    def __init__(self, dataset: Any, image_column: str | None, label_column: str | None) -> None:
        self.dataset = dataset
        self.image_column = image_column
        self.label_column = label_column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.dataset[index]
        if not isinstance(row, Mapping):
            image, label = row
            return image, label
        image_key = self.image_column or next((k for k in ("image", "img") if k in row), None)
        label_key = self.label_column or next((k for k in ("label", "labels") if k in row), None)
        if image_key not in row or label_key not in row:
            raise KeyError(
                f"the row has columns {sorted(row)}; pass `image_column` and `label_column` to `convert_dataset`"
            )
        image = row[image_key]
        if isinstance(image, Mapping):  # datasets.Image(decode=False): the stored bytes, or the file they came from
            if image.get("bytes"):
                image = image["bytes"]
            elif image.get("path"):
                with open(image["path"], "rb") as fh:
                    image = fh.read()
        return image, row[label_key]


def _dataset_classes(dataset: Any, label_column: str | None) -> list[str] | None:
    """``dataset.classes``, or the names of a Hugging Face ``ClassLabel`` label column."""
    classes = getattr(dataset, "classes", None)
    if classes is not None:
        return list(classes)
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping):
        feature = features.get(label_column or next((k for k in ("label", "labels") if k in features), ""))
        names = getattr(feature, "names", None)
        if names:
            return [str(name) for name in names]
    return None


def convert_dataset(
    dataset: Sequence[Any] | Mapping[str, Sequence[Any]],
    dst: str | os.PathLike[str],
    classes: Sequence[str] | None = None,
    short_side: int | None = 256,
    quality: int = 90,
    keep_original: bool = False,
    encoding: Encoding = "jpeg",
    num_workers: int | None = None,
    strict: bool = False,
    fingerprint: str | None = None,
    force: bool = False,
    progress: bool = True,
    initial_map_size: int = _INITIAL_MAP_SIZE,
    image_column: str | None = None,
    label_column: str | None = None,
) -> ConversionSummary:
    """Convert any indexed dataset of ``(PIL image or encoded image bytes, int label)`` into a database.

    Also takes a Hugging Face ``datasets.Dataset`` (or a ``DatasetDict`` of splits) with an image and a label column:
    rows are read by column, class names come from a ``ClassLabel`` label feature, and an ``Image(decode=False)``
    column is stored from its encoded bytes without decoding. Split names are stored as :func:`convert` stores split
    folders (``validation`` becomes ``val``, ...); each record's index in its dataset is stored as its source.

    Args:
        dataset: one dataset (stored as split ``"train"``) or a mapping of split name to dataset.
        dst: the database directory to create or replace.
        classes: the class names; default: the first dataset's ``classes`` attribute, or its ``ClassLabel`` names,
            else ``"0"``, ``"1"``, ...
        short_side: as in :func:`convert`.
        quality: as in :func:`convert`.
        keep_original: as in :func:`convert`.
        encoding: as in :func:`convert`.
        num_workers: as in :func:`convert`; the datasets reach the workers by fork, or are pickled once under spawn.
        strict: as in :func:`convert`.
        fingerprint: a string that identifies the dataset's content; when given, re-running with the same
            fingerprint and options does nothing. Without it, every call converts.
        force: as in :func:`convert`.
        progress: as in :func:`convert`.
        initial_map_size: as in :func:`convert`.
        image_column: for rows that are mappings: the image column; default ``"image"`` or ``"img"``.
        label_column: for rows that are mappings: the label column; default ``"label"`` or ``"labels"``.

    Returns:
        A :class:`ConversionSummary`.

    Example:
        >>> import datasets  # pip install 'lightning-fastdata[hf]'
        >>> from lightning_fastdata import convert_dataset
        >>> splits = datasets.load_dataset("imagefolder", data_dir="data/pets")  # doctest: +SKIP
        >>> convert_dataset(splits, "data/pets.lmdb")  # doctest: +SKIP

    """
    opts = _check_options(short_side, quality, keep_original, encoding)
    given = dict(dataset) if isinstance(dataset, Mapping) else {"train": dataset}
    if not given or not all(len(ds) for ds in given.values()):
        raise SourceLayoutError("every dataset passed to `convert_dataset` must be non-empty.")
    _warn_split_typos(dict.fromkeys(map(str, given), "the dataset for split"), "`dataset`")
    datasets: dict[str, _Rows] = {}
    for name, ds in given.items():
        split = canonical_split(str(name)) or str(name)
        if split in datasets:
            raise SourceLayoutError(f"`dataset` has two splits stored as {split!r}; rename one of them.")
        datasets[split] = _Rows(ds, image_column, label_column)
    first = next(iter(given.values()))
    if classes is None:
        classes = _dataset_classes(first, label_column)
    tasks = {split: [(split, i, -1) for i in range(len(ds))] for split, ds in datasets.items()}
    plan = _Plan(
        classes=list(classes) if classes is not None else None,
        tasks=tasks,  # type: ignore[arg-type]
        fingerprint=fingerprint,
        source=f"<{type(first).__name__}>",
        names={split: [str(i) for i in range(len(ds))] for split, ds in datasets.items()},
    )
    return _run(plan, Path(dst).expanduser(), datasets, opts, num_workers, strict, force, progress, initial_map_size)
