"""LightningCLI's parse errors said in one line, naming the nearest valid key or class for a misspelled one."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn


class UsageError(Exception):
    """A LightningCLI command line or config that does not parse, said in one line."""


def one_line_parser() -> type:
    """LightningCLI's parser, raising :class:`UsageError` where it would print its whole usage and exit."""
    from lightning.pytorch.cli import LightningArgumentParser

    class _Parser(LightningArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            if not self.exit_on_error:  # jsonargparse's own attempts (union members, nested parsers) catch these
                super().error(message, ex)
            raise UsageError(_usage_line(self, message, ex))

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
