"""What interrupted conversions and stagings leave beside a target, found (:func:`stale_conversions`) and cleaned.

A killed converter or staging leaves its working copy (``.NAME.partial``), a database moved aside (``.NAME.old``) or
its lock file (``.NAME.lock``); ``lightning-fastdata convert --clean`` removes them (:func:`clean_stale_conversions`),
each under the target's lock (:func:`~lightning_fastdata.store.ondisk.target_lock`), and puts back a database moved
aside whose replacement never came. What is not this user's own is never removed, restored or followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from pathlib import Path

from lightning_fastdata.store.format import DATA_FILE, PROGRESS_FILE, converter_of, parse_json, partial_path
from lightning_fastdata.store.ondisk import (
    dir_size,
    foreign_kind,
    not_own,
    read_small,
    target_lock,
    unwritable_error,
)
from lightning_fastdata.store.summary import human_bytes

log = logging.getLogger(__name__)


def stale_conversions(folder: str | os.PathLike[str]) -> list[Path]:
    """What interrupted conversions left in ``folder``: working copies and lock files that no running converter holds.

    Each ``.NAME.partial`` (an unfinished database), ``.NAME.old`` (a replaced one) and ``.NAME.lock`` whose lock is
    not held by a live converter is listed; those of a conversion under way are not. Only this user's own folders are
    listed, and lock files that are regular files of one name: a link, a hard link or another user's folder under
    such a name was not left by this user's conversion, and is never removed or restored (see
    :func:`clean_stale_conversions`).
    """
    return _leftovers(folder)[0]


def _leftovers(folder: str | os.PathLike[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """:func:`stale_conversions`, and what stands under a leftover's name but is not this user's own, with what it is.

    The latter are those that, followed, look like a leftover (:func:`_looks_ours`): a link to a database named
    ``.NAME.old``, say, which restoring would make ``NAME`` a link to data this user never converted.
    """
    root = Path(folder).expanduser().absolute()
    try:
        names = sorted(e.name for e in os.scandir(root) if e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    stale, foreign = [], []
    for name in names:
        for suffix in (".partial", ".old", ".lock"):
            if name.endswith(suffix) and len(name) > len(suffix) + 1:
                path, target = root / name, root / name[1 : -len(suffix)]
                what = _not_left_by_us(path)
                if what is not None:
                    if _looks_ours(path, target):
                        foreign.append((path, what))
                elif _looks_ours(path, target) and converter_of(target) is None:
                    stale.append(path)
    return stale, foreign


def _not_left_by_us(path: Path) -> str | None:
    """What ``path`` (a leftover's name) is when no conversion of this user's left it (:func:`foreign_kind`), or None.

    A lock file that is a regular file of one name passes whoever owns it: taking its lock says whose it is.
    """
    try:
        found = os.lstat(path)
    except OSError:
        return None  # gone meanwhile: nothing to say of it (nor does it look like a leftover any longer)
    if path.suffix == ".lock" and stat.S_ISREG(found.st_mode) and found.st_nlink == 1:
        return None
    return foreign_kind(found, directory=path.suffix != ".lock")


def _looks_ours(path: Path, target: Path) -> bool:
    """Whether ``path`` (``.NAME.partial``, ``.NAME.old`` or ``.NAME.lock``), followed, looks left by a conversion.

    Not another program's: a database folder (or a working copy not yet started), or a lock file beside one or
    holding a converter's record. Whether it is this user's own is :func:`_not_left_by_us`'s to say.
    """
    if path.suffix == ".lock":
        if not path.is_file():
            return False
        if (target / DATA_FILE).is_file() or partial_path(target).is_dir():
            return True
        with contextlib.suppress(UnicodeDecodeError, ValueError):
            record = parse_json(read_small(path, 4096) or b"null")  # a converter's record is some 100 bytes
            return isinstance(record, dict) and "pid" in record and "host" in record
        return False
    return path.is_dir() and ((path / DATA_FILE).is_file() or _staging(path) or not any(path.iterdir()))


def _staging(path: Path) -> bool:
    """Whether the working copy ``path`` is a staging's (it holds ``progress.json``), not a conversion's."""
    return (path / PROGRESS_FILE).is_file()


def clean_stale_conversions(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what interrupted conversions left in ``folder`` (:func:`stale_conversions`); one line per action.

    A ``.NAME.old`` whose database ``NAME`` is missing (a conversion died while replacing it) is put back as
    ``NAME`` rather than removed. Each ``NAME``'s leftovers are removed while holding its conversion lock, so a
    conversion that starts meanwhile is never touched. A link, a hard link or another user's folder under a
    leftover's name is left as it is, and named in a line of its own.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ReadOnlyDestinationError: ``folder`` is read-only.

    """
    root = Path(folder).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"`folder` {str(root)!r} does not exist or is not a folder. Pass the folder to clean.")
    stale, foreign = _leftovers(root)
    leftovers: dict[Path, list[Path]] = {}
    for path in stale:
        leftovers.setdefault(root / path.name[1 : -len(path.suffix)], []).append(path)
    done = []
    for target, paths in leftovers.items():
        try:
            with target_lock(target, wait=False) as read_only:
                if read_only is not None:
                    raise unwritable_error(target, read_only) from read_only
                done += [_clean(path, target) for path in paths]
        except BlockingIOError:
            continue  # a conversion to `target` started meanwhile: its files are in use
    for path, what in foreign:
        kind = "file" if path.suffix == ".lock" else "folder"
        done.append(
            f"left {str(path)!r} as it is: it is {what}, where an interrupted conversion leaves a {kind} of this"
            f" user's; nothing was removed, restored or followed through it. Unless you made it, remove it, and check"
            f" who else can write to {str(root)!r}."
        )
    return done


def _clean(path: Path, target: Path) -> str:
    """Remove (or, for a database moved aside, put back) one leftover of a conversion to ``target``.

    Raises:
        DestinationError: ``path``, listed as this user's folder, was replaced by a link or another user's since.

    """
    if path.suffix != ".lock":
        try:
            refused = not_own(path, os.lstat(path), directory=True)
        except FileNotFoundError:
            return f"{path} is gone already"
        if refused is not None:
            raise refused
    if path.suffix == ".old" and not os.path.lexists(target):
        os.replace(path, target)
        return f"restored {target} from {path.name}, left by a conversion interrupted while replacing it"
    if path.suffix != ".lock":
        size, what = dir_size(path), "staging" if _staging(path) else "conversion"
        shutil.rmtree(path, ignore_errors=True)
        return f"removed {path} ({human_bytes(size)}), left by an interrupted {what}"
    return f"removed {path}, the lock file of a conversion that is no longer running"  # removed when the lock ends


def report_stale(dst: Path) -> None:
    """Name the working copies that dead converters left beside ``dst`` (this one's own is replaced anyway)."""
    own = partial_path(dst)
    stale = [p for p in stale_conversions(dst.parent) if p.suffix == ".partial" and p != own]
    if stale:
        sizes = sum(dir_size(p) for p in stale if p.is_dir())
        log.warning(
            "%d incomplete conversion(s) left by converters that are no longer running take %s in %s: %s. Remove them"
            " with `lightning-fastdata convert --clean %s`.",
            len(stale),
            human_bytes(sizes),
            dst.parent,
            ", ".join(p.name for p in stale),
            dst.parent,
        )
