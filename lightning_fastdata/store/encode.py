"""Per-image encoding: one source image (a file, encoded bytes or a PIL image) to one record's payload.

:class:`EncodeOptions` is the one definition of how images are stored (``short_side``, ``quality``,
``keep_original``, ``encoding``): :func:`check_options` validates what ``convert`` and ``convert_dataset`` were
given, and the database's metadata records it (``meta["encoding"]``), so a re-run with other options converts again.
:func:`encode_all` encodes a conversion's tasks in order, in a pool of worker processes or in this one.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import multiprocessing
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from lightning_fastdata._cv import cv2
from lightning_fastdata._files import FileTooLargeError, NotRegularFileError, read_regular
from lightning_fastdata.cpus import usable_cpu_count
from lightning_fastdata.store.format import ENCODING_JPEG, ENCODING_RAW, MAX_SIDE
from lightning_fastdata.store.labels import kind_of_value
from lightning_fastdata.store.plan import MAX_SOURCE_BYTES, not_an_image_reason, too_large_reason
from lightning_fastdata.store.summary import image_error_reason
from lightning_fastdata.store.targets import MIXED_KINDS, TargetSpec, check_target

if TYPE_CHECKING:
    from lightning_fastdata.store.plan import Task


class _Skip(Exception):
    """An input that cannot become a record; the message is the reason shown to the user."""


Encoding = Literal["jpeg", "raw"]


@dataclass(frozen=True)
class EncodeOptions:
    """How each image is stored; ``asdict`` of it is the ``encoding`` entry of a database's metadata.

    The fields are ``convert``'s arguments of the same names (documented there), after :func:`check_options`.
    """

    short_side: int | None
    quality: int
    keep_original: bool
    encoding: Encoding = "jpeg"


def check_options(short_side: int | None, quality: int, keep_original: bool, encoding: str) -> EncodeOptions:
    """The options of a conversion, checked; ``0`` and ``None`` for ``short_side`` both keep the original size.

    Raises:
        ValueError: an option is out of range, or ``keep_original`` is combined with ``encoding="raw"``.

    """
    if short_side is not None and short_side < 0:
        raise ValueError(f"`short_side` must be >= 0 (0 or None keeps the original size), got {short_side}.")
    if not 1 <= quality <= 100:
        raise ValueError(f"`quality` must be in 1..100, got {quality}.")
    if encoding not in ("jpeg", "raw"):
        raise ValueError(f"`encoding` must be 'jpeg' or 'raw', got {encoding!r}.")
    if encoding == "raw" and keep_original:
        raise ValueError("`keep_original` stores JPEG bytes and cannot be combined with `encoding='raw'`.")
    return EncodeOptions(short_side or None, quality, keep_original, encoding)  # type: ignore[arg-type]


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


def _encode_image(source: Any, opts: EncodeOptions) -> tuple[int, int, int, bytes]:
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
        except Image.DecompressionBombError as err:
            raise _Skip(
                f"too large to open safely ({err}); if the file is trusted, raise `PIL.Image.MAX_IMAGE_PIXELS`"
                " (or set it to None) before converting"
            ) from None
        except (OSError, SyntaxError, ValueError) as err:
            raise _Skip(image_error_reason(err, f"unreadable image header: {err}")) from None
    else:
        raise _Skip(f"expected a PIL image or encoded image bytes, got {type(source).__name__}")
    try:
        width, height = img.size
        target = _target_size(width, height, opts.short_side)
        if max(target or (width, height)) > MAX_SIDE:  # readers refuse such a record (and JPEG cannot hold it)
            raise _Skip(f"{width}x{height} is over {MAX_SIDE} pixels a side, the most a record holds; set `short_side`")
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
            return ENCODING_JPEG, height, width, raw
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
            return ENCODING_RAW, img.height, img.width, img.tobytes()
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=opts.quality)
        return ENCODING_JPEG, img.height, img.width, out.getvalue()
    except _Skip:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise _Skip(image_error_reason(err, f"corrupt or truncated image: {err}")) from None


def _downscale_jpeg(raw: bytes, target: tuple[int, int], quality: int) -> tuple[int, int, int, bytes]:
    """The common case, fast: an RGB or grayscale JPEG to ``target`` (width, height), re-encoded as JPEG.

    libjpeg-turbo decodes (at half scale in the DCT when the source is at least twice the target: exact and SIMD);
    a Gaussian prefilter then a bilinear resize shrink it, antialiased; libjpeg-turbo encodes with 4:2:0 chroma, as
    Pillow does. The prefilter's sigma, ``0.5 * sqrt(ratio**2 - 1)``, blurs about as much as an antialiased bilinear
    (triangle) filter of the same ratio, Pillow's and torchvision's: files come out the size Pillow's give, where
    scikit-image's weaker ``(ratio - 1) / 2`` kept grain that made them larger and slower to decode in every epoch;
    and it takes less time than Pillow's decode, resize and encode
    (measured: docs/benchmarks.md#conversion-prefilter-the-blur-of-an-antialiased-bilinear-filter).
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
        raise _Skip(image_error_reason(err, f"corrupt or truncated image: {err}")) from None
    return ENCODING_JPEG, target[1], target[0], payload


# ---------------------------------------------------------------------------------------------------------------
# Encoding a conversion's tasks, in worker processes or in this one
# ---------------------------------------------------------------------------------------------------------------


class EncodeResult(NamedTuple):
    """What encoding one task gave: a record's fields and payload, or (``payload is None``) why it was skipped."""

    label: Any
    bytes_in: int
    encoding: int
    height: int
    width: int
    payload: bytes | None
    reason: str | None


# Per-worker state, installed by the pool initializer (inherited under fork, pickled once under spawn).
_STATE: dict[str, Any] = {}


def _init_worker(
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    max_image_pixels: int | None,
    targets: tuple[TargetSpec, dict[str, int] | None, bool] | None = None,
) -> None:
    # Ctrl-C reaches the whole process group: the main process handles it (and stops the pool); a worker would only
    # print its own KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Image.MAX_IMAGE_PIXELS = max_image_pixels  # the caller's limit, also under spawn
    _STATE["datasets"] = datasets
    _STATE["opts"] = opts
    _STATE["targets"] = targets
    # One thread per worker: the pool already uses every core. Encoding needs no torch (importing it takes longer than
    # a small conversion: docs/benchmarks.md#conversion-workers-no-torch-and-a-pool-only-where-it-pays); torch is
    # capped only where it is already loaded: inherited by fork from
    # a caller that uses it, or imported by a dataset that reached this worker pickled.
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)


def _load_task(task: Task) -> tuple[Any, Any, int]:
    """Read the task's input: ``(source, target, bytes_in)``; a dataset's target checked against the kind."""
    split, item, label = task
    if isinstance(item, str):
        try:  # only a regular file, read up to its size: a path may have become a FIFO or a device since the scan
            raw = read_regular(item, limit=MAX_SOURCE_BYTES)
        except NotRegularFileError as err:
            raise _Skip(not_an_image_reason(err.kind)) from None
        except FileTooLargeError as err:
            raise _Skip(too_large_reason(err.size)) from None
        except OSError as err:
            raise _Skip(f"cannot read file: {err.strerror or err}") from None
        return raw, label, len(raw)
    try:
        source, label = _STATE["datasets"][split][item]
    except Exception as err:  # a user's dataset may raise anything; the sample is skipped and reported
        raise _Skip(f"dataset raised {type(err).__name__}: {err}") from None
    spec, class_to_idx, inferred = _STATE.get("targets") or (TargetSpec(), None, False)
    try:
        target = check_target(spec, label, class_to_idx)
    except ValueError as err:
        kind = kind_of_value(label)
        if inferred and kind not in (None, "none", spec.kind):  # the first sample's kind was a guess, and is wrong
            first = f"where the first sample's made it {spec.kind}"
            raise _Skip(f"{MIXED_KINDS} {label!r:.60} is {kind}, {first}") from None
        raise _Skip(f"{spec.kind} target: {err}") from None
    size = len(source) if isinstance(source, (bytes, bytearray, memoryview)) else 0
    return source, target, size


def _work(task: Task) -> EncodeResult:
    """Pool entry point: the encoded record of ``task``, or the reason it is skipped."""
    label, size = task[2], 0
    try:
        source, label, size = _load_task(task)
        encoding, height, width, payload = _encode_image(source, _STATE["opts"])
    except _Skip as skip:
        return EncodeResult(label, size, 0, 0, 0, None, str(skip))
    return EncodeResult(label, size, encoding, height, width, payload, None)


class Encoded(NamedTuple):
    """What :func:`encode_all` yields: the results in task order, and how many worker processes make them."""

    results: Iterator[EncodeResult]
    workers: int  # 0: this process


#: Without a worker count given, tasks are encoded in this process for up to this long first: what that took per task
#: says whether a pool would pay for its start (:func:`_pool_pays`); a small conversion ends here, without one.
_PROBE_S = 0.25


def _pool_pays(seconds_per_task: float, remaining: int, workers: int, method: str | None) -> bool:
    """Whether a pool of ``workers`` encodes ``remaining`` tasks sooner than this process, counting its start.

    A forked worker starts in milliseconds; a spawned or forkserver one (Python 3.14's default on Linux) imports this
    package first (measured: docs/benchmarks.md#conversion-workers-no-torch-and-a-pool-only-where-it-pays). The
    pool must save twice a generous start time, so it never costs time.
    """
    if workers < 2:  # one worker only moves the work out of this process
        return False
    start = 0.1 if method == "fork" else 1.0
    return seconds_per_task * remaining * (1 - 1 / workers) > 2 * start


@contextlib.contextmanager
def encode_all(
    tasks: list[Task],
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    workers: int | None,
    targets: tuple[TargetSpec, dict[str, int] | None, bool] | None = None,
) -> Iterator[Encoded]:
    """The :class:`EncodeResult` of each task in order, from a process pool (``workers > 0``) or this process.

    ``workers=None`` uses up to the usable CPUs, and for files none where a pool would not pay for its start: the
    first tasks are encoded here (:data:`_PROBE_S`), and the rest too unless :func:`_pool_pays`. Pool workers import
    only what encoding needs (not torch) and run one thread each. ``datasets`` (``convert_dataset``'s, by split)
    reach the pool's workers by fork, or are pickled once under spawn and forkserver.
    """
    # not `_init_worker` here: its one-thread cap is for pool workers and must not stick to the caller's process
    _STATE.update(datasets=datasets, opts=opts, targets=targets)
    try:
        done: list[EncodeResult] = []
        # files only: reading a dataset of one's own here, before the pool forks, would hand the workers whatever
        # handles its reads opened lazily (an HDF5 file, a database, a socket)
        probe = workers is None and datasets is None
        if workers is None:
            workers = min(usable_cpu_count(), len(tasks))
        if probe:
            started = time.perf_counter()
            while len(done) < len(tasks) and time.perf_counter() - started < _PROBE_S:
                done.append(_work(tasks[len(done)]))
            per_task = (time.perf_counter() - started) / max(1, len(done))
            method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
            if not _pool_pays(per_task, len(tasks) - len(done), workers, method):
                workers = 0
        rest = tasks[len(done) :]
        if workers == 0 or not rest:
            yield Encoded(itertools.chain(done, map(_work, rest)), 0)
            return
        workers = min(workers, len(rest))
        chunksize = max(1, min(32, len(rest) // (workers * 8)))
        with multiprocessing.get_context().Pool(
            workers, initializer=_init_worker, initargs=(datasets, opts, Image.MAX_IMAGE_PIXELS, targets)
        ) as pool:
            yield Encoded(itertools.chain(done, pool.imap(_work, rest, chunksize=chunksize)), workers)
    finally:
        _STATE.clear()
