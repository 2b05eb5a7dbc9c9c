"""``python -m edgeprune.cli``."""

import sys

from . import main

sys.exit(main())
