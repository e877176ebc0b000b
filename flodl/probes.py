"""Probes: the points where tests and benchmarks look in on a worker or a rank.

Product code calls a ``Probes`` at a few named points: ``reach`` where a
fault may be injected (a rank's ``batch``, ``average``, ``epoch``, ``save``...;
the list and what each action does are ``flodl/testing/faults.py``'s), ``pace``
after each step (a simulated slower device), ``spawn_delay_s`` before the
worker starts a rank, ``observe`` where a rank holds a state tests compare (a
joiner's optimizer state and its donor's). Here every one of them does nothing, and that is what a
real run gets.

``flodl.testing`` implements them (``flodl/testing/probes.py``: fault
injection from ``FLODL_INJECT_FAULT``, pacing from ``FLODL_SIMULATE_*``).
Only a process's entry point installs that implementation, and only when one
of those variables is set (``config.env.probes_requested``): the rank's
``python -m flodl.rank`` (rank/__main__.py), a script rank's
``python -m flodl.rank.script_start`` and the worker's ``main``. No other
product module imports ``flodl.testing`` (tests/test_layering.py holds that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Probes", "for_rank", "install"]

#: a step's record (rank/step_meter.py ``StepRecord``): what ``pace`` hands back, re-timed
R = TypeVar("R")


class Probes:
    """The no-op probes of a real run (the base ``flodl.testing`` implements)."""

    #: ``pace`` changes steps (the step loop skips the call otherwise: it runs every step)
    paces = False
    #: each step is measured on its own, even on a GPU (a simulated pace acts on every step)
    paced_alone = False

    def armed(self, point: str) -> bool:
        """Is a fault armed at ``point``? (A caller that must prepare for it asks first.)"""
        return False

    def reach(self, point: str, *, index: int | None = None, before: Callable[[], object] | None = None) -> str | None:
        """The process reached fault point ``point`` (``index``: which one, for an indexed point such as
        an epoch; ``before``: what to do first if a fault fires there). Returns an action the caller
        carries out itself (``"nan"``, ``"drop"``), else None."""
        return None

    def pace(self, record: R, started: float) -> R:
        """A step ended (``started``: its ``perf_counter`` start): the record, re-timed if it was paced."""
        return record

    def spawn_delay_s(self) -> float:
        """Seconds the worker holds this rank's start."""
        return 0.0

    def observe(self, point: str, state: Callable[[], dict[str, Any]]) -> None:
        """The rank holds a state tests look at, at ``point`` (``handoff.sent``: a donor's state as it
        handed it; ``handoff.taken``: a joiner's as it took it; ``resumed``: a resumed rank's):
        ``state()`` gives it, as named tensors. Only called, never computed, in a real run."""


NONE = Probes()

_factory: Callable[[int], Probes] = lambda rank: NONE  # noqa: E731  # what install() replaces


def install(factory: Callable[[int], Probes]) -> None:
    """Give this process ``factory(rank)``'s probes (an entry point calls it, before any rank is set up)."""
    global _factory
    _factory = factory


def for_rank(rank: int) -> Probes:
    """The probes of rank ``rank`` in this process (the no-op ones unless an entry point installed others)."""
    return _factory(rank)
