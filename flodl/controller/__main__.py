"""``python -m flodl.controller``."""

from . import exit_process, main

exit_process(main())
