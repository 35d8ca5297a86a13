"""The one rule every fast path of the package follows, stated once."""

from __future__ import annotations

from typing import TypeGuard, TypeVar

_T = TypeVar("_T")


def inherits(obj: object, base: type[_T], *methods: str) -> TypeGuard[_T]:
    """Whether ``obj`` is a ``base`` whose class keeps ``base``'s own ``methods`` (overrides none of them).

    Each fast path stands in for some methods of one of the package's classes, and calls none of them:

    * the fused batch path (:class:`~lightning_fastdata.pipeline.kernel.BatchReader`) for a dataset's ``__getitem__``
      and ``decode`` and for a crop transform's ``__call__``;
    * the vectorized draw of :meth:`~lightning_fastdata.transforms.RandomResizedCropFlip.boxes` for ``box`` and
      ``flip``;
    * the keyed draw of :meth:`~lightning_fastdata.transforms.RandomResizedCropFlip.__call__` for ``box``.

    A subclass that overrides one of them does something of its own that the fast path would skip, so it takes the
    general path, which calls its methods.
    """
    cls = type(obj)
    return isinstance(obj, base) and all(getattr(cls, name) is getattr(base, name) for name in methods)
