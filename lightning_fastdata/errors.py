"""Exceptions raised by lightning_fastdata; each message says what was found and how to fix it."""

from __future__ import annotations


class FastDataError(Exception):
    """Base class of every error this package raises on purpose."""


class DatasetFormatError(FastDataError, ValueError):
    """A path is not a complete lightning_fastdata database of a version this package reads."""


class CorruptRecordError(FastDataError, ValueError):
    """A stored record is damaged: bad header, failed checksum, or bytes that do not decode."""


class SourceLayoutError(FastDataError, ValueError):
    """A conversion source is missing, empty, or not laid out as an image folder."""


class InvalidArgumentError(FastDataError, ValueError):
    """An argument is out of its range or not one of its choices (``FastImageDataModule(image_size=0)``)."""


class MissingSplitError(FastDataError, ValueError):
    """The data has no split a stage reads (``train`` to fit, ``test`` to test, the named ``predict_split``)."""


class ConversionError(FastDataError, RuntimeError):
    """A conversion could not finish (a skipped file under ``strict``, disk full, ...); nothing was published."""


class SampleError(FastDataError, RuntimeError):
    """A sample could not be produced (its transform raised); the message names the split, index and cause."""


class DestinationError(ConversionError, ValueError):
    """A conversion's destination cannot be used.

    It holds data this package will not replace (another source's database needs force), a file stands where a
    folder must go, or its folder is read-only.
    """


class ReadOnlyDestinationError(DestinationError):
    """The folder a conversion would write into is read-only (``FastImageDataModule`` names its ``cache_dir``).

    ``folder`` is the read-only folder itself: the destination's folder, or, where that does not exist yet, the
    nearest of its parents that does (``/ro`` for a ``dst`` of ``/ro/new/db.lmdb``); ``None`` where not known.
    ``reason`` is the system's word for it (``Read-only file system``), when there is one.
    """

    folder: str | None = None
    reason: str | None = None


class RemoteStorageError(FastDataError, RuntimeError):
    """A database at a URL cannot be staged or published.

    A missing backend, bucket, object or completion marker, missing credentials, or a network failure. The message
    names the URL and what to set; nothing half-copied is ever used as a database.
    """
