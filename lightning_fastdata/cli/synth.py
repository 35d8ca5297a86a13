"""``lightning-fastdata synth``: a folder of synthetic JPEGs for demos and benchmarks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: The line ``lightning-fastdata --help`` shows for ``synth``.
HELP = "write a synthetic image folder of smooth JPEGs (for demos and benchmarks)"
#: What ``lightning-fastdata synth --help`` says first.
DESCRIPTION = "Write DST/train/<class>/*.jpg and DST/val/<class>/*.jpg (or DST/<class>/*.jpg with --val 0)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``synth``'s arguments."""
    p.add_argument("dst", help="the folder to write")
    p.add_argument("--classes", type=int, default=4, help="number of classes (default 4)")
    p.add_argument("--train", type=int, default=64, help="training images per class (default 64)")
    p.add_argument("--val", type=int, default=16, help="validation images per class; 0 for a plain ImageFolder")
    p.add_argument("--min-size", type=int, default=300, help="smallest side length drawn (default 300)")
    p.add_argument("--max-size", type=int, default=640, help="largest side length drawn (default 640)")
    p.add_argument("--noise", type=float, default=0.0, help="photo-like grain, pixel std on 0-255 (default 0: smooth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write into DST even when it already holds files")


def run(args: argparse.Namespace) -> int:
    """Write the synthetic image folder ``args.dst``; the exit code (2 for a folder that holds files)."""
    from lightning_fastdata.synthetic import make_image_folder

    dst = Path(args.dst).expanduser()
    held = sorted(e.name for e in dst.iterdir() if not e.name.startswith(".")) if dst.is_dir() else []
    if held and not args.force:
        print(
            f"error: `dst` {str(dst)!r} is not empty (it holds {len(held)} entries: {', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}); synth would add its classes to them and overwrite same-named"
            " images. Pick a new folder, or pass --force to write into it anyway.",
            file=sys.stderr,
        )
        return 2
    root = make_image_folder(
        args.dst,
        num_classes=args.classes,
        train_per_class=args.train,
        val_per_class=args.val,
        min_size=args.min_size,
        max_size=args.max_size,
        noise=args.noise,
        seed=args.seed,
    )
    total = args.classes * (args.train + args.val)
    print(f"wrote {total} synthetic JPEGs in {args.classes} classes to {root}")
    return 0
