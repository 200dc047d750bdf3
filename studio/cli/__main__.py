"""``python -m studio.cli``: the `studio` command, for a checkout that is not installed."""

import sys

from studio.cli import main

sys.exit(main())
