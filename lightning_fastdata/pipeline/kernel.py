"""Record to pixels: :class:`BatchReader` builds a whole batch of one split from its database records.

This is step 3 of the batch path; :mod:`lightning_fastdata.pipeline` follows a sample's whole trip, from its
database record to a batch on the device, and :func:`~lightning_fastdata.pipeline.factory.create_loader` builds the
loader that runs it (:class:`~lightning_fastdata.pipeline.factory.FastLoader`).

1. **Records.** The batch's records are read in one LMDB transaction (the environment opened lazily in the process
   that reads, checksums verified) and decoded straight from the memory map (libjpeg-turbo through ``simplejpeg``).
2. **Crops.** The batch's crop boxes and flips are drawn at once, each sample's from its key ``(seed, epoch,
   sample)``; each image is then cropped, resized (antialiased when shrinking) and flipped *straight into its slot*
   of one preallocated ``uint8`` NHWC batch buffer (OpenCV). For CPU training each crop is also coloured (colour
   augmentation, :mod:`~lightning_fastdata.pipeline.color`) and normalized to ``float32`` in the same thread
   (:class:`~lightning_fastdata.pipeline.crop.CropKernel`). A user's own transform (or dataset) takes the per-sample
   path instead (:mod:`~lightning_fastdata.pipeline.per_sample`): ``dataset[i]``, then stacking.
3. **Targets.** A batch's targets are of its database's kind (:mod:`~lightning_fastdata.store.targets`): class
   indices from the record headers already read (``int64 [B]``), else the kept records' multi-hot ``float32 [B, C]``
   or ``float32 [B, K]`` (``[B]`` when K = 1) rows, read once per batch (``LmdbImageDataset.targets_of``), or ``-1``.
   With ``return_index`` a batch also holds each sample's dataset index, ``int64 [B]``: its record in the split
   (through a subset, the index into the split it views).
4. **Bad samples.** Under ``on_bad_sample="skip"`` a sample that fails with one of this package's errors is left
   out of its batch and counted, with its target and index (:func:`~lightning_fastdata.skipping.read_kept`);
   otherwise the error propagates with the split and index.

With ``decode="device"`` the batch holds the still-encoded JPEGs and their crop boxes instead
(:func:`~lightning_fastdata.pipeline.device_decode.read_encoded`), decoded by nvJPEG on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, get_worker_info

from lightning_fastdata.keyed_random import AugmentKey
from lightning_fastdata.pipeline.color import BatchColor, ImagePlan
from lightning_fastdata.pipeline.crop import CropKernel
from lightning_fastdata.pipeline.device_decode import check_encodable, read_encoded
from lightning_fastdata.pipeline.per_sample import read_samples
from lightning_fastdata.pipeline.schema import BatchSchema
from lightning_fastdata.pipeline.slots import Batches, FreshBatch, SlotBatch, SlotLayout, SlotMemory
from lightning_fastdata.pipeline.targets import fill_targets, new_rows, records_of, subset_view
from lightning_fastdata.skipping import SkipCounter, read_kept
from lightning_fastdata.store.format import RecordHeader
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.transforms import Box, FusedCrops, Normalizer

Output = Literal["uint8", "float", "encoded"]


def _split_view(dataset: Dataset) -> tuple[Dataset, np.ndarray | None]:
    """``(base, indices)`` of a fixed subset of a database (:func:`subset_view`): ``(dataset, None)`` for any other.

    Nested or not: ``torch.utils.data.Subset``, the DataModule's held-out view.
    """
    base, indices = subset_view(dataset)
    if isinstance(base, LmdbImageDataset) and indices is not None:
        return base, indices
    return dataset, None


def fast_path(dataset: Dataset) -> FusedCrops | None:
    """What :class:`BatchReader` fuses for ``dataset``, as its database split states it; ``None``: sample by sample.

    The split is an :class:`~lightning_fastdata.LmdbImageDataset` (or a subset of one) whose
    :meth:`~lightning_fastdata.LmdbImageDataset.fast_path` names the crops: those of the package's crop transforms
    (or its :class:`~lightning_fastdata.pipeline.views.MultiViewCrop`), unchanged.
    """
    base, _ = _split_view(dataset)
    return base.fast_path() if isinstance(base, LmdbImageDataset) else None


def fuses(dataset: Dataset) -> bool:
    """Whether :class:`BatchReader` builds ``dataset``'s batches on the fused path (:func:`fast_path`)."""
    return fast_path(dataset) is not None


def _batch_as_is(batch: Any) -> Any:
    """The collate function of worker processes: :meth:`BatchReader.__getitems__` already returns a whole batch."""
    return batch


class BatchReader(Dataset):
    """Builds whole batches of one split: record -> decode -> crop/resize/flip into one buffer (-> normalize).

    The fused path runs when ``dataset`` is an :class:`~lightning_fastdata.LmdbImageDataset` (or a subset of one,
    or a subclass that keeps ``__getitem__`` and ``decode``) whose transform is
    :class:`~lightning_fastdata.transforms.RandomResizedCropFlip` or
    :class:`~lightning_fastdata.transforms.CenterCropResize`; any other dataset or transform is read sample by sample
    with ``dataset[i]`` and stacked with ``default_collate``.

    Args:
        dataset: the split to read.
        output: ``"uint8"`` batches (NCHW views of NHWC memory: ``channels_last``), for normalization on the device;
            ``"float"`` normalized ``float32`` batches (normalized in the reading thread); ``"encoded"`` still-encoded
            JPEGs with their crop boxes, for ``decode="device"``.
        normalizer: the mean and std for ``output="float"``.
        channels_last: ``float`` batches in ``channels_last`` memory (uint8 batches always are).
        skip_counter: when given, samples that fail with a package error are left out of their batch and counted.
        pin_memory: allocate batches in page-locked memory (for ``non_blocking`` copies to a GPU).
        return_index: batches are ``(images, targets, index)``, ``index`` the samples' true dataset indices
            (``int64 [B]``): for a subset (``torch.utils.data.Subset``, the DataModule's held-out view) of an
            :class:`~lightning_fastdata.LmdbImageDataset`, the index into the split it views.
        color: draw each sample's colour parameters from its key (:meth:`BatchColor.draw
            <lightning_fastdata.pipeline.color.BatchColor.draw>`, keyed by its dataset index). The fused path with
            ``output="float"`` (CPU training) colours each crop with them before normalizing it; otherwise they are the
            batch's ``color`` field, ``float32 [B, 7]``, which travels beside it
            (:mod:`~lightning_fastdata.pipeline.schema`) for the device stage to apply (``[B, V, 7]``, each view its
            own, when the images are a list of ``V`` views: built-in ``views`` or a transform's list).

    """

    def __init__(
        self,
        dataset: Dataset,
        output: Output = "uint8",
        normalizer: Normalizer | None = None,
        channels_last: bool = False,
        skip_counter: SkipCounter | None = None,
        pin_memory: bool = False,
        return_index: bool = False,
        color: BatchColor | None = None,
        crop_size: int | None = None,
    ) -> None:
        if output not in ("uint8", "float", "encoded"):
            raise ValueError(f"`output` must be 'uint8', 'float' or 'encoded', got {output!r}.")
        if output == "float" and normalizer is None:
            raise ValueError("`output='float'` needs a `normalizer` (the mean and std).")
        self.dataset = dataset
        self.output = output
        self.normalizer = normalizer
        self.channels_last = channels_last
        self.skip_counter = skip_counter
        self.pin_memory = pin_memory
        self.return_index = return_index
        self.color = color
        self.base, self.indices = _split_view(dataset)
        transform = getattr(self.base, "transform", None)
        #: what the fused path makes for the dataset, as it states it (:func:`fast_path`); ``None``: per sample
        self.fast = fast_path(dataset)
        self.fused = self.fast is not None
        #: the side of single crops this epoch, given by the loader as each epoch starts (:meth:`start_epoch`);
        #: ``None``: the transform's own size
        self.crop_size = crop_size
        if output == "encoded":
            check_encodable(self.base, transform)
        self.transform = transform if self.fused or output == "encoded" else None
        #: whether crops are coloured here, in the reading thread (CPU training), instead of on the batch's device
        self.colors_crops = color is not None and self.fused and output == "float"
        #: where a worker process builds batches whose indices carry a slot (:mod:`~lightning_fastdata.pipeline.slots`):
        #: its loader's memory, set as the worker starts; the loader's threads pass theirs to :meth:`__getitems__`
        self.slots: SlotMemory | None = None
        #: the per-image kernel of the fused path, with its per-thread scratch buffers
        self._crop = CropKernel(self.base, output, normalizer, channels_last, color) if self.fused else None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        """One sample, as the wrapped dataset gives it."""
        return self.dataset[index]

    def batch_schema(self) -> BatchSchema | None:
        """The fields of this reader's fused batches (:mod:`~lightning_fastdata.pipeline.schema`), as of now.

        ``None`` when batches are not built into slots: the per-sample path (a transform or dataset of one's own) and
        still-encoded images (``decode="device"``).
        """
        if not self.fused or self.output == "encoded":
            return None
        assert self.transform is not None
        assert isinstance(self.base, LmdbImageDataset)
        spec, dtype = self.base.target_spec, "uint8" if self.output == "uint8" else "float32"
        chw = self.output == "float" and not self.channels_last
        shapes = [(3, size, size) if chw else (size, size, 3) for size in self._sizes()]
        color = self.color is not None and not self.colors_crops
        assert self.fast is not None
        return BatchSchema.of(shapes, dtype, (spec.shape, spec.dtype), self.return_index, color, self.fast.multiview)

    def slot_layout(self, batch_size: int) -> SlotLayout | None:
        """What one batch slot of this reader holds, for batches of ``batch_size``: its :meth:`batch_schema`."""
        schema = self.batch_schema()
        return None if schema is None else SlotLayout(batch_size, schema)

    def _sizes(self) -> list[int]:
        """The side of each view's crops: a single crop's is the epoch's (:attr:`crop_size`) or its transform's."""
        assert self.fast is not None
        if self.fast.multiview:
            return [crop.size for crop in self.fast.crops]
        return [self.crop_size or self.fast.crops[0].size]

    def start_epoch(self, crop_size: int | None) -> None:
        """The epoch's crop size, given by its loader as the epoch starts (``None``: the transform's own size).

        Single crops are cut to it, on the fused path and in the package's crop transforms of the per-sample path.

        Never during an epoch: a fused crop's side is its batch memory's, made for the epoch.
        """
        self.crop_size = crop_size

    def __getitems__(self, indices: Sequence[int], slots: SlotMemory | None = None) -> Any:
        """A whole batch, what the engines call: built in the slot its indices carry, if they carry one.

        A list of :class:`KeyedIndices` is a task of several batches (worker processes are sent a few at a time):
        they are built in order and returned together as :class:`~lightning_fastdata.pipeline.slots.Batches`.

        Into a slot (:class:`KeyedIndices` with a ``slot``) of ``slots`` (default: :attr:`slots`, a worker process's),
        the batch is a :class:`~lightning_fastdata.pipeline.slots.SlotBatch`: the slot and the samples in it, all
        that goes back from a worker process. Otherwise it is :meth:`read_batch`'s ``(images, targets[, index])``.
        """
        if indices and type(indices[0]) is KeyedIndices:  # a task of several batches (the process engine)
            return Batches(self.__getitems__(batch, slots) for batch in indices)
        slot, slots = getattr(indices, "slot", None), self.slots if slots is None else slots
        if slot is None or slots is None or len(indices) > slots.layout.batch_size:
            return self.read_batch(indices)
        return SlotBatch(slot, *self._fill_slot(indices, getattr(indices, "key", None), slots, slot))

    def read_batch(self, indices: Sequence[int], seed: int | None = None) -> Any:
        """The batch of samples ``indices``: ``(images, targets[, index])``, bad samples left out under the skip policy.

        Random crops and flips are a function of each sample's key (:mod:`lightning_fastdata.keyed_random`): the
        loaders pass ``(seed, epoch)`` with the indices (:class:`KeyedIndices`), so a sample is augmented the same
        way whichever thread or worker reads it, in any batch, after a resume. ``seed`` stands for the key
        ``(seed, 0)`` when the indices carry none; without either, boxes are drawn from :mod:`random`.

        Raises:
            FastDataError: a sample failed (naming its split and index), without the skip policy.
            SampleError: every sample of the batch failed, under the skip policy.

        """
        key = getattr(indices, "key", None)
        if key is None and seed is not None:
            key = (seed, 0)
        if self.output == "encoded":
            pairs = records_of(indices, self.indices)
            return read_encoded(
                self._lmdb(), self.transform, pairs, key, self.skip_counter, self.return_index, self._pin_labels
            )
        if not self.fused:  # a dataset or transform of one's own (:mod:`~lightning_fastdata.pipeline.per_sample`)
            return read_samples(
                self.dataset,
                self.indices,
                indices,
                key,
                self.crop_size,
                self.return_index,
                self.color,
                self.skip_counter,
            )
        return self._read_fused(indices, key)

    # -- the fused path --------------------------------------------------------------------------------------------

    def _read_fused(self, indices: Sequence[int], key: AugmentKey | None) -> tuple[Any, ...]:
        """The fused path into fresh memory (no slot): see :meth:`_fill`.

        In a worker process that memory is a memfd of its own, which goes to the training process as its file
        descriptor (:class:`~lightning_fastdata.pipeline.slots.FreshBatch`), as the slots' memory does: never through
        ``/dev/shm``, however many batches the loop keeps.
        """
        if get_worker_info() is not None:
            layout = self.slot_layout(len(indices))
            assert layout is not None
            memory = SlotMemory(layout, 1, shared=True)
            return FreshBatch(memory, *self._fill_slot(indices, key, memory, 0))
        schema, pinned = self.batch_schema(), self._pinned()
        assert schema is not None
        # one tensor per view, NHWC uint8 (or NCHW / NHWC float32): page-locked when asked for and CUDA is there, else
        # NumPy's (which asks the kernel for huge pages: few page faults)
        regions = [new_rows(field, len(indices), pinned) for field in schema.images]
        count, labels, records = self._fill(indices, key, [region.numpy() for region in regions])
        values = {}
        for field in schema.fields:
            rows = new_rows(field, count, pinned)
            given = PRODUCERS[field.name](self, key, labels, records, rows.numpy())
            values[field.name] = rows if given is None else self._pin_labels(given)
        nhwc = self.output == "uint8" or self.channels_last  # handed out as NCHW views
        return schema.assemble(
            [region[:count].permute(0, 3, 1, 2) if nhwc else region[:count] for region in regions], values
        )

    def _fill(
        self, indices: Sequence[int], key: AugmentKey | None, outs: Sequence[np.ndarray]
    ) -> tuple[int, list[int], list[int]]:
        """The fused path: read, crop boxes, then decode -> crop -> resize -> flip (-> normalize) into ``outs``.

        Every record of the batch is read in one LMDB transaction and decoded straight from the memory map; the crop
        boxes and flips are drawn for the whole batch at once (vectorized); each image then lands in its place in
        ``outs`` (the batch's memory in its stored shape: one array, or one per view of a
        :class:`~lightning_fastdata.pipeline.views.MultiViewCrop`, each view cropped from the one decode), the kept
        ones first. Returns how many were kept, their header labels (the class of a ``class`` database) and their
        records in the base split, in the kept order.
        """
        base, transform, crop_image = self.base, self.transform, self._crop
        assert isinstance(base, LmdbImageDataset)
        assert transform is not None
        assert crop_image is not None
        pairs = records_of(indices, self.indices)
        labels: list[int] = []
        records: list[int] = []
        with base.records() as read:  # payloads are views of the memory map until this block ends
            found = read_kept(pairs, lambda pair: (pair, *read(pair[1])), self.skip_counter)
            per_view = self._view_boxes(found, key)
            boxes = list(zip(*(view_boxes for view_boxes, _ in per_view), strict=True))  # per sample, one per view
            flips = list(zip(*(view_flips for _, view_flips in per_view), strict=True))
            views = len(per_view)
            # the colour of every view of every sample found, for the crops coloured here (one plan for the batch)
            plan = self._plan(key, [item[0][1] for item in found]) if self.colors_crops else None

            def crop_into(item: tuple[int, tuple[tuple[int, int], RecordHeader, memoryview], Any, Any]) -> None:
                position, ((_, record), header, payload), sample_boxes, sample_flips = item
                kept = len(labels)  # a sample that fails leaves out every view: the next one takes its place
                outs_of = [out[kept] for out in outs]
                color = None if plan is None else (plan, position * views)
                crop_image.into(record, header, payload, sample_boxes, sample_flips, outs_of, color)
                labels.append(header.label)
                records.append(record)

            read_kept(list(zip(range(len(found)), found, boxes, flips, strict=True)), crop_into, self.skip_counter)
        return len(labels), labels, records

    def _fill_slot(
        self, indices: Sequence[int], key: AugmentKey | None, slots: SlotMemory, slot: int
    ) -> tuple[int, Any]:
        """:meth:`_fill` slot ``slot`` of ``slots``: the samples in it, and the targets that are not in it.

        Every field of the slot's schema is filled by its producer (:data:`PRODUCERS`), so nothing but the count need
        leave a worker process; only a ``target_transform``'s targets that are not class indices are returned, else
        ``None``.
        """
        count, labels, records = self._fill(indices, key, slots.regions(slot, len(indices)))
        given = None
        for field in slots.layout.schema.fields:
            produced = PRODUCERS[field.name](self, key, labels, records, slots.field(slot, field.name, count))
            given = produced if produced is not None else given
        return count, given

    def _params(self, key: AugmentKey | None, records: Sequence[int]) -> np.ndarray:
        """The colour parameters of a fused batch's ``records``: ``[n, V, 7]`` for the ``V`` views, each its own."""
        assert self.color is not None
        assert self.fast is not None
        return self.color.draw(key, records, len(self.fast.crops) if self.fast.multiview else None)

    def _plan(self, key: AugmentKey | None, records: Sequence[int]) -> ImagePlan:
        """The colour of each view of ``records`` for crops coloured here: sample i's view v is row ``i V + v``.

        See :meth:`BatchColor.apply_image <lightning_fastdata.pipeline.color.BatchColor.apply_image>`.
        """
        assert self.color is not None
        return self.color.plan(self._params(key, records))

    def _view_boxes(self, found: list[tuple[Any, ...]], key: AugmentKey | None) -> list[tuple[list[Box], list[bool]]]:
        """Each view's crop boxes and flips of the records ``found``, as the fast path states them."""
        fast = self.fast
        assert fast is not None
        heights, widths = [item[1].height for item in found], [item[1].width for item in found]
        boxes = fast.boxes(heights, widths, key=key, samples=[item[0][0] for item in found])
        return boxes if fast.multiview else [boxes]

    # -- memory ----------------------------------------------------------------------------------------------------

    def _lmdb(self) -> LmdbImageDataset:
        """The database split the fused and encoded paths read (their reader is built only for one)."""
        assert isinstance(self.base, LmdbImageDataset)
        return self.base

    def _pin_labels(self, labels: Any) -> Any:
        """Labels in page-locked memory when batches are: their copy to the GPU is asynchronous too."""
        return labels.pin_memory() if self._pinned() and isinstance(labels, Tensor) else labels

    def _pinned(self) -> bool:
        """Whether this process builds batches in page-locked memory (not in a worker: those go as memfds)."""
        return self.pin_memory and get_worker_info() is None and torch.cuda.is_available()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.slots is not None and not self.slots.shared:
            state["slots"] = None  # private slots stay in their process (shared ones travel as their file descriptor)
        return state

    def __repr__(self) -> str:
        path = "fused" if self.fused else "per-sample"
        return f"{type(self).__name__}({self.dataset!r}, output={self.output!r}, {path})"


def _produce_target(
    reader: BatchReader, key: AugmentKey | None, labels: list[int], records: list[int], out: np.ndarray
) -> Any:
    """The ``target`` field: the record headers' classes, or the split's target arrays (:func:`fill_targets`)."""
    return fill_targets(reader._lmdb(), labels, records, out)


def _produce_index(
    reader: BatchReader, key: AugmentKey | None, labels: list[int], records: list[int], out: np.ndarray
) -> None:
    """The ``index`` field: the records read, each sample's index in the split (through a subset, the one it views)."""
    out[:] = records


def _produce_color(
    reader: BatchReader, key: AugmentKey | None, labels: list[int], records: list[int], out: np.ndarray
) -> None:
    """The ``color`` field: each sample's colour parameters, drawn from its key (for the device stage)."""
    out[:] = reader._params(key, records)


#: the producer of each field after the images on the fused path (the images are the crop kernel's, :meth:`_fill`),
#: by the field's name in the batch schema (:mod:`~lightning_fastdata.pipeline.schema`): called with the reader, the
#: batch's key, the kept samples' header labels and records, and the field's rows to fill. Only the target's may
#: return something: targets that do not fit the rows (a ``target_transform``'s), carried as they are.
PRODUCERS: dict[str, Callable[[BatchReader, AugmentKey | None, list[int], list[int], np.ndarray], Any]] = {
    "target": _produce_target,
    "index": _produce_index,
    "color": _produce_color,
}


class KeyedIndices(list):
    """A batch's sample indices with the key its augmentation is drawn from, ``(seed, epoch)``, and its slot.

    A list, so any dataset reads it as indices; it crosses to worker processes as one (pickled with its key and
    slot). ``slot``: the batch slot to build the batch in (:mod:`~lightning_fastdata.pipeline.slots`), or ``None``.
    """

    def __init__(self, indices: Sequence[int], key: AugmentKey, slot: int | None = None) -> None:
        super().__init__(indices)
        self.key = key
        self.slot = slot
