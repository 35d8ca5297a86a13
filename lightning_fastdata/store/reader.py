"""The reader of a database: :class:`LmdbImageDataset` (lazy, fork- and spawn-safe) and :func:`collate_labels`.

It mirrors the writer (:mod:`lightning_fastdata.store.writer`); both follow :mod:`lightning_fastdata.store.format`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import lmdb
import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate

from lightning_fastdata._cv import cv2
from lightning_fastdata._files import anonymous_file, path_of
from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError, FastDataError, SampleError
from lightning_fastdata.store.environments import open_readonly, read_meta, read_transaction
from lightning_fastdata.store.format import (
    DATA_FILE,
    ENCODING_JPEG,
    ENCODING_PNG,
    ENCODING_RAW,
    RecordHeader,
    labels_key,
    record_key,
    unpack_record,
)
from lightning_fastdata.store.jpeg import _SCANS_COUNTED, MAX_JPEG_SCANS, JpegFrame, jpeg_frame
from lightning_fastdata.store.targets import NO_LABEL, SplitTargets, TargetSpec, first_bad_label

Output = Literal["tensor", "pil", "encoded"]

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
_RAISE_HINT = (
    "If you trust this database, raise `max_pixels` (LmdbImageDataset or FastImageDataModule, `--data.max_pixels` on"
    " the command line), or pass None for no limit."
)


def _png_size(data: bytearray | memoryview) -> tuple[int, int]:
    """``(height, width)`` from a PNG's IHDR chunk, which the format puts first."""
    if len(data) < 24 or bytes(data[:8]) != _PNG_SIGNATURE or bytes(data[12:16]) != b"IHDR":
        raise ValueError("not a PNG (no PNG signature and IHDR chunk)")
    width, height = struct.unpack_from(">II", data, 16)
    return height, width


def _read_png(data: bytearray | memoryview, pixels: int) -> np.ndarray | None:
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


def collate_labels(labels: list[Any]) -> Any:
    """A batch's labels: one ``int64`` tensor for class indices (no per-label tensor), else ``default_collate``."""
    if all(type(label) is int for label in labels):
        return torch.tensor(labels, dtype=torch.int64)
    return default_collate(labels)


class LmdbImageDataset(Dataset):
    """Images and labels of one split of a database made by ``lightning-fastdata convert``.

    A drop-in for torchvision's ``ImageFolder``: it has ``classes``, ``class_to_idx`` and ``targets`` and returns
    ``(image, target)``. The target is what the database stores (:attr:`target_spec`, see
    :mod:`~lightning_fastdata.store.targets`): a class index (``int``), a multi-hot ``float32`` tensor ``[C]``
    (``multilabel``), a ``float32`` tensor ``[K]`` (``float``; a 0-d one when K = 1), or ``-1`` (``none``).
    Nothing is loaded in ``__init__`` beyond the metadata; the LMDB environment opens lazily in
    the process that reads (a DataLoader worker, under fork or spawn) and is never pickled. Memory does not grow
    with the number of samples: keys are computed from the index.

    Args:
        path: the database directory.
        split: which split to read (``"train"``, ``"val"``, ...).
        transform: applied to the image (a ``uint8`` CHW tensor, or a PIL image with ``output="pil"``: classic PIL
            transforms such as ``Compose([RandomResizedCrop(224), ToTensor(), Normalize(...)])`` need ``"pil"``).
        target_transform: applied to the target.
        output: ``"tensor"`` decodes (libjpeg-turbo through ``simplejpeg``) to a ``uint8`` RGB tensor of shape
            ``(3, H, W)`` (a view of HWC memory);
            ``"pil"`` gives an RGB PIL image for PIL transforms; ``"encoded"`` gives the stored bytes as a 1-D
            ``uint8`` tensor, for decoding later (e.g. on the GPU).
        verify_checksums: check each record's CRC32 before decoding (a few microseconds per image).
        fast_decode: decode JPEGs with libjpeg-turbo's fast DCT and chroma upsampling, as the batch path of
            :class:`~lightning_fastdata.FastImageDataModule` does (its ``build_dataset`` sets it, so a transform of
            one's own sees the same pixels as the built-in path): about 14% less time, and about a grey level darker on
            average than the accurate decode of PIL and torchvision, which ``False`` (the default) matches.
        max_pixels: the most pixels an image may have (default 48 MiP: 50,331,648, 8192 x 6144, 144 MiB decoded).
            Checked against the record header when a record is read and against the image's own frame header (JPEG
            SOF, PNG IHDR) before it is decoded; a larger image is a :class:`~lightning_fastdata.CorruptRecordError`
            naming it (skipped under ``on_bad_sample="skip"``), so a database you did not make cannot have a reader
            decode a decompression bomb. Nor may a decode take more than :data:`DECODE_BUDGET` (5) bytes a pixel of
            it (240 MiB by default): a CMYK JPEG (7 bytes a pixel), a progressive JPEG (3 and its buffer of DCT
            coefficients: 9 for 4:4:4 colour, 6 for 4:2:0, 5 for grey), or an RGBA, 16-bit or CMYK image read as a
            PIL image (6 to 8), is refused above the pixels that fit; nor may a JPEG have more than
            :data:`.jpeg.MAX_JPEG_SCANS` (100) scans, each a pass of the decoder over the image. Raise it for trusted
            databases of larger images; ``None``: no limit (on scans either).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DatasetFormatError: ``path`` is not a complete database of a version this package reads.
        ValueError: ``split`` is not in the database, ``output`` is unknown, or ``max_pixels`` is below 1.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from lightning_fastdata import LmdbImageDataset
        >>> train = LmdbImageDataset("data/imagenette.lmdb", split="train")
        >>> image, label = train[0]  # uint8 tensor (3, H, W), int
        >>> loader = DataLoader(train, batch_size=64, num_workers=4)

    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        split: str = "train",
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        output: Output = "tensor",
        verify_checksums: bool = True,
        fast_decode: bool = False,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        if output not in ("tensor", "pil", "encoded"):
            raise ValueError(f"`output` must be 'tensor', 'pil' or 'encoded', got {output!r}.")
        if max_pixels is not None and max_pixels < 1:
            raise ValueError(f"`max_pixels` must be >= 1 or None (no limit), got {max_pixels}.")
        meta = read_meta(path)
        splits = meta["splits"]
        if split not in splits:
            raise ValueError(f"`split` {split!r} is not in {os.fspath(path)!r}; it holds {sorted(splits)}.")
        self.path = str(Path(path).expanduser().absolute())
        self.split = split
        self.transform = transform
        self.target_transform = target_transform
        self.output = output
        self.verify_checksums = verify_checksums
        self.fast_decode = fast_decode
        self.max_pixels = max_pixels
        self.classes: list[str] = list(meta["classes"])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.class_counts: list[int] = list(splits[split]["class_counts"])
        #: what each sample's target is (:mod:`~lightning_fastdata.store.targets`)
        self.target_spec = TargetSpec.from_meta(meta, self.path)
        crc = splits[split].get("targets_crc32")
        self._targets = SplitTargets(
            self.target_spec, split, int(splits[split]["length"]), crc if type(crc) is int else None, self.path
        )
        if self.target_spec.kind in ("multilabel", "float"):  # sizes, before a batch's memory is sized by C or K
            with read_transaction(open_readonly(self.path), buffers=True) as txn:
                self._targets.check_sizes(txn)
        self.splits: list[str] = sorted(splits)
        self.encoding: dict[str, Any] = dict(meta.get("encoding", {}))
        self._length = int(splits[split]["length"])
        self._env: lmdb.Environment | None = None
        self._pid: int | None = None
        self._file_size = 0
        self._identity: tuple[int, ...] = ()
        # the samples whose JPEG markers passed :meth:`_check_jpeg` in this process: a byte a sample, made on first use.
        # The walk holds the GIL (a few us a JPEG, what bounds the threads engine on many cores), and a record of an
        # open database never changes (its identity is checked at every open), so each is walked once, not each epoch
        self._jpeg_checked: bytearray | None = None

    def __len__(self) -> int:
        return self._length

    def _environment(self) -> lmdb.Environment:
        """The LMDB environment of this process, opened on first use (and again after a fork)."""
        if self._env is None or self._pid != os.getpid():
            self._env = open_readonly(self.path)
            st = os.stat(os.path.join(self.path, DATA_FILE))
            self._file_size = st.st_size
            self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            self._pid = os.getpid()
        return self._env

    def _read_failed(self, what: str, err: lmdb.Error) -> FastDataError:
        """The error for LMDB's ``err`` while ``what``: damage, unless the database was replaced since it was opened.

        Once the database at :attr:`path` is replaced, the next open of that path in this process closes the old
        environment (:func:`~lightning_fastdata.store.environments.open_readonly`); reading through it then fails here.
        """
        try:
            st = os.stat(os.path.join(self.path, DATA_FILE))
            replaced = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._identity
        except OSError:
            replaced = True
        if replaced:
            return DatasetFormatError(
                f"{what} failed: the database was replaced or deleted after this dataset opened it (by `convert"
                " --force`, say), and the records it indexed are gone. Create the dataset again (or the DataModule)."
            )
        return CorruptRecordError(f"{what} failed: {err}")

    def _where(self, index: int) -> str:
        return f"split {self.split!r} index {index} of {self.path!r}"

    def read_record(self, index: int) -> tuple[RecordHeader, bytearray]:
        """The header and the encoded image bytes of sample ``index``, checksum verified.

        Raises:
            IndexError: ``index`` is out of range.
            CorruptRecordError: the record is missing or damaged, its header declares more than ``max_pixels``, or
                its target is damaged (a class label outside the classes, a float value that is not finite); the
                message names the split and index.

        """
        with self.records() as read:
            header, payload = read(index)
            return header, bytearray(payload)  # one copy out of the memory map, writable for torch.frombuffer

    @contextmanager
    def records(self) -> Iterator[Callable[[int], tuple[RecordHeader, memoryview]]]:
        """Many records in one read transaction (the batch path's way): yields ``read(index) -> (header, payload)``.

        ``payload`` is a view into the database's memory map, valid until the ``with`` block ends: decode it there, or
        copy it. ``read`` raises as :meth:`read_record` does, and ``RuntimeError`` in a process forked inside the
        block (the transaction belongs to the parent: read in the child with ``records()`` of its own).
        """
        with contextlib.ExitStack() as stack:
            try:
                txn = stack.enter_context(read_transaction(self._environment(), buffers=True))
            except lmdb.Error as err:
                raise self._read_failed(f"reading {self.path!r}", err) from err
            yield functools.partial(self._read, txn, os.getpid())

    def _read(self, txn: lmdb.Transaction, opened_in: int, index: int) -> tuple[RecordHeader, memoryview]:
        length = self._length
        if not -length <= index < length:
            raise IndexError(f"index {index} is out of range for split {self.split!r} of length {length}")
        index %= length
        try:
            record = txn.get(record_key(self.split, index))
            if record is None:
                raise CorruptRecordError("the record is missing")
            if len(record) > self._file_size:  # a damaged length: touching it would read past the file's end
                raise CorruptRecordError(f"the record claims {len(record)} bytes, more than the whole file")
            header, payload = unpack_record(record, verify=self.verify_checksums)
        except (CorruptRecordError, lmdb.Error) as err:
            if os.getpid() != opened_in:  # not damage: the parent's transaction, closed in this child at the fork
                raise RuntimeError(
                    f"{self._where(index)}: this read transaction was opened in process {opened_in}, before this"
                    f" process ({os.getpid()}) was forked from it, and a transaction does not cross a fork. Fork"
                    " outside `records()` / `read_transaction`, and read in the child through a transaction of its"
                    " own (`records()` or `read_record` called after the fork)."
                ) from err
            raise CorruptRecordError(
                f"{self._where(index)}: {err}. The database is damaged: convert the source again with"
                " `lightning-fastdata convert --force`."
            ) from err
        kind = self.target_spec.kind
        if kind == "class" and not 0 <= header.label < len(self.classes):
            raise self._bad_label(index, header.label)
        if kind == "float":  # its values, checked with the arrays' checksum once: a dictionary look-up a record
            try:
                self._targets.check_records(txn, self._identity, index)
            except lmdb.Error as err:
                raise self._read_failed(f"reading the targets of {self._where(index)}", err) from err
        self._check_pixels(index, header.height, header.width)
        return header, payload

    def _bad_label(self, index: int, label: int) -> CorruptRecordError:
        """The error for sample ``index``'s class ``label`` outside the classes (its header's or the label array's)."""
        return CorruptRecordError(
            f"{self._where(index)}: label {label} is outside the {len(self.classes)} classes. The database is damaged:"
            " convert the source again with `lightning-fastdata convert --force`."
        )

    def _check_pixels(self, index: int, height: int, width: int) -> None:
        """Refuse an image of more than :attr:`max_pixels` pixels, before anything is allocated for it."""
        if self.max_pixels is not None and height * width > self.max_pixels:
            raise CorruptRecordError(
                f"{self._where(index)}: the image is {height}x{width} ({height * width:,} pixels), over `max_pixels`"
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
            f"{self._where(index)}: the image is a {height}x{width} {what} ({pixels:,} pixels), whose decode takes"
            f" {takes}, over the {DECODE_BUDGET * self.max_pixels / 2**20:.0f} MiB that `max_pixels`"
            f" ({self.max_pixels:,}) allows an image ({DECODE_BUDGET} bytes a pixel). {_RAISE_HINT}"
        )

    def _check_frame(self, index: int, header: RecordHeader, data: bytearray | memoryview) -> JpegFrame | None:
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
            raise CorruptRecordError(f"{self._where(index)}: the image does not decode: {err}") from err
        self._check_pixels(index, height, width)
        if (height, width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self._where(index)}: the {kind} frame header's size {(height, width)} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return self._check_jpeg(index, header, data) if header.encoding == ENCODING_JPEG else None

    def _check_jpeg(self, index: int, header: RecordHeader, data: bytearray | memoryview) -> JpegFrame | None:
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
        self._check_pixels(index, frame.height, frame.width)
        if (frame.height, frame.width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self._where(index)}: the JPEG frame header's size {(frame.height, frame.width)} differs from the"
                f" stored {(header.height, header.width)}"
            )
        kind = "progressive JPEG" if frame.progressive else "multi-scan JPEG" if frame.buffered else "JPEG"
        if frame.scans > MAX_JPEG_SCANS:
            counted = f"{frame.scans:,}" if frame.scans < _SCANS_COUNTED else f"more than {_SCANS_COUNTED - 1:,}"
            raise CorruptRecordError(
                f"{self._where(index)}: the {kind} has {counted} scans, over the {MAX_JPEG_SCANS} a JPEG may have"
                " (each scan is a pass of the decoder over the whole image; encoders write about 10). If you trust"
                " this database, pass `max_pixels=None`, which lifts this limit too."
            )
        if len(frame.sampling) == 4:  # CMYK or YCCK: libjpeg-turbo decodes it to CMYK, then converts it to RGB
            kind = kind.replace("JPEG", "CMYK JPEG")
        cost = _CMYK_COST if len(frame.sampling) == 4 else 3
        self._check_cost(index, kind, frame.height, frame.width, cost, frame.buffer_bytes())
        return frame

    def decode(self, index: int, header: RecordHeader, data: bytearray) -> Any:
        """Decode a record read by :meth:`read_record` into this dataset's ``output`` form (before ``transform``).

        Raises:
            CorruptRecordError: the bytes do not decode to the stored size; the message names the split and index.

        """
        if self.output == "encoded":
            return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if self.output == "pil":
            return self._pil_image(index, header, data)
        return torch.from_numpy(self.decode_hwc(index, header, data, fast=self.fast_decode)).permute(2, 0, 1)

    def decode_hwc(
        self,
        index: int,
        header: RecordHeader,
        data: bytearray | memoryview,
        buffer: np.ndarray | None = None,
        fast: bool = False,
    ) -> np.ndarray:
        """Decode a record into a ``uint8`` RGB HWC NumPy array (the batch path's form; no tensor, no copy).

        JPEGs decode with libjpeg-turbo (``simplejpeg``; the GIL is released), into ``buffer`` when given (at least
        ``height * width * 3`` bytes); ``fast`` uses its fast DCT and upsampling (see ``fast_decode``). PNGs decode
        with OpenCV (libpng) straight to 8-bit RGB, into a new array (:func:`_read_png`: 16-bit samples keep their
        high byte, where PIL's conversion of a 16-bit greyscale image clips them). Raw records are a view of ``data``.
        Each takes 3 bytes a pixel, but for a CMYK JPEG (7: refused over :data:`DECODE_BUDGET`).

        A JPEG decodes into exactly the ``height * width * 3`` bytes its record header declares (checked against
        ``max_pixels`` when the record was read), once a walk over its markers (:meth:`_check_jpeg`, a few us) has
        found its frame header of that size, its scans within :data:`.jpeg.MAX_JPEG_SCANS` and its decode within
        :data:`DECODE_BUDGET`; libjpeg-turbo, which reads the JPEG's own frame header first, would refuse a larger
        image too before it decodes a pixel. :meth:`_check_frame` explains a failure.

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
            checked = self._jpeg_checked = bytearray(self._length)
        if not checked[index]:
            self._check_jpeg(index, header, data)
            checked[index] = self.max_pixels is not None  # with no limit nothing was checked: check once one is set
        nbytes = header.height * header.width * 3
        out = np.empty(nbytes, dtype=np.uint8) if buffer is None else buffer[:nbytes]
        try:
            image = simplejpeg.decode_jpeg(data, "RGB", fastdct=fast, fastupsample=fast, buffer=out)
        except (RuntimeError, OSError, ValueError) as err:
            self._check_frame(index, header, data)  # a frame header over `max_pixels` or unlike the record's says so
            raise CorruptRecordError(f"{self._where(index)}: the image does not decode: {err}") from err
        if image.shape[:2] != (header.height, header.width):
            self._check_frame(index, header, data)
            raise CorruptRecordError(
                f"{self._where(index)}: decoded size {image.shape[:2]} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def _png_image(self, index: int, header: RecordHeader, data: bytearray | memoryview) -> np.ndarray:
        self._check_frame(index, header, data)
        image = _read_png(data, header.height * header.width)
        if image is None:
            raise CorruptRecordError(f"{self._where(index)}: the image does not decode (libpng refused the PNG)")
        if image.shape != (header.height, header.width, 3):  # the frame header agreed: never, but never trusted
            raise CorruptRecordError(
                f"{self._where(index)}: decoded size {image.shape[:2]} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def _pil_image(self, index: int, header: RecordHeader, data: bytearray | memoryview) -> Image.Image:
        if header.encoding == ENCODING_RAW:
            return Image.fromarray(self._raw_image(index, header, data))
        frame = self._check_frame(index, header, data)
        failures = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
        try:
            image = Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[header.encoding]])
        except failures as err:
            raise CorruptRecordError(f"{self._where(index)}: the image does not decode: {err}") from err
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
            raise CorruptRecordError(f"{self._where(index)}: the image does not decode: {err}") from err
        if (image.height, image.width) != (header.height, header.width):
            raise CorruptRecordError(
                f"{self._where(index)}: decoded size {(image.height, image.width)} differs from the stored"
                f" {(header.height, header.width)}"
            )
        return image

    def _raw_image(self, index: int, header: RecordHeader, data: bytearray | memoryview) -> np.ndarray:
        expected = header.height * header.width * 3
        if len(data) != expected or expected == 0:
            raise CorruptRecordError(
                f"{self._where(index)}: a raw {header.height}x{header.width} RGB record needs {expected} bytes,"
                f" found {len(data)}"
            )
        return np.frombuffer(data, dtype=np.uint8).reshape(header.height, header.width, 3)

    @property
    def target_kind(self) -> str:
        """``"class"``, ``"multilabel"``, ``"float"`` or ``"none"``: what :attr:`target_spec` says."""
        return self.target_spec.kind

    @property
    def num_classes(self) -> int:
        """Classes of a ``class`` or ``multilabel`` database (``C``), else 0."""
        return self.target_spec.num_classes

    def targets_of(self, records: Sequence[int] | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The targets of samples ``records`` as one array ``[n, *target_spec.shape]`` of ``target_spec.dtype``.

        Read from the split's typed arrays in one read transaction (a few bytes a sample; the arrays are checked once
        per process); into ``out`` when given. ``class`` targets come from the label array, ``none`` are ``-1``.

        Raises:
            CorruptRecordError: the target arrays are missing or damaged, or a sample's target is (a class label
                outside the classes, a float value that is not finite), naming the first such sample.

        """
        spec = self.target_spec
        records = np.asarray(records, dtype=np.int64)
        if records.size and (records.min() < 0 or records.max() >= self._length):
            raise IndexError(f"a record index is out of range for split {self.split!r} of length {self._length}")
        if out is None:
            out = np.empty((len(records), *spec.shape), dtype=spec.dtype)
        if spec.kind == "class":
            with self._label_array() as labels:
                out[...] = labels[records]
            bad = first_bad_label(out, len(self.classes))
            if bad is not None:
                raise self._bad_label(int(records[bad]), int(out[bad]))
            return out
        if spec.kind == "none":
            out[...] = NO_LABEL
            return out
        try:
            with read_transaction(self._environment(), buffers=True) as txn:
                self._targets.gather(txn, self._identity, records, out)
        except lmdb.Error as err:
            raise self._read_failed(f"reading the targets of split {self.split!r} of {self.path!r}", err) from err
        return out

    def target(self, index: int, header: RecordHeader) -> Any:
        """Sample ``index``'s target as ``__getitem__`` gives it (before ``target_transform``)."""
        kind = self.target_spec.kind
        if kind == "class":
            return header.label
        if kind == "none":
            return NO_LABEL
        return torch.from_numpy(self.targets_of([index % self._length]))[0]

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        header, data = self.read_record(index)
        image = self.decode(index, header, data)
        label: Any = self.target(index, header)
        if self.transform is not None:
            try:
                image = self.transform(image)
            except Exception as err:
                hint = ""
                if self.output == "tensor" and isinstance(err, TypeError) and "PIL" in str(err):
                    hint = (
                        " This transform expects a PIL image (classic torchvision transforms such as ToTensor), but"
                        " images are uint8 tensors by default: pass `output='pil'` to LmdbImageDataset."
                    )
                raise SampleError(
                    f"{self._where(index)}: the transform raised {type(err).__name__}: {err}.{hint}"
                ) from err
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    @property
    def targets(self) -> list[Any]:
        """The target of every sample, read from the database on each access (not kept in memory).

        Class indices (``class``), lists of class indices (``multilabel``), values (``float``: a list of K, or one
        when K = 1) or ``-1`` (``none``).

        Raises:
            CorruptRecordError: a class label is outside the classes, a float value is not finite, or the arrays are
                damaged; the message names the first such sample's split, index and value.

        """
        kind = self.target_spec.kind
        if kind == "none":
            return [NO_LABEL] * self._length
        if kind == "multilabel":
            try:
                with read_transaction(self._environment(), buffers=True) as txn:
                    return self._targets.class_lists(txn, self._identity)
            except lmdb.Error as err:
                raise self._read_failed(f"reading the targets of split {self.split!r} of {self.path!r}", err) from err
        if kind == "float":  # a value that is not finite is refused, naming its sample (`SplitTargets.check_records`)
            return self.targets_of(np.arange(self._length)).tolist()
        with self._label_array() as labels:
            bad = first_bad_label(labels, len(self.classes))  # as every other read of a label refuses it
            if bad is not None:
                raise self._bad_label(bad, int(labels[bad]))
            return labels.tolist()

    @contextmanager
    def _label_array(self) -> Iterator[np.ndarray]:
        """The ``int32`` label array of a ``class`` split, a view of the memory map valid in the ``with`` block."""
        try:
            with read_transaction(self._environment(), buffers=True) as txn:
                raw = txn.get(labels_key(self.split))
                if raw is None or len(raw) != 4 * self._length:
                    raise CorruptRecordError(
                        f"the label array of split {self.split!r} of {self.path!r} is missing or damaged"
                    )
                yield np.frombuffer(raw, dtype="<i4")
        except lmdb.Error as err:
            raise self._read_failed(f"reading the labels of split {self.split!r} of {self.path!r}", err) from err

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None  # an LMDB environment must never cross a process boundary
        state["_pid"] = None
        state["_jpeg_checked"] = None  # each process walks its samples once itself: never a copy of a byte a sample
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, split={self.split!r}, len={len(self)},"
            f" classes={len(self.classes)}, output={self.output!r})"
        )
