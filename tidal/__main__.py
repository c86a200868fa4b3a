"""`python -m tidal ...` is the same as the `tidal` command."""
import sys

from tidal.cli import main

sys.exit(main())
