"""Self-supervised DINO on generated images: a student and an EMA teacher trained on several views of each image.

``FastImageDataModule(views=[...])`` decodes each training image once and crops every view from it; a training batch is
``(views, targets)``, ``views`` a list of ``[B, 3, S, S]`` tensors, the large (global) views first, the list lightly and
solo-learn hand over. The step takes ``views, targets = batch[0], batch[1]`` as lightly's examples do, so it runs
unchanged on a lightly loader (whose batches are ``(views, targets, filenames)``) and on this one (``(views, targets,
index)`` with ``return_index=True``); solo-learn's steps take ``indexes, views, targets``: see docs/datamodule.md. The
targets (the generated folder's classes; ``-1`` for an unlabeled set) are not used. DINO (Caron et al., 2021): the
student sees every view, the teacher, an exponential moving average of the student, sees the large views only; the loss
is the cross-entropy between the teacher's centred, sharpened (low temperature) distribution over ``out_dim`` prototypes
and the student's, over every pair of different views. Over the first epochs the loss often rises, since the centring
spreads the teacher over more prototypes and the teacher's entropy is part of the loss; the agreement rises: how often
the student's prototype on a view is the teacher's on another view of the image.

This runs in seconds on a CPU: 2 x 48 px and 4 x 24 px views, a four-layer CNN and a small projection head. To scale it
up, keep the training step and change the sizes: DINO's recipe is ``views=[ViewGroup(224, count=2, scale=(0.4, 1.0)),
ViewGroup(96, count=6, scale=(0.05, 0.4))]``, a resnet50 (torchvision, its ``fc`` replaced by ``nn.Identity()``,
``embed_dim=2048``) or a ViT-S/16 (timm, ``num_classes=0``, ``embed_dim=384``) as the backbone, ``out_dim=65536``,
``hidden_dim=2048``, ``bottleneck_dim=256``, the teacher's momentum raised from 0.996 to 1 over the run (a cosine) and
its temperature from 0.04 to 0.07 over the first 30 epochs, and DINO's colour augmentation, each view with its own
parameters: ``color_jitter=(0.4, 0.4, 0.2, 0.1), grayscale_p=0.2`` on the DataModule and the per-view blur and
solarization on the groups, ``views=[ViewGroup(224, scale=(0.4, 1.0), blur_p=1.0), ViewGroup(224, scale=(0.4, 1.0),
blur_p=0.1, solarize_p=0.2), ViewGroup(96, count=6, scale=(0.05, 0.4), blur_p=0.5)]``.

    python examples/ssl_dino.py --out /tmp/dino --epochs 3
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from lightning_fastdata import FastImageDataModule, ViewGroup, make_image_folder


def tiny_backbone(embed_dim: int = 64) -> nn.Module:
    """A four-layer CNN pooled to ``[B, embed_dim]``: takes views of any size (a resnet or a ViT in a real run)."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 64, embed_dim):
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


class DINOHead(nn.Module):
    """DINO's projection head: an MLP to a bottleneck, L2-normalized, then a weight-normalized layer to ``out_dim``."""

    def __init__(self, in_dim: int, out_dim: int = 256, hidden_dim: int = 128, bottleneck_dim: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        self.prototypes = nn.Parameter(torch.randn(out_dim, bottleneck_dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight norm with its gain fixed at 1, as DINO's last layer: cosine similarity to each prototype
        return F.normalize(self.mlp(x), dim=-1) @ F.normalize(self.prototypes, dim=-1).T


class DINOLoss(nn.Module):
    """Cross-entropy from the teacher's centred, sharpened outputs to the student's, over pairs of different views.

    The centre is an EMA of the teacher's mean output: subtracting it keeps one prototype from winning every image
    (collapse), and the teacher's low temperature keeps its outputs from going uniform.
    """

    def __init__(
        self, out_dim: int, student_temp: float = 0.1, teacher_temp: float = 0.04, center_momentum: float = 0.9
    ):
        super().__init__()
        self.student_temp, self.teacher_temp, self.center_momentum = student_temp, teacher_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
        """``student``: one ``[B, out_dim]`` output per view; ``teacher``: one per large view, the same first views."""
        targets = [F.softmax((t - self.center) / self.teacher_temp, dim=-1) for t in teacher]
        log_probs = [F.log_softmax(s / self.student_temp, dim=-1) for s in student]
        terms = [
            -(target * log_prob).sum(dim=-1).mean()
            for i, target in enumerate(targets)
            for j, log_prob in enumerate(log_probs)
            if i != j  # never a view against itself
        ]
        self.update_center(torch.cat(teacher))
        return torch.stack(terms).mean()

    @torch.no_grad()
    def agreement(self, student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
        """How often the student's prototype (argmax) on a view is the centred teacher's on another view of an image."""
        picks = [(t - self.center).argmax(dim=-1) for t in teacher]
        return torch.stack(
            [
                (p == s.argmax(dim=-1)).float().mean()
                for i, p in enumerate(picks)
                for j, s in enumerate(student)
                if i != j
            ]
        ).mean()

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor) -> None:
        self.center.mul_(self.center_momentum).add_(teacher.mean(dim=0, keepdim=True), alpha=1 - self.center_momentum)


class DINO(LightningModule):
    """A student (backbone + head) trained by gradient, a teacher (its copy) by exponential moving average.

    ``training_step`` takes a lightly / solo-learn multi-view batch: ``views, targets = batch[0], batch[1]``, ``views``
    a list of ``[B, 3, S, S]`` tensors with the ``num_large`` large views first.
    """

    def __init__(
        self, num_large: int = 2, embed_dim: int = 64, out_dim: int = 256, lr: float = 2e-3, momentum: float = 0.99
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.student = nn.Sequential(tiny_backbone(embed_dim), DINOHead(embed_dim, out_dim))
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.criterion = DINOLoss(out_dim)
        self.epoch_losses: list[float] = []
        self.epoch_agreement: list[float] = []
        self.first_views: list[torch.Tensor] | None = None
        self._losses: list[torch.Tensor] = []
        self._agreement: list[torch.Tensor] = []

    @staticmethod
    def _each_view(net: nn.Module, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """``net`` on each view, one forward per size (DINO's MultiCropWrapper), one ``[B, D]`` output per view."""
        outputs: list[torch.Tensor] = []
        start = 0
        while start < len(views):
            end = start
            while end < len(views) and views[end].shape == views[start].shape:
                end += 1
            outputs += net(torch.cat(views[start:end])).chunk(end - start)
            start = end
        return outputs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        views, _targets = batch[0], batch[1]  # the targets (classes here, -1 for an unlabeled set) are not used
        if self.first_views is None:
            self.first_views = [view.detach().clone() for view in views]
        with torch.no_grad():
            teacher = self._each_view(self.teacher, views[: self.hparams.num_large])
        student = self._each_view(self.student, views)
        agreement = self.criterion.agreement(student, teacher)  # before the loss moves the centre
        loss = self.criterion(student, teacher)
        self._losses.append(loss.detach())
        self._agreement.append(agreement)
        self.log_dict({"train/loss": loss, "train/agreement": agreement}, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The teacher follows the student after each optimizer step (its BatchNorm statistics too)."""
        with torch.no_grad():
            for t, s in zip(self.teacher.state_dict().values(), self.student.state_dict().values(), strict=True):
                if t.dtype.is_floating_point:
                    t.mul_(self.hparams.momentum).add_(s.detach(), alpha=1 - self.hparams.momentum)
                else:
                    t.copy_(s)

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(torch.stack(self._losses).mean()))
        self.epoch_agreement.append(float(torch.stack(self._agreement).mean()))
        self._losses.clear()
        self._agreement.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=self.hparams.lr, weight_decay=0.04)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Generate, train; returns what a test checks (one training batch's views, the loss and agreement per epoch, the
    DataModule)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".demo/dino", help="where the images and the converted database go")
    parser.add_argument("--images-per-class", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    seed_everything(0, workers=True)
    out = Path(args.out)
    folder = make_image_folder(
        out / "images", num_classes=4, train_per_class=args.images_per_class, val_per_class=0, min_size=56, max_size=80
    )
    dm = FastImageDataModule(
        str(folder),
        cache_dir=str(out / "cache"),
        views=[ViewGroup(48, count=2, scale=(0.4, 1.0)), ViewGroup(24, count=4, scale=(0.05, 0.4))],
        image_size=48,
        batch_size=32,
        num_workers=0,
        val_fraction=0.0,
    )
    model = DINO(num_large=dm.num_large_views)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, datamodule=dm)
    print(
        f"{dm.num_large_views} large + {dm.num_small_views} small views: loss by epoch"
        f" {[round(v, 3) for v in model.epoch_losses]}, teacher/student agreement"
        f" {[round(v, 3) for v in model.epoch_agreement]}"
    )
    return {
        "views": model.first_views,
        "losses": model.epoch_losses,
        "agreement": model.epoch_agreement,
        "datamodule": dm,
    }


if __name__ == "__main__":
    main()
