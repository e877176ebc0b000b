"""``python -m flodl.controller``."""

import sys

from . import main

sys.exit(main())
