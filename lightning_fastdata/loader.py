"""The batch path in one place: a sample's whole trip from its database record to a batch on the device.

:class:`FastLoader` is what :class:`~lightning_fastdata.FastImageDataModule` hands to Lightning. Read top-down:

1. **Order.** The sampler (a seeded ``DistributedSampler`` that can start part-way into an epoch, for exact resume)
   gives this rank's indices; they are cut into batches.
2. **Engine.** Each batch is built whole by one of ``threads`` threads in this process (the default), or by one of
   ``num_workers`` DataLoader worker processes. Threads share the process's memory: no worker start-up, no copy of
   the dataset per worker, no inter-process transfer of batches, and the decode and resize kernels below release the
   GIL, so they run in parallel.
3. **Record to pixels** (:meth:`BatchReader.read_batch`). The batch's records are read in one LMDB transaction (the
   environment opened lazily in the process that reads, checksums verified) and decoded straight from the memory map
   (libjpeg-turbo through ``simplejpeg``); the batch's crop boxes and flips are drawn at once, from a seed the
   consuming thread draws in batch order; each image is then cropped, resized (antialiased when shrinking) and
   flipped *straight into its slot* of one preallocated ``uint8`` NHWC batch buffer (OpenCV). For CPU training each
   sample is also normalized to ``float32`` in the same thread. A user's own transform (or dataset) takes the
   per-sample path instead: ``dataset[i]``, then stacking.
4. **Bad samples.** Under ``on_bad_sample="skip"`` a sample that fails with one of this package's errors is left
   out of its batch and counted; otherwise the error propagates with the split and index.
5. **Device.** On CUDA the host batch (page-locked) is copied ``non_blocking`` on a side stream one batch ahead and
   normalized there (:func:`~lightning_fastdata.prefetch.prefetch_to_device`); with ``decode="device"`` the batch
   holds JPEG bytes and crop boxes, decoded by nvJPEG on the device.
6. **Position.** Batches are counted as they are handed out, so a checkpoint resumes after the last one
   (:class:`~lightning_fastdata.resumable.ResumableLoader`).
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate, get_worker_info

from lightning_fastdata._format import RecordHeader
from lightning_fastdata.dataset import LmdbImageDataset
from lightning_fastdata.device_decode import EncodedCropDataset, collate_encoded
from lightning_fastdata.errors import FastDataError, SampleError
from lightning_fastdata.resumable import ResumableLoader
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import Box, Normalizer, crop_resize_into, is_crop_transform

Output = Literal["uint8", "float", "encoded"]


def _split_view(dataset: Dataset) -> tuple[Dataset, np.ndarray | None]:
    """``(base, indices)`` of a fixed subset (``torch.utils.data.Subset`` or the DataModule's held-out view)."""
    inner, indices = getattr(dataset, "dataset", None), getattr(dataset, "indices", None)
    if isinstance(inner, LmdbImageDataset) and indices is not None:
        return inner, np.asarray(indices, dtype=np.int64)
    return dataset, None


class _BufferPool:
    """Batch buffers reused once nothing refers to them any more: no page faults and no zeroing per batch.

    A fresh 38 MB float32 batch costs thousands of page faults and a kernel memset on first touch, about as much as
    normalizing it. A buffer handed out as a tensor (``torch.from_numpy``) is referenced by that tensor's storage,
    and by every view of it, until the consumer drops the last one; then its reference count falls back to the pool's
    own and it is reused. Buffers being filled are reserved, so two threads never share one.
    """

    #: references to a free buffer seen by ``sys.getrefcount`` in :meth:`take`: the list, the loop variable, the call
    _FREE_REFS = 3

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._buffers: list[np.ndarray] = []
        self._reserved: set[int] = set()
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A free buffer of ``shape`` and ``dtype`` (a new one when none is free), reserved until :meth:`release`."""
        with self._lock:
            for buffer in self._buffers:
                if (
                    buffer.shape == shape
                    and buffer.dtype == dtype
                    and id(buffer) not in self._reserved
                    and sys.getrefcount(buffer) == self._FREE_REFS
                ):
                    self._reserved.add(id(buffer))
                    return buffer
            buffer = np.empty(shape, dtype=dtype)
            if len(self._buffers) < self.limit:  # a consumer that keeps every batch gets fresh ones past the limit
                self._buffers.append(buffer)
                self._reserved.add(id(buffer))
            return buffer

    def release(self, buffer: np.ndarray) -> None:
        """The buffer is now referenced by the batch handed out; it is free again once that batch is dropped."""
        with self._lock:
            self._reserved.discard(id(buffer))


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

    """

    def __init__(
        self,
        dataset: Dataset,
        output: Output = "uint8",
        normalizer: Normalizer | None = None,
        channels_last: bool = False,
        skip_counter: SkipCounter | None = None,
        pin_memory: bool = False,
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
        self.base, self.indices = _split_view(dataset)
        transform = getattr(self.base, "transform", None)
        self.fused = (
            isinstance(self.base, LmdbImageDataset)
            and self.base.output == "tensor"
            and is_crop_transform(transform)
            # a subclass that reads or decodes its own way keeps its way (the per-sample path calls it)
            and type(self.base).__getitem__ is LmdbImageDataset.__getitem__
            and type(self.base).decode is LmdbImageDataset.decode
        )
        self.transform = transform if self.fused else None
        self._scratch = threading.local()
        self._pool = _BufferPool()
        self._encoded: EncodedCropDataset | None = None
        if output == "encoded":
            if not isinstance(self.base, LmdbImageDataset) or not callable(getattr(transform, "box", None)):
                raise TypeError(
                    "`decode='device'` needs `build_dataset` to return an LmdbImageDataset and the transforms to be"
                    f" RandomResizedCropFlip / CenterCropResize (objects with a `box(height, width)` method); got"
                    f" {type(self.base).__name__} and {type(transform).__name__}. Use `decode='cpu'` for custom"
                    " pipelines."
                )
            self._encoded = EncodedCropDataset(self.base, transform.box, getattr(transform, "flip_p", 0.0))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        """One sample, as the wrapped dataset gives it."""
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """A whole batch (what a DataLoader worker process calls)."""
        return self.read_batch(indices)

    def read_batch(self, indices: Sequence[int], seed: int | None = None) -> Any:
        """The batch of samples ``indices``: ``(images, labels)``, bad samples left out under the skip policy.

        ``seed`` seeds the batch's crop boxes and flips on the fused path (default: drawn from :mod:`random`); the
        threaded engine draws it in the consuming thread, in batch order, so a seeded run crops the same way
        whichever thread builds which batch.

        Raises:
            FastDataError: a sample failed (naming its split and index), without the skip policy.
            SampleError: every sample of the batch failed, under the skip policy.

        """
        if self.output == "encoded":
            samples = self._each(indices, self._encoded_sample)
            return collate_encoded(samples)
        if not self.fused:
            return default_collate(self._each(indices, self.dataset.__getitem__))
        return self._read_fused(indices, seed)

    # -- the fused path --------------------------------------------------------------------------------------------

    def _read_fused(self, indices: Sequence[int], seed: int | None) -> tuple[Tensor, Any]:
        """The fused path: read, crop boxes, then decode -> crop -> resize -> flip (-> normalize) into the batch.

        Every record of the batch is read in one LMDB transaction and decoded straight from the memory map; the crop
        boxes and flips are drawn for the whole batch at once (vectorized); each image then lands in its slot.
        """
        base, transform = self.base, self.transform
        assert isinstance(base, LmdbImageDataset)
        assert transform is not None
        records = self.indices[np.asarray(indices)].tolist() if self.indices is not None else [int(i) for i in indices]
        images = self._new_batch(len(records))
        slots = images.numpy() if images.dtype == torch.uint8 or self.channels_last else None
        labels: list[Any] = []
        with base.records() as read:  # payloads are views of the memory map until this block ends
            found = self._each(records, lambda record: (record, *read(record)))
            boxes, flips = transform.boxes([f[1].height for f in found], [f[1].width for f in found], seed)

            def crop_into(item: tuple[tuple[int, RecordHeader, memoryview], Box, bool]) -> None:
                (record, header, payload), box, flip = item
                self._crop_into(record, header, payload, box, flip, self._slot(images, slots, len(labels)))
                labels.append(header.label)

            self._each(list(zip(found, boxes, flips, strict=True)), crop_into)
        if base.target_transform is not None:
            labels = [base.target_transform(label) for label in labels]
        images = images[: len(labels)]
        labels_tensor = self._labels(labels)
        if self._pinned() and isinstance(labels_tensor, Tensor):  # so its copy to the GPU is asynchronous too
            labels_tensor = labels_tensor.pin_memory()
        return self._as_nchw(images), labels_tensor

    def _crop_into(
        self, record: int, header: RecordHeader, payload: memoryview, box: Box, flip: bool, out: np.ndarray
    ) -> None:
        """Decode one record, crop, resize and flip it (and normalize it) into ``out``."""
        base, transform = self.base, self.transform
        assert isinstance(base, LmdbImageDataset)
        assert transform is not None
        nbytes = header.height * header.width * 3
        image = base.decode_hwc(record, header, payload, self._buffer("decode", nbytes), fast=True)
        scratch = self._buffer("prefilter", nbytes)
        try:
            if self.output == "float":  # the uint8 crop in a scratch buffer, then normalized into the batch
                assert self.normalizer is not None
                size = transform.size
                crop = self._buffer("resized", size * size * 3)[: size * size * 3].reshape(size, size, 3)
                self.normalizer.into(crop_resize_into(image, box, size, flip, crop, scratch), out)
            else:
                crop_resize_into(image, box, transform.size, flip, out, scratch)
        except Exception as err:  # cv2.error and friends: name the sample
            raise SampleError(f"{base._where(record)}: cropping {box} failed: {err}") from err

    # -- one sample ------------------------------------------------------------------------------------------------

    def _encoded_sample(self, index: int) -> Any:
        assert self._encoded is not None
        return self._encoded.read(int(self.indices[index]) if self.indices is not None else index)

    def _each(self, items: Sequence[Any], read: Callable[[Any], Any]) -> list[Any]:
        """``read`` every item; under the skip policy a package error leaves that sample out."""
        results = []
        for item in items:
            try:
                results.append(read(item))
            except FastDataError as err:
                if self.skip_counter is None:
                    raise
                self.skip_counter.skip(err)
        if not results:
            raise SampleError(
                f"all {len(items)} samples of a batch failed and were skipped; the data is likely unreadable"
                " (see the warnings above). Check the database with `LmdbImageDataset` directly."
            )
        return results

    # -- buffers ---------------------------------------------------------------------------------------------------

    def _new_batch(self, n: int) -> Tensor:
        """The batch buffer: NHWC uint8 (or NCHW / NHWC float32), in shared memory inside a worker process."""
        assert self.transform is not None
        size = self.transform.size
        if self.output == "uint8" or self.channels_last:
            shape: tuple[int, ...] = (n, size, size, 3)
        else:
            shape = (n, 3, size, size)
        dtype = torch.uint8 if self.output == "uint8" else torch.float32
        if get_worker_info() is not None:  # a worker process: the batch goes back through shared memory, uncopied
            nbytes = int(np.prod(shape)) * (1 if dtype == torch.uint8 else 4)
            storage = torch.UntypedStorage._new_shared(nbytes)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        if self._pinned():  # torch's caching host allocator reuses pinned blocks safely
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        buffer = self._pool.take(shape, np.uint8 if dtype == torch.uint8 else np.float32)
        try:
            return torch.from_numpy(buffer)  # the tensor's storage holds the buffer until the batch is dropped
        finally:
            self._pool.release(buffer)

    def _pinned(self) -> bool:
        """Whether this process builds batches in page-locked memory (not in a worker: those go through shm)."""
        return self.pin_memory and get_worker_info() is None and torch.cuda.is_available()

    @staticmethod
    def _slot(images: Tensor, slots: np.ndarray | None, i: int) -> np.ndarray:
        return slots[i] if slots is not None else images[i].numpy()

    def _as_nchw(self, images: Tensor) -> Tensor:
        nhwc = self.output == "uint8" or self.channels_last
        return images.permute(0, 3, 1, 2) if nhwc else images

    @staticmethod
    def _labels(labels: list[Any]) -> Any:
        if all(type(label) is int for label in labels):
            return torch.tensor(labels, dtype=torch.int64)
        return default_collate(labels)

    def _buffer(self, name: str, nbytes: int) -> np.ndarray:
        """This thread's reusable flat buffer ``name`` (decoded image, prefiltered crop): no page faults per image."""
        buffer = getattr(self._scratch, name, None)
        if buffer is None or buffer.size < nbytes:
            buffer = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            setattr(self._scratch, name, buffer)
        return buffer

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_scratch"] = state["_pool"] = None  # scratch and buffers stay in their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scratch = threading.local()
        self._pool = _BufferPool()

    def __repr__(self) -> str:
        path = "fused" if self.fused else "per-sample"
        return f"{type(self).__name__}({self.dataset!r}, output={self.output!r}, {path})"


def _threaded_batches(
    batch_indices: Iterator[Sequence[int]],
    read_batch: Callable[[Sequence[int], int], Any],
    threads: int,
    ahead: int,
) -> Iterator[Any]:
    """Build batches on ``threads`` threads, each batch whole on one thread, ``ahead`` batches in flight, in order.

    Each batch's random seed is drawn here, in the consuming thread, in batch order: reproducible under a seed.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix="lightning_fastdata")

    def submit(indices: Sequence[int]) -> Future:
        return pool.submit(read_batch, indices, random.getrandbits(64))

    pending: deque[Future] = deque(submit(b) for b in itertools.islice(batch_indices, ahead))
    try:
        while pending:
            batch = pending.popleft().result()
            following = next(batch_indices, None)
            if following is not None:
                pending.append(submit(following))
            yield batch
    finally:  # the epoch ended, or the consumer stopped early: stop the queued batches, let running ones finish
        pool.shutdown(wait=False, cancel_futures=True)


class FastLoader(ResumableLoader):
    """The training and evaluation loader of :class:`~lightning_fastdata.FastImageDataModule` (see module docs).

    A :class:`~torch.utils.data.DataLoader`, so Lightning treats it as any loader: it reaches the sampler for
    ``set_epoch``, uses ``len()`` for limits and progress, and saves the loader state for exact resume.

    Args:
        dataset: a :class:`BatchReader`.
        *args: the arguments of :class:`~lightning_fastdata.resumable.ResumableLoader`.
        threads: with ``num_workers=0``, build batches on this many threads in this process (``0``: on the calling
            thread, as a plain DataLoader does).
        prefetch_batches: batches in flight on the threads (default: two per thread).
        **kwargs: the keyword arguments of :class:`~lightning_fastdata.resumable.ResumableLoader`.

    """

    def __init__(
        self,
        dataset: Dataset,
        *args: Any,
        threads: int = 0,
        prefetch_batches: int | None = None,
        **kwargs: Any,
    ) -> None:
        if threads < 0:
            raise ValueError(f"`threads` must be >= 0, got {threads}.")
        kwargs.setdefault("collate_fn", _batch_as_is if isinstance(dataset, BatchReader) else None)
        super().__init__(dataset, *args, **kwargs)
        self.threads = threads
        self.prefetch_batches = prefetch_batches

    @property
    def engine(self) -> str:
        """Where batches are built: ``"threads"``, ``"processes"`` or ``"main"`` (the calling thread)."""
        if self.num_workers > 0:
            return "processes"
        return "threads" if self.threads > 0 and isinstance(self.dataset, BatchReader) else "main"

    @property
    def workers(self) -> int:
        """Threads or worker processes building batches (``0``: the calling thread builds them)."""
        return self.num_workers if self.num_workers > 0 else (self.threads if self.engine == "threads" else 0)

    def _get_iterator(self) -> Any:
        if self.engine != "threads":
            return super()._get_iterator()
        assert isinstance(self.dataset, BatchReader)
        assert self.batch_sampler is not None
        ahead = self.prefetch_batches or 2 * self.threads
        return _threaded_batches(iter(self.batch_sampler), self.dataset.read_batch, self.threads, ahead)
