"""Command line: ``python -m shardc plan <model spec> --world-size N``."""

from __future__ import annotations

import sys

from shardc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
