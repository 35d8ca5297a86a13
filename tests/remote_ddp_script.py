"""One "node" of a two-node CPU DDP run on a database at a URL, run as a script by ``test_remote.py``.

Usage: ``python remote_ddp_script.py URL CACHE_DIR OUT_DIR EPOCHS`` with ``MASTER_ADDR``, ``MASTER_PORT`` and
``NODE_RANK`` set: Lightning starts this node's second rank itself (``Trainer(devices=2, num_nodes=2)``). Each rank
writes ``OUT_DIR/rank<r>.json``: its node, what staging did on it (``staged`` on the node's local rank 0 in
``prepare_data``; ``found`` on the rank that waited for it), the staged copy it reads, and the sample indices it
trained on, per epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from indexed import IndexedDataModule, RecordingModel
from lightning.pytorch import Trainer
from ranks import end_process_group


def main(url: str, cache_dir: str, out_dir: str, epochs: int) -> None:
    dm = IndexedDataModule(
        url, cache_dir=cache_dir, image_size=16, batch_size=4, num_workers=0, val_fraction=0, drop_last=False
    )
    model = RecordingModel()
    model.layer = torch.nn.Linear(3, 3)  # the session database has 3 classes
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    result = {
        "rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "staging": dm.staging.action if dm.staging else None,
        "database": str(dm.database_path),
        "epochs": model.seen,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    end_process_group()
