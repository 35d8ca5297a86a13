"""The DataModule's saved arguments beside the model's: the names Lightning would refuse to merge for the loggers.

Lightning merges the model's and the DataModule's hyperparameters for the loggers and stops the run on a name both
saved with different values (``Error while merging hparams``). :func:`clashes` finds those names, :func:`for_loggers`
renames the DataModule's to ``datamodule/<name>``, and :func:`say_clashes` warns once per clash
(``FastImageDataModule.hparams_initial`` and ``hparams_clashes``).

Every argument stays saved under its own name (``hparams``, and the checkpoint's ``datamodule_hyper_parameters``), so
``load_from_checkpoint`` and LightningCLI rebuild the DataModule as it was; only the loggers get the renamed one,
beside the model's. A name both saved with the same value (``image_size=224`` in both) is logged once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

#: the prefix under which loggers get a saved argument that the model also saved, with another value
HPARAMS_PREFIX = "datamodule/"


def _lightning_differs(a: Any, b: Any) -> bool:
    """Whether Lightning's hyperparameter merge (``_log_hyperparams``) takes ``a`` and ``b`` for different values."""
    if type(a) is not type(b) or (isinstance(a, torch.Tensor) and a is not b):
        return True
    try:
        return bool(a != b)
    except Exception:  # an ambiguous comparison (arrays): take them for different, the safe side for the merge
        return True


def _same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one setting in substance: ``(0.5, 0.5)`` and ``[0.5, 0.5]``, ``1`` and ``1.0``."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(a.eq(b).all())
        )
    try:
        return bool(a == b)
    except Exception:
        return False


def clashes(trainer: Trainer | None, ours: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The saved arguments Lightning would refuse to merge with the Trainer's model's: ``{name: (model's, ours)}``.

    ``ours``: the DataModule's saved arguments. Empty without a Trainer, a model, or hyperparameters the model logs.
    """
    module = getattr(trainer, "lightning_module", None)
    # `_log_hyperparams` is `save_hyperparameters(logger=...)`: no public accessor, and Lightning reads it too
    if not isinstance(module, LightningModule) or not getattr(module, "_log_hyperparams", False):
        return {}
    theirs = module.hparams_initial
    return {
        key: (theirs[key], ours[key])
        for key in sorted(theirs.keys() & ours.keys())
        if key != "_class_path" and _lightning_differs(theirs[key], ours[key])
    }


def for_loggers(hparams: AttributeDict, clashing: Mapping[str, Any]) -> AttributeDict:
    """``hparams`` as the loggers get them: each name in ``clashing`` renamed ``datamodule/<name>``."""
    if not clashing:
        return hparams
    return AttributeDict({(f"{HPARAMS_PREFIX}{k}" if k in clashing else k): v for k, v in hparams.items()})


def say_clashes(
    trainer: Trainer | None,
    clashing: Callable[[], Mapping[str, tuple[Any, Any]]],
    warned: set[tuple[str, str, str]],
) -> None:
    """Warn once per clash that the model and this DataModule saved one name with different values.

    Args:
        trainer: the DataModule's Trainer; nothing is merged without one that has a logger.
        clashing: the DataModule's :func:`clashes`, asked only when there is a logger.
        warned: the clashes warned about so far, ``(name, repr of the model's, repr of ours)``; updated.

    """
    if trainer is None or not getattr(trainer, "loggers", None):  # nothing is merged without a logger
        return
    # one setting as two types ((0.5,) and [0.5]) is renamed too, since Lightning's merge compares types, quietly
    found = {key: values for key, values in clashing().items() if not _same_value(*values)}
    for key, (theirs, ours) in found.items():
        if (key, repr(theirs), repr(ours)) in warned:
            continue
        warned.add((key, repr(theirs), repr(ours)))
        rank_zero_warn(
            f"The model saved `{key}={theirs!r}` and FastImageDataModule `{key}={ours!r}` (which its loaders use):"
            f" loggers get the DataModule's as `{HPARAMS_PREFIX}{key}`. Pass the same value to both if they"
            " should agree."
        )
