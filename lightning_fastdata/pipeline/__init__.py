"""The batch path, top-down: :func:`create_loader` builds it, :class:`FastLoader` runs it, one epoch at a time.

One module per stage: :mod:`~lightning_fastdata.pipeline.factory` (the loader factory and the loader),
:mod:`~lightning_fastdata.pipeline.threads` and :mod:`~lightning_fastdata.pipeline.processes` (the two engines),
:mod:`~lightning_fastdata.pipeline.kernel` (record to pixels; each image's crops in
:mod:`~lightning_fastdata.pipeline.crop`, a dataset of one's own in :mod:`~lightning_fastdata.pipeline.per_sample`, a
batch's targets and indices in :mod:`~lightning_fastdata.pipeline.targets`), :mod:`~lightning_fastdata.pipeline.device`
(the device stage; nvJPEG in :mod:`~lightning_fastdata.pipeline.device_decode`, the side streams in
:mod:`~lightning_fastdata.pipeline.streams`) and :mod:`~lightning_fastdata.pipeline.resume` (the saved position).

A training batch on CUDA, from database record to model input:

1. **Order.** A seeded :class:`~lightning_fastdata.pipeline.resume.ResumableSampler` (a ``DistributedSampler`` that
   can start part-way into an epoch) gives this rank's indices; they are cut into batches, each keyed with the
   epoch's ``(seed, epoch)`` (:class:`~lightning_fastdata.pipeline.factory._KeyedBatches`), so a sample's crop and
   flip are a function of ``(seed, epoch, sample)`` on every engine.
2. **Engine.** Each batch is built whole by one of ``workers`` threads in this process (``engine="threads"``,
   :mod:`~lightning_fastdata.pipeline.threads`: no worker start-up, no copy of the dataset per worker, no
   inter-process transfer, and the decode and resize kernels release the GIL), or by one of ``workers`` DataLoader
   worker processes (``"processes"``, :mod:`~lightning_fastdata.pipeline.processes`). The DataModule's
   ``engine="auto"`` picks processes for CUDA training with 4 or more workers, threads otherwise.
3. **Record to pixels** (:meth:`BatchReader.read_batch <lightning_fastdata.pipeline.kernel.BatchReader.read_batch>`,
   in :mod:`~lightning_fastdata.pipeline.kernel`): one LMDB transaction, decode, crop, resize and flip straight into
   one ``uint8`` batch buffer (page-locked for a GPU); bad samples left out under the skip policy. With ``views``
   (:mod:`~lightning_fastdata.pipeline.views`) each image is decoded once and every view cropped into its own region
   of the buffer: the batch's images are a list of views.
4. **Device.** The host batch is copied ``non_blocking`` one step ahead on a side CUDA stream
   (:func:`~lightning_fastdata.pipeline.device.prefetch_to_device`), and :class:`DeviceStage` turns it into model
   input there: ``uint8`` -> normalized float of the model's dtype, ``channels_last`` if asked; with
   ``decode="device"`` it decodes the still-encoded JPEGs first (nvJPEG).
5. **Position.** Batches are counted as they are handed to the training loop, after the look-ahead, so a checkpoint
   resumes after the last one the loop saw (:mod:`~lightning_fastdata.pipeline.resume`).

Without the look-ahead (training on a CPU, or ``prefetch_to_device=False``) step 4 is Lightning's copy, and the
DataModule's ``on_after_batch_transfer`` runs the same :class:`DeviceStage`. For CPU training the loader threads
normalize to ``float32`` in step 3 already, so the device stage only casts to the model's dtype where it differs.

DataLoader worker processes import :mod:`~lightning_fastdata.pipeline.kernel`, and so this package, to unpickle the
batch reader: nothing imported here may import Lightning or torchvision at module level (seconds per worker), which
is why Lightning is imported inside the functions that need it.
"""

from lightning_fastdata.pipeline.device import DeviceStage
from lightning_fastdata.pipeline.factory import FastLoader, create_loader
from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices

__all__ = ["BatchReader", "DeviceStage", "FastLoader", "KeyedIndices", "create_loader"]
