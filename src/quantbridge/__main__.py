"""``python -m quantbridge``: the command-line interface (see ``quantbridge.cli``)."""

import sys

from .cli import main

sys.exit(main())
