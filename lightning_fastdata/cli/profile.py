"""``lightning-fastdata profile``: the time of each loading stage per sample, a folder's beside its database's."""

from __future__ import annotations

import argparse

from lightning_fastdata.cli.stage import local_copy

#: The line ``lightning-fastdata --help`` shows for ``profile``.
HELP = "time each loading stage per sample (folder: read, decode, transforms, collate; database: the batch path)"
#: What ``lightning-fastdata profile --help`` says first.
DESCRIPTION = (
    "Per-stage time per sample of the loading path of DATA (an image folder or a database), and of its"
    " counterpart when it exists (a database's source folder; a folder's conversion), with a conclusion."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``profile``'s arguments."""
    p.add_argument("data", help="an image folder, a database directory, or the URL of a published one (staged first)")
    p.add_argument("--db", default=None, help="the folder's database (a path or URL), if not in the default cache")
    p.add_argument("--samples", type=int, default=200, help="samples timed (default 200)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the profiles as JSON")


def run(args: argparse.Namespace) -> int:
    """Time each loading stage of ``args.data`` (and its counterpart) and print the profiles; the exit code."""
    import json

    from lightning_fastdata.profiling import profile

    db = None if args.db is None else local_copy(args.db, "--db")
    profiles = profile(local_copy(args.data, "data"), db, args.samples, args.batch_size, args.image_size)
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
