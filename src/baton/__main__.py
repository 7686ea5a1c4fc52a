"""``python -m baton``: the ``baton`` command line."""

import sys

from baton.cli import main

sys.exit(main())
