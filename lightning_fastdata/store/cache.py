"""Where lightning_fastdata keeps what it makes for you: the cache folder, and the database a source converts into.

``FastImageDataModule`` converts an image folder (or list file) once into ``<cache>/<name>-<digest>.lmdb``, the digest
keyed by the source's path and the conversion settings, so changing a setting converts into a new slot and switching
back finds the earlier conversion up to date. The same folder holds the ``num_workers="tune"`` picks, the records of
databases verified in read-only folders, and the CLI's cached ``--help`` texts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Where converted databases go by default: ``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache/lightning_fastdata``."""
    env = os.environ.get("LIGHTNING_FASTDATA_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_fastdata"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The absolute cache folder: ``cache_dir`` (``~`` expanded) when given, else :func:`default_cache_dir`."""
    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()).absolute()


def converted_path(source: Path, root: Path, short_side: int | None, quality: int, encoding: str) -> Path:
    """The database under ``root`` that the source ``source`` (an absolute path) converts into with these settings."""
    key = json.dumps([str(source), short_side, quality, encoding])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return root / f"{source.name}-{digest}.lmdb"
