"""A record's image checked against the reader's limits, then decoded: :class:`RecordDecoder`.

The reader (:class:`~lightning_fastdata.store.reader.LmdbImageDataset`) reads records; what it takes to turn one into
pixels lives here, owned by one :class:`RecordDecoder` a dataset holds and hands its decodes to. A database you did
not make may ask a reader for more memory or time than its images are worth (decompression bombs), so nothing is
decoded before it is checked, in the order the bytes allow:

1. **The record header** (:meth:`RecordDecoder.check_pixels`, when a record is read): at most ``max_pixels``.
2. **The image's own frame header** (:meth:`RecordDecoder.check_frame`: JPEG SOF, PNG IHDR), which a decoder sizes
   its output by: within ``max_pixels`` too, and of the record's size exactly.
3. **What the decode takes** (a JPEG's markers, :func:`~lightning_fastdata.store.jpeg.jpeg_frame`, walked once a sample
   per process; a PIL image's mode): at most :data:`~lightning_fastdata.store.jpeg.MAX_JPEG_SCANS` scans, and at most
   :data:`DECODE_BUDGET` bytes a pixel of ``max_pixels``.

Then JPEGs decode with libjpeg-turbo (``simplejpeg``), PNGs with OpenCV (libpng), raw records are a view of their
bytes; ``output="pil"`` reads JPEGs and PNGs with PIL, each only as its own format. Errors name the sample through the
dataset's own naming (``split 'train' index 3 of '/data/db'``). Nothing here imports torch.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import simplejpeg
from PIL import Image

from lightning_fastdata._cv import cv2
from lightning_fastdata._files import anonymous_file, path_of
from lightning_fastdata.errors import CorruptRecordError
from lightning_fastdata.store.format import ENCODING_JPEG, ENCODING_PNG, ENCODING_RAW, RecordHeader
from lightning_fastdata.store.jpeg import _SCANS_COUNTED, MAX_JPEG_SCANS, JpegFrame, jpeg_frame

#: the most pixels a record may decode to by default: 48 MiP (50,331,648: 8192 x 6144), as much as a 50 MP camera's
#: photos (8688 x 5792); a database you did not make cannot ask a reader for more memory than this per image
#: (decompression bombs): 144 MiB decoded as RGB, 240 MiB as a greyscale JPEG that PIL converts to RGB.
DEFAULT_MAX_PIXELS = 3 * 2**24
#: the most memory one image's decode may take, in bytes a pixel of `max_pixels` (240 MiB at the default): what a
#: greyscale image of `max_pixels` takes as a PIL image (1 byte a pixel decoded, then 4 for PIL's RGB). An image whose
#: decode takes more a pixel (a CMYK JPEG; an RGBA, 16-bit or CMYK image read as a PIL image) is refused above the
#: pixels that fit, before it is decoded.
DECODE_BUDGET = 5
#: bytes a pixel that libjpeg-turbo (simplejpeg) takes for a CMYK or YCCK JPEG decoded to RGB: the CMYK image, then RGB
_CMYK_COST = 7
#: the only format PIL may read a record of each encoding as (none of its other, rarer, decoders)
_PIL_FORMATS = {ENCODING_JPEG: "JPEG", ENCODING_PNG: "PNG"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: a PNG of at most this many pixels decodes from its bytes, with OpenCV's copy (6 bytes a pixel: 6 MiB at most); a
#: larger one through a file in memory, straight into NumPy's (3 bytes a pixel), at the cost of the file's pages
#: (docs/benchmarks.md#png-records-from-their-bytes-up-to-1-mip)
_PNG_COPIED_PIXELS = 1 << 20
#: a record's image bytes: a copy out of the memory map, or a view into it (valid in its read transaction)
Encoded = bytearray | memoryview
_RAISE_HINT = (
    "If you trust this database, raise `max_pixels` (LmdbImageDataset or FastImageDataModule, `--data.max_pixels` on"
    " the command line), or pass None for no limit."
)


def _png_size(data: Encoded) -> tuple[int, int]:
    """``(height, width)`` from a PNG's IHDR chunk, which the format puts first."""
    if len(data) < 24 or bytes(data[:8]) != _PNG_SIGNATURE or bytes(data[12:16]) != b"IHDR":
        raise ValueError("not a PNG (no PNG signature and IHDR chunk)")
    width, height = struct.unpack_from(">II", data, 16)
    return height, width


def _read_png(data: Encoded, pixels: int) -> np.ndarray | None:
    """A PNG of ``pixels`` pixels decoded by OpenCV (libpng) into a new ``uint8`` RGB HWC array; ``None`` if it fails.

    Transparency is dropped, palettes, greyscale and depths under 8 bits are expanded, and 16-bit samples keep their
    high byte, all row by row as libpng decodes; EXIF orientation is not applied (as PIL). ``cv2.imdecode`` decodes
    into OpenCV's memory and copies that into NumPy's (6 bytes a pixel at the peak): a PNG of more than
    :data:`_PNG_COPIED_PIXELS` goes to ``cv2.imread`` as a file in memory instead, which, given an output, decodes
    straight into NumPy's memory (3 bytes a pixel).
    """
    flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
    if pixels <= _PNG_COPIED_PIXELS:
        return cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    fd = anonymous_file("lightning_fastdata-png")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)  # opening /dev/fd/N shares this offset on some systems
        return cv2.imread(path_of(fd), None, flags)
    finally:
        os.close(fd)


def _pil_cost(mode: str) -> int:
    """Bytes a pixel that PIL takes to decode an image of ``mode`` and convert it to RGB.

    PIL keeps an image of one 8-bit band in 1 byte a pixel, a 16-bit one (``I;16``) in 2, and every other mode
    (RGB, RGBA, LA, CMYK, ...) in 4; a conversion to RGB makes a second image, of 4.
    """
    if mode == "RGB":
        return 4
    return (1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4) + 4


class RecordDecoder:
    """The checks and decodes of one split's records, held to ``max_pixels`` and :data:`DECODE_BUDGET`.

    One per :class:`~lightning_fastdata.store.reader.LmdbImageDataset`, which keeps ``decode``, ``decode_hwc`` and
    ``max_pixels`` as its own API and hands the work here. It holds nothing per sample but one byte a sample in the
    process that decodes (:meth:`decode_hwc`'s record of walked JPEGs), never pickled.

    Args:
        max_pixels: the most pixels an image may have; ``None``: no limit (on scans or decode cost either).
        length: the split's records.
        where: names sample ``index`` in errors (the dataset's ``_where``).

    """

    def __init__(self, max_pixels: int | None, length: int, where: Callable[[int], str]) -> None:
        self.max_pixels = max_pixels
        self.length = length
        self.where = where
        # the samples whose JPEG markers passed :meth:`_check_jpeg` in this process: a byte a sample, made on first use.
        # The walk holds the GIL (a few us a JPEG, what bounds the threads engine on many cores), and a record of an
        # open database never changes (its identity is checked at every open), so each is walked once, not each epoch
        self._jpeg_checked: bytearray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_jpeg_checked"] = None  # each process walks its samples once itself: never a copy of a byte a sample
        return state

    def check_pixels(self, index: int, height: int, width: int) -> None:
        """Refuse an image of more than :attr:`max_pixels` pixels, before anything is allocated for it."""
        if self.max_pixels is not None and height * width > self.max_pixels:
            raise CorruptRecordError(
                f"{self.where(index)}: the image is {height}x{width} ({height * width:,} pixels), over `max_pixels`"
                f" ({self.max_pixels:,}). {_RAISE_HINT}"
            )

    def _check_cost(self, index: int, what: str, height: int, width: int, cost: int, buffer: int = 0) -> None:
        """Refuse an image whose decode takes more than ``DECODE_BUDGET`` bytes a pixel of ``max_pixels``, undecoded.

        ``cost``: the bytes a pixel of the image that its decode takes; ``buffer``: the bytes of the buffer it is
        decoded through beside (a multi-scan JPEG's coefficients, :meth:`.jpeg.JpegFrame.buffer_bytes`); ``what``:
        its kind and how it is decoded.
        """
        pixels = height * width
        total = pixels * cost + buffer
        if self.max_pixels is None or total <= DECODE_BUDGET * self.max_pixels:
            return
        takes = f"{cost} bytes a pixel ({total / 2**20:.0f} MiB)"
        if buffer:
            takes = (
                f"{total / pixels:.3g} bytes a pixel ({total / 2**20:.0f} MiB: {cost} a pixel for the image and"
                f" {buffer / 2**20:.0f} MiB for the buffer of its DCT coefficients that a multi-scan JPEG is decoded"
                " through)"
            )
        raise CorruptRecordError(
            f"{self.where(index)}: the image is a {height}x{width} {what} ({pixels:,} pixels), whose decode takes"
            f" {takes}, over the {DECODE_BUDGET * self.max_pixels / 2**20:.0f} MiB that `max_pixels`"
            f" ({self.max_pixels:,}) allows an image ({DECODE_BUDGET} bytes a pixel). {_RAISE_HINT}"
        )

    def check_frame(self, index: int, header: RecordHeader, data: Encoded) -> JpegFrame | None:
        """Check a JPEG or PNG record's own frame header (SOF, IHDR) before anything decodes it; no pixels are touched.

        A decoder sizes its output by the frame header, not the record's: a record header within ``max_pixels`` may
        carry a frame header that asks for far more (a decompression bomb). It must give the record's size exactly.
        A JPEG's markers are checked too (:meth:`_check_jpeg`): its scans, and what its decode to RGB takes.

        Returns:
            A JPEG's frame as its markers give it (``None`` for a PNG, or with ``max_pixels`` ``None``).

        Raises:
            CorruptRecordError: the frame header does not parse, is over ``max_pixels``, or differs from the record
                header's size, or a JPEG's scans or decode are over their limits; the message names the split and
                index.

        """
        kind = _PIL_FORMATS[header.encoding]
        try:
            if header.encoding == ENCODING_JPEG:
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            else:
                height, width = _png_size(data)
        except ValueError as err:
            raise CorruptRecordError(f"{self.where(index)}: the image does not decode: {err}") from err
        self.check_pixels(index, height, width)
        if (height, width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self.where(index)}: the {kind} frame header's size {(height, width)} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return self._check_jpeg(index, header, data) if header.encoding == ENCODING_JPEG else None

    def _check_jpeg(self, index: int, header: RecordHeader, data: Encoded) -> JpegFrame | None:
        """Check a JPEG's markers before its decode (:func:`.jpeg.jpeg_frame`: a few us, no pixel decoded, no copy).

        Its frame header gives the record's size, within ``max_pixels``; it has at most :data:`.jpeg.MAX_JPEG_SCANS`
        scans; and its decode to RGB (3 bytes a pixel, 7 for a CMYK or YCCK JPEG, plus the coefficient buffer of a
        progressive or other multi-scan frame) fits :data:`DECODE_BUDGET`. Nothing is checked with ``max_pixels``
        ``None``.

        Returns:
            The frame, or ``None`` where its markers give none (nothing decodes: the decoder says why) or nothing is
            checked.

        Raises:
            CorruptRecordError: the frame is over one of these limits or unlike the record's size, naming the split and
                index.

        """
        if self.max_pixels is None:
            return None
        frame = jpeg_frame(data)
        if frame is None:
            return None
        self.check_pixels(index, frame.height, frame.width)
        if (frame.height, frame.width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self.where(index)}: the JPEG frame header's size {(frame.height, frame.width)} differs from the"
                f" stored {(header.height, header.width)}"
            )
        kind = "progressive JPEG" if frame.progressive else "multi-scan JPEG" if frame.buffered else "JPEG"
        if frame.scans > MAX_JPEG_SCANS:
            counted = f"{frame.scans:,}" if frame.scans < _SCANS_COUNTED else f"more than {_SCANS_COUNTED - 1:,}"
            raise CorruptRecordError(
                f"{self.where(index)}: the {kind} has {counted} scans, over the {MAX_JPEG_SCANS} a JPEG may have"
                " (each scan is a pass of the decoder over the whole image; encoders write about 10). If you trust"
                " this database, pass `max_pixels=None`, which lifts this limit too."
            )
        if len(frame.sampling) == 4:  # CMYK or YCCK: libjpeg-turbo decodes it to CMYK, then converts it to RGB
            kind = kind.replace("JPEG", "CMYK JPEG")
        cost = _CMYK_COST if len(frame.sampling) == 4 else 3
        self._check_cost(index, kind, frame.height, frame.width, cost, frame.buffer_bytes())
        return frame

    def decode_hwc(
        self, index: int, header: RecordHeader, data: Encoded, buffer: np.ndarray | None = None, fast: bool = False
    ) -> np.ndarray:
        """Decode a record into a ``uint8`` RGB HWC NumPy array (the batch path's form; no tensor, no copy).

        JPEGs decode with libjpeg-turbo (``simplejpeg``; the GIL is released), into ``buffer`` when given (at least
        ``height * width * 3`` bytes); ``fast`` uses its fast DCT and upsampling (see ``fast_decode``). PNGs decode
        with OpenCV (libpng) straight to 8-bit RGB, into a new array (:func:`_read_png`: 16-bit samples keep their
        high byte, where PIL's conversion of a 16-bit greyscale image clips them). Raw records are a view of ``data``.
        Each takes 3 bytes a pixel, but for a CMYK JPEG (7: refused over :data:`DECODE_BUDGET`).

        A JPEG decodes into exactly the ``height * width * 3`` bytes its record header declares (checked against
        ``max_pixels`` when the record was read), once a walk over its markers (:meth:`_check_jpeg`, a few us, once a
        sample per process) has found its frame header of that size, its scans within :data:`.jpeg.MAX_JPEG_SCANS`
        and its decode within :data:`DECODE_BUDGET`; libjpeg-turbo, which reads the JPEG's own frame header first,
        would refuse a larger image too before it decodes a pixel. :meth:`check_frame` explains a failure.

        Raises:
            CorruptRecordError: the bytes do not decode to the stored size, their frame header is over
                ``max_pixels``, a JPEG has more than :data:`.jpeg.MAX_JPEG_SCANS` scans, or their decode would take
                more than :data:`DECODE_BUDGET`; the message names the split and index.

        """
        if header.encoding == ENCODING_RAW:
            return self._raw_image(index, header, data)
        if header.encoding != ENCODING_JPEG:
            return self._png_image(index, header, data)
        checked = self._jpeg_checked
        if checked is None:
            checked = self._jpeg_checked = bytearray(self.length)
        if not checked[index]:
            self._check_jpeg(index, header, data)
            checked[index] = self.max_pixels is not None  # with no limit nothing was checked: check once one is set
        nbytes = header.height * header.width * 3
        out = np.empty(nbytes, dtype=np.uint8) if buffer is None else buffer[:nbytes]
        try:
            image = simplejpeg.decode_jpeg(data, "RGB", fastdct=fast, fastupsample=fast, buffer=out)
        except (RuntimeError, OSError, ValueError) as err:
            self.check_frame(index, header, data)  # a frame header over `max_pixels` or unlike the record's says so
            raise CorruptRecordError(f"{self.where(index)}: the image does not decode: {err}") from err
        if image.shape[:2] != (header.height, header.width):
            self.check_frame(index, header, data)
            raise CorruptRecordError(
                f"{self.where(index)}: decoded size {image.shape[:2]} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def _png_image(self, index: int, header: RecordHeader, data: Encoded) -> np.ndarray:
        self.check_frame(index, header, data)
        image = _read_png(data, header.height * header.width)
        if image is None:
            raise CorruptRecordError(f"{self.where(index)}: the image does not decode (libpng refused the PNG)")
        if image.shape != (header.height, header.width, 3):  # the frame header agreed: never, but never trusted
            raise CorruptRecordError(
                f"{self.where(index)}: decoded size {image.shape[:2]} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def pil_image(self, index: int, header: RecordHeader, data: Encoded) -> Image.Image:
        """Decode a record into an RGB PIL image (``output="pil"``), its frame and its mode's cost checked first.

        Raises:
            CorruptRecordError: as :meth:`decode_hwc`, with PIL's cost of the image's mode (:func:`_pil_cost`).

        """
        if header.encoding == ENCODING_RAW:
            return Image.fromarray(self._raw_image(index, header, data))
        frame = self.check_frame(index, header, data)
        failures = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
        try:
            image = Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[header.encoding]])
        except failures as err:
            raise CorruptRecordError(f"{self.where(index)}: the image does not decode: {err}") from err
        # its mode is known once its header is read, before its pixels are: what decoding and converting it takes
        kind = "progressive JPEG" if frame is not None and frame.progressive else _PIL_FORMATS[header.encoding]
        what = f"{image.mode} {kind} read as a PIL image"
        buffer = frame.buffer_bytes() if frame is not None else 0  # libjpeg's, as for a tensor
        self._check_cost(index, what, header.height, header.width, _pil_cost(image.mode), buffer)
        try:
            image.load()
            if image.mode != "RGB":  # an RGB image is not copied again (PIL holds 4 bytes a pixel)
                image = image.convert("RGB")
        except failures as err:
            raise CorruptRecordError(f"{self.where(index)}: the image does not decode: {err}") from err
        if (image.height, image.width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self.where(index)}: decoded size {(image.height, image.width)} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def _raw_image(self, index: int, header: RecordHeader, data: Encoded) -> np.ndarray:
        expected = header.height * header.width * 3
        if len(data) != expected or expected == 0:
            raise CorruptRecordError(
                f"{self.where(index)}: a raw {header.height}x{header.width} RGB record needs {expected} bytes,"
                f" found {len(data)}"
            )
        return np.frombuffer(data, dtype=np.uint8).reshape(header.height, header.width, 3)
