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
and loads the state once the round's average has landed. On the controller's
host (the same-host lane) the donor writes the state into a shared-memory
segment instead and sends one ``StateSlice`` naming it; the controller gives
each joiner on that host a link of its own, which it maps copy-on-write and
unlinks (the state's tensors are views of those pages), and sends the others
slices of it: 201 MB went through two socket hops and three copies before.

A round the donor has passed before it heard of (it cannot: the ``Regroup``
reaches it before the window that holds the round) or that finds it without a
state to give is answered "none" (``total`` -1), so no joiner waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..wire import messages as m
from ..wire import shm
from ..wire.bulk import check_state_segment, check_state_slice, state_slices

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
        self.segment: Path | None = None  # the last state segment sent (the controller unlinks it once passed on)

    def due_at(self, round_: int) -> None:
        """The controller asked for this rank's state with its snapshot of round ``round_`` (link thread)."""
        with self._lock:
            self._due.add(round_)

    def due(self, round_: int) -> bool:
        """Is this rank's state asked for with its snapshot of round ``round_``?"""
        with self._lock:
            return round_ in self._due

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
        """Send ``state`` (None: "none") for the joiners of round ``round_``: as one shared-memory
        segment on the controller's host (the same-host lane), else slice by slice."""
        if not state:
            self.bulk.send_state(m.StateSlice(rank=self.rank, round=round_, total=-1, start=0, count=0, shm=""), None)
            return
        if not (self.bulk.lane and self._send_segment(round_, state)):
            view = memoryview(state)
            for start, count in state_slices(len(state)):
                header = m.StateSlice(rank=self.rank, round=round_, total=len(state), start=start, count=count, shm="")
                self.bulk.send_state(header, view[start : start + count])
        log.info("rank %d: handed its optimizer state (%.1f MB) to the ranks joining at round %d", self.rank, len(state) / 2**20, round_)

    def _send_segment(self, round_: int, state: bytearray) -> bool:
        """The state written into a segment of ours, which the controller links for each joiner on
        this host and unlinks (no byte of it crosses a socket here); False when /dev/shm has no room."""
        try:
            path = shm.write_state(self.bulk.run_id, state)
        except OSError as exc:
            log.warning("rank %d: no shared-memory segment for the joiners' state (%s); it goes as slices", self.rank, exc)
            return False
        self.segment = path
        try:
            self.bulk.send_state(
                m.StateSlice(rank=self.rank, round=round_, total=len(state), start=0, count=len(state), shm=str(path)), None
            )
        except BaseException:
            shm.unlink(path)
            raise
        return True

    def close(self) -> None:
        """Drop the name of the last state segment, if the controller has not (it stopped first)."""
        if self.segment is not None:
            shm.unlink(self.segment)


class StateIn:
    """The joiner's side: the donor's state gathered slice by slice (or mapped from the segment the
    controller names), for the round it joins at."""

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id  # a segment the controller names must be one of this run's
        self.round = -1  # the round whose donor state is awaited (-1: none)
        self._buf: bytearray | memoryview | None = None
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
        if header.shm:
            path = check_state_segment(header, frames, self.run_id)
            if header.round != self.round or self.ended:
                shm.unlink(path)  # ours to drop, stale or not
                return
            try:
                self._buf = shm.map_private(path, header.total)  # the state's pages, no copy
            finally:
                shm.unlink(path)  # mapped (or unusable): the name goes, and nothing is left behind
            self._got, self.ended = header.total, True
            return
        piece = check_state_slice(header, frames)
        if header.round != self.round or self.ended:
            return  # not the round this rank joins at: stale
        if piece is None:
            self._buf, self.ended = None, True
            return
        if not isinstance(self._buf, bytearray) or len(self._buf) != header.total:
            self._buf, self._got = bytearray(header.total), 0
        self._buf[header.start : header.start + header.count] = piece
        self._got += header.count
        self.ended = self._got >= header.total

    def wait(self, receive: Callable[[int], object], timeout_s: float, must_stop: Callable[[], bool]) -> bytearray | memoryview | None:
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
