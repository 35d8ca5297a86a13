"""Tests for ``lightning_fastdata.presets``: the dicts, real Trainers built from them, and LightningCLI defaults."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from fakes import hide_cuda
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.utils.data import DataLoader, TensorDataset

import lightning_fastdata
from lightning_fastdata import presets
from lightning_fastdata.cli import lightning_cli
from lightning_fastdata.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]

#: what `ddp()` always asks DDP for
THROUGHPUT_KWARGS = {"gradient_as_bucket_view": True, "find_unused_parameters": False}


@pytest.fixture
def info(monkeypatch: pytest.MonkeyPatch) -> Mock:
    """The presets' ``rank_zero_info``, recording its calls."""
    mock = Mock()
    monkeypatch.setattr(presets, "rank_zero_info", mock)
    return mock


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without CUDA, wherever the tests run: for the presets and for the Trainer's ``accelerator="auto"``."""
    hide_cuda(monkeypatch)


@pytest.fixture
def with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with CUDA, as far as ``accelerator="auto"`` can tell (nothing is built on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _trainer(**kwargs: Any) -> Trainer:
    """A quiet Trainer from preset keyword arguments."""
    return Trainer(
        **kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )


# ----------------------------------------------------------------------------------------------------------------
# mixed_precision
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_cuda")
def test_mixed_precision_on_cpu_is_full_precision_and_says_why(info: Mock) -> None:
    """Without CUDA: ``32-true`` on the CPU, and one info line that explains it."""
    assert presets.mixed_precision() == {"precision": "32-true"}
    info.assert_called_once()
    message = info.call_args.args[0]
    assert "32-true" in message
    assert "CUDA" in message
    assert "bf16-mixed" in message  # and what to do on a CPU with bfloat16 units


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_mixed_precision_on_gpu_is_16_mixed(accelerator: str, info: Mock) -> None:
    """Asking for a GPU gives ``16-mixed`` on that accelerator, silently (even where CUDA is not detected)."""
    assert presets.mixed_precision(accelerator) == {"accelerator": accelerator, "precision": "16-mixed"}  # type: ignore[arg-type]
    info.assert_not_called()


@pytest.mark.usefixtures("with_cuda")
def test_mixed_precision_auto_follows_cuda(info: Mock) -> None:
    """``"auto"`` picks the GPU when CUDA is available; ``"cpu"`` stays on the CPU regardless."""
    assert presets.mixed_precision() == {"precision": "16-mixed"}
    assert presets.mixed_precision("auto") == {"accelerator": "gpu", "precision": "16-mixed"}
    info.assert_not_called()
    assert presets.mixed_precision("cpu") == {"accelerator": "cpu", "precision": "32-true"}
    info.assert_called_once()


# ----------------------------------------------------------------------------------------------------------------
# ddp and fast_gpu
# ----------------------------------------------------------------------------------------------------------------


def _ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The DistributedDataParallel arguments of a strategy (no public accessor exists)."""
    return strategy._ddp_kwargs


@pytest.mark.usefixtures("no_cuda")
def test_ddp_on_cpu_names_the_registered_throughput_strategy() -> None:
    """``ddp(devices=2)``: the registered ``ddp_fastdata`` strategy, and only what was asked for."""
    kwargs = presets.ddp(devices=2)
    assert kwargs == {"devices": 2, "strategy": presets.DDP_STRATEGY}
    assert presets.ddp(devices=2, accelerator="auto")["accelerator"] == "cpu"
    assert presets.DDP_STRATEGY in StrategyRegistry
    strategy = StrategyRegistry.get(presets.DDP_STRATEGY)
    assert isinstance(strategy, DDPStrategy)
    assert _ddp_kwargs(strategy) == {**THROUGHPUT_KWARGS, "static_graph": False}


@pytest.mark.usefixtures("no_cuda")
def test_ddp_static_graph_and_nodes() -> None:
    """``static_graph`` picks the static registration; ``num_nodes`` passes through."""
    kwargs = presets.ddp(devices=4, num_nodes=3, static_graph=True, accelerator="cpu")
    assert kwargs["num_nodes"] == 3
    assert kwargs["devices"] == 4
    assert kwargs["strategy"] == presets.DDP_STATIC_STRATEGY
    assert _ddp_kwargs(StrategyRegistry.get(kwargs["strategy"])) == {**THROUGHPUT_KWARGS, "static_graph": True}


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize(("accelerator", "expected"), [("gpu", "gpu"), ("cuda", "cuda")])
def test_ddp_on_gpu_names_the_gpu(accelerator: str, expected: str) -> None:
    """An explicit GPU accelerator passes through."""
    kwargs = presets.ddp(devices=2, accelerator=accelerator)  # type: ignore[arg-type]
    assert kwargs["accelerator"] == expected
    assert kwargs["strategy"] == presets.DDP_STRATEGY


@pytest.mark.usefixtures("with_cuda")
def test_ddp_auto_follows_cuda() -> None:
    """``accelerator="auto"`` means the GPU where CUDA is available; left out, the Trainer's own "auto" decides."""
    kwargs = presets.ddp(devices="auto", accelerator="auto")
    assert kwargs["accelerator"] == "gpu"
    assert kwargs["devices"] == "auto"
    assert presets.ddp() == {"strategy": presets.DDP_STRATEGY}


@pytest.mark.parametrize("num_nodes", [0, -1])
def test_ddp_without_nodes_raises(num_nodes: int) -> None:
    """At least one node."""
    with pytest.raises(ValueError, match="`num_nodes`"):
        presets.ddp(num_nodes=num_nodes)


def test_registered_strategies_build_a_new_strategy_each_time() -> None:
    """Strategies hold per-run state, so two Trainers never share one."""
    assert StrategyRegistry.get(presets.DDP_STRATEGY) is not StrategyRegistry.get(presets.DDP_STRATEGY)


def test_importing_presets_twice_does_not_re_register() -> None:
    """Reloading the module keeps one registration (no "already present" error)."""
    import importlib

    importlib.reload(presets)
    assert presets.DDP_STRATEGY in StrategyRegistry


@pytest.mark.usefixtures("no_cuda")
def test_fast_gpu_on_cpu_degrades_and_says_so(info: Mock) -> None:
    """Without CUDA, ``fast_gpu`` is DDP in full precision on the CPU, with the info line."""
    kwargs = presets.fast_gpu(devices=2)
    assert kwargs == {"devices": 2, "strategy": presets.DDP_STRATEGY, "precision": "32-true"}
    info.assert_called_once()


@pytest.mark.usefixtures("with_cuda")
def test_fast_gpu_on_cuda(info: Mock) -> None:
    """With CUDA: every GPU of each node, DDP, ``16-mixed``."""
    kwargs = presets.fast_gpu(num_nodes=2, static_graph=True)
    assert "accelerator" not in kwargs  # the Trainer's "auto" picks the GPU
    assert "devices" not in kwargs  # the Trainer's "auto": every GPU
    assert kwargs["num_nodes"] == 2
    assert kwargs["precision"] == "16-mixed"
    assert kwargs["strategy"] == presets.DDP_STATIC_STRATEGY
    info.assert_not_called()


# ----------------------------------------------------------------------------------------------------------------
# Real Trainers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_cuda")
def test_trainer_from_mixed_precision_on_cpu() -> None:
    """``Trainer(**mixed_precision())`` builds on the CPU in full precision."""
    trainer = _trainer(**presets.mixed_precision())
    assert trainer.precision == "32-true"
    assert isinstance(trainer.accelerator, CPUAccelerator)


@pytest.mark.usefixtures("no_cuda")
def test_trainer_from_ddp_on_cpu() -> None:
    """``Trainer(**ddp(devices=2))`` builds the throughput DDPStrategy on two CPU processes (none launched yet)."""
    trainer = _trainer(**presets.ddp(devices=2))
    assert isinstance(trainer.strategy, DDPStrategy)
    assert _ddp_kwargs(trainer.strategy) == {**THROUGHPUT_KWARGS, "static_graph": False}
    assert trainer.num_devices == 2
    assert trainer.world_size == 2
    assert isinstance(trainer.accelerator, CPUAccelerator)


@pytest.mark.usefixtures("no_cuda")
def test_trainer_from_fast_gpu_on_cpu() -> None:
    """``Trainer(**fast_gpu(devices=2))`` builds on a machine without CUDA."""
    trainer = _trainer(**presets.fast_gpu(devices=2))
    assert trainer.precision == "32-true"
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2


@pytest.mark.usefixtures("no_cuda")
def test_presets_combine_with_the_callers_own_trainer_arguments() -> None:
    """``Trainer(accelerator="cpu", **preset(...))`` builds: a preset does not set what the caller did not ask for."""
    trainer = _trainer(accelerator="cpu", **presets.ddp(devices=2))
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2
    trainer = _trainer(accelerator="cpu", devices=2, num_nodes=1, **presets.fast_gpu())
    assert trainer.precision == "32-true"
    assert trainer.num_devices == 2
    trainer = _trainer(accelerator="cpu", **presets.mixed_precision())
    assert isinstance(trainer.accelerator, CPUAccelerator)


@pytest.mark.usefixtures("no_cuda")
def test_trainer_arguments_passed_to_a_preset_win_over_its_choices(info: Mock) -> None:
    """Any Trainer argument passed to a preset is returned as given, over the preset's own value."""
    kwargs = presets.fast_gpu(devices=2, accelerator="cpu", precision="bf16-mixed", max_epochs=3)
    assert kwargs == {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": presets.DDP_STRATEGY,
        "precision": "bf16-mixed",
        "max_epochs": 3,
    }
    info.assert_not_called()  # no "32-true because no CUDA" line when the caller chose the precision
    trainer = _trainer(**presets.ddp(devices=2, accelerator="cpu", max_epochs=3))
    assert trainer.max_epochs == 3
    assert isinstance(trainer.strategy, DDPStrategy)


def test_gpu_presets_name_a_gpu() -> None:
    """The GPU dicts (not buildable into a Trainer here) ask for the GPU and 16-mixed."""
    assert presets.mixed_precision("gpu") == {"accelerator": "gpu", "precision": "16-mixed"}
    assert presets.ddp(accelerator="gpu")["accelerator"] == "gpu"


# ----------------------------------------------------------------------------------------------------------------
# LightningCLI trainer_defaults
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so the configs' `fastdata_examples.*` class paths import (sys.path is restored)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "argv", ["lightning-fastdata"])  # pytest's own arguments are not the CLI's


@pytest.mark.usefixtures("in_repo", "no_cuda")
def test_mixed_precision_as_cli_trainer_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset dict is LightningCLI ``trainer_defaults``: the CPU config gets its precision from it."""
    monkeypatch.setattr(LightningCLI, "instantiate_classes", lambda self: None)
    cli = lightning_cli(
        ["--config", "examples/configs/cpu.yaml"], run=False, trainer_defaults=presets.mixed_precision("gpu")
    )
    assert cli.config.trainer.precision == "16-mixed"  # from the preset: cpu.yaml sets no precision
    assert cli.config.trainer.accelerator == "cpu"  # the config file overrides the defaults


@pytest.mark.usefixtures("in_repo", "no_cuda")
def test_ddp_as_cli_trainer_defaults() -> None:
    """``LightningCLI(..., trainer_defaults=presets.ddp(devices=2))`` parses and builds a DDP Trainer."""
    cli = lightning_cli(
        ["--config", "examples/configs/cpu.yaml", "--trainer.devices", "2", "--trainer.logger", "false"],
        run=False,
        trainer_defaults=presets.ddp(devices=2),
    )
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.num_devices == 2
    assert _ddp_kwargs(cli.trainer.strategy) == {**THROUGHPUT_KWARGS, "static_graph": False}


# ----------------------------------------------------------------------------------------------------------------
# ResumeCheckpoint
# ----------------------------------------------------------------------------------------------------------------


class _Steps(LightningModule):
    """A linear model on 16 random rows in batches of 2 (8 steps an epoch) that counts the steps it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.trained = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained += 1
        return self.layer(batch[0]).pow(2).mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_with_resume_checkpoint(root: Path, max_steps: int, **fit: Any) -> tuple[Trainer, _Steps]:
    """Fit ``_Steps`` with a ``ResumeCheckpoint(every_n_train_steps=3)`` and a versioned CSVLogger under ``root``."""
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        default_root_dir=root,
        logger=CSVLogger(root),
        callbacks=[presets.ResumeCheckpoint(every_n_train_steps=3)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = _Steps()
    trainer.fit(model, **fit)
    return trainer, model


def _saved_step(root: Path) -> int:
    """The step of ``last.ckpt``, loaded as Lightning loads it (``weights_only=True``)."""
    return int(torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["global_step"])


def test_resume_checkpoint_saves_last_every_n_steps_in_one_folder_across_logger_versions(tmp_path: Path) -> None:
    """``last.ckpt`` every 3 steps in ``<default_root_dir>/checkpoints``, which the next run (a new logger version)
    finds with ``ckpt_path="last"``: it trains on from where the first stopped, not from 0."""
    first, _ = _fit_with_resume_checkpoint(tmp_path, max_steps=5)
    assert first.logger is not None
    assert first.logger.version == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]  # save_top_k=0
    second, model = _fit_with_resume_checkpoint(tmp_path, max_steps=10, ckpt_path="last")
    assert second.logger is not None
    assert second.logger.version == 1
    assert model.trained == 5  # steps 6 to 10
    assert second.global_step == 10
    assert _saved_step(tmp_path) == 10


def test_resume_checkpoint_saves_the_end_of_a_fit_and_a_rerun_says_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fit of 7 steps saved every 3 ends with ``last.ckpt`` at step 7, not 6; the same command again restores it,
    trains nothing and says the fit is complete; raising ``max_steps`` trains on from 7."""
    monitor_infos: list[str] = []
    monkeypatch.setattr(presets, "rank_zero_info", lambda message, *a, **k: monitor_infos.append(message))
    _fit_with_resume_checkpoint(tmp_path, max_steps=7, ckpt_path="last")
    assert _saved_step(tmp_path) == 7
    _, again = _fit_with_resume_checkpoint(tmp_path, max_steps=7, ckpt_path="last")
    assert again.trained == 0
    assert _saved_step(tmp_path) == 7
    said = [line for line in monitor_infos if line.startswith("ResumeCheckpoint:")]
    assert len(said) == 1
    assert "is the end of a completed fit (max_steps=7, step 7): this run trained nothing" in said[0]
    _, more = _fit_with_resume_checkpoint(tmp_path, max_steps=9, ckpt_path="last")
    assert more.trained == 2
    assert _saved_step(tmp_path) == 9
    assert len([line for line in monitor_infos if line.startswith("ResumeCheckpoint:")]) == 1


def test_resume_checkpoint_takes_an_explicit_folder(tmp_path: Path) -> None:
    """``dirpath`` wins over the default folder."""
    callback = presets.ResumeCheckpoint(every_n_train_steps=2, dirpath=str(tmp_path / "mine"))
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Steps())
    assert (tmp_path / "mine" / "last.ckpt").is_file()
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("every", [0, -5])
def test_resume_checkpoint_rejects_a_step_interval_below_one(every: int) -> None:
    """``every_n_train_steps`` below 1 is refused, naming the argument and the value."""
    with pytest.raises(InvalidArgumentError, match=rf"`every_n_train_steps` must be an int >= 1, got {every}"):
        presets.ResumeCheckpoint(every_n_train_steps=every)


@pytest.mark.usefixtures("in_repo", "no_cuda")
def test_resume_checkpoint_from_the_command_line() -> None:
    """``--trainer.callbacks+=lightning_fastdata.ResumeCheckpoint`` builds it with the options given after it."""
    cli = lightning_cli(
        [
            "--config",
            "examples/configs/cpu.yaml",
            "--trainer.logger",
            "false",
            "--trainer.callbacks+=lightning_fastdata.ResumeCheckpoint",
            "--trainer.callbacks.every_n_train_steps=7",
        ],
        run=False,
    )
    # the class the package exports (`test_importing_presets_twice_does_not_re_register` reloads `presets`)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, lightning_fastdata.ResumeCheckpoint)]
    assert callback.save_last is True
    assert callback.save_top_k == 0
    assert callback._every_n_train_steps == 7
    assert cli.trainer.checkpoint_callback is callback  # Lightning adds no default ModelCheckpoint beside it
