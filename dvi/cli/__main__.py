"""`python -m dvi.cli ...`: the `dvi` command (how dvi starts its own child processes)."""

import sys

from dvi.cli import main

sys.exit(main())
