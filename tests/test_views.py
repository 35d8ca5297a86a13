"""Tests for ``lightning_fastdata.pipeline.views``: several views of each image, decoded once, on every engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hostile
import numpy as np
import pytest
import torch
from fakes import fake_trainer, patch_cuda_streams, refusing_host_reads
from lightning.pytorch import LightningModule, Trainer

from lightning_fastdata import FastImageDataModule, InvalidArgumentError, LmdbImageDataset, ViewGroup
from lightning_fastdata.pipeline import DeviceStage, create_loader
from lightning_fastdata.pipeline import device as device_module
from lightning_fastdata.pipeline.color import COLUMNS, BatchColor
from lightning_fastdata.pipeline.kernel import BatchReader, KeyedIndices
from lightning_fastdata.pipeline.schema import with_beside
from lightning_fastdata.pipeline.views import MultiViewCrop, check_views
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.transforms import Normalizer, crop_resize_into

#: two large views, three small ones (given small first: the groups are sorted by size)
GROUPS = [ViewGroup(12, count=3, scale=(0.05, 0.4)), ViewGroup(24, count=2, scale=(0.4, 1.0))]
SIZES = [24, 24, 12, 12, 12]
NORMALIZER = Normalizer((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _dataset(database: Path, **kwargs: Any) -> LmdbImageDataset:
    return LmdbImageDataset(database, transform=MultiViewCrop(check_views(GROUPS)), fast_decode=True, **kwargs)  # type: ignore[arg-type]


def _epoch(database: Path, engine: str, workers: int, batch_size: int = 4, **kwargs: Any) -> list[Any]:
    """One shuffled epoch's batches, copied (the loader's slots are reused)."""
    loader = create_loader(
        _dataset(database), batch_size, shuffle=True, seed=5, engine=engine, workers=workers, **kwargs
    )  # type: ignore[arg-type]
    return [
        with_beside(([v.clone() for v in batch[0]], *(t.clone() for t in batch[1:])), _cloned(batch))
        for batch in loader
    ]


def _cloned(batch: Any) -> dict[str, torch.Tensor]:
    """The fields beside ``batch`` (its colour parameters), copied."""
    return {name: tensor.clone() for name, tensor in getattr(batch, "beside", {}).items()}


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two tensors that should be equal differ: where they are, what they hold, or which values differ."""
    if (a.device, a.dtype, a.shape) != (b.device, b.dtype, b.shape):
        return f"{a.device} {a.dtype} {tuple(a.shape)} against {b.device} {b.dtype} {tuple(b.shape)}"
    differ = (a.cpu().double() - b.cpu().double()).abs()
    return f"{int((differ > 0).sum())} of {differ.numel()} values differ, by up to {float(differ.max()):g}"


def _assert_same(first: list[Any], second: list[Any]) -> None:
    """The same batches bit for bit; a difference names the batch, the element and how it differs."""
    assert len(first) == len(second) > 1
    for n, ((views_a, *rest_a), (views_b, *rest_b)) in enumerate(zip(first, second, strict=True)):
        assert [v.shape[-1] for v in views_a] == [v.shape[-1] for v in views_b] == SIZES
        for v, (a, b) in enumerate(zip(views_a, views_b, strict=True)):
            assert torch.equal(a, b), f"batch {n}, view {v}: {_difference(a, b)}"
        for i, (a, b) in enumerate(zip(rest_a, rest_b, strict=True), start=1):
            assert torch.equal(a, b), f"batch {n}, element {i} ({type(a).__name__}): {_difference(a, b)}"
        beside_a, beside_b = _cloned(first[n]), _cloned(second[n])
        assert beside_a.keys() == beside_b.keys()
        for name in beside_a:
            assert torch.equal(beside_a[name], beside_b[name]), (
                f"batch {n}, {name}: {_difference(*(b[name] for b in (beside_a, beside_b)))}"
            )


def test_views_are_checked_and_sorted_largest_first() -> None:
    """Groups (or mappings of their fields) come back sorted by size; a bad one is an error naming `views`."""
    groups = check_views([{"size": 96, "count": 6, "scale": [0.05, 0.4]}, {"size": 224, "count": 2}])
    assert groups is not None
    assert [(g.size, g.count, g.scale) for g in groups] == [(224, 2, (0.08, 1.0)), (96, 6, (0.05, 0.4))]
    for bad in ([], {"size": 1}, [{"sizes": 3}], [{"size": 0}], [{"size": 8, "count": 0}], [{"size": 8, "flip": 2}]):
        with pytest.raises(InvalidArgumentError, match="`views"):
            check_views(bad)  # type: ignore[arg-type]


def test_batches_are_a_list_of_views_equal_on_both_engines(database: Path) -> None:
    """Threads and worker processes (2 each) give the same views bit for bit: NCHW uint8, large views first."""
    threads = _epoch(database, "threads", 2, return_index=True)
    _assert_same(threads, _epoch(database, "processes", 2, return_index=True))
    views, targets, index = threads[0]
    assert isinstance(views, list)
    assert [tuple(v.shape) for v in views] == [(4, 3, s, s) for s in SIZES]
    assert all(v.dtype == torch.uint8 and v.is_contiguous(memory_format=torch.channels_last) for v in views)
    assert targets.dtype == index.dtype == torch.int64
    assert not torch.equal(views[0], views[1])  # each view its own box


@pytest.mark.parametrize(("engine", "workers"), [("processes", 1), ("threads", 0)])
def test_batches_built_in_fresh_memory_are_the_same(database: Path, engine: str, workers: int) -> None:
    """With every batch kept alive no slot is free: the batches built in fresh memory hold the same views."""
    loader = create_loader(
        _dataset(database),
        1,
        shuffle=True,
        seed=5,
        engine=engine,
        workers=workers,
        prefetch_factor=1,  # type: ignore[arg-type]
    )
    kept = list(loader)
    assert loader.slot_misses > 0
    _assert_same(kept, _epoch(database, "threads", 2, batch_size=1))


def test_each_image_is_decoded_once(database: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five views of each image, one decode of it."""
    calls = []
    decode = LmdbImageDataset.decode_hwc

    def counting(self: LmdbImageDataset, record: int, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(record)
        return decode(self, record, *args, **kwargs)

    monkeypatch.setattr(LmdbImageDataset, "decode_hwc", counting)
    batches = _epoch(database, "threads", 0)
    samples = sum(len(targets) for _, targets in batches)
    assert sorted(calls) == list(range(samples))


@pytest.mark.parametrize("output", ["uint8", "float"])
def test_views_are_crops_of_the_decoded_image_with_their_keyed_boxes(database: Path, output: str) -> None:
    """Each view is the reference crop of the decoded image with the box and flip its key gives it (normalized)."""
    dataset = _dataset(database)
    plain = LmdbImageDataset(database, fast_decode=True)
    transform = dataset.transform
    assert isinstance(transform, MultiViewCrop)
    key, samples = (7, 2), [3, 0, 9]
    views, _ = BatchReader(dataset, output=output, normalizer=NORMALIZER).read_batch(KeyedIndices(samples, key))  # type: ignore[arg-type]
    images = [plain[i][0].permute(1, 2, 0).numpy() for i in samples]
    per_view = transform.boxes([im.shape[0] for im in images], [im.shape[1] for im in images], key, samples)
    assert len({box for boxes, _ in per_view for box in boxes}) == len(SIZES) * len(samples)  # every box its own
    for v, (boxes, flips) in enumerate(per_view):
        size = SIZES[v]
        for i, image in enumerate(images):
            crop = crop_resize_into(image, boxes[i], size, flips[i], np.empty((size, size, 3), np.uint8))
            expected = torch.from_numpy(crop).permute(2, 0, 1)
            if output == "float":
                expected = NORMALIZER.batch(expected[None].contiguous())[0]
                torch.testing.assert_close(views[v][i], expected, rtol=0, atol=1e-5)
            else:
                assert torch.equal(views[v][i], expected)


def test_a_skipped_sample_leaves_every_view(database_copy: Path) -> None:
    """Under the skip policy a bad sample leaves each view, with its target and index; the others stay aligned."""
    hostile.damage_record(database_copy, 2)
    reader = BatchReader(_dataset(database_copy), skip_counter=SkipCounter(), return_index=True)
    views, targets, index = reader.read_batch(KeyedIndices([1, 2, 3], (0, 0)))
    whole, _, _ = BatchReader(_dataset(database_copy), return_index=True).read_batch(KeyedIndices([1, 3], (0, 0)))
    assert index.tolist() == [1, 3]
    assert len(targets) == 2
    for view, expected in zip(views, whole, strict=True):
        assert torch.equal(view, expected)


class _ViewsModel(LightningModule):
    """Asserts each training batch is ``(views, targets)``: float32 normalized views, large first."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, targets = batch
        assert isinstance(views, list)
        assert [v.shape[-1] for v in views] == SIZES
        assert all(v.dtype == torch.float32 and v.shape[:2] == (4, 3) for v in views)
        assert min(float(v.min()) for v in views) < 0  # normalized, not 0-255
        assert targets.dtype == torch.int64
        assert targets.shape == (4,)
        self.seen += 1
        return sum(torch.nn.functional.cross_entropy(self.layer(v.mean(dim=(2, 3))), targets) for v in views)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_trains_on_views(database: Path, tmp_path: Path) -> None:
    """A real fit on the CPU gets ``(views, targets)`` batches; the DataModule counts its large and small views."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=2, engine="threads", views=GROUPS)
    assert (dm.num_large_views, dm.num_small_views) == (2, 3)
    model = _ViewsModel()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen == 2
    val_images, _ = next(iter(dm.val_dataloader()))
    assert isinstance(val_images, torch.Tensor)
    assert val_images.shape[-1] == 16


class _SoloLearnMethod(LightningModule):
    """solo-learn's ``BaseMethod`` steps as they unpack batches: ``_, X, targets`` in training, ``X, targets`` after."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.steps = {"train": 0, "val": 0}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, X, targets = batch  # solo-learn's names
        assert len(X) == 5
        self.steps["train"] += 1
        return sum(torch.nn.functional.cross_entropy(self.layer(x.mean(dim=(2, 3))), targets) for x in X[:2])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        X, targets = batch
        assert isinstance(X, torch.Tensor)
        assert len(targets) == len(X)
        self.steps["val"] += 1

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SoloLearnOnFastData(_SoloLearnMethod):
    """docs/datamodule.md's solo-learn recipe, word for word: only the training step reorders the batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, targets, indexes = batch  # FastImageDataModule(..., views=[...], return_index=True)
        return super().training_step((indexes, views, targets), batch_idx)


def test_the_solo_learn_recipe_fits_with_a_validation_split(database: Path, tmp_path: Path) -> None:
    """With ``return_index`` the training batches carry the index, the validation batches are ``(images, targets)``:
    solo-learn's validation step (and the sanity check before training) runs unchanged."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0, views=GROUPS, return_index=True)
    model = _SoloLearnOnFastData()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.steps == {"train": 2, "val": 3}  # the sanity check's batch, then the fit's validation


def test_views_refuse_device_decode_and_a_size_schedule() -> None:
    """``views`` with ``decode='device'`` or ``image_size_schedule`` is an error naming both."""
    with pytest.raises(InvalidArgumentError, match=r"`views`.*`decode='device'`"):
        FastImageDataModule("x", views=GROUPS, decode="device")
    with pytest.raises(InvalidArgumentError, match=r"`image_size_schedule`.*`views`"):
        FastImageDataModule("x", views=GROUPS, image_size_schedule={0: 8})


def test_store_short_side_follows_the_largest_view() -> None:
    """A conversion stores images large enough for the largest view's crops."""
    dm = FastImageDataModule("x", image_size=96, views=[ViewGroup(512, count=2), ViewGroup(96, count=4)])
    assert dm.store_short_side() == 586  # ceil(512 / 0.875)


def test_tuning_counts_the_samples_of_a_views_batch(database: Path) -> None:
    """``num_workers='tune'`` times images a second: a views batch counts its samples, not its views."""
    from lightning_fastdata.tuning import _batch_len

    assert _batch_len(_epoch(database, "threads", 0)[0]) == 4


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_views_copied_ahead_to_the_device_are_the_same(
    database: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied ahead to (patched) CUDA from the slots, a batch's views are those of the plain epoch."""
    reference = _epoch(database, "threads", 2)
    patch_cuda_streams(monkeypatch)
    _assert_same(_epoch(database, engine, 2, device="cuda:0"), reference)


def test_set_image_size_with_views_resizes_the_evaluation_crops_without_a_warning(
    database: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """With ``views`` the training crops are the views' sizes, on purpose: ``set_image_size`` resizes validation's
    centre crops and warns about no transform."""
    dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0, views=GROUPS, val_fraction=0.5)
    dm.setup("fit")
    dm.set_image_size(24)
    assert not [w for w in recwarn if "set_image_size" in str(w.message)]
    val_images, _ = next(iter(dm.val_dataloader()))
    assert val_images.shape[-1] == 24
    views, _ = next(iter(dm.train_dataloader()))
    assert [view.shape[-1] for view in views] == [group.size for group in dm.views for _ in range(group.count)]


# ----------------------------------------------------------------------------------------------------------------
# Views with colour augmentation: each view of each sample its own keyed parameters
# ----------------------------------------------------------------------------------------------------------------

RECIPE: dict[str, Any] = {"jitter": (0.4, 0.4, 0.2, 0.1), "grayscale_p": 0.2, "blur_p": 0.5, "solarize_p": 0.2}
KEY = (5, 2)


def test_views_with_colour_are_the_same_on_both_engines(database: Path) -> None:
    """Threads and worker processes give the same uint8 views and ``[B, V, 7]`` parameters, bit for bit."""
    threads = _epoch(database, "threads", 2, output="uint8", color=BatchColor(**RECIPE))
    processes = _epoch(database, "processes", 2, output="uint8", color=BatchColor(**RECIPE))
    _assert_same(threads, processes)
    for batch in threads:
        assert len(batch) == 2  # the parameters travel beside the batch
        assert batch.beside["color"].shape == (len(batch[1]), len(SIZES), len(COLUMNS))
        assert all(view.dtype == torch.uint8 for view in batch[0])


def test_cpu_views_are_coloured_in_the_loader_the_same_on_both_engines(database: Path) -> None:
    """For CPU training (float output) each view is coloured as it is cropped: no parameters in the batch, the same
    batches on threads and worker processes, and what the device stage makes of the uint8 views and parameters."""
    kwargs = {"output": "float", "normalizer": NORMALIZER, "color": BatchColor(**RECIPE)}
    threads, processes = _epoch(database, "threads", 2, **kwargs), _epoch(database, "processes", 2, **kwargs)
    _assert_same(threads, processes)
    assert all(len(batch) == 2 and batch[0][0].dtype == torch.float32 for batch in threads)  # no parameters
    color = BatchColor(**RECIPE)
    indices = KeyedIndices([0, 5, 9, 13], KEY)
    coloured = BatchReader(_dataset(database), "float", NORMALIZER, color=color).read_batch(indices)
    carried = BatchReader(_dataset(database), color=color).read_batch(indices)
    staged = DeviceStage(NORMALIZER, color=color)(carried)
    for view, want, plain in zip(coloured[0], staged[0], carried[0], strict=True):
        torch.testing.assert_close(view, want)
        assert not torch.allclose(view, NORMALIZER.batch(plain))


def test_view_groups_draw_with_probabilities_of_their_own(database: Path) -> None:
    """A group's ``blur_p`` / ``solarize_p`` replace the DataModule's for its views (DINO's asymmetric views)."""
    views = [
        {"size": 24, "blur_p": 1.0},
        {"size": 24, "blur_p": 0.0, "solarize_p": 1.0},
        {"size": 12, "count": 3, "scale": [0.05, 0.4]},
    ]
    dm = FastImageDataModule(str(database), views=views, color_jitter=(0.4, 0.4, 0.2, 0.1), blur_p=0.5)
    color = dm.augment_plan.color
    assert color is not None
    params = color.draw(KEY, list(range(400)), len(SIZES))
    sigma, solarize = params[..., COLUMNS.index("sigma")], params[..., COLUMNS.index("solarize")]
    assert (sigma[:, 0] > 0).all()
    assert (sigma[:, 1] == 0).all()
    assert (solarize[:, 1] == 1).all()
    assert (solarize[:, [0, 2, 3, 4]] == 0).all()  # the DataModule's solarize_p, 0
    assert 0.4 < (sigma[:, 2:] > 0).mean() < 0.6  # the DataModule's blur_p, 0.5
    # a group's probability alone turns the colour stage on
    only = FastImageDataModule(str(database), views=[{"size": 24, "solarize_p": 0.2}, {"size": 12}])
    assert only._color is not None
    assert FastImageDataModule(str(database), views=views[2:])._color is None


def test_view_group_probabilities_are_checked() -> None:
    """A group's probability out of range, or a jitter probability without jitter strengths, names the group."""
    with pytest.raises(InvalidArgumentError, match=r"`views\[1\]`: `blur_p` must be in \[0, 1\], got 1.5"):
        FastImageDataModule("db", views=[{"size": 24}, {"size": 12, "blur_p": 1.5}])
    with pytest.raises(InvalidArgumentError, match=r"`views\[0\]` sets `color_jitter_p`.*`color_jitter="):
        FastImageDataModule("db", views=[{"size": 24, "color_jitter_p": 0.8}])


def test_each_view_of_a_sample_gets_its_own_parameters(database: Path) -> None:
    """Two views of a sample differ in their colour parameters; view 0's are a single view's."""
    color = BatchColor(**RECIPE)
    reader = BatchReader(_dataset(database), color=color, return_index=True)
    batch = reader.read_batch(KeyedIndices([0, 5, 9, 13], KEY))
    (_, _, index), params = batch, batch.beside["color"]
    assert params.shape == (4, len(SIZES), len(COLUMNS))
    for sample in params:
        assert len({tuple(view.tolist()) for view in sample}) == len(SIZES)
    assert np.array_equal(params[:, 0].numpy(), color.draw(KEY, index.tolist()))


def test_view_parameters_are_a_function_of_seed_epoch_sample_and_view(database: Path) -> None:
    """A sample read in another batch, in another order, keeps each view's parameters; another epoch changes them."""
    reader = BatchReader(_dataset(database), color=BatchColor(**RECIPE), return_index=True)
    one = reader.read_batch(KeyedIndices([0, 5, 9, 13], KEY))
    other = reader.read_batch(KeyedIndices([13, 2, 5], KEY))
    assert one.beside["color"].shape == (4, len(SIZES), len(COLUMNS))
    assert torch.equal(one.beside["color"][[3, 1]], other.beside["color"][[0, 2]])
    later = reader.read_batch(KeyedIndices([0, 5, 9, 13], (5, 3)))
    assert not torch.equal(one.beside["color"], later.beside["color"])


class _OwnViews:
    """A transform of one's own returning a list of views: the per-sample path, not the built-in views."""

    def __init__(self) -> None:
        self.crop = MultiViewCrop(check_views(GROUPS))  # type: ignore[arg-type]

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        return self.crop(image)


def test_a_transforms_views_get_the_built_in_views_parameters(database: Path) -> None:
    """The per-sample path with a transform's list of views draws per (sample, view), as the built-in views do."""
    own = LmdbImageDataset(database, transform=_OwnViews(), fast_decode=True)
    per_sample = BatchReader(own, color=BatchColor(**RECIPE))
    fused = BatchReader(_dataset(database), color=BatchColor(**RECIPE))
    assert not per_sample.fused
    assert fused.fused
    batch = per_sample.read_batch(KeyedIndices([3, 1, 7], KEY))
    (views, _), params = batch, batch.beside["color"]
    fused_params = fused.read_batch(KeyedIndices([3, 1, 7], KEY)).beside["color"]
    assert params.shape == (3, len(SIZES), len(COLUMNS))
    assert torch.equal(params, fused_params)
    color = BatchColor(**RECIPE)
    for v, coloured in enumerate(DeviceStage(NORMALIZER, color=color)(batch)[0]):
        assert torch.equal(coloured, NORMALIZER.batch(color(views[v], params[:, v])))


def test_device_stage_colours_each_view_with_its_own_parameters(database: Path) -> None:
    """Each view is coloured with its column of ``[B, V, 7]``, then normalized; mismatched parameters are refused."""
    color = BatchColor(**RECIPE)
    reader = BatchReader(_dataset(database), color=color)
    batch = reader.read_batch(KeyedIndices([0, 5, 9, 13], KEY))
    (views, targets), params = batch, batch.beside["color"]
    stage = DeviceStage(NORMALIZER, color=color)
    out = stage(batch)
    assert len(out) == 2
    assert out[1] is targets
    for v, (coloured, view) in enumerate(zip(out[0], views, strict=True)):
        assert coloured.dtype == torch.float32
        assert torch.equal(coloured, NORMALIZER.batch(color(view, params[:, v])))
        assert not torch.allclose(coloured, NORMALIZER.batch(view, torch.float32, False))
    with pytest.raises(ValueError, match=r"5 views take colour parameters \[B, 5, 7\], got \(4, 7\)"):
        stage((views, targets), {"color": params[:, 0]})
    with pytest.raises(ValueError, match=r"one image batch takes colour parameters \[B, 7\]"):
        stage((views[0], targets), {"color": params})


class _ColouredViewsModel(LightningModule):
    """Asserts each training batch is ``(views, targets)``: normalized float32 views, not the uncoloured ones."""

    def __init__(self, plain: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.plain = plain
        self.seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, targets = batch
        assert isinstance(views, list)
        assert [v.shape[-1] for v in views] == SIZES
        for view, plain in zip(views, self.plain[batch_idx], strict=True):
            assert view.dtype == torch.float32
            assert view.shape == plain.shape
            assert view.min() < -0.5  # normalized (0-255 floats would be >= 0)
            assert not torch.allclose(view, plain)
        self.seen += 1
        return sum(torch.nn.functional.cross_entropy(self.layer(v.mean(dim=(2, 3))), targets) for v in views)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _views_datamodule(database: Path, **kwargs: Any) -> FastImageDataModule:
    dm = FastImageDataModule(
        str(database), image_size=16, batch_size=4, num_workers=2, engine="threads", views=GROUPS, **kwargs
    )
    dm.setup("fit")
    return dm


def test_fit_on_cpu_with_views_and_color_jitter(database: Path, tmp_path: Path) -> None:
    """A CPU fit with ``views`` and ``color_jitter`` trains on coloured, normalized float32 views."""
    plain_dm = _views_datamodule(database)
    plain_dm.trainer = fake_trainer("cpu")
    plain = [[view.clone() for view in batch[0]] for batch in plain_dm.train_dataloader()]
    dm = _views_datamodule(database, color_jitter=(0.4, 0.4, 0.2, 0.1), color_jitter_p=1.0)
    model = _ColouredViewsModel(plain)
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


def test_patched_cuda_views_are_coloured_on_the_side_stream_without_reading_the_device(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On (patched) CUDA the views and their ``[B, V, 7]`` parameters are copied; the stage reads nothing back."""
    patch_cuda_streams(monkeypatch)
    copied: list[Any] = []
    monkeypatch.setattr(device_module, "_to_device", lambda batch, device: copied.append(batch) or batch)
    dm = _views_datamodule(database, color_jitter=(0.4, 0.4, 0.2, 0.1), blur_p=1.0, solarize_p=0.2, pin_memory=False)
    dm.trainer = fake_trainer(torch.device("cuda", 0))
    loader = dm.train_dataloader()
    assert loader.prefetching
    stage = loader.on_device
    assert stage is dm._loaders.stage
    assert stage.color is not None

    loader.on_device = refusing_host_reads(stage)
    batches = list(loader)
    assert len(batches) == 6
    for views, *rest in batches:
        assert len(rest) == 1  # the parameters taken off
        assert [(type(v), v.dtype) for v in views] == [(torch.Tensor, torch.float32)] * len(SIZES)
    assert copied
    for batch in copied:  # what crossed to the device: uint8 views, and the parameters beside them
        views, _ = batch
        assert all(view.dtype == torch.uint8 for view in views)
        assert batch.beside["color"].shape[1:] == (len(SIZES), len(COLUMNS))
