"""``PredictionWriter``: ``trainer.predict``'s outputs written to a CSV or JSON Lines file, one row per sample.

Each process streams its rows, tagged with their sample index, to a part file beside the output; after the last
batch, rank zero checks that they hold every sample of the split, merges them in sample order, drops the duplicates
that ``DistributedSampler`` pads with (once it has checked that they agree), and publishes the file under its final
name by a rename. A run that stops early publishes nothing; one whose parts miss samples, or predict a sample twice
with different results, raises and keeps them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fastdata.errors import InvalidArgumentError, SampleError
from lightning_fastdata.pipeline.kernel import BatchReader
from lightning_fastdata.pipeline.targets import subset_view
from lightning_fastdata.splits import split_sources
from lightning_fastdata.store.reader import LmdbImageDataset

try:
    import fcntl
except ImportError:  # not on Windows: left-over merges are not cleared there
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

Format = Literal["csv", "jsonl"]

#: file suffixes that name a format when ``format`` is left out
_SUFFIXES: dict[str, Format] = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
#: the output's columns, in order (a float DataModule's value names go before ``output``); a column appears when some
#: row has it
_COLUMNS = ("index", "source", "label", "class", "labels", "classes", "value", "output")
#: a part file's row kinds: a class (``label``, ``class``), the classes of a multi-label sample (``labels``,
#: ``classes``), a float target's values (``value``, or one column per name) or a raw model output (``output``)
_CLASS, _MULTI, _VALUES, _RAW = b"c", b"m", b"v", b"r"
#: two predictions of one sample agree when each float differs by at most this fraction of the largest magnitude in
#: them: two steps of bfloat16 (a padded sample is predicted again in another batch, where a GPU may sum in another
#: order, in TF32 or under bf16-mixed precision); anything else (a class, an integer, a string) must be equal
_REPEAT_TOLERANCE = 2.0**-6


class PredictionWriter(BasePredictionWriter):
    r"""Writes ``trainer.predict``'s outputs to a CSV or JSON Lines file, one row per sample, in the data's order.

    Each row holds the sample's ``index`` in the predicted split and its ``source`` (the image's path relative to
    the converted folder, from :meth:`~lightning_fastdata.FastImageDataModule.predict_sources`), then what
    ``predict_step`` returned for it. When the predict dataset is a ``torch.utils.data.Subset`` (or a subset of one),
    ``index`` is the sample's index in the dataset the subsets view, so ``index`` and ``source`` name the sample that
    was predicted; the rows follow the subset's order. The row's content:

    - a float tensor of shape ``(N, C)`` with ``C`` the DataModule's number of classes is read as logits (or
      probabilities): ``label`` is the arg-max and ``class`` its class name;
    - an integer tensor of shape ``(N,)`` is read as class indices: ``label`` and ``class``;
    - for a DataModule of multi-label targets (``target_kind == "multilabel"``), a float tensor ``(N, C)`` is read as
      logits instead: ``labels`` lists the indices of the classes whose sigmoid is above ``threshold`` and
      ``classes`` their names (a JSON list; in a CSV file its JSON text);
    - for a DataModule of ``float`` targets of K values, a float tensor ``(N, K)`` (or ``(N,)`` when K = 1) is read
      as the values: one column per value under the DataModule's names for them when it knows them
      (``target_spec.names``), else ``value`` (a number, or a list of K);
    - anything else is written as it is, per sample, in ``output`` (a JSON value: a tensor or array of first
      dimension ``N`` gives one row each, a mapping one object each, a list or tuple of length ``N`` one item each).

    In a CSV file ``output`` holds the JSON text; a column no row uses is left out. Without a DataModule that knows its
    classes (``classes``) and sources (``predict_sources()``), ``class`` and ``source`` are left out.

    **Under DDP** every process streams its rows, with their sample indices, to a hidden part file beside
    ``output_path`` (``.NAME.rank<R>.part``), so no process holds the predictions in memory. After the last batch,
    rank zero merges the parts in sample order, keeps each sample once (``DistributedSampler`` repeats up to
    ``world_size - 1`` to give every process as many batches) and removes the parts. A sample predicted more than
    once must get the same prediction each time (floats within float noise: two steps of bfloat16 of the
    prediction's largest value): otherwise rank zero raises a :class:`~lightning_fastdata.SampleError` naming the
    sample and both predictions, writes nothing and keeps the parts. More repeats than the sampler pads with
    (a loader that reads samples twice) warn, and each sample is written once. On several nodes ``output_path`` must
    be on storage every node shares.

    The file appears whole, under its name, only when the run completes: it is written under a temporary name and
    renamed. A run that stops early (an error, Ctrl-C) leaves no new file and no parts, and a previous file of that
    name as it was.

    **Every sample of the split** must have a row: if the parts miss some (a sampler of one's own that leaves samples
    out), rank zero raises a ``RuntimeError`` that counts and names them, writes nothing, and keeps the parts. Only a
    ``limit_predict_batches`` that stops the loader early leaves samples out on purpose: then the batches that ran
    are written, unchecked, and the log says how many ran.

    Use ``trainer.predict(..., return_predictions=False)`` (``--return_predictions false`` on the command line) so
    that Lightning does not also keep every output in memory.

    Args:
        output_path: the file to write (``.csv``, ``.jsonl``; ``~`` is expanded); its folder is created. An existing
            file is replaced when the run completes.
        format: ``"csv"`` or ``"jsonl"`` (JSON Lines); default: from the suffix of ``output_path``.
        threshold: for multi-label targets, a class is predicted when the sigmoid of its logit is above this.

    Raises:
        InvalidArgumentError: ``format`` is not ``"csv"``, ``"jsonl"`` or ``None``, it is ``None`` and the suffix
            names neither, ``output_path`` is a folder, or ``threshold`` is not in [0, 1] (a ``ValueError``).

    Example::

        from lightning_fastdata import FastImageDataModule, PredictionWriter

        trainer = Trainer(callbacks=[PredictionWriter("predictions.csv")])
        trainer.predict(model, datamodule=FastImageDataModule("data/"), return_predictions=False)

    From the command line::

        lightning-fastdata predict --config config.yaml --ckpt_path best.ckpt \
            --trainer.callbacks+=lightning_fastdata.PredictionWriter \
            --trainer.callbacks.output_path=predictions.csv

    """

    def __init__(self, output_path: str, format: Format | None = None, threshold: float = 0.5) -> None:
        super().__init__("batch")
        path = Path(output_path).expanduser()
        if format is None:
            format = _SUFFIXES.get(path.suffix.lower())
            if format is None:
                raise InvalidArgumentError(
                    f"`output_path` {output_path!r} does not say the format by its suffix: name a `.csv` or `.jsonl`"
                    " file, or pass `format='csv'` or `format='jsonl'`."
                )
        elif format not in ("csv", "jsonl"):
            raise InvalidArgumentError(f"`format` must be 'csv', 'jsonl' or None (from the suffix), got {format!r}.")
        if path.is_dir():
            raise InvalidArgumentError(f"`output_path` {output_path!r} is a folder; name a file in it to write.")
        if not 0 <= threshold <= 1:
            raise InvalidArgumentError(f"`threshold` must be in [0, 1] (a sigmoid's output), got {threshold}.")
        self.threshold = threshold
        #: the DataModule's target kind and, for ``float`` targets, their count and the columns named for them
        self._kind = "class"
        self._dim = 0
        self._names: list[str] | None = None
        self.output_path = path
        self.format: Format = format
        self._part: IO[bytes] | None = None
        self._classes: list[str] | None = None
        self._sources: list[str] | None = None
        #: the split that ``_sources`` names the files of (``None``: not known)
        self._sources_of: str | None = None
        #: samples of the predicted split the parts must cover (``None``: not checked), and the batches that ran of
        #: those the loader has, when `limit_predict_batches` cut it short
        self._samples: int | None = None
        self._limited: tuple[int, int] | None = None
        #: each sample index of the predict loader's dataset -> its index in the dataset its subsets view (``None``:
        #: no subset, the same index)
        self._indices: np.ndarray | None = None
        #: every rank's part was complete: a failed merge keeps them
        self._parts_complete = False

    def part_path(self, rank: int) -> Path:
        """The part file rank ``rank`` streams its rows to: hidden, beside ``output_path``."""
        return self.output_path.with_name(f".{self.output_path.name}.rank{rank}.part")

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "predict":
            return
        self._parts_complete = False
        datamodule = trainer.datamodule
        if getattr(datamodule, "on_bad_sample", "raise") == "skip":
            raise InvalidArgumentError(
                "`PredictionWriter` needs every sample of a batch to be predicted, but the DataModule has"
                " `on_bad_sample='skip'`, which leaves bad samples out of their batch: rows could not be matched to"
                " their files. Predict with `on_bad_sample='raise'`."
            )
        self._classes = None
        self._sources = None
        with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
            self._classes = [str(name) for name in datamodule.classes]  # type: ignore[union-attr]
        self._kind, self._dim, self._names = "class", 0, None
        with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
            spec = datamodule.target_spec  # type: ignore[union-attr]
            self._kind, self._dim = str(spec.kind), int(spec.dim)
            names = [str(name) for name in spec.names]
            if len(names) == self._dim and len(set(names)) == len(names) and not set(names) & set(_COLUMNS):
                self._names = names
        self._sources_of = None
        predict_sources = getattr(datamodule, "predict_sources", None)
        if callable(predict_sources) and trainer.global_rank == 0:  # only rank zero writes the file
            try:
                self._sources = list(predict_sources())
                self._sources_of = str(datamodule.resolved_predict_split())  # type: ignore[union-attr]
            except ValueError as err:  # a database converted before sources were stored: the rows still have indices
                log.warning("predictions are written without their `source`: %s", err)
            except AttributeError:  # a DataModule of one's own with `predict_sources` only: its split is not known
                pass

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        self._close()
        self._samples, self._limited = _split_to_cover(trainer)
        base, self._indices = _viewed(getattr(_predict_loader(trainer), "dataset", None))
        if self._sources_of is not None and isinstance(base, LmdbImageDataset) and base.split != self._sources_of:
            # a predict dataset of one's own, of another split than `predict_split` (a Subset of `train`, say): the
            # rows name that split's files
            self._sources, self._sources_of = split_sources(Path(base.path), base.split), base.split
        self._parts_complete = False
        self._part = open(self.part_path(trainer.global_rank), "wb")  # noqa: SIM115 - open until the merge

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Stream the batch's rows, with their sample indices, to this process's part file."""
        if dataloader_idx != 0:
            raise InvalidArgumentError(
                f"`PredictionWriter` writes the predictions of one dataloader; got a batch of dataloader"
                f" {dataloader_idx}. Return one predict dataloader, or one writer's Trainer per dataloader."
            )
        if not batch_indices:
            raise InvalidArgumentError(
                "`PredictionWriter` cannot tell which samples a predict batch holds: Lightning tracks them only for a"
                " torch `DataLoader` with a batch sampler (as `FastImageDataModule.predict_dataloader` returns)."
            )
        kind, values = _per_sample(prediction, len(batch_indices), self._classes, self._target())
        if self._part is None:  # `write_on_batch_end` called without `on_predict_start` (a custom loop)
            self.on_predict_start(trainer, pl_module)
        assert self._part is not None
        lines = [
            b"%d\t%s\t%s\n" % (int(index), kind, json.dumps(value, ensure_ascii=False).encode())
            for index, value in zip(batch_indices, values, strict=True)
        ]
        self._part.write(b"".join(lines))

    def _target(self) -> tuple[str, int, float]:
        """The DataModule's target kind, its float values per sample, and the multi-label threshold."""
        return self._kind, self._dim, self.threshold

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        trainer.strategy.barrier("PredictionWriter.parts_written")
        self._parts_complete = True
        error = None
        if trainer.global_rank == 0:
            try:
                rows = self._merge(trainer.world_size, self._samples)
            except Exception as err:  # told to the other ranks below, then raised here
                error = f"{type(err).__name__}: {err}"
                raise
            finally:
                # every rank waits for the merge and learns its outcome (none waits forever on a failed rank zero)
                error = trainer.strategy.broadcast(error, src=0)
            limited = ""
            if self._limited is not None:
                limited = " (`limit_predict_batches` ran {} of the loader's {} batches)".format(*self._limited)
            rank_zero_info(f"PredictionWriter: wrote {rows} predictions to {self.output_path}{limited}")
        else:
            error = trainer.strategy.broadcast(error, src=0)
            if error is not None:
                raise RuntimeError(f"rank 0 could not merge the predictions into {str(self.output_path)!r}: {error}")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()
        if self._parts_complete:  # the merge failed: the parts hold every prediction made
            return
        with contextlib.suppress(OSError):
            self.part_path(trainer.global_rank).unlink(missing_ok=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._part is not None:
            self._part.close()
            self._part = None

    def _remove_dead_merges(self) -> None:
        """Remove the ``.NAME.<pid>.tmp`` files of merges that were killed (no process holds their lock)."""
        if fcntl is None:
            return
        for stale in self.output_path.parent.glob(f".{self.output_path.name}.*.tmp"):
            with contextlib.suppress(OSError), open(stale, "rb") as fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a live merge holds it
                stale.unlink()
                log.info("removed %s, left by a merge that was killed", stale)

    def _merge(self, world_size: int, samples: int | None = None) -> int:
        """Write the rows of the parts of ranks ``0..world_size-1``, each sample once, in sample order; remove them.

        With ``samples``, the parts must cover samples ``0..samples-1`` of the split, and no other; otherwise nothing is
        written and the parts are kept. A sample's repeats (the sampler's padding) must agree with its first row, and
        more of them than ``DistributedSampler`` pads ``world_size`` processes with warn. Returns the number of rows
        written.

        Raises:
            FileNotFoundError: a part is missing (another node's disk).
            SampleError: a sample has two rows whose predictions differ (a ``RuntimeError``).
            RuntimeError: ``samples`` are not all covered, or indices lie beyond them.

        """
        parts = [self.part_path(rank) for rank in range(world_size)]
        missing = [str(part) for part in parts if not part.is_file()]
        if missing:
            raise FileNotFoundError(
                f"the part files {missing} are missing: on several nodes, `output_path` {str(self.output_path)!r}"
                " must be on storage that every node shares."
            )
        # where each sample's first row is: part and byte offset, one pair of integers per sample (not its row)
        part_of, offset_of, kinds, repeats = self._index(parts)
        if samples is not None:
            self._check_coverage(part_of, samples, parts)
        self._say_repeats(repeats, world_size, samples)
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
                columns = [c for c in _COLUMNS if self._has(c, kinds)]
                if self._names is not None and _VALUES in kinds:  # the value names in place of `value`
                    at = columns.index("value")
                    columns[at : at + 1] = self._names
                emit = self._csv_rows(out, columns) if self.format == "csv" else self._jsonl_rows(out)
                for index in np.flatnonzero(part_of >= 0):
                    reader = readers[part_of[index]]
                    reader.seek(int(offset_of[index]))
                    _, kind, value = reader.readline().rstrip(b"\n").split(b"\t", 2)
                    emit(self._row(int(index), kind, json.loads(value)))
                    rows += 1
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.output_path)
        finally:
            tmp.unlink(missing_ok=True)
        for part in parts:
            part.unlink(missing_ok=True)
        return rows

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

    def _index(self, parts: Sequence[Path]) -> tuple[np.ndarray, np.ndarray, set[bytes], int]:
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
                            self._check_repeat(i, first.readline(), first_part, line, number, parts)
                        offset += len(line)
        return part_of, offset_of, kinds, repeats

    def _check_repeat(
        self, index: int, first: bytes, first_rank: int, again: bytes, rank: int, parts: Sequence[Path]
    ) -> None:
        """Raise unless two rows of sample ``index`` (part lines of ranks ``first_rank`` and ``rank``) agree."""
        first_kind, first_value = first.rstrip(b"\n").split(b"\t", 2)[1:]
        kind, value = again.rstrip(b"\n").split(b"\t", 2)[1:]
        if first_kind == kind and (first_value == value or _agree(json.loads(first_value), json.loads(value))):
            return
        where = f"sample {index}"
        database_index = self._database_index(index)
        if database_index != index:
            where += f" of the predict dataset (index {database_index} of the dataset it views)"
        source = self._source(database_index)
        if source is not None:
            where += f", {source!r},"
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

    @staticmethod
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

    def _database_index(self, index: int) -> int:
        """Sample ``index`` of the predict loader's dataset as an index of the dataset its subsets view."""
        if self._indices is None or not 0 <= index < len(self._indices):
            return index
        return int(self._indices[index])

    def _source(self, index: int) -> str | None:
        """The source of the viewed dataset's sample ``index``; ``None`` when unknown."""
        if self._sources is None or not 0 <= index < len(self._sources):
            return None
        return self._sources[index]

    def _has(self, column: str, kinds: set[bytes]) -> bool:
        if column == "index":
            return True
        if column == "source":
            return self._sources is not None
        if column == "label":
            return _CLASS in kinds
        if column == "class":
            return _CLASS in kinds and self._classes is not None
        if column == "labels":
            return _MULTI in kinds
        if column == "classes":
            return _MULTI in kinds and self._classes is not None
        if column == "value":
            return _VALUES in kinds
        return _RAW in kinds

    def _row(self, index: int, kind: bytes, value: Any) -> dict[str, Any]:
        # the index and source of the sample itself, not its position in a subset of the dataset
        index = self._database_index(index)
        row: dict[str, Any] = {"index": index}
        if self._sources is not None:
            row["source"] = self._source(index)
        if kind == _CLASS:
            row["label"] = value
            if self._classes is not None:
                row["class"] = self._classes[value] if 0 <= value < len(self._classes) else None
        elif kind == _MULTI:
            row["labels"] = value
            if self._classes is not None:
                classes = self._classes
                row["classes"] = [classes[i] if 0 <= i < len(classes) else None for i in value]
        elif kind == _VALUES:
            if self._names is None:
                row["value"] = value
            else:
                row.update(zip(self._names, value if isinstance(value, list) else [value], strict=True))
        else:
            row["output"] = value
        return row

    @staticmethod
    def _csv_rows(out: IO[str], columns: list[str]) -> Any:
        writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()

        def emit(row: dict[str, Any]) -> None:
            for key in ("output", "labels", "classes", "value"):
                if key in row and (key == "output" or isinstance(row[key], list)):
                    row[key] = json.dumps(row[key], ensure_ascii=False)
            writer.writerow({k: "" if v is None else v for k, v in row.items()})

        return emit

    @staticmethod
    def _jsonl_rows(out: IO[str]) -> Any:
        def emit(row: dict[str, Any]) -> None:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")

        return emit


def _split_to_cover(trainer: Trainer) -> tuple[int | None, tuple[int, int] | None]:
    """The samples the predicted split's rows must cover, and ``(batches run, batches)`` if a limit cut it short.

    Every sample of the split when every batch of the loader runs; ``None`` when that cannot be told (a loader or
    dataset without a length) or ``limit_predict_batches`` stops the loader early on purpose.
    """
    loader = _predict_loader(trainer)
    try:
        samples, batches = len(loader.dataset), len(loader)  # type: ignore[union-attr,arg-type]
    except (AttributeError, TypeError):
        return None, None
    run = trainer.num_predict_batches[0] if trainer.num_predict_batches else batches
    if run < batches:
        return None, (int(run), batches)
    return samples, None


def _predict_loader(trainer: Trainer) -> Any:
    """The Trainer's (first) predict loader; ``None`` when it has none."""
    loaders = trainer.predict_dataloaders
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    return loaders[0] if isinstance(loaders, list | tuple) and loaders else loaders


def _viewed(dataset: Any) -> tuple[Any, np.ndarray | None]:
    """``(base, indices)``: the dataset ``dataset`` views through subsets, each sample's index in it (``None``: none).

    Nested subsets to any depth (:func:`~lightning_fastdata.pipeline.targets.subset_view`); a :class:`BatchReader`
    (what a loader of this package reads its dataset through) is looked through.
    """
    while isinstance(dataset, BatchReader):  # a reader of the subset: its `indices` are the subset's own
        dataset = dataset.dataset
    return subset_view(dataset)


def _agree(first: Any, again: Any) -> bool:
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
    name = {_CLASS: "class", _MULTI: "classes", _VALUES: "values", _RAW: "output"}.get(kind, "row")
    return f"{name} {text}"


def _per_sample(
    prediction: Any, n: int, classes: Sequence[str] | None, target: tuple[str, int, float] = ("class", 0, 0.5)
) -> tuple[bytes, list[Any]]:
    """``predict_step``'s output for a batch of ``n`` samples: its row kind, and one JSON value per sample.

    ``target``: the DataModule's target kind, values per sample of a ``float`` target, and the multi-label threshold.

    Raises:
        InvalidArgumentError: the output cannot be split into ``n`` samples.

    """
    kind, dim, threshold = target
    floating = isinstance(prediction, torch.Tensor) and prediction.is_floating_point()
    if floating and prediction.ndim and len(prediction) == n:
        if kind == "multilabel" and prediction.ndim == 2 and classes and prediction.shape[1] == len(classes):
            above = (prediction.detach().float().sigmoid() > threshold).cpu()
            return _MULTI, [row.nonzero().flatten().tolist() for row in above]
        if kind == "float" and dim >= 1 and prediction.shape[1:] in ((dim,), () if dim == 1 else (dim,)):
            values = prediction.detach().float().cpu()
            return _VALUES, [_jsonable(item) for item in (values.reshape(n) if dim == 1 else values).tolist()]
    if isinstance(prediction, torch.Tensor):
        if prediction.is_floating_point() and prediction.ndim == 2 and classes and prediction.shape[1] == len(classes):
            return _CLASS, prediction.argmax(dim=1).tolist()
        integer = not (prediction.is_floating_point() or prediction.is_complex() or prediction.dtype == torch.bool)
        if integer and prediction.ndim == 1 and len(prediction) == n:
            return _CLASS, prediction.tolist()
    return _RAW, _split(prediction, n)


def _split(value: Any, n: int) -> list[Any]:
    """``value`` as ``n`` JSON values, one per sample."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim >= 1 and len(value) == n:
        return [_jsonable(item) for item in value.tolist()]
    if isinstance(value, Mapping):
        columns = {str(key): _split(item, n) for key, item in value.items()}
        return [{key: items[i] for key, items in columns.items()} for i in range(n)]
    if isinstance(value, list | tuple) and len(value) == n:
        return [_jsonable(item) for item in value]
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor | np.ndarray) else ""
    raise InvalidArgumentError(
        f"`PredictionWriter` cannot split `predict_step`'s output ({type(value).__name__}{shape}) into the batch's {n}"
        " samples: return a tensor or array whose first dimension is the batch, a mapping of them, or a list with one"
        " item per sample."
    )


def _jsonable(value: Any) -> Any:
    """``value`` as JSON types: tensors and arrays as lists, a NaN or infinity as ``None``."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)
