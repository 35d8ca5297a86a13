"""``lightning-fastdata fit|validate|test|predict``: LightningCLI, with any LightningModule and DataModule subclass.

``COMMAND --help`` is read from the text :mod:`~lightning_fastdata.cli.help_cache` keeps, and a misspelled option is
told from it, so that neither imports Lightning; every other command line is LightningCLI's to parse.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_fastdata.cli.common import LIGHTNING_COMMANDS, PROG, error_message
from lightning_fastdata.cli.help_cache import help_columns, help_path, keep_help, quick_usage_error
from lightning_fastdata.cli.usage import UsageError, one_line_parser
from lightning_fastdata.errors import ConversionError, DestinationError, FastDataError

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

#: The end of ``fit --help`` (and validate, test, predict): in subclass mode, LightningCLI lists only ``--data`` itself.
DATA_HELP = (
    "The DataModule's arguments (data_dir, batch_size, num_workers, cache_dir, ...) are not listed above: `{prog}"
    " {command} --data.help FastImageDataModule` lists them (or `--data.help my_data.MyDataModule` for a subclass),"
    " and `--model.help CLASS_PATH` a model's. Set them as `--data.data_dir DIR` or under `data: init_args:` in a"
    " config."
).replace("{prog}", PROG)


def add_parsers(sub: argparse._SubParsersAction) -> None:
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


def _render_help(command: str, from_console: bool = False) -> tuple[int | str | None, str]:
    """LightningCLI's ``COMMAND --help``: its exit code and text, at :func:`help_columns` wide."""
    columns = help_columns()
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
        path = help_path(command)
        if path is None:  # no cache folder for this user
            continue
        if not path.is_file():
            code, text = _render_help(command)
            if code not in (0, None) or not text:
                raise RuntimeError(f"`{PROG} {command} --help` exited {code!r}:\n{text}")
            keep_help(path, text)
        paths.append(path)
    return paths


def _lightning_help(command: str, from_console: bool) -> NoReturn:
    """``COMMAND --help``: LightningCLI's text, kept in the cache, so that only the first call imports Lightning."""
    path = help_path(command)
    if path is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            sys.stdout.write(path.read_text())
            raise SystemExit(0)
    code, text = _render_help(command, from_console)
    sys.stdout.write(text)
    if path is not None and code in (0, None) and text:
        keep_help(path, text)
    raise SystemExit(code)


def run(argv: list[str], from_console: bool) -> int:
    """A LightningCLI sub-command; its usage errors and this package's errors are one ``error:`` line."""
    if argv[1:] in (["--help"], ["-h"]):
        _lightning_help(argv[0], from_console)
    try:
        quick = quick_usage_error(argv[0], argv[1:])
    except Exception:  # a shortcut, never a new way to fail: the full parser decides
        quick = None
    if quick is not None:  # said without importing Lightning
        print(f"error: {quick}", file=sys.stderr)
        return 2
    try:
        # LightningCLI reads sys.argv itself when run from the console: passing it as `args` as well makes it warn
        # that `args` "is intended to run from within Python" on every run
        lightning_cli(None if from_console else argv, parser_class=one_line_parser(), parser_kwargs={"prog": PROG})
    except UsageError as err:
        hint = "" if "did you mean" in str(err) else f" (`{PROG} {argv[0]} --help` lists every option)"
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    except ConversionError as err:
        print(f"error: {error_message(err)}", file=sys.stderr)
        return 2 if isinstance(err, DestinationError) else 1
    except FastDataError as err:
        print(f"error: {error_message(err)}", file=sys.stderr)
        return 2
    except ValueError as err:  # jsonargparse wraps what a class's __init__ raises; only this package's is said so
        cause = err.__cause__
        while cause is not None and not isinstance(cause, FastDataError):
            cause = cause.__cause__
        if cause is None:
            raise
        print(f"error: {error_message(cause)}", file=sys.stderr)
        return 2
    return 0
