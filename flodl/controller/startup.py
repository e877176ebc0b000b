"""Start-up: the seconds from launch to the first batch trained, phase by phase, and the lines that say so.

Before a run trains, every rank process imports torch and builds the task,
which on a small machine takes seconds. ``Startup`` records when each phase
of that start ended (the workers up, every first rank built its task, the
process group formed, the first batch trained), counted from the process
start, tells the console as it goes, and gives the summary its ``startup_s``
and ``startup`` (docs/monitor.md). A worker or rank that joins later is not
start-up: its lines are the admission's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .console import Console

#: Past this many workers the "workers up" line counts their hosts instead of naming them.
NAME_HOSTS_UP_TO = 4


def process_started_unix() -> float | None:
    """When this process started (seconds since the epoch, to the kernel's clock tick), or None
    where ``/proc`` does not say (not Linux)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # the command name (field 2) may hold spaces or parentheses: count from the last ')'
            started = int(f.read().rsplit(b")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks since boot
        with open("/proc/uptime", "rb") as f:
            up = float(f.read().split()[0])  # seconds since boot, to 10 ms (/proc/stat's boot time is whole seconds)
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (up - started)


class Startup:
    """The start-up's marks (seconds from ``started_unix``) and its console lines."""

    def __init__(self, console: Console, *, started_unix: float | None = None, wall: Callable[[], float] = time.time) -> None:
        self.console = console
        self.wall = wall
        self.started_unix = wall() if started_unix is None else started_unix
        self.marks: dict[str, float] = {}  # phase -> seconds from the start, once it ended

    def _elapsed(self) -> float:
        return max(0.0, self.wall() - self.started_unix)

    def _mark(self, phase: str, text: str) -> None:
        """``phase`` ended now: remember when (the first time only) and say so."""
        if phase in self.marks:
            return
        self.marks[phase] = at = self._elapsed()
        self.console.startup(f"start-up {at:4.1f} s: {text}", done=True)

    def _so_far(self, text: str) -> None:
        """A count within a phase (a live terminal rewrites it in place)."""
        self.console.startup(f"start-up {self._elapsed():4.1f} s: {text}", done=False)

    def worker_up(self, workers: int, expected: int) -> None:
        """Another worker said hello (counted on a terminal while more are expected)."""
        if workers < expected:
            self._so_far(f"workers up {workers}/{expected}")

    def workers_up(self, hosts: list[str], ranks: int) -> None:
        """Every worker is in and welcomed (``hosts``: one per worker): their ``ranks`` start now,
        importing torch and building the task."""
        names = sorted(set(hosts))
        where = ", ".join(names) if len(names) <= NAME_HOSTS_UP_TO else f"{len(names)} hosts"
        who = "worker up" if len(hosts) == 1 else f"{len(hosts)} workers up"
        self._mark("workers_up", f"{who} on {where}: {ranks} rank(s) starting (importing torch, building the task)")

    def rank_built(self, built: int, ranks: int) -> None:
        """Another first rank built its task and said hello (counted on a terminal; the last one
        ends the phase: ``ranks_built``)."""
        if built < ranks:
            self._so_far(f"ranks built their task {built}/{ranks}")

    def ranks_built(self, built: int, ranks: int, *, params: int, samples: int, grain: str = "sample") -> None:
        self._mark("ranks_built", f"ranks built their task {built}/{ranks} ({params:,} parameters, {samples:,} {grain}s)")

    def group_formed(self, world: int, *, collective: bool) -> None:
        """Every first rank is ready: in the process group (collective backends), holding rank 0's parameters."""
        if world < 2:
            how = "the rank is ready (one rank: nothing to average)"
        elif collective:
            how = f"process group formed, {world} ranks hold rank 0's parameters"
        else:
            how = f"{world} ranks ready, averaging through the controller"
        self._mark("group_formed", how)

    def first_batch(self) -> None:
        self._mark("first_batch", "first batch trained")

    @property
    def startup_s(self) -> float | None:
        """Seconds from the process start to the first batch trained (None before it)."""
        return self.marks.get("first_batch")

    def summary(self) -> dict:
        """The summary's ``startup``: the start (Unix time) and each phase's end, in seconds from it."""
        return {"started_unix": self.started_unix, **{f"{phase}_s": at for phase, at in self.marks.items()}}
