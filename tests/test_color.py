"""Tests for ``lightning_fastdata.pipeline.color``: batch colour ops against torchvision, keyed per-sample draws."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fakes import fake_trainer, patch_cuda_streams, refusing_host_reads
from lightning.pytorch import LightningModule, Trainer
from torch.nn import functional as F
from torchvision.transforms.v2 import functional as TF

from lightning_fastdata import FastImageDataModule
from lightning_fastdata.errors import InvalidArgumentError
from lightning_fastdata.pipeline import BatchReader, DeviceStage, KeyedIndices, create_loader
from lightning_fastdata.pipeline import device as device_module
from lightning_fastdata.pipeline.color import COLUMNS, BatchColor
from lightning_fastdata.pipeline.schema import Batch, with_beside
from lightning_fastdata.store.reader import LmdbImageDataset
from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD, Normalizer, RandomResizedCropFlip

RECIPE = {"jitter": (0.4, 0.4, 0.2, 0.1), "grayscale_p": 0.2, "blur_p": 0.5, "solarize_p": 0.2}
B = 8


@pytest.fixture(scope="module")
def database(make_database: Callable[..., Path]) -> Path:
    """2 classes x 12 train images of 40-80 px."""
    return make_database("color", short_side=64, num_classes=2, train_per_class=12, val_per_class=2, min_size=40)


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, 3, 24, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _params(**columns: Any) -> torch.Tensor:
    params = torch.zeros(B, len(COLUMNS))
    params[:, :3] = 1.0
    for name, values in columns.items():
        params[:, COLUMNS.index(name)] = torch.as_tensor(values, dtype=torch.float32)
    return params


_FACTORS = torch.linspace(0.3, 1.7, B)
_EVERY_OTHER = (torch.arange(B) % 2).float()


def _cpu(stage: BatchColor, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The CPU path (image by image, OpenCV, uint8), as floats."""
    out = stage.apply_images(images, params)
    assert out.dtype == torch.uint8
    return out.float()


def _batched(stage: BatchColor, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The device path (batched torch ops, float32 0-255), run on the CPU."""
    out = stage.apply_batch(images, params)
    assert out.dtype == torch.float32
    return out


PATHS = [pytest.param(_cpu, id="cpu"), pytest.param(_batched, id="batched")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("column", "stage", "reference", "values"),
    [
        ("brightness", BatchColor((0.7, 0, 0, 0), 1.0), TF.adjust_brightness, _FACTORS),
        ("contrast", BatchColor((0, 0.7, 0, 0), 1.0), TF.adjust_contrast, _FACTORS),
        ("saturation", BatchColor((0, 0, 0.7, 0), 1.0), TF.adjust_saturation, _FACTORS),
        ("grayscale", BatchColor(grayscale_p=1.0), lambda x, on: TF.rgb_to_grayscale(x, 3) if on else x, None),
        ("solarize", BatchColor(solarize_p=1.0), lambda x, on: TF.solarize(x, 128) if on else x, None),
    ],
)
def test_each_op_matches_torchvision_per_sample(
    path: Callable[..., torch.Tensor],
    column: str,
    stage: BatchColor,
    reference: Callable[..., torch.Tensor],
    values: Any,
) -> None:
    """Every sample gets torchvision's op with its own parameter, on both paths: within 2 grey levels (torchvision
    truncates its uint8 results, twice in saturation: its grey image is uint8; ours round)."""
    images = _images()
    values = _EVERY_OTHER if values is None else values
    out = path(stage, images, _params(**{column: values}))
    want = torch.stack([reference(images[i], values[i].item()) for i in range(B)])
    assert (out - want.float()).abs().max() <= 2.0


def _rgb_hue(images: torch.Tensor) -> torch.Tensor:
    """Each pixel's HSV hue, in turns (torchvision's formula)."""
    r, g, b = (images.float() / 255).unbind(dim=-3)
    maxc, minc = torch.maximum(torch.maximum(r, g), b), torch.minimum(torch.minimum(r, g), b)
    chroma = (maxc - minc).clamp_min(1e-6)
    hue = torch.where(maxc == r, (g - b) / chroma, torch.where(maxc == g, 2 + (b - r) / chroma, 4 + (r - g) / chroma))
    return torch.remainder(hue / 6, 1.0)


@pytest.mark.parametrize("path", PATHS)
def test_hue_turns_colours_about_the_grey_axis(path: Callable[..., torch.Tensor]) -> None:
    """A hue shift keeps each pixel's grey, turns saturated colours by about the shift in HSV's direction, and is
    undone by the opposite shift; no shift leaves the pixels as they are."""
    stage = BatchColor((0, 0, 0, 0.5), 1.0)
    # mid-range colours, so no channel clips: 8 samples of 6 x 6 pixels in [64, 192]
    images = torch.randint(64, 193, (B, 3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    shifts = torch.tensor([0.0, 0.02, -0.02, 0.05, -0.05, 0.03, -0.03, 0.0])
    out = path(stage, images, _params(hue=shifts))
    grey = torch.tensor((0.2989, 0.587, 0.114)).view(1, 3, 1, 1)
    assert ((out * grey).sum(dim=1) - (images.float() * grey).sum(dim=1)).abs().max() <= 1.0
    assert torch.equal(out[0], images[0].float())
    turned = torch.remainder(_rgb_hue(out.clamp(0, 255)) - _rgb_hue(images.float()) + 0.5, 1.0) - 0.5
    saturated = (images.float().amax(dim=1) - images.float().amin(dim=1)) > 60
    for i in range(1, B - 1):  # the median turn of the saturated pixels: the shift's sign, about its size
        median = turned[i][saturated[i]].median().item()
        assert median * shifts[i].item() > 0
        assert 0.5 * abs(shifts[i].item()) <= abs(median) <= 2 * abs(shifts[i].item())
    back = path(stage, out.round().clamp(0, 255).to(torch.uint8), _params(hue=-shifts))
    assert (back - images.float()).abs().max() <= 3.0


@pytest.mark.parametrize("path", PATHS)
def test_blur_matches_torchvision_gaussian_blur_per_sample(path: Callable[..., torch.Tensor]) -> None:
    """Each sample is blurred as ``gaussian_blur`` with its sigma and a kernel of 2 ceil(3 sigma) + 1; 0: untouched."""
    images, stage = _images(), BatchColor(blur_p=1.0)
    sigmas = torch.linspace(0.1, 2.0, B) * _EVERY_OTHER
    out = path(stage, images, _params(sigma=sigmas))
    for i in range(B):
        size = [2 * math.ceil(3 * sigmas[i].item()) + 1] * 2
        want = TF.gaussian_blur(images[i], size, [sigmas[i].item()] * 2) if sigmas[i] > 0 else images[i]
        assert (out[i] - want.float()).abs().max() <= 1
    assert torch.equal(out[0], images[0].float())  # no blur drawn: the very pixels


def test_the_cpu_and_batched_paths_agree_on_the_whole_recipe() -> None:
    """The CPU path (uint8, OpenCV) and the device path (float32 torch) give the same colours within 2 grey levels."""
    color = BatchColor(**RECIPE)
    images = torch.cat([_images(0), _images(1)])
    params = torch.from_numpy(color.draw((0, 0), list(range(2 * B))))
    cpu, batched = color.apply_images(images, params), color.apply_batch(images, params)
    assert (cpu.float() - batched).abs().max() <= 2.0
    assert torch.equal(color(images, params), cpu)  # on a CPU, the stage is the CPU path
    assert not torch.equal(cpu, images)


def test_the_cpu_path_leaves_the_callers_batch_alone() -> None:
    """Colouring a batch on the CPU writes new memory, never the batch it was given (a loader's slot)."""
    color, images = BatchColor(**RECIPE), _images()
    before = images.clone()
    color(images, torch.from_numpy(color.draw((0, 0), list(range(B)))))
    assert torch.equal(images, before)


def test_parameters_are_drawn_per_sample_from_their_key() -> None:
    """Rows differ within a batch; a sample's row depends only on (seed, epoch, sample), not on its batch."""
    color = BatchColor(**RECIPE)
    params = color.draw((3, 1), list(range(64)))
    assert params.shape == (64, len(COLUMNS))
    assert params.dtype == np.float32
    jittered = params[:, 0] != 1.0
    assert 0 < jittered.sum() < 64  # about 80%: drawn per sample, not per batch
    assert len(np.unique(params[jittered, 0])) == jittered.sum()  # each sample its own brightness
    assert 0 < params[:, 4].sum() < 64
    assert 0 < (params[:, 5] > 0).sum() < 64
    assert 0 < params[:, 6].sum() < 64
    assert (params[:, 5][params[:, 5] > 0] >= 0.1).all()
    assert (params[:, 3] <= 0.1).all()
    np.testing.assert_array_equal(color.draw((3, 1), [40, 7, 2]), params[[40, 7, 2]])
    assert not np.array_equal(color.draw((3, 2), [7]), params[[7]])  # another epoch, other draws


def test_stage_output_of_a_sample_is_the_same_in_any_batch() -> None:
    """A sample's coloured pixels are bit for bit the same whatever else its batch holds."""
    color, images = BatchColor(**RECIPE), torch.cat([_images(0), _images(1)])
    params = torch.from_numpy(color.draw((0, 0), list(range(2 * B))))
    whole = color(images, params)
    order = [11, 3, 0, 14, 5]
    np.testing.assert_array_equal(color(images[order], params[order]).numpy(), whole[order].numpy())


def test_invalid_arguments_name_themselves() -> None:
    """Out-of-range arguments fail naming the argument; nothing on is no stage."""
    with pytest.raises(InvalidArgumentError, match="`grayscale_p`"):
        BatchColor(grayscale_p=1.5)
    with pytest.raises(InvalidArgumentError, match="`color_jitter`"):
        BatchColor((0.4, 0.4, 0.2))
    with pytest.raises(InvalidArgumentError, match="`blur_sigma`"):
        BatchColor(blur_sigma=(0.0, 2.0))
    assert BatchColor.create() is None
    assert BatchColor.create((0.4, 0.4, 0.2, 0.1)) is not None


def test_device_stage_colours_then_normalizes_and_takes_the_parameters_off() -> None:
    """The stage takes the parameters beside the batch and normalizes the coloured images into a plain tuple; a batch
    without them is only normalized."""
    normalizer, color = Normalizer(IMAGENET_MEAN, IMAGENET_STD), BatchColor(**RECIPE)
    images, labels = _images(), torch.arange(B)
    params = torch.from_numpy(color.draw((0, 0), list(range(B))))
    out = DeviceStage(normalizer, color=color)(Batch((images, labels), {"color": params}))
    assert type(out) is tuple
    assert len(out) == 2
    assert torch.equal(out[1], labels)
    torch.testing.assert_close(out[0], normalizer.batch(color(images, params)))
    given = DeviceStage(normalizer, color=color)((images, labels), {"color": params})  # taken off before a transfer
    torch.testing.assert_close(given[0], out[0], rtol=0, atol=0)
    plain = DeviceStage(normalizer, color=color)((images, labels))
    torch.testing.assert_close(plain[0], normalizer.batch(images))
    assert not torch.equal(out[0], plain[0])


# ----------------------------------------------------------------------------------------------------------------
# Through the loaders
# ----------------------------------------------------------------------------------------------------------------


def _reader(database: Path, **kwargs: Any) -> BatchReader:
    dataset = LmdbImageDataset(database, split="train", transform=RandomResizedCropFlip(16), fast_decode=True)
    return BatchReader(dataset, color=BatchColor(**RECIPE), **kwargs)


_FLOAT = {"output": "float", "normalizer": Normalizer(IMAGENET_MEAN, IMAGENET_STD)}


def _epoch(database: Path, engine: str, workers: int, **kwargs: Any) -> list[Any]:
    loader = create_loader(
        _reader(database, **kwargs), 4, shuffle=True, seed=5, engine=engine, workers=workers, **kwargs
    )
    return [with_beside(tuple(t.clone() for t in batch), getattr(batch, "beside", {})) for batch in loader]


def test_batches_carry_keyed_parameters_on_every_engine(database: Path) -> None:
    """Threads and worker processes give the same uint8 batches and parameters, bit for bit, the parameters beside
    the batch."""
    threads, processes = _epoch(database, "threads", 2), _epoch(database, "processes", 1)
    assert len(threads) == len(processes) == 6
    for a, b in zip(threads, processes, strict=True):
        assert len(a) == len(b) == 2  # images, targets: the parameters are not in the training step's batch
        assert a.beside["color"].shape == (4, len(COLUMNS))
        assert torch.equal(a.beside["color"], b.beside["color"])
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    stage = DeviceStage(Normalizer(IMAGENET_MEAN, IMAGENET_STD), color=BatchColor(**RECIPE))
    assert torch.equal(stage(threads[0])[0], stage(processes[0])[0])


def test_cpu_batches_are_coloured_in_the_loader_the_same_on_every_engine(database: Path) -> None:
    """For CPU training (float output) the loader colours each crop before normalizing it: no parameters reach the
    training process, threads and worker processes agree bit for bit, and the batch is the device stage's colouring
    of the uint8 batch with its parameters."""
    threads, processes = _epoch(database, "threads", 2, **_FLOAT), _epoch(database, "processes", 1, **_FLOAT)
    assert len(threads) == len(processes) == 6
    for a, b in zip(threads, processes, strict=True):
        assert len(a) == 2
        assert a[0].dtype == torch.float32
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    indices = KeyedIndices([0, 5, 9, 13], (5, 2))
    coloured = _reader(database, **_FLOAT).read_batch(indices)
    carried = _reader(database).read_batch(indices)
    stage = DeviceStage(Normalizer(IMAGENET_MEAN, IMAGENET_STD), color=BatchColor(**RECIPE))
    torch.testing.assert_close(coloured[0], stage(carried)[0])
    assert not torch.allclose(coloured[0], stage(tuple(carried))[0])  # not the uncoloured batch


def test_batch_composition_does_not_change_a_samples_parameters(database: Path) -> None:
    """A sample read in another batch, in another order, gets the same parameters (keyed by its index)."""
    reader = _reader(database, return_index=True)
    one = reader.read_batch(KeyedIndices([0, 5, 9, 13], (5, 2)))
    other = reader.read_batch(KeyedIndices([13, 2, 5], (5, 2)))
    assert torch.equal(one.beside["color"][[3, 1]], other.beside["color"][[0, 2]])
    assert torch.equal(one[-1], torch.tensor([0, 5, 9, 13]))  # the index last, the parameters beside the batch
    assert not torch.equal(one.beside["color"][0], one.beside["color"][1])


class _Jittered(LightningModule):
    """Checks each training batch: normalized float32, two elements, not the batch without colour."""

    def __init__(self, plain: list[torch.Tensor]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.plain = plain
        self.seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        assert images.dtype == torch.float32
        assert images.shape == self.plain[batch_idx].shape
        assert images.min() < -0.5  # normalized (0-255 floats would be >= 0)
        assert not torch.allclose(images, self.plain[batch_idx])
        self.seen += 1
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _datamodule(database: Path, **kwargs: Any) -> FastImageDataModule:
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0, val_fraction=0, **kwargs)
    dm.setup("fit")
    return dm


def test_fit_on_cpu_with_color_jitter(database: Path, tmp_path: Path) -> None:
    """A CPU fit with ``color_jitter`` trains on jittered, normalized float32 batches (the parameters stripped)."""
    plain_dm = _datamodule(database)
    plain_dm.trainer = fake_trainer("cpu")
    plain = [batch[0] for batch in plain_dm.train_dataloader()]
    dm = _datamodule(database, color_jitter=(0.4, 0.4, 0.2, 0.1), color_jitter_p=1.0)
    model = _Jittered(plain)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen == 2
    assert dm.hparams["color_jitter"] == (0.4, 0.4, 0.2, 0.1)


class _OwnCrop(FastImageDataModule):
    """A training transform of one's own: the per-sample path, coloured by the device stage after the transfer."""

    def train_transform(self) -> Any:
        crop = RandomResizedCropFlip(self.image_size)
        return lambda image: crop(image)


class _SeesTransfers(_Jittered):
    """Records what the transfer hook is given: the batch as the training step will take it, nothing beside."""

    def __init__(self, plain: list[torch.Tensor]) -> None:
        super().__init__(plain)
        self.transferred: list[Any] = []

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.transferred.append((type(batch), len(batch), getattr(batch, "beside", None)))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_a_per_sample_fit_takes_the_parameters_beside_the_batch_through_the_transfer(
    database: Path, tmp_path: Path
) -> None:
    """Without the loader's look-ahead, the DataModule takes the parameters off before the transfer: the transfer hook
    and the training step see ``(images, targets)``, and the images are coloured after it."""
    plain_dm = _OwnCrop(str(database), image_size=16, batch_size=4, num_workers=0, val_fraction=0)
    plain_dm.setup("fit")
    plain_dm.trainer = fake_trainer("cpu")
    plain = [plain_dm.to_model_input(batch)[0] for batch in plain_dm.train_dataloader()]
    dm = _OwnCrop(str(database), image_size=16, batch_size=4, num_workers=0, val_fraction=0,
                  color_jitter=(0.4, 0.4, 0.2, 0.1), color_jitter_p=1.0)  # fmt: skip
    model = _SeesTransfers(plain)
    trainer = Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert model.seen == 2
    assert model.transferred == [(list, 2, None)] * 2  # plain: the parameters went beside the batch, not in it


def test_patched_cuda_stage_runs_on_the_side_stream_without_reading_the_device(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On (patched) CUDA the parameters arrive as tensors in the copied batch; the stage reads nothing back."""
    patch_cuda_streams(monkeypatch)
    copied: list[Any] = []
    monkeypatch.setattr(device_module, "_to_device", lambda batch, device: copied.append(batch) or batch)
    dm = _datamodule(database, color_jitter=(0.4, 0.4, 0.2, 0.1), blur_p=1.0, solarize_p=0.2, pin_memory=False)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    loader = dm.train_dataloader()
    assert loader.prefetching
    assert dm._loaders.stage_in_loader

    stage = loader.on_device
    assert stage is dm._loaders.stage
    assert stage.color is not None

    loader.on_device = refusing_host_reads(stage)
    batches = list(loader)
    assert len(batches) == 6
    assert all(len(batch) == 2 for batch in batches)
    assert all(images.dtype == torch.float32 for images, _ in batches)
    # what crossed to the device: the uint8 images, and the parameters beside them
    assert all(batch[0].dtype == torch.uint8 and len(batch) == 2 for batch in copied)
    assert all(batch.beside["color"].shape == (4, len(COLUMNS)) for batch in copied)


def test_device_decode_with_colour_is_refused(database: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode='device'`` on CUDA with colour augmentation fails with what to pass instead."""
    patch_cuda_streams(monkeypatch)
    dm = _datamodule(database, decode="device", grayscale_p=0.2, pin_memory=False)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="decode='cpu'"):
        dm.train_dataloader()
