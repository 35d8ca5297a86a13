"""The example LightningCLI configs parse, and the CPU one trains through ``lightning-fastdata fit``."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_fastdata import (
    CorruptRecordError,
    FastImageDataModule,
    InvalidArgumentError,
    ViewGroup,
    make_image_folder,
)
from lightning_fastdata.cli import lightning_cli, main
from lightning_fastdata.store.reader import DEFAULT_MAX_PIXELS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so the configs' `fastdata_examples.*` class paths import (sys.path is restored)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])  # pytest's own arguments are not the CLI's


def _parse(monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """The config LightningCLI parses from `args`, without instantiating the model, data or Trainer."""
    monkeypatch.setattr(LightningCLI, "instantiate_classes", lambda self: None)
    return lightning_cli(list(args), run=False).config


def test_configs_exist() -> None:
    """The three documented example configs are present (the parametrized test below is not empty)."""
    assert {p.name for p in CONFIGS} >= {"cpu.yaml", "ddp.yaml", "gpu_16mixed.yaml"}


@pytest.mark.usefixtures("in_repo")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example config parses with the `lightning-fastdata` LightningCLI into an importable model and data."""
    cfg = _parse(monkeypatch, "--config", str(config))
    assert cfg.seed_everything == 0
    assert cfg.model.class_path == "fastdata_examples.classifier.ImageClassifier"
    assert cfg.data.class_path in {
        "lightning_fastdata.FastImageDataModule",
        "fastdata_examples.augmented_datamodule.JitterDataModule",
    }
    assert cfg.data.init_args.data_dir == ".demo/images"
    assert cfg.data.init_args.num_workers == "auto"  # FastImageDataModule's defaults fill the rest


@pytest.mark.usefixtures("in_repo")
def test_cpu_config_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU config trains in full precision with the jitter subclass and small crops."""
    cfg = _parse(monkeypatch, "--config", "examples/configs/cpu.yaml")
    assert cfg.trainer.accelerator == "cpu"
    assert cfg.trainer.devices == 1
    assert cfg.trainer.max_epochs == 2
    assert cfg.trainer.precision is None
    assert cfg.model.init_args.arch == "resnet18"
    assert cfg.data.class_path == "fastdata_examples.augmented_datamodule.JitterDataModule"
    assert cfg.data.init_args.jitter == 0.2
    assert cfg.data.init_args.image_size == 96
    assert cfg.data.init_args.batch_size == 32


@pytest.mark.usefixtures("in_repo")
def test_gpu_config_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-GPU config uses 16-mixed and channels_last batches."""
    cfg = _parse(monkeypatch, "--config", "examples/configs/gpu_16mixed.yaml")
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.trainer.devices == 1
    assert cfg.trainer.precision == "16-mixed"
    assert cfg.trainer.benchmark is True
    assert cfg.model.init_args.arch == "resnet50"
    assert cfg.data.class_path == "lightning_fastdata.FastImageDataModule"
    assert cfg.data.init_args.channels_last is True
    assert cfg.data.init_args.image_size == 224
    assert cfg.data.init_args.batch_size == 128


@pytest.mark.usefixtures("in_repo")
def test_ddp_config_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DDP config names the DDPStrategy class with its arguments, on every GPU, with synced batch norm."""
    cfg = _parse(monkeypatch, "--config", "examples/configs/ddp.yaml")
    assert cfg.trainer.strategy.class_path == "lightning.pytorch.strategies.DDPStrategy"
    assert cfg.trainer.strategy.init_args.gradient_as_bucket_view is True
    assert cfg.trainer.strategy.init_args.find_unused_parameters is False
    assert cfg.trainer.devices == -1
    assert cfg.trainer.num_nodes == 1
    assert cfg.trainer.precision == "16-mixed"
    assert cfg.trainer.sync_batchnorm is True
    assert cfg.data.init_args.channels_last is True


@pytest.mark.usefixtures("in_repo")
def test_command_line_overrides_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options after `--config` override the config's values."""
    cfg = _parse(
        monkeypatch,
        "--config",
        "examples/configs/gpu_16mixed.yaml",
        "--data.init_args.batch_size",
        "7",
        "--trainer.precision",
        "bf16-mixed",
    )
    assert cfg.data.init_args.batch_size == 7
    assert cfg.trainer.precision == "bf16-mixed"


@pytest.mark.usefixtures("in_repo")
def test_config_with_unknown_key_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelled datamodule argument is rejected at parse time."""
    config = tmp_path / "bad.yaml"
    config.write_text(
        "data:\n  class_path: lightning_fastdata.FastImageDataModule\n  init_args:\n    data_dir: x\n    batchsize: 8\n"
    )
    with pytest.raises(SystemExit):
        _parse(monkeypatch, "--config", str(config))


@pytest.mark.usefixtures("in_repo")
def test_cpu_config_fits(tmp_path: Path) -> None:
    """`lightning-fastdata fit --config examples/configs/cpu.yaml` trains and saves a checkpoint and its config."""
    images = make_image_folder(
        tmp_path / "images",
        num_classes=2,
        train_per_class=6,
        val_per_class=2,
        min_size=40,
        max_size=80,
        num_workers=1,
    )
    cache, out = tmp_path / "cache", tmp_path / "out"
    code = main(
        [
            "fit",
            "--config",
            "examples/configs/cpu.yaml",
            "--data.init_args.data_dir",
            str(images),
            "--data.init_args.cache_dir",
            str(cache),
            "--data.init_args.image_size",
            "32",
            "--data.init_args.batch_size",
            "6",  # 12 training images: the two steps are one epoch, so validation runs at its end
            "--trainer.max_steps",
            "2",
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.default_root_dir",
            str(out),
            # named, not Lightning's default: that is TensorBoardLogger wherever tensorboard is installed (GPU images)
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            str(out),
        ]
    )
    assert code == 0
    assert len([p for p in cache.iterdir() if p.suffix == ".lmdb"]) == 1  # converted into `cache_dir`
    checkpoints = sorted(out.rglob("*.ckpt"))
    assert len(checkpoints) == 1
    checkpoint = torch.load(checkpoints[0], map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2
    assert checkpoint["hyper_parameters"]["num_classes"] == 2
    assert checkpoint["datamodule_hyper_parameters"]["image_size"] == 32
    assert checkpoint["datamodule_hyper_parameters"]["jitter"] == 0.2
    saved = sorted(out.rglob("config.yaml"))
    assert len(saved) == 1
    assert "JitterDataModule" in saved[0].read_text()
    metrics = sorted(out.rglob("metrics.csv"))
    assert len(metrics) == 1
    header = metrics[0].read_text().splitlines()[0]
    assert "train/loss" in header
    assert "val/loss" in header


def _one_error_line(err: str) -> str:
    """The single ``error:`` line of stderr (Lightning's own info lines may precede it); no traceback."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert not [line for line in err.splitlines() if line.lstrip().startswith(("usage:", "[--"))], err
    return errors[0]


@pytest.mark.usefixtures("in_repo")
def test_a_misspelled_argument_is_one_line_naming_the_nearest_key(tmp_path: Path, capsys) -> None:
    """``--data.init_args.data_dri``, a config's ``batchsize`` and ``--trainer.max_epochz``: one line each, exit 2."""
    config = tmp_path / "bad.yaml"
    config.write_text(
        "data:\n  class_path: lightning_fastdata.FastImageDataModule\n  init_args:\n    data_dir: x\n    batchsize: 8\n"
    )
    cases = [
        (
            ["--data.init_args.data_dri", "x"],
            "`data` (JitterDataModule) has no argument `data_dri`; did you mean `data_dir`",
        ),
        (
            ["--config", str(config)],
            "`data` (FastImageDataModule) has no argument `batchsize`; did you mean `batch_size`",
        ),
        (
            ["--trainer.max_epochz", "1"],
            "unrecognized option `--trainer.max_epochz`; did you mean `--trainer.max_epochs`?",
        ),
    ]
    for extra, expected in cases:
        assert main(["fit", "--config", "examples/configs/cpu.yaml", *extra]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(f"error: {expected}"), line


def _another_packages_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another installed package's top-level ``examples`` first on ``sys.path``, as on a GPU node with such a package.

    A regular package: Python imports it before the repository's ``examples/`` folder (no ``__init__.py``) wherever
    each is on ``sys.path``. Neither it nor the example modules are left imported.
    """
    site = tmp_path / "site-packages"
    (site / "examples").mkdir(parents=True)
    (site / "examples" / "__init__.py").write_text('"""Another package\'s examples."""\n')
    monkeypatch.syspath_prepend(str(site))
    for name in [name for name in sys.modules if name.partition(".")[0] in ("examples", "fastdata_examples")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.usefixtures("in_repo")
def test_the_example_configs_import_their_classes_beside_another_packages_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The configs name their classes by a name no other package uses (``fastdata_examples.*``), so another installed
    package's top-level ``examples`` changes nothing: each class is the one in the repository's ``examples/``."""
    _another_packages_examples(tmp_path, monkeypatch)
    for config in CONFIGS:
        cfg = _parse(monkeypatch, "--config", str(config))
        for class_path in (cfg.model.class_path, cfg.data.class_path):
            module, _, name = class_path.rpartition(".")
            assert module.partition(".")[0] in ("fastdata_examples", "lightning_fastdata"), class_path
            folder = "examples" if module.startswith("fastdata_examples") else "lightning_fastdata"
            assert Path(inspect.getfile(getattr(importlib.import_module(module), name))).parent == ROOT / folder
    assert "examples" not in sys.modules  # nothing asked for another package's


def test_an_example_config_run_outside_the_repository_says_where_to_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """An example config's ``fastdata_examples.*`` class, run from another folder: one line saying to run from the
    repository root (or to put it on PYTHONPATH), exit 2, even beside another package's top-level ``examples``."""
    _another_packages_examples(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    assert main(["fit", "--config", str(ROOT / "examples" / "configs" / "cpu.yaml")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(
        "error: `model.class_path` 'fastdata_examples.classifier.ImageClassifier': No module named 'fastdata_examples';"
        " `fastdata_examples` is imported from the working directory or PYTHONPATH: run from the folder that holds"
        " `fastdata_examples/` (for examples/configs/*.yaml, the repository root), or add that folder to PYTHONPATH"
    ), line


@pytest.mark.usefixtures("in_repo")
def test_a_missing_data_dir_is_one_line(tmp_path: Path, capsys) -> None:
    """No ``data_dir`` in the config, or one that does not exist: one ``error:`` line naming it, exit 2."""
    config = tmp_path / "no_data_dir.yaml"
    config.write_text(
        "model:\n  class_path: fastdata_examples.classifier.ImageClassifier\n"
        "data:\n  class_path: lightning_fastdata.FastImageDataModule\n"
    )
    assert main(["fit", "--config", str(config)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: `data.init_args.data_dir` is required: set it in the config or pass"), line

    missing = tmp_path / "nope"
    args = ["--data.init_args.data_dir", str(missing), "--data.init_args.cache_dir", str(tmp_path / "cache")]
    args += ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    assert main(["fit", "--config", "examples/configs/cpu.yaml", *args]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: `data_dir` {str(missing)!r} does not exist. Pass an ImageFolder root"), line


@pytest.mark.usefixtures("in_repo")
def test_a_value_of_the_wrong_type_is_one_line_with_the_reason(tmp_path: Path, capsys) -> None:
    """A value jsonargparse rejects, or a misspelled class_path: one line that keeps the reason, exit 2."""
    config = tmp_path / "typo.yaml"
    config.write_text("model:\n  class_path: fastdata_examples.classifier.ImageClassifer\n")
    hint = " (`lightning-fastdata fit --help` lists every option)"
    cases = [
        (["--data.init_args.batch_size", "abc"], "`data.init_args.batch_size`: expected an int, got 'abc'" + hint),
        (
            ["--data.init_args.engine", "thread"],
            "`data.init_args.engine`: expected one of 'auto', 'threads', 'processes', got 'thread'" + hint,
        ),
        (
            ["--data.init_args.num_workers", "x"],
            "`data.init_args.num_workers`: expected an int or one of 'auto', 'tune', got 'x'" + hint,
        ),
        (
            ["--config", str(config)],
            "`model.class_path` 'fastdata_examples.classifier.ImageClassifer': module 'fastdata_examples.classifier'"
            " has no attribute 'ImageClassifer'; did you mean `fastdata_examples.classifier.ImageClassifier`?",
        ),
    ]
    for extra, expected in cases:
        assert main(["fit", "--config", "examples/configs/cpu.yaml", *extra]) == 2
        assert _one_error_line(capsys.readouterr().err) == f"error: {expected}"


@pytest.mark.usefixtures("in_repo")
def test_a_value_the_datamodule_rejects_is_one_line(capsys) -> None:
    """``val_fraction 2`` or ``image_size 0`` parse but fail ``__init__``: its message in one line, exit 2."""
    cases = [
        (["--data.init_args.val_fraction", "2"], "`val_fraction` must be in [0, 1), got 2.0."),
        (["--data.init_args.image_size", "0"], "`image_size` (0) and `batch_size` (32) must be >= 1."),
    ]
    for extra, expected in cases:
        assert main(["fit", "--config", "examples/configs/cpu.yaml", *extra]) == 2
        assert _one_error_line(capsys.readouterr().err) == f"error: {expected}"


@pytest.mark.usefixtures("in_repo")
def test_test_without_a_test_split_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``test`` on data without a ``test/`` split: one line naming the database and its splits, exit 2."""
    (tmp_path / "tiny_model.py").write_text(
        "from fastdata_examples.classifier import ImageClassifier\n\n\n"
        "class Tested(ImageClassifier):\n    def test_step(self, batch, batch_idx):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    images = make_image_folder(
        tmp_path / "images", num_classes=2, train_per_class=2, val_per_class=1, min_size=40, max_size=48, num_workers=1
    )
    args = ["--model", "tiny_model.Tested", "--data.init_args.data_dir", str(images)]
    args += ["--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path / "out")]
    args += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    assert main(["test", "--config", "examples/configs/cpu.yaml", *args]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.fullmatch(
        r"error: '.*\.lmdb' has no test split; it holds \['train', 'val'\]\. Put test images in `test/<class>/`"
        r" \(or `testing/`\) beside `train/` under `data_dir`, then run again\.",
        line,
    ), line


@pytest.mark.usefixtures("in_repo")
def test_a_misspelled_trainer_key_in_a_config_names_the_nearest_key(tmp_path: Path, capsys) -> None:
    """``trainer: {max_epoch: 2}`` in a config: one line naming ``trainer.max_epochs``, exit 2."""
    config = tmp_path / "trainer.yaml"
    config.write_text("trainer:\n  max_epoch: 2\n")
    assert main(["fit", "--config", "examples/configs/cpu.yaml", "--config", str(config)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == "error: unknown key `trainer.max_epoch`; did you mean `trainer.max_epochs`?"


@pytest.mark.usefixtures("in_repo")
def test_prepare_data_per_node_is_a_cli_argument() -> None:
    """`--data.prepare_data_per_node false` reaches the attribute Lightning reads to pick who prepares the data."""
    config = ["--config", "examples/configs/cpu.yaml"]
    assert lightning_cli(config, run=False).datamodule.prepare_data_per_node is True
    cli = lightning_cli([*config, "--data.prepare_data_per_node", "false"], run=False)
    assert cli.datamodule.prepare_data_per_node is False


@pytest.mark.usefixtures("in_repo")
def test_max_pixels_is_a_cli_argument_that_reaches_the_datasets(database: Path) -> None:
    """`--data.max_pixels N` reaches the DataModule and the datasets it builds, which refuse larger images."""
    config = ["--config", "examples/configs/cpu.yaml", "--data.data_dir", str(database)]
    assert lightning_cli(config, run=False).datamodule.max_pixels == DEFAULT_MAX_PIXELS
    cli = lightning_cli([*config, "--data.max_pixels", "100"], run=False)
    dataset = cli.datamodule.build_dataset("train", None)
    assert dataset.max_pixels == 100
    with pytest.raises(CorruptRecordError, match=r"split 'train' index 0 of .*over `max_pixels` \(100\)"):
        dataset[0]
    assert FastImageDataModule(str(database), max_pixels=None).build_dataset("train", None)[0][0].ndim == 3
    with pytest.raises(InvalidArgumentError, match="`max_pixels` must be >= 1 or None"):
        FastImageDataModule(str(database), max_pixels=0)


@pytest.mark.usefixtures("in_repo")
def test_image_size_schedule_is_a_cli_argument(database: Path, tmp_path: Path) -> None:
    """`image_size_schedule` from a YAML config or the command line: epochs and sizes as ints, applied per epoch."""
    config = tmp_path / "fixres.yaml"
    config.write_text("data:\n  init_args:\n    image_size: 48\n    image_size_schedule: {0: 32, 3: 48}\n")
    base = ["--config", "examples/configs/cpu.yaml", "--data.data_dir", str(database), "--trainer.logger", "false"]
    dm = lightning_cli([*base, "--config", str(config)], run=False).datamodule
    assert dm.image_size_schedule == {0: 32, 3: 48}
    args = ["--data.image_size", "24", "--data.image_size_schedule", "{0: 16, 1: 24}", "--data.batch_size", "4"]
    dm = lightning_cli([*base, *args], run=False).datamodule
    assert (dm.image_size, dm.image_size_schedule) == (24, {0: 16, 1: 24})
    loader = dm.train_dataloader()
    sizes = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        sizes.append(next(iter(loader))[0].shape[-1])  # the example's jitter wraps the crop: resized too
    assert sizes == [16, 24]
    assert dm.val_dataset[0][0].shape == (3, 24, 24)


@pytest.mark.usefixtures("in_repo")
def test_fit_a_multilabel_list_file_from_the_command_line(tmp_path: Path) -> None:
    """``lightning-fastdata fit --data.data_dir tags.csv --data.targets multilabel --data.return_index true``: the
    list converts as multi-label, the saved hyperparameters hold both, and the tagger trains on its batches."""
    from fastdata_examples.multilabel_tagger import make_tagged_images

    listing = make_tagged_images(tmp_path / "tags", 24)
    out = tmp_path / "out"
    code = main(
        [
            "fit",
            "--model", "fastdata_examples.multilabel_tagger.Tagger", "--model.num_classes", "4",
            "--data", "FastImageDataModule", "--data.data_dir", str(listing), "--data.targets", "multilabel",
            "--data.return_index", "true", "--data.cache_dir", str(tmp_path / "cache"), "--data.image_size", "32",
            "--data.batch_size", "8", "--data.num_workers", "0", "--data.short_side", "0",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out),
            "--trainer.logger", "false",
        ]
    )  # fmt: skip
    assert code == 0
    (checkpoint,) = sorted(out.rglob("*.ckpt"))
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2
    assert saved["datamodule_hyper_parameters"]["targets"] == "multilabel"
    assert saved["datamodule_hyper_parameters"]["return_index"] is True
    (database,) = [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".lmdb"]
    assert FastImageDataModule(str(database)).target_kind == "multilabel"


@pytest.mark.usefixtures("in_repo")
def test_dino_views_parse_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DINO `views` spec in YAML, with its per-view colour, parses into view groups, and the DataModule sorts them,
    counts its views and gives each view its group's probabilities."""
    config = tmp_path / "dino.yaml"
    config.write_text(
        "model:\n  class_path: fastdata_examples.classifier.ImageClassifier\n"
        "data:\n  class_path: lightning_fastdata.FastImageDataModule\n  init_args:\n    data_dir: x\n    views:\n"
        "      - {size: 96, count: 6, scale: [0.05, 0.4], blur_p: 0.5}\n"
        "      - {size: 224, scale: [0.4, 1.0], flip: 0.5, blur_p: 1.0}\n"
        "      - {size: 224, scale: [0.4, 1.0], blur_p: 0.1, solarize_p: 0.2}\n"
        "    color_jitter: [0.4, 0.4, 0.2, 0.1]\n    grayscale_p: 0.2\n"
    )
    views = _parse(monkeypatch, "--config", str(config)).data.init_args.views
    assert [(v.size, v.count, tuple(v.scale), v.blur_p) for v in views] == [
        (96, 6, (0.05, 0.4), 0.5),
        (224, 1, (0.4, 1.0), 1.0),
        (224, 1, (0.4, 1.0), 0.1),
    ]
    monkeypatch.undo()  # instantiated for real this time
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])
    dm = lightning_cli(["--config", str(config), "--trainer.logger=false"], run=False).datamodule
    assert dm.views == (
        ViewGroup(224, 1, (0.4, 1.0), blur_p=1.0),
        ViewGroup(224, 1, (0.4, 1.0), blur_p=0.1, solarize_p=0.2),
        ViewGroup(96, 6, (0.05, 0.4), blur_p=0.5),
    )
    assert (dm.num_large_views, dm.num_small_views) == (2, 6)
    # per view: (jitter, grayscale, blur, solarize) probabilities, the DataModule's where a group sets none
    color = dm.augment_plan.color
    assert color is not None
    assert color.view_probabilities == ((0.8, 0.2, 1.0, 0.0), (0.8, 0.2, 0.1, 0.2)) + ((0.8, 0.2, 0.5, 0.0),) * 6
