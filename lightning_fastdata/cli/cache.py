"""``lightning-fastdata cache list|remove|prune``: the conversions FastImageDataModule made in the cache folder."""

from __future__ import annotations

import argparse

#: The line ``lightning-fastdata --help`` shows for ``cache``.
HELP = "list, remove or prune the conversions FastImageDataModule made in the cache folder"
#: What ``lightning-fastdata cache --help`` says first.
DESCRIPTION = (
    "FastImageDataModule converts each image folder once per set of conversion settings into the cache folder"
    " ($LIGHTNING_FASTDATA_CACHE, else ~/.cache/lightning_fastdata). List those conversions with their source,"
    " settings, size and last use; remove one; or prune by size or age. A conversion being written, or read"
    " by a running process, is never removed."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``cache``'s arguments and its actions ``list``, ``remove`` and ``prune``."""
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


def run(args: argparse.Namespace) -> int:
    """List, remove or prune the cache folder's conversions as ``args.action`` says; the exit code."""
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
