"""`dvi keys init`: the control channel's signing keys for a deployment on several hosts (`dvi.keys`). A light command:
it loads no model library."""

from __future__ import annotations

import argparse
from pathlib import Path

from dvi import keys
from dvi.cli.output import out


def keys_init(args: argparse.Namespace) -> int:
    keys.init_hosts(Path(args.trainer), Path(args.replica))
    out(f"trainer keys in {Path(args.trainer).resolve()}, replica keys in {Path(args.replica).resolve()}")
    return 0
