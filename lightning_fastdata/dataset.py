"""Deprecated: ``LmdbImageDataset`` and ``collate_labels`` live in :mod:`lightning_fastdata.store.reader`."""

from lightning_fastdata._deprecated import moved

__getattr__ = moved(__name__, ("lightning_fastdata.store.reader",))
