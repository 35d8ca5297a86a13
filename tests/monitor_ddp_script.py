"""Real two-process DDP on CPU with ``LoaderMonitor``, run as a script by ``test_monitor.py``.

Usage: ``python monitor_ddp_script.py OUT_DIR``. Rank 1's dataset sleeps 10 ms per sample, rank 0's does not; each
rank writes ``OUT_DIR/rank<r>.json`` with its monitor's summary (which gathers every rank's wait) and table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from ranks import end_process_group
from torch.utils.data import DataLoader, Dataset

from lightning_fastdata import LoaderMonitor


class _RankSlowDataset(Dataset):
    """16 items; loading one takes 30 ms on rank 1 only (``num_workers=0``: ``__getitem__`` runs in the rank)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dist.get_rank() == 1:
            time.sleep(0.03)
        return torch.full((4,), float(index)), torch.tensor(0.0)


class _TinyModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a small machine
    monitor = LoaderMonitor(warmup_epochs=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[monitor],
    )
    trainer.fit(_TinyModel(), DataLoader(_RankSlowDataset(), batch_size=2, num_workers=0))
    result = {"rank": trainer.global_rank, "summary": monitor.summary, "table": monitor.format_table()}
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
