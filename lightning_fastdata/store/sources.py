"""Reading a source: image folders and roots of split folders, and the front door of every source's scan.

A conversion starts here: :func:`scan_folder` and :func:`~lightning_fastdata.store.listfiles.scan_list` turn a source
into a :class:`~lightning_fastdata.store.plan.ConversionPlan` (what to encode, the class names, a fingerprint of the
source); :func:`source_plan` tells which a source is. The same knowledge of layouts serves those who read folders
without converting: :func:`train_folder`, :func:`folder_classes`, :func:`canonical_split`, and :func:`image_folder` /
:func:`open_image_file` (torchvision's ``ImageFolder`` with a conversion's tolerance).

List files are read by :mod:`~lightning_fastdata.store.listfiles`, and the plan and what every layout shares (split
names, image extensions, the limits on a source file) live in :mod:`~lightning_fastdata.store.plan`; their public
names are importable from here too.
"""

from __future__ import annotations

import difflib
import io
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from lightning_fastdata._files import file_kind, read_regular
from lightning_fastdata.errors import SampleError, SourceLayoutError
from lightning_fastdata.store.labels import LABEL_SEPARATOR
from lightning_fastdata.store.listfiles import LIST_EXTENSIONS, scan_list
from lightning_fastdata.store.plan import (
    IMG_EXTENSIONS,
    LAYOUT_HELP,
    MAX_SOURCE_BYTES,
    SPLIT_ALIASES,
    ConversionPlan,
    SourceScan,
    Task,
    canonical_split,
    check_targets_option,
    not_an_image_reason,
    too_large_reason,
    warn_split_typos,
)
from lightning_fastdata.store.summary import SkippedFile, image_error_reason
from lightning_fastdata.store.targets import TargetSpec

__all__ = [
    "IMG_EXTENSIONS",
    "LIST_EXTENSIONS",
    "MAX_SOURCE_BYTES",
    "SPLIT_ALIASES",
    "ConversionPlan",
    "Task",
    "canonical_split",
    "check_targets_option",
    "folder_classes",
    "image_folder",
    "not_an_image_reason",
    "open_image_file",
    "scan_folder",
    "scan_list",
    "source_plan",
    "too_large_reason",
    "train_folder",
    "warn_split_typos",
]


def _class_dirs(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _walk_files(folder: Path) -> Iterator[str]:
    """Every file under ``folder`` (following links), sorted, skipping hidden files and folders."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield os.path.join(dirpath, name)


def _is_image_name(path: str) -> bool:
    return path.lower().endswith(IMG_EXTENSIONS)


def _has_image(folder: Path) -> bool:
    return any(_is_image_name(path) for path in _walk_files(folder))


def _split_folders(src: Path) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """The split roots of ``src`` and the class folders of each; raises ``SourceLayoutError`` on a bad layout.

    ``src`` is a root of splits when one of its folders has a split name (:data:`SPLIT_ALIASES`, any case) and holds
    class folders; otherwise it is one ImageFolder tree, stored as split ``train``, and a top-level folder with a split
    name is read as a class, with a warning.
    """
    if not src.exists():
        raise SourceLayoutError(f"`src` {str(src)!r} does not exist.\n{LAYOUT_HELP}")
    if not src.is_dir():
        mode = src.stat().st_mode
        if not stat.S_ISREG(mode):  # a list file too must be one: a FIFO or /dev/stdin would block or never end
            raise SourceLayoutError(
                f"`src` {str(src)!r} is {file_kind(mode)}, not a folder or a list file: only regular files are read."
                f" Save the list to a .csv, .tsv or .json file and pass that.\n{LAYOUT_HELP}"
            )
        raise SourceLayoutError(f"`src` {str(src)!r} is a file, not a folder.\n{LAYOUT_HELP}")
    top = _class_dirs(src)
    if not top:
        raise SourceLayoutError(f"`src` {str(src)!r} has no sub-folders (one per class are needed).\n{LAYOUT_HELP}")
    split_like = [name for name in top if canonical_split(name)]
    split_mode = any(_class_dirs(src / name) for name in split_like)
    if not split_mode:
        for name in split_like:
            warnings.warn(
                f"`src` {str(src)!r}: the folder {name!r} has a split name but holds no class folders, so it is read"
                f" as a class of images. If it is a split, put its images in {name}/<class>/; otherwise rename it.",
                UserWarning,
                stacklevel=3,
            )
        split_roots = {"train": src}
    else:
        split_roots = {}
        warn_split_typos(dict.fromkeys(top, "the split folder"), f"`src` {str(src)!r}")
        for name in top:
            split = canonical_split(name) or name
            if split in split_roots:
                raise SourceLayoutError(
                    f"`src` {str(src)!r} holds two folders for split {split!r}: {split_roots[split].name!r} and"
                    f" {name!r}. Merge them, or move one out of `src`."
                )
            split_roots[split] = src / name
    per_split = {}
    for split, root in split_roots.items():
        classes = _class_dirs(root)
        if not classes:
            raise SourceLayoutError(
                f"split folder {str(root)!r} has no class sub-folders, but {str(src)!r} looks like a root of"
                f" splits because it holds {', '.join(repr(n + '/') for n in split_like)}.\n{LAYOUT_HELP}"
            )
        per_split[split] = classes
    return split_roots, per_split


def _nonempty_classes(split_roots: dict[str, Path], per_split: dict[str, list[str]]) -> list[str]:
    """The class names (sorted, across splits) whose folder holds an image file in at least one split."""
    found = {split: {n for n in per_split[split] if _has_image(root / n)} for split, root in split_roots.items()}
    classes = sorted(set().union(*found.values()))
    if len(classes) == 1:
        _refuse_nested_classes(split_roots, classes[0])
    if "train" in found and len(found) > 1:
        _warn_classes_missing_from_train(split_roots["train"].parent, found)
    return classes


def _warn_classes_missing_from_train(src: Path, found: dict[str, set[str]]) -> None:
    """Warn about classes with images in another split but none in ``train``: most often a misspelled folder."""
    missing = sorted(set().union(*found.values()) - found["train"])
    if not missing:
        return
    described = []
    for name in missing:
        splits = " and ".join(split for split in sorted(found) if name in found[split])
        close = difflib.get_close_matches(name, sorted(found["train"]), n=1)
        described.append(f"{name!r} (in {splits}" + (f"; did you mean {close[0]!r}?)" if close else ")"))
    warnings.warn(
        f"`src` {str(src)!r}: {len(missing)} class(es) have images in another split but none in train, so the model"
        f" never learns them: {', '.join(described)}. They are kept as classes; rename or move the folders if that"
        " is a mistake.",
        UserWarning,
        stacklevel=4,
    )


def _refuse_nested_classes(split_roots: dict[str, Path], name: str) -> None:
    """Refuse a single class folder whose images all lie in two or more sub-folders: the classes one level deeper.

    ``root/dataset/<class>/<image>`` would otherwise convert to one class, ``dataset``, and train a 1-class model.
    """
    nested: dict[Path, list[str]] = {}
    for root in split_roots.values():
        folder = root / name
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            if any(e.is_file() and _is_image_name(e.name) and not e.name.startswith(".") for e in entries):
                return
        subfolders = [d for d in _class_dirs(folder) if _has_image(folder / d)]
        if len(subfolders) < 2:
            return
        nested[folder] = subfolders
    if not nested:
        return
    folder, subfolders = next(iter(nested.items()))
    shown = ", ".join(repr(d) for d in subfolders[:5])
    shown += f" and {len(subfolders) - 5} more" if len(subfolders) > 5 else ""
    if folder.parent in split_roots.values() and len(split_roots) == 1:
        fix = f"Pass {str(folder)!r} as `src` (`data_dir`) instead."
    else:
        fix = f"Move the class folders of {str(folder)!r} up one level, into {str(folder.parent)!r}."
    raise SourceLayoutError(
        f"{str(folder.parent)!r} holds a single class folder, {name!r}, and all its images are in its sub-folders"
        f" {shown}: the classes seem to be nested one level deeper, and converting would make a 1-class dataset."
        f" {fix} (To convert one class whose images lie in sub-folders, list them in a CSV file: path,label.)"
    )


def train_folder(src: str | os.PathLike[str]) -> Path:
    """The ImageFolder tree of ``src``'s training split (``src`` itself when it has no split folders).

    Raises:
        SourceLayoutError: ``src`` is missing or not an image folder, or has split folders but no training split.

    """
    path = Path(src).expanduser()
    split_roots, _ = _split_folders(path)
    if "train" not in split_roots:
        raise SourceLayoutError(f"`src` {str(path)!r} has split folders but no training split (train/, training/).")
    return split_roots["train"]


def image_folder(root: str | os.PathLike[str], transform: Any = None) -> Any:
    """An ``ImageFolder`` (torchvision's) over ``root``, with the tolerance of a conversion.

    Hidden and empty class folders are left out (torchvision refuses a class folder without images), and images are
    opened with :func:`open_image_file`, whose errors name the file.

    Raises:
        SourceLayoutError: no class folder of ``root`` holds an image file.

    """
    from torchvision import datasets

    path = Path(root)
    classes = _nonempty_classes({"train": path}, {"train": _class_dirs(path)})
    if not classes:
        raise SourceLayoutError(
            f"found no image files under {str(path)!r} (looked for {' '.join(IMG_EXTENSIONS)}, any case, in the class"
            f" folders).\n{LAYOUT_HELP}"
        )

    class _Folder(datasets.ImageFolder):
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            return classes, {name: i for i, name in enumerate(classes)}

    return _Folder(str(path), transform=transform, loader=open_image_file)


def open_image_file(path: str, data: bytes | None = None) -> Image.Image:
    """Open an image file (or its bytes, already read) as RGB, as ``ImageFolder`` does, with errors naming the file.

    Raises:
        SampleError: the file cannot be read or decoded.

    """
    try:
        if data is None:
            data = read_regular(path, limit=MAX_SOURCE_BYTES)
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        reason = image_error_reason(err, f"{type(err).__name__}: {err}")
        raise SampleError(
            f"{path!r} cannot be read as an image ({reason}). Fix or remove it, or convert the"
            " folder with `lightning-fastdata convert` (it skips and lists bad files) and use the database."
        ) from None


def folder_classes(
    src: str | os.PathLike[str], targets: str | None = None, label_separator: str = LABEL_SEPARATOR
) -> list[str]:
    """The class names a conversion of ``src`` will have (sorted, across splits; empty class folders left out).

    For a list file, those of its labels read as ``targets`` (``None``: inferred), as its conversion reads them.
    """
    return list(source_plan(src, targets, label_separator).classes or [])


def source_plan(
    src: str | os.PathLike[str], targets: str | None = None, label_separator: str = LABEL_SEPARATOR
) -> ConversionPlan:
    """What a conversion of ``src`` will store, without converting: its classes and target kind.

    A list file is read as ``targets``; a folder gives classes (its tasks are not listed).
    """
    path = Path(src).expanduser()
    if path.is_file() and path.suffix.lower() in LIST_EXTENSIONS:
        return scan_list(path.absolute(), targets, label_separator)
    if targets == "none":
        return ConversionPlan([], {}, None, str(path), targets=TargetSpec("none"))
    if targets not in (None, "class"):
        scan_folder(path, targets)  # refuses, as a conversion would
    return ConversionPlan(_nonempty_classes(*_split_folders(path)), {}, None, str(path), targets=TargetSpec("class"))


def scan_folder(src: Path, targets: str | None = None) -> ConversionPlan:
    """A plan from an ImageFolder tree or a root of split trees; non-image files and empty classes are ignored.

    ``targets``: ``None`` or ``"class"`` stores each image's class folder, ``"none"`` no target at all.

    Raises:
        SourceLayoutError: ``src`` is not laid out as image folders, or ``targets`` is a kind folders cannot give.

    """
    check_targets_option(targets, LABEL_SEPARATOR)
    if targets not in (None, "class", "none"):
        raise SourceLayoutError(
            f"`targets` {targets!r} needs a list file: the folders of `src` {str(src)!r} give one class per image."
            f" List the images and their targets in a CSV, TSV or JSON file and convert that, or pass `--targets class`"
            " (or none)."
        )
    split_roots, per_split = _split_folders(src)
    classes = _nonempty_classes(split_roots, per_split)
    scan = SourceScan()
    for name in sorted(set().union(*per_split.values())):
        if name not in classes:
            folders = [str(root / name) for split, root in split_roots.items() if name in per_split[split]]
            scan.ignored.append(SkippedFile(folders[0], "empty class folder: no image files in it; left out"))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    for split, root in split_roots.items():
        scan.tasks[split], scan.names[split] = [], []
        for name in per_split[split]:
            if name not in class_to_idx:
                continue
            for path in _walk_files(root / name):
                if not _is_image_name(path):
                    reason = f"not an image file name (looked for {' '.join(IMG_EXTENSIONS)})"
                    scan.ignored.append(SkippedFile(path, reason))
                    continue
                label = None if targets == "none" else class_to_idx[name]
                scan.add(split, path, label, Path(os.path.relpath(path, src)).as_posix())
    if targets != "none":
        return scan.plan(src, classes)
    plan = scan.plan(src, [])
    plan.targets = TargetSpec("none")
    return plan
