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

A checkpoint may come from elsewhere (a colleague's run, another version, a damaged copy), so a saved position is
checked before it is used: every field there, of its type and in its range, and saved for this data and these
settings. What does not fit is refused with what was found, never trusted (``batches=-3`` was a 3-batch epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from numbers import Integral
from typing import Any

from torch.utils.data import DistributedSampler

from lightning_fastdata.errors import InvalidArgumentError

#: the fields of a saved position (:func:`position_state`), each every version has written
_FIELDS = ("epoch", "batches", "batch_size", "num_samples", "seed", "shuffle")
#: the largest epoch a position may name: the sampler seeds its order with ``seed + epoch`` (the next epoch's too),
#: which torch's generators take up to 2**64 - 1
_MAX_EPOCH = 2**63 - 2
#: the fix for a position that cannot be used, said by every refusal
_START_OVER = (
    " Resume from another checkpoint of the run (or with the lightning_fastdata version that saved this one), or start"
    " the fit without `ckpt_path` (take the weights with `YourModel.load_from_checkpoint(path)`)."
)


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


def restore_position(sampler: Any, state: Any, batch_size: int | None, per_epoch: int) -> int | None:
    """Set ``sampler`` to continue the saved epoch after its last handed-out batch.

    An epoch that was complete (``per_epoch`` batches) is followed by the next one, from its beginning. Returns the
    batches already handed out in the epoch that continues, or ``None`` when no epoch continues part-way. An empty
    state (a checkpoint of a loader that saves no position) changes nothing.

    Raises:
        InvalidArgumentError: the state is damaged (a field missing, unknown, of another type or out of its range;
            more batches than an epoch has) or was saved for other data or settings (a ``ValueError``).

    """
    if not isinstance(sampler, ResumableSampler):
        return None  # nothing to resume: the state is not read
    if isinstance(state, Mapping) and not state:
        return None
    _check_position(state)
    expected = {
        "batch_size": batch_size,
        "num_samples": sampler.num_samples,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
    }
    changed = {k: (state[k], v) for k, v in expected.items() if state[k] != v}
    if changed:
        found = ", ".join(f"`{k}` {_shown(old)} in the checkpoint, {new!r} now" for k, (old, new) in changed.items())
        hint = ""
        if "num_samples" in changed:
            hint = (
                " (`num_samples` is the samples each process draws an epoch, the training split's size divided by the"
                " number of processes: the data or the number of devices or nodes changed)"
            )
        raise InvalidArgumentError(
            f"The checkpoint's training-loader position was saved for other data or settings: {found}{hint}. Its"
            f" epoch {state['epoch']} cannot be continued where it stopped (after batch {_shown(state['batches'])}) on"
            " these. Resume with the data, `batch_size`, `seed` and number of devices the checkpoint was saved with;"
            " or start the fit without `ckpt_path` (take the weights with `YourModel.load_from_checkpoint(path)`);"
            " or, to go on from the checkpoint with the new settings and that epoch restarted from its beginning,"
            " save it again without the loader's position: each entry of"
            " `ckpt['loops']['fit_loop']['state_dict']['combined_loader']` set to `{}`."
        )
    epoch, batches = int(state["epoch"]), int(state["batches"])
    if batches >= per_epoch:  # the epoch was complete: the next one starts from its beginning
        sampler.set_epoch(epoch + 1)
        return None
    sampler.set_epoch(epoch)  # before the iterator exists, which reads the sampler (at once, with workers)
    sampler.skip = batches * int(batch_size or 1)
    return batches


def _check_position(state: Any) -> None:
    """Raise unless ``state`` is a position :func:`position_state` could have written.

    Every field present and none other, each an integer (a ``bool`` or a float is none) or, ``shuffle``, a ``bool``,
    in its range; ``batches`` at most the batches of an epoch of ``num_samples`` in batches of ``batch_size``.

    Unknown fields are refused, not ignored: a position written by another version that this one does not know how
    to read could move the resume somewhere else than the saving run stopped, with no one told.

    Raises:
        InvalidArgumentError: what is wrong with the state, and that the checkpoint is damaged or not this version's.

    """
    damaged = (
        "The training loader's position in the checkpoint is damaged, or was saved by another version of"
        " lightning_fastdata or another loader"
    )
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"{damaged}: it is {_shown(state)}, not a mapping of {', '.join(_FIELDS)}.{_START_OVER}"
        )
    missing = [key for key in _FIELDS if key not in state]
    unknown = sorted(_shown(key) for key in state if key not in _FIELDS)
    if missing or unknown:
        found = []
        if missing:
            found.append(f"it lacks {', '.join(f'`{key}`' for key in missing)}")
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            found.append(f"it has {', '.join(unknown[:5])}{more}, which this version does not write")
        raise InvalidArgumentError(
            f"{damaged}: {' and '.join(found)} (a position holds {', '.join(_FIELDS)}).{_START_OVER}"
        )
    bad = [
        f"`{key}` {_shown(state[key])} ({want})"
        for key, want in (
            ("epoch", f"an integer from 0 to {_MAX_EPOCH}"),
            ("batches", "an integer of at least 0"),
            ("batch_size", "an integer of at least 1, or None"),
            ("num_samples", "an integer of at least 0"),
            ("seed", "an integer"),
            ("shuffle", "True or False"),
        )
        if not _fits(key, state[key])
    ]
    if bad:
        raise InvalidArgumentError(f"{damaged}: it has {'; '.join(bad)}.{_START_OVER}")
    per_epoch = -(-state["num_samples"] // (state["batch_size"] or 1))  # in integers: any size is exact
    if state["batches"] > per_epoch:
        raise InvalidArgumentError(
            f"{damaged}: it has `batches` {_shown(state['batches'])} trained of epoch {state['epoch']}, more than the"
            f" {_shown(per_epoch)} an epoch of its {_shown(state['num_samples'])} samples per process in batches of"
            f" {_shown(state['batch_size'])} has.{_START_OVER}"
        )


def _fits(key: str, value: Any) -> bool:
    """Whether field ``key`` of a position may hold ``value``."""
    if key == "shuffle":
        return type(value) is bool
    if key == "batch_size" and value is None:  # a loader of a batch sampler of one's own
        return True
    if isinstance(value, bool) or not isinstance(value, Integral):  # NumPy's integers too; a bool is no count
        return False
    if key == "epoch":
        return 0 <= value <= _MAX_EPOCH
    if key == "batch_size":
        return value >= 1
    return key == "seed" or value >= 0


def _shown(value: Any, limit: int = 60) -> str:
    """``value`` for a message: its ``repr``, cut to ``limit`` characters (a damaged state may hold anything)."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python prints
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
