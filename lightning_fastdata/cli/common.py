"""Names every ``lightning-fastdata`` command shares: the program's name, LightningCLI's commands, an error's line."""

from __future__ import annotations

import re

#: Sub-commands handed to LightningCLI.
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
#: The command's name in usage lines and messages, however it was started.
PROG = "lightning-fastdata"


def is_url(path: str | None) -> bool:
    """Whether a path argument is a URL (without importing the store)."""
    return path is not None and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def error_message(err: BaseException) -> str:
    """The error's own message; for one re-raised from a DataLoader worker, without the worker's traceback."""
    text = str(err)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("Error") else last
    return text
