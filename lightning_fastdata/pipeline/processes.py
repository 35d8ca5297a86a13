"""The process engine (``engine="processes"``): batches built whole by DataLoader worker processes.

torch's DataLoader runs the workers; each calls :meth:`BatchReader.__getitems__
<lightning_fastdata.pipeline.kernel.BatchReader.__getitems__>` for a whole batch and hands it back in shared memory.
Workers import this module to unpickle the ``worker_init_fn``, so it imports neither Lightning nor torchvision.
"""

from __future__ import annotations

import torch


def _worker_init(worker_id: int) -> None:
    """One intra-op thread per worker process: the workers already use every core the budget gives them.

    OpenCV needs nothing here: :mod:`lightning_fastdata._cv` switched its thread pool off in the parent.
    """
    torch.set_num_threads(1)
