"""Old module paths kept as thin shims: each name resolves to its new home, with one ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old: str, homes: tuple[str, ...]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for the shim ``old``: finds a name in the first of ``homes`` holding it.

    ``homes`` go in import order, each before the modules that import from it, so the first holding a name defines it.

    Each lookup warns once, in one line, naming where to import the name from now: ``lightning_fastdata`` for the
    public API, else the module that defines it. Dunder names (``__all__``, ``__path__``, ...) are never forwarded,
    so ``import *`` and introspection see an empty module.
    """

    def __getattr__(name: str) -> Any:
        if not (name.startswith("__") and name.endswith("__")):
            for home in homes:
                module = importlib.import_module(home)
                if name in vars(module):
                    value = getattr(module, name)
                    public = name in importlib.import_module("lightning_fastdata").__all__
                    where = "lightning_fastdata" if public else home
                    warnings.warn(
                        f"`{old}` is deprecated: import `{name}` from `{where}` instead.",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    return value
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
