"""``FastImageDataModule``: point it at an image folder, get the fastest input pipeline this machine can give.

Its public API is composed as Lightning composes ``LightningDataModule(DataHooks, HyperparametersMixin)``: from
facets, each a mixin of its own module. This module holds the class with its arguments (the class docstring, which
LightningCLI reads, and ``__init__``) and the plans they resolve into (:mod:`lightning_fastdata.plans`);
:class:`~lightning_fastdata.datamodule_data.DataSide` answers where the data is and what it holds, and opens its
datasets; :class:`~lightning_fastdata.datamodule_loaders.LoaderSide` feeds them to the model: loaders, workers, the
image size and the batch on the device. ``PlainHparamsDataModule`` (:mod:`lightning_fastdata.hparams`) saves the
arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from torch.utils.data import Dataset

from lightning_fastdata.arguments import check_arguments
from lightning_fastdata.database import Database
from lightning_fastdata.datamodule_data import DataSide
from lightning_fastdata.datamodule_loaders import LoaderSide
from lightning_fastdata.hparams import HPARAMS_PREFIX as HPARAMS_PREFIX
from lightning_fastdata.hparams import PlainHparamsDataModule, redacted
from lightning_fastdata.loaders import SplitLoaders
from lightning_fastdata.pipeline.views import ViewGroup
from lightning_fastdata.plans import AugmentPlan, DataPlan, LoaderPlan
from lightning_fastdata.store.labels import LABEL_SEPARATOR
from lightning_fastdata.store.reader import DEFAULT_MAX_PIXELS
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_fastdata.workers import AUTO_PROCESSES_MIN_WORKERS as AUTO_PROCESSES_MIN_WORKERS

_Plan = TypeVar("_Plan", DataPlan, LoaderPlan, AugmentPlan)


class FastImageDataModule(DataSide, LoaderSide, PlainHparamsDataModule):
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
