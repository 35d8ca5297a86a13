"""A training loader's position from a checkpoint one did not make: each damaged state is refused, saying what.

Lightning hands ``FastLoader.load_state_dict`` whatever the checkpoint holds. A state with a field missing, unknown,
of another type or out of its range, or with more batches than an epoch has, is an ``InvalidArgumentError`` that names
the field and its value, says the checkpoint is damaged or another version's and how to go on, and leaves the loader
as it was. Before, ``batches=-3`` gave a 3-batch epoch, ``batches="3"`` and ``seed=0.0`` were taken as the numbers,
and a missing ``epoch`` was a bare ``KeyError``. A state saved for other data is ``test_resume.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_fastdata import FastImageDataModule, InvalidArgumentError
from lightning_fastdata.pipeline import FastLoader
from lightning_fastdata.pipeline.resume import ResumableSampler

#: 22 samples in batches of 4: 6 batches an epoch, the last one partial
N, BATCH, NUM_BATCHES = 22, 4, 6

#: what every refusal of a damaged state says
DAMAGED = "The training loader's position in the checkpoint is damaged, or was saved by another version"


def _loader(epoch: int = 3) -> FastLoader:
    """A resumable loader of items ``(index,)``, seed 0, set to ``epoch``."""
    dataset = TensorDataset(torch.arange(N))
    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return FastLoader(dataset, sampler=sampler, batch_size=BATCH)


def _state(**changes: Any) -> dict[str, Any]:
    """A valid position of :func:`_loader`'s data after 2 batches of epoch 1, with ``changes``."""
    state = {"epoch": 1, "batches": 2, "batch_size": BATCH, "num_samples": N, "seed": 0, "shuffle": True}
    return {**state, **changes}


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in _state().items() if k != key}


def _ids(loader: FastLoader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def _reference(epoch: int) -> list[list[int]]:
    """Epoch ``epoch`` of a plain ``DistributedSampler`` of the same data and seed (independent of the code tested)."""
    dataset = TensorDataset(torch.arange(N))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return [batch[0].tolist() for batch in DataLoader(dataset, sampler=sampler, batch_size=BATCH)]


#: (state, what the message must say): each a state no run of this version wrote
HOSTILE: list[tuple[str, Any, str]] = [
    # batches: counts of handed-out batches, 0 to the 6 an epoch has
    ("negative batches", _state(batches=-3), r"`batches` -3 \(an integer of at least 0\)"),
    ("bool batches", _state(batches=True), r"`batches` True \(an integer of at least 0\)"),
    ("string batches", _state(batches="3"), r"`batches` '3' \(an integer of at least 0\)"),
    ("float batches", _state(batches=2.0), r"`batches` 2\.0 \(an integer"),
    ("None batches", _state(batches=None), r"`batches` None \(an integer"),
    (
        "batches beyond the epoch",
        _state(batches=7),
        r"`batches` 7 trained of epoch 1, more than the 6 an epoch of"
        r" its 22 samples per process in batches of 4 has",
    ),
    ("a huge batches", _state(batches=10**5000), r"`batches` <an integer of 16610 bits> trained of epoch 1"),
    # epoch: 0 up to where seed + epoch + 1 still seeds torch's generator
    ("negative epoch", _state(epoch=-1), rf"`epoch` -1 \(an integer from 0 to {2**63 - 2}\)"),
    ("epoch past the seeds", _state(epoch=2**63), r"`epoch` 9223372036854775808 \(an integer from 0"),
    ("float epoch", _state(epoch=1.5), r"`epoch` 1\.5 \(an integer"),
    ("tensor epoch", _state(epoch=torch.tensor(1)), r"`epoch` tensor\(1\) \(an integer"),
    # the fields the order depends on: compared with the loader's only once they are of their type
    ("float seed equal to the seed", _state(seed=0.0), r"`seed` 0\.0 \(an integer\)"),
    ("string seed", _state(seed="0"), r"`seed` '0' \(an integer\)"),
    ("int shuffle equal to True", _state(shuffle=1), r"`shuffle` 1 \(True or False\)"),
    ("zero batch size", _state(batch_size=0), r"`batch_size` 0 \(an integer of at least 1, or None\)"),
    ("negative batch size", _state(batch_size=-4), r"`batch_size` -4 \(an integer of at least 1"),
    ("negative num_samples", _state(num_samples=-22), r"`num_samples` -22 \(an integer of at least 0\)"),
    ("several bad fields", _state(batches=-3, epoch=-1), r"`epoch` -1 \(.*\); `batches` -3 \("),
    ("a long string, cut", _state(seed="x" * 10_000), r"`seed` 'x{56}\.\.\. \(an integer\)"),
    # the fields themselves: every one a version wrote, none other
    ("missing epoch", _without("epoch"), r"it lacks `epoch` \(a position holds epoch, batches, batch_size"),
    ("missing batches", _without("batches"), r"it lacks `batches`"),
    ("only batches", {"batches": 2}, r"it lacks `epoch`, `batch_size`, `num_samples`, `seed`, `shuffle`"),
    ("an unknown field", _state(rank=0), r"it has 'rank', which this version does not write"),
    ("a field that is no string", _state() | {5: 1}, r"it has 5, which this version does not write"),
    ("missing and unknown", {**_without("seed"), "seeds": 0}, r"it lacks `seed` and it has 'seeds', which"),
    ("many unknown fields", _state() | {f"x{i}": 0 for i in range(9)}, r"'x4' and 4 more, which this version"),
    # the state itself
    ("a list", [_state()], r"it is \[\{'epoch': 1, .*\.\.\., not a mapping of epoch, batches"),
    ("None", None, r"it is None, not a mapping"),
    ("a string", "epoch=1", r"it is 'epoch=1', not a mapping"),
]


@pytest.mark.parametrize(
    ("state", "found"), [(state, found) for _, state, found in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_a_damaged_state_is_refused_and_the_loader_left_as_it_was(state: Any, found: str) -> None:
    """Each damaged state is an `InvalidArgumentError` naming what is wrong and how to go on; nothing is resumed."""
    loader = _loader(epoch=3)
    with pytest.raises(InvalidArgumentError, match=found) as raised:
        loader.load_state_dict(state)
    message = str(raised.value)
    assert message.startswith(DAMAGED)
    assert "start the fit without `ckpt_path`" in message
    assert len(message) < 1000  # a hostile value is cut, not printed whole
    assert loader.sampler.epoch == 3
    assert loader.sampler.skip == 0
    assert _ids(loader) == _reference(3)


@pytest.mark.parametrize(
    ("state", "epoch", "skip", "resumed"),
    [
        (_state(), 1, 2 * BATCH, lambda: _reference(1)[2:]),
        (_state(batches=0), 1, 0, lambda: _reference(1)),
        (_state(batches=NUM_BATCHES), 2, 0, lambda: _reference(2)),  # a complete epoch: the next one
        # NumPy's integers are integers (a state built by code of one's own may hold them)
        (
            {**_state(), "epoch": np.int64(1), "batches": np.int32(2), "seed": np.int64(0)},
            1,
            8,
            lambda: _reference(1)[2:],
        ),
    ],
    ids=["mid-epoch", "no batch yet", "epoch complete", "numpy integers"],
)
def test_a_valid_state_resumes_as_before(state: dict[str, Any], epoch: int, skip: int, resumed: Any) -> None:
    """The checks refuse no state a run writes: each continues where it stopped, as an uninterrupted run would."""
    loader = _loader(epoch=0)
    loader.load_state_dict(state)
    assert loader.sampler.epoch == epoch
    assert loader.sampler.skip == skip
    assert _ids(loader) == resumed()


def test_an_empty_state_and_a_plain_sampler_read_nothing() -> None:
    """`{}` (a loader that saves no position) changes nothing; a loader without a `ResumableSampler` reads no state,
    damaged or not, as before."""
    loader = _loader(epoch=3)
    loader.load_state_dict({})
    assert loader.sampler.epoch == 3
    dataset = TensorDataset(torch.arange(N))
    plain = FastLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0), batch_size=BATCH)
    plain.load_state_dict(_state(batches=-3))
    assert plain.sampler.epoch == 0
    assert _ids(plain) == _reference(0)


class _TinyModel(LightningModule):
    """A linear classifier on the mean colour."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch[:2]
        return F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_fit_from_a_checkpoint_with_a_damaged_position_is_refused(database: Path, tmp_path: Path) -> None:
    """`fit(ckpt_path=...)` from a checkpoint whose loader position says `batches=-3` raises the error to the caller
    (before, the fit went on with a 3-batch epoch); the same checkpoint undamaged resumes."""

    def fit(max_steps: int, ckpt_path: Path | None = None) -> Trainer:
        dm = FastImageDataModule(str(database), image_size=16, batch_size=4, num_workers=0)
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(_TinyModel(), datamodule=dm, ckpt_path=ckpt_path)
        return trainer

    path = tmp_path / "mid-epoch.ckpt"
    fit(2).save_checkpoint(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["batches"] == 2
    state["batches"] = -3
    damaged = tmp_path / "damaged.ckpt"
    torch.save(checkpoint, damaged)
    with pytest.raises(InvalidArgumentError, match=r"damaged.*`batches` -3 \(an integer of at least 0\)"):
        fit(4, damaged)
    assert fit(4, path).global_step == 4
    # the way out a refusal of other data names: the checkpoint without the loader's position resumes
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{}]
    torch.save(checkpoint, damaged)
    assert fit(4, damaged).global_step == 4
