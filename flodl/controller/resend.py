"""Windows whose report is overdue from an idle rank, sent again.

A connection reset can lose a frame in either direction: ZeroMQ drops what a
dead connection's queues held, and the controller's ROUTER drops what it sends
to a route that moved until the rank's next frame names the new one. Either a
``Window`` never reached its rank, or the rank's ``WindowDone`` never reached
us. Both leave the rank idle, waiting for a command, while the conductor waits
for its report; heartbeats go on, so liveness sees nothing wrong and the run
would wait for ever. One cure serves both: send the window again. A rank that
never had it trains it (in order: ``Window.after``), one that already reported
it answers with that report again, one still busy with it drops the copy
(``flodl.rank.window_inbox``).

The evidence is the rank's own heartbeat: it says ``idle`` and for how long, so
a window is re-sent only once a beat that left well after the window did still
finds the rank idle, never on timing alone (a slow window is not a lost one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..plan.membership import RankInfo
from ..wire import messages as m

#: a heartbeat must have found the rank idle at least this long ...
IDLE_S = 1.0
#: ... and have arrived at least this long after the window left: time for the window to get there
AFTER_SENT_S = 0.5
#: one window is sent again to one rank at most this often
EVERY_S = 2.0


class WindowResender:
    """The windows each rank has not reported yet, and which of them are overdue."""

    def __init__(self) -> None:
        self._out: dict[int, dict[int, tuple[m.Window, float]]] = {}  # rank -> window -> (message, last sent)
        self.resent = 0  # windows sent again (summary, monitor)

    def sent(self, rank: int, window: m.Window, now: float) -> None:
        self._out.setdefault(rank, {})[window.window] = (window, now)

    def reported(self, rank: int, window: int) -> None:
        self._out.get(rank, {}).pop(window, None)

    def settled(self, window: int) -> None:
        """Window ``window`` is settled: nothing up to it is waited for (a dead rank's entries go too)."""
        for pending in self._out.values():
            for number in [n for n in pending if n <= window]:
                del pending[number]

    def overdue(self, window: int, waiting: Iterable[int], ranks: Mapping[int, RankInfo], now: float) -> list[tuple[int, m.Window]]:
        """The ranks in ``waiting`` whose report of ``window`` is overdue (re-stamped as sent now)."""
        due = []
        for rank in waiting:
            entry = self._out.get(rank, {}).get(window)
            info = ranks.get(rank)
            if entry is None or info is None:
                continue
            message, last_sent = entry
            beat = info.progress
            if now - last_sent < EVERY_S or beat.busy != "idle" or beat.busy_s < IDLE_S or beat.at < last_sent + AFTER_SENT_S:
                continue
            self._out[rank][window] = (message, now)
            self.resent += 1
            due.append((rank, message))
        return due
