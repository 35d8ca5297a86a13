"""Tests for ``lightning_fastdata.pipeline``: one factory builds every loader; the device stage is one object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import fake_trainer, patch_cuda_streams
from torch.utils.data import DistributedSampler, RandomSampler, TensorDataset

from lightning_fastdata import FastImageDataModule, LmdbImageDataset
from lightning_fastdata.pipeline import DeviceStage, FastLoader, create_loader
from lightning_fastdata.pipeline.kernel import BatchReader
from lightning_fastdata.pipeline.processes import _worker_init
from lightning_fastdata.pipeline.resume import ResumableSampler
from lightning_fastdata.transforms import Normalizer, RandomResizedCropFlip

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture
def dataset(database: Path) -> LmdbImageDataset:
    return LmdbImageDataset(database, transform=RandomResizedCropFlip(16))


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_create_loader_sets_up_each_engine(dataset: LmdbImageDataset, engine: Any) -> None:
    """Threads get ``threads`` and in-flight batches; processes get workers kept alive, one intra-op thread each."""
    loader = create_loader(dataset, 4, engine=engine, workers=2, prefetch_factor=3, output="uint8", pin_memory=True)
    assert isinstance(loader, FastLoader)
    assert isinstance(loader.dataset, BatchReader)
    assert loader.dataset.fused
    assert (loader.engine, loader.workers, loader.batch_size) == (engine, 2, 4)
    assert loader.page_locked  # the batch slots, page-locked once (no pin-memory thread: `pin_memory` is off)
    assert not loader.pin_memory
    if engine == "threads":
        assert (loader.num_workers, loader.threads, loader.prefetch_batches) == (0, 2, 6)
        assert loader.dataset.pin_memory  # the threads build batches in page-locked memory
    else:
        assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
        assert loader.worker_init_fn is _worker_init
        assert not loader.dataset.pin_memory  # worker processes hand batches over in shared memory


def test_create_loader_sampler_and_position(dataset: LmdbImageDataset) -> None:
    """A seeded DistributedSampler for the rank, resumable for training; a sampler of one's own is kept."""
    train = create_loader(dataset, 4, shuffle=True, seed=7, num_replicas=2, rank=1, resumable=True, drop_last=True)
    sampler = train.sampler
    assert isinstance(sampler, ResumableSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.seed, sampler.shuffle) == (2, 1, 7, True)
    assert train.resumable
    assert set(train.state_dict()) == {"epoch", "batches", "batch_size", "num_samples", "seed", "shuffle"}
    evaluation = create_loader(dataset, 4)
    assert type(evaluation.sampler) is DistributedSampler
    assert not evaluation.resumable
    assert evaluation.state_dict() == {}
    own = RandomSampler(dataset)
    assert create_loader(dataset, 4, sampler=own).sampler is own


def test_create_loader_reads_a_dataset_as_it_comes_without_an_output() -> None:
    """``output=None`` (or a dataset that already is a BatchReader) is not wrapped again."""
    tensors = TensorDataset(torch.arange(10))
    loader = create_loader(tensors, 4, output=None, engine="processes")
    assert loader.dataset is tensors
    assert loader.engine == "main"
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_create_loader_checks_its_arguments(dataset: LmdbImageDataset) -> None:
    """An unknown engine or a negative worker count is refused, naming the argument."""
    with pytest.raises(ValueError, match="`engine`"):
        create_loader(dataset, 4, engine="fibers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`workers`"):
        create_loader(dataset, 4, workers=-1)


def test_device_stage_turns_images_into_model_input() -> None:
    """uint8 -> normalized dtype (channels_last if asked); floats only take the dtype; anything else passes."""
    normalizer = Normalizer(MEAN, STD)
    stage = DeviceStage(normalizer, dtype=torch.float64, channels_last=True)
    images, labels = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8), torch.arange(2)
    out, out_labels = stage((images, labels))
    assert out.dtype == torch.float64
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.float(), normalizer.batch(images), rtol=0, atol=1e-5)
    assert out_labels is labels
    as_list = stage([images.float(), labels])
    assert isinstance(as_list, list)
    assert as_list[0].dtype == torch.float64
    ready = (out, labels)
    assert stage(ready) is ready
    assert stage({"x": images})["x"] is images


def test_device_stage_treats_each_view_as_a_single_view_batch() -> None:
    """A list (or tuple) of views of their own sizes: each one normalized as a single view would be, in the same
    container; float views only take the dtype; views already model input pass, the batch untouched."""
    normalizer = Normalizer(MEAN, STD)
    stage = DeviceStage(normalizer, dtype=torch.float64, channels_last=True)
    large = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    small = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    labels, index = torch.arange(2), torch.tensor([5, 3])
    views, out_labels, out_index = stage(([large, small], labels, index))
    assert isinstance(views, list)
    assert [tuple(view.shape) for view in views] == [(2, 3, 8, 8), (2, 3, 4, 4)]
    for view, single in zip(views, [large, small], strict=True):
        assert view.dtype == torch.float64
        assert view.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(view, stage((single, labels))[0])  # exactly the single-view treatment
    assert out_labels is labels
    assert out_index is index
    as_tuple = stage([(large.float(), small), labels])
    assert isinstance(as_tuple, list)
    assert isinstance(as_tuple[0], tuple)
    assert [view.dtype for view in as_tuple[0]] == [torch.float64, torch.float64]
    ready = (views, labels)
    assert stage(ready) is ready
    not_images = (["a", "b"], labels)
    assert stage(not_images) is not_images


def test_device_stage_needs_a_device_and_size_to_decode() -> None:
    """Still-encoded images without ``device`` and ``image_size`` raise, naming them."""
    from lightning_fastdata.pipeline.device_decode import EncodedImages

    encoded = EncodedImages([torch.zeros(4, dtype=torch.uint8)], torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1))
    with pytest.raises(ValueError, match="image_size"):
        DeviceStage(Normalizer(MEAN, STD))((encoded, torch.arange(1)))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA streams patched so the device look-ahead runs on the CPU (copies are the identity)."""
    patch_cuda_streams(monkeypatch)


@pytest.mark.usefixtures("fake_cuda")
def test_the_device_stage_runs_once_in_the_loader_or_in_the_hook(database: Path) -> None:
    """Looking ahead on CUDA, the loader runs the stage and the hook hands the batch on untouched; else the hook."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0, pin_memory=False)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    uint8 = BatchReader(LmdbImageDataset(database, transform=RandomResizedCropFlip(16))).read_batch(range(4))
    images, _ = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.float32  # normalized by the loader's device stage
    assert dm.on_after_batch_transfer(uint8, 0) is uint8  # nothing left for the hook
    dm.prefetch_to_device = False
    assert next(iter(dm.train_dataloader()))[0].dtype == torch.uint8
    built = []
    make_stage = dm._device_stage
    dm._device_stage = lambda: built.append(1) or make_stage()
    out, _ = dm.on_after_batch_transfer(uint8, 0)
    dm.on_after_batch_transfer(uint8, 0)
    assert built == []  # the stage built with the loader, not one per batch
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, dm.to_model_input(uint8)[0])
