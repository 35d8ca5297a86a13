"""The reader of a database: :class:`LmdbImageDataset` (lazy, fork- and spawn-safe) and :func:`collate_labels`.

It mirrors the writer (:mod:`lightning_fastdata.store.writer`); both follow :mod:`lightning_fastdata.store.format`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import lmdb
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from lightning_fastdata._fast_path import inherits
from lightning_fastdata.errors import CorruptRecordError, DatasetFormatError, FastDataError, SampleError
from lightning_fastdata.store.decoding import DECODE_BUDGET, DEFAULT_MAX_PIXELS, RecordDecoder
from lightning_fastdata.store.environments import open_readonly, read_meta, read_transaction
from lightning_fastdata.store.format import DATA_FILE, RecordHeader, record_key, unpack_record
from lightning_fastdata.store.target_reader import TargetReader
from lightning_fastdata.store.targets import NO_LABEL, SplitTargets, TargetSpec

__all__ = ["DECODE_BUDGET", "DEFAULT_MAX_PIXELS", "LmdbImageDataset", "Output", "collate_labels"]

Output = Literal["tensor", "pil", "encoded"]


def collate_labels(labels: list[Any]) -> Any:
    """A batch's labels: one ``int64`` tensor for class indices (no per-label tensor), else ``default_collate``."""
    if all(type(label) is int for label in labels):
        return torch.tensor(labels, dtype=torch.int64)
    return default_collate(labels)


def _identity(path: str) -> tuple[int, ...]:
    """What tells the data file of the database at ``path`` from any other: device, inode, size (third), mtime."""
    st = os.stat(os.path.join(path, DATA_FILE))
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_failed(path: str, identity: tuple[int, ...], what: str, err: lmdb.Error) -> FastDataError:
    """The error for LMDB's ``err`` while ``what``: damage, unless the database was replaced since it was opened.

    ``identity``: its data file's when the dataset opened it (:func:`_identity`). Once the database at ``path`` is
    replaced, the next open of that path in this process closes the old environment
    (:func:`~lightning_fastdata.store.environments.open_readonly`); reading through it then fails here.
    """
    try:
        replaced = _identity(path) != identity
    except OSError:
        replaced = True
    if replaced:
        return DatasetFormatError(
            f"{what} failed: the database was replaced or deleted after this dataset opened it (by `convert"
            " --force`, say), and the records it indexed are gone. Create the dataset again (or the DataModule)."
        )
    return CorruptRecordError(f"{what} failed: {err}")


def _unreadable(where: str, opened_in: int, err: Exception) -> Exception:
    """The error for the record at ``where`` that did not read in a transaction opened in process ``opened_in``."""
    if os.getpid() != opened_in:  # not damage: the parent's transaction, closed in this child at the fork
        return RuntimeError(
            f"{where}: this read transaction was opened in process {opened_in}, before this"
            f" process ({os.getpid()}) was forked from it, and a transaction does not cross a fork. Fork"
            " outside `records()` / `read_transaction`, and read in the child through a transaction of its"
            " own (`records()` or `read_record` called after the fork)."
        )
    return CorruptRecordError(
        f"{where}: {err}. The database is damaged: convert the source again with `lightning-fastdata convert --force`."
    )


def _transform_failed(where: str, output: str, err: Exception) -> SampleError:
    """The error for a user's transform that raised ``err`` on the sample at ``where``, with a hint where one helps."""
    hint = ""
    if output == "tensor" and isinstance(err, TypeError) and "PIL" in str(err):
        hint = (
            " This transform expects a PIL image (classic torchvision transforms such as ToTensor), but"
            " images are uint8 tensors by default: pass `output='pil'` to LmdbImageDataset."
        )
    return SampleError(f"{where}: the transform raised {type(err).__name__}: {err}.{hint}")


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
        self.classes: list[str] = list(meta["classes"])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.class_counts: list[int] = list(splits[split]["class_counts"])
        #: what each sample's target is (:mod:`~lightning_fastdata.store.targets`)
        self.target_spec = TargetSpec.from_meta(meta, self.path)
        self._length = int(splits[split]["length"])
        crc = splits[split].get("targets_crc32")
        #: the split's typed target arrays, read by :attr:`_target_reader` and checked record by record in :meth:`_read`
        self._targets = SplitTargets(
            self.target_spec, split, self._length, crc if type(crc) is int else None, self.path
        )
        if self.target_spec.kind in ("multilabel", "float"):  # sizes, before a batch's memory is sized by C or K
            with read_transaction(open_readonly(self.path), buffers=True) as txn:
                self._targets.check_sizes(txn)
        self.splits: list[str] = sorted(splits)
        self.encoding: dict[str, Any] = dict(meta.get("encoding", {}))
        self._env: lmdb.Environment | None = None
        self._pid: int | None = None
        self._file_size = 0
        self._identity: tuple[int, ...] = ()
        #: checks records against `max_pixels` and decodes them (:mod:`~lightning_fastdata.store.decoding`)
        self._decoder = RecordDecoder(max_pixels, self._length, self._where)
        #: reads targets through this dataset's transactions (:mod:`~lightning_fastdata.store.target_reader`)
        self._target_reader = TargetReader(self._targets, len(self.classes), self._transaction, self._where)

    def __len__(self) -> int:
        return self._length

    @property
    def max_pixels(self) -> int | None:
        """The most pixels an image may have (``None``: no limit); the decoder's, which holds records to it."""
        return self._decoder.max_pixels

    @max_pixels.setter
    def max_pixels(self, value: int | None) -> None:
        self._decoder.max_pixels = value

    def _environment(self) -> lmdb.Environment:
        """The LMDB environment of this process, opened on first use (and again after a fork)."""
        if self._env is None or self._pid != os.getpid():
            self._env = open_readonly(self.path)
            self._identity = _identity(self.path)
            self._file_size = self._identity[2]
            self._pid = os.getpid()
        return self._env

    @contextmanager
    def _transaction(self, what: str) -> Iterator[tuple[lmdb.Transaction, tuple[int, ...]]]:
        """A read transaction of this process's environment and its data file's identity; errors name ``what``."""
        try:
            with read_transaction(self._environment(), buffers=True) as txn:
                yield txn, self._identity
        except lmdb.Error as err:
            raise _read_failed(self.path, self._identity, what, err) from err

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
                raise _read_failed(self.path, self._identity, f"reading {self.path!r}", err) from err
            # the decoder's check of a record header's pixels, bound once a transaction rather than looked up a record
            yield functools.partial(self._read, txn, os.getpid(), self._decoder.check_pixels)

    def _read(
        self, txn: lmdb.Transaction, opened_in: int, check_pixels: Callable[[int, int, int], None], index: int
    ) -> tuple[RecordHeader, memoryview]:
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
            raise _unreadable(self._where(index), opened_in, err) from err
        kind = self.target_spec.kind
        if kind == "class" and not 0 <= header.label < len(self.classes):
            raise self._target_reader.bad_label(index, header.label)
        if kind == "float":  # its values, checked with the arrays' checksum once: a dictionary look-up a record
            try:
                self._targets.check_records(txn, self._identity, index)
            except lmdb.Error as err:
                what = f"reading the targets of {self._where(index)}"
                raise _read_failed(self.path, self._identity, what, err) from err
        check_pixels(index, header.height, header.width)
        return header, payload

    def decode(self, index: int, header: RecordHeader, data: bytearray) -> Any:
        """Decode a record read by :meth:`read_record` into this dataset's ``output`` form (before ``transform``).

        Raises:
            CorruptRecordError: the bytes do not decode to the stored size; the message names the split and index.

        """
        if self.output == "encoded":
            return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if self.output == "pil":
            return self._decoder.pil_image(index, header, data)
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

        JPEGs into ``buffer`` when given (at least ``height * width * 3`` bytes), with libjpeg-turbo's fast DCT and
        upsampling if ``fast``; each record is checked against ``max_pixels`` and :data:`DECODE_BUDGET` first. See
        :meth:`RecordDecoder.decode_hwc <lightning_fastdata.store.decoding.RecordDecoder.decode_hwc>`.

        Raises:
            CorruptRecordError: the bytes do not decode to the stored size, or are over a limit, naming the sample.

        """
        return self._decoder.decode_hwc(index, header, data, buffer, fast)

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
        return self._target_reader.of(records, out)

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
                raise _transform_failed(self._where(index), self.output, err) from err
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def fast_path(self) -> Any:
        """What the fused batch path can do for this dataset: its transform's ``fused_crops()``, else ``None``.

        ``None`` (read sample by sample) for non-tensor output, a transform that states no fused crops, or a subclass
        that overrides ``__getitem__`` or ``decode`` (it reads its own way; override this to state otherwise).
        """
        if self.output != "tensor" or not inherits(self, LmdbImageDataset, "__getitem__", "decode"):
            return None
        fused_crops = getattr(self.transform, "fused_crops", None)
        return fused_crops() if callable(fused_crops) else None

    @property
    def targets(self) -> list[Any]:
        """The target of every sample, read from the database on each access (not kept in memory).

        Class indices (``class``), lists of class indices (``multilabel``), values (``float``: a list of K, or one
        when K = 1) or ``-1`` (``none``).

        Raises:
            CorruptRecordError: a class label is outside the classes, a float value is not finite, or the arrays are
                damaged; the message names the first such sample's split, index and value.

        """
        return self._target_reader.all()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None  # an LMDB environment must never cross a process boundary
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, split={self.split!r}, len={len(self)},"
            f" classes={len(self.classes)}, output={self.output!r})"
        )
