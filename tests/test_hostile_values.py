"""Target values a database you did not make may hold: float targets that are not finite, labels outside the classes.

The writer refuses both (``check_target``); written byte by byte (``tests/hostile.py``), each is a damaged sample on
every read path, as a record that fails its checksum is: ``dataset[i]`` (tensors, PIL images, encoded bytes), the
batch path on threads and worker processes, device decode's host side, ``targets`` and ``targets_of``. Each refusal is
a ``CorruptRecordError`` naming the split, the index and the value, and a skip under ``on_bad_sample="skip"``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import hostile
import numpy as np
import pytest
import torch

from lightning_fastdata import CorruptRecordError, LmdbImageDataset
from lightning_fastdata.pipeline import create_loader
from lightning_fastdata.pipeline.device_decode import EncodedCropDataset
from lightning_fastdata.skipping import SkipCounter
from lightning_fastdata.store.format import ENCODING_JPEG
from lightning_fastdata.transforms import CenterCropResize, Normalizer

#: one float a sample: the values that are not finite at 1, 3 and 5
VALUES = [0.5, math.nan, 1.5, math.inf, 2.5, -math.inf, 3.5, 4.5]
BAD = {1: "nan", 3: "inf", 5: "-inf"}
GOOD = [i for i in range(len(VALUES)) if i not in BAD]
NORMALIZER = Normalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def _records(n: int, label: int = -1) -> list[bytes]:
    return [hostile.record(ENCODING_JPEG, label, 24, 32, hostile.jpeg(24, 32, seed=i)) for i in range(n)]


@pytest.fixture(scope="module")
def floats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``float`` database of one value a sample, NaN and infinities among them (:data:`VALUES`)."""
    return hostile.write_float_database(tmp_path_factory.mktemp("floats") / "db", _records(len(VALUES)), VALUES)


def _refusal(db: Path, index: int, value: str) -> str:
    return re.escape(f"split 'train' index {index} of {str(db)!r}: its float target {value} is not finite")


@pytest.mark.parametrize("output", ["tensor", "pil", "encoded"])
def test_a_float_target_that_is_not_finite_is_refused_by_every_sample_read(floats: Path, output: str) -> None:
    """``dataset[i]`` of a NaN, ``inf`` or ``-inf`` target: a one-line error naming the split, index and value (before
    the fix, each reached the sample as it is); the finite ones read as stored."""
    dataset = LmdbImageDataset(floats, output=output)  # type: ignore[arg-type]
    for index, value in BAD.items():
        with pytest.raises(CorruptRecordError, match=_refusal(floats, index, value)) as info:
            dataset[index]
        assert "\n" not in str(info.value)
    assert [float(dataset[i][1]) for i in GOOD] == [VALUES[i] for i in GOOD]


def test_targets_and_targets_of_refuse_a_float_target_that_is_not_finite(floats: Path) -> None:
    """``targets`` names the first sample that is not finite; ``targets_of`` the first of those it is asked for."""
    dataset = LmdbImageDataset(floats)
    with pytest.raises(CorruptRecordError, match=_refusal(floats, 1, "nan")):
        _ = dataset.targets
    with pytest.raises(CorruptRecordError, match=_refusal(floats, 5, "-inf")):
        dataset.targets_of([0, 5, 3])
    assert dataset.targets_of(GOOD).tolist() == [VALUES[i] for i in GOOD]


def test_a_multi_value_target_names_its_values(tmp_path: Path) -> None:
    """A sample of three values, one infinite, is refused naming all three; its neighbours read."""
    values = np.array([[1, 2, 3], [4, math.inf, 6], [7, 8, 9]], dtype=np.float32)
    db = hostile.write_float_database(tmp_path / "db", _records(3), values)
    dataset = LmdbImageDataset(db)
    with pytest.raises(CorruptRecordError, match=_refusal(db, 1, "[4.0, inf, 6.0]")):
        dataset[1]
    assert dataset[2][1].tolist() == [7, 8, 9]


@pytest.mark.parametrize(
    ("engine", "workers", "output"),
    [("threads", 0, "uint8"), ("threads", 2, "float"), ("threads", 1, "encoded"), ("processes", 1, "uint8")],
)
def test_the_batch_path_skips_a_float_target_that_is_not_finite(
    floats: Path, engine: str, workers: int, output: str
) -> None:
    """On the fused, encoded (device decode) and worker-process paths, under the skip policy, the samples whose
    targets are not finite are left out of their batches (before the fix, NaN and infinities reached the batches)."""
    counter = SkipCounter()
    dataset = LmdbImageDataset(floats, transform=CenterCropResize(16))
    loader = create_loader(
        dataset, 4, engine=engine, workers=workers, output=output, skip_counter=counter, return_index=True,
        normalizer=NORMALIZER,
    )  # fmt: skip
    batches = list(loader)
    index = torch.cat([batch[-1] for batch in batches]).tolist()
    targets = torch.cat([batch[1] for batch in batches])
    assert index == GOOD
    assert targets.tolist() == [VALUES[i] for i in GOOD]
    assert counter.value == len(BAD)
    del loader


def test_the_batch_path_raises_naming_a_float_target_that_is_not_finite(floats: Path) -> None:
    """Without the skip policy a batch holding such a sample raises, naming it; so does the per-sample path."""
    for transform in (CenterCropResize(16), lambda image: image[:, :8, :8].contiguous()):
        dataset = LmdbImageDataset(floats, transform=transform)
        with pytest.raises(CorruptRecordError, match=_refusal(floats, 3, "inf")):
            list(create_loader(dataset, 2, sampler=[2, 3], engine="threads", workers=0))


def test_device_decode_s_dataset_refuses_a_float_target_that_is_not_finite(floats: Path) -> None:
    """``EncodedCropDataset`` (device decode's per-sample reader) refuses the sample before its bytes travel."""
    dataset = EncodedCropDataset(LmdbImageDataset(floats), lambda height, width: (0, 0, height, width), 0.0)
    with pytest.raises(CorruptRecordError, match=_refusal(floats, 5, "-inf")):
        dataset[5]
    assert float(dataset[6][1]) == VALUES[6]


@pytest.mark.parametrize(("label", "position"), [(-1, 2), (3, 1), (-(2**31), 3), (2**31 - 1, 0)])
def test_a_label_array_holding_a_label_outside_the_classes_is_refused_by_targets(
    tmp_path: Path, label: int, position: int
) -> None:
    """A class database whose label array holds ``-1`` or a label past the classes: ``targets`` and ``targets_of``
    refuse it naming the sample and the label (before the fix, ``targets`` returned it), as a record header's
    label outside the classes is refused when the record is read."""
    labels = np.array([0, 1, 2, 0], dtype="<i4")
    labels[position] = label
    db = hostile.write_database(tmp_path / "db", _records(4, label=0), ["a", "b", "c"], labels=labels.tobytes())
    dataset = LmdbImageDataset(db)
    refusal = re.escape(f"split 'train' index {position} of {str(db)!r}: label {label} is outside the 3 classes")
    with pytest.raises(CorruptRecordError, match=refusal):
        _ = dataset.targets
    with pytest.raises(CorruptRecordError, match=refusal):
        dataset.targets_of([(position + 1) % 4, position])
