"""LoaderMonitor on a plain torchvision ImageFolder pipeline: an input-bound run, and what it advises.

python examples/monitor_imagefolder.py [--workdir .demo]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from demo import TinyNet
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from lightning_fastdata import LoaderMonitor, make_image_folder
from lightning_fastdata.store.sources import train_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=".demo")
    args = parser.parse_args()
    root = Path(args.workdir) / "images"
    if not root.is_dir():  # the folder `make demo` generates
        make_image_folder(root, num_classes=4, train_per_class=250, val_per_class=0, noise=8)
    standard = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    train = datasets.ImageFolder(train_folder(root), transform=standard)
    loader = DataLoader(train, batch_size=32, shuffle=True, num_workers=0)  # the usual first attempt
    monitor = LoaderMonitor(report_dir=Path(args.workdir) / "imagefolder_report", verbose=False)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=3,
        callbacks=[monitor],
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyNet(len(train.classes)), loader)
    print(monitor.format_table())


if __name__ == "__main__":
    main()
