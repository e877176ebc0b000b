"""Every timeout the run derives from ``heartbeat_timeout_secs`` and ``snapshot_timeout_secs``.

Pure arithmetic, one place: the user sets two numbers, and the controller,
worker and ranks each wait on a handful of deadlines made from them. They
are written here once, each with why it is as long as it is, and the
controller logs them at run start (``Deadlines.describe``).

Who builds one:

* the controller: ``Deadlines.from_config(config)``;
* a rank: from what it is told (``heartbeat_timeout_s`` from its spawn environment,
  ``collective_s`` from its ``RankWelcome``, ``snapshot_s`` from the run's
  config), which are the controller's values;
* a worker: ``heartbeat_timeout_s`` from its ``WorkerWelcome`` (it needs nothing else).

The hang limits of a busy rank (a step, an average, an eval) are
``progress.ProgressLimits``, built on ``heartbeat_timeout_s`` and the launch options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run import DdpRunConfig

#: Added to the two waits that must outlast another process's detection of a death:
#: that process notices at a heartbeat check (every 0.5-1 s), then has messages to send and
#: a group to tear down; ten seconds covers it on a loaded machine.
DETECTION_MARGIN_S = 10.0
#: The relay's safety net, in heartbeat timeouts (see ``relay_round_s``).
RELAY_TIMEOUT_FACTOR = 2.0
#: A rank's snapshot send and its CPU round wait, in snapshot timeouts (see ``snapshot_wait_s``).
SNAPSHOT_WAIT_FACTOR = 2.0


@dataclass(frozen=True)
class Deadlines:
    """The run's timeouts in seconds: three inputs, the rest derived (properties)."""

    heartbeat_timeout_s: float
    """Silence after which a peer is dead: the controller's verdict on a worker or rank
    (``Membership``), a worker's and a rank's verdict on the controller. The user's
    ``heartbeat_timeout_secs``; workers and the controller beat every second, ranks every half second, so it
    forgives that many lost beats (a rank its peers wait for: half of it, plan/progress.py ``silence_limit``)."""

    collective_s: float | None = None
    """How long one collective (and a process group's rendezvous) may block before it raises.
    The controller sets it to ``heartbeat_timeout_s`` (None here means that): a collective stuck on a
    dead peer then fails about when the heartbeats have told everyone of the death, not later
    (the survivors would sit idle) and not sooner (a slow peer is not a dead one)."""

    snapshot_s: float | None = None
    """CPU averaging: how long the controller waits for every live rank's snapshot before it
    aborts a round (``snapshot_timeout_secs``). None where it is not known (a worker)."""

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s}")
        if self.collective_s is None:
            object.__setattr__(self, "collective_s", self.heartbeat_timeout_s)

    @classmethod
    def from_config(cls, config: DdpRunConfig) -> Deadlines:
        """The controller's deadlines, from the user's options."""
        heartbeat_timeout_s = float(config.effective_heartbeat_timeout_secs)
        return cls(
            heartbeat_timeout_s=heartbeat_timeout_s, collective_s=heartbeat_timeout_s, snapshot_s=float(config.snapshot_timeout_secs)
        )

    @property
    def collective_timeout_s(self) -> float:
        """``collective_s`` typed as set: ``__post_init__`` fills a None from ``heartbeat_timeout_s``."""
        assert self.collective_s is not None
        return self.collective_s

    @property
    def verdict_wait_s(self) -> float:
        """How long a failed rank waits for the controller's ``Shutdown`` after reporting its error.
        The controller answers at once; one heartbeat timeout without an answer means it is gone."""
        return self.heartbeat_timeout_s

    @property
    def relay_round_s(self) -> float:
        """How long a host relay waits for the controller's average before it gives a round up.
        A safety net only: the controller times rounds out itself (``snapshot_s``) and tells the
        relay, so this must be longer than a controller that is alive could stay silent."""
        return RELAY_TIMEOUT_FACTOR * self.heartbeat_timeout_s

    @property
    def regroup_wait_s(self) -> float:
        """How long a rank whose collective failed waits for the controller's ``Regroup``. The
        controller first has to declare the dead peer dead (a heartbeat timeout after its last
        beat, which may come well after the collective failed: doubled for slack), then announce
        the new generation (the margin)."""
        return 2 * self.heartbeat_timeout_s + DETECTION_MARGIN_S

    @property
    def group_gather_s(self) -> float:
        """How long a member of a new process group waits for the others to arrive. Members come
        at different times: a survivor may still sit in the failed collective until its own
        timeout (``collective_s``, doubled for slack), and only then waits for the controller's
        announcement like everyone else (``regroup_wait_s``)."""
        return 2 * self.collective_timeout_s + self.regroup_wait_s

    @property
    def snapshot_wait_s(self) -> float:
        """CPU averaging, on a rank: how long sending its snapshot and waiting for the round's
        average may take. Longer than the controller's own round timeout (twice it), so the
        controller's abort decides the round, never the rank's give-up; at least one collective
        timeout, so a short ``snapshot_s`` does not undercut a slow link's send.

        Raises:
            ValueError: ``snapshot_s`` is not known here.
        """
        if self.snapshot_s is None:
            raise ValueError("snapshot_wait_s needs snapshot_s (the run's snapshot_timeout_secs)")
        return max(self.collective_timeout_s, SNAPSHOT_WAIT_FACTOR * self.snapshot_s)

    def describe(self) -> str:
        """One line for the run-start log: every deadline and its value."""
        parts = [
            ("heartbeat", self.heartbeat_timeout_s),
            ("collective", self.collective_s),
            ("rank verdict wait", self.verdict_wait_s),
            ("relay round", self.relay_round_s),
            ("regroup wait", self.regroup_wait_s),
            ("group gather", self.group_gather_s),
        ]
        if self.snapshot_s is not None:
            parts += [("averaging round", self.snapshot_s), ("rank snapshot wait", self.snapshot_wait_s)]
        return ", ".join(f"{name} {value:g} s" for name, value in parts)
