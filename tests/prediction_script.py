"""Models whose predictions can be checked, and a real two-process DDP prediction run on CPU (``test_prediction.py``).

Usage: ``python prediction_script.py DATA_DIR OUTPUT_PATH [interrupt | disagree]``: predicts the database's predict
split on two CPU processes with :class:`OneHotModel` and a :class:`~lightning_fastdata.PredictionWriter` writing
``OUTPUT_PATH``; each rank writes the number of samples it predicted (the sampler's padding included) to
``rank<R>.json`` beside it. With ``interrupt``: on one process, with a model that raises ``KeyboardInterrupt`` (as
Ctrl-C does) on its second batch. With ``disagree``: with :class:`RankModel`, whose ranks predict the sample the
sampler pads with differently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from ranks import end_process_group
from torch.nn import functional as F

from lightning_fastdata import FastImageDataModule, PredictionWriter


class OneHotModel(LightningModule):
    """Predicts each sample's own label as one-hot logits: a writer that maps rows to the right files writes, for
    every row, the class of the folder its source is in."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.layer = torch.nn.Linear(3, num_classes)
        self.predicted = 0

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, labels = batch
        self.predicted += len(labels)
        return F.one_hot(labels, self.num_classes).float() * 5 - 1


class LabelModel(OneHotModel):
    """Predicts each sample's own label as an int64 class index."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[1]


class RawModel(OneHotModel):
    """Returns per-sample values that are no class: its label twice, as a mapping of tensors."""

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        labels = batch[1]
        return {"twice": labels * 2, "pair": torch.stack([labels, labels + 1], dim=1).float()}


class FailingModel(OneHotModel):
    """Predicts the first batch, then fails on the second."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("the model failed on batch 1")
        return super().predict_step(batch, batch_idx)


class InterruptedModel(OneHotModel):
    """Predicts the first batch, then is interrupted as by Ctrl-C."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise KeyboardInterrupt
        return super().predict_step(batch, batch_idx)


class RankModel(OneHotModel):
    """Predicts each sample's label plus its rank, as a class index: a sample both ranks predict gets two classes."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.predicted += len(batch[1])
        return (batch[1] + self.global_rank) % self.num_classes


def main(data_dir: str, output_path: str, mode: str = "") -> None:
    interrupt = mode == "interrupt"
    dm = FastImageDataModule(data_dir, image_size=16, batch_size=2, num_workers=0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if interrupt else 2,
        strategy="auto" if interrupt else "ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PredictionWriter(output_path)],
    )
    model = InterruptedModel() if interrupt else RankModel() if mode == "disagree" else OneHotModel()
    trainer.predict(model, datamodule=dm, return_predictions=False)
    Path(output_path).with_name(f"rank{trainer.global_rank}.json").write_text(json.dumps(model.predicted))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4])
    end_process_group()
