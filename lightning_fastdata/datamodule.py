"""``FastImageDataModule``: point it at an image folder, get the fastest input pipeline this machine can give."""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fastdata import cpus, resizing
from lightning_fastdata.errors import (
    InvalidArgumentError,
    MissingSplitError,
    ReadOnlyDestinationError,
    RemoteStorageError,
    SourceLayoutError,
)
from lightning_fastdata.pipeline import DeviceStage, FastLoader, create_loader
from lightning_fastdata.pipeline.kernel import Output, fuses
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.store import cache, remote
from lightning_fastdata.store import format as _format
from lightning_fastdata.store.conversion import convert
from lightning_fastdata.store.reader import DEFAULT_MAX_PIXELS, LmdbImageDataset
from lightning_fastdata.store.sources import canonical_split, folder_classes
from lightning_fastdata.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCropResize,
    Normalizer,
    RandomResizedCropFlip,
)
from lightning_fastdata.tuning import LoaderConfig, TuneCache, quick_tune

#: ``engine="auto"`` picks worker processes for CUDA training from this many workers on (see ``resolved_engine``)
AUTO_PROCESSES_MIN_WORKERS = 4

#: the prefix under which loggers get a saved argument that the model also saved, with another value
HPARAMS_PREFIX = "datamodule/"

log = logging.getLogger(__name__)

_PRECISION_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}


def _quiet_lightning_worker_check() -> None:
    """Silence Lightning's "does not have many workers" for this DataModule's loaders, when they build on threads.

    Lightning reads ``DataLoader.num_workers``, which is 0 when batches are built on loader threads, and advises more
    worker processes to a loader that already uses its whole budget. Only that warning, only for the named loaders of
    a Trainer fed by a DataModule (which are all this DataModule's).
    """
    warnings.filterwarnings(
        "ignore",
        message=r"The '(train|val|test|predict)_dataloader' does not have many workers",
        category=PossibleUserWarning,
    )


def _lightning_differs(a: Any, b: Any) -> bool:
    """Whether Lightning's hyperparameter merge (``_log_hyperparams``) takes ``a`` and ``b`` for different values."""
    if type(a) is not type(b) or (isinstance(a, torch.Tensor) and a is not b):
        return True
    try:
        return bool(a != b)
    except Exception:  # an ambiguous comparison (arrays): take them for different, the safe side for the merge
        return True


def _same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one setting in substance: ``(0.5, 0.5)`` and ``[0.5, 0.5]``, ``1`` and ``1.0``."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(a.eq(b).all())
        )
    try:
        return bool(a == b)
    except Exception:
        return False


def _describe(obj: Any) -> str:
    """A stable description of a transform for cache keys: its repr, unless that is the default one (an address)."""
    text = repr(obj)
    if " at 0x" not in text:
        return text
    state = sorted((k, _describe(v)) for k, v in getattr(obj, "__dict__", {}).items())
    return f"{type(obj).__module__}.{type(obj).__qualname__}({state})"


class _IndexView(Dataset):
    """A fixed subset of a dataset, its indices held as ``int32`` (4 bytes per sample)."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        self.dataset = dataset
        self.indices = indices.astype(np.int32)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.indices[index])]


class FastImageDataModule(LightningDataModule):
    """A LightningDataModule for image classification that converts once to LMDB and feeds uint8 batches.

    ``prepare_data`` converts the image folder into an LMDB database (once: later runs find it up to date);
    ``setup`` opens it. Loader threads (or worker processes, ``engine="processes"``) decode each image and crop,
    resize and flip it straight into one batch buffer (:mod:`lightning_fastdata.pipeline` follows a sample from
    record to device batch). On CUDA the batch stays ``uint8`` (a quarter of the bytes of float32) and is normalized
    on the device; on a CPU it is normalized to ``float32`` in the loader threads. Batches are ``(images, labels)``.

    Worker count, ``pin_memory`` and ``persistent_workers`` are chosen for the machine when left at their
    defaults: ``num_workers="auto"`` is the CPUs this process may really use (affinity, cgroup quota) divided by
    the training processes on this node.

    Subclass to change the pipeline: override :meth:`train_transform`, :meth:`val_transform` or
    :meth:`build_dataset`.

    Every argument is saved (:attr:`hparams`, so ``load_from_checkpoint`` and LightningCLI rebuild the DataModule);
    one the model also saved with another value reaches the loggers as ``datamodule/<name>`` (:attr:`hparams_initial`).

    Args:
        data_dir: an ImageFolder root with split trees (``train/``, ``val/``, ``test/`` or their aliases, any case), a
            plain ImageFolder root, a ``path,label`` list file (``.csv``/``.json``), or a database made by
            ``lightning-fastdata convert``. ``~`` is expanded. Or the fsspec URL of a database published by
            ``lightning-fastdata convert SRC URL`` (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``; needs
            ``pip install 'lightning-fastdata[remote]'``): ``prepare_data`` stages it once per node into ``cache_dir``
            (:func:`~lightning_fastdata.store.remote.stage`), and a later run reuses that copy after one request.
        cache_dir: a local folder (the node's local disk) where the conversion of a folder, or the copy of a URL,
            goes: one database per source and conversion settings; default ``$LIGHTNING_FASTDATA_CACHE`` or
            ``~/.cache/lightning_fastdata``. Never inside ``data_dir``. It may be read-only once it holds an up-to-date
            conversion.
        image_size: side length of the square training and validation crops; :meth:`set_image_size` changes it
            during a run (the saved hyperparameter stays the configured value).
        image_size_schedule: progressive resizing or FixRes: ``{epoch: image_size}``, each size used from that
            epoch on (``{0: 128, 10: 160, 15: 224}``); epochs before the first key train at ``image_size``. The
            training loader applies it as each epoch starts, from its sampler's epoch (so a resumed run gets the
            size of its epoch); validation uses the size of the epoch it follows. A folder is converted for the
            largest size. See docs/datamodule.md.
        batch_size: samples per batch (per process under DDP). With ``drop_last=True`` a value above the process's
            share of the training split is clamped to it, with a warning (:meth:`clamp_batch_size`).
        num_workers: loader threads (or worker processes, see ``engine``) per training process; ``"auto"`` budgets
            them from the usable CPUs; ``"tune"`` measures 0 up to the budget for a few seconds on the training data,
            each count on the engine it would train on, and keeps the cheapest count within 5% of the fastest (cached
            under ``cache_dir``, keyed by database, transforms, batch size, engine and CPUs).
        engine: ``"threads"`` builds batches on ``num_workers`` threads in the training process (no worker
            start-up, no copy of the dataset per worker; decoding and resizing release the GIL); ``"processes"`` on
            ``num_workers`` DataLoader worker processes, straight into batch slots shared with the training process
            (which then spends a few microseconds per image receiving them). ``"auto"`` (default) picks worker
            processes for CUDA training with at least 4 workers (the loader threads would share the GIL with the
            training loop's kernel launches), threads otherwise (CPU training and fewer workers, where the two
            engines are close and threads need no start-up); the choice is logged once.
        pin_memory: page-locked host batches for fast, asynchronous copies; default: on when training on CUDA.
        persistent_workers: keep workers alive between epochs; default: on when there are workers.
        prefetch_factor: batches each worker loads ahead; default: PyTorch's 2.
        val_fraction: share of ``train`` held out for validation when the data has no ``val`` split (``0`` for
            none); the split is deterministic for a given ``seed``.
        seed: seeds the validation split, the training shuffle (which also changes with the epoch) and the
            augmentation: a sample's random draws, in the built-in transforms and in torch's random functions called
            by a transform of one's own, are a function of ``(seed, epoch, sample)``
            (:mod:`lightning_fastdata.keyed_random`).
        mean: per-channel mean on the 0-1 scale: subtracted by the loader threads for CPU training, on the device
            for CUDA training.
        std: per-channel standard deviation on the 0-1 scale.
        scale: ``RandomResizedCrop`` area range for training.
        crop_fraction: validation centre crop as a share of the short side (0.875 = 224 of 256).
        short_side: conversion: downscale stored images to this short side (0 keeps the original size); ``None``
            follows ``image_size``: ``max(256, ceil(image_size / crop_fraction))``, so crops are never upsampled
            from a smaller store. A store smaller than that warns.
        quality: conversion: JPEG quality of re-encoded images.
        encoding: conversion: ``"jpeg"`` (compact) or ``"raw"`` uint8 pixels (about 10x larger, no decoding in
            the workers: the fastest CPU path when the database fits in the page cache).
        channels_last: hand the model ``channels_last`` batches (faster convolutions with AMP on recent GPUs).
        drop_last: drop the last incomplete training batch.
        prefetch_to_device: copy batch N+1 to the GPU (and normalize it there) on a side CUDA stream while batch N
            computes; default: on when training on CUDA. A no-op elsewhere.
        decode: ``"cpu"`` decodes in the workers; ``"device"`` ships the stored JPEG bytes and decodes, crops and
            resizes whole batches on the GPU (batched nvJPEG), so the workers do almost nothing per image. The decode
            runs on the training thread, which torchvision's nvJPEG call blocks until each batch is decoded; pixels
            differ from ``"cpu"``'s by about 1.4 grey levels on average (docs/datamodule.md). Without CUDA it warns
            once and decodes on the CPU.
        on_bad_sample: ``"raise"`` stops on a sample that fails to read, decode or transform, with an error naming
            the split, index and cause; ``"skip"`` leaves such samples out of their batch, logs the first few and
            counts them in :attr:`skipped_samples`.
        predict_split: the split ``predict_dataloader`` reads, in order; default ``"test"``, else ``"val"``, else
            ``"train"``. :meth:`predict_sources` names the source file of each prediction.
        prepare_data_per_node: ``True`` (Lightning's default): local rank 0 of every node converts or stages the
            data in ``prepare_data``; ``False``: global rank 0 alone does, while every other rank waits. For a
            ``cache_dir`` that every node shares (docs/ddp.md); with a cache per node, a URL is then staged in
            ``setup`` by the first rank of each other node, but a folder's conversion is not found there.
        max_pixels: the most pixels a stored image may have (default 48 MiP: 50,331,648, 8192 x 6144, 144 MiB
            decoded), checked against each record's header and the image's own frame header before decoding; a
            larger one is a bad sample naming its split and index (skipped under ``on_bad_sample="skip"``). It keeps
            a database you did not make from having the loader decode a decompression bomb; raise it for trusted
            databases of larger images (``None``: no limit).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_fastdata import FastImageDataModule
        >>> dm = FastImageDataModule("data/imagenette", batch_size=64)
        >>> Trainer(max_epochs=10).fit(model, datamodule=dm)  # doctest: +SKIP

    """

    def __init__(
        self,
        data_dir: str,
        cache_dir: str | None = None,
        image_size: int = 224,
        image_size_schedule: dict[int, int] | None = None,
        batch_size: int = 64,
        num_workers: int | Literal["auto", "tune"] = "auto",
        engine: Literal["auto", "threads", "processes"] = "auto",
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        scale: tuple[float, float] = (0.08, 1.0),
        crop_fraction: float = 0.875,
        short_side: int | None = None,
        quality: int = 90,
        encoding: Literal["jpeg", "raw"] = "jpeg",
        channels_last: bool = False,
        drop_last: bool = True,
        prefetch_to_device: bool | None = None,
        decode: Literal["cpu", "device"] = "cpu",
        on_bad_sample: Literal["raise", "skip"] = "raise",
        predict_split: str | None = None,
        prepare_data_per_node: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        super().__init__()
        if image_size < 1 or batch_size < 1:
            raise InvalidArgumentError(f"`image_size` ({image_size}) and `batch_size` ({batch_size}) must be >= 1.")
        if num_workers not in ("auto", "tune") and (not isinstance(num_workers, int) or num_workers < 0):
            raise InvalidArgumentError(f"`num_workers` must be 'auto', 'tune' or an int >= 0, got {num_workers!r}.")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise InvalidArgumentError(f"`prefetch_factor` must be >= 1 or None, got {prefetch_factor}.")
        if not 0 <= val_fraction < 1:
            raise InvalidArgumentError(f"`val_fraction` must be in [0, 1), got {val_fraction}.")
        if engine not in ("auto", "threads", "processes"):
            raise InvalidArgumentError(f"`engine` must be 'auto', 'threads' or 'processes', got {engine!r}.")
        if decode not in ("cpu", "device"):
            raise InvalidArgumentError(f"`decode` must be 'cpu' or 'device', got {decode!r}.")
        if on_bad_sample not in ("raise", "skip"):
            raise InvalidArgumentError(f"`on_bad_sample` must be 'raise' or 'skip', got {on_bad_sample!r}.")
        if max_pixels is not None and max_pixels < 1:
            raise InvalidArgumentError(f"`max_pixels` must be >= 1 or None (no limit), got {max_pixels}.")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise InvalidArgumentError(f"`mean` and `std` need 3 values each and `std` > 0, got {mean} and {std}.")
        remote.check_local(
            cache_dir,
            "cache_dir",
            "the cache must be a local folder: its databases are memory-mapped. Pass a folder on the node's local disk",
        )
        self.save_hyperparameters()
        shown = remote.redact_url(data_dir) if isinstance(data_dir, str) else data_dir
        if shown != data_dir:  # the loggers' hyperparameters and the checkpoints never hold a URL's secrets
            self.save_hyperparameters({**self.hparams, "data_dir": shown})
            rank_zero_info(
                f"`data_dir` {shown!r} carries credentials or a signed query: they are left out of the saved"
                " hyperparameters and checkpoints (pass `data_dir` again to load from one)."
            )
        self.data_dir = data_dir
        self.cache_dir = cache_dir
        self.image_size = image_size
        self.image_size_schedule = resizing.check_schedule(image_size_schedule)
        self._sizes = (image_size, *(self.image_size_schedule or {}).values())  # configured: what is converted for
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.engine = engine
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.val_fraction = val_fraction
        self.seed = seed
        self.normalizer = Normalizer(tuple(mean), tuple(std))
        self.scale = tuple(scale)
        self.crop_fraction = crop_fraction
        self.short_side = short_side
        self.quality = quality
        self.encoding = encoding
        self.channels_last = channels_last
        self.drop_last = drop_last
        self.prefetch_to_device = prefetch_to_device
        self.decode = decode
        self.on_bad_sample = on_bad_sample
        self.predict_split = predict_split
        self.prepare_data_per_node = prepare_data_per_node
        self.max_pixels = max_pixels
        self._skip_counter = SkipCounter()
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.predict_dataset: Dataset | None = None
        self._splits: list[str] | None = None
        self._warned_workers = False
        self._chosen_engine: str | None = None
        self._warned_decode = False
        self._warned_hparams: set[tuple[str, str, str]] = set()
        self._said_generators = False
        self._tuned: int | None = None
        self._staged: remote.StagedDatabase | None = None
        #: whether this DataModule's loaders run the device stage themselves, on the side stream
        self._stage_in_loader = False
        #: the device stage of the last loader built (for the Trainer it was built for), which the hook reuses
        self._stage: DeviceStage | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Where the data is
    # ------------------------------------------------------------------------------------------------------------

    @property
    def is_database(self) -> bool:
        """Whether ``data_dir`` already is a converted database (then nothing is converted), here or at a URL."""
        return self.is_remote or (Path(self.data_dir).expanduser() / _format.DATA_FILE).is_file()

    @property
    def is_remote(self) -> bool:
        """Whether ``data_dir`` is a URL, whose database is staged into ``cache_dir`` (:attr:`staging`)."""
        return remote.is_url(self.data_dir)

    @property
    def _shown_dir(self) -> str:
        """``data_dir`` as errors and logs show it: a URL without its user-info and query (a secret)."""
        return remote.redact_url(str(self.data_dir))

    @property
    def staging(self) -> remote.StagedDatabase | None:
        """What staging ``data_dir`` did in this process (fetched, fetched again and why, reused); ``None``: nothing."""
        return self._staged

    @property
    def cache_root(self) -> Path:
        """The directory holding conversions and the ``num_workers="tune"`` cache."""
        return cache.cache_root(self.cache_dir)

    @property
    def database_path(self) -> Path:
        """The database that is read: ``data_dir`` itself, or its conversion under ``cache_dir``."""
        if self.is_remote:
            return remote.staged_path(self.data_dir, self.cache_root)
        source = Path(self.data_dir).expanduser().absolute()
        if self.is_database:
            return source
        return cache.converted_path(source, self.cache_root, self.store_short_side(), self.quality, self.encoding)

    def store_short_side(self) -> int | None:
        """The short side a conversion stores (``None``: original sizes): ``short_side``, or one fit for the crops."""
        if self.short_side is None:
            return max(256, math.ceil(max(self._sizes) / self.crop_fraction))
        return self.short_side or None

    def _check_store_size(self, stored: int | None, size: int | None = None) -> None:
        """Warn when the stored images are too small for ``size`` (the largest configured): crops would be upsampled."""
        size = max(self._sizes) if size is None else size
        needed = math.ceil(size / self.crop_fraction)
        if stored is None or stored >= needed:
            return
        if self.is_database:  # its images are what they are: only a new conversion changes them
            fix = (
                f"Convert the source again with `lightning-fastdata convert SRC {self._shown_dir} --short-side {needed}"
                " --force` (or 0 to keep original sizes), or pass the source folder as `data_dir`."
            )
        else:
            fix = (
                f"Pass `short_side={needed}` (or leave it at None, which follows `image_size`; 0 keeps original sizes)."
            )
        rank_zero_warn(
            f"The database stores images with a short side of at most {stored} px, but `image_size={size}`"
            f" with `crop_fraction={self.crop_fraction}` needs {needed} px: every crop is upsampled. {fix}"
        )

    @property
    def classes(self) -> list[str]:
        """Class names: from the database, or before conversion from the folder names (nothing is read)."""
        if self.is_remote and self._staged is None and remote.find_staged(self.data_dir, self.cache_root) is None:
            raise RemoteStorageError(
                f"`data_dir` {self._shown_dir!r} is not staged yet: its classes are read from the staged copy. Call"
                " `prepare_data()` first (the Trainer does, before `setup`)."
            )
        if self.is_database or (self.database_path / _format.DATA_FILE).is_file():
            return list(_format.read_meta(self.database_path)["classes"])
        return folder_classes(Path(self.data_dir).expanduser())

    @property
    def skipped_samples(self) -> int:
        """Samples left out so far under ``on_bad_sample="skip"`` (counted across DataLoader workers)."""
        return self._skip_counter.value

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    # ------------------------------------------------------------------------------------------------------------
    # Hyperparameters
    # ------------------------------------------------------------------------------------------------------------

    @property
    @override
    def hparams_initial(self) -> AttributeDict:
        """The saved arguments as the loggers get them: one the model saved too, with another value, is renamed.

        Every argument is saved under its own name (:attr:`hparams`, and the checkpoint's
        ``datamodule_hyper_parameters``), so ``load_from_checkpoint`` and LightningCLI rebuild this DataModule as it
        was. Lightning merges the model's and the DataModule's hyperparameters for the loggers, and stops the run on a
        name both saved with different values (``Error while merging hparams``); such an argument reaches the loggers
        as ``datamodule/<name>`` instead, beside the model's, and :meth:`setup` says so (:meth:`hparams_clashes`).
        The same value under both names (``image_size=224`` in both) is logged once, as before.
        """
        hparams = super().hparams_initial
        clashes = self.hparams_clashes()
        if not clashes:
            return hparams
        return AttributeDict({(f"{HPARAMS_PREFIX}{k}" if k in clashes else k): v for k, v in hparams.items()})

    def hparams_clashes(self) -> dict[str, tuple[Any, Any]]:
        """The saved arguments Lightning would refuse to merge with the Trainer's model's: ``{name: (model's, ours)}``.

        Empty without a Trainer, a model, or hyperparameters the model logs.
        """
        module = getattr(self.trainer, "lightning_module", None)
        # `_log_hyperparams` is `save_hyperparameters(logger=...)`: no public accessor, and Lightning reads it too
        if not isinstance(module, LightningModule) or not getattr(module, "_log_hyperparams", False):
            return {}
        theirs, ours = module.hparams_initial, super().hparams_initial
        return {
            key: (theirs[key], ours[key])
            for key in sorted(theirs.keys() & ours.keys())
            if key != "_class_path" and _lightning_differs(theirs[key], ours[key])
        }

    def _say_hparams_clashes(self) -> None:
        """Warn once per clash that the model and this DataModule saved one name with different values."""
        trainer = self.trainer
        if trainer is None or not getattr(trainer, "loggers", None):  # nothing is merged without a logger
            return
        # one setting as two types ((0.5,) and [0.5]) is renamed too, since Lightning's merge compares types, quietly
        clashes = {key: values for key, values in self.hparams_clashes().items() if not _same_value(*values)}
        for key, (theirs, ours) in clashes.items():
            if (key, repr(theirs), repr(ours)) in self._warned_hparams:
                continue
            self._warned_hparams.add((key, repr(theirs), repr(ours)))
            rank_zero_warn(
                f"The model saved `{key}={theirs!r}` and FastImageDataModule `{key}={ours!r}` (which its loaders use):"
                f" loggers get the DataModule's as `{HPARAMS_PREFIX}{key}`. Pass the same value to both if they"
                " should agree."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------

    @override
    def prepare_data(self) -> None:
        """Convert ``data_dir`` once, or stage it from its URL (one process per node; an up-to-date copy is reused)."""
        if self.is_remote:
            self._stage_remote()
        if self.is_database:
            _format.read_meta(self.database_path)  # fail early with a clear message if it is not usable
            if self.num_workers == "tune":
                self._tune_num_workers()
            return
        source = Path(self.data_dir).expanduser().absolute()
        if not source.exists():
            raise SourceLayoutError(
                f"`data_dir` {str(source)!r} does not exist. Pass an ImageFolder root (root/<class>/*.jpg), a root of"
                " train/ val/ test/ trees, a path,label list file, or a database made by `lightning-fastdata convert`."
            )
        target = self.database_path
        if target == source or target.is_relative_to(source):
            raise InvalidArgumentError(
                f"`cache_dir` {self.cache_dir!r} must not be inside `data_dir` {self.data_dir!r}."
            )
        settings = {"short_side": self.store_short_side(), "quality": self.quality, "encoding": self.encoding}
        previous = cache.conversion_meta(target)
        note = cache.other_settings_note(source, target, settings)  # why a new conversion, when the cache has others
        if note is not None:
            rank_zero_info(note)
        try:
            summary = convert(source, target, **settings)
        except ReadOnlyDestinationError as err:
            raise self._read_only_cache_error(err) from err
        if previous is not None and not summary.up_to_date:
            rank_zero_info(cache.source_change_note(target, previous, summary.splits))
        if summary.up_to_date:  # the common case on every later run: nothing for the user's log
            log.debug(summary.format())
        else:
            rank_zero_info(summary.format())
        if self.num_workers == "tune":  # measured here, on one process per node, so the ranks read the cache
            self._tune_num_workers()

    def _stage_remote(self) -> None:
        """Copy the database at the URL ``data_dir`` into ``cache_dir`` once per node, or reuse the copy there."""
        try:
            self._staged = remote.stage(self.data_dir, self.cache_root)
        except ReadOnlyDestinationError as err:
            raise self._read_only_cache_error(err) from err
        if self._staged.action != "reused":
            done = self._staged.reason or f"staged {self._shown_dir}"
            rank_zero_info(f"FastImageDataModule: {done}; reading {self._staged.path}")

    def _read_only_cache_error(self, err: ReadOnlyDestinationError) -> ReadOnlyDestinationError:
        """The error naming the setting that chose the cache folder, and the folder that is read-only.

        The setting: ``cache_dir`` or ``$LIGHTNING_FASTDATA_CACHE``. The folder: the cache folder, or, when it does not
        exist yet, the parent it cannot be made in.
        """
        if self.cache_dir:
            setting = f"`cache_dir` {self.cache_dir!r}"
        elif os.environ.get("LIGHTNING_FASTDATA_CACHE"):
            setting = f"`LIGHTNING_FASTDATA_CACHE` {os.environ['LIGHTNING_FASTDATA_CACHE']!r}"
        else:
            setting = f"the default cache folder {str(self.cache_root)!r}"
        reason = f" ({err.reason})" if err.reason else ""
        folder = Path(err.folder) if err.folder else self.cache_root
        if folder == self.cache_root:
            where = f"{setting} is read-only"
        elif folder in self.cache_root.parents:  # not there yet: the folder it would be made in is the read-only one
            where = f"{setting} does not exist and cannot be made in {str(folder)!r}, which is read-only"
        else:
            where = f"{setting} cannot be written: {str(folder)!r} is read-only"
        if self.is_remote:  # a copy of a URL: no database to pass instead, only another cache
            error = ReadOnlyDestinationError(
                f"{where}, so `data_dir` {self._shown_dir!r} cannot be staged into it{reason}. Pass `cache_dir=` a"
                " writable folder on this node's local disk (`--data.cache_dir` on the command line) or set"
                " LIGHTNING_FASTDATA_CACHE to one."
            )
        else:
            error = ReadOnlyDestinationError(
                f"{where}, so `data_dir` {self.data_dir!r} cannot be converted into it{reason}. Pass `cache_dir=` a"
                " writable folder (`--data.cache_dir` on the command line) or set LIGHTNING_FASTDATA_CACHE to one, or"
                " convert once where it is writable (`lightning-fastdata convert`) and pass the database as `data_dir`."
            )
        error.folder, error.reason = str(folder), err.reason
        return error

    @override
    def setup(self, stage: str) -> None:
        """Open the database's splits; hold out ``val_fraction`` of ``train`` when there is no ``val`` split.

        Splits are found by their canonical names (``train``, ``val``, ``test``; databases written before split
        names were canonical may say ``valid``, ``validation``, ``testing``...). Only ``fit`` needs ``train``.
        """
        self._say_hparams_clashes()  # before Lightning merges the hyperparameters, which it does after `setup`
        if self.train_dataset is None and (self._splits is None or stage == "fit"):
            self._open_splits()  # again after `train_dataset = None`: the same splits and holdout (seeded), rebuilt
        if stage == "fit" and self.train_dataset is None:
            raise MissingSplitError(
                f"{str(self.database_path)!r} has no `train` split; it holds {self._splits}. Put training images in"
                " `train/<class>/` (or `training/`) under `data_dir`, or run validate/test/predict only."
            )
        if stage == "fit":
            self._say_shared_generators()

    def _say_shared_generators(self) -> None:
        """Say once that loader threads cannot key a training transform's draws from :mod:`random` or NumPy's.

        A transform or dataset of one's own is read sample by sample, within the sample's key
        (:mod:`lightning_fastdata.keyed_random`): its torch draws are keyed on every engine, its draws from Python's
        and NumPy's process-wide generators only in worker processes and on the training thread.
        """
        if self._said_generators or self.train_dataset is None or fuses(self.train_dataset):
            return
        workers = self._tuned
        if workers is None:
            workers = self.worker_budget() if self.num_workers in ("auto", "tune") else int(self.num_workers)
        if workers == 0 or self.resolved_engine(workers) != "threads":
            return
        self._said_generators = True
        rank_zero_info(
            f"FastImageDataModule: the training transform (or dataset) is your own, read on {workers} loader threads:"
            " its torch random draws (torchvision transforms) are keyed per sample, the same in every run and after a"
            " resume, but draws from Python's `random` or NumPy's global generator are not (the threads share them)."
            " Draw from `lightning_fastdata.keyed_random.sample_rng()` instead, or pass `engine='processes'`, which"
            " keys those too."
        )

    def _open_splits(self) -> None:
        if self.is_remote and self._staged is None:  # a rank other than the node's first: wait for its staging
            found = remote.find_staged(self.data_dir, self.cache_root)
            if found is None:  # prepare_data did not run on this node (or ran elsewhere): stage it here
                self._stage_remote()
            else:
                self._staged = remote.StagedDatabase(found, "found")
        cache.record_use(self.database_path, self.cache_root)  # its last use, and that this process reads it
        meta = _format.read_meta(self.database_path)
        if self.is_database and self.short_side is not None:
            rank_zero_warn(
                f"`short_side={self.short_side}` is ignored: `data_dir` {self._shown_dir!r} is a database, whose images"
                f" were stored at a short side of {meta.get('encoding', {}).get('short_side') or 'their original size'}"
                " (`short_side` applies when a DataModule converts a folder)."
            )
        self._check_store_size(meta.get("encoding", {}).get("short_side"))
        splits = meta["splits"]
        self._splits = sorted(splits)
        if self.predict_split is not None:
            self.resolved_predict_split(self._splits)  # a misspelled split fails now, not after the whole fit
        by_role: dict[str, str] = {}
        for name in sorted(splits, key=lambda n: (n != canonical_split(n), n)):  # an exact "val" beats "valid"
            by_role.setdefault(canonical_split(name) or name, name)
        val_split, test_split = by_role.get("val"), by_role.get("test")
        if "train" in by_role:
            train = self.build_dataset(by_role["train"], self.train_transform())
            if val_split is not None:
                self.train_dataset = train
            elif self.val_fraction > 0:
                n = len(train)  # type: ignore[arg-type]
                order = np.random.default_rng(self.seed).permutation(n)
                n_val = max(1, round(n * self.val_fraction))
                self.val_dataset = _IndexView(
                    self.build_dataset(by_role["train"], self.val_transform()), np.sort(order[:n_val])
                )
                self.train_dataset = _IndexView(train, np.sort(order[n_val:]))
            else:
                self.train_dataset = train
        if val_split is not None:
            self.val_dataset = self.build_dataset(val_split, self.val_transform())
        if test_split is not None:
            self.test_dataset = self.build_dataset(test_split, self.val_transform())

    def resolved_predict_split(self, splits: Sequence[str] | None = None) -> str:
        """The split ``predict_dataloader`` reads: ``predict_split``, else ``test``, else ``val``, else ``train``."""
        names = list(_format.read_meta(self.database_path)["splits"]) if splits is None else list(splits)
        if self.predict_split is not None:
            if self.predict_split not in names:
                raise MissingSplitError(
                    f"`predict_split` {self.predict_split!r} is not in {str(self.database_path)!r}; it holds"
                    f" {sorted(names)}."
                )
            return self.predict_split
        for role in ("test", "val", "train"):
            match = next((n for n in sorted(names) if canonical_split(n) == role), None)
            if match is not None:
                return match
        return sorted(names)[0]

    def predict_sources(self) -> list[str]:
        """Where each sample of :meth:`predict_dataloader` came from, in its order (on one device).

        Each entry is the path relative to the converted folder, the path as listed in a list file, or the index in a
        converted dataset.

        Under DDP each rank predicts every ``world_size``-th sample (``DistributedSampler`` without shuffling); rank
        ``r``'s ``i``-th prediction is ``predict_sources()[r + i * world_size]`` (the last few may repeat).

        Raises:
            ValueError: the database predates stored sources; convert it again (``--force``) to store them.

        """
        split = self.resolved_predict_split()
        sources = _format.read_sources(self.database_path, split)
        if sources is None:
            raise ValueError(
                f"{str(self.database_path)!r} was converted before source paths were stored; convert it again"
                " (`lightning-fastdata convert --force`) to map predictions back to files."
            )
        return sources

    # ------------------------------------------------------------------------------------------------------------
    # Extension points
    # ------------------------------------------------------------------------------------------------------------

    def train_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The per-image training transform: uint8 CHW in, uint8 CHW ``image_size`` square out."""
        return RandomResizedCropFlip(self.image_size, scale=self.scale)  # type: ignore[arg-type]

    def val_transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The per-image validation transform: uint8 CHW in, uint8 CHW ``image_size`` square out."""
        return CenterCropResize(self.image_size, crop_fraction=self.crop_fraction)

    def build_dataset(self, split: str, transform: Callable[[Any], Any] | None) -> Dataset:
        """The dataset of one split of the database; override to add fields or change decoding.

        It decodes as the built-in batch path does (``fast_decode=True``), so a transform of one's own for one split
        sees the same pixels as the built-in transform of another, and refuses images over ``max_pixels``.
        """
        return LmdbImageDataset(
            self.database_path, split=split, transform=transform, fast_decode=True, max_pixels=self.max_pixels
        )

    # ------------------------------------------------------------------------------------------------------------
    # Loaders
    # ------------------------------------------------------------------------------------------------------------

    def _processes_per_node(self) -> int:
        trainer = self.trainer
        return 1 if trainer is None else cpus.processes_per_node(trainer.world_size, trainer.num_nodes)

    def worker_budget(self) -> int:
        """Workers per process that the usable CPUs allow: usable CPUs // training processes sharing them.

        The processes sharing them are the training processes on this node, or only this one when a launcher pinned
        each rank to its own CPUs (see :func:`~lightning_fastdata.cpus.pinned_to_own_cpus`).
        """
        trainer = self.trainer
        return (
            cpus.worker_budget(1, 1) if trainer is None else cpus.worker_budget(trainer.world_size, trainer.num_nodes)
        )

    def resolved_num_workers(self) -> int:
        """The worker count the loaders use (``"auto"`` resolved; a value above the budget warns once)."""
        budget = self.worker_budget()
        if self.num_workers == "auto":
            return budget
        if self.num_workers == "tune":
            return self._tune_num_workers()
        if self.num_workers > budget and not self._warned_workers:
            self._warned_workers = True
            sharing = cpus.cpu_sharing_processes(self._processes_per_node())
            rank_zero_warn(
                f"`num_workers={self.num_workers}` is above this process's budget of {budget}:"
                f" {cpus.usable_cpu_count()} usable CPUs shared by {sharing} training process(es)."
                " Workers beyond the budget compete for cores and usually slow loading; use `num_workers='auto'`."
            )
        return int(self.num_workers)

    def resolved_engine(self, workers: int | None = None) -> Literal["threads", "processes"]:
        """The engine the loaders use: ``engine``, or for ``"auto"`` the choice for ``workers``, logged once.

        ``workers`` defaults to the budget, or to ``num_workers`` when it is a number.

        ``"auto"`` follows what issue 18 measured on an H100 node with 16 cores: worker processes fed resnet18 at 8,901
        samples/s against the threads' 5,853, and resnet50 on 4 cores at 3,426 against 3,225, while the threads'
        kernel launches queued behind the loader threads (step p90 71 ms against a p50 of 23 ms). Below 4 workers,
        and for CPU training, threads: no worker start-up, no shared memory for batch slots, and on a CPU worker
        processes only match them (``benchmarks/bench_engines.py``, 2 CPUs).
        """
        if workers is None:
            workers = self.worker_budget() if self.num_workers in ("auto", "tune") else int(self.num_workers)
        choice = self._engine_for(workers)
        if self.engine == "auto" and choice != self._chosen_engine:
            self._chosen_engine = choice
            why = (
                f"CUDA training with {workers} workers"
                if choice == "processes"
                else "training on the CPU"
                if self._output() == "float"
                else "reading encoded bytes for decode='device'"
                if self._output() == "encoded"
                else f"{workers} worker(s), fewer than {AUTO_PROCESSES_MIN_WORKERS}"
            )
            rank_zero_info(f"FastImageDataModule: engine='auto' chose {choice!r} ({why}).")
        return choice

    def _engine_for(self, workers: int) -> Literal["threads", "processes"]:
        """The engine for ``workers`` workers: ``engine``, or ``"auto"``'s choice (see :meth:`resolved_engine`)."""
        if self.engine != "auto":
            return self.engine  # type: ignore[return-value]
        return "processes" if self._output() == "uint8" and workers >= AUTO_PROCESSES_MIN_WORKERS else "threads"

    def _tune_key(self) -> str:
        meta = _format.read_meta(self.database_path)
        transform = self.train_transform()
        parts = {
            "database": str(self.database_path),
            "created": meta.get("created"),
            "source": meta.get("source", {}).get("fingerprint"),
            "transform": _describe(transform),
            "batch_size": self.batch_size,
            "usable_cpus": cpus.usable_cpu_count(),
            "processes_per_node": self._processes_per_node(),
            "decode": self.decode,
            "output": self._output(),
            "engine": self.engine,  # the setting: "auto" times each count on the engine it picks for that count
        }
        return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:16]

    def _tune_num_workers(self) -> int:
        """``num_workers="tune"``: the cached pick for this configuration, or a bounded sweep that makes one."""
        if self._tuned is not None:
            return self._tuned
        cache = TuneCache(self.cache_root / "tune.json")
        key = self._tune_key()
        entry = cache.get(key)
        if entry is not None and isinstance(entry.get("num_workers"), int):
            self._tuned = int(entry["num_workers"])
            return self._tuned
        pin_memory = self._on_cuda() if self.pin_memory is None else self.pin_memory
        # each count on the engine it would train on: `_loader` resolves the engine from the tuned count the same way
        result = quick_tune(
            self.tuning_loader, self.batch_size, self.worker_budget(), engine=self._engine_for, pin_memory=pin_memory
        )
        self._tuned = result.pick.config.num_workers
        rank_zero_info(f"num_workers='tune' measured the training loader:\n{result.format_table()}")
        try:
            cache.put(key, {"num_workers": self._tuned, **result.to_dict()})
        except OSError as err:
            rank_zero_warn(
                f"num_workers='tune' picked num_workers={self._tuned} for this run, but could not cache the pick in"
                f" {str(cache.path)!r} ({err.strerror or err}), so the next run measures again. Pass `cache_dir=` a"
                " writable folder (or set LIGHTNING_FASTDATA_CACHE) to keep it."
            )
        return self._tuned

    def tuning_loader(self, config: LoaderConfig) -> DataLoader:
        """The training loader as ``fit`` builds it, with ``config``'s workers, engine, batch size and pinning.

        What ``num_workers="tune"`` and ``lightning-fastdata bench`` time: the batch path, the engine and, on CUDA, the
        copy to the device and the normalization there.
        """
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return self._loader(self.train_dataset, shuffle=True, drop_last=self.drop_last, train=True, config=config)

    def _on_cuda(self) -> bool:
        trainer = self.trainer
        if trainer is None:
            return torch.cuda.is_available()
        return trainer.strategy.root_device.type == "cuda"

    def _device(self) -> torch.device:
        trainer = self.trainer
        if trainer is None:
            return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return trainer.strategy.root_device

    def uses_prefetch(self) -> bool:
        """Whether loaders copy batches ahead on a side CUDA stream (``prefetch_to_device``, resolved)."""
        on_cuda = self._device().type == "cuda"
        return on_cuda if self.prefetch_to_device is None else (self.prefetch_to_device and on_cuda)

    def uses_device_decode(self) -> bool:
        """Whether JPEGs are decoded on the GPU (``decode="device"`` on CUDA); warns once when CUDA is missing."""
        if self.decode != "device":
            return False
        if self._device().type == "cuda":
            return True
        if not self._warned_decode:
            self._warned_decode = True
            rank_zero_warn(
                f"`decode='device'` needs a CUDA device, but training runs on {self._device().type}: decoding on the"
                " CPU in the DataLoader workers instead."
            )
        return False

    def _output(self) -> Output:
        """What the loaders read: encoded for device decode, uint8 for CUDA, normalized float on a CPU."""
        if self.uses_device_decode():
            return "encoded"
        return "uint8" if self._device().type == "cuda" else "float"

    def set_image_size(self, size: int) -> None:
        """Crop to ``size`` from now on: progressive resizing and FixRes (docs/datamodule.md).

        The datasets already built stay, with their samples, order and ``val_fraction`` holdout; only their crop
        transforms (:class:`~lightning_fastdata.transforms.RandomResizedCropFlip`,
        :class:`~lightning_fastdata.transforms.CenterCropResize`) change size, and so do the crops of
        ``decode="device"``. Loaders already built follow as their next epoch starts: batch slots of the new shape,
        persistent worker processes restarted. Call it before ``fit``, or from a callback's ``on_train_epoch_start``
        (before the epoch's first batch is drawn); with ``image_size_schedule`` the schedule sets the size again as
        each training epoch starts. :attr:`image_size` changes; the saved hyperparameter stays the configured one.

        Raises:
            InvalidArgumentError: ``size`` is not an int >= 1.

        """
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgumentError(f"`set_image_size` needs an int >= 1, got {size!r}.")
        if size == self.image_size:
            return
        previous, self.image_size = self.image_size, size
        built = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}
        missed = resizing.resize([d for d in (*built.values(), self.predict_dataset) if d is not None], size)
        if self._stage is not None:
            self._stage.image_size = size
        rank_zero_info(
            f"FastImageDataModule: image_size {previous} -> {size}; the loaders follow as their next epoch starts"
            " (new batch slots, and any persistent worker processes restart with the new crop size)."
        )
        for name, dataset in built.items():
            if dataset is not None and any(dataset is d for d in missed):
                rank_zero_warn(
                    f"`set_image_size`: the {name} dataset's transform is not RandomResizedCropFlip or"
                    " CenterCropResize, so its crops keep their size. Override `set_image_size` to resize it too."
                )
        if self._splits is not None:
            self._check_store_size(_format.read_meta(self.database_path).get("encoding", {}).get("short_side"), size)

    def _start_epoch(self, stage: DeviceStage, schedule: bool, epoch: int) -> int:
        """A loader's epoch starts: the scheduled size (training), the current one for its device stage; returns it.

        A loader whose persistent worker processes started at another size restarts them (``before_epoch``).
        """
        if schedule and self.image_size_schedule:
            self.set_image_size(resizing.size_at(self.image_size_schedule, epoch, self._sizes[0]))
        stage.image_size = self.image_size
        return self.image_size

    def _loader(
        self, dataset: Dataset, shuffle: bool, drop_last: bool, train: bool = False, config: LoaderConfig | None = None
    ) -> FastLoader:
        """The loader of one split, with this DataModule's settings (or ``config``'s, for tuning).

        :mod:`lightning_fastdata.pipeline` follows a sample from record to device batch.
        """
        if config is None:
            workers, batch_size = self.resolved_num_workers(), self.batch_size
            engine = self.resolved_engine(workers)
            prefetch_factor, pin_memory = self.prefetch_factor, self.pin_memory
        else:
            engine, workers, batch_size = config.engine, config.num_workers, config.batch_size
            prefetch_factor, pin_memory = config.prefetch_factor, config.pin_memory
        if engine == "threads" and workers > 0:
            _quiet_lightning_worker_check()
        trainer = self.trainer
        # A DistributedSampler seeded with `seed` in every case: Lightning leaves a DistributedSampler in place and
        # calls its `set_epoch` each epoch, so shuffling changes by epoch, is reproducible from `seed`, and shards
        # across ranks with the Trainer's own `distributed_sampler_kwargs` (num_replicas, rank).
        dist_kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        limit = getattr(trainer, "limit_train_batches", 1.0) if train else 1.0
        self._stage = self._device_stage()
        loader = create_loader(
            dataset,
            batch_size,
            shuffle=shuffle,
            seed=self.seed,
            num_replicas=dist_kwargs.get("num_replicas", 1),
            rank=dist_kwargs.get("rank", 0),
            resumable=train,
            drop_last=drop_last,
            engine=engine,  # type: ignore[arg-type]
            workers=workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=self.persistent_workers,
            output=self._output(),
            normalizer=self.normalizer,
            channels_last=self.channels_last,
            skip_counter=self._skip_counter if self.on_bad_sample == "skip" else None,
            pin_memory=self._on_cuda() if pin_memory is None else pin_memory,
            device=self._device() if self.uses_prefetch() else None,
            device_stage=self._stage,
            limit_batches=limit if isinstance(limit, (int, float)) else 1.0,
            before_epoch=functools.partial(self._start_epoch, self._stage, train and config is None),
        )
        self._stage_in_loader = loader.prefetching
        return loader

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, seeded training batches of ``(images, int64 labels)``.

        For CPU training the images are normalized ``float32`` (the loader threads normalize them); for CUDA training
        they are ``uint8`` NCHW (``channels_last`` memory), and when prefetching to the device they arrive on the GPU
        already normalized.

        With ``drop_last=True``, a ``batch_size`` larger than this process's share of the training split (a batch size
        finder's doubling, or a small dataset) would leave no batch to train on: it is clamped to that share, one
        batch an epoch, with a warning (:meth:`clamp_batch_size`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        if self.drop_last:
            self.clamp_batch_size()
        return self._loader(self.train_dataset, shuffle=True, drop_last=self.drop_last, train=True)

    def clamp_batch_size(self) -> int:
        """Lower ``batch_size`` to this process's share of the training split when it is larger; returns it.

        The DataModule's attribute and its saved ``batch_size`` both change, so Lightning's ``BatchSizeFinder`` (which
        reads the saved value) stops there, and a checkpoint says what trained. Warns when it lowers it.
        """
        if self.train_dataset is None:
            self.setup("fit")
        samples = len(self.train_dataset)  # type: ignore[arg-type]
        replicas = (getattr(self.trainer, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
        share = max(1, math.ceil(samples / replicas))  # a DistributedSampler pads every rank to the same share
        if self.batch_size <= share:
            return self.batch_size
        per_process = f" ({share} per process on {replicas})" if replicas > 1 else ""
        rank_zero_warn(
            f"`batch_size={self.batch_size}` is larger than the training split's {samples} images{per_process}, and"
            f" `drop_last=True` would leave no batch to train on: batches hold {share} instead, one an epoch. Pass"
            f" `batch_size` <= {share} (a batch size finder stops here by itself), or `drop_last=False`."
        )
        self.batch_size = share
        if "batch_size" in self.hparams:
            self.hparams["batch_size"] = share
        return share

    @override
    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Validation batches in order (an empty list when there is no validation data)."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, shuffle=False, drop_last=False)

    @override
    def test_dataloader(self) -> DataLoader:
        """Batches of the ``test`` split (a ``test/``, ``testing/``, ... folder), in order, with validation transforms.

        Raises:
            MissingSplitError: the database has no test split (a ``ValueError``).

        """
        if self._splits is None:
            self.setup("test")
        if self.test_dataset is None:
            raise MissingSplitError(
                f"{str(self.database_path)!r} has no test split; it holds {self._splits}. Put test images in"
                " `test/<class>/` (or `testing/`) beside `train/` under `data_dir`, then run again."
            )
        return self._loader(self.test_dataset, shuffle=False, drop_last=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        """Batches of :meth:`resolved_predict_split`, in order; :meth:`predict_sources` maps them back to files."""
        if self.predict_dataset is None:
            self.predict_dataset = self.build_dataset(self.resolved_predict_split(), self.val_transform())
        return self._loader(self.predict_dataset, shuffle=False, drop_last=False)

    # ------------------------------------------------------------------------------------------------------------
    # On the device
    # ------------------------------------------------------------------------------------------------------------

    def batch_dtype(self) -> torch.dtype:
        """The dtype images are converted to: float32, or the Trainer's true-precision dtype."""
        trainer = self.trainer
        if trainer is None:
            return torch.float32
        return _PRECISION_DTYPES.get(str(trainer.precision), torch.float32)

    def _device_stage(self) -> DeviceStage:
        """The on-device transform of this DataModule's batches, for the Trainer's device and precision."""
        return DeviceStage(
            self.normalizer,
            dtype=self.batch_dtype(),
            channels_last=self.channels_last,
            device=self._device(),
            image_size=self.image_size,
            skip=self._skip_counter.skip if self.on_bad_sample == "skip" else None,
        )

    def to_model_input(self, batch: Any) -> Any:
        """uint8 images, or still-encoded ones, in the first element of a batch -> normalized floats on its device.

        The device stage (:class:`~lightning_fastdata.pipeline.device.DeviceStage`): the loaders run it on the side
        stream when they copy batches ahead, ``on_after_batch_transfer`` otherwise. A batch that is already floating
        point only takes the model's dtype.
        """
        return self._device_stage()(batch)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn the uint8 images (first element of the batch) into normalized floats on the batch's device.

        Nothing to do when the loader already did it on the side stream; otherwise the stage built with the loader
        runs here (one object for the run, not one per batch).
        """
        if self._stage_in_loader:
            return batch
        return (self._stage or self._device_stage())(batch)
