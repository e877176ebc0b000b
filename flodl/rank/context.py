"""What every part of a rank is handed: who it is, its way to the controller, and how its work stops.

``RankContext`` is made once, when the rank process starts (``RankRunner``), and
never changes; ``JoinedRun`` is what the controller's ``RankWelcome`` settled
for the whole run. The parts (docs/architecture.md, "Inside a rank") take
these two instead of long parameter lists, and each other by name.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import DdpRunConfig
    from ..config.deadlines import Deadlines
    from ..config.env import RankEnv
    from ..host.gauges import ResourceSampler
    from ..probes import Probes
    from ..wire import messages as m
    from .link import ControllerLink
    from .seams import Seams


@dataclass(frozen=True)
class RankContext:
    """The rank process's fixed facts and shared means (set up before anything is built)."""

    env: RankEnv
    device: torch.device
    link: ControllerLink
    probes: Probes  # tests and benchmarks look in here (faults, a simulated pace): no-ops in a real run
    seams: Seams  # what a Task rank and a script rank do differently (seams.py)
    # what the rank opens on its way (sockets, segments, threads, files) registers its clean-up
    # here as it opens; the runner closes them all, last opened first, on every exit path
    closing: contextlib.ExitStack
    sigterm: threading.Event  # SIGTERM arrived: the rank ends at its next batch
    resources: ResourceSampler  # gauges for the monitor, summarised per window

    @property
    def rank(self) -> int:
        return self.env.rank

    def must_stop(self) -> bool:
        """The controller is gone or ordered an abort, or SIGTERM came: stop at the next batch."""
        return self.link.must_stop or self.sigterm.is_set()

    def ending(self) -> bool:
        """The run ends (a Shutdown of any kind, the controller gone, SIGTERM): no new group is worth building."""
        return self.link.ending or self.sigterm.is_set()


@dataclass(frozen=True)
class JoinedRun:
    """What the welcome settled for the run, as the rank's parts read it."""

    welcome: m.RankWelcome
    config: DdpRunConfig  # the controller's options, validated and typed
    deadlines: Deadlines  # every timeout, from the heartbeat, collective and snapshot timeouts
    # every epoch of the run is an event this rank sees, in order, even one it trains no batch of
    # (docs/script-mode.md): from ``first_epoch`` (-1: its first batch's, a joiner) to ``epochs - 1``
    first_epoch: int
    epochs: int
