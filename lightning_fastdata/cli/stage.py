"""``lightning-fastdata stage``: a published database copied into the cache folder, as ``bench`` and ``profile`` do."""

from __future__ import annotations

import argparse
import sys

from lightning_fastdata.cli.common import is_url

#: The line ``lightning-fastdata --help`` shows for ``stage``.
HELP = "copy a database published at a URL into this machine's cache folder, as training would"
#: What ``lightning-fastdata stage --help`` says first.
DESCRIPTION = (
    "Copy the database published at URL (s3://bucket/name.lmdb, gs://, az://, https://; needs `pip install"
    " 'lightning-fastdata[remote]'`) into the cache folder, once: what FastImageDataModule(URL) does in"
    " prepare_data, ahead of training (one task per node in a job script). A copy of the current publication"
    " is reused after one request; an interrupted staging resumes."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``stage``'s arguments."""
    p.add_argument("url", metavar="URL", help="the database's URL, as published by `convert SRC URL`")
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="the local cache folder, as FastImageDataModule's cache_dir (default: $LIGHTNING_FASTDATA_CACHE, else"
        " ~/.cache/lightning_fastdata)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def local_copy(path: str, argument: str) -> str:
    """``path``, or for the URL of a published database its copy staged into the cache folder (once)."""
    if not is_url(path):
        return path
    from lightning_fastdata.store import remote
    from lightning_fastdata.store.format import default_cache_dir

    staged = remote.stage(path, default_cache_dir(), argument=argument)
    shown = remote.redact_url(path)
    print(f"{argument} {shown}: {staged.reason or staged.action}, read from {staged.path}", file=sys.stderr)
    return str(staged.path)


def run(args: argparse.Namespace) -> int:
    """Stage ``args.url`` into the cache folder and say where it is; the exit code."""
    from lightning_fastdata.store import cache, remote

    if not is_url(args.url):
        raise ValueError(f"`URL` {args.url!r} is not a URL; a local database needs no staging (pass it as data_dir).")
    remote.check_local(args.cache_dir, "--cache-dir", "the copy is memory-mapped. Pass a folder on the local disk")
    staged = remote.stage(args.url, cache.cache_root(args.cache_dir), progress=not args.quiet, argument="URL")
    done = {"staged": "staged", "restaged": "staged again", "reused": "already staged", "found": "already staged"}
    shown = remote.redact_url(args.url)
    print(f"{shown}: {done[staged.action]} at {staged.path}" + (f" ({staged.reason})" if staged.reason else ""))
    return 0
