"""Tests for ``lightning_fastdata.plans``: the DataModule's settings as frozen plans, and the modules that take them."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lightning_fastdata import FastImageDataModule

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fastdata"
#: the modules the DataModule hands its work to
BESIDE = ("loaders", "splits", "workers", "resizing", "resolve", "hparams", "database", "arguments")


def test_plans_are_frozen_snapshots_of_the_current_settings() -> None:
    """A plan cannot be changed; a setting changed later (the batch size finder's) is in the next plan taken."""
    dm = FastImageDataModule("unused", image_size=16, image_size_schedule={0: 8, 2: 24}, batch_size=8)
    plan = dm.loader_plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 4  # type: ignore[misc]
    dm.batch_size = 4
    assert (plan.batch_size, dm.loader_plan.batch_size) == (8, 4)
    assert dm.augment_plan.sizes == (16, 8, 24)
    dm.set_image_size(12)
    assert (dm.augment_plan.image_size, dm.image_size) == (16, 12)  # the plan holds the configured size
    assert dm.data_plan.largest_size == 24
    assert (dm.hparams["batch_size"], dm.hparams["image_size"]) == (8, 16)  # what is saved does not move


@pytest.mark.parametrize("module", BESIDE)
def test_no_module_beside_the_datamodule_takes_it_or_writes_its_attributes(module: str) -> None:
    """No parameter named ``dm`` or ``datamodule``, and no assignment to one's attributes."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names = {"dm", "datamodule"}
    taken = [
        f"{node.name}({arg.arg})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args + node.args.kwonlyargs
        if arg.arg in names
    ]
    written = [
        ast.unparse(target)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in names
    ]
    assert (taken, written) == ([], [])


def test_no_function_outside_the_datamodule_takes_it() -> None:
    """Across the package, only the DataModule's own modules have a parameter that is the DataModule."""
    own = {"datamodule.py", "datamodule_data.py", "datamodule_loaders.py"}
    taken = [
        f"{path.relative_to(PACKAGE)}:{node.name}({arg.arg})"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in own
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args + node.args.kwonlyargs
        if arg.arg in {"dm", "datamodule"}
        or (arg.annotation is not None and "FastImageDataModule" in ast.unparse(arg.annotation))
    ]
    assert taken == []
