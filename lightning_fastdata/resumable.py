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
epoch's order only when its first batch is asked for (see :meth:`ResumableLoader.__iter__`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from lightning_fastdata.prefetch import DevicePrefetchLoader


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


class ResumableLoader(DevicePrefetchLoader):
    """A training DataLoader whose position within the epoch is saved in checkpoints and restored on resume.

    Needs a :class:`ResumableSampler`; with any other sampler it behaves as :class:`DevicePrefetchLoader` and saves
    no state. Batches are counted as they are handed to the training loop (after any device look-ahead), so a
    checkpoint taken after batch ``k`` resumes with batch ``k + 1``.

    Args:
        *args: the arguments of :class:`~lightning_fastdata.DevicePrefetchLoader`.
        limit_batches: the Trainer's ``limit_train_batches``: an epoch that handed out this many batches (an int, or
            a share of ``len()`` as a float) was complete, so resuming from it starts the next epoch.
        **kwargs: the keyword arguments of :class:`~lightning_fastdata.DevicePrefetchLoader`.

    """

    def __init__(self, *args: Any, limit_batches: int | float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_batches = limit_batches
        self._handed_out = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """Iterate the epoch, counting the batches handed out; the epoch's order is drawn at its first batch."""
        if not isinstance(self.sampler, ResumableSampler):
            return super().__iter__()
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        # A generator: nothing below runs until the first batch is asked for. Lightning creates the iterator before it
        # calls `set_epoch` (for the first epoch of a fit, and of a fit resumed from an end-of-epoch checkpoint, where
        # it does not call `load_state_dict` either), and DataLoader workers draw their indices as soon as the
        # DataLoader's own iterator exists. Drawn here, the order is that of the epoch the sampler is set to when
        # training really starts, whoever set it and in whatever order.
        batches = super().__iter__()
        self._handed_out, self._resume_at = self._resume_at, 0
        for batch in batches:
            self._handed_out += 1
            yield batch

    def batches_per_epoch(self) -> int:
        """The batches the training loop takes from an epoch: ``len()`` cut by ``limit_batches``, as Lightning does."""
        if isinstance(self.limit_batches, int):
            return min(len(self), self.limit_batches)
        return int(len(self) * self.limit_batches)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: epoch, batches handed out, and what the order depends on."""
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):
            return {}
        return {
            "epoch": sampler.epoch,
            "batches": self._handed_out,
            "batch_size": self.batch_size,
            "num_samples": sampler.num_samples,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch after its last handed-out batch (or start the next one if it was complete)."""
        sampler = self.sampler
        if not state or not isinstance(sampler, ResumableSampler):
            return
        expected = {
            "batch_size": self.batch_size,
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
            return
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= self.batches_per_epoch():  # the epoch was complete: the next one starts from its beginning
            sampler.set_epoch(epoch + 1)
            return
        sampler.set_epoch(epoch)  # before the iterator exists, which reads the sampler (at once, with workers)
        sampler.skip = batches * int(self.batch_size or 1)
        self._resume_at = batches
