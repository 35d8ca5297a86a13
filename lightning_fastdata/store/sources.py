"""Reading a source: image folders, roots of split folders and ``path,label`` list files, scanned into a plan.

A conversion starts here: :func:`scan_folder` and :func:`scan_list` turn a source into a :class:`ConversionPlan`
(what to encode, the class names, a fingerprint of the source). The same knowledge of layouts serves those who read
folders without converting: :func:`train_folder`, :func:`folder_classes`, :func:`canonical_split`, and
:func:`image_folder` / :func:`open_image_file` (torchvision's ``ImageFolder`` with a conversion's tolerance).
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
import os
import stat
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from PIL import Image

from lightning_fastdata._files import NotRegularFileError, file_kind, read_regular
from lightning_fastdata.errors import SampleError, SourceLayoutError
from lightning_fastdata.store.format import parse_json
from lightning_fastdata.store.summary import SkippedFile, image_error_reason
from lightning_fastdata.store.targets import (
    KINDS,
    LABEL_SEPARATOR,
    MAX_DIM,
    TargetSpec,
    check_target,
    infer_list_kind,
    is_missing,
    short_repr,
    split_label,
)

#: File extensions read as images (matched case-insensitively), as torchvision's ``ImageFolder``.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: Folder names (matched case-insensitively) read as splits, and the split name each is stored under.
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validation": "val",
    "dev": "val",
    "test": "test",
    "testing": "test",
}

#: Files accepted as a list source: ``path,label`` rows (CSV or tab-separated TSV, with a header) or a JSON list of
#: objects.
LIST_EXTENSIONS = (".csv", ".tsv", ".json")


#: the most bytes a source image file may have: it is read whole into memory, and no image Pillow decodes is larger
#: (twice ``Image.MAX_IMAGE_PIXELS``, where Pillow refuses one, of 16-bit RGBA is 1.4 GB, uncompressed). A list file
#: may name any regular file: a 20 GB one ended the conversion with a MemoryError
MAX_SOURCE_BYTES = 2 << 30


def too_large_reason(size: int) -> str:
    """Why a source file of ``size`` bytes, over :data:`MAX_SOURCE_BYTES`, is skipped unread."""
    return (
        f"a file of {size / 2**30:.1f} GiB, over the {MAX_SOURCE_BYTES >> 30} GiB a source image may have (no image"
        " Pillow decodes is that large); it was not read"
    )


def not_an_image_reason(kind: str) -> str:
    """Why a source path that is not a regular file is skipped, and what to do.

    ``kind``: what it is, as :func:`~lightning_fastdata._files.file_kind` says.
    """
    return f"{kind}, not an image file: only regular files are read; list or put the image file itself there"


#: how far a list file's numeric labels (class indices) may exceed its rows: a class name is made for every index up to
#: the largest, so a label of 3000000000 would otherwise ask for 3 billion of them (the subset of a larger label set
#: still fits: ImageNet-21k's 21,841 classes for a list of any length)
_SPARE_CLASS_INDICES = 2**20
_LAYOUT_HELP = """Expected an ImageFolder tree:
    SRC/<class_a>/<image>.jpg
    SRC/<class_b>/<image>.png
or a root holding one such tree per split (train/training, val/valid/validation/dev, test/testing, any case):
    SRC/train/<class>/<image>.jpg
    SRC/val/<class>/<image>.jpg
or a list file SRC.csv or SRC.tsv (header `path,label`, optional `split`) or SRC.json ([{"path": ..., "label": ...},
...]). With `--targets float` the values may be columns of their own (`path,x,y`); with `--targets none` only `path`
is needed; with `--targets multilabel` a label holds class names separated by `|` (`--label-sep`) or a JSON list."""

#: One input to encode: ``(split, path or dataset index, target)``: a class index, a tuple of class indices
#: (``multilabel``), a tuple of floats (``float``) or ``None`` (``none``), as :func:`~.targets.check_target` returns
#: them; ``-1`` for a dataset's input: the dataset gives it.
Task: TypeAlias = tuple[str, str | int, Any]


@dataclass
class ConversionPlan:
    """Everything to convert: ``tasks[split]`` lists ``(split, path-or-index, label)``.

    ``names[split]`` holds, in the same order, what identifies each input to the user (a path relative to the source,
    a path as listed, or a dataset index): it is stored beside the records so predictions map back to their files.
    """

    classes: list[str] | None
    tasks: dict[str, list[Task]]
    fingerprint: str | None
    source: str
    names: dict[str, list[str]] = field(default_factory=dict)
    #: the size of the source files (0 for datasets): estimates the space a conversion needs
    source_bytes: int = 0
    #: the target kind (:mod:`~lightning_fastdata.store.targets`); ``num_classes`` follows ``classes`` when written
    targets: TargetSpec = field(default_factory=TargetSpec)
    #: whether ``targets`` was inferred from a dataset's first sample: a later target of another kind stops the writer
    targets_inferred: bool = False
    skipped: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)


def canonical_split(name: str) -> str | None:
    """The split a folder or list entry named ``name`` is stored as (``"train"``, ``"val"``, ``"test"``), else None."""
    return SPLIT_ALIASES.get(name.strip().lower())


_KNOWN_SPLITS = "train/training, val/valid/validation/dev, test/testing (any case)"


def warn_split_typos(names: Mapping[str, str], where: str) -> None:
    """Warn about each split name that is not a known one but close to one (``trian``): most likely a typo.

    ``names`` maps each name to what carries it (``"the split folder"``, ``"3 row(s) with split"``); names far from
    every known one are custom splits, kept silently as documented.
    """
    for name, carrier in names.items():
        if canonical_split(name) is not None:
            continue
        close = difflib.get_close_matches(name.strip().lower(), list(SPLIT_ALIASES), n=1, cutoff=0.7)
        if close:
            warnings.warn(
                f"{where}: {carrier} {name!r}, which is not a known split name; it is stored as a split named"
                f" {name!r}. Did you mean {close[0]!r}? Known names: {_KNOWN_SPLITS}.",
                UserWarning,
                stacklevel=4,
            )


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
        raise SourceLayoutError(f"`src` {str(src)!r} does not exist.\n{_LAYOUT_HELP}")
    if not src.is_dir():
        mode = src.stat().st_mode
        if not stat.S_ISREG(mode):  # a list file too must be one: a FIFO or /dev/stdin would block or never end
            raise SourceLayoutError(
                f"`src` {str(src)!r} is {file_kind(mode)}, not a folder or a list file: only regular files are read."
                f" Save the list to a .csv, .tsv or .json file and pass that.\n{_LAYOUT_HELP}"
            )
        raise SourceLayoutError(f"`src` {str(src)!r} is a file, not a folder.\n{_LAYOUT_HELP}")
    top = _class_dirs(src)
    if not top:
        raise SourceLayoutError(f"`src` {str(src)!r} has no sub-folders (one per class are needed).\n{_LAYOUT_HELP}")
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
                f" splits because it holds {', '.join(repr(n + '/') for n in split_like)}.\n{_LAYOUT_HELP}"
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
            f" folders).\n{_LAYOUT_HELP}"
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


class _Scan:
    """Collects tasks, the source fingerprint, and the inputs skipped before conversion (unreadable paths)."""

    def __init__(self) -> None:
        self.tasks: dict[str, list[Task]] = {}
        self.names: dict[str, list[str]] = {}
        self.skipped: list[SkippedFile] = []
        self.ignored: list[SkippedFile] = []
        self.digest = hashlib.sha256()
        self.bytes = 0

    def add(self, split: str, path: str, label: Any, name: str) -> None:
        self.tasks.setdefault(split, [])
        self.names.setdefault(split, [])
        try:
            st = os.stat(path)
        except ValueError:  # a NUL character (a JSON list's `\\u0000`): no file has such a name
            self.skipped.append(SkippedFile(repr(path), "the path holds a NUL character, which no file name can"))
            return
        except OSError as err:
            dangling = os.path.islink(path)
            reason = "dangling symbolic link (its target does not exist)" if dangling else f"cannot read file: {err}"
            self.skipped.append(SkippedFile(path, reason))
            return
        if not stat.S_ISREG(st.st_mode):  # `/dev/zero` would be read until memory runs out, a FIFO block the read
            link = f" (a symbolic link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
            self.skipped.append(SkippedFile(path, not_an_image_reason(file_kind(st.st_mode) + link)))
            return
        self.tasks[split].append((split, path, label))
        self.names[split].append(name)
        self.bytes += st.st_size
        self.digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())

    def plan(self, src: Path, classes: list[str]) -> ConversionPlan:
        if not any(self.tasks.values()) and not self.skipped:
            exts = " ".join(IMG_EXTENSIONS)
            raise SourceLayoutError(
                f"found no image files under {str(src)!r} (looked for {exts}, any case, in the class folders).\n"
                f"{_LAYOUT_HELP}"
            )
        return ConversionPlan(
            classes=classes,
            tasks=self.tasks,
            fingerprint=self.digest.hexdigest(),
            source=str(src),
            names=self.names,
            skipped=self.skipped,
            ignored=self.ignored,
            source_bytes=self.bytes,
        )


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
    scan = _Scan()
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


class _JsonNumber(str):
    """A number of a JSON list file as its text (``0.30``, ``1e2``, ``NaN``): what a label is, whichever the kind.

    A class is named by the text as written, a float is parsed from it; a list of them is written as the file does.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_SAVE_AS_UTF8 = (
    "A list file is UTF-8 text: if it was saved as UTF-16 (Excel's 'Unicode Text'), save it again as 'CSV UTF-8'"
)


def _list_text(src: Path) -> tuple[str, bytes]:
    """A list file's text and its bytes (read once: they are the fingerprint too), refused unless it is UTF-8 text.

    Raises:
        SourceLayoutError: ``src`` is no regular file, cannot be read, is not UTF-8, or holds a NUL character.

    """
    try:
        data = read_regular(src)
    except NotRegularFileError as err:  # replaced since the conversion looked: read, it would block or never end
        raise SourceLayoutError(
            f"`src` {str(src)!r} is {err.kind}, not a list file: only regular files are read. Save the list to a"
            " .csv, .tsv or .json file and pass that."
        ) from None
    except OSError as err:
        raise SourceLayoutError(f"`src` {str(src)!r} cannot be read: {err.strerror or err}") from None
    body = data[len(_UTF8_BOM) :] if data.startswith(_UTF8_BOM) else data
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = body.count(b"\n", 0, err.start) + 1
        utf16 = " It starts as UTF-16 does." if data.startswith(_UTF16_BOMS) else ""
        raise SourceLayoutError(
            f"`src` {str(src)!r} is not UTF-8 text: byte 0x{body[err.start : err.start + 1].hex()} at line {line}"
            f" ({err.reason}).{utf16} {_SAVE_AS_UTF8}, and replace any byte not meant to be there."
        ) from None
    nul = text.find("\0")
    if nul >= 0:  # Python's csv reads it as a character: a path with it fails, a label keeps it
        line = text.count("\n", 0, nul) + 1
        raise SourceLayoutError(
            f"`src` {str(src)!r} holds a NUL character at line {line}, which no text file does. {_SAVE_AS_UTF8};"
            " otherwise remove the NUL bytes."
        )
    return text, data


def _read_csv(src: Path, text: str) -> list[dict[str, Any]]:
    """The rows of a CSV or TSV list file (with a header), as ``csv.DictReader`` reads them.

    Raises:
        SourceLayoutError: a row cannot be read as CSV (a cell over ``csv.field_size_limit()``, 128 KiB: most often
            a quote left open, which makes the rest of the file one cell), naming the row and its first line.

    """
    reader = csv.DictReader(io.StringIO(text), delimiter="\t" if src.suffix.lower() == ".tsv" else ",")
    rows: list[dict[str, Any]] = []
    where = "the header (line 1)"
    try:
        _ = reader.fieldnames  # the header, read first: an error in it is named as such
        while True:
            where = f"row {len(rows) + 1} (from line {reader.line_num + 1})"  # numbered as skipped rows are
            row = next(reader, None)
            if row is None:
                return rows
            rows.append(row)
    except csv.Error as err:
        limit = csv.field_size_limit()
        fix = (
            f'A cell is {limit:,} characters at most: if a quote (`"`) opens a cell and is never closed, the rest'
            " of the file reads as that cell; close it, or quote the cell whole (a quote inside a quoted cell is"
            ' written twice: `""`)'
            if "field larger than field limit" in str(err)
            else "Check the quoting of that row: a cell that holds the separator or a line break is quoted whole"
        )
        raise SourceLayoutError(f"`src` {str(src)!r}: {where} cannot be read as CSV ({err}). {fix}.") from None


def _read_list(src: Path, columns: tuple[str, ...] = ("path", "label")) -> tuple[list[dict[str, Any]], bytes]:
    """The rows of a CSV or TSV (with a header) or JSON (a list of objects) list file, keys lower-cased; its bytes.

    ``columns``: those the first row must have (``path`` alone where no label is read).
    """
    text, data = _list_text(src)
    if src.suffix.lower() == ".json":
        try:  # numbers keep their text (`0.30` is the class '0.30', never a float's repr '0.3')
            rows = parse_json(text, parse_int=_JsonNumber, parse_float=_JsonNumber, parse_constant=_JsonNumber)
        except ValueError as err:
            raise SourceLayoutError(f"`src` {str(src)!r} is not valid JSON: {err}.\n{_LAYOUT_HELP}") from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise SourceLayoutError(f"`src` {str(src)!r} must hold a JSON list of objects.\n{_LAYOUT_HELP}")
    else:
        rows = _read_csv(src, text)
    rows = [{str(k).strip().lower(): v for k, v in row.items() if k is not None} for row in rows]
    if not rows:
        raise SourceLayoutError(f"`src` {str(src)!r} lists no images.\n{_LAYOUT_HELP}")
    missing = set(columns) - set(rows[0])
    if missing:
        raise SourceLayoutError(
            f"`src` {str(src)!r} has no {' or '.join(sorted(missing))} column; its columns are {sorted(rows[0])}."
            " Name the columns `path` and `label` (and optionally `split`); with `--targets float` (`targets='float'`)"
            " the columns other than `path` and `split` are read as values, with `--targets none` no `label` is"
            f" needed.\n{_LAYOUT_HELP}"
        )
    return rows, data


def check_targets_option(targets: str | None, label_separator: str) -> None:
    """Refuse a ``targets`` that is not a kind, and a ``label_separator`` that is empty or spans lines.

    Raises:
        ValueError: either is not usable.

    """
    if targets is not None and targets not in KINDS:
        raise ValueError(f"`targets` must be one of {', '.join(KINDS)} (or left out to infer it), got {targets!r}.")
    if not isinstance(label_separator, str) or not label_separator.strip() or "\n" in label_separator:
        raise ValueError(
            f"`label_separator` must be a visible string such as '|' or ';', got {label_separator!r}."
            " Pass the character that separates class names in a multi-label list file's `label` column."
        )


def _label_of(row: Mapping[str, Any]) -> Any:
    """A row's ``label`` as the list file holds it: a JSON list as a list, anything else as stripped text."""
    label = row.get("label")
    if isinstance(label, (list, tuple)):
        return list(label)
    return "" if label is None else str(label).strip()


def _has_path(row: Mapping[str, Any]) -> bool:
    return bool(str(row.get("path") or "").strip())


def _index_classes(src: Path, names: list[str], rows: int) -> tuple[list[str], dict[str, int]]:
    """The classes of a list file's label names: their indices when all are ASCII digits, else the sorted names.

    Raises:
        SourceLayoutError: an index exceeds the rows by more than :data:`_SPARE_CLASS_INDICES`.

    """
    # numeric labels keep their value as the class index (ASCII digits: `'²'.isdigit()` too, but int() refuses it)
    if names and all(label.isascii() and label.isdigit() for label in names):
        top = max(int(label) for label in names)
        if top >= rows + _SPARE_CLASS_INDICES:  # checked before a class name is made for every index below it
            raise SourceLayoutError(
                f"`src` {str(src)!r}: the label {top} read as a class index makes {top + 1:,} classes for"
                f" {rows:,} row(s); class indices may exceed the rows by {_SPARE_CLASS_INDICES:,} at most."
                " Number the classes from 0, or label the rows with class names."
            )
        return [str(i) for i in range(top + 1)], {label: int(label) for label in names}
    classes = sorted(set(names))
    return classes, {name: i for i, name in enumerate(classes)}


def _float_columns(src: Path, rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The columns a ``float`` list file's values are in: ``label`` if present, else all but ``path`` and ``split``.

    Raises:
        SourceLayoutError: there is no such column.

    """
    if "label" in rows[0]:
        return ("label",)
    columns = tuple(key for key in rows[0] if key not in ("path", "split"))
    if not columns:
        raise SourceLayoutError(
            f"`src` {str(src)!r} has no column of values for `--targets float`; its columns are {sorted(rows[0])}."
            " Add a `label` column, or one column per value (`path,x,y`).\n" + _LAYOUT_HELP
        )
    return columns


def _float_spec(src: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> TargetSpec:
    """The ``float`` kind of a list file: one value per column, or as many as the first ``label`` list holds."""
    if columns != ("label",):
        if len(columns) > MAX_DIM:
            raise SourceLayoutError(
                f"`src` {str(src)!r} has {len(columns)} value columns; at most {MAX_DIM} are stored."
            )
        return TargetSpec("float", dim=len(columns), names=columns)
    first = next((_label_of(row) for row in rows if _has_path(row)), "")
    if isinstance(first, str) and first.startswith("[") and first.endswith("]"):
        first = split_label(first, ",")
    if not isinstance(first, list):
        return TargetSpec("float", dim=1, names=("label",))
    if not 1 <= len(first) <= MAX_DIM:
        raise SourceLayoutError(
            f"`src` {str(src)!r}: the first row's label holds {len(first)} values; 1 to {MAX_DIM} are stored."
        )
    return TargetSpec("float", dim=len(first))


def _float_values(row: Mapping[str, Any], columns: tuple[str, ...]) -> Any:
    """The values of a ``float`` row, to check: its columns' cells, or its ``label`` list (JSON or ``[a, b]`` text)."""
    if columns != ("label",):
        return [row.get(column) for column in columns]
    label = _label_of(row)
    if isinstance(label, str) and label.startswith("[") and label.endswith("]"):
        return split_label(label, ",")
    return label


def scan_list(src: Path, targets: str | None = None, label_separator: str = LABEL_SEPARATOR) -> ConversionPlan:
    """A plan from a list of ``path,label[,split]`` rows; relative paths are relative to the list file's folder.

    Args:
        src: the list file (``.csv``, ``.tsv`` or ``.json``).
        targets: the kind of the labels (:mod:`~lightning_fastdata.store.targets`); ``None``: classes, unless the
            labels could be read otherwise (numbers that are not integers, mostly numbers with a few other labels,
            lists, names joined by ``label_separator``), which is refused naming ``--targets``.
        label_separator: what separates the class names of a ``multilabel`` label (``cat|outdoor``).

    An image listed twice (the same path, relative to the list file's folder, once normalised: ``./a.jpg`` is
    ``a.jpg``) with the same target in the same split is converted once; its later rows are skipped and listed, so
    ``strict`` refuses them as it refuses every row it cannot convert as listed.

    Raises:
        SourceLayoutError: the file cannot be read, lacks a column, lists an image twice with different targets or in
            two splits, or its labels are ambiguous (:class:`~lightning_fastdata.store.labels.AmbiguousTargetsError`).

    """
    check_targets_option(targets, label_separator)
    rows, data = _read_list(src, ("path",) if targets in ("none", "float") else ("path", "label"))
    labels = [_label_of(row) for row in rows]
    if targets is None:
        # the rows that list an image, numbered as the skipped rows are (the first after the header is row 1)
        pairs = enumerate(zip(rows, labels, strict=True), start=1)
        labelled = [(number, label) for number, (row, label) in pairs if _has_path(row)]
        numbers = [number for number, _ in labelled]
        targets = infer_list_kind([label for _, label in labelled], str(src), label_separator, numbers)
    scan = _Scan()
    scan.digest.update(data)  # the bytes parsed: a second read could meet another file
    if targets == "multilabel":  # the separator decides the classes: another one reads another dataset
        scan.digest.update(f"\0multilabel\0{label_separator}".encode())
    spec, classes, values = _list_targets(src, rows, labels, targets, label_separator)
    split_names = [str(row.get("split") or "train").strip() for row in rows]
    counts = Counter(split_names)
    warn_split_typos({name: f"{n} row(s) with split" for name, n in counts.items()}, f"`src` {str(src)!r}")
    seen: dict[str, tuple[int, str, Any]] = {}  # an image's normalised path: its first row, split and target
    conflicts: list[str] = []
    for number, (row, value, split_name) in enumerate(zip(rows, values, split_names, strict=True), start=1):
        listed = str(row.get("path") or "").strip()
        split = canonical_split(split_name) or split_name
        if not listed or isinstance(value, _Missing):
            reason = value.reason if listed and isinstance(value, _Missing) else _NO_PATH_OR_LABEL
            scan.skipped.append(SkippedFile(f"{src} row {number}", reason))
            continue
        path = str(src.parent / Path(listed).expanduser())
        first, first_split, first_value = seen.setdefault(os.path.normpath(path), (number, split, value))
        if first == number:
            scan.add(split, path, value, listed)
        elif first_split != split or first_value != value:
            conflicts.append(_conflict(listed, (first, rows[first - 1], first_split), (number, row, split), targets))
        else:
            reason = f"{listed!r} again, as in row {first}, with the same target: converted once; remove the row"
            scan.skipped.append(SkippedFile(f"{src} row {number}", reason))
    if conflicts:
        more = (
            f" ({len(conflicts) - 1} more row(s) conflict with an earlier row of their image.)" if conflicts[1:] else ""
        )
        raise SourceLayoutError(f"`src` {str(src)!r}: {conflicts[0]}.{more}")
    plan = scan.plan(src, classes)
    plan.targets = spec
    return plan


_NO_PATH_OR_LABEL = "row without a path or a label"


def _conflict(
    listed: str, first: tuple[int, Mapping[str, Any], str], again: tuple[int, Mapping[str, Any], str], kind: str
) -> str:
    """Why an image listed twice, as ``first`` and ``again`` (row number, row, split), cannot be converted."""
    (row_a, cells_a, split_a), (row_b, cells_b, split_b) = first, again
    if split_a != split_b:  # a leak: whichever split it is dropped from, the conversion would guess
        return (
            f"{listed!r} is listed in split {split_a!r} (row {row_a}) and in split {split_b!r} (row {row_b}): the"
            " model would be evaluated on an image it trained on. Keep each image in one split: remove one of the rows"
        )
    fix = "keep one row per image"
    label_a, label_b = _label_of(cells_a), _label_of(cells_b)
    if kind in ("class", "multilabel") and isinstance(label_a, str) and isinstance(label_b, str):
        both = f"`{label_a}{LABEL_SEPARATOR}{label_b}`" if kind == "class" else "its classes"
        fix += f", or name {both} in one row" + (" and pass `--targets multilabel`" if kind == "class" else "")
    return (
        f"{listed!r} is listed twice with different labels: row {row_a} ({_cells(cells_a)}) and row {row_b}"
        f" ({_cells(cells_b)}). An image has one target: {fix}"
    )


def _cells(row: Mapping[str, Any]) -> str:
    """A row's cells but ``path`` and ``split``, for a message: ``label 'cat'``, ``x '1', y '2'``."""
    return ", ".join(f"{key} {_short_text(value)}" for key, value in row.items() if key not in ("path", "split"))


def _short_text(value: Any) -> str:
    """A list file's cell for a message: a JSON list as it is, anything else as stripped text."""
    cell = value if isinstance(value, (list, tuple)) else str(value if value is not None else "").strip()
    return short_repr(cell, 40)


@dataclass(frozen=True)
class _Missing:
    """A row whose target cannot be stored, and why (it is skipped and listed)."""

    reason: str


def _list_targets(
    src: Path, rows: list[dict[str, Any]], labels: list[Any], kind: str, separator: str
) -> tuple[TargetSpec, list[str], list[Any]]:
    """A list file's target kind, classes, and each row's target as a task holds it (or why it has none)."""
    if kind == "none":
        return TargetSpec("none"), [], [None] * len(rows)
    if kind == "float":
        columns = _float_columns(src, rows)
        spec = _float_spec(src, rows, columns)
        values: list[Any] = []
        for row in rows:
            raw = _float_values(row, columns)
            try:
                values.append(check_target(spec, raw))
            except ValueError as err:
                # a missing value says so (as pandas reads one: `NA`, `n/a`, empty, JSON null), not "not a number"
                items = raw if isinstance(raw, list) else [raw]
                gap = next((i for i in items if i is None or (isinstance(i, str) and is_missing(i.strip()))), False)
                reason = f"a missing value ({_short_text(gap)})" if gap is not False else str(err)
                values.append(_Missing(f"float target: {reason}"))
        return spec, [], values
    kept = [_has_path(row) for row in rows]
    if kind == "multilabel":
        names = [split_label(label, separator) for label in labels]
        every = [name for keep, row_names in zip(kept, names, strict=True) if keep for name in row_names]
        classes, index = _index_classes(src, every, sum(kept))
        if len(classes) > MAX_DIM:
            raise SourceLayoutError(
                f"`src` {str(src)!r}: the labels name {len(classes):,} classes; a multi-label database holds at most"
                f" {MAX_DIM:,}. Check `--label-sep` ({separator!r}), or number the classes from 0."
            )
        targets = [
            tuple(sorted({index[name] for name in row_names})) if keep else None  # an empty label: no class
            for keep, row_names in zip(kept, names, strict=True)
        ]
        return TargetSpec("multilabel"), classes, targets
    texts = [str(label) for label in labels]  # `class`: a list is one class, named as Python writes it
    # the classes of the rows that are kept: a row without a path or a label is skipped, and is no class `''`
    named = [text for keep, text in zip(kept, texts, strict=True) if keep and text]
    classes, index = _index_classes(src, named, len(named))
    missing = _Missing(_NO_PATH_OR_LABEL)
    values = [index[text] if keep and text else missing for keep, text in zip(kept, texts, strict=True)]
    return TargetSpec("class"), classes, values
