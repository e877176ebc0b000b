"""Fault injection for tests and benchmarks: a rank kills or stops itself at a chosen point.

``FLODL_INJECT_FAULT="1:average:5"`` makes rank 1 SIGKILL itself the 5th time
it reaches an averaging round; ``"2:batch:40:stop"`` makes rank 2 SIGSTOP
itself in the middle of its 40th batch (after backward, before the optimizer
step), which looks to everyone else exactly like a hung device. Actions:
``kill`` (SIGKILL, the default), ``stop`` (SIGSTOP: the whole process
freezes), ``hang`` (only the training thread blocks for good, as in a
deadlocked data read or user code that never returns: heartbeats go on),
``nan`` (at ``batch``: the gradients turn NaN, so the next loss is NaN),
``drop`` (at ``window`` and ``report`` only: the frame is lost, as in a
connection reset), ``delay`` (at ``spawn`` only). Points:

* ``batch``   mid-batch: gradients computed, step not taken (accumulating: counts optimizer steps)
* ``average`` mid-averaging: the replica backed up, peers already inside the round
* ``epoch``   at an epoch edge: the first batch of epoch ``n`` (0-based) about to run (or of the
              first later epoch the rank trains, if its share skips epoch ``n``)
* ``regroup`` rebuilding the process group of the ``n``-th new generation (collective
              backend): every member has arrived, the group is not yet connected
* ``save``    the ``n``-th checkpoint's data files are written, the controller not yet
              told (so it has not committed them)
* ``window``  the ``n``-th ``Window`` frame reaches the rank's link (``drop``: it never arrived)
* ``report``  the ``n``-th ``WindowDone`` is about to leave (``drop``: it never arrives)
* ``reported`` the ``n``-th ``WindowDone`` has left, the window's end average launched and still in
              flight (Cadence, Async): the rank dies with it in flight
* ``slice``   the first slice of the rank's ``n``-th snapshot has left (CPU backend), the rest not sent:
              the rank dies halfway through its snapshot (a model of more than one 8 MiB slice)
* ``build``   the rank about to build its task, before its hello (``hang``: a start-up that
              never ends, as a stuck import or a dataset download would; n is 1)
* ``spawn``   read by the worker, not the rank: ``delay`` holds the start of this rank's process
              for n seconds, as a fork on a loaded host can (``1:spawn:3:delay``)

Several faults are comma-separated. Real processes really die, so the elastic
path under test is the one users get; nothing here is consulted unless the
variable is set.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config.env import INJECT_FAULT, injected_faults

POINTS = ("batch", "average", "epoch", "regroup", "save", "window", "report", "reported", "slice", "build", "spawn")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
ACTIONS = (*SIGNALS, "hang", "nan", "drop", "delay")
LOSSY = ("window", "report")  # the points where a frame can be lost: the only ones ``drop`` applies to


@dataclass
class FaultPlan:
    """The faults armed for one rank, and how often each point was reached."""

    armed: dict[str, tuple[int, str]] = field(default_factory=dict)  # point -> (nth, action)
    seen: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls, rank: int, text: str | None = None) -> FaultPlan:
        """Parse ``rank:point:n[:kill|stop]`` items; raise ValueError naming the bad one."""
        text = injected_faults() if text is None else text
        plan = cls()
        for item in filter(None, (t.strip() for t in text.split(","))):
            parts = item.split(":")
            try:
                who, point, nth = int(parts[0]), parts[1], int(parts[2])
                action = parts[3] if len(parts) > 3 else "kill"
            except (IndexError, ValueError):
                raise ValueError(f"{INJECT_FAULT}: {item!r} is not rank:point:n[:kill|stop]") from None
            if point not in POINTS or action not in ACTIONS or nth < 0 or len(parts) > 4:
                raise ValueError(f"{INJECT_FAULT}: {item!r}: point must be one of {POINTS}, action one of {ACTIONS}, n >= 0")
            if (action == "drop") != (point in LOSSY) and action != "kill":
                raise ValueError(f"{INJECT_FAULT}: {item!r}: drop applies to the points {LOSSY}, and they take only drop or kill")
            if (action == "delay") != (point == "spawn"):
                raise ValueError(f"{INJECT_FAULT}: {item!r}: the spawn point takes only delay, and delay applies only to spawn")
            if who == rank:
                plan.armed[point] = (nth, action)
        return plan

    def reach(self, point: str, index: int | None = None, before: Callable[[], object] | None = None) -> str | None:
        """Called at ``point``; fires when its count (or the given index) equals the armed n,
        after calling ``before`` (``reported``: the report is flushed first).

        Returns the action the caller must carry out itself (``nan``), else None.
        """
        if point not in self.armed:
            return None
        count = self.seen[point] = self.seen.get(point, 0) + 1
        nth, action = self.armed[point]
        # an indexed point (the epoch) fires at the first index at or past n: a rank whose share of
        # the data skips epoch n (windows flow across epoch edges, and with 3 ranks on a loaded
        # machine one trained no batch of epoch 3) would otherwise never reach its fault
        if (index < nth) if index is not None else (count != nth):
            return None
        del self.armed[point]  # once: a stopped process that is resumed carries on
        if before is not None:
            before()
        if action == "hang":
            threading.Event().wait()  # this thread never returns; the rest of the process lives on
        if action in SIGNALS:
            os.kill(os.getpid(), SIGNALS[action])
        return action

    def spawn_delay_s(self) -> float:
        """Seconds the worker holds this rank's start (the ``spawn`` point), 0 when none is armed."""
        return float(self.armed["spawn"][0]) if "spawn" in self.armed else 0.0
