"""A donor's state to the joiners on the CPU backend's bulk plane (``StateOut``, ``StateIn``).

A joiner of a CPU run takes its first round's average whole as its parameters
(cpu_average.py, ``adopting``). The controller's ``Regroup`` that admits it
names that round (``first_round``) and a donor (``sync_from``), and goes to the
donor too. The donor hands its state (handoff.py: a bundle's ``.optim`` bytes)
with its snapshot of that round: it dumps the state just before the snapshot
(every earlier round landed, so the outer optimizer's state is the one that
round's average is stepped from) and sends it right after, as ``StateSlice``
messages the controller passes on to the joiners (averaging/server.py). The
joiner gathers the slices as they come, between its other reads of the socket,
and loads the state once the round's average has landed.

A round the donor has passed before it heard of (it cannot: the ``Regroup``
reaches it before the window that holds the round) or that finds it without a
state to give is answered "none" (``total`` -1), so no joiner waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..wire import messages as m
from ..wire.bulk import check_state_slice, state_slices

if TYPE_CHECKING:
    from .cpu_average import BulkLink

log = logging.getLogger(__name__)


class StateOut:
    """The donor's side: the rounds it hands its state with, and the sending."""

    def __init__(self, bulk: BulkLink, rank: int) -> None:
        self.bulk = bulk
        self.rank = rank
        self.dump: Callable[[], bytearray] | None = None  # the state's bytes (handoff.py), once the replica exists
        self._due: set[int] = set()
        self._lock = threading.Lock()  # ``due_at`` runs on the link thread, the rest on the training thread

    def due_at(self, round_: int) -> None:
        """The controller asked for this rank's state with its snapshot of round ``round_`` (link thread)."""
        with self._lock:
            self._due.add(round_)

    def take(self, next_round: int) -> tuple[bool, list[int]]:
        """Before this rank sends its snapshot of ``next_round``: whether the state goes with it, and
        the rounds asked for that it has passed already (answered "none")."""
        with self._lock:
            passed = sorted(r for r in self._due if r < next_round)
            due = next_round in self._due
            self._due -= {*passed, next_round}
        return due, passed

    def capture(self) -> bytearray | None:
        """The state to hand, or None (no replica yet; a state that could not be made is logged)."""
        if self.dump is None:
            return None
        try:
            return self.dump()
        except Exception:  # a state that cannot be sent costs the joiner its optimizer's state, not the run
            log.exception("rank %d: could not make the optimizer state for the joiners; they start with a fresh optimizer", self.rank)
            return None

    def send(self, round_: int, state: bytearray | None) -> None:
        """Send ``state`` (None: "none") for the joiners of round ``round_``, slice by slice."""
        if not state:
            self.bulk.send_state(m.StateSlice(rank=self.rank, round=round_, total=-1, start=0, count=0), None)
            return
        view = memoryview(state)
        for start, count in state_slices(len(state)):
            header = m.StateSlice(rank=self.rank, round=round_, total=len(state), start=start, count=count)
            self.bulk.send_state(header, view[start : start + count])
        log.info("rank %d: handed its optimizer state (%.1f MB) to the ranks joining at round %d", self.rank, len(state) / 2**20, round_)


class StateIn:
    """The joiner's side: the donor's state gathered slice by slice, for the round it joins at."""

    def __init__(self) -> None:
        self.round = -1  # the round whose donor state is awaited (-1: none)
        self._buf: bytearray | None = None
        self._got = 0
        self.ended = False  # all of it came, or "none" did

    def expect(self, round_: int) -> None:
        """The donor's state comes with round ``round_`` (the Regroup that admits this rank)."""
        self.round, self._buf, self._got, self.ended = round_, None, 0, False

    @property
    def awaited(self) -> bool:
        return self.round >= 0

    def take(self, header: m.StateSlice, frames: list) -> None:
        """One slice (or the "none") as it came off the socket.

        Raises:
            ProtocolError: the message disagrees with itself or with the slices before it.
        """
        piece = check_state_slice(header, frames)
        if header.round != self.round or self.ended:
            return  # not the round this rank joins at: stale
        if piece is None:
            self._buf, self.ended = None, True
            return
        if self._buf is None or len(self._buf) != header.total:
            self._buf, self._got = bytearray(header.total), 0
        self._buf[header.start : header.start + header.count] = piece
        self._got += header.count
        self.ended = self._got >= header.total

    def wait(self, receive: Callable[[int], object], timeout_s: float, must_stop: Callable[[], bool]) -> bytearray | None:
        """The state once it is all in (``receive(ms)`` reads the socket on), or None: "none"
        came, ``timeout_s`` passed, or the run stops. Either way nothing more is awaited."""
        deadline = time.monotonic() + timeout_s
        while not self.ended and not must_stop():
            if time.monotonic() > deadline:
                log.warning("the donor's optimizer state did not come within %g s; training with a fresh optimizer", timeout_s)
                break
            receive(100)
        state = self._buf if self.ended else None
        self.round, self._buf = -1, None
        return state
