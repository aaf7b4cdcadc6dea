"""The ``atomtool`` console script: a light module that imports the command line inside ``main``.

Importing the command line takes ~0.3 s (typer, and pydantic / FastAPI for the tool-call parser choices), and
typer then builds the commands; a Ctrl-C in that window would otherwise end in a traceback from whatever it
hit. Here it ends like one inside a command does: ``error: interrupted`` on stderr and exit status 130.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point (``atomtool``): :func:`atomtool.cli.main` with Ctrl-C during start-up handled."""
    try:
        from atomtool.cli import main as cli_main

        # a command turns its own Ctrl-C into the same line (atomtool.cli._user_errors); this catches one that
        # lands while typer builds the command line around it
        cli_main()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
