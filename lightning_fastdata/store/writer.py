"""The writer of a database: a conversion's records written into a hidden working copy, then moved into place.

:func:`write_database` carries one conversion through: take the lock of ``dst`` (``.DST.lock``), stop early when
``dst`` is up to date, encode the plan's tasks (:mod:`~lightning_fastdata.store.encode`) and write them into
``.DST.partial`` with metadata marked complete last, then move it into place. The lock, the working copy and the
move by rename are :mod:`~lightning_fastdata.store.ondisk`'s; what killed converters left is
:mod:`~lightning_fastdata.store.leftovers`'s to find and clean. The reader (:mod:`~lightning_fastdata.store.reader`)
mirrors this module; both follow :mod:`~lightning_fastdata.store.format`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import mmap
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb
from tqdm.auto import tqdm

from lightning_fastdata.__about__ import __version__
from lightning_fastdata.errors import ConversionError, DatasetFormatError, DestinationError
from lightning_fastdata.store.encode import EncodeOptions, encode_all
from lightning_fastdata.store.environments import open_readonly, read_meta, read_transaction
from lightning_fastdata.store.format import (
    DATA_FILE,
    FORMAT_VERSION,
    META_KEY,
    REPORT_FILE,
    dump_meta,
    labels_key,
    pack_record,
    partial_path,
    record_key,
    sources_key,
)
from lightning_fastdata.store.labels import AmbiguousTargetsError
from lightning_fastdata.store.leftovers import report_stale
from lightning_fastdata.store.ondisk import (
    READ_ONLY,
    check_fresh,
    dir_size,
    fresh_working_copy,
    move_into_place,
    read_only_error,
    recover_interrupted_publish,
    remove_aside,
    target_lock,
    unwritable_error,
    write_own,
)
from lightning_fastdata.store.plan import ConversionPlan
from lightning_fastdata.store.summary import ConversionSummary, SkippedFile, human_bytes
from lightning_fastdata.store.targets import MAX_DIM, MIXED_KINDS, TargetColumn

log = logging.getLogger(__name__)


INITIAL_MAP_SIZE = 1 << 28  # 256 MiB; doubled whenever the database fills it
_TXN_RECORDS = 512
_TXN_BYTES = 64 << 20

# LMDB's page layout (mdb.c of LMDB 0.9; checked on 0.9.36, which py-lmdb 3.0 bundles): what an entry costs on disk
_PAGE_HEADER = 16  # PAGEHDRSZ
_NODE_HEADER = 8  # NODESIZE: before each key in a leaf or branch page
_NODE_SLOT = 2  # sizeof(indx_t): the node's place in its page's index
_PAGE_NUMBER = 8  # sizeof(pgno_t): what a leaf node holds of a value kept on overflow pages
#: pages a commit may take from LMDB's free list rather than from the disk: the few that the commits before it freed
_REUSABLE_PAGES = 64
#: LMDB's largest page (MAX_PAGESIZE): on a system with larger pages (64 KiB on some arm64 kernels) it uses this
_MAX_PAGE = 1 << 15
#: beside ``data.mdb``: LMDB's ``lock.mdb`` (8 KiB) and the conversion report
_OTHER_FILES = 64 << 10
#: the files LMDB makes in a database folder it writes
_LMDB_FILES = (DATA_FILE, "lock.mdb")


class _PageBound:
    """An upper bound of the size of ``data.mdb`` once it holds the entries put so far: the disk space it needs.

    From LMDB's page layout: a value whose node (header, key, value) is over ``nodemax`` (2038 bytes with 4 KiB pages)
    gets whole overflow pages of its own, ``(15 + size) // page + 1`` (a 10 KiB record takes 12 KiB), and its leaf
    node holds their first page's number. Leaves filled in key order are simulated: LMDB moves a full leaf's last node
    to the new page with the next one. Keys put between others (a split whose name sorts before one written, the
    labels, sources and metadata) are counted in half-full pages, as branch pages are. Each commit copies the pages it
    changes (the path to the leaf, the free list's), freeing the old ones for the commits after the next to reuse.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._room = page_size - _PAGE_HEADER
        self._node_max = ((self._room // 2) & ~1) - _NODE_SLOT
        self.overflow = 0  # overflow pages
        self.commits = 0
        self._leaves = 1  # the leaves of the keys put in order, simulated
        self._fill = self._last = 0  # the bytes of the last such leaf, and of its last node
        self._between = self._between_runs = self._between_largest = 0  # the keys put between others
        self._top = self._previous = b""
        self._longest_key = 0

    def overflow_pages(self, key: bytes, size: int) -> int:
        """The overflow pages a value of ``size`` bytes under ``key`` takes (0: it lies in its leaf)."""
        if _NODE_HEADER + len(key) + size <= self._node_max:
            return 0
        return (_PAGE_HEADER - 1 + size) // self.page_size + 1

    def add(self, key: bytes, size: int) -> None:
        """Count an entry put under ``key`` with a value of ``size`` bytes."""
        pages = self.overflow_pages(key, size)
        self.overflow += pages
        self._longest_key = max(self._longest_key, len(key))
        node = _NODE_HEADER + len(key) + (_PAGE_NUMBER if pages else size)
        node += (node & 1) + _NODE_SLOT
        if key > self._top:
            if self._fill + node > self._room:
                self._leaves += 1
                self._fill = self._last + node
            else:
                self._fill += node
            self._last, self._top = node, key
        else:
            self._between += node
            self._between_largest = max(self._between_largest, node)
            self._between_runs += key < self._previous or self._between_runs == 0
        self._previous = key

    def nbytes(self, scale: float = 1.0) -> int:
        """The bound, in bytes; ``scale`` projects the entries so far to ``scale`` times as many alike."""
        half = (self._room - self._between_largest) // 2
        leaves = math.ceil(self._leaves * scale) + math.ceil(self._between * scale / half) + 2 * self._between_runs
        depth, level, branches = 1, leaves, 0
        per_branch = self._room // 2 // (_NODE_HEADER + self._longest_key + 1 + _NODE_SLOT)  # a node per child page
        while level > 1:
            level = math.ceil(level / per_branch)
            branches += level
            depth += 1
        # pages freed by a commit are reused two commits later: three commits' copies at a time, and a page of the
        # free list now and then
        copied = 3 * (depth + 2) + math.ceil(self.commits * scale / 8)
        return self.page_size * (2 + math.ceil(self.overflow * scale) + leaves + branches + copied)


class _NoRoom(OSError):
    """A commit that cannot fit on the disk, found before LMDB writes it."""


def _free_space(path: Path) -> int | None:
    """The bytes this process may still write on the disk of ``path``; ``None`` where the file system does not say.

    For root, the blocks the file system reserves for it count too (ext4 keeps 5%): root writes into them.
    """
    if not hasattr(os, "statvfs"):  # Windows
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks == 0:  # a pseudo or FUSE file system that reports no size
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


class _LmdbWriter:
    """Batches puts into transactions and grows ``map_size`` (doubling) whenever the database is full.

    ``bound`` counts what LMDB writes (:class:`_PageBound`); before each commit, the overflow pages it surely adds are
    checked against the free disk space, so a full disk stops the conversion with :class:`_NoRoom` before LMDB writes
    a page of it (LMDB reports a short write as ``mdb_txn_commit: Input/output error``, and the disk stays full).
    """

    def __init__(self, path: Path, map_size: int, bound: _PageBound | None = None) -> None:
        self.path = path
        self.map_size = map_size
        check_fresh(path, _LMDB_FILES)  # LMDB opens (and writes) its files through links: none may be planted
        self.env = lmdb.open(str(path), map_size=map_size, subdir=True, readahead=False, meminit=False, sync=False)
        self.bound = bound if bound is not None else _PageBound(self.env.stat()["psize"])
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._pending_pages = 0  # overflow pages

    def put(self, key: bytes, value: bytes) -> None:
        self._pending.append((key, value))
        self._pending_bytes += len(value)
        self._pending_pages += self.bound.overflow_pages(key, len(value))
        self.bound.add(key, len(value))
        if len(self._pending) >= _TXN_RECORDS or self._pending_bytes >= _TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._pending_pages > _REUSABLE_PAGES:
            needed = (self._pending_pages - _REUSABLE_PAGES) * self.bound.page_size
            free = _free_space(self.path)
            if free is not None and free < needed:
                raise _NoRoom(errno.ENOSPC, f"its next commit alone needs {human_bytes(needed)}")
        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value)
            except lmdb.MapFullError:
                self.map_size *= 2
                log.debug("LMDB map full; growing map_size to %d bytes", self.map_size)
                self.env.set_mapsize(self.map_size)
                continue
            self.bound.commits += 1
            self._pending.clear()
            self._pending_bytes = self._pending_pages = 0

    def close(self) -> None:
        try:
            self.flush()
            self.env.sync(True)
        finally:  # a full disk too: an environment left open in this process blocks a later open of its files
            self.env.close()


def _existing_meta(dst: Path) -> dict[str, Any] | None:
    """The metadata of a complete database at ``dst``, ``None`` if there is none; refuse to clobber other data."""
    if not dst.exists():
        return None
    if dst.is_dir() and not any(dst.iterdir()):
        return None
    try:
        return read_meta(dst)
    except DatasetFormatError as err:
        if (dst / DATA_FILE).is_file() and _has_meta_record(dst):
            return None  # our own incomplete or outdated database: safe to replace
        raise DestinationError(
            f"`dst` {str(dst)!r} exists and is not a lightning_fastdata database; refusing to replace it."
            " Pass a new or empty path."
        ) from err


def _has_meta_record(dst: Path) -> bool:
    """Whether the LMDB at ``dst`` holds a ``__meta__`` record, i.e. was written by lightning_fastdata."""
    try:
        with read_transaction(open_readonly(dst)) as txn:
            return txn.get(META_KEY) is not None
    except (DatasetFormatError, lmdb.Error):
        return False


def _make_parent(dst: Path) -> None:
    """Create the folder ``dst`` goes into; a file in the way or a read-only folder is a ``DestinationError``."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [dst.parent, *dst.parent.parents] if p.exists() and not p.is_dir()), dst.parent)
        raise DestinationError(
            f"`dst` {str(dst)!r} cannot be created: {str(blocker)!r} is a file, not a folder. Choose a `dst` whose"
            " parent folders are folders, or move that file away."
        ) from None
    except OSError as err:
        if err.errno in READ_ONLY:
            raise read_only_error(dst, err) from err
        raise


def _write_failure(
    err: BaseException, tmp: Path, dst: Path, plan: ConversionPlan, summary: ConversionSummary, bound: _PageBound
) -> str:
    """Why writing failed: a full disk, named with the free space and what the database needs (:class:`_PageBound`).

    A full disk is the one clear error, whether it was found before a commit (:class:`_NoRoom`) or LMDB's commit
    failed on it (``ENOSPC``, or the ``Input/output error`` of a short write where less is free than still needed).
    """
    free = _free_space(dst.parent)
    try:
        written = (tmp / DATA_FILE).stat().st_size
    except OSError:
        written = 0
    total = sum(len(tasks) for tasks in plan.tasks.values())
    if summary.written > 0:  # the records handed to LMDB so far, committed or not; the sources list is put last
        names = sum(len(name) + 4 for split_names in plan.names.values() for name in split_names)
        needed = bound.nbytes(total / summary.written) + names + _OTHER_FILES
        basis = f"LMDB's pages of the images so far: {human_bytes(round(needed / total))} per image, for {total} images"
    else:
        needed = plan.source_bytes
        basis = f"the {human_bytes(plan.source_bytes)} of the {total} source images"
    code = getattr(err, "errno", None)
    full = isinstance(err, _NoRoom) or code in (errno.ENOSPC, errno.EDQUOT) or isinstance(err, lmdb.DiskError)
    full = full or (free is not None and needed > 0 and free < needed - written)
    if not full:
        return (
            f"writing the database under {str(tmp)!r} failed: {err}. Check free disk space and permissions of"
            f" {str(dst.parent)!r}, then run the conversion again; nothing was published."
        )
    missing = max(0, needed - written - (free or 0))
    what = (
        f"stopped before filling the disk ({err.strerror})"
        if isinstance(err, _NoRoom)
        else f"failed: the disk is full (ENOSPC; LMDB said: {err})"
    )
    return (
        f"writing the database under {str(tmp)!r} {what}. {human_bytes(free or 0)} is free on the disk of"
        f" {str(dst.parent)!r}; the database needs about {human_bytes(needed)} (estimated from {basis}), so free about"
        f" {human_bytes(missing)} more, or convert onto another disk, then run the conversion again; nothing was"
        " published."
    )


def write_database(
    plan: ConversionPlan,
    dst: str | os.PathLike[str],
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    num_workers: int | None,
    strict: bool,
    force: bool,
    progress: bool,
    initial_map_size: int,
) -> ConversionSummary:
    """Convert ``plan`` into the database ``dst``, or find it up to date; the arguments are ``convert``'s.

    Raises:
        DestinationError: ``dst`` holds other data, or (without ``force``) a database of another source; or a
            symbolic link, a hard link or another user's file or folder stands where the conversion writes its lock
            file, its working copy (``.DST.partial``, and LMDB's files in it) or the database it moves aside
            (``.DST.old``): nothing is written, removed or renamed through it.
        ReadOnlyDestinationError: the folder of ``dst`` is read-only and ``dst`` is not an up-to-date database.
        ConversionError: nothing could be converted, an input was skipped under ``strict``, or writing failed.

    """
    dst = Path(dst).absolute()
    _make_parent(dst)
    encoding_meta = asdict(opts)
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"`num_workers` must be >= 0 (0 converts in this process), got {num_workers}.")
    summary = ConversionSummary(destination=str(dst), workers=num_workers or 0, ignored=list(plan.ignored))
    start = time.perf_counter()
    with target_lock(dst) as read_only:
        if read_only is None:
            recover_interrupted_publish(dst)
        old = _existing_meta(dst)
        old_source = old.get("source", {}).get("path") if old is not None else None
        # a dataset's source is only its type name: two datasets cannot be told apart, and re-running must work
        both_datasets = str(old_source).startswith("<") and plan.source.startswith("<")
        if old is not None and not force and old_source != plan.source and not both_datasets:
            raise DestinationError(
                f"`dst` {str(dst)!r} holds a database converted from {old_source!r}, not from {plan.source!r};"
                " refusing to replace it (it may be the only copy of that data). Choose another `dst`, or pass"
                " --force (`force=True`) to replace it."
            )
        if (
            old is not None
            and not force
            and plan.fingerprint is not None
            and old.get("source", {}).get("fingerprint") == plan.fingerprint
            and old.get("encoding") == encoding_meta
            and old.get("targets", {"kind": "class"}) == plan.targets.to_meta()  # `--targets` stores another kind
        ):
            summary.up_to_date = True
            summary.written = sum(s["length"] for s in old["splits"].values())
            summary.splits = {name: s["length"] for name, s in old["splits"].items()}
            return summary
        if read_only is not None:
            raise unwritable_error(dst, read_only, outdated=old is not None) from read_only

        report_stale(dst)
        tmp = partial_path(dst)
        remove_aside(dst.parent / f".{dst.name}.old")  # before any work: a planted one would stop the publish
        fresh_working_copy(tmp)
        summary.skipped.extend(plan.skipped)
        bound = _PageBound(min(mmap.PAGESIZE, _MAX_PAGE))  # LMDB's page is the system's, at most 32 KiB
        try:
            try:
                meta = _write(plan, tmp, datasets, opts, num_workers, progress, initial_map_size, summary, bound)
            except (lmdb.Error, OSError) as err:
                raise ConversionError(_write_failure(err, tmp, dst, plan, summary, bound)) from err
            summary.seconds = time.perf_counter() - start
            if strict and summary.skipped:
                raise ConversionError(
                    f"{len(summary.skipped)} input(s) could not be converted and `strict` is set; nothing was"
                    f" written to {str(dst)!r}. First: {summary.skipped[0].path}: {summary.skipped[0].reason}."
                    " Fix or remove those files, or convert without --strict to skip them."
                )
            if summary.written == 0:
                first = f" First: {summary.skipped[0].path}: {summary.skipped[0].reason}." if summary.skipped else ""
                raise ConversionError(f"none of the {len(summary.skipped)} inputs could be converted.{first}")
            summary.bytes_out = dir_size(tmp)
            report = {"meta": meta, **summary.to_dict()}
            try:
                write_own(tmp / REPORT_FILE, json.dumps(report, indent=2, default=str).encode())
            except OSError as err:
                raise ConversionError(
                    f"writing {REPORT_FILE} under {str(tmp)!r} failed: {err}. Check free disk space; nothing"
                    " was published."
                ) from err
            move_into_place(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return summary


def _write(
    plan: ConversionPlan,
    tmp: Path,
    datasets: Mapping[str, Any] | None,
    opts: EncodeOptions,
    workers: int | None,
    progress: bool,
    initial_map_size: int,
    summary: ConversionSummary,
    bound: _PageBound,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "complete": False,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "writer": f"lightning_fastdata {__version__}",
        "encoding": asdict(opts),
        "source": {"path": plan.source, "fingerprint": plan.fingerprint},
    }
    all_tasks = [task for split_tasks in plan.tasks.values() for task in split_tasks]
    all_names = [name for split in plan.tasks for name in plan.names.get(split, [])]
    if len(all_names) != len(all_tasks):
        all_names = [f"{task[0]}[{task[1]}]" for task in all_tasks]
    spec = plan.targets
    if spec.kind in ("class", "multilabel") and plan.classes is not None:
        spec = dataclasses.replace(spec, num_classes=len(plan.classes))
    elif spec.kind == "multilabel":  # indices of a dataset without class names: checked against the largest kind
        spec = dataclasses.replace(spec, num_classes=MAX_DIM)
    columns = {split: TargetColumn(spec) for split in plan.tasks}
    sources: dict[str, list[str]] = {split: [] for split in plan.tasks}
    class_to_idx = {name: i for i, name in enumerate(plan.classes)} if plan.classes is not None else None
    bar = tqdm(total=len(all_tasks), unit="img", desc=f"convert {Path(plan.source).name}", disable=not progress)
    # The pool starts before the LMDB environment opens: a forked child must never inherit an open environment.
    with bar, encode_all(all_tasks, datasets, opts, workers, (spec, class_to_idx, plan.targets_inferred)) as encoded:
        summary.workers = encoded.workers
        writer = _LmdbWriter(tmp, initial_map_size, bound)
        try:
            writer.put(META_KEY, dump_meta(meta))  # complete=False until the very end
            writer.flush()
            for task, name, result in zip(all_tasks, all_names, encoded.results, strict=True):
                split = task[0]
                summary.bytes_in += result.bytes_in
                if result.reason is not None or result.payload is None:
                    shown = task[1] if isinstance(task[1], str) else f"{split}[{task[1]}]"
                    if str(result.reason).startswith(MIXED_KINDS):  # inferred from the first sample, wrongly
                        raise AmbiguousTargetsError(
                            f"the dataset's targets are not all of one kind: {shown}'s"
                            f" {str(result.reason)[len(MIXED_KINDS) :].strip()}. Pass `targets=` ('class',"
                            " 'multilabel', 'float' or 'none') to say what they are; nothing was written."
                        )
                    summary.skipped.append(SkippedFile(str(shown), str(result.reason)))
                    bar.set_postfix(skipped=len(summary.skipped), refresh=False)
                else:
                    column = columns[split]
                    label = column.add(result.label)
                    record = pack_record(result.encoding, label, result.height, result.width, result.payload)
                    writer.put(record_key(split, len(column) - 1), record)
                    sources[split].append(name)
                    summary.written += 1  # live, with bytes_out: a full disk's message estimates the space needed
                    summary.bytes_out += len(record)
                bar.update()
            classes = plan.classes
            if spec.kind in ("class", "multilabel"):
                top = max((column.top() for column in columns.values()), default=-1)
                if classes is None:
                    classes = [str(i) for i in range(top + 1)]
                elif top >= len(classes):
                    raise ConversionError(
                        f"a label is >= the number of classes ({len(classes)}); pass the full `classes`."
                    )
                spec = dataclasses.replace(spec, num_classes=len(classes))
            else:
                classes = []
            meta["classes"] = classes
            meta["targets"] = spec.to_meta()
            meta["splits"] = {}
            for split, column in columns.items():
                column.spec = spec
                if spec.kind == "class":
                    writer.put(labels_key(split), column.labels().tobytes())
                for key, value in column.arrays(split).items():
                    writer.put(key, value)
                writer.put(sources_key(split), json.dumps(sources[split]).encode())
                meta["splits"][split] = {"length": len(column), **column.split_meta(split)}
            summary.add_targets(spec, classes, meta["splits"])
            meta["complete"] = True
            writer.put(META_KEY, dump_meta(meta))
        except BaseException:
            writer.env.close()  # drop pending writes: the partial directory is deleted by the caller
            raise
        writer.close()
    summary.splits = {split: len(column) for split, column in columns.items()}
    summary.written = sum(summary.splits.values())
    return meta
