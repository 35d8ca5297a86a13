"""Tests for ``lightning_fastdata.pipeline.kernel``: the fused batch path, its engines, correct pixels, no copies."""

from __future__ import annotations

import gc
import math
import random
import weakref
from pathlib import Path
from typing import Any

import cv2
import hostile
import lmdb
import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from lightning_fastdata import LmdbImageDataset, SampleError, convert_dataset
from lightning_fastdata.errors import CorruptRecordError
from lightning_fastdata.pipeline import FastLoader
from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices
from lightning_fastdata.pipeline.resume import ResumableSampler
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.store import format as store_format
from lightning_fastdata.transforms import CenterCropResize, Normalizer, RandomResizedCropFlip, _apply, crop_resize_into

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 24


def _smooth(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB uint8 image with distinct channels (so a channel swap or a flip shows)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, 3)
    channels = [127 + 100 * np.sin(x / (9 + 4 * c) + y / (13 + 3 * c) + phase[c]) for c in range(3)]
    channels[0] = channels[0] * 0.5 + 120 * (x / width)  # red grows to the right: a flip is visible
    return np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)


def _loader(dataset, engine: str, batch_size: int = 5, **kwargs: Any) -> FastLoader:
    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    workers = {"threads": 2} if engine == "threads" else {"num_workers": 2} if engine == "processes" else {}
    return FastLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False, **workers, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Correct images
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("box", "tolerance"),
    [
        ((10, 20, 150, 170), 1.5),  # downscaled over 2x on both sides: a box filter vs antialiased bilinear
        ((10, 20, 36, 30), 0.5),  # downscaled under 2x: prefilter + bilinear
        ((10, 20, 36, 20), 0.5),  # downscaled on one side, upscaled on the other
        ((30, 5, 17, 20), 1.0),  # upscaled: bilinear, as torchvision
        ((0, 0, 160, 200), 2.0),  # the whole image, 7x smaller: the filters' shapes differ most
    ],
)
def test_crop_resize_matches_torchvision_resized_crop(box: tuple[int, int, int, int], tolerance: float) -> None:
    """A fixed box gives torchvision's ``resized_crop(antialias=True)`` within a mean of `tolerance` levels (of 255).

    Tolerances: OpenCV's box filter and torchvision's antialiased triangle filter weigh the same source pixels a little
    differently when downscaling; upscaling differs by rounding only. Channels stay in RGB order.
    """
    image = _smooth(160, 200)
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    crop_resize_into(image, box, SIZE, False, out)
    ours = torch.from_numpy(out).permute(2, 0, 1).float()
    reference = TF.resized_crop(torch.from_numpy(image).permute(2, 0, 1), *box, [SIZE, SIZE], antialias=True).float()
    assert (ours - reference).abs().mean() <= tolerance
    assert (ours - reference).abs().max() <= 12
    flipped = np.empty_like(out)
    crop_resize_into(image, box, SIZE, True, flipped)
    np.testing.assert_array_equal(flipped, out[:, ::-1])


@pytest.mark.parametrize("box", [(0, 0, 36, 36), (0, 0, 20, 36)], ids=["both-axes", "one-axis"])
def test_shrinking_by_less_than_2x_is_antialiased(box: tuple[int, int, int, int]) -> None:
    """One-pixel stripes shrunk 1.5x alias into strong bands under plain bilinear; ours flatten as torchvision's do.

    (A sampled Gaussian prefilter of the textbook width barely touches this pattern: the reason for the 3-tap kernel.)
    """
    stripes = np.zeros((40, 40, 3), np.uint8)
    stripes[:, ::2] = 255
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    ours = crop_resize_into(stripes, box, SIZE, False, out).astype(np.float64)
    top, left, h, w = box
    plain = cv2.resize(stripes[top : top + h, left : left + w], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    theirs = TF.resized_crop(torch.from_numpy(stripes).permute(2, 0, 1), *box, [SIZE, SIZE], antialias=True)
    assert abs(ours.mean() - 127.5) < 2  # the blur keeps the mean
    # at most halfway from torchvision's residual ripple (16.6 levels) to bilinear's aliasing (63.5): 27.3 here
    assert ours.std() <= (theirs.float().std().item() + plain.std()) / 2


def test_crop_resize_keeps_rgb_order() -> None:
    """Channels come out in the order they went in (no BGR swap anywhere in the OpenCV kernel)."""
    image = np.empty((50, 60, 3), np.uint8)
    image[...] = (200, 90, 10)
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    for box in ((0, 0, 50, 60), (5, 5, 10, 12)):
        crop_resize_into(image, box, SIZE, True, out)
        assert out.reshape(-1, 3).tolist() == [[200, 90, 10]] * SIZE * SIZE


def test_crop_boxes_follow_torchvision_random_resized_crop() -> None:
    """Box areas, aspect ratios and positions have the distribution of torchvision's ``get_params``."""
    height, width, n = 256, 341, 4000
    ours_t, theirs_t = RandomResizedCropFlip(SIZE), RandomResizedCrop(SIZE)
    random.seed(0)
    torch.manual_seed(0)
    ours = np.array([ours_t.box(height, width) for _ in range(n)], dtype=np.float64)
    image = torch.empty(3, height, width)
    theirs = np.array([theirs_t.get_params(image, theirs_t.scale, theirs_t.ratio) for _ in range(n)], np.float64)

    def summary(boxes: np.ndarray) -> np.ndarray:
        top, left, h, w = boxes.T
        area, aspect = h * w / (height * width), np.log(w / h)
        centre_y, centre_x = (top + h / 2) / height, (left + w / 2) / width
        return np.array([np.quantile(v, q) for v in (area, aspect, centre_y, centre_x) for q in (0.1, 0.5, 0.9)])

    np.testing.assert_allclose(summary(ours), summary(theirs), atol=0.04)
    # the batch path draws a whole batch at once (vectorized): the same distribution
    batch, flips = ours_t.boxes(np.full(n, height), np.full(n, width))
    np.testing.assert_allclose(summary(np.array(batch, np.float64)), summary(theirs), atol=0.04)
    assert 0.45 < np.mean(flips) < 0.55


def test_batch_boxes_fall_back_and_fit_as_single_boxes_do() -> None:
    """Where no try fits, both draws fall back to the same centre crop; every box lies inside its image."""
    crop = RandomResizedCropFlip(SIZE, scale=(0.99, 1.0))
    boxes, _ = crop.boxes(np.array([10, 256, 1000]), np.array([1000, 341, 10]))
    assert boxes[0] == crop.box(10, 1000) == (0, (1000 - 13) // 2, 10, 13)
    assert boxes[2] == crop.box(1000, 10) == ((1000 - 13) // 2, 0, 13, 10)
    heights, widths = np.random.default_rng(0).integers(1, 600, (2, 500))
    top, left, h, w = np.array(RandomResizedCropFlip(SIZE).boxes(heights, widths)[0]).T
    assert (h > 0).all()
    assert (w > 0).all()
    assert (top >= 0).all()
    assert (left >= 0).all()
    assert (top + h <= heights).all()
    assert (left + w <= widths).all()
    centre = CenterCropResize(SIZE)
    assert centre.boxes([90, 300], [120, 200]) == ([centre.box(90, 120), centre.box(300, 200)], [False, False])


def test_crop_transform_on_a_tensor_is_the_fused_kernel() -> None:
    """The transforms' tensor path (for a user's own dataset) gives the same pixels as the fused batch path."""
    image = _smooth(90, 120)
    transform = CenterCropResize(SIZE)
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    crop_resize_into(image, transform.box(90, 120), SIZE, False, out)
    tensor = transform(torch.from_numpy(image).permute(2, 0, 1))
    assert tensor.shape == (3, SIZE, SIZE)
    np.testing.assert_array_equal(tensor.permute(1, 2, 0).numpy(), out)


# ----------------------------------------------------------------------------------------------------------------
# The fused batch path
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def dataset(database: Path) -> LmdbImageDataset:
    return LmdbImageDataset(database, transform=RandomResizedCropFlip(SIZE))


def test_fused_batches_match_the_per_sample_path(
    dataset: LmdbImageDataset, database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the same boxes and flips, the fused batch equals the per-sample transform's output up to decode rounding."""
    drawn: list[tuple[list, list]] = []
    draw = dataset.transform.boxes
    monkeypatch.setattr(dataset.transform, "boxes", lambda h, w, **kw: drawn.append(draw(h, w, **kw)) or drawn[-1])
    reader = BatchReader(dataset, output="uint8")  # the fast path it states draws with the (patched) boxes
    assert reader.fused
    images, labels = reader.read_batch([0, 3, 7])
    (boxes, flips), plain = drawn[0], LmdbImageDataset(database)
    expected = torch.stack(
        [_apply(plain[i][0], box, SIZE, flip) for i, box, flip in zip((0, 3, 7), boxes, flips, strict=True)]
    )
    assert images.dtype == torch.uint8
    assert images.shape == (3, 3, SIZE, SIZE)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == [dataset.targets[i] for i in (0, 3, 7)]
    # the batch path decodes with libjpeg-turbo's fast DCT and upsampling: a few levels here and there
    assert (images.float() - expected.float()).abs().mean() < 2.0


def test_float_batches_are_the_normalized_uint8_batches(dataset: LmdbImageDataset) -> None:
    """``output="float"`` normalizes in the reading thread exactly as the device would; CHW or channels_last."""
    normalizer = Normalizer(MEAN, STD)
    random.seed(1)
    uint8, _ = BatchReader(dataset, output="uint8").read_batch(range(6))
    for channels_last in (False, True):
        random.seed(1)
        floats, _ = BatchReader(dataset, "float", normalizer, channels_last=channels_last).read_batch(range(6))
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert floats.dtype == torch.float32
        assert floats.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(floats, normalizer.batch(uint8.contiguous()), rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["main", "threads", "processes"])
def test_every_engine_gives_the_same_batches_in_order(database: Path, engine: str) -> None:
    """Threads and worker processes hand out the same batches, in sampler order, as the calling thread does."""
    dataset = LmdbImageDataset(database, transform=CenterCropResize(SIZE))  # deterministic pixels
    reference = list(_loader(BatchReader(dataset), "main"))
    loader = _loader(BatchReader(dataset), engine)
    assert loader.engine == engine
    batches = list(loader)
    assert len(batches) == len(reference) == math.ceil(len(dataset) / 5)
    for (images, labels), (ref_images, ref_labels) in zip(batches, reference, strict=True):
        torch.testing.assert_close(images, ref_images, rtol=0, atol=0)
        assert labels.tolist() == ref_labels.tolist()


def test_a_seeded_threaded_epoch_crops_the_same_way_twice(dataset: LmdbImageDataset) -> None:
    """Crops follow the sampler's seed and epoch, not the global random state or which thread builds a batch."""
    epochs = []
    for global_seed in (7, 8):
        random.seed(global_seed)
        epochs.append(list(_loader(BatchReader(dataset), "threads", batch_size=2)))
    for (first, first_labels), (second, second_labels) in zip(*epochs, strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        assert first_labels.tolist() == second_labels.tolist()


def test_crops_are_a_function_of_seed_epoch_and_sample(dataset: LmdbImageDataset) -> None:
    """A sample's crop and flip depend on ``(seed, epoch, sample)`` only: not on its batch or its place in it."""
    reader = BatchReader(dataset, output="uint8")

    def read(indices: list[int], key: tuple[int, int]) -> torch.Tensor:
        return reader.read_batch(KeyedIndices(indices, key))[0].clone()

    whole = read(list(range(6)), (3, 0))
    torch.testing.assert_close(torch.cat([read([0, 1, 2], (3, 0)), read([3, 4, 5], (3, 0))]), whole, rtol=0, atol=0)
    torch.testing.assert_close(read([5, 4, 3, 2, 1, 0], (3, 0)), whole.flip(0), rtol=0, atol=0)
    assert not torch.equal(read(list(range(6)), (3, 1)), whole)  # another epoch
    assert not torch.equal(read(list(range(6)), (4, 0)), whole)  # another seed
    torch.testing.assert_close(reader.read_batch(list(range(6)), seed=3)[0], whole, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ["threads", "processes", "main"])
def test_a_loader_is_freed_without_the_garbage_collector(dataset: LmdbImageDataset, engine: str) -> None:
    """Nothing a loader's iterator holds refers back to the loader: dropping it frees it (and stops its workers) at
    once, not at some later garbage collection (which took 10 s for persistent worker processes)."""
    loader = _loader(BatchReader(dataset), engine, persistent_workers=engine == "processes")
    assert sum(len(labels) for _, labels in loader) == len(dataset)
    alive = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert alive() is None
    finally:
        gc.enable()


def test_threads_stop_cleanly_when_the_consumer_stops_early(dataset: LmdbImageDataset) -> None:
    """Leaving an epoch after one batch leaves no thread running, and the next epoch is whole."""
    import threading

    loader = _loader(BatchReader(dataset), "threads", batch_size=2)
    iterator = iter(loader)
    next(iterator)
    del iterator
    deadline = __import__("time").monotonic() + 10
    while any(t.name.startswith("lightning_fastdata") for t in threading.enumerate()):
        assert __import__("time").monotonic() < deadline, "loader threads still running"
        __import__("time").sleep(0.01)
    assert sum(len(labels) for _, labels in loader) == len(dataset)


def test_a_custom_transform_takes_the_per_sample_path(database: Path) -> None:
    """A user's own transform (or a subclass that changes ``__call__``) still works, through ``dataset[i]``."""

    class Darker(RandomResizedCropFlip):
        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return super().__call__(image) // 2

    reader = BatchReader(LmdbImageDataset(database, transform=Darker(SIZE)))
    assert not reader.fused
    images, labels = next(iter(_loader(reader, "threads", batch_size=4)))
    assert images.shape == (4, 3, SIZE, SIZE)
    assert images.max() <= 127
    assert len(labels) == 4


def _draws() -> list[Any]:
    """One draw from each kind of random source a transform of one's own might use."""
    return [
        torch.rand(2),
        torch.empty(3).uniform_(-1, 1),
        torch.randperm(6),
        torch.randint(0, 9, (3,)),
        torch.multinomial(torch.ones(4), 2),
        random.random(),
        np.random.rand(),
    ]


def _same(a: list[Any], b: list[Any]) -> list[bool]:
    return [torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True)]


def test_sample_key_keys_torch_random_functions_on_every_thread_and_leaves_the_global_state() -> None:
    """Within ``sample_key`` torch's random functions draw from the sample's key, on the main thread and on a loader
    thread alike, and the global generator's state is as it was; ``random`` and NumPy's global generator are keyed
    (and put back) on the main thread only; a ``generator`` passed in is kept."""
    import threading

    from lightning_fastdata.keyed_random import sample_key

    def keyed(sample: int) -> list[Any]:
        with sample_key((3, 1), sample):
            return _draws()

    torch.manual_seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    on_main = keyed(5)
    assert all(_same(keyed(5), on_main))
    assert not any(_same(keyed(6), on_main)[:5])  # another sample, other torch draws
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    on_thread: list[list[Any]] = []
    thread = threading.Thread(target=lambda: on_thread.append(keyed(5)))
    thread.start()
    thread.join()
    assert _same(on_thread[0], on_main)[:5] == [True] * 5  # torch: keyed on a loader thread too
    assert torch.equal(torch.get_rng_state(), before[0])
    with sample_key((3, 1), 5):
        own = torch.rand(2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(own, torch.rand(2, generator=torch.Generator().manual_seed(1)))


def test_a_dataset_subclass_with_its_own_getitem_takes_the_per_sample_path(database: Path) -> None:
    """A ``build_dataset`` returning a subclass that overrides ``__getitem__`` is called, not bypassed."""

    class Marked(LmdbImageDataset):
        def __getitem__(self, index: int) -> Any:
            image, label = super().__getitem__(index)
            return image, label + 100

    reader = BatchReader(Marked(database, transform=CenterCropResize(SIZE)))
    assert not reader.fused
    _, labels = reader.read_batch([0, 1])
    assert min(labels.tolist()) >= 100


def test_target_transform_applies_on_the_fused_path(database: Path) -> None:
    """``target_transform`` runs on every label of a fused batch."""
    dataset = LmdbImageDataset(database, transform=CenterCropResize(SIZE), target_transform=lambda y: y + 10)
    _, labels = BatchReader(dataset).read_batch([0, 1])
    assert labels.tolist() == [dataset.targets[0] + 10, dataset.targets[1] + 10]


def _damaged(database_copy: Path, index: int) -> Path:
    env = lmdb.open(str(database_copy), map_size=1 << 26)
    with env.begin(write=True) as txn:
        key = store_format.record_key("train", index)
        header, payload = store_format.unpack_record(txn.get(key))
        broken = bytes(payload[: len(payload) // 3])  # a JPEG cut short
        txn.put(key, store_format.pack_record(header.encoding, header.label, header.height, header.width, broken))
    env.close()
    return database_copy


def test_a_bad_record_raises_naming_it_or_is_skipped_and_counted(database_copy: Path) -> None:
    """Without the skip policy the error names split and index; with it the sample leaves its batch and is counted."""
    dataset = LmdbImageDataset(_damaged(database_copy, 2), transform=CenterCropResize(SIZE))
    with pytest.raises(CorruptRecordError, match="split 'train' index 2"):
        BatchReader(dataset).read_batch([1, 2, 3])
    counter = SkipCounter()
    images, labels = BatchReader(dataset, skip_counter=counter).read_batch([1, 2, 3])
    assert images.shape[0] == len(labels) == 2
    assert counter.value == 1
    with pytest.raises(SampleError, match="all 1 samples"):
        BatchReader(dataset, skip_counter=counter).read_batch([2])


def test_raw_records_take_the_fused_path(tmp_path: Path) -> None:
    """A raw-pixel database is read without decoding and cropped like a JPEG one."""
    images = [(_smooth(40, 50, seed=i), i % 2) for i in range(4)]
    from PIL import Image

    convert_dataset([(Image.fromarray(a), y) for a, y in images], tmp_path / "raw", encoding="raw", progress=False)
    reader = BatchReader(LmdbImageDataset(tmp_path / "raw", transform=CenterCropResize(SIZE)))
    batch, labels = reader.read_batch(range(4))
    assert labels.tolist() == [0, 1, 0, 1]
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    crop_resize_into(images[1][0], CenterCropResize(SIZE).box(40, 50), SIZE, False, out)
    np.testing.assert_array_equal(batch[1].permute(1, 2, 0).numpy(), out)


# ----------------------------------------------------------------------------------------------------------------
# No per-batch host-to-device copies
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the CPU tensors copied to another device (``Tensor.to``) while the test runs."""
    seen: list[tuple[int, ...]] = []
    real_to = torch.Tensor.to

    def counting_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type != "cpu":
            seen.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    return seen


def test_normalizing_on_a_device_copies_the_constants_once(copies: list[tuple[int, ...]]) -> None:
    """Mean and std reach a device once per (device, dtype): no CPU tensor is copied to the device per batch.

    The ``meta`` device stands in for a GPU; every ``Tensor.to`` from the CPU to it is counted.
    """
    normalizer = Normalizer(MEAN, STD)
    for _ in range(5):
        out = normalizer.batch(torch.empty(4, 3, 8, 8, dtype=torch.uint8, device="meta"), torch.float16)
        assert out.dtype == torch.float16
        assert out.device.type == "meta"
    assert copies == [(1, 3, 1, 1), (1, 3, 1, 1)]  # scale and shift, once
    for _ in range(3):
        normalizer.float_(torch.empty(2, 3, 8, 8, dtype=torch.float64, device="meta"))
    assert len(copies) == 4  # a new dtype: once more, then cached


def test_datamodule_to_model_input_copies_nothing_per_batch(copies: list[tuple[int, ...]]) -> None:
    """``FastImageDataModule.to_model_input`` (run on the side stream per batch) copies no CPU tensor to the device."""
    from lightning_fastdata import FastImageDataModule

    dm = FastImageDataModule("unused")
    for _ in range(4):
        images = torch.empty(2, 3, 8, 8, dtype=torch.uint8, device="meta")
        out, _labels = dm.to_model_input((images, torch.empty(2, dtype=torch.int64, device="meta")))
        assert out.dtype == torch.float32
    assert len(copies) == 2


def test_device_decode_runs_nvjpeg_on_its_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvJPEG decodes under a dedicated current stream; the caller's stream waits for it and records the outputs."""
    from lightning_fastdata.pipeline import device_decode, streams

    log: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(f"{self.name} waits {other.name}")

    caller = Stream("caller")
    current = [caller]

    class Context:
        def __init__(self, stream: Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: Any) -> None:
            current.pop()

    class Output:
        def record_stream(self, stream: Stream) -> None:
            log.append(f"record {stream.name}")

    def fake_decode(inputs: list[Any], mode: Any, device: Any) -> list[Output]:
        log.append(f"decode on {current[-1].name}")
        return [Output() for _ in inputs]

    monkeypatch.setattr(streams, "_SIDE_STREAMS", {})

    class DecodeStream(Stream):  # a class, as `torch.cuda.Stream` is
        def __init__(self, device: Any = None) -> None:
            super().__init__("decode")

    monkeypatch.setattr(torch.cuda, "Stream", DecodeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", Context)
    monkeypatch.setattr(device_decode, "decode_jpeg", fake_decode)
    outputs = device_decode._decode_on_device([object(), object()], torch.device("cuda", 0))
    assert len(outputs) == 2
    assert log == ["decode waits caller", "decode on decode", "caller waits decode", "record caller", "record caller"]
    device_decode._decode_on_device([object()], torch.device("cuda", 0))
    assert log.count("decode on decode") == 2  # the same stream again, not one per batch


@pytest.mark.cuda
def test_cuda_training_steps_never_synchronize(database: Path) -> None:
    """On CUDA, steps fed by the DataModule's loader (threads, pinned uint8, side-stream copy and normalization)
    run under ``torch.cuda.set_sync_debug_mode("error")``: no host-device synchronization per step."""
    from lightning_fastdata import FastImageDataModule

    dm = FastImageDataModule(str(database), image_size=32, batch_size=4, num_workers=2, val_fraction=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.prefetching
    model = torch.nn.Conv2d(3, 4, 3).cuda()
    batches = iter(loader)
    images, labels = next(batches)  # the first batch copies the normalization constants once
    assert images.is_cuda
    assert images.dtype == torch.float32
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for images, labels in batches:
            loss = model(images).float().mean() + labels.float().mean() * 0
            loss.backward()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps == len(loader) - 1


@pytest.mark.slow
def test_a_worker_process_imports_neither_lightning_nor_torchvision() -> None:
    """Unpickling a batch reader in a spawned worker imports the batch path only: Lightning and torchvision (which
    loads ``torch._dynamo``) cost each worker seconds of start-up (6.3 s -> 3.7 s to import it here)."""
    import subprocess
    import sys

    code = (
        "import sys, lightning_fastdata.pipeline.kernel, lightning_fastdata.pipeline.processes;"  # the worker_init_fn
        " print(sorted({'lightning', 'torchvision'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("output", ["uint8", "encoded"])
def test_a_header_with_an_absurd_or_too_large_size_is_a_bad_sample(tmp_path: Path, output: str) -> None:
    """Record headers (with valid checksums) claiming 2**32 - 1 pixels a side, or more than ``max_pixels``, and a JPEG
    whose own frame header is larger than its record's, are bad samples naming their index: skipped under the skip
    policy, on the batch path and on device decode's host side (``ValueError: Maximum allowed dimension exceeded``
    escaped the skip policy)."""
    image = hostile.jpeg(48, 64)
    records = [
        hostile.record(store_format.ENCODING_JPEG, 0, 48, 64, image),
        hostile.record(store_format.ENCODING_JPEG, 0, 2**32 - 1, 2**32 - 1, image),
        hostile.record(store_format.ENCODING_JPEG, 0, 65535, 65535, image),
        hostile.record(store_format.ENCODING_JPEG, 0, 48, 64, hostile.claiming(image, 16000, 16000)),
        hostile.record(store_format.ENCODING_JPEG, 0, 48, 64, image),
    ]
    dataset = LmdbImageDataset(
        hostile.write_database(tmp_path / "db", records, ["a"]), transform=CenterCropResize(SIZE)
    )
    for bad in (1, 2, 3):
        with pytest.raises(CorruptRecordError, match=f"split 'train' index {bad} of"):
            BatchReader(dataset, output=output).read_batch([0, bad, 4])  # type: ignore[arg-type]
    counter = SkipCounter()
    images, labels = BatchReader(dataset, output=output, skip_counter=counter).read_batch(range(5))  # type: ignore[arg-type]
    assert len(images) == len(labels) == 2
    assert counter.value == 3


def test_a_dataset_and_its_transform_state_the_fast_path(database: Path) -> None:
    """A transform of one's own that states its fused crops is fused; a dataset that states none reads per sample."""

    class Declared:  # wraps a package crop and says so: the fused path makes the crop's boxes
        def __init__(self) -> None:
            self.crop = RandomResizedCropFlip(16)

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return self.crop(image)

        def fused_crops(self) -> Any:
            return self.crop.fused_crops()

    class Undeclared(Declared):
        fused_crops = None  # type: ignore[assignment]

    class PerSample(LmdbImageDataset):
        def fast_path(self) -> Any:
            return None

    assert BatchReader(LmdbImageDataset(database, transform=Declared())).fused  # type: ignore[arg-type]
    assert not BatchReader(LmdbImageDataset(database, transform=Undeclared())).fused  # type: ignore[arg-type]
    assert not BatchReader(PerSample(database, transform=RandomResizedCropFlip(16))).fused
    assert BatchReader(LmdbImageDataset(database, transform=RandomResizedCropFlip(16))).fused
