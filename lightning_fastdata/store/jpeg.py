"""The walk over a JPEG's markers that tells what its decode will cost, before anything decodes it.

:func:`jpeg_frame` reads a JPEG's frame header (its type, size and sampling factors) and counts its scans, as
libjpeg reads them, without decoding a pixel or copying the bytes: a few microseconds, a few milliseconds for a record
of thousands of scans. With it the reader (:class:`~lightning_fastdata.store.reader.LmdbImageDataset`, unless its
``max_pixels`` is ``None``) holds every JPEG record to its decode budget before decoding it: a database you did not
make may hold a valid JPEG whose decode takes half a minute (thousands of scans, each a pass of the decoder over the
whole image: :data:`MAX_JPEG_SCANS`) or memory well beyond its pixels' (a progressive frame decodes through a buffer
of all its coefficients, :meth:`JpegFrame.buffer_bytes`), which a bound on its pixels alone does not catch (issue 43).
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

#: the most scans a JPEG may have (unless the reader's ``max_pixels`` is ``None``). libjpeg decodes a progressive JPEG
#: scan by scan, each a pass over the 8x8 blocks of its components however few bytes it holds, so thousands of empty
#: scans take tens of seconds (issue 43; docs/benchmarks.md#jpeg-scan-limit-100-scans). Encoders write about 10
#: (libjpeg's progression: 10 for colour, 6 for grey, 60 at most, for 10 components); 100 keep a 48 MiP image under
#: about 1 s. libjpeg-turbo's own fuzzers stop at 500 scans (``TJPARAM_SCANLIMIT``), on images of at most 1 MP, whose
#: scans cost 1/48 of these.
MAX_JPEG_SCANS = 100
#: scans are counted up to this many (a message names the count): the walk over them stays a few ms
_SCANS_COUNTED = 1 << 16
#: a marker between segments (libjpeg skips other bytes there), and the marker that ends a scan's entropy-coded data, in
#: which a 0xFF byte is followed by 0x00 (a stuffed data byte), by 0xFF (fill) or is a restart marker (0xD0 to 0xD7)
_MARKER = re.compile(rb"\xff[^\x00\xff]")
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
#: markers without a length: TEM, the restart markers, SOI and EOI (0xD9)
_NO_LENGTH = frozenset((0x01, *range(0xD0, 0xDA)))
#: the frame headers (SOF0 to SOF15 but DHT 0xC4, JPG 0xC8 and DAC 0xCC), the progressive and the lossless ones
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE_SOF = frozenset((0xC2, 0xC6, 0xCA, 0xCE))
_LOSSLESS_SOF = frozenset((0xC3, 0xC7, 0xCB, 0xCF))


class JpegFrame(NamedTuple):
    """What a JPEG's markers say of its decode, read by :func:`jpeg_frame` before anything decodes it."""

    #: the frame header's marker: 0xC0 (baseline), 0xC2 (progressive), ...
    sof: int
    height: int
    width: int
    #: each component's sampling factors ``(horizontal, vertical)``
    sampling: tuple[tuple[int, int], ...]
    #: the scans (SOS markers) the decoder reads: 1 for a single-scan frame, whose walk stops at its scan
    scans: int
    #: whether libjpeg decodes it through a buffer of the whole image's coefficients: a progressive frame, or one whose
    #: first scan holds only some of its components (``has_multiple_scans`` in libjpeg's ``jdinput.c``)
    buffered: bool

    @property
    def progressive(self) -> bool:
        """Whether the frame is progressive (SOF2, SOF6, SOF10, SOF14)."""
        return self.sof in _PROGRESSIVE_SOF

    def buffer_bytes(self) -> int:
        """The bytes of the whole-image buffer libjpeg decodes a :attr:`buffered` frame through, else 0.

        As ``jdcoefct.c`` sizes it: per component, its blocks (rounded up to whole MCUs) of 64 coefficients of 2 bytes
        (``JBLOCK``), 6 bytes a pixel for a 4:4:4 colour image, 3 for 4:2:0; a lossless frame keeps 2 bytes a sample at
        most.
        """
        if not self.buffered or not self.sampling:
            return 0
        lossless = self.sof in _LOSSLESS_SOF
        side, unit = (1, 2) if lossless else (8, 128)
        h_max = max(max(h for h, _ in self.sampling), 1)
        v_max = max(max(v for _, v in self.sampling), 1)
        total = 0
        for h, v in self.sampling:
            h, v = max(h, 1), max(v, 1)  # a factor of 0 does not decode
            columns = -(-self.width * h // (h_max * side))
            rows = -(-self.height * v // (v_max * side))
            total += -(-columns // h) * h * -(-rows // v) * v * unit
        return total


def jpeg_frame(data: bytes | bytearray | memoryview, count_to: int = _SCANS_COUNTED) -> JpegFrame | None:
    """A JPEG's frame type, size, sampling factors and scans, from a walk over its markers: no pixel is decoded.

    The walk reads the markers as libjpeg does (bytes between segments are skipped to the next marker), from segment
    to segment by their lengths; a single-scan frame ends it at its scan. The scans of a multi-scan frame are counted:
    each scan's entropy-coded data is skipped in one search (C speed, no copy) to the marker that ends it, there being
    no other marker inside it. It stops after ``count_to`` scans, at the end of the image (EOI) or of the data.

    Returns:
        The frame, or ``None`` where no frame header and scan are found (nothing decodes: the decoder says why).

    """
    size = len(data)
    if size < 4 or data[0] != 0xFF or data[1] != 0xD8:  # libjpeg wants SOI first
        return None
    unpack = struct.unpack_from
    pos, frame, scans, buffered = 2, None, 0, False
    while pos + 4 <= size:
        if data[pos] == 0xFF and data[pos + 1] not in (0x00, 0xFF):
            marker = data[pos + 1]
        else:  # bytes before a marker (or fill): skipped, as libjpeg's `next_marker` does
            found = _MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
            marker = data[pos + 1]
        if marker in _NO_LENGTH:
            if marker == 0xD9:  # EOI
                break
            pos += 2
            continue
        if pos + 4 > size:  # a marker whose length is cut off: the data ends
            break
        (length,) = unpack(">H", data, pos + 2)
        body, pos = pos + 4, pos + 2 + max(length, 2)
        if marker == 0xDA:  # SOS
            if frame is None or body >= size:
                return None  # a scan before a frame header does not decode
            scans += 1
            if scans == 1:
                buffered = frame[0] in _PROGRESSIVE_SOF or data[body] < len(frame[3])
                if not buffered:  # libjpeg reads no second scan of a single-scan frame
                    break
            if scans >= count_to:
                break
            found = _SCAN_END.search(data, pos)
            if found is None:
                break
            pos = found.start()
        elif marker in _SOF and frame is None and body + 6 <= size:
            _, height, width, count = unpack(">BHHB", data, body)
            sampling = tuple((factors >> 4, factors & 15) for factors in data[body + 7 : body + 6 + 3 * count : 3])
            frame = (marker, height, width, sampling)
    if frame is None or scans == 0:
        return None
    return JpegFrame(*frame, scans, buffered)
