"""`python -m autopar ...` runs the `autopar` command (cli.py)."""
import sys

from .cli import main

sys.exit(main())
