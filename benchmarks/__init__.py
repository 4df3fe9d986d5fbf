"""Benchmarks: scripts that print numbers (see README.md). `emit` is their common ending."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    """`result` as indented JSON on stdout, and at `out` where one is named."""
    text = json.dumps(result, indent=1, default=str)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
