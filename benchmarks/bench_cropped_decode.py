"""What decoding only the crop would save: full decode + crop-resize against TurboJPEG 3's cropped decode, one core.

The training crop (``RandomResizedCrop``) keeps on average about half of each image, yet the loaders (ours, FFCV's,
limit B) decode all of it. libjpeg-turbo 3's TurboJPEG API can decode a region (``tj3SetCroppingRegion``: rows
outside it are skipped, columns outside it are entropy-decoded but not transformed). This times, on the same stored
JPEGs and the same crop boxes, per image on one core:

* ``full``: ``simplejpeg`` (fast DCT and upsampling), then this package's ``crop_resize_into`` (what the loaders do);
* ``cropped``: TurboJPEG 3 with the same fast DCT and upsampling, decoding only the crop's rows and its MCU-aligned
  columns, then the same ``crop_resize_into``.

It needs a ``libturbojpeg`` of version 3 or later (``--lib``, else the system's): Debian 12 ships 2.1,
without this API, and no maintained wheel ships one, so the package does not use it. The ``turbojpeg`` 0.0.2 wheel on
PyPI bundles one (``pip download turbojpeg==0.0.2``, then ``--lib`` its ``turbojpeg.libs/libturbojpeg-*.so*``).

    python benchmarks/bench_cropped_decode.py --images .bench/images-3000-noise8-256 --lib /path/libturbojpeg.so.0
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import random
import statistics
import time
from pathlib import Path

import cv2
import numpy as np
import simplejpeg

from lightning_fastdata.transforms import RandomResizedCropFlip, crop_resize_into

SIZE = 224
TJINIT_DECOMPRESS, TJPARAM_JPEGWIDTH, TJPARAM_JPEGHEIGHT, TJPARAM_FASTUPSAMPLE, TJPARAM_FASTDCT = 1, 5, 6, 9, 10
TJPARAM_SUBSAMP, TJPF_RGB = 4, 0
MCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 8}  # TJSAMP_444, 422, 420, GRAY, 440, 411, 441


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


def _turbojpeg(path: str | None) -> ctypes.CDLL:
    found = path or ctypes.util.find_library("turbojpeg")
    if found is None:
        raise SystemExit("no libturbojpeg found: pass --lib")
    lib = ctypes.CDLL(found)
    if not hasattr(lib, "tj3SetCroppingRegion"):
        raise SystemExit(f"{found} is older than libjpeg-turbo 3.0 (no tj3SetCroppingRegion): pass --lib")
    lib.tj3Init.restype = ctypes.c_void_p
    lib.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
    lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int]
    lib.tj3Decompress8.argtypes += [ctypes.c_int]
    lib.tj3GetErrorStr.restype = ctypes.c_char_p
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default=".bench/images-3000-noise8-256", help="a folder of stored JPEGs")
    parser.add_argument("--lib", default=None, help="a libturbojpeg of version 3 or later")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=int, default=1000, help="images to time")
    args = parser.parse_args()

    cv2.setNumThreads(1)
    lib = _turbojpeg(args.lib)
    handle = lib.tj3Init(TJINIT_DECOMPRESS)
    lib.tj3Set(handle, TJPARAM_FASTUPSAMPLE, 1)
    lib.tj3Set(handle, TJPARAM_FASTDCT, 1)
    blobs = [f.read_bytes() for f in sorted(Path(args.images).rglob("*.jpg"))][: args.limit]
    crop = RandomResizedCropFlip(SIZE)
    out, scratch, decoded = (
        np.empty((SIZE, SIZE, 3), np.uint8),
        np.empty(1 << 20, np.uint8),
        np.empty(1 << 22, np.uint8),
    )

    def full(blob: bytes) -> None:
        image = simplejpeg.decode_jpeg(blob, "RGB", fastdct=True, fastupsample=True, buffer=decoded)
        crop_resize_into(image, crop.box(*image.shape[:2]), SIZE, crop.flip(), out, scratch)

    def cropped(blob: bytes) -> None:
        if lib.tj3DecompressHeader(handle, blob, len(blob)):
            raise RuntimeError(lib.tj3GetErrorStr(handle))
        height, width = lib.tj3Get(handle, TJPARAM_JPEGHEIGHT), lib.tj3Get(handle, TJPARAM_JPEGWIDTH)
        top, left, h, w = crop.box(height, width)
        x = left - left % MCU_WIDTH[lib.tj3Get(handle, TJPARAM_SUBSAMP)]
        region = _Region(x, top, min(width - x, w + left - x), h)
        if lib.tj3SetCroppingRegion(handle, region) or lib.tj3Decompress8(
            handle, blob, len(blob), decoded.ctypes.data, region.w * 3, TJPF_RGB
        ):
            raise RuntimeError(lib.tj3GetErrorStr(handle))
        image = decoded[: region.h * region.w * 3].reshape(region.h, region.w, 3)
        crop_resize_into(image, (0, left - x, h, w), SIZE, crop.flip(), out, scratch)
        lib.tj3SetCroppingRegion(handle, _Region(0, 0, 0, 0))

    times: dict[str, list[float]] = {"full": [], "cropped": []}
    for _ in range(args.rounds):  # interleaved, the same boxes for both (the same seed)
        for name, one in (("full", full), ("cropped", cropped)):
            random.seed(0)
            start = time.process_time()
            for blob in blobs:
                one(blob)
            times[name].append((time.process_time() - start) / len(blobs) * 1e6)
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{len(blobs)} images from {args.images}, median of {args.rounds} rounds, one core:")
    print(f"full decode + crop-resize:    {med['full']:.0f} us per image")
    print(f"cropped decode + crop-resize: {med['cropped']:.0f} us per image ({med['cropped'] / med['full']:.2f}x)")


if __name__ == "__main__":
    main()
