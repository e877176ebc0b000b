"""The run's phase, its one failure and its clock marks: the facts every part of the controller reads.

``RunState`` is the only writer of each: the conductor moves the phase
(``to``, which logs the move and refuses one the run cannot make), any part
latches the failure (``fail``: the first one wins) or says something changed
(``changed``), and the conductor waits on those changes (``until``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import StrEnum

from ..errors import EXIT_RANK_LOST, RunAborted
from ..plan.membership import Membership

log = logging.getLogger("flodl.controller")


class Phase(StrEnum):
    """Where the run is; a ``StrEnum`` so the summary and logs keep the words they had."""

    STARTING = "starting"
    GATHERING = "gathering"  # waiting for the workers
    JOINING = "joining"  # the first ranks start, say hello and form the collective
    TRAINING = "training"
    SHUTTING_DOWN = "shutting down"  # a clean end: every peer told to go
    ABORTING = "aborting"  # a failure: every peer told to stop now
    DONE = "done"


#: The moves a run can make; anything else is a bug in the conductor.
_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.GATHERING, Phase.ABORTING}),
    Phase.GATHERING: frozenset({Phase.JOINING, Phase.ABORTING}),
    Phase.JOINING: frozenset({Phase.TRAINING, Phase.ABORTING}),
    Phase.TRAINING: frozenset({Phase.SHUTTING_DOWN, Phase.ABORTING}),
    Phase.SHUTTING_DOWN: frozenset({Phase.DONE, Phase.ABORTING}),
    Phase.ABORTING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class RunState:
    """Phase, failure, start and end of one run; handlers record changes here and the conductor waits on them."""

    def __init__(self, members: Membership, clock: Callable[[], float]) -> None:
        self._members = members  # only to say who is missing when a wait times out
        self._clock = clock
        self._phase = Phase.STARTING
        self._failure: RunAborted | None = None
        self._changed = asyncio.Event()
        self.started_at = 0.0  # when the run started, then when training did (the summary's wall time)
        self.finished_at = 0.0

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def failure(self) -> RunAborted | None:
        return self._failure

    def to(self, phase: Phase) -> None:
        """Move the run to ``phase``.

        Raises:
            RuntimeError: the run cannot move there from where it is (a bug).
        """
        if phase not in _MOVES[self._phase]:
            raise RuntimeError(f"the run cannot move from {self._phase} to {phase}")
        log.info("phase: %s -> %s", self._phase, phase)
        self._phase = phase

    @property
    def ended(self) -> bool:
        """Every peer was told to go: an exit now is not a death."""
        return self._phase in (Phase.SHUTTING_DOWN, Phase.ABORTING, Phase.DONE)

    @property
    def admitting(self) -> bool:
        """The first ranks start or the run trains: a worker arriving now grows the run."""
        return self._phase in (Phase.JOINING, Phase.TRAINING)

    def mark_started(self) -> None:
        self.started_at = self._clock()

    def mark_finished(self) -> None:
        """The first end counts (a clean end's, not the abort that may follow it)."""
        self.finished_at = self.finished_at or self._clock()

    def fail(self, message: str, code: int) -> None:
        """Latch the run's failure (the first one wins) and wake the conductor."""
        if self._failure is None:
            log.info("%s", message)  # the console says it ("run stopped: ..."), once
            self._failure = RunAborted(message, code)
        self._changed.set()

    def changed(self) -> None:
        """A handler recorded something the conductor may be waiting for."""
        self._changed.set()

    async def until(self, predicate: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        """Wait for ``predicate`` (re-checked on every change).

        Raises:
            RunAborted: a failure was latched, or ``timeout_s`` passed.
        """
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            if predicate():
                return
            if deadline is not None and self._clock() > deadline:
                # assess is pure: a verdict asked for only to explain the timeout marks nobody dead
                why = self._members.assess(self._clock()).reason
                self.fail(f"timed out after {timeout_s:g} s waiting for {what} ({why})", EXIT_RANK_LOST)
                continue
            await self.next_change(0.5)

    async def next_change(self, at_most_s: float) -> None:
        """Sleep until a handler records a change, or ``at_most_s`` passes."""
        self._changed.clear()
        try:
            async with asyncio.timeout(at_most_s):
                await self._changed.wait()
        except TimeoutError:
            pass
