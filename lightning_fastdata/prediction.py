"""``PredictionWriter``: ``trainer.predict``'s outputs written to a CSV or JSON Lines file, one row per sample.

Each process streams its rows, tagged with their sample index, to a part file beside the output; after the last
batch, rank zero checks that they hold every sample of the split, merges them in sample order, drops the duplicates
that ``DistributedSampler`` pads with (once it has checked that they agree), and publishes the file under its final
name by a rename. A run that stops early publishes nothing; one whose parts miss samples, or predict a sample twice
with different results, raises and keeps them.

This module is the Lightning callback that wires the two halves: :mod:`~lightning_fastdata.prediction_rows` reads a
batch's output into rows (what a tensor's shape means) and :mod:`~lightning_fastdata.prediction_parts` writes the
part files and merges them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline.kernel import BatchReader
from lightning_fastdata.pipeline.targets import subset_view
from lightning_fastdata.prediction_parts import Format, PartFiles
from lightning_fastdata.prediction_rows import COLUMNS, RowLayout, per_sample
from lightning_fastdata.splits import split_sources
from lightning_fastdata.store.reader import LmdbImageDataset

log = logging.getLogger(__name__)

#: file suffixes that name a format when ``format`` is left out
_SUFFIXES: dict[str, Format] = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


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
        #: the DataModule's target kind and, for ``float`` targets, their count
        self._kind = "class"
        self._dim = 0
        self.output_path = path
        self.format: Format = format
        self._parts = PartFiles(path, format)
        #: the classes, sources, value names and subset indices that make the rows of the merge
        self._rows = RowLayout()
        #: the split that the rows' sources name the files of (``None``: not known)
        self._sources_of: str | None = None
        #: samples of the predicted split the parts must cover (``None``: not checked), and the batches that ran of
        #: those the loader has, when `limit_predict_batches` cut it short
        self._samples: int | None = None
        self._limited: tuple[int, int] | None = None
        #: every rank's part was complete: a failed merge keeps them
        self._parts_complete = False

    def part_path(self, rank: int) -> Path:
        """The part file rank ``rank`` streams its rows to: hidden, beside ``output_path``."""
        return self._parts.path(rank)

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
        rows = self._rows
        rows.classes = rows.sources = rows.names = None
        with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
            rows.classes = [str(name) for name in datamodule.classes]  # type: ignore[union-attr]
        self._kind, self._dim = "class", 0
        with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
            spec = datamodule.target_spec  # type: ignore[union-attr]
            self._kind, self._dim = str(spec.kind), int(spec.dim)
            names = [str(name) for name in spec.names]
            if len(names) == self._dim and len(set(names)) == len(names) and not set(names) & set(COLUMNS):
                rows.names = names
        self._sources_of = None
        predict_sources = getattr(datamodule, "predict_sources", None)
        if callable(predict_sources) and trainer.global_rank == 0:  # only rank zero writes the file
            try:
                rows.sources = list(predict_sources())
                self._sources_of = str(datamodule.resolved_predict_split())  # type: ignore[union-attr]
            except ValueError as err:  # a database converted before sources were stored: the rows still have indices
                log.warning("predictions are written without their `source`: %s", err)
            except AttributeError:  # a DataModule of one's own with `predict_sources` only: its split is not known
                pass

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        self._parts.close()
        self._samples, self._limited = _split_to_cover(trainer)
        base, self._rows.indices = _viewed(getattr(_predict_loader(trainer), "dataset", None))
        if self._sources_of is not None and isinstance(base, LmdbImageDataset) and base.split != self._sources_of:
            # a predict dataset of one's own, of another split than `predict_split` (a Subset of `train`, say): the
            # rows name that split's files
            self._rows.sources, self._sources_of = split_sources(Path(base.path), base.split), base.split
        self._parts_complete = False
        self._parts.open(trainer.global_rank)

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
        kind, values = per_sample(prediction, len(batch_indices), self._rows.classes, self._target())
        if not self._parts.is_open:  # `write_on_batch_end` called without `on_predict_start` (a custom loop)
            self.on_predict_start(trainer, pl_module)
        self._parts.write(batch_indices, kind, values)

    def _target(self) -> tuple[str, int, float]:
        """The DataModule's target kind, its float values per sample, and the multi-label threshold."""
        return self._kind, self._dim, self.threshold

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._parts.close()
        trainer.strategy.barrier("PredictionWriter.parts_written")
        self._parts_complete = True
        error = None
        if trainer.global_rank == 0:
            try:
                rows = self._parts.merge(trainer.world_size, self._rows, self._samples)
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
        self._parts.close()
        if self._parts_complete:  # the merge failed: the parts hold every prediction made
            return
        with contextlib.suppress(OSError):
            self.part_path(trainer.global_rank).unlink(missing_ok=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._parts.close()


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
