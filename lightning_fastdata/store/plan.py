"""What scanning a source yields, a :class:`ConversionPlan` collected by a :class:`SourceScan`, and what layouts share.

A source is read by :mod:`~lightning_fastdata.store.sources` (image folders, roots of split folders) or
:mod:`~lightning_fastdata.store.listfiles` (``path,label`` list files); both fill a :class:`SourceScan`, which checks
each file it is given (a regular file, readable) and fingerprints the source, and both read the same split names
(:func:`canonical_split`, :func:`warn_split_typos`), the same ``targets`` option (:func:`check_targets_option`) and the
same limits on a source image (:data:`MAX_SOURCE_BYTES`, which the encoder applies when it reads the file).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import stat
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from lightning_fastdata._files import file_kind
from lightning_fastdata.errors import SourceLayoutError
from lightning_fastdata.store.summary import SkippedFile
from lightning_fastdata.store.targets import KINDS, TargetSpec

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


#: how a refusal of a source's layout ends: the layouts a source may have
LAYOUT_HELP = """Expected an ImageFolder tree:
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


class SourceScan:
    """Collects tasks, the source fingerprint, and the inputs skipped before conversion (unreadable paths)."""

    def __init__(self) -> None:
        self.tasks: dict[str, list[Task]] = {}
        self.names: dict[str, list[str]] = {}
        self.skipped: list[SkippedFile] = []
        self.ignored: list[SkippedFile] = []
        self.digest = hashlib.sha256()
        self.bytes = 0

    def add(self, split: str, path: str, label: Any, name: str) -> None:
        """Add the file ``path`` as a task of ``split``, named ``name``; or skip it, saying why, if it is no file."""
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
        """The plan of the source ``src``: the tasks added, with ``classes``.

        Raises:
            SourceLayoutError: no file was added or skipped: ``src`` holds no image file.

        """
        if not any(self.tasks.values()) and not self.skipped:
            exts = " ".join(IMG_EXTENSIONS)
            raise SourceLayoutError(
                f"found no image files under {str(src)!r} (looked for {exts}, any case, in the class folders).\n"
                f"{LAYOUT_HELP}"
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
