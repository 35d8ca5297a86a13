"""Real two-process DDP on CPU, run as a script by ``test_ddp.py`` (Lightning's launcher re-executes it for rank 1).

Usage: ``python ddp_script.py DATA_DIR OUT_DIR SEED EPOCHS [KIND]``. Trains a tiny model on ``FastImageDataModule``
whose items carry their sample index, and writes ``OUT_DIR/rank<r>.json`` with the indices each rank saw, per epoch,
the size of each training batch, and what the rank saw of its launch (Lightning's cluster environment, ranks,
processes per node). ``KIND`` ``multilabel``: a multi-label database read through
``FastImageDataModule(return_index=True)``, each batch's multi-hot targets checked against the database's; ``views``:
``FastImageDataModule(views=VIEWS, return_index=True)``, the shape of each batch's views recorded too (the model trains
on the first). Also runs under ``torchrun --nproc_per_node 2`` (then Lightning starts no processes of its own).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

from indexed import IndexedDataModule, RecordingModel
from lightning.pytorch import Trainer
from ranks import end_process_group
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, ViewGroup, cpus

#: the ``views`` kind's groups, given small first: the batches must hold the large views first
VIEWS = [ViewGroup(16, count=3, scale=(0.05, 0.4)), ViewGroup(32, count=2, scale=(0.4, 1.0))]


class ValidatedModel(RecordingModel):
    """:class:`RecordingModel` with a validation step (its loss synchronized across ranks) that also records the size
    of each training batch and, for batches of views, each view's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[int] = []
        self.view_shapes: list[list[list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if isinstance(batch[0], list):  # `(views, targets, index)`: record every view, train on the first
            self.view_shapes.append([list(view.shape) for view in batch[0]])
            self.dtypes.update(str(view.dtype) for view in batch[0])
            batch = (batch[0][0], *batch[1:])
        self.batch_sizes.append(len(batch[0]))
        if batch[1].is_floating_point():  # multi-hot targets: the rows of the batch's own samples
            dataset = self.trainer.datamodule.train_dataset.dataset
            assert batch[1].tolist() == dataset.targets_of(batch[2].numpy()).tolist()
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not isinstance(self.trainer.datamodule, IndexedDataModule):  # its own dataset gives each sample's index
            assert len(batch) == 2, "`return_index` leaves validation batches `(images, targets)`"
        images, labels = batch[0], batch[1]
        self.log("val_loss", F.cross_entropy(self.layer(images.mean(dim=(2, 3))), labels), sync_dist=True)


def main(data_dir: str, out_dir: str, seed: int, epochs: int, kind: str = "class") -> None:
    modules = {
        "class": IndexedDataModule,
        "multilabel": partial(FastImageDataModule, return_index=True),
        "views": partial(FastImageDataModule, return_index=True, views=VIEWS),
    }
    module = modules[kind]
    dm = module(data_dir, image_size=16, batch_size=4, num_workers=0, val_fraction=0.1, seed=seed, drop_last=False)
    model = ValidatedModel()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=True,
    )
    trainer.fit(model, datamodule=dm)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "epochs": model.seen,
        "batches": model.batches,
        "dtypes": sorted(model.dtypes),
        "train_indices": [int(i) for i in dm.train_dataset.indices],
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "batch_sizes": model.batch_sizes,
        "view_shapes": model.view_shapes,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "processes_per_node": cpus.processes_per_node(trainer.world_size, trainer.num_nodes),
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
    end_process_group()
