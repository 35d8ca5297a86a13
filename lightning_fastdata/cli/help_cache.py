"""Where LightningCLI's ``COMMAND --help`` text is kept, and the typos that text tells without importing Lightning.

``fit --help`` and a misspelled option cost an import of Lightning (seconds) only the first time: the text is kept in
the user's cache folder, keyed by everything it depends on, and read back as it is.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any

from lightning_fastdata.__about__ import __version__

# `COMMAND --help` is rendered at most this wide, as click does by default: one cached text then serves every terminal
# at least this wide, and `make` can cache it ahead, where there is no terminal (80 columns)
HELP_COLUMNS = 80


def help_columns() -> int:
    """The width ``--help`` is rendered at: the terminal's, up to :data:`HELP_COLUMNS`."""
    import shutil

    return min(shutil.get_terminal_size().columns, HELP_COLUMNS)


def help_dir() -> Path | None:
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


def help_path(command: str, columns: int | None = None) -> Path | None:
    """Where ``lightning-fastdata COMMAND --help``'s text is kept, keyed by everything it depends on.

    ``None`` where there is no cache folder (:func:`help_dir`).
    """
    folder = help_dir()
    if folder is None:
        return None
    import hashlib
    from importlib import metadata

    parts = [__version__, sys.version, sys.executable, command, str(columns or help_columns())]
    for package in ("lightning", "jsonargparse", "torch"):
        try:
            parts.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            parts.append("-")
    package_dir = Path(__file__).parents[1]  # lightning_fastdata/, not this cli/ folder
    # an edited checkout: every module, the subpackages' too (store/, monitor/)
    parts += [f"{p.relative_to(package_dir)}:{p.stat().st_mtime_ns}" for p in sorted(package_dir.rglob("*.py"))]
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("JSONARGPARSE"))
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return folder / f"{command}-{digest}.txt"


def keep_help(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half of it); a read-only cache keeps nothing."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _cached_options(command: str) -> list[str] | None:
    """The option strings of ``COMMAND``'s parser, from its cached ``--help`` text; ``None`` when none is cached."""
    path = help_path(command, HELP_COLUMNS)
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


def quick_usage_error(command: str, args: list[str]) -> str | None:
    """A misspelled top-level or ``trainer`` key, in ``args`` or a config file, told from the cached ``--help`` text.

    Parsing the command line needs Lightning (seconds to import) only to find such a typo; this finds it first, saying
    what the parser would (:mod:`~lightning_fastdata.cli.usage`), and gives up (``None``) wherever that is not
    certain: no cached text, no close match, a key under ``model``, ``data``, the optimizer or a class's
    ``init_args``, an abbreviated option.
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
