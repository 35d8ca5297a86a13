"""Every private name of torch (or CPython) this package still uses: each one here, and only here.

A private name may change in any release, so each is listed with what it is for and the versions it was checked on,
and the code imports it from this module. Checked on torch 2.14.1 and on the declared lower bound, torch 2.4.0 (with
Python 3.11.7): the suite runs on both (``make test-lowest``, ``constraints/lowest.txt``, which says what did not
pass there), and torch 2.4's worker loop sets the same two names the same way.

* ``torch.utils.data._utils.worker.WorkerInfo`` and its module's ``_worker_info``: what the public
  :func:`torch.utils.data.get_worker_info` returns. The process engine's workers
  (:class:`~lightning_fastdata.pipeline.processes.WorkerPool`) set it as torch's own workers do, so
  ``get_worker_info()`` keeps telling a worker process from the training process: the batch reader builds a batch
  that found no free slot in a memfd of its own there (:mod:`~lightning_fastdata.pipeline.kernel`), the keyed random
  state is not saved there (:mod:`~lightning_fastdata.keyed_random`), and a user's ``worker_init_fn`` or dataset may
  call it too.
* ``multiprocessing.reduction.DupFd`` (CPython, undocumented): pickles a file descriptor so that the process that
  unpickles it gets its own copy, whatever the start method (passed to a spawned child as it starts, else fetched
  from the sender over a socket). Batch slot memory and batches built in a memfd of their own
  (:mod:`~lightning_fastdata.pipeline.slots`) reach the workers and come back this way; torch sends its shared
  tensors with it too.

Workers import this module, so it imports nothing but torch and the standard library.
"""

from __future__ import annotations

from multiprocessing.reduction import DupFd
from typing import Any

from torch.utils.data._utils import worker as _worker

__all__ = ["DupFd", "set_worker_info"]


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """Make :func:`torch.utils.data.get_worker_info` in this worker process return what torch's workers return."""
    _worker._worker_info = _worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
