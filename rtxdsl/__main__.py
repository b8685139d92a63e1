"""``python -m rtxdsl``: the demo (see rtxdsl.cli)."""

import sys

from .cli import main

sys.exit(main())
