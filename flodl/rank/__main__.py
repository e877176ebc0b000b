"""``python -m flodl.rank``: started by ``flodl.worker``, one per device."""

from ..host.proc import exit_now
from .runner import main

exit_now(main())  # the work is flushed; torch's interpreter teardown would cost most of a second
