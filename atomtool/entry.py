"""The ``atomtool`` console script: a light module that imports the command line inside ``main``.

Importing the command line takes ~0.3 s (typer, and pydantic / FastAPI for the tool-call parser choices), and a
Ctrl-C in that window would otherwise end in a traceback from whichever import it hit; here it ends like one
inside a command does: ``error: interrupted`` on stderr and exit status 130.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point (``atomtool``): :func:`atomtool.cli.main` with Ctrl-C during start-up handled."""
    try:
        from atomtool.cli import main as cli_main
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    cli_main()
