"""The ``lightning-fastdata`` command line.

``convert`` (and ``convert --clean DIR``), ``synth``, ``bench``, ``profile`` and ``cache`` are parsed here; ``fit``,
``validate``, ``test`` and ``predict`` are LightningCLI's, with any LightningModule and any
:class:`~lightning_fastdata.FastImageDataModule` subclass named by ``class_path``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_fastdata.__about__ import __version__
from lightning_fastdata.errors import ConversionError, DestinationError, FastDataError, RemoteStorageError

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

#: Sub-commands handed to LightningCLI.
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
#: The command's name in usage lines and messages, however it was started.
PROG = "lightning-fastdata"
#: The end of ``fit --help`` (and validate, test, predict): in subclass mode, LightningCLI lists only ``--data`` itself.
DATA_HELP = (
    "The DataModule's arguments (data_dir, batch_size, num_workers, cache_dir, ...) are not listed above: `{prog}"
    " {command} --data.help FastImageDataModule` lists them (or `--data.help my_data.MyDataModule` for a subclass),"
    " and `--model.help CLASS_PATH` a model's. Set them as `--data.data_dir DIR` or under `data: init_args:` in a"
    " config."
).replace("{prog}", PROG)
# `COMMAND --help` is rendered at most this wide, as click does by default: one cached text then serves every terminal
# at least this wide, and `make` can cache it ahead, where there is no terminal (80 columns)
HELP_COLUMNS = 80


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert an image folder into an LMDB image database",
        description=(
            "Convert SRC, an ImageFolder tree (SRC/<class>/<image>), a root of split trees (SRC/train/<class>/...,"
            " SRC/val/<class>/..., SRC/test/<class>/...; also training, valid, validation, dev, testing, any case) or"
            " a list file (CSV or TSV with a path,label[,split] header, or JSON), into the database DST, in parallel."
            " A list file's labels are classes unless --targets says otherwise; labels that could be read as another"
            " kind (numbers that are not integers, lists, names joined by the --label-sep) are refused until it does."
            " Unchanged sources are not converted twice."
        ),
    )
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


def _add_lightning(sub: argparse._SubParsersAction) -> None:
    """List LightningCLI's sub-commands (they are parsed by LightningCLI, never by this parser)."""
    helps = {
        "fit": "train a LightningModule on a FastImageDataModule with LightningCLI (`fit --help` lists every option;"
        " `fit --data.help FastImageDataModule` the DataModule's)",
        "validate": "run the validation loop with LightningCLI",
        "test": "run the test loop on the test split with LightningCLI",
        "predict": "predict with LightningCLI; the lightning_fastdata.PredictionWriter callback writes the predictions"
        " to a CSV or JSON Lines file, one row per image",
    }
    for command in LIGHTNING_COMMANDS:
        sub.add_parser(command, help=helps[command], add_help=False)


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic image folder of smooth JPEGs (for demos and benchmarks)",
        description="Write DST/train/<class>/*.jpg and DST/val/<class>/*.jpg (or DST/<class>/*.jpg with --val 0).",
    )
    p.add_argument("dst", help="the folder to write")
    p.add_argument("--classes", type=int, default=4, help="number of classes (default 4)")
    p.add_argument("--train", type=int, default=64, help="training images per class (default 64)")
    p.add_argument("--val", type=int, default=16, help="validation images per class; 0 for a plain ImageFolder")
    p.add_argument("--min-size", type=int, default=300, help="smallest side length drawn (default 300)")
    p.add_argument("--max-size", type=int, default=640, help="largest side length drawn (default 640)")
    p.add_argument("--noise", type=float, default=0.0, help="photo-like grain, pixel std on 0-255 (default 0: smooth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write into DST even when it already holds files")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure loader throughput over num_workers (and batch size, prefetch_factor, pin_memory); pick the best",
        description=(
            "Sweep loader settings over DATA, a database made by `convert` (timed through FastImageDataModule's"
            " training loader, as `fit` builds it: the batch path, the engine, and on CUDA the copy and normalization"
            " on the device) or an ImageFolder tree (torchvision's standard transforms), and mark the cheapest"
            " configuration within 5% of the fastest."
        ),
    )
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


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="time each loading stage per sample (folder: read, decode, transforms, collate; database: the batch path)",
        description=(
            "Per-stage time per sample of the loading path of DATA (an image folder or a database), and of its"
            " counterpart when it exists (a database's source folder; a folder's conversion), with a conclusion."
        ),
    )
    p.add_argument("data", help="an image folder, a database directory, or the URL of a published one (staged first)")
    p.add_argument("--db", default=None, help="the folder's database (a path or URL), if not in the default cache")
    p.add_argument("--samples", type=int, default=200, help="samples timed (default 200)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the profiles as JSON")


def _add_cache(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="list, remove or prune the conversions FastImageDataModule made in the cache folder",
        description=(
            "FastImageDataModule converts each image folder once per set of conversion settings into the cache folder"
            " ($LIGHTNING_FASTDATA_CACHE, else ~/.cache/lightning_fastdata). List those conversions with their source,"
            " settings, size and last use; remove one; or prune by size or age. A conversion being written, or read"
            " by a running process, is never removed."
        ),
    )
    cache_dir_help = "the cache folder (default: as above)"
    p.add_argument("--cache-dir", default=None, metavar="DIR", help=cache_dir_help)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="each conversion: key, size, last use, settings, source")
    listing.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    remove = actions.add_parser("remove", help="remove one conversion")
    remove.add_argument("target", metavar="KEY|PATH", help="a key as `cache list` shows it, or the conversion's path")
    prune = actions.add_parser(
        "prune",
        help="remove conversions unused for a while, then the least recently used until the rest fit a size",
    )
    for action in (listing, remove, prune):  # `cache list --cache-dir DIR` as well as `cache --cache-dir DIR list`
        action.add_argument("--cache-dir", default=argparse.SUPPRESS, metavar="DIR", help=cache_dir_help)
    prune.add_argument("--max-size", default=None, metavar="SIZE", help="keep at most SIZE in all: 20GB, 500MB, 20GiB")
    prune.add_argument("--older-than", default=None, metavar="AGE", help="remove those unused for AGE: 30d, 12h, 2w")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def _add_stage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stage",
        help="copy a database published at a URL into this machine's cache folder, as training would",
        description=(
            "Copy the database published at URL (s3://bucket/name.lmdb, gs://, az://, https://; needs `pip install"
            " 'lightning-fastdata[remote]'`) into the cache folder, once: what FastImageDataModule(URL) does in"
            " prepare_data, ahead of training (one task per node in a job script). A copy of the current publication"
            " is reused after one request; an interrupted staging resumes."
        ),
    )
    p.add_argument("url", metavar="URL", help="the database's URL, as published by `convert SRC URL`")
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="the local cache folder, as FastImageDataModule's cache_dir (default: $LIGHTNING_FASTDATA_CACHE, else"
        " ~/.cache/lightning_fastdata)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-fastdata`` (the Lightning sub-commands are parsed by LightningCLI)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Input-fast image training tools.",
        epilog="Training: `lightning-fastdata fit --config CONFIG.yaml` runs LightningCLI with any LightningModule"
        " and any FastImageDataModule subclass named by `class_path`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(sub)
    _add_synth(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_cache(sub)
    _add_stage(sub)
    _add_lightning(sub)
    return parser


def _convert(args: argparse.Namespace) -> int:
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


def _synth(args: argparse.Namespace) -> int:
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


def is_url(path: str | None) -> bool:
    """Whether a path argument is a URL (without importing the store)."""
    return path is not None and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def _local(path: str, argument: str) -> str:
    """``path``, or for the URL of a published database its copy staged into the cache folder (once)."""
    if not is_url(path):
        return path
    from lightning_fastdata.store import remote
    from lightning_fastdata.store.format import default_cache_dir

    staged = remote.stage(path, default_cache_dir(), argument=argument)
    shown = remote.redact_url(path)
    print(f"{argument} {shown}: {staged.reason or staged.action}, read from {staged.path}", file=sys.stderr)
    return str(staged.path)


def _bench(args: argparse.Namespace) -> int:
    import json

    from lightning_fastdata.bench import sweep_dataset
    from lightning_fastdata.tuning import plot_sweep, sweep

    source, kind = sweep_dataset(_local(args.data, "data"), args.image_size, engine=args.engine)
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


def _profile(args: argparse.Namespace) -> int:
    import json

    from lightning_fastdata.profiling import profile

    db = None if args.db is None else _local(args.db, "--db")
    profiles = profile(_local(args.data, "data"), db, args.samples, args.batch_size, args.image_size)
    for item in profiles:
        print(item.format_table())
        print(item.conclusion())
        print()
    if len(profiles) == 2:
        folder, database = profiles
        print(
            f"per sample: {folder.total_ms:.2f} ms from the folder, {database.total_ms:.2f} ms from the database"
            f" ({folder.total_ms / database.total_ms:.1f}x less work per sample)"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                [
                    {
                        "name": p.name,
                        "path": p.path,
                        "samples": p.samples,
                        "stages_ms": p.stages,
                        "conclusion": p.conclusion(),
                        "skipped": [{"path": item.path, "reason": item.reason} for item in p.skipped],
                    }
                    for p in profiles
                ],
                fh,
                indent=1,
            )
    return 0


def _stage(args: argparse.Namespace) -> int:
    from lightning_fastdata.store import cache, remote

    if not is_url(args.url):
        raise ValueError(f"`URL` {args.url!r} is not a URL; a local database needs no staging (pass it as data_dir).")
    remote.check_local(args.cache_dir, "--cache-dir", "the copy is memory-mapped. Pass a folder on the local disk")
    staged = remote.stage(args.url, cache.cache_root(args.cache_dir), progress=not args.quiet, argument="URL")
    done = {"staged": "staged", "restaged": "staged again", "reused": "already staged", "found": "already staged"}
    shown = remote.redact_url(args.url)
    print(f"{shown}: {done[staged.action]} at {staged.path}" + (f" ({staged.reason})" if staged.reason else ""))
    return 0


def _cache(args: argparse.Namespace) -> int:
    import json
    import time

    from lightning_fastdata.store import cache
    from lightning_fastdata.store.summary import human_bytes

    if args.action == "remove":
        print(cache.remove_conversion(args.target, args.cache_dir))
        return 0
    if args.action == "prune":
        max_size = None if args.max_size is None else cache.parse_size(args.max_size)
        older_than = None if args.older_than is None else cache.parse_age(args.older_than)
        done = cache.prune_cache(args.cache_dir, max_size, older_than, args.dry_run)
        print("\n".join(done) if done else "nothing to prune")
        return 0
    conversions = cache.list_conversions(args.cache_dir)
    elsewhere = cache.converted_elsewhere(args.cache_dir)  # `convert SRC DST`'s: listed, never removed from here
    if args.json:
        print(json.dumps([c.to_dict() for c in conversions + elsewhere], indent=1))
        return 0
    root = cache.cache_root(args.cache_dir)
    if not conversions and not elsewhere:
        print(f"no conversions in {root}")
        return 0
    now = time.time()
    for c in conversions:
        settings = " ".join(f"{k}={v}" for k, v in c.settings.items())
        status = c.state + (", in use" if c.in_use else "")
        print(f"{c.key}  {human_bytes(c.size)}  last used {(now - c.last_used) / 86400:.1f} days ago  {status}")
        source = f"{c.staged_from} (staged; converted from {c.source or '?'})" if c.staged_from else c.source or "?"
        print(f"    source {source}  {settings}  targets {c.targets or '?'}")
    total = sum(c.size for c in conversions)
    print(f"{len(conversions)} conversion(s), {human_bytes(total)} in {root}")
    if elsewhere:
        print("\nmade by `lightning-fastdata convert SRC DST` outside the cache folder (not removed by `cache`):")
        for c in elsewhere:
            settings = " ".join(f"{k}={v}" for k, v in c.settings.items())
            print(f"{c.path}  {human_bytes(c.size)}  last used {(now - c.last_used) / 86400:.1f} days ago")
            print(f"    source {c.source}  {settings}  targets {c.targets or '?'}")
    return 0


def lightning_cli(args: Sequence[str] | None, run: bool = True, **kwargs: Any) -> LightningCLI:
    """LightningCLI with a model and a :class:`~lightning_fastdata.FastImageDataModule`, both in subclass mode.

    Classes are named by ``class_path`` in the config; the working directory is importable, so a user's own
    ``my_model.MyModel`` and ``my_data.MyDataModule`` (a FastImageDataModule subclass whose ``**kwargs`` pass the
    parent's arguments through) work without installing anything. ``args=None`` reads ``sys.argv[1:]`` (the
    console script); a list is parsed as if typed on the command line.
    """
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_fastdata import presets  # noqa: F401 - registers the `ddp_fastdata` strategies for the configs
    from lightning_fastdata.datamodule import FastImageDataModule
    from lightning_fastdata.monitor import LoaderMonitor  # noqa: F401 - a Callback jsonargparse then knows by name

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    parser_kwargs = kwargs["parser_kwargs"] = dict(kwargs.get("parser_kwargs") or {})
    for command in LIGHTNING_COMMANDS:  # each command's --help ends saying how to see the DataModule's options
        parser_kwargs[command] = {"epilog": DATA_HELP.format(command=command), **parser_kwargs.get(command, {})}
    return LightningCLI(
        LightningModule,
        FastImageDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=None if args is None else list(args),
        run=run,
        **kwargs,
    )


def _message(err: BaseException) -> str:
    """The error's own message; for one re-raised from a DataLoader worker, without the worker's traceback."""
    text = str(err)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("Error") else last
    return text


class _UsageError(Exception):
    """A LightningCLI command line or config that does not parse, said in one line."""


def _one_line_parser() -> type:
    """LightningCLI's parser, raising :class:`_UsageError` where it would print its whole usage and exit."""
    from lightning.pytorch.cli import LightningArgumentParser

    class _Parser(LightningArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            if not self.exit_on_error:  # jsonargparse's own attempts (union members, nested parsers) catch these
                super().error(message, ex)
            raise _UsageError(_usage_line(self, message, ex))

    return _Parser


def _usage_line(parser: Any, message: str, ex: Exception | None = None) -> str:
    """One line for a jsonargparse error, naming the nearest valid key for a misspelled one."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    group = re.match(r'Parser key "([^"]+)"', lines[0])
    key = group.group(1) if group else None
    unknown = next((m for m in (re.search(r"Option '([^']+)' is not accepted", line) for line in lines) if m), None)
    if unknown is not None and key is not None:
        cls = _class_of(parser, key, message)
        name = unknown.group(1)
        close = difflib.get_close_matches(name, _init_arguments(cls), n=1, cutoff=0.6) if cls is not None else []
        owner = f" ({cls.__name__})" if cls is not None else ""
        hint = f"; did you mean `{close[0]}` (`--{key}.init_args.{close[0]}`)?" if close else "."
        return f"`{key}`{owner} has no argument `{name}`{hint}"
    unknown_key = re.match(r"(Subcommand|Group) '([^']+)' does not accept option '([^']+)'", lines[0])
    if unknown_key is not None:  # a config's key: `trainer: {max_epoch: 2}`
        kind, owner, name = unknown_key.groups()
        name = name if kind == "Subcommand" else f"{owner}.{name}"
        keys = [action.dest for action in getattr(ex, "subcommand_parser", parser)._actions]
        keys = [dest for dest in keys if not name.startswith(f"{dest}.")]  # `trainer` is no answer to `trainer.zzz`
        close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
        return f"unknown key `{name}`" + (f"; did you mean `{close[0]}`?" if close else "")
    required = next((m for m in (re.search(r"arguments are required: (.+)", line) for line in lines) if m), None)
    if required is not None:
        names = [n.strip() for n in required.group(1).split(",")]
        keys = [f"{key}.init_args.{n}" if key else n for n in names]
        return (
            f"{', '.join(f'`{k}`' for k in keys)} {'is' if len(keys) == 1 else 'are'} required: set"
            f" {'it' if len(keys) == 1 else 'them'} in the config or pass {' '.join(f'`--{k} ...`' for k in keys)}."
        )
    unrecognized = re.match(r"unrecognized arguments: (.+)", lines[0])
    if unrecognized is not None:
        options = [tok.split("=", 1)[0] for tok in unrecognized.group(1).split() if tok.startswith("-")]
        if options:
            close = difflib.get_close_matches(options[0], _option_strings(parser), n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else f". `{parser.prog} --help` lists every option."
            return f"unrecognized option `{options[0]}`{hint}"
    return _rejected_value(message) or lines[0]


def _rejected_value(message: str) -> str | None:
    """``key: reason`` for a value jsonargparse rejects, from the innermost of its nested errors.

    jsonargparse nests a ``Parser key "..."`` block per level (``data``, then the class's argument), lists every
    union member's error (``- Expected a <class 'NoneType'>`` among them) and ends each level with the given value.
    """
    keys: list[str] = []
    class_path, class_reason = None, None  # the class given, and the first reason given for it
    expected: list[tuple[int, str, str | None]] = []  # (indent, type, value)
    given, reasons = None, []
    for raw in message.splitlines():
        text = raw.strip().removeprefix("- ")
        if (found := re.fullmatch(r'Parser key "([^"]+)":', text)) is not None:
            keys += ["init_args", found[1]] if class_path and keys else [found[1]]
            class_path = None
        elif (found := re.fullmatch(r"Problem with given class_path '([^']+)':", text)) is not None:
            class_path, class_reason = found[1], None
        elif (found := re.fullmatch(r"Expected a (.+?)(?:\. Got value: (.*))?", text)) is not None:
            if found[1] != "<class 'NoneType'>" and not found[1].startswith("path but "):
                expected.append((len(raw) - len(raw.lstrip()), found[1], found[2]))
        elif text.startswith("Given value: "):
            given = given if given is not None else text.removeprefix("Given value: ")
        elif text and not text.startswith(("Does not validate against", "Subtypes:", "Errors:", "Given value type:")):
            reasons.append(text)
            # a list's member (`trainer.callbacks`) goes on with the forms a subclass may take: not the reason
            class_reason = text if class_path is not None and class_reason is None else class_reason
    if not keys:
        return None
    key = ".".join(keys)
    if expected:
        deepest = max(indent for indent, _, _ in expected)
        types = list(dict.fromkeys(_type_name(hint) for indent, hint, _ in expected if indent == deepest))
        value = next((got for indent, _, got in expected if indent == deepest and got is not None), given)
        short = re.fullmatch(r"a dot import path string: (\w+)", types[0])
        if short is not None:  # `--trainer.callbacks+=LoaderMonitr`: a class name that no imported class has
            return f"`{key}`: {short[1]!r} is not a class jsonargparse knows{_class_hint(short[1])}"
        return f"`{key}`: expected {' or '.join(types)}" + (f", got {value!r}" if value is not None else "")
    if not reasons:
        return None
    if class_path is None:
        return f"`{key}`: {reasons[-1]}"
    hint, reason = "", class_reason or reasons[-1]
    missing = re.fullmatch(r"module '([\w.]+)' has no attribute '(\w+)'", reason)
    if missing is not None and missing[1] in sys.modules:  # a misspelled class of a module that imports
        # dir(): a package's lazily imported names too (`lightning_fastdata.LoaderMonitor`)
        names = [name for name in dir(sys.modules[missing[1]]) if name[:1].isupper()]
        close = difflib.get_close_matches(missing[2], names, n=1, cutoff=0.6)
        hint = f"; did you mean `{missing[1]}.{close[0]}`?" if close else ""
    unknown = re.fullmatch(r"No module named '([\w.]+)'", reason)
    if unknown is not None:  # a module of the user's, not installed: imported from the working directory
        top = unknown[1].split(".")[0]
        hint = (
            f"; `{top}` is imported from the working directory or PYTHONPATH: run from the folder that holds `{top}/`"
            " (for examples/configs/*.yaml, the repository root), or add that folder to PYTHONPATH"
        )
    return f"`{key}.class_path` {class_path!r}: {reason}{hint}"


def _class_hint(name: str) -> str:
    """A hint for a class name that no imported class has: the nearest class of this package or Lightning's callbacks.

    ``; did you mean `lightning_fastdata.LoaderMonitor`?``, else ``. Give the class path: `module.Class`.``.
    """
    for module in ("lightning_fastdata", "lightning.pytorch.callbacks"):
        names = [n for n in dir(sys.modules[module]) if n[:1].isupper()] if module in sys.modules else []
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if close:
            return f"; did you mean `{module}.{close[0]}`?"
    return ". Give the class path: `module.Class`."


def _type_name(hint: str) -> str:
    """``an int``, ``one of 'a', 'b'``: a jsonargparse type hint (``<class 'int'>``, ``typing.Literal['a', 'b']``)."""
    literal = re.fullmatch(r"typing(?:_extensions)?\.Literal\[(.*)\]", hint)
    if literal is not None:
        return f"one of {literal[1]}"
    name = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", hint)
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _class_of(parser: Any, key: str, message: str) -> type | None:
    """The class given for ``key`` (``data``, ``model``): in the message, the command line or the config files."""
    import importlib

    import yaml

    found = re.search(r"class_path '([\w.]+)'", message)
    path = found.group(1) if found else None
    args = list(getattr(parser, "args", None) or [])
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if found is None and name in (f"--{key}", f"--{key}.class_path") and not value.startswith("{"):
            path = value if not os.path.isfile(value) else path
        elif found is None and name in ("-c", "--config") and os.path.isfile(value):
            with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
                config = yaml.safe_load(Path(value).read_text())
                path = config.get(key, {}).get("class_path", path)
    if path is None or "." not in path:
        if key != "data":
            return None
        path = "lightning_fastdata.FastImageDataModule"
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _init_arguments(cls: type) -> list[str]:
    """The ``__init__`` arguments of ``cls`` and, through ``**kwargs``, of its bases."""
    import inspect

    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _option_strings(parser: Any) -> list[str]:
    """Every option of ``parser``, and ``--data.init_args.<argument>`` for FastImageDataModule's arguments."""
    from lightning_fastdata.datamodule import FastImageDataModule

    options = [opt for action in parser._actions for opt in action.option_strings]
    return options + [f"--data.init_args.{name}" for name in _init_arguments(FastImageDataModule)]


def _help_columns() -> int:
    """The width ``--help`` is rendered at: the terminal's, up to :data:`HELP_COLUMNS`."""
    import shutil

    return min(shutil.get_terminal_size().columns, HELP_COLUMNS)


def _help_dir() -> Path | None:
    """Where ``--help`` texts are kept: the user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``).

    Not ``$LIGHTNING_FASTDATA_CACHE``: that names where databases go (often a job's scratch disk), while the text
    depends only on what is installed; a new data cache made the first ``fit --help`` import Lightning again.
    ``None`` for a user without a home (a container's arbitrary uid): nothing is cached.
    """
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no $HOME and no passwd entry
            return None
    return Path(base).expanduser() / "lightning_fastdata" / "cli-help"


def _help_cache(command: str, columns: int | None = None) -> Path | None:
    """Where ``lightning-fastdata COMMAND --help``'s text is kept, keyed by everything it depends on.

    ``None`` where there is no cache folder (:func:`_help_dir`).
    """
    folder = _help_dir()
    if folder is None:
        return None
    import hashlib
    from importlib import metadata

    parts = [__version__, sys.version, sys.executable, command, str(columns or _help_columns())]
    for package in ("lightning", "jsonargparse", "torch"):
        try:
            parts.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            parts.append("-")
    package_dir = Path(__file__).parent
    # an edited checkout: every module, the subpackages' too (store/, monitor/)
    parts += [f"{p.relative_to(package_dir)}:{p.stat().st_mtime_ns}" for p in sorted(package_dir.rglob("*.py"))]
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("JSONARGPARSE"))
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return folder / f"{command}-{digest}.txt"


def _render_help(command: str, from_console: bool = False) -> tuple[int | str | None, str]:
    """LightningCLI's ``COMMAND --help``: its exit code and text, at :func:`_help_columns` wide."""
    columns = _help_columns()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)  # argparse and jsonargparse wrap at COLUMNS - 2
    buffer = io.StringIO()
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(buffer):
            lightning_cli(None if from_console else [command, "--help"], parser_kwargs={"prog": PROG})
    except SystemExit as done:
        code = done.code
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return code, buffer.getvalue()


def _keep_help(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half of it); a read-only cache keeps nothing."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def cache_help(commands: Sequence[str] = LIGHTNING_COMMANDS) -> list[Path]:
    """Render ``COMMAND --help`` for each command into the cache now, importing Lightning once for all of them.

    The first ``lightning-fastdata fit --help`` after an install otherwise pays for importing Lightning (seconds);
    ``make`` calls this after installing, and an image build (a Dockerfile) can do the same::

        python -c "from lightning_fastdata.cli import cache_help; cache_help()"

    Returns the cached files. Text already cached is kept; nothing is written where the cache is read-only.
    """
    paths = []
    for command in commands:
        if command not in LIGHTNING_COMMANDS:
            raise ValueError(f"{command!r} is not one of LightningCLI's commands {LIGHTNING_COMMANDS}")
        path = _help_cache(command)
        if path is None:  # no cache folder for this user
            continue
        if not path.is_file():
            code, text = _render_help(command)
            if code not in (0, None) or not text:
                raise RuntimeError(f"`{PROG} {command} --help` exited {code!r}:\n{text}")
            _keep_help(path, text)
        paths.append(path)
    return paths


def _lightning_help(command: str, from_console: bool) -> NoReturn:
    """``COMMAND --help``: LightningCLI's text, kept in the cache, so that only the first call imports Lightning."""
    path = _help_cache(command)
    if path is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            sys.stdout.write(path.read_text())
            raise SystemExit(0)
    code, text = _render_help(command, from_console)
    sys.stdout.write(text)
    if path is not None and code in (0, None) and text:
        _keep_help(path, text)
    raise SystemExit(code)


def _cached_options(command: str) -> list[str] | None:
    """The option strings of ``COMMAND``'s parser, from its cached ``--help`` text; ``None`` when none is cached."""
    path = _help_cache(command, HELP_COLUMNS)
    try:
        text = path.read_text() if path is not None else ""
    except (OSError, UnicodeDecodeError):
        return None
    options = []
    for line in text.splitlines():
        if line.startswith("  -"):  # `  -c CONFIG, --config CONFIG   Path to ...`: the option strings, then the text
            head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            options += [part.split()[0] for part in head.split(", ") if part.startswith("-")]
    return options or None


def _quick_usage_error(command: str, args: list[str]) -> str | None:
    """A misspelled top-level or ``trainer`` key, in ``args`` or a config file, told from the cached ``--help`` text.

    Parsing the command line needs Lightning (seconds to import) only to find such a typo; this finds it first, saying
    what the parser would (:func:`_usage_line`), and gives up (``None``) wherever that is not certain: no cached text,
    no close match, a key under ``model``, ``data``, the optimizer or a class's ``init_args``, an abbreviated option.
    """
    import yaml

    options = _cached_options(command)
    if options is None:
        return None
    keys = list(dict.fromkeys(opt[2:].rstrip("+") for opt in options if opt.startswith("--")))
    keys = [key for key in keys if not key.endswith(".help")]  # `--trainer.logger.help CLASS`: no key of a config
    tops = {key for key in keys if "." not in key} - {"model", "data", "optimizer", "lr_scheduler"}

    def unknown(name: str) -> bool:  # a key no option is or holds (`trainer.logger` holds `trainer.logger.init_args.x`)
        return name not in keys and not any(name.startswith(f"{key}.") for key in keys if "." in key)

    def nearest(name: str, candidates: list[str]) -> str | None:
        others = [key for key in candidates if not name.startswith(f"{key}.")]
        close = difflib.get_close_matches(name, others, n=1, cutoff=0.6)
        return close[0] if close else None

    def first_leaf(name: str, value: Any) -> str | None:  # jsonargparse names a mapping's first key in full
        while isinstance(value, dict):
            if not value or "class_path" in value or "init_args" in value:  # named otherwise: left to jsonargparse
                return None
            key, value = next(iter(value.items()))
            name = f"{name}.{key}"
        return name

    configs, i = [], 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in ("-c", "--config"):
            configs.append(value if eq else args[i + 1] if i + 1 < len(args) else "")
            i += 1 if eq else 2
            continue
        if arg.startswith("--") and name not in options and not any(opt.startswith(name) for opt in options):
            top = name[2:].split(".")[0]
            if unknown(name[2:]) and (top in tops or top not in keys):  # not a class's argument (`--data.x`)
                close = nearest(name, options)
                return f"unrecognized option `{name}`; did you mean `{close}`?" if close else None
        i += 1
    for config in configs:
        try:
            loaded = yaml.safe_load(Path(config).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
        if not isinstance(loaded, dict):
            return None
        for top, value in loaded.items():
            found = None
            if not isinstance(top, str) or "." in top:
                return None
            if top not in keys:
                found = first_leaf(top, value)
            elif top == "trainer" and isinstance(value, dict):
                for sub, sub_value in value.items():
                    if not isinstance(sub, str) or "." in sub:
                        return None
                    if f"trainer.{sub}" not in keys:
                        found = first_leaf(f"trainer.{sub}", sub_value)
                        break
            if found is not None:
                close = nearest(found, keys)
                return f"unknown key `{found}`; did you mean `{close}`?" if close else None
    return None


def _lightning(argv: list[str], from_console: bool) -> int:
    """A LightningCLI sub-command; its usage errors and this package's errors are one ``error:`` line."""
    if argv[1:] in (["--help"], ["-h"]):
        _lightning_help(argv[0], from_console)
    try:
        quick = _quick_usage_error(argv[0], argv[1:])
    except Exception:  # a shortcut, never a new way to fail: the full parser decides
        quick = None
    if quick is not None:  # said without importing Lightning
        print(f"error: {quick}", file=sys.stderr)
        return 2
    try:
        # LightningCLI reads sys.argv itself when run from the console: passing it as `args` as well makes it warn
        # that `args` "is intended to run from within Python" on every run
        lightning_cli(None if from_console else argv, parser_class=_one_line_parser(), parser_kwargs={"prog": PROG})
    except _UsageError as err:
        hint = "" if "did you mean" in str(err) else f" (`{PROG} {argv[0]} --help` lists every option)"
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    except ConversionError as err:
        print(f"error: {_message(err)}", file=sys.stderr)
        return 2 if isinstance(err, DestinationError) else 1
    except FastDataError as err:
        print(f"error: {_message(err)}", file=sys.stderr)
        return 2
    except ValueError as err:  # jsonargparse wraps what a class's __init__ raises; only this package's is said so
        cause = err.__cause__
        while cause is not None and not isinstance(cause, FastDataError):
            cause = cause.__cause__
        if cause is None:
            raise
        print(f"error: {_message(cause)}", file=sys.stderr)
        return 2
    return 0


def _unrecognized(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> NoReturn:
    """Exit 2 as argparse does for ``unknown`` arguments of ``command``, naming the nearest option of a misspelled one.

    ``convert --short-size 128``: ``unrecognized arguments: --short-size 128; did you mean --short-side?``.
    """
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    message = f"unrecognized arguments: {' '.join(unknown)}"
    options = [opt for action in sub._actions for opt in action.option_strings if opt.startswith("--")]
    for token in unknown:
        close = difflib.get_close_matches(token.split("=", 1)[0], options, n=1, cutoff=0.6)
        if token.startswith("--") and close:
            message += f"; did you mean {close[0]}?"
            break
    sub.error(message)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes, not as it was when the handler was made."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _log_to_stderr() -> None:
    """Show this package's log lines (INFO and up, bare messages) on stderr; other libraries' loggers are left alone.

    Not the root logger, whose INFO level would let botocore say "Found credentials in environment variables." on
    every run against a bucket. As ``logging.basicConfig`` does, nothing is changed where logging is already set up
    (a program calling :func:`main`, or pytest).
    """
    logger = logging.getLogger("lightning_fastdata")
    if logging.getLogger().handlers or any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-fastdata`` console script."""
    from_console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHTNING_COMMANDS:
        return _lightning(argv, from_console)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parser, args.command, unknown)
    if args.command == "convert" and args.clean is None and args.dst is None:
        parser.error("convert: the following arguments are required: SRC and DST (or --clean DIR)")
    _log_to_stderr()
    handlers = {
        "convert": _convert, "synth": _synth, "bench": _bench, "profile": _profile, "cache": _cache, "stage": _stage,
    }  # fmt: skip
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:  # `lightning-fastdata convert ... | head -1`: the reader is gone; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process that SIGPIPE ended
    except DestinationError as err:  # bad input: a `dst` that must not be replaced, or cannot be written
        print(f"error: {_message(err)}", file=sys.stderr)
        return 2
    except (ConversionError, RemoteStorageError) as err:
        print(f"error: {_message(err)}", file=sys.stderr)
        return 1
    except (FastDataError, FileNotFoundError, ValueError) as err:
        print(f"error: {_message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was published; run the same command again to start over", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
