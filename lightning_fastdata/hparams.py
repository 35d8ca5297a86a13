"""The DataModule's saved arguments beside the model's: the names Lightning would refuse to merge for the loggers.

Lightning merges the model's and the DataModule's hyperparameters for the loggers and stops the run on a name both
saved with different values (``Error while merging hparams``). :func:`clashes` finds those names, :func:`for_loggers`
renames the DataModule's to ``datamodule/<name>``, and :func:`say_clashes` warns once per clash
(``FastImageDataModule.hparams_initial`` and ``hparams_clashes``).

Every argument stays saved under its own name (``hparams``, and the checkpoint's ``datamodule_hyper_parameters``), so
``load_from_checkpoint`` and LightningCLI rebuild the DataModule as it was; only the loggers get the renamed one,
beside the model's. A name both saved with the same value (``image_size=224`` in both) is logged once.

Lightning loads checkpoints with ``torch.load(weights_only=True)``, which refuses every class it does not know: a
``ViewGroup``, a ``pathlib.Path``, an enum. :func:`plain` saves each argument as the plain value that the constructor
takes back (a mapping, a string, the enum's value), and :func:`refused_by_weights_only` names what still would not load.
A URL ``data_dir`` is saved without its credentials and signed query (:func:`redacted`).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import inspect
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fastdata.store import remote

#: the prefix under which loggers get a saved argument that the model also saved, with another value
HPARAMS_PREFIX = "datamodule/"


_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))


def redacted(data_dir: Any) -> str | None:
    """``data_dir`` as saved when it is a URL that carries credentials or a signed query (and says so), else ``None``.

    The loggers' hyperparameters and the checkpoints never hold a URL's secrets.
    """
    shown = remote.redact_url(data_dir) if isinstance(data_dir, str) else data_dir
    if shown == data_dir:
        return None
    rank_zero_info(
        f"`data_dir` {shown!r} carries credentials or a signed query: they are left out of the saved"
        " hyperparameters and checkpoints (pass `data_dir` again to load from one)."
    )
    return shown


def plain(value: Any) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` reads back and the DataModule's constructor takes again.

    A dataclass becomes the mapping of its fields (``ViewGroup(96, count=6)`` -> ``{"size": 96, "count": 6, ...}``), a
    path its string, an enum its value, a named tuple a tuple, a NumPy scalar or array a number or list, a subclass of
    ``str``/``int``/``float`` the plain type; lists, tuples, sets and mappings are converted item by item. Tensors,
    dtypes and devices load as they are. Anything else is returned unchanged (:func:`refused_by_weights_only`).
    """
    if type(value) in _PRIMITIVES or isinstance(value, (torch.Tensor, torch.dtype, torch.device)):
        return value
    if isinstance(value, enum.Enum):  # before the str/int subclasses: `class Mode(str, Enum)` is one of them
        return plain(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    for kind in _PRIMITIVES[:-1]:  # a subclass of a primitive pickles as its own class
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):  # a named tuple too: its class would not load
        return tuple(plain(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return {plain(item) for item in value}
    return value


def _loadable(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back, by type: nothing is pickled to find out.

    Primitives, tensors, dtypes and devices, in lists, tuples, sets and dicts.
    """
    kind = type(value)
    if kind in _PRIMITIVES or kind in (torch.Tensor, torch.nn.Parameter, torch.dtype, torch.device):
        return True
    if kind in (list, tuple, set):
        return all(_loadable(item) for item in value)
    if kind in (dict, collections.OrderedDict):
        return all(_loadable(key) and _loadable(item) for key, item in value.items())
    return False


def refused_by_weights_only(hparams: Mapping[str, Any]) -> list[str]:
    """The names of ``hparams`` whose values ``torch.load(weights_only=True)`` would refuse, sorted."""
    return sorted(name for name, value in hparams.items() if not _loadable(value))


#: the (class, argument names) already warned about as not loading from a checkpoint
_WARNED_UNLOADABLE: set[tuple[Any, ...]] = set()


def warn_unloadable(owner: type, saved: Mapping[str, Any]) -> None:
    """Warn once per class and arguments when ``owner``'s ``saved`` arguments would not load from a checkpoint."""
    refused = refused_by_weights_only(saved)
    if not refused or (owner, *refused) in _WARNED_UNLOADABLE:
        return
    _WARNED_UNLOADABLE.add((owner, *refused))
    found = ", ".join(f"`{name}` ({type(saved[name]).__name__})" for name in refused)
    rank_zero_warn(
        f"{owner.__name__}: the saved argument(s) {found} would not load from a checkpoint: Lightning"
        " loads checkpoints with `torch.load(weights_only=True)`, which refuses their classes, so"
        " `fit(ckpt_path=...)` and `load_from_checkpoint` would fail. Pass plain values (numbers, strings,"
        " lists, mappings, paths, dataclasses, enums), or leave an argument out of the checkpoint with"
        " `self.hparams.pop(name)` after `super().__init__(...)` (then pass it again when loading)."
    )


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


class PlainHparamsDataModule(LightningDataModule):
    """A LightningDataModule whose saved arguments load back from a checkpoint and reach the loggers beside the model's.

    ``FastImageDataModule``'s base: :meth:`save_hyperparameters` saves each value in its plain form (:func:`plain`),
    :attr:`hparams_initial` renames for the loggers a name the model saved with another value (:func:`for_loggers`).
    """

    @override
    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: types.FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """As Lightning's, with every value saved in the plain form a checkpoint loads back (:func:`plain`).

        Lightning loads checkpoints with ``torch.load(weights_only=True)``: a ``ViewGroup`` is saved as its mapping, a
        ``Path`` as its string, an enum as its value, which the constructor takes again, so ``fit(ckpt_path=...)`` and
        ``load_from_checkpoint`` rebuild this DataModule (and a subclass's own arguments). A value that still would not
        load warns, naming its argument.
        """
        if frame is None:  # the caller's: Lightning collects the constructor's arguments from it
            current = inspect.currentframe()
            frame = current.f_back if current is not None else None
        super().save_hyperparameters(*args, ignore=ignore, frame=frame, logger=logger)
        saved = dict(self.hparams)
        converted = {name: plain(value) for name, value in saved.items()}
        if any(converted[name] is not saved[name] for name in saved):
            self.hparams.update(converted)
            # the frozen copy `hparams_initial` reads, made as Lightning's `save_hyperparameters` makes it (no setter)
            self._hparams_initial = copy.deepcopy(self._hparams)
        warn_unloadable(type(self), converted)

    @property
    @override
    def hparams_initial(self) -> AttributeDict:
        """The saved arguments as the loggers get them: one the model saved too, with another value, is renamed.

        It reaches the loggers as ``datamodule/<name>``, and :meth:`setup` says so (:mod:`lightning_fastdata.hparams`).
        """
        return for_loggers(super().hparams_initial, self.hparams_clashes())

    def hparams_clashes(self) -> dict[str, tuple[Any, Any]]:
        """The saved arguments Lightning would refuse to merge with the model's: ``{name: (model's, ours)}``."""
        return clashes(self.trainer, super().hparams_initial)
