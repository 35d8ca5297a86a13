"""The part files of a prediction run: each process's rows, and rank zero's merge of them into the output.

Each process streams its rows to a hidden part file beside the output, ``.NAME.rank<R>.part``: one line a row, the
sample index, the row kind and the JSON value (:mod:`~lightning_fastdata.prediction_rows`), tab-separated, so no
process holds the predictions in memory. After the last batch rank zero indexes the parts (each sample's first row
as a part and a byte offset, two integers a sample), checks that they cover the split and that a sample's repeats
agree with its first row, writes the rows in sample order to ``.NAME.<pid>.tmp`` under a lock, syncs it and renames
it into place. The parts are removed once the file is published, and kept when the merge fails.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fastdata.errors import SampleError
from lightning_fastdata.prediction_rows import CLASS, MULTI, RAW, VALUES, RowLayout

try:
    import fcntl
except ImportError:  # not on Windows: left-over merges are not cleared there
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

Format = Literal["csv", "jsonl"]

#: two predictions of one sample agree when each float differs by at most this fraction of the largest magnitude in
#: them: two steps of bfloat16 (a padded sample is predicted again in another batch, where a GPU may sum in another
#: order, in TF32 or under bf16-mixed precision); anything else (a class, an integer, a string) must be equal
_REPEAT_TOLERANCE = 2.0**-6


class PartFiles:
    """The part files beside ``output_path``: this process's, written row by row, and the merge that publishes them.

    Args:
        output_path: the file the merge publishes.
        format: ``"csv"`` or ``"jsonl"``.

    """

    def __init__(self, output_path: Path, format: Format) -> None:
        self.output_path = output_path
        self.format: Format = format
        self._part: IO[bytes] | None = None

    def path(self, rank: int) -> Path:
        """The part file rank ``rank`` streams its rows to: hidden, beside ``output_path``."""
        return self.output_path.with_name(f".{self.output_path.name}.rank{rank}.part")

    @property
    def is_open(self) -> bool:
        """Whether this process's part file is open for rows."""
        return self._part is not None

    def open(self, rank: int) -> None:
        """Start rank ``rank``'s part file afresh (a part left open is closed first)."""
        self.close()
        self._part = open(self.path(rank), "wb")  # noqa: SIM115 - open until the merge

    def write(self, indices: Sequence[int], kind: bytes, values: Sequence[Any]) -> None:
        """Append one batch's rows of ``kind``: sample ``indices[i]``'s value is ``values[i]``."""
        assert self._part is not None
        lines = [
            b"%d\t%s\t%s\n" % (int(index), kind, json.dumps(value, ensure_ascii=False).encode())
            for index, value in zip(indices, values, strict=True)
        ]
        self._part.write(b"".join(lines))

    def close(self) -> None:
        """Close this process's part file (idempotent)."""
        if self._part is not None:
            self._part.close()
            self._part = None

    def merge(self, world_size: int, layout: RowLayout, samples: int | None = None) -> int:
        """Write the rows of the parts of ranks ``0..world_size-1``, each sample once, in sample order; remove them.

        With ``samples``, the parts must cover samples ``0..samples-1`` of the split, and no other; otherwise nothing is
        written and the parts are kept. A sample's repeats (the sampler's padding) must agree with its first row, and
        more of them than ``DistributedSampler`` pads ``world_size`` processes with warn. ``layout`` makes the rows.
        Returns the number of rows written.

        Raises:
            FileNotFoundError: a part is missing (another node's disk).
            SampleError: a sample has two rows whose predictions differ (a ``RuntimeError``).
            RuntimeError: ``samples`` are not all covered, or indices lie beyond them.

        """
        parts = [self.path(rank) for rank in range(world_size)]
        missing = [str(part) for part in parts if not part.is_file()]
        if missing:
            raise FileNotFoundError(
                f"the part files {missing} are missing: on several nodes, `output_path` {str(self.output_path)!r}"
                " must be on storage that every node shares."
            )
        # where each sample's first row is: part and byte offset, one pair of integers per sample (not its row)
        part_of, offset_of, kinds, repeats = self._index(parts, layout)
        if samples is not None:
            self._check_coverage(part_of, samples, parts)
        _say_repeats(repeats, world_size, samples)
        self._remove_dead_merges()
        tmp = self.output_path.with_name(f".{self.output_path.name}.{os.getpid()}.tmp")
        rows = 0
        try:
            with contextlib.ExitStack() as stack:
                readers = [stack.enter_context(open(part, "rb")) for part in parts]
                out = stack.enter_context(open(tmp, "w", encoding="utf-8", newline=""))
                if fcntl is not None:  # held while merging: a later run can tell a live merge from a dead one's file
                    with contextlib.suppress(OSError):
                        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                columns = layout.columns(kinds)
                emit = _csv_rows(out, columns) if self.format == "csv" else _jsonl_rows(out)
                for index in np.flatnonzero(part_of >= 0):
                    reader = readers[part_of[index]]
                    reader.seek(int(offset_of[index]))
                    _, kind, value = reader.readline().rstrip(b"\n").split(b"\t", 2)
                    emit(layout.row(int(index), kind, json.loads(value)))
                    rows += 1
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.output_path)
        finally:
            tmp.unlink(missing_ok=True)
        for part in parts:
            part.unlink(missing_ok=True)
        return rows

    def _remove_dead_merges(self) -> None:
        """Remove the ``.NAME.<pid>.tmp`` files of merges that were killed (no process holds their lock)."""
        if fcntl is None:
            return
        for stale in self.output_path.parent.glob(f".{self.output_path.name}.*.tmp"):
            with contextlib.suppress(OSError), open(stale, "rb") as fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a live merge holds it
                stale.unlink()
                log.info("removed %s, left by a merge that was killed", stale)

    def _check_coverage(self, part_of: np.ndarray, samples: int, parts: Sequence[Path]) -> None:
        """Raise unless the parts (``part_of``: each sample's part, -1 for none) hold samples ``0..samples-1`` only."""
        # with the samples past the last index seen: none of them was predicted
        missing = np.concatenate([np.flatnonzero(part_of[:samples] < 0), np.arange(len(part_of), samples)])
        beyond = np.flatnonzero(part_of >= 0)
        beyond = beyond[beyond >= samples]
        if not len(missing) and not len(beyond):
            return
        if len(missing):
            found, indices = f"{len(missing)} of {samples} samples of the predicted split have no prediction", missing
        else:
            where = "an index" if len(beyond) == 1 else f"{len(beyond)} indices"
            found, indices = f"the predictions name {where} beyond the split's {samples} samples", beyond
        first = ", ".join(str(i) for i in indices[:5]) + (", ..." if len(indices) > 5 else "")
        raise RuntimeError(
            f"{found} (indices [{first}]): `output_path` {str(self.output_path)!r} was not written; the part files are"
            f" kept: {', '.join(str(part) for part in parts)}. A sampler of one's own leaves samples out (a"
            " `DistributedSampler` with `drop_last=True`, or with a `num_replicas` other than the run's): predict"
            " every sample, or, to predict part of a split on purpose, a `torch.utils.data.Subset` of it or the"
            " first batches (`limit_predict_batches`)."
        )

    def _index(self, parts: Sequence[Path], layout: RowLayout) -> tuple[np.ndarray, np.ndarray, set[bytes], int]:
        """Per sample index: its first row's part (-1: none) and byte offset; the row kinds; the repeated rows.

        Each row that repeats a sample is checked against the sample's first row (:meth:`_check_repeat`).
        """
        size = 0
        for part in parts:
            with open(part, "rb") as fh:
                for line in fh:
                    size = max(size, int(line.split(b"\t", 1)[0]) + 1)
        part_of = np.full(size, -1, dtype=np.int32)
        offset_of = np.zeros(size, dtype=np.int64)
        kinds: set[bytes] = set()
        repeats = 0
        with contextlib.ExitStack() as stack:
            # each part opened once more, to read a repeated sample's first row back (repeats are few: the padding)
            firsts: list[IO[bytes] | None] = [None] * len(parts)
            for number, part in enumerate(parts):
                offset = 0
                with open(part, "rb") as fh:
                    for line in fh:
                        index, kind, _ = line.split(b"\t", 2)
                        i = int(index)
                        if part_of[i] < 0:
                            part_of[i], offset_of[i] = number, offset
                            kinds.add(kind)
                        else:
                            repeats += 1
                            first_part = int(part_of[i])
                            first = firsts[first_part]
                            if first is None:
                                first = firsts[first_part] = stack.enter_context(open(parts[first_part], "rb"))
                            first.seek(int(offset_of[i]))
                            self._check_repeat(layout.where(i), first.readline(), first_part, line, number, parts)
                        offset += len(line)
        return part_of, offset_of, kinds, repeats

    def _check_repeat(
        self, where: str, first: bytes, first_rank: int, again: bytes, rank: int, parts: Sequence[Path]
    ) -> None:
        """Raise unless two rows of the sample ``where`` names (part lines of ranks ``first_rank``, ``rank``) agree."""
        first_kind, first_value = first.rstrip(b"\n").split(b"\t", 2)[1:]
        kind, value = again.rstrip(b"\n").split(b"\t", 2)[1:]
        if first_kind == kind and (first_value == value or agree(json.loads(first_value), json.loads(value))):
            return
        raise SampleError(
            f"{where} was predicted twice with different results: {_shown(first_kind, first_value)} by rank"
            f" {first_rank} and {_shown(kind, value)} by rank {rank}. A sample predicted more than once (the"
            " `DistributedSampler` pads the processes with repeats) must get the same prediction, or the file could"
            " hold either: a `predict_step` that draws (dropout left on, a random test-time augmentation) or a"
            " dataset whose index names another sample on each process gives different ones. Make `predict_step`"
            " deterministic and give every process the same dataset. `output_path`"
            f" {str(self.output_path)!r} was not written; the part files are kept:"
            f" {', '.join(str(part) for part in parts)}."
        )


def _say_repeats(repeats: int, world_size: int, samples: int | None) -> None:
    """Warn when more rows repeat a sample than ``DistributedSampler`` pads ``world_size`` processes with."""
    # `DistributedSampler` (without `drop_last`) pads the ranks to equal shares with the first samples again:
    # up to `world_size - 1` of them, exactly `-samples % world_size` when the split's size is known
    padding = (-samples) % world_size if samples is not None else world_size - 1
    if repeats <= padding:
        return
    rows = "row repeats a sample" if repeats == 1 else "rows repeat samples"
    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    pads = f"the {padding} repeats `DistributedSampler` pads {processes} with"
    pads += f" for {samples} samples" if samples is not None else " at most"
    rank_zero_warn(
        f"PredictionWriter: {repeats} prediction {rows} already predicted, more than {pads}. Their"
        " predictions agree and each sample is written once, but the predict loader read those samples more"
        " than once: a sampler of one's own that draws with replacement, or one that gives every process all"
        " the samples (a `DistributedSampler` with `num_replicas=1` under DDP), predicts the data twice or more."
        " If that was not meant, give the predict loader a sampler that reads each sample once."
    )


def _csv_rows(out: IO[str], columns: list[str]) -> Callable[[dict[str, Any]], None]:
    writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()

    def emit(row: dict[str, Any]) -> None:
        for key in ("output", "labels", "classes", "value"):
            if key in row and (key == "output" or isinstance(row[key], list)):
                row[key] = json.dumps(row[key], ensure_ascii=False)
        writer.writerow({k: "" if v is None else v for k, v in row.items()})

    return emit


def _jsonl_rows(out: IO[str]) -> Callable[[dict[str, Any]], None]:
    def emit(row: dict[str, Any]) -> None:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")

    return emit


def agree(first: Any, again: Any) -> bool:
    """Whether two predictions of one sample (JSON values) are the same: floats up to float noise, the rest equal."""
    scale = max((abs(x) for x in _floats(first) + _floats(again)), default=0.0)
    return _same(first, again, _REPEAT_TOLERANCE * scale)


def _floats(value: Any) -> list[float]:
    """Every float in a JSON value."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, list):
        return [x for item in value for x in _floats(item)]
    if isinstance(value, dict):
        return [x for item in value.values() for x in _floats(item)]
    return []


def _same(first: Any, again: Any, tolerance: float) -> bool:
    """JSON values equal, but for floats that differ by at most ``tolerance``."""
    if isinstance(first, float) and isinstance(again, float):
        return abs(first - again) <= tolerance
    if isinstance(first, list) and isinstance(again, list):
        return len(first) == len(again) and all(_same(a, b, tolerance) for a, b in zip(first, again, strict=True))
    if isinstance(first, dict) and isinstance(again, dict):
        return first.keys() == again.keys() and all(_same(first[k], again[k], tolerance) for k in first)
    return type(first) is type(again) and first == again


def _shown(kind: bytes, value: bytes, limit: int = 120) -> str:
    """A part row's prediction for a message: its JSON text, cut to ``limit`` characters, and its kind."""
    text = value.decode("utf-8", "replace")
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    name = {CLASS: "class", MULTI: "classes", VALUES: "values", RAW: "output"}.get(kind, "row")
    return f"{name} {text}"
