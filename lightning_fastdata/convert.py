"""Deprecated: conversion lives in :mod:`lightning_fastdata.store` (``convert`` itself: ``store.conversion``).

``lightning_fastdata.convert`` is the function (the package imports this module first, then binds the function over
its name); this module only forwards the names it used to hold, each with a ``DeprecationWarning``.
"""

from lightning_fastdata._deprecated import moved

__getattr__ = moved(
    __name__,
    tuple(
        f"lightning_fastdata.store.{home}"
        for home in ("cache", "format", "summary", "sources", "encode", "hf", "writer", "conversion")
    ),
)
