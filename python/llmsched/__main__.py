"""``python -m llmsched``: the command line (see :mod:`llmsched.cli`)."""

import sys

from llmsched.cli import main

sys.exit(main())
