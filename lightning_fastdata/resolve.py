"""Where a DataModule's data is: the database ``data_dir`` names, converted or staged once into the cache folder.

``data_dir`` is a database (here, or at a URL) or a source that converts into one under the cache folder
(:func:`database_path`). ``FastImageDataModule.prepare_data`` stages a URL's database once per node (:func:`stage`)
or converts a source once (:func:`convert_source`); ``setup`` finds the staged copy another rank made
(:func:`find_or_stage`) and checks what the database stores against the crops (:func:`check_store`). A read-only
cache folder is one error naming the setting that chose it (:func:`read_only_cache_error`).

Logged through Lightning's ``rank_zero_*``: the :mod:`~lightning_fastdata.store` modules themselves import neither
torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata.errors import (
    InvalidArgumentError,
    ReadOnlyDestinationError,
    RemoteStorageError,
    SourceLayoutError,
)
from lightning_fastdata.store import cache, remote
from lightning_fastdata.store import environments as _environments
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.conversion import convert
from lightning_fastdata.store.labels import LABEL_SEPARATOR
from lightning_fastdata.store.sources import folder_classes, source_plan
from lightning_fastdata.store.targets import TargetSpec

log = logging.getLogger(__name__)


def is_database(data_dir: str) -> bool:
    """Whether ``data_dir`` already is a converted database (then nothing is converted), here or at a URL."""
    return remote.is_url(data_dir) or (Path(data_dir).expanduser() / _format.DATA_FILE).is_file()


def shown(data_dir: str) -> str:
    """``data_dir`` as errors and logs show it: a URL without its user-info and query (a secret)."""
    return remote.redact_url(str(data_dir))


def store_short_side(short_side: int | None, image_size: int, crop_fraction: float) -> int | None:
    """The short side a conversion stores (``None``: original sizes): ``short_side``, or one fit for the crops."""
    if short_side is None:
        return max(256, math.ceil(image_size / crop_fraction))
    return short_side or None


def database_path(
    data_dir: str,
    root: Path,
    short_side: int | None,
    quality: int,
    encoding: str,
    targets: str | None = None,
    label_separator: str = LABEL_SEPARATOR,
) -> Path:
    """The database that is read: ``data_dir`` itself, or its conversion under the cache folder ``root``.

    ``short_side`` is the one the conversion stores (:func:`store_short_side`); a target kind other than classes
    converts into a database of its own (:func:`~lightning_fastdata.store.cache.converted_path`).
    """
    if remote.is_url(data_dir):
        return remote.staged_path(data_dir, root)
    source = Path(data_dir).expanduser().absolute()
    if is_database(data_dir):
        return source
    return cache.converted_path(source, root, short_side, quality, encoding, targets, label_separator)


def classes(
    data_dir: str,
    root: Path,
    database: Path,
    staged: bool,
    targets: str | None = None,
    label_separator: str = LABEL_SEPARATOR,
) -> list[str]:
    """Class names: from the database, or before conversion from the folder names or list file (no image is read).

    ``database`` is the one read (:func:`database_path`), ``staged`` whether this process staged or found the copy of
    a URL ``data_dir`` (else it is looked for under the cache folder ``root``: :func:`check_staged`). A list file's
    labels are read as its conversion reads them: as ``targets``, separated by ``label_separator``.
    """
    if remote.is_url(data_dir) and not staged:
        check_staged(data_dir, root)
    if is_database(data_dir) or (database / _format.DATA_FILE).is_file():
        return list(_environments.read_meta(database)["classes"])
    return folder_classes(Path(data_dir).expanduser(), targets, label_separator)


def target_spec(
    data_dir: str, database: Path, targets: str | None = None, label_separator: str = LABEL_SEPARATOR
) -> TargetSpec:
    """What each sample's target is (:mod:`~lightning_fastdata.store.targets`), from the database ``database``.

    Before conversion, what the conversion of ``data_dir`` (a folder, or a list file read as ``targets``) will store.
    """
    if is_database(data_dir) or (database / _format.DATA_FILE).is_file():
        return TargetSpec.from_meta(_environments.read_meta(database), database)
    plan = source_plan(Path(data_dir).expanduser(), targets, label_separator)
    spec = plan.targets
    if spec.kind in ("class", "multilabel"):
        return dataclasses.replace(spec, num_classes=len(plan.classes or []))
    return spec


def check_targets(meta: Mapping[str, Any], targets: str | None, path: Path) -> None:
    """Refuse a database whose target kind is not the ``targets`` asked for (``None``: any kind).

    Raises:
        InvalidArgumentError: the kinds differ; the message names both.

    """
    stored = TargetSpec.from_meta(dict(meta), path)
    if targets is not None and stored.kind != targets:
        raise InvalidArgumentError(
            f"`targets={targets!r}`, but {str(path)!r} holds {stored.describe()} targets. Pass"
            f" `targets={stored.kind!r}` (or leave it unset), or convert the source again with `--targets {targets}`."
        )


def check_staged(data_dir: str, root: Path) -> None:
    """Raise unless the URL ``data_dir`` has a staged copy under the cache folder ``root`` (its classes are read there).

    Raises:
        RemoteStorageError: it has none yet.

    """
    if remote.find_staged(data_dir, root) is None:
        raise RemoteStorageError(
            f"`data_dir` {shown(data_dir)!r} is not staged yet: its classes are read from the staged copy. Call"
            " `prepare_data()` first (the Trainer does, before `setup`)."
        )


def check_store_size(stored: int | None, image_size: int, crop_fraction: float, database: bool, data_dir: str) -> None:
    """Warn when the stored images are too small for ``image_size``: every crop would be upsampled.

    ``database``: whether ``data_dir`` is a database (then only a new conversion changes its images).
    """
    needed = math.ceil(image_size / crop_fraction)
    if stored is None or stored >= needed:
        return
    if database:  # its images are what they are: only a new conversion changes them
        fix = (
            f"Convert the source again with `lightning-fastdata convert SRC {shown(data_dir)} --short-side {needed}"
            " --force` (or 0 to keep original sizes), or pass the source folder as `data_dir`."
        )
    else:
        fix = f"Pass `short_side={needed}` (or leave it at None, which follows `image_size`; 0 keeps original sizes)."
    rank_zero_warn(
        f"The database stores images with a short side of at most {stored} px, but `image_size={image_size}`"
        f" with `crop_fraction={crop_fraction}` needs {needed} px: every crop is upsampled. {fix}"
    )


def check_store(
    meta: Mapping[str, Any],
    short_side: int | None,
    image_size: int,
    crop_fraction: float,
    database: bool,
    data_dir: str,
) -> None:
    """Warn about what an opened database stores: ``short_side`` ignored for a database, images too small for crops.

    Args:
        meta: the database's metadata.
        short_side: the DataModule's ``short_side`` argument.
        image_size: the crops' side.
        crop_fraction: the validation crop's share of the short side.
        database: whether ``data_dir`` is a database.
        data_dir: the DataModule's ``data_dir``.

    """
    if database and short_side is not None:
        rank_zero_warn(
            f"`short_side={short_side}` is ignored: `data_dir` {shown(data_dir)!r} is a database, whose images"
            f" were stored at a short side of {meta.get('encoding', {}).get('short_side') or 'their original size'}"
            " (`short_side` applies when a DataModule converts a folder)."
        )
    check_store_size(meta.get("encoding", {}).get("short_side"), image_size, crop_fraction, database, data_dir)


def stage(data_dir: str, cache_dir: str | None, root: Path) -> remote.StagedDatabase:
    """Copy the database at the URL ``data_dir`` into ``cache_dir`` once per node, or reuse the copy there.

    ``root`` is the cache folder ``cache_dir`` resolves to.
    """
    try:
        staged = remote.stage(data_dir, root)
    except ReadOnlyDestinationError as err:
        raise read_only_cache_error(err, data_dir, cache_dir, root) from err
    if staged.action != "reused":
        done = staged.reason or f"staged {shown(data_dir)}"
        rank_zero_info(f"FastImageDataModule: {done}; reading {staged.path}")
    return staged


def find_or_stage(data_dir: str, cache_dir: str | None, root: Path) -> remote.StagedDatabase:
    """The copy of the URL ``data_dir`` that the node's first rank staged, or, when none did, one staged here."""
    found = remote.find_staged(data_dir, root)
    if found is None:  # prepare_data did not run on this node (or ran elsewhere): stage it here
        return stage(data_dir, cache_dir, root)
    return remote.StagedDatabase(found, "found")


def convert_source(
    data_dir: str,
    cache_dir: str | None,
    root: Path,
    target: Path,
    settings: Mapping[str, Any],
    targets: str | None = None,
    label_separator: str = LABEL_SEPARATOR,
) -> None:
    """Convert the source ``data_dir`` into ``target`` under the cache folder ``root``, once (an up-to-date one stays).

    Logs why it converts again when the cache holds other conversions of the source, or the source changed.

    Args:
        data_dir: the source: an image folder, a root of split folders, or a list file.
        cache_dir: the DataModule's ``cache_dir`` (named by errors).
        root: the cache folder.
        target: the database it converts into (:func:`database_path`).
        settings: ``short_side``, ``quality`` and ``encoding``.
        targets: the target kind of a list file's labels (``convert(targets=)``); ``None``: inferred.
        label_separator: what separates a multi-label label's class names.

    """
    source = Path(data_dir).expanduser().absolute()
    if not source.exists():
        raise SourceLayoutError(
            f"`data_dir` {str(source)!r} does not exist. Pass an ImageFolder root (root/<class>/*.jpg), a root of"
            " train/ val/ test/ trees, a path,label list file, or a database made by `lightning-fastdata convert`."
        )
    if target == source or target.is_relative_to(source):
        raise InvalidArgumentError(f"`cache_dir` {cache_dir!r} must not be inside `data_dir` {data_dir!r}.")
    previous = cache.conversion_meta(target)
    note = cache.other_settings_note(source, target, settings)  # why a new conversion, when the cache has others
    if note is not None:
        rank_zero_info(note)
    if (note := cache.elsewhere_note(source, target, settings)) is not None:  # `convert SRC DST` made it already
        rank_zero_info(note)
    try:
        summary = convert(source, target, **settings, targets=targets, label_separator=label_separator)
    except ReadOnlyDestinationError as err:
        raise read_only_cache_error(err, data_dir, cache_dir, root) from err
    if previous is not None and not summary.up_to_date:
        rank_zero_info(cache.source_change_note(target, previous, summary.splits))
    if summary.up_to_date:  # the common case on every later run: nothing for the user's log
        log.debug(summary.format())
    else:
        rank_zero_info(summary.format())


def read_only_cache_error(
    err: ReadOnlyDestinationError, data_dir: str, cache_dir: str | None, root: Path
) -> ReadOnlyDestinationError:
    """The error naming the setting that chose the cache folder, and the folder that is read-only.

    The setting: ``cache_dir`` or ``$LIGHTNING_FASTDATA_CACHE``. The folder: the cache folder ``root``, or, when it
    does not exist yet, the parent it cannot be made in.
    """
    if cache_dir:
        setting = f"`cache_dir` {cache_dir!r}"
    elif os.environ.get("LIGHTNING_FASTDATA_CACHE"):
        setting = f"`LIGHTNING_FASTDATA_CACHE` {os.environ['LIGHTNING_FASTDATA_CACHE']!r}"
    else:
        setting = f"the default cache folder {str(root)!r}"
    reason = f" ({err.reason})" if err.reason else ""
    folder = Path(err.folder) if err.folder else root
    if folder == root:
        where = f"{setting} is read-only"
    elif folder in root.parents:  # not there yet: the folder it would be made in is the read-only one
        where = f"{setting} does not exist and cannot be made in {str(folder)!r}, which is read-only"
    else:
        where = f"{setting} cannot be written: {str(folder)!r} is read-only"
    if remote.is_url(data_dir):  # a copy of a URL: no database to pass instead, only another cache
        error = ReadOnlyDestinationError(
            f"{where}, so `data_dir` {shown(data_dir)!r} cannot be staged into it{reason}. Pass `cache_dir=` a"
            " writable folder on this node's local disk (`--data.cache_dir` on the command line) or set"
            " LIGHTNING_FASTDATA_CACHE to one."
        )
    else:
        error = ReadOnlyDestinationError(
            f"{where}, so `data_dir` {data_dir!r} cannot be converted into it{reason}. Pass `cache_dir=` a"
            " writable folder (`--data.cache_dir` on the command line) or set LIGHTNING_FASTDATA_CACHE to one, or"
            " convert once where it is writable (`lightning-fastdata convert`) and pass the database as `data_dir`."
        )
    error.folder, error.reason = str(folder), err.reason
    return error
