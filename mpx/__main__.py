"""``python -m mpx``: the command line (mpx._cli.main)."""

import sys

from mpx._cli.main import main

sys.exit(main())
