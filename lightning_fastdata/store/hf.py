"""The Hugging Face ``datasets`` adapter of ``convert_dataset``: rows read by column, class names from ``ClassLabel``.

Any indexed dataset of ``(image, label)`` tuples passes through :class:`DatasetRows` unchanged; ``datasets`` itself is
never imported (``pip install 'lightning-fastdata[hf]'`` installs it for those who load data with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class DatasetRows:
    """A dataset seen as ``(image, label)`` pairs.

    Tuples pass through; mapping rows (Hugging Face ``datasets``) are read by column, and an undecoded ``Image``
    feature (``{"bytes": ..., "path": ...}``) gives its stored bytes.
    """

    def __init__(self, dataset: Any, image_column: str | None, label_column: str | None) -> None:
        self.dataset = dataset
        self.image_column = image_column
        self.label_column = label_column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.dataset[index]
        if not isinstance(row, Mapping):
            image, label = row
            return image, label
        image_key = self.image_column or next((k for k in ("image", "img") if k in row), None)
        label_key = self.label_column or next((k for k in ("label", "labels") if k in row), None)
        if image_key not in row or label_key not in row:
            raise KeyError(
                f"the row has columns {sorted(row)}; pass `image_column` and `label_column` to `convert_dataset`"
            )
        image = row[image_key]
        if isinstance(image, Mapping):  # datasets.Image(decode=False): the stored bytes, or the file they came from
            if image.get("bytes"):
                image = image["bytes"]
            elif image.get("path"):
                with open(image["path"], "rb") as fh:
                    image = fh.read()
        return image, row[label_key]


def dataset_classes(dataset: Any, label_column: str | None) -> list[str] | None:
    """``dataset.classes``, or the names of a Hugging Face ``ClassLabel`` label column."""
    classes = getattr(dataset, "classes", None)
    if classes is not None:
        return list(classes)
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping):
        feature = features.get(label_column or next((k for k in ("label", "labels") if k in features), ""))
        names = getattr(feature, "names", None)
        if names:
            return [str(name) for name in names]
    return None
