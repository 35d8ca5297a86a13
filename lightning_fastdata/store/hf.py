"""The Hugging Face ``datasets`` adapter of ``convert_dataset``: rows read by column, class names from ``ClassLabel``.

Any indexed dataset of ``(image, label)`` tuples passes through :class:`DatasetRows` unchanged; ``datasets`` itself is
never imported (``pip install 'lightning-fastdata[hf]'`` installs it for those who load data with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_fastdata._files import read_regular
from lightning_fastdata.errors import SourceLayoutError
from lightning_fastdata.store.labels import AmbiguousTargetsError, kind_of_value
from lightning_fastdata.store.targets import KINDS, MAX_DIM, TargetSpec, _as_items


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
            elif image.get("path"):  # a regular file only, read up to its size: a path may name a FIFO or /dev/zero
                image = read_regular(image["path"])
        return image, row[label_key]


def dataset_classes(dataset: Any, label_column: str | None) -> list[str] | None:
    """``dataset.classes``, or the names of a Hugging Face ``ClassLabel`` label column (or of a sequence of them)."""
    classes = getattr(dataset, "classes", None)
    if classes is not None:
        return list(classes)
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping):
        feature = features.get(label_column or next((k for k in ("label", "labels") if k in features), ""))
        if isinstance(feature, list) and feature:
            feature = feature[0]
        feature = getattr(feature, "feature", feature)  # Sequence(ClassLabel(...))
        names = getattr(feature, "names", None)
        if names:
            return [str(name) for name in names]
    return None


def dataset_targets(kind: str | None, dataset: Any, rows: DatasetRows, label_column: str | None) -> TargetSpec:
    """The target kind of ``convert_dataset``: ``kind``, else what the features or the first sample make unambiguous.

    A Hugging Face label feature decides first: ``ClassLabel`` is ``class``, ``Sequence(ClassLabel)`` ``multilabel``,
    ``Value("float*")`` ``float`` (one value), a ``Sequence`` of float values of a fixed length ``float`` (that many).
    Otherwise the first sample's target: see :func:`~lightning_fastdata.store.labels.kind_of_value`. A ``float``
    target has as many values as the first sample's.

    Raises:
        ValueError: ``kind`` is not a target kind.
        AmbiguousTargetsError: no kind was given and the first target could be read as several.

    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"`targets` must be one of {', '.join(KINDS)}, got {kind!r}.")
    if kind == "none":
        return TargetSpec("none")
    if kind is None:
        kind = _feature_kind(dataset, label_column)
    if kind in ("class", "multilabel"):
        return TargetSpec(kind)
    try:
        value = rows[0][1]
    except Exception as err:  # a user's dataset may raise anything: the kind cannot be read from it
        raise SourceLayoutError(
            f"reading the first sample of the dataset to learn its target kind raised {type(err).__name__}: {err}."
            " Pass `targets=` ('class', 'multilabel', 'float' or 'none')."
        ) from err
    if kind is None:
        kind = kind_of_value(value)
        if kind is None:
            raise AmbiguousTargetsError(
                f"the dataset's first target, {value!r:.60}, could be class indices, a multi-hot vector or values:"
                " pass `targets='multilabel'` (class indices), `targets='float'` (values) or `targets='class'`."
            )
    if kind != "float":
        return TargetSpec(kind)
    count = len(_as_items(value))
    if not 1 <= count <= MAX_DIM:
        raise SourceLayoutError(f"the dataset's first float target has {count} values; 1 to {MAX_DIM} are stored.")
    return TargetSpec("float", dim=count)


def _feature_kind(dataset: Any, label_column: str | None) -> str | None:
    """The kind a Hugging Face dataset's label feature says, or ``None`` (no features, or another feature)."""
    features = getattr(dataset, "features", None)
    if not isinstance(features, Mapping):
        return None
    feature = features.get(label_column or next((k for k in ("label", "labels") if k in features), ""))
    name = type(feature).__name__
    if name == "ClassLabel":
        return "class"
    inner = getattr(feature, "feature", None)
    if name in ("Sequence", "List", "LargeList") or isinstance(feature, list):
        inner = feature[0] if isinstance(feature, list) and feature else inner
        if type(inner).__name__ == "ClassLabel":
            return "multilabel"
        if "float" in str(getattr(inner, "dtype", "")):
            return "float"
    if name == "Value" and "float" in str(getattr(feature, "dtype", "")):
        return "float"
    return None
