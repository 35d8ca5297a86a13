"""The ``lightning-fastdata`` command line.

``convert`` (and ``convert --clean DIR``), ``synth``, ``bench``, ``profile``, ``cache`` and ``stage`` are parsed here,
each by its module of this package; ``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's
(:mod:`~lightning_fastdata.cli.fit`), with any LightningModule and any
:class:`~lightning_fastdata.FastImageDataModule` subclass named by ``class_path``. No module of this package imports
torch or Lightning until a command needs them, so that ``--help`` and a cached ``fit --help`` start quickly.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_fastdata.__about__ import __version__
from lightning_fastdata.cli import bench, cache, convert, fit, profile, stage, synth
from lightning_fastdata.cli.common import LIGHTNING_COMMANDS, PROG, error_message, is_url
from lightning_fastdata.cli.fit import DATA_HELP, cache_help, lightning_cli
from lightning_fastdata.cli.help_cache import HELP_COLUMNS
from lightning_fastdata.errors import ConversionError, DestinationError, FastDataError, RemoteStorageError

__all__ = [
    "DATA_HELP",
    "HELP_COLUMNS",
    "LIGHTNING_COMMANDS",
    "PROG",
    "build_parser",
    "cache_help",
    "is_url",
    "lightning_cli",
    "main",
]

#: The commands this parser runs, in ``--help``'s order: each module gives ``HELP``, ``DESCRIPTION``,
#: ``add_arguments(parser)`` and ``run(args)`` (the exit code).
_COMMANDS = {"convert": convert, "synth": synth, "bench": bench, "profile": profile, "cache": cache, "stage": stage}


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
    for name, command in _COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION))
    fit.add_parsers(sub)
    return parser


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
        return fit.run(argv, from_console)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parser, args.command, unknown)
    if args.command == "convert" and args.clean is None and args.dst is None:
        parser.error("convert: the following arguments are required: SRC and DST (or --clean DIR)")
    _log_to_stderr()
    try:
        code = _COMMANDS[args.command].run(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:  # `lightning-fastdata convert ... | head -1`: the reader is gone; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process that SIGPIPE ended
    except DestinationError as err:  # bad input: a `dst` that must not be replaced, or cannot be written
        print(f"error: {error_message(err)}", file=sys.stderr)
        return 2
    except (ConversionError, RemoteStorageError) as err:
        print(f"error: {error_message(err)}", file=sys.stderr)
        return 1
    except (FastDataError, FileNotFoundError, ValueError) as err:
        print(f"error: {error_message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was published; run the same command again to start over", file=sys.stderr)
        return 130
