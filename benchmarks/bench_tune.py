"""``num_workers="tune"`` against an exhaustive sweep, on the same data (moved here from the unit tests).

The tuned count must load at least 90% as fast as the best count of an exhaustive sweep, measured interleaved so
both see the same load from anything else running on the machine.

    python benchmarks/bench_tune.py
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from lightning_fastdata import FastImageDataModule, make_image_folder
from lightning_fastdata.pipeline.kernel import BatchReader
from lightning_fastdata.tuning import LoaderConfig, measure, sweep


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = make_image_folder(
            Path(tmp) / "src", num_classes=2, train_per_class=150, val_per_class=0, min_size=64, max_size=160, noise=8
        )
        dm = FastImageDataModule(str(src), cache_dir=str(Path(tmp) / "cache"), num_workers="tune", batch_size=32)
        dm.prepare_data()
        dm.setup("fit")
        budget, tuned = dm.worker_budget(), dm.resolved_num_workers()
        reader = BatchReader(dm.build_dataset("train", dm.train_transform()), "float", dm.normalizer)
        exhaustive = sweep(
            reader, (dm.batch_size,), budget, (), (False,), seconds=1.0, early_stop=1.0, engine=dm.engine
        )
        best = exhaustive.best.config
        tuned_rates, best_rates = [], []
        for _ in range(3):
            config = LoaderConfig(tuned, dm.batch_size, engine=dm.engine)
            tuned_rates.append(measure(reader, config, seconds=1.0).images_per_sec)
            best_rates.append(measure(reader, best, seconds=1.0).images_per_sec)
        print(exhaustive.format_table())
        ratio = statistics.median(tuned_rates) / statistics.median(best_rates)
        print(f"tuned num_workers={tuned}: {ratio:.0%} of the best ({best.num_workers}); target >= 90%")
        raise SystemExit(0 if ratio >= 0.9 else 1)


if __name__ == "__main__":
    main()
