"""``lightning-fastdata bench``: loader throughput over num_workers and batch sizes, and the cheapest fast setting."""

from __future__ import annotations

import argparse
import sys

from lightning_fastdata.cli.stage import local_copy

#: The line ``lightning-fastdata --help`` shows for ``bench``.
HELP = "measure loader throughput over num_workers (and batch size, prefetch_factor, pin_memory); pick the best"
#: What ``lightning-fastdata bench --help`` says first.
DESCRIPTION = (
    "Sweep loader settings over DATA, a database made by `convert` (timed through FastImageDataModule's"
    " training loader, as `fit` builds it: the batch path, the engine, and on CUDA the copy and normalization"
    " on the device) or an ImageFolder tree (torchvision's standard transforms), and mark the cheapest"
    " configuration within 5% of the fastest."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench``'s arguments."""
    p.add_argument("data", help="a database directory, the URL of a published one (staged first), or an image folder")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64], metavar="B", help="batch sizes (default 64)")
    p.add_argument("--max-workers", type=int, default=None, metavar="N", help="default: usable CPUs + 1")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per point (default 1.0)")
    p.add_argument("--image-size", type=int, default=224, help="crop size (default 224)")
    p.add_argument(
        "--engine",
        choices=("threads", "processes"),
        default="threads",
        help="a database's loader engine, as FastImageDataModule(engine=...) (default threads)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the measurements as JSON")
    p.add_argument("--plot", metavar="PNG", default=None, help="also plot images/s against workers (matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Sweep the loader settings over ``args.data`` and print the table; the exit code."""
    import json

    from lightning_fastdata.bench import sweep_dataset
    from lightning_fastdata.tuning import plot_sweep, sweep

    source, kind = sweep_dataset(local_copy(args.data, "data"), args.image_size, engine=args.engine)
    if kind == "database":  # the training loader as `fit` builds it
        engine, how = args.engine, f"FastImageDataModule's training loader, engine={args.engine!r}"
    else:
        engine, how = "processes", "torchvision ImageFolder + standard transforms, DataLoader worker processes"
    print(f"bench: {kind} {args.data} ({how}), {len(source)} samples, {args.seconds:g} s per point")
    result = sweep(
        source, batch_sizes=args.batch_sizes, max_workers=args.max_workers, seconds=args.seconds, engine=engine
    )
    print(result.format_table())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=1)
    if args.plot:
        try:
            plot_sweep(result, args.plot)
        except ImportError:
            print("no plot: matplotlib is not installed (`pip install 'lightning-fastdata[plot]'`)", file=sys.stderr)
    return 0
