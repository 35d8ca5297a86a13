"""What ``lightning-fastdata bench`` measures: a database through the training loader ``fit`` builds, else a folder.

The sweep itself is :func:`lightning_fastdata.tuning.sweep`; this module only picks its source. It lives apart from
:mod:`lightning_fastdata.tuning` because a database's source is a ``FastImageDataModule``, which itself imports
``tuning`` (for ``num_workers="tune"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from lightning_fastdata.tuning import LoaderConfig


class TrainingLoaders:
    """The training loaders ``fit`` builds, one per configuration: what ``lightning-fastdata bench`` times.

    The batch path, its engine, and on CUDA the copy to the device and the normalization there, with the
    configuration's workers and batch size.

    Args:
        loader: the training loader of a configuration (``FastImageDataModule.tuning_loader``).
        samples: the number of training samples, ``len()``.

    """

    def __init__(self, loader: Callable[[LoaderConfig], Iterable[Any]], samples: Callable[[], int]) -> None:
        self.loader = loader
        self.samples = samples

    def __call__(self, config: LoaderConfig) -> Iterable[Any]:
        """The training loader with ``config``."""
        return self.loader(config)

    def __len__(self) -> int:
        return self.samples()


def sweep_dataset(
    data: str | os.PathLike[str], image_size: int = 224, engine: str = "threads"
) -> tuple[Dataset | TrainingLoaders, str]:
    """What ``lightning-fastdata bench`` measures, and its kind.

    A database is timed through FastImageDataModule's training loader (``engine``, the batch path, and the device
    step on CUDA: :class:`TrainingLoaders`), an image folder through torchvision's ``ImageFolder`` with the standard
    transforms (RandomResizedCrop, flip, ToTensor, Normalize).
    """
    from lightning_fastdata.store import format as _format
    from lightning_fastdata.store.sources import image_folder, train_folder

    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"`data` {str(path)!r} does not exist. Pass an image folder or a database made by `lightning-fastdata"
            " convert`."
        )
    if (path / _format.DATA_FILE).is_file():
        from lightning_fastdata.datamodule import FastImageDataModule  # here: a folder's bench needs no Lightning

        datamodule = FastImageDataModule(str(path), image_size=image_size, engine=engine, val_fraction=0)  # type: ignore[arg-type]

        def samples() -> int:
            if datamodule.train_dataset is None:
                datamodule.setup("fit")
            return len(datamodule.train_dataset)  # type: ignore[arg-type]

        return TrainingLoaders(datamodule.tuning_loader, samples), "database"
    if not path.is_dir():
        raise FileNotFoundError(f"`data` {str(path)!r} is neither a database nor an image folder.")
    from torchvision import transforms

    from lightning_fastdata.transforms import IMAGENET_MEAN, IMAGENET_STD

    standard = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    return image_folder(train_folder(path), transform=standard), "image folder"
