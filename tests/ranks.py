"""What every DDP test script does after its fit: end its process group itself.

Lightning destroys an NCCL process group at exit, a gloo one (every CPU run here) not; left to the interpreter's
exit, gloo's threads can abort a rank ("terminate called without an active exception", pytorch/pytorch#190489), which
the launcher then reports as the run's failure.
"""

from __future__ import annotations

import torch


def end_process_group() -> None:
    """Destroy this process's default process group, if it has one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
