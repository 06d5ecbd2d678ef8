"""``python -m rlmath demo ...``: the same as the ``rlmath`` console script."""

import sys

from rlmath.cli import main

sys.exit(main())
