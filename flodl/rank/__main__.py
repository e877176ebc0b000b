"""``python -m flodl.rank``: started by ``flodl.worker``, one per device."""

import sys

from .runner import main

sys.exit(main())
