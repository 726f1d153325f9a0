"""``python -m helpers.bench``: see :mod:`helpers.bench.cli`."""

import sys

from helpers.bench.cli import main

sys.exit(main())
