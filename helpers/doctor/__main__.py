"""``python3 -m helpers.doctor``: see :mod:`helpers.doctor`."""

import sys

from helpers.doctor.run import main

sys.exit(main())
