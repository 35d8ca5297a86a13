from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_fastdata import make_image_folder


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_same_seed_gives_identical_files(tmp_path):
    """The output is a deterministic function of the arguments: the same seed writes the same bytes."""
    kwargs = {"num_classes": 3, "train_per_class": 4, "val_per_class": 2, "min_size": 20, "max_size": 40}
    first = _files(make_image_folder(tmp_path / "a", seed=5, num_workers=1, **kwargs))
    second = _files(make_image_folder(tmp_path / "b", seed=5, num_workers=1, **kwargs))
    other = _files(make_image_folder(tmp_path / "c", seed=6, num_workers=1, **kwargs))
    assert len(first) == 18
    assert first == second
    assert first.keys() == other.keys()
    assert all(first[name] != other[name] for name in first)


def test_output_does_not_depend_on_worker_count(tmp_path):
    """A pool of workers writes the same files as one process (128 images, enough to use two workers)."""
    kwargs = {"num_classes": 2, "train_per_class": 64, "val_per_class": 0, "min_size": 8, "max_size": 12, "seed": 1}
    serial = _files(make_image_folder(tmp_path / "serial", num_workers=1, **kwargs))
    pooled = _files(make_image_folder(tmp_path / "pooled", num_workers=2, **kwargs))
    assert len(serial) == 128
    assert serial == pooled


def test_layout_counts_and_sizes(tmp_path):
    """``root/{train,val}/class_<k>/<n>.jpg`` with the requested counts, sizes drawn within the bounds."""
    root = make_image_folder(
        tmp_path / "s", num_classes=2, train_per_class=5, val_per_class=3, min_size=30, max_size=50, num_workers=1
    )
    assert root == tmp_path / "s"
    assert sorted(p.name for p in root.iterdir()) == ["train", "val"]
    for split, count in (("train", 5), ("val", 3)):
        assert sorted(p.name for p in (root / split).iterdir()) == ["class_0", "class_1"]
        for k in range(2):
            names = sorted(p.name for p in (root / split / f"class_{k}").iterdir())
            assert names == [f"{n:05d}.jpg" for n in range(count)]
    sizes = set()
    for path in root.rglob("*.jpg"):
        with Image.open(path) as img:
            assert img.format == "JPEG"
            assert img.mode == "RGB"
            assert all(30 <= side <= 50 for side in img.size)
            sizes.add(img.size)
    assert len(sizes) > 1


def test_val_zero_gives_a_flat_image_folder(tmp_path):
    """With ``val_per_class=0`` the layout is a plain ImageFolder, ``root/class_<k>/<n>.jpg``."""
    root = make_image_folder(
        tmp_path / "flat", num_classes=3, train_per_class=2, val_per_class=0, min_size=10, max_size=12, num_workers=1
    )
    assert sorted(p.name for p in root.iterdir()) == ["class_0", "class_1", "class_2"]
    assert len(list(root.glob("*/*.jpg"))) == 6
    assert not (root / "train").exists()


def test_classes_are_visibly_distinct(tmp_path):
    """The mean colour differs clearly between classes and little within a class."""
    root = make_image_folder(
        tmp_path / "s", num_classes=4, train_per_class=6, val_per_class=0, min_size=24, max_size=40, num_workers=1
    )
    means, spreads = [], []
    for k in range(4):
        colours = [
            np.asarray(Image.open(p).convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(axis=0)
            for p in sorted((root / f"class_{k}").glob("*.jpg"))
        ]
        means.append(np.mean(colours, axis=0))
        spreads.append(np.linalg.norm(np.std(colours, axis=0)))
    between = min(np.linalg.norm(means[a] - means[b]) for a, b in itertools.combinations(range(4), 2))
    assert between > 40
    assert between > 3 * max(spreads)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 0},
        {"train_per_class": 0},
        {"val_per_class": -1},
        {"min_size": 0},
        {"min_size": 50, "max_size": 40},
    ],
)
def test_invalid_arguments_raise(tmp_path, kwargs):
    """Non-positive counts or an empty size range raise ``ValueError`` naming the argument, writing nothing."""
    with pytest.raises(ValueError, match="`"):
        make_image_folder(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()
