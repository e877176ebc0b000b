"""``python -m flodl.rank``: started by ``flodl.worker``, one per device.

An entry point: when the environment asks for injected faults or a simulated pace
(tests, benchmarks), it installs ``flodl.testing``'s probes first (flodl/probes.py).
"""

from ..config.env import probes_requested
from ..host.proc import exit_now
from .runner import main

if probes_requested():
    from ..testing.probes import install_from_environment

    install_from_environment()
exit_now(main())  # the work is flushed; torch's interpreter teardown would cost most of a second
