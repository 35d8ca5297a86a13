"""``FastImageDataModule``: point it at an image folder, get the fastest input pipeline this machine can give."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fastdata import loaders, resizing, resolve
from lightning_fastdata.arguments import check_arguments
from lightning_fastdata.database import Database
from lightning_fastdata.hparams import HPARAMS_PREFIX as HPARAMS_PREFIX
from lightning_fastdata.hparams import PlainHparamsDataModule, redacted, say_clashes
from lightning_fastdata.loaders import SplitLoaders
from lightning_fastdata.pipeline import DeviceStage, FastLoader
from lightning_fastdata.pipeline.device import batch_dtype, trainer_device, uses_prefetch
from lightning_fastdata.pipeline.schema import split_beside
from lightning_fastdata.pipeline.views import MultiViewCrop, ViewGroup
from lightning_fastdata.plans import AugmentPlan, DataPlan, LoaderPlan
from lightning_fastdata.splits import missing_split, pick_predict_split, split_sources
from lightning_fastdata.store import cache, remote
from lightning_fastdata.store.labels import LABEL_SEPARATOR
from lightning_fastdata.store.reader import DEFAULT_MAX_PIXELS, LmdbImageDataset
from lightning_fastdata.store.targets import TargetSpec
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, CenterCropResize, RandomResizedCropFlip
from lightning_fastdata.tuning import LoaderConfig
from lightning_fastdata.workers import AUTO_PROCESSES_MIN_WORKERS as AUTO_PROCESSES_MIN_WORKERS
from lightning_fastdata.workers import budget_for, default_workers

_Plan = TypeVar("_Plan", DataPlan, LoaderPlan, AugmentPlan)


class FastImageDataModule(PlainHparamsDataModule):
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
            plain ImageFolder root, a ``path,label`` list file (``.csv``/``.tsv``/``.json``), or a database made by
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
        image_size_schedule: progressive resizing or FixRes: ``{epoch: image_size}`` from that epoch on (``{0: 128,
            10: 160, 15: 224}``), applied by the training loader from its sampler's epoch (resume-exact); validation
            uses the size of the epoch it follows; a folder is converted for the largest size.
        batch_size: samples per batch (per process under DDP). With ``drop_last=True`` a value above the process's
            share of the training split is clamped to it, with a warning (:meth:`clamp_batch_size`).
        num_workers: loader threads (or worker processes, see ``engine``) per training process; ``"auto"`` budgets
            them from the usable CPUs; ``"tune"`` measures 0 up to the budget for a few seconds on the training data,
            each count on the engine it would train on, and keeps the cheapest count within 5% of the fastest (cached
            under ``cache_dir``, keyed by database, transforms, batch size, engine and CPUs); ``num_workers`` then
            reads the pick.
        engine: ``"threads"`` builds batches on ``num_workers`` threads in the training process; ``"processes"`` on
            ``num_workers`` DataLoader worker processes, straight into batch slots shared with it. ``"auto"``: worker
            processes for CUDA training with 4 workers or more, else threads; logged once (:meth:`resolved_engine`).
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
        decode: ``"cpu"`` decodes in the workers; ``"device"`` decodes, crops and resizes whole batches of the stored
            JPEGs on the GPU (batched nvJPEG, on the training thread; about 1.4 grey levels from ``"cpu"``'s pixels).
            Without CUDA it warns once and decodes on the CPU.
        on_bad_sample: ``"raise"`` stops on a sample that fails to read, decode or transform, with an error naming
            the split, index and cause; ``"skip"`` leaves such samples out of their batch, logs the first few and
            counts them in :attr:`skipped_samples`.
        predict_split: the split ``predict_dataloader`` reads, in order; default ``"test"``, else ``"val"``, else
            ``"train"``. :meth:`predict_sources` names the source file of each prediction.
        prepare_data_per_node: ``True``: local rank 0 of every node converts or stages the data in ``prepare_data``;
            ``False``: global rank 0 alone does, for a ``cache_dir`` every node shares (docs/ddp.md).
        max_pixels: the most pixels a stored image may have (default 48 MiP, 8192 x 6144), checked before decoding; a
            larger one is a bad sample naming its split and index: no decompression bomb from a database you did not
            make. Raise it for trusted databases of larger images (``None``: no limit).
        targets: what a list file's labels are, when ``data_dir`` is one (``"class"``, ``"multilabel"``, ``"float"``,
            ``"none"``; docs/datamodule.md#targets): passed to the conversion, as ``lightning-fastdata convert
            --targets``. ``None``: inferred where unambiguous, else the conversion refuses naming this argument. For a
            database, the kind it must hold (a mismatch is an error); a folder gives classes, or ``"none"``.
        label_separator: what separates a list file's class names in one ``multilabel`` label (``cat|outdoor``).
        return_index: training and predict batches are ``(images, targets, index)``, ``index`` each sample's dataset
            index (``int64 [B]``) in the database split it was read from, on every engine; :meth:`sources` names the
            file of each. Validation and test batches stay ``(images, targets)``, as solo-learn's and lightly's
            evaluation steps unpack them.
        views: self-supervised training: view groups (:class:`~lightning_fastdata.ViewGroup`, or mappings of its
            fields), e.g. DINO's 2 x 224 at scale ``(0.4, 1)`` and 6 x 96 at ``(0.05, 0.4)``, each image decoded once.
            Training batches are ``(views, targets[, index])``, ``views`` a list of ``[B, 3, S, S]`` tensors, large
            first; evaluation keeps the centre crop (docs/datamodule.md#self-supervised-training).
        color_jitter: training colour jitter ``(brightness, contrast, saturation, hue)`` as torchvision's
            ``ColorJitter`` takes them (the DINO/BYOL recipe: ``(0.4, 0.4, 0.2, 0.1)``); ``None``: none. Each
            sample gets parameters of its own drawn from ``(seed, epoch, index)`` (with ``views``, each view its own,
            with its group's probabilities where it sets them); the ops run before normalization: on the device, on
            the batch, for CUDA training; in the loader, crop by crop, on a CPU (:mod:`.pipeline.color`).
        color_jitter_p: probability of the jitter, per sample.
        grayscale_p: probability of random grayscale, per training sample.
        blur_p: probability of a Gaussian blur, per training sample, sigma uniform in ``blur_sigma``.
        blur_sigma: the blur's sigma range ``(low, high)``, in pixels.
        solarize_p: probability of solarization (values >= 128 inverted), per training sample.
        worker_nice: lower the worker processes' priority (``engine="processes"``) by this nice increment, 0-19: the
            training process's thread, which launches the GPU's work, then gets a core the moment it wakes, while the
            workers keep every core it leaves idle. For CUDA training with workers on every core (19: the lowest
            priority); not for CPU training, whose step would take the workers' cores (docs/datamodule.md).

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
        targets: Literal["class", "multilabel", "float", "none"] | None = None,
        label_separator: str = LABEL_SEPARATOR,
        return_index: bool = False,
        views: list[ViewGroup] | None = None,
        color_jitter: tuple[float, float, float, float] | None = None,
        color_jitter_p: float = 0.8,
        grayscale_p: float = 0.0,
        blur_p: float = 0.0,
        blur_sigma: tuple[float, float] = (0.1, 2.0),
        solarize_p: float = 0.0,
        worker_nice: int = 0,
    ) -> None:
        super().__init__()
        checked = check_arguments(
            cache_dir=cache_dir, image_size=image_size, image_size_schedule=image_size_schedule, batch_size=batch_size,
            num_workers=num_workers, engine=engine, prefetch_factor=prefetch_factor, val_fraction=val_fraction,
            mean=mean, std=std, decode=decode, on_bad_sample=on_bad_sample, max_pixels=max_pixels, targets=targets,
            views=views, color_jitter=color_jitter, color_jitter_p=color_jitter_p, grayscale_p=grayscale_p,
            blur_p=blur_p, blur_sigma=blur_sigma, solarize_p=solarize_p, worker_nice=worker_nice,
        )  # fmt: skip
        self.save_hyperparameters()
        shown = redacted(data_dir)
        if shown is not None:  # the loggers' hyperparameters and the checkpoints never hold a URL's secrets
            self.save_hyperparameters({**self.hparams, "data_dir": shown})
        self.data_dir = data_dir
        self.cache_dir = cache_dir
        self.image_size = image_size
        self.image_size_schedule = checked.schedule
        self.views = checked.views
        #: the configured size (`image_size` is the current one): with the schedule and views, what is converted for
        self._base_size = image_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        #: whether `num_workers` is (or will be) the pick of `num_workers="tune"`
        self._tunes_workers = num_workers == "tune"
        self.engine = engine
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.val_fraction = val_fraction
        self.seed = seed
        self.normalizer = checked.normalizer
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
        self.targets = targets
        self.label_separator = label_separator
        self.return_index = return_index
        self.worker_nice = worker_nice
        self._color = checked.color
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.predict_dataset: Dataset | None = None
        #: the data side: the database, staged or converted, and its splits once open
        self._database = Database()
        #: the loader side: worker count and engine, the device stage of the last loader, what was warned once
        self._loaders = SplitLoaders()
        self._warned_hparams: set[tuple[str, str, str]] = set()
        #: the fields taken beside the batch being transferred (`on_before_batch_transfer`), for the device stage
        self._beside: dict[str, Any] = {}

    # --- Where the data is --------------------------------------------------------------------------------------

    @property
    def is_database(self) -> bool:
        """Whether ``data_dir`` already is a converted database (then nothing is converted), here or at a URL."""
        return self.is_remote or resolve.is_database(self.data_dir)

    @property
    def is_remote(self) -> bool:
        """Whether ``data_dir`` is a URL, whose database is staged into ``cache_dir`` (:attr:`staging`)."""
        return remote.is_url(self.data_dir)

    @property
    def staging(self) -> remote.StagedDatabase | None:
        """What staging ``data_dir`` did in this process (fetched, fetched again and why, reused); ``None``: nothing."""
        return self._database.staged

    @property
    def cache_root(self) -> Path:
        """The directory holding conversions and the ``num_workers="tune"`` cache."""
        return cache.cache_root(self.cache_dir)

    @property
    def database_path(self) -> Path:
        """The database that is read: ``data_dir`` itself, or its conversion under ``cache_dir``."""
        return resolve.database_path(
            self.data_dir, self.cache_root, self.store_short_side(), self.quality, self.encoding, self.targets,
            self.label_separator,
        )  # fmt: skip

    def store_short_side(self) -> int | None:
        """The short side a conversion stores (``None``: original sizes): ``short_side``, or one fit for the crops."""
        return resolve.store_short_side(self.short_side, max(self.augment_plan.sizes), self.crop_fraction)

    @property
    def classes(self) -> list[str]:
        """Class names: from the database, or before conversion from the folder names (nothing is read)."""
        return self._database.classes(self.data_plan)

    # --- Plans: the settings as the modules that do the work receive them (:mod:`lightning_fastdata.plans`) --------

    def _plan(self, kind: type[_Plan], **resolved: Any) -> _Plan:
        """A ``kind`` plan of the current settings: each field the attribute of its name, unless ``resolved`` has it."""
        names = [field.name for field in dataclasses.fields(kind) if field.name not in resolved]  # type: ignore[arg-type]
        return kind(**{name: getattr(self, name) for name in names}, **resolved)

    @property
    def data_plan(self) -> DataPlan:
        """Where the data is and how it is read, as now set."""
        return self._plan(DataPlan, largest_size=max(self.augment_plan.sizes))

    @property
    def loader_plan(self) -> LoaderPlan:
        """How the loaders run, as now set (``num_workers`` is ``"tune"``'s pick once it is made)."""
        return self._plan(LoaderPlan, skips=self.on_bad_sample == "skip")

    @property
    def augment_plan(self) -> AugmentPlan:
        """How training samples are augmented: the configured size and schedule, crops, views, colour."""
        views = None if self.views is None else tuple(self.views)
        return self._plan(
            AugmentPlan, image_size=self._base_size, schedule=self.image_size_schedule, views=views, color=self._color
        )

    @property
    def tunes_workers(self) -> bool:
        """Whether ``num_workers`` is ``num_workers="tune"``'s pick (measured on this machine), once it is made."""
        return self._tunes_workers

    @property
    def skipped_samples(self) -> int:
        """Samples left out so far under ``on_bad_sample="skip"`` (counted across DataLoader workers)."""
        return self._loaders.skip_counter.value

    @property
    def num_large_views(self) -> int:
        """Training views of the largest size per image (``views``' first groups; 1 without ``views``)."""
        if self.views is None:
            return 1
        return sum(g.count for g in self.views if g.size == self.views[0].size)

    @property
    def num_small_views(self) -> int:
        """Training views smaller than the largest per image (DINO's local crops; 0 without ``views``)."""
        return 0 if self.views is None else sum(g.count for g in self.views) - self.num_large_views

    @property
    def num_classes(self) -> int:
        """Classes of a ``class`` or ``multilabel`` database (``C``); 0 for ``float`` and ``none`` targets."""
        classes = self.classes  # before conversion or staging: a folder's, or the error that says to stage first
        return len(classes) if self.target_kind in ("class", "multilabel") else 0

    # --- Lightning hooks ----------------------------------------------------------------------------------------

    @override
    def prepare_data(self) -> None:
        """Convert ``data_dir`` once, or stage it from its URL (one process per node; an up-to-date copy is reused)."""
        self._database.prepare(self.data_plan)
        if self.num_workers == "tune":  # measured here, on one process per node, so the ranks read the cache
            self.num_workers = self._tuned_workers()

    @override
    def setup(self, stage: str) -> None:
        """Open the database's splits (:func:`~lightning_fastdata.splits.open_splits`); only ``fit`` needs ``train``.

        Without a ``val`` split, ``val_fraction`` of ``train`` is held out (seeded).
        """
        # before Lightning merges the hyperparameters, which it does after `setup`
        say_clashes(self.trainer, self.hparams_clashes, self._warned_hparams)
        if self.train_dataset is None and (self._database.splits is None or stage == "fit"):
            # again after `train_dataset = None`: the same splits and holdout (seeded), rebuilt
            opened = self._database.open(
                self.data_plan, self.predict_split, self.build_dataset, self.train_transform, self.val_transform
            )
            for name in ("train", "val", "test"):  # a split the database lacks leaves its dataset as it was
                if getattr(opened, name) is not None:
                    setattr(self, f"{name}_dataset", getattr(opened, name))
        if stage == "fit" and self.train_dataset is None:
            raise missing_split(self.database_path, self._database.splits, "train")
        if stage == "fit":
            self._loaders.workers.say_shared_generators(
                self.train_dataset, self.loader_plan, self.worker_budget, self.resolved_engine
            )

    def resolved_predict_split(self, splits: Sequence[str] | None = None) -> str:
        """The split ``predict_dataloader`` reads: ``predict_split``, else ``test``, else ``val``, else ``train``."""
        return pick_predict_split(self.database_path, self.predict_split, splits)

    def predict_sources(self) -> list[str]:
        """Where each sample of :meth:`predict_dataloader` came from, in its order (on one device; :meth:`sources`).

        Under DDP each rank predicts every ``world_size``-th sample (``DistributedSampler`` without shuffling); rank
        ``r``'s ``i``-th prediction is ``predict_sources()[r + i * world_size]`` (the last few may repeat).
        """
        return self.sources(self.resolved_predict_split())

    # --- Extension points ---------------------------------------------------------------------------------------

    def train_transform(self) -> Callable[[torch.Tensor], Any]:
        """The per-image training transform: uint8 CHW in, uint8 CHW ``image_size`` square out.

        With ``views``, a list of uint8 CHW crops, one per view, large views first
        (:class:`~lightning_fastdata.pipeline.views.MultiViewCrop`).
        """
        if self.views is not None:
            return MultiViewCrop(self.views)
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

    # --- The image size: set here, reaching the loaders through :func:`.resizing.apply_size` ---------------------

    def set_image_size(self, size: int) -> None:
        """Crop to ``size`` (an int >= 1) from now on: progressive resizing and FixRes (docs/datamodule.md).

        The loaders' crops change size as their next epoch starts (the datasets and their transforms stay as built),
        and the crops of ``decode="device"`` at once. Call it before ``fit`` or from ``on_train_epoch_start``. What
        changes and when, what it warns: :mod:`lightning_fastdata.resizing`. ``image_size`` changes; the saved
        hyperparameter stays the configured one.
        """
        size = resizing.check_size(size)
        if size == self.image_size:
            return
        previous, self.image_size = self.image_size, size
        built = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}
        opened = self.data_plan if self._database.splits is not None else None  # checks its stored images
        resizing.apply_size(size, previous, built, self._loaders.stage, opened)

    def _start_epoch(self, stage: DeviceStage, scheduled: bool, epoch: int) -> int:
        """A loader's ``before_epoch``: the schedule's size of ``epoch`` (``scheduled``), the current one for ``stage``.

        The size is set through :meth:`set_image_size` (a subclass's override counts); a loader whose persistent worker
        processes started at another size restarts them, as the returned size changed.
        """
        if scheduled and self.image_size_schedule:
            self.set_image_size(resizing.size_at(self.image_size_schedule, epoch, self._base_size))
        stage.image_size = self.image_size
        return self.image_size

    # --- Loaders ------------------------------------------------------------------------------------------------

    def worker_budget(self) -> int:
        """Workers per process that the usable CPUs allow (:func:`~lightning_fastdata.workers.budget_for`)."""
        return budget_for(self.trainer)

    def resolved_num_workers(self) -> int:
        """The worker count the loaders use (``"auto"`` resolved; a value above the budget warns once).

        ``num_workers="tune"``'s pick is also ``num_workers`` from then on; the saved hyperparameter stays ``"tune"``.
        """
        plan, budget = self.loader_plan, self.worker_budget()
        workers = self._loaders.workers.num_workers(plan, budget, self.trainer, self._tuned_workers)
        if self.num_workers == "tune":
            self.num_workers = workers
        return workers

    def _tuned_workers(self) -> int:
        """``num_workers="tune"``'s pick: cached, or measured on :meth:`tuning_loader` (``WorkerChoice``)."""
        return self._loaders.tuned_workers(
            self.loader_plan, self.trainer, self._device(), self.cache_root, lambda: self.database_path,
            self.train_transform, self.worker_budget, self.tuning_loader,
        )  # fmt: skip

    def resolved_engine(self, workers: int | None = None) -> Literal["threads", "processes"]:
        """The engine the loaders use: ``engine``, or ``"auto"``'s choice, logged once (``WorkerChoice.engine``).

        ``workers`` defaults to the budget, or to ``num_workers`` when it is a number.
        """
        plan = self.loader_plan
        if workers is None:
            workers = default_workers(plan, self.worker_budget)
        return self._loaders.engine(plan, self._device(), workers)

    def tuning_loader(self, config: LoaderConfig) -> DataLoader:
        """The training loader as ``fit`` builds it, with ``config``'s settings: what ``"tune"`` and ``bench`` time."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        return self._loader(
            self.train_dataset, drop_last=self.drop_last, train=True, config=config, return_index=self.return_index
        )

    def _loader(
        self,
        dataset: Dataset,
        drop_last: bool = False,
        train: bool = False,
        config: LoaderConfig | None = None,
        return_index: bool = False,
    ) -> FastLoader:
        """The loader of ``dataset`` (:meth:`.SplitLoaders.build`): shuffled, resumable and scheduled with ``train``.

        ``config``: a tuning sweep's workers, engine, batch size and pinning, else this DataModule's, resolved.
        """
        scheduled = train and config is None
        if config is None:
            workers = self.resolved_num_workers()
            config = self._loaders.config(self.loader_plan, self.trainer, workers, self.resolved_engine(workers))
        stage = self._device_stage()
        return self._loaders.build(
            dataset, self.loader_plan, config, stage, self._device(), self.trainer, train=train, drop_last=drop_last,
            return_index=return_index, normalizer=self.normalizer, color=self._color,
            before_epoch=functools.partial(self._start_epoch, stage, scheduled), prefetch=self.uses_prefetch(),
        )  # fmt: skip

    def _device(self) -> torch.device:
        return trainer_device(self.trainer)

    def uses_prefetch(self) -> bool:
        """Whether loaders copy batches ahead on a side CUDA stream (``prefetch_to_device``, resolved)."""
        return uses_prefetch(self.prefetch_to_device, self._device())

    def uses_device_decode(self) -> bool:
        """Whether JPEGs are decoded on the GPU (``decode="device"`` on CUDA); warns once when CUDA is missing."""
        return self._loaders.uses_device_decode(self.decode, self._device())

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled, seeded ``(images, targets)`` batches: ``views`` for images with ``views``, ``index`` last too.

        ``index`` with ``return_index``. Targets of the database's kind (:attr:`target_kind`: ``int64 [B]``,
        multi-hot ``float32 [B, C]``, ``float32 [B, K]`` or ``[B]``, ``-1``). Images normalized ``float32`` for CPU
        training, ``uint8`` NCHW for CUDA (normalized on the device). A ``batch_size`` above this process's share is
        clamped (:meth:`clamp_batch_size`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        if self.drop_last:
            self.clamp_batch_size()
        return self._loader(self.train_dataset, drop_last=self.drop_last, train=True, return_index=self.return_index)

    def clamp_batch_size(self) -> int:
        """Lower ``batch_size`` to this process's share of the training split when larger, with a warning; returns it.

        The saved ``batch_size`` changes too (:func:`lightning_fastdata.loaders.clamp_batch_size`).
        """
        if self.train_dataset is None:
            self.setup("fit")
        share = loaders.clamp_batch_size(self.batch_size, len(self.train_dataset), self.trainer)  # type: ignore[arg-type]
        if share != self.batch_size:
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
        return self._loader(self.val_dataset)

    @override
    def test_dataloader(self) -> DataLoader:
        """Batches of the ``test`` split (a ``test/``, ``testing/``, ... folder), in order, with validation transforms.

        Raises:
            MissingSplitError: the database has no test split (a ``ValueError``).

        """
        if self._database.splits is None:
            self.setup("test")
        if self.test_dataset is None:
            raise missing_split(self.database_path, self._database.splits, "test")
        return self._loader(self.test_dataset)

    @override
    def predict_dataloader(self) -> DataLoader:
        """Batches of :meth:`resolved_predict_split`, in order; :meth:`predict_sources` maps them back to files."""
        if self.predict_dataset is None:
            self.predict_dataset = self.build_dataset(self.resolved_predict_split(), self.val_transform())
        return self._loader(self.predict_dataset, return_index=self.return_index)

    # --- On the device ------------------------------------------------------------------------------------------

    def batch_dtype(self) -> torch.dtype:
        """The dtype images are converted to: float32, or the Trainer's true-precision dtype."""
        return batch_dtype(self.trainer)

    def _device_stage(self) -> DeviceStage:
        """The on-device transform of this DataModule's batches, for the Trainer's device and precision."""
        return self._loaders.device_stage(
            self.normalizer, self.batch_dtype(), self._device(), self.image_size, self._color, self.channels_last,
            self.on_bad_sample == "skip",
        )  # fmt: skip

    def to_model_input(self, batch: Any) -> Any:
        """uint8 images, or still-encoded ones, in the first element of a batch -> normalized floats on its device.

        The device stage (:class:`~lightning_fastdata.pipeline.device.DeviceStage`); a float batch only takes the dtype.
        """
        return self._device_stage()(batch)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Take the fields that travel beside the batch (its colour parameters) for the device stage.

        The transfer (and a LightningModule's ``transfer_batch_to_device``) moves the plain batch; the device stage
        takes them in :meth:`on_after_batch_transfer`, which Lightning calls next for the same batch.
        """
        batch, self._beside = split_beside(batch)
        return batch

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn the uint8 images (first element of the batch) into normalized floats on the batch's device.

        Nothing to do when the loader already did it on the side stream; otherwise the stage built with the loader
        runs here (one object for the run, not one per batch), with the fields taken beside the batch.
        """
        beside, self._beside = self._beside, {}
        return self._loaders.on_device(batch, self._device_stage, beside)

    # --- Targets and where each sample came from ----------------------------------------------------------------

    @property
    def target_spec(self) -> TargetSpec:
        """What each sample's target is (:mod:`~lightning_fastdata.store.targets`): the database's, else classes."""
        return self._database.target_spec(self.data_plan)

    @property
    def target_kind(self) -> str:
        """``"class"``, ``"multilabel"``, ``"float"`` or ``"none"``: what batches hold (:meth:`train_dataloader`)."""
        return self.target_spec.kind

    @property
    def target_dim(self) -> int:
        """Values per sample of a ``float`` target (``K``), else 0."""
        return self.target_spec.dim

    def sources(self, split: str | None = None) -> list[str]:
        """Where each index of ``split`` came from: ``sources(split)[index]`` names the file of a batch's ``index``.

        ``split`` defaults to the training split. What an entry is, and the errors: :func:`.splits.split_sources`.
        """
        return split_sources(self.database_path, split)
