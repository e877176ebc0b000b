"""A rank's windows in the order the controller sent them, and its recent reports, kept to answer again.

A connection reset can lose a ``Window`` on its way here or this rank's
``WindowDone`` on its way back; the controller then sends the window again
(``flodl.controller.resend``). The link thread passes every ``Window`` through
here: a window that overtook the one it names in ``after`` (that one was lost)
waits for it, so ranks never average windows out of step; a copy of a window
already reported is answered with the report again; a copy of one queued or
in training is dropped (its report comes when it is done).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..wire.messages import Window, WindowDone

#: reports kept for a re-ask: a window is re-sent only while the conductor waits for it, at most two out
KEEP_REPORTS = 8


class WindowInbox:
    """Orders windows by ``after`` and remembers the last reports. Thread-safe: the link thread
    sorts windows in, the training thread files reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last = -1  # the last window passed on to the training thread
        self._held: dict[int, Window] = {}  # after -> a window that overtook that one
        self._reports: OrderedDict[int, WindowDone] = OrderedDict()
        self.duplicates = 0  # copies answered or dropped (a reset happened)

    def arrive(self, window: Window) -> tuple[list[Window], WindowDone | None]:
        """Windows to train now, in order, and a report to send again (a copy of a reported window)."""
        with self._lock:
            again = self._reports.get(window.window)
            if again is not None or window.window <= self.last or window.after in self._held:
                self.duplicates += 1
                return [], again
            if window.after != self.last:
                self._held[window.after] = window  # the window it names is lost or late: run that first
                return [], None
            ready = [window]
            self.last = window.window
            while self.last in self._held:
                follower = self._held.pop(self.last)
                ready.append(follower)
                self.last = follower.window
            return ready, None

    def reported(self, report: WindowDone) -> None:
        """The training thread sent ``report``: keep it for a re-ask."""
        with self._lock:
            self._reports[report.window] = report
            while len(self._reports) > KEEP_REPORTS:
                self._reports.popitem(last=False)
