"""Exact mid-epoch resume: the training loader's position goes into Lightning checkpoints and comes back.

Lightning saves ``state_dict()`` of every training loader that has one (``_Stateful``) into the checkpoint, and on
resume calls ``load_state_dict()`` before it creates the iterator; its own batch counter continues from where the
epoch stopped, while ``len()`` stays the full epoch. So the loader records how many batches it handed out in the
current epoch, and on resume its sampler starts the same epoch's order that many samples in: every rank continues
with exactly the samples it had not yet seen, in the order an uninterrupted run would have used.

The order itself needs no saving: it is a function of ``seed``, the epoch and the rank (``DistributedSampler``).
Under DDP the ranks run in lockstep, so the one state in the checkpoint (rank zero's batch count) is every rank's.

From an end-of-epoch checkpoint (``ModelCheckpoint``'s default, saved in ``on_train_epoch_end``) Lightning does not
restart the epoch: it calls no ``load_state_dict``, sets the sampler to the next epoch with ``set_epoch`` and starts
it from the beginning. It creates the loader's iterator before that ``set_epoch``, though, so the loader draws an
epoch's order only when its first batch is asked for (see
:meth:`~lightning_fastdata.pipeline.factory.FastLoader.__iter__`).

The loader is :class:`~lightning_fastdata.pipeline.factory.FastLoader`, which counts the batches it hands out; this
module holds the sampler and the two halves of the position: :func:`position_state` and :func:`restore_position`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """A seeded ``DistributedSampler`` that can start an epoch part-way through its order.

    ``skip`` samples of this rank's order for the next epoch are left out once, then it is reset.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the epoch, without the first ``skip`` (one-shot)."""
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


def batches_per_epoch(length: int, limit_batches: int | float) -> int:
    """The batches the training loop takes from an epoch of ``length``: cut by ``limit_batches``, as Lightning does."""
    if isinstance(limit_batches, int):
        return min(length, limit_batches)
    return int(length * limit_batches)


def position_state(sampler: Any, batch_size: int | None, handed_out: int) -> dict[str, Any]:
    """The position in the epoch: epoch, batches handed out, and what the order depends on.

    ``{}`` for a sampler other than :class:`ResumableSampler`: nothing to resume.
    """
    if not isinstance(sampler, ResumableSampler):
        return {}
    return {
        "epoch": sampler.epoch,
        "batches": handed_out,
        "batch_size": batch_size,
        "num_samples": sampler.num_samples,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
    }


def restore_position(sampler: Any, state: dict[str, Any], batch_size: int | None, per_epoch: int) -> int | None:
    """Set ``sampler`` to continue the saved epoch after its last handed-out batch.

    An epoch that was complete (``per_epoch`` batches) is followed by the next one, from its beginning. Returns the
    batches already handed out in the epoch that continues, or ``None`` when no epoch continues part-way.
    """
    if not state or not isinstance(sampler, ResumableSampler):
        return None
    expected = {
        "batch_size": batch_size,
        "num_samples": sampler.num_samples,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
    }
    changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
    if changed:
        from lightning.pytorch.utilities import rank_zero_warn  # here: worker processes import this module too

        found = ", ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in changed.items())
        rank_zero_warn(
            f"The training data changed since the checkpoint ({found}), so the resume cannot be exact: epoch"
            f" {state.get('epoch')} restarts from the beginning of its order while the Trainer counts on from"
            f" batch {state.get('batches')}; for the rest of that epoch some samples are seen twice and some not"
            " at all. Later epochs are complete."
        )
        sampler.set_epoch(int(state.get("epoch", 0)))
        return None
    epoch, batches = int(state["epoch"]), int(state["batches"])
    if batches >= per_epoch:  # the epoch was complete: the next one starts from its beginning
        sampler.set_epoch(epoch + 1)
        return None
    sampler.set_epoch(epoch)  # before the iterator exists, which reads the sampler (at once, with workers)
    sampler.skip = batches * int(batch_size or 1)
    return batches
