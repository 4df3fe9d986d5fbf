"""What a `dvi` command prints: its output stream.

While a command runs, `sys.stdout` is stderr (`dvi.cli.main` calls `capture`): a library that prints or logs to stdout
(DeepSpeed's logger is a stdout handler, made when transformers imports DeepSpeed to load a model) then cannot mix its
lines into what the command prints for people and programs (`generate --json`, `config show`, `stream tail`).
Commands print with `out`. This module knows nothing of the commands.
"""

from __future__ import annotations

import sys
from typing import TextIO

ERROR_PREFIX = "dvi: error: "  # how a command's error starts on stderr (dvi.cli.main), as a parent reads it back

_stream: TextIO = sys.stdout


def capture() -> None:
    """The command's output is this process's stdout; everything else that writes to `sys.stdout` goes to stderr."""
    global _stream
    _stream = sys.stdout
    sys.stdout = sys.stderr


def release() -> None:
    sys.stdout = _stream


def stream() -> TextIO:
    return _stream


def out(*args, **kwargs) -> None:
    """print() to the command's output."""
    print(*args, file=_stream, **kwargs)
