"""``python -m bench.matrix [--quick]``: run the model x mode matrix (see bench/matrix/suite.py)."""

import sys

from bench.matrix.suite import main

sys.exit(main())
