"""The conversion entry points: :func:`convert` (a folder or list file) and :func:`convert_dataset` (any dataset).

Each checks its arguments, reads its source into a plan (:mod:`~lightning_fastdata.store.sources`, or the
dataset through :mod:`~lightning_fastdata.store.hf`) and hands it to the writer
(:func:`~lightning_fastdata.store.writer.write_database`), which returns the :class:`ConversionSummary`. The options
both take are documented once, in :data:`_OPTIONS_DOC`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lightning_fastdata.errors import SourceLayoutError
from lightning_fastdata.store import remote
from lightning_fastdata.store.cache import converted_path, record_elsewhere
from lightning_fastdata.store.encode import Encoding, check_options
from lightning_fastdata.store.format import default_cache_dir
from lightning_fastdata.store.hf import DatasetRows, dataset_classes, dataset_targets
from lightning_fastdata.store.labels import LABEL_SEPARATOR
from lightning_fastdata.store.sources import (
    LIST_EXTENSIONS,
    ConversionPlan,
    canonical_split,
    check_targets_option,
    scan_folder,
    scan_list,
    warn_split_typos,
)
from lightning_fastdata.store.summary import ConversionSummary, SkippedFile
from lightning_fastdata.store.targets import TargetKind
from lightning_fastdata.store.writer import INITIAL_MAP_SIZE, write_database

__all__ = ["ConversionSummary", "SkippedFile", "convert", "convert_dataset"]

#: The arguments :func:`convert` and :func:`convert_dataset` share (their defaults too), documented once: each of
#: their docstrings holds a line ``{options}`` that becomes these entries, so ``help()`` shows them in full. Lines are
#: 112 wide: 120 where they land, under ``Args:``.
_OPTIONS_DOC = """\
short_side: downscale images whose short side is larger to this many pixels (256 fits training at 224) and store
    them as JPEG; ``None`` or ``0`` keeps the original size. Smaller images are never upscaled.
quality: JPEG quality of re-encoded images.
keep_original: store the source bytes untouched wherever the source already is an RGB or grayscale JPEG, even
    when larger than ``short_side``. Small JPEGs are always stored untouched.
encoding: ``"jpeg"`` (compact, decoded per read) or ``"raw"`` (uint8 pixels: about 10x the size, no decode at
    all when reading; for datasets that fit the page cache and CPU-bound input pipelines).
num_workers: worker processes; default: up to the CPUs this process may use (affinity and cgroup quota), and
    none for a conversion too small to pay for starting them (the first images, encoded here, tell). ``0``
    converts in this process. A dataset reaches the workers by fork, or is pickled once under spawn.
strict: fail, writing nothing, if any input is skipped (corrupt, truncated, empty, not an image; a list file's row
    without a usable label, or listing an image again).
force: rebuild even if ``dst`` is up to date, or replace a database converted from another source.
progress: show a progress bar with images/s and ETA.
initial_map_size: the first LMDB map size in bytes; it doubles by itself whenever the database fills it."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _shared_options(func: _F) -> _F:
    """Put :data:`_OPTIONS_DOC`, indented, in place of the ``{options}`` line of ``func``'s docstring."""
    if func.__doc__:  # None under ``python -OO``
        lines = []
        for line in func.__doc__.splitlines():
            if line.strip() == "{options}":
                indent = line[: len(line) - len(line.lstrip())]
                lines += [indent + entry for entry in _OPTIONS_DOC.splitlines()]
            else:
                lines.append(line)
        func.__doc__ = "\n".join(lines)
    return func


@_shared_options
def convert(  # noqa: D417 - the shared options are documented in _OPTIONS_DOC
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    short_side: int | None = 256,
    quality: int = 90,
    keep_original: bool = False,
    encoding: Encoding = "jpeg",
    num_workers: int | None = None,
    strict: bool = False,
    force: bool = False,
    progress: bool = True,
    initial_map_size: int = INITIAL_MAP_SIZE,
    targets: TargetKind | None = None,
    label_separator: str = LABEL_SEPARATOR,
) -> ConversionSummary:
    """Convert an ImageFolder tree, a root of split trees, or a ``path,label`` list file into an LMDB image database.

    Split folders are recognised by name, in any case: ``train``/``training``, ``val``/``valid``/``validation``/``dev``
    and ``test``/``testing`` are stored as ``train``, ``val`` and ``test``. Each record's path relative to ``src`` is
    stored too (:func:`~lightning_fastdata.read_sources`). Non-image files and empty class folders are left out and
    listed in ``ConversionSummary.ignored``; unreadable paths (a dangling link) are skipped and listed.

    The conversion runs once: re-running on an unchanged source with the same options does nothing (also in a
    read-only folder). It writes into a hidden sibling of ``dst`` and renames it into place at the end, so an
    interruption never leaves anything that reads as a complete database; running again starts over. While it runs,
    the lock file ``.<dst>.lock`` beside ``dst`` names its process;
    :func:`~lightning_fastdata.store.leftovers.clean_stale_conversions` removes what a killed conversion left.

    Args:
        src: an ImageFolder root (``src/<class>/<image>``), a root of split trees (``src/train/<class>/<image>``),
            or a list file: ``.csv`` (or tab-separated ``.tsv``) with a header holding ``path`` and ``label`` (and
            optionally ``split``), or ``.json``, a list of such objects. Listed paths are relative to the list file's
            folder; labels are class names, or class indices when all are non-negative integers (see ``targets``
            for other kinds). ``~`` is expanded.
        dst: the database directory to create or replace. Only a lightning_fastdata database converted from the same
            ``src`` is replaced; one converted from another source needs ``force``. Or an fsspec URL
            (``s3://bucket/name.lmdb``; needs ``pip install 'lightning-fastdata[remote]'``): the database is converted
            into the cache folder, where it is kept, then published there unless the URL already holds the same files
            (:func:`_publish`); running again converts and uploads nothing. With ``keep_original`` or ``force`` it is
            converted into a temporary folder instead, removed after the upload.
        {options}
        targets: what a list file's labels are (:mod:`~lightning_fastdata.store.targets`): ``"class"`` (each
            distinct label a class), ``"multilabel"`` (class names separated by ``label_separator``, a JSON list, or
            ``[a, b]`` text; an empty label names no class), ``"float"`` (the numbers of the ``label`` column, or of
            every column but ``path`` and ``split``: ``path,x,y``; rows whose values do not parse or are not finite
            are skipped and listed) or ``"none"`` (no target; no ``label`` column needed). Default: classes, unless
            the labels could be read otherwise (numbers that are not all integers, lists, labels holding the
            separator): that is refused with an error naming this option. A folder gives only ``"class"`` or
            ``"none"``.
        label_separator: what separates the class names of a ``multilabel`` label (``cat|outdoor``).

    Returns:
        A :class:`ConversionSummary`; skipped and ignored files are also listed in ``dst/convert_report.json``.

    Raises:
        SourceLayoutError: ``src`` is missing, empty, or not laid out as an image folder or a list file (including a
            single class folder whose images lie in two or more sub-folders: classes nested one level too deep), or
            its labels are ambiguous without ``targets``
            (:class:`~lightning_fastdata.store.labels.AmbiguousTargetsError`).
        DestinationError: ``dst`` holds other data, or (without ``force``) a database of another source, or a file
            stands where one of its parent folders must go.
        ReadOnlyDestinationError: the folder of ``dst`` is read-only and ``dst`` is not an up-to-date database.
        ConversionError: nothing could be converted, a file was skipped under ``strict``, or writing failed (a full
            disk is named, with the space the database needs).
        RemoteStorageError: ``dst`` is a URL that cannot be written (missing backend, bucket or credentials, a
            network failure).
        InvalidArgumentError: ``src`` is a URL (convert reads local files).

    Example:
        >>> from lightning_fastdata import convert
        >>> summary = convert("data/imagenette", "data/imagenette.lmdb", short_side=256)
        >>> print(summary.format())

    """
    remote.check_local(src, "src", "convert reads a local image folder or list file. Copy the source to a local disk")
    if remote.is_url(dst):
        opts = check_options(short_side, quality, keep_original, encoding)
        # the slot a DataModule converts SRC into (it never keeps originals); a rebuild on demand stays apart from it
        source = Path(src).expanduser().absolute()
        check_targets_option(targets, label_separator)
        slot = converted_path(source, default_cache_dir(), opts.short_side, quality, encoding, targets, label_separator)
        return _publish(
            lambda local: convert(
                src, local, short_side, quality, keep_original, encoding, num_workers, strict, force, progress,
                initial_map_size, targets, label_separator,
            ),
            os.fspath(dst),
            progress,
            None if keep_original or force else slot,
        )  # fmt: skip
    opts = check_options(short_side, quality, keep_original, encoding)
    src_path, dst_path = Path(src).expanduser().absolute(), Path(dst).expanduser().absolute()
    is_list = src_path.is_file() and src_path.suffix.lower() in LIST_EXTENSIONS
    if dst_path == src_path:
        raise ValueError(f"`dst` {str(dst)!r} and `src` {str(src)!r} are the same path. Choose another `dst`.")
    if not is_list and dst_path.is_relative_to(src_path):
        raise ValueError(
            f"`dst` {str(dst)!r} is inside `src` {str(src)!r}; it must be outside (inside, it would be read as a class"
            " or a split on the next run). Choose a path beside the image folder, e.g. `data/images.lmdb`."
        )
    if src_path.is_relative_to(dst_path):
        raise ValueError(
            f"`src` {str(src)!r} is inside `dst` {str(dst)!r}: converting would replace the folder holding the source."
            " Choose a `dst` outside it, e.g. `data/images.lmdb` beside the image folder."
        )
    check_targets_option(targets, label_separator)
    plan = scan_list(src_path, targets, label_separator) if is_list else scan_folder(src_path, targets)
    summary = write_database(plan, dst_path, None, opts, num_workers, strict, force, progress, initial_map_size)
    slot = converted_path(src_path, dst_path.parent, opts.short_side, quality, encoding, targets, label_separator)
    if dst_path != slot:  # not a cache slot
        record_elsewhere(src_path, dst_path)  # so that a DataModule given SRC can point at it, and `cache list` show it
    return summary


@_shared_options
def convert_dataset(  # noqa: D417 - the shared options are documented in _OPTIONS_DOC
    dataset: Sequence[Any] | Mapping[str, Sequence[Any]],
    dst: str | os.PathLike[str],
    classes: Sequence[str] | None = None,
    short_side: int | None = 256,
    quality: int = 90,
    keep_original: bool = False,
    encoding: Encoding = "jpeg",
    num_workers: int | None = None,
    strict: bool = False,
    fingerprint: str | None = None,
    force: bool = False,
    progress: bool = True,
    initial_map_size: int = INITIAL_MAP_SIZE,
    image_column: str | None = None,
    label_column: str | None = None,
    targets: TargetKind | None = None,
) -> ConversionSummary:
    """Convert any indexed dataset of ``(PIL image or encoded image bytes, target)`` into a database.

    Also takes a Hugging Face ``datasets.Dataset`` (or a ``DatasetDict`` of splits) with an image and a label column:
    rows are read by column, class names come from a ``ClassLabel`` label feature, and an ``Image(decode=False)``
    column is stored from its encoded bytes without decoding. Split names are stored as :func:`convert` stores split
    folders (``validation`` becomes ``val``, ...); each record's index in its dataset is stored as its source.

    Args:
        dataset: one dataset (stored as split ``"train"``) or a mapping of split name to dataset.
        dst: the database directory to create or replace.
        classes: the class names; default: the first dataset's ``classes`` attribute, or its ``ClassLabel`` names,
            else ``"0"``, ``"1"``, ...
        {options}
        fingerprint: a string that identifies the dataset's content; when given, re-running with the same
            fingerprint and options does nothing. Without it, every call converts.
        image_column: for rows that are mappings: the image column; default ``"image"`` or ``"img"``.
        label_column: for rows that are mappings: the label column; default ``"label"`` or ``"labels"``.
        targets: what each target is (:mod:`~lightning_fastdata.store.targets`): ``"class"`` (an int), ``"multilabel"``
            (a list of class indices or names), ``"float"`` (a float, or a list or array of K floats), ``"none"`` (no
            target is read). Default: inferred from the first sample where that is unambiguous (an int: ``class``;
            floats: ``float``; a list of names: ``multilabel``), else refused with an error naming this argument.

    Returns:
        A :class:`ConversionSummary`.

    Example:
        >>> import datasets  # pip install 'lightning-fastdata[hf]'
        >>> from lightning_fastdata import convert_dataset
        >>> splits = datasets.load_dataset("imagefolder", data_dir="data/pets")  # doctest: +SKIP
        >>> convert_dataset(splits, "data/pets.lmdb")  # doctest: +SKIP

    """
    if remote.is_url(dst):
        return _publish(
            lambda local: convert_dataset(
                dataset, local, classes, short_side, quality, keep_original, encoding, num_workers, strict,
                fingerprint, True, progress, initial_map_size, image_column, label_column, targets,
            ),
            os.fspath(dst),
            progress,
        )  # fmt: skip
    opts = check_options(short_side, quality, keep_original, encoding)
    given = dict(dataset) if isinstance(dataset, Mapping) else {"train": dataset}
    if not given or not all(len(ds) for ds in given.values()):
        raise SourceLayoutError("every dataset passed to `convert_dataset` must be non-empty.")
    warn_split_typos(dict.fromkeys(map(str, given), "the dataset for split"), "`dataset`")
    datasets: dict[str, DatasetRows] = {}
    for name, ds in given.items():
        split = canonical_split(str(name)) or str(name)
        if split in datasets:
            raise SourceLayoutError(f"`dataset` has two splits stored as {split!r}; rename one of them.")
        datasets[split] = DatasetRows(ds, image_column, label_column)
    first = next(iter(given.values()))
    if classes is None:
        classes = dataset_classes(first, label_column)
    spec = dataset_targets(targets, first, datasets[next(iter(datasets))], label_column)
    tasks = {split: [(split, i, -1) for i in range(len(ds))] for split, ds in datasets.items()}
    plan = ConversionPlan(
        targets=spec,
        targets_inferred=targets is None,
        classes=list(classes) if classes is not None else None,
        tasks=tasks,  # type: ignore[arg-type]
        fingerprint=fingerprint,
        source=f"<{type(first).__name__}>",
        names={split: [str(i) for i in range(len(ds))] for split, ds in datasets.items()},
    )
    return write_database(
        plan, Path(dst).expanduser(), datasets, opts, num_workers, strict, force, progress, initial_map_size
    )


def _publish(
    convert_into: Callable[[Path], ConversionSummary], url: str, progress: bool, local: Path | None = None
) -> ConversionSummary:
    """Convert locally, then upload the database to ``url`` unless it already holds the same files.

    ``local``: where the conversion goes and stays (the cache slot of a folder's conversion, which a later run, or a
    DataModule reading the folder, finds up to date); ``None``: a temporary folder under the cache folder, removed in
    any case. The upload (:func:`~lightning_fastdata.store.remote.publish`) writes the completion marker last, so the
    database at ``url`` is readable only once complete; its report names the URL as the destination.
    """
    remote.check_destination(url)  # a missing backend or bucket, or another's objects, fail before converting
    root = default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if local is None:
            local = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".publish-", dir=root))) / "db.lmdb"
        summary = convert_into(local)
        _, summary.uploaded = remote.publish_database(local, url, progress, destination=url)
    summary.destination = remote.redact_url(url)  # printed: no user-info or signature
    return summary
