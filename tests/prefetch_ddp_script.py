"""Real two-process DDP on CPU through a loader that looks ahead to the device, run as a script by ``test_prefetch.py``.

Usage: ``python prefetch_ddp_script.py DATA_DIR OUT_DIR EPOCHS``. The datamodule is forced to build
loaders that look ahead to the device (on CPU they pass batches through), so Lightning's DDP sampler handling,
``set_epoch`` and batch counting run against them. Each rank writes ``OUT_DIR/rank<r>.json`` with the sample
indices it saw per epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from indexed import IndexedDataModule, RecordingModel
from lightning.pytorch import Trainer
from ranks import end_process_group

from lightning_fastdata.pipeline import FastLoader


class PrefetchIndexedDataModule(IndexedDataModule):
    """Batches ``(images, labels, indices)``, always through the device look-ahead (a passthrough on CPU)."""

    def uses_prefetch(self) -> bool:
        return True


def main(data_dir: str, out_dir: str, epochs: int) -> None:
    dm = PrefetchIndexedDataModule(
        data_dir, image_size=16, batch_size=4, num_workers=0, seed=0, drop_last=False, prefetch_to_device=True
    )
    model = RecordingModel()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    assert isinstance(loader, FastLoader), type(loader)
    assert not loader.prefetching  # a CPU device: batches pass through
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "loader": type(loader).__name__,
        "num_replicas": loader.sampler.num_replicas,
        "sampler_rank": loader.sampler.rank,
        "epochs": model.seen,
        "batches": model.batches,
        "sampler_epochs": model.sampler_epochs,
        "dtypes": sorted(model.dtypes),
        "train_size": len(dm.train_dataset),
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    end_process_group()
