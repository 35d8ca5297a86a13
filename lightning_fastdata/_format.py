"""Deprecated: the on-disk format lives in :mod:`lightning_fastdata.store.format` (cache folder: ``store.cache``)."""

from lightning_fastdata._deprecated import moved

__getattr__ = moved(__name__, ("lightning_fastdata.store.cache", "lightning_fastdata.store.format"))
