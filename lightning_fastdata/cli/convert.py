"""``lightning-fastdata convert``: an image folder or a list file into a database (``--clean DIR``: what it left)."""

from __future__ import annotations

import argparse

from lightning_fastdata.cli.common import is_url

#: The line ``lightning-fastdata --help`` shows for ``convert``.
HELP = "convert an image folder into an LMDB image database"
#: What ``lightning-fastdata convert --help`` says first.
DESCRIPTION = (
    "Convert SRC, an ImageFolder tree (SRC/<class>/<image>), a root of split trees (SRC/train/<class>/...,"
    " SRC/val/<class>/..., SRC/test/<class>/...; also training, valid, validation, dev, testing, any case) or"
    " a list file (CSV or TSV with a path,label[,split] header, or JSON), into the database DST, in parallel."
    " A list file's labels are classes unless --targets says otherwise; labels that could be read as another"
    " kind (numbers that are not integers, lists, names joined by the --label-sep) are refused until it does."
    " Unchanged sources are not converted twice."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``convert``'s arguments."""
    p.add_argument(
        "src", nargs="?", help="the image folder, or a .csv/.tsv/.json list of path,label[,split] rows, to read"
    )
    p.add_argument(
        "dst",
        nargs="?",
        help="the database directory to write (created, or replaced if it is ours and made from the same SRC), or a"
        " URL to publish it to (s3://bucket/name.lmdb, gs://, az://: converted locally, then uploaded; needs"
        " `pip install 'lightning-fastdata[remote]'`)",
    )
    p.add_argument(
        "--short-side",
        type=int,
        default=256,
        metavar="N",
        help="downscale images whose short side exceeds N pixels to N and store them as JPEG (default 256, fits"
        " training at 224); 0 keeps the original size; never upscales",
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (default 90)")
    p.add_argument(
        "--keep-original",
        action="store_true",
        help="store source JPEGs byte for byte, even when larger than --short-side",
    )
    p.add_argument(
        "--encoding",
        choices=("jpeg", "raw"),
        default="jpeg",
        help="jpeg (default, compact) or raw uint8 pixels (about 10x larger, nothing to decode when reading)",
    )
    p.add_argument(
        "--targets",
        choices=("class", "multilabel", "float", "none"),
        default=None,
        help="what a list file's labels are: class (each distinct label a class), multilabel (class names joined by"
        " --label-sep, or a JSON list; multi-hot targets), float (numbers: the label column, or every column but path"
        " and split, e.g. path,x,y; regression), none (no targets). Default: classes, refusing ambiguous labels."
        " A folder gives class or none",
    )
    p.add_argument(
        "--label-sep",
        default="|",
        metavar="S",
        help="what separates the class names of a multilabel label (default |: cat|outdoor)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: up to the usable CPUs, none for a conversion too small to pay for them);"
        " 0 converts in this process",
    )
    p.add_argument("--strict", action="store_true", help="fail, writing nothing, if any file has to be skipped")
    p.add_argument(
        "--force",
        action="store_true",
        help="convert even if DST is up to date, or replace a DST converted from another source",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--clean",
        metavar="DIR",
        default=None,
        help="instead of converting: remove what interrupted conversions left in DIR (hidden .NAME.partial working"
        " copies and .NAME.lock files that no running conversion holds; a .NAME.old whose NAME is missing is put back)",
    )


def run(args: argparse.Namespace) -> int:
    """Convert ``args.src`` into ``args.dst`` (or clean ``args.clean``) and print the summary; the exit code."""
    from lightning_fastdata.store.conversion import convert
    from lightning_fastdata.store.leftovers import clean_stale_conversions

    if args.clean is not None:
        if is_url(args.clean):
            raise ValueError(f"`--clean` {args.clean!r} is a URL; it cleans a local folder of interrupted conversions.")
        if args.src is not None:
            raise ValueError(f"`--clean DIR` takes no SRC or DST (got {args.src!r}); run the conversion separately.")
        done = clean_stale_conversions(args.clean)
        print("\n".join(done) if done else f"nothing to clean in {args.clean}")
        return 0
    summary = convert(
        args.src,
        args.dst,
        short_side=args.short_side,
        quality=args.quality,
        keep_original=args.keep_original,
        encoding=args.encoding,
        num_workers=args.workers,
        strict=args.strict,
        force=args.force,
        progress=not args.quiet,
        targets=args.targets,
        label_separator=args.label_sep,
    )
    print(summary.format() + (" Use --force to rebuild." if summary.up_to_date else ""))
    return 0
