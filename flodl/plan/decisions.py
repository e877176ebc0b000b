"""What a fault leads to: pure decisions, carried out by the controller.

A death, a hang, a failed collective, an error a rank reports: each ends in
one of a few outcomes (go on and regroup, wait for the explanation, save and
stop, stop). The controller's liveness code used to decide inline, reachable
only through whole-cluster tests; these functions take the facts (no clock
of their own, no I/O, no controller) and return a ``Decision`` that names the
outcome, the exit code and the sentence the user reads. tests/test_decisions.py
drives them table by table, like ``elche`` and ``guard``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ..errors import EXIT_CONFIG, EXIT_NONFINITE, EXIT_RANK_LOST, EXIT_TASK_ERROR
from .membership import unrecoverable

if TYPE_CHECKING:
    from ..config import DdpRunConfig

#: Collective failures no death explains, rebuilt in place, before the run is stopped.
MAX_COLLECTIVE_RETRIES = 3


class Outcome(str, Enum):
    RECOVER = "recover"  # fence the dead, re-plan their work, regroup the survivors, heal
    REBUILD = "rebuild"  # a collective failed with nobody dead: rebuild it among the same ranks
    WAIT = "wait"  # not yet: a death report may still explain it
    IGNORE = "ignore"  # nothing to do (stale, or already answered)
    SAVE_AND_STOP = "save and stop"  # too few left: the elected survivor writes the bundle, then stop
    STOP = "stop"  # end the run with ``code``


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    code: int = 0
    why: str = ""
    save_reason: str = ""  # with SAVE_AND_STOP: the sidecar's save_reason


def after_deaths(
    config: DdpRunConfig,
    *,
    started: bool,
    world_size: int,
    dead_total: int,
    survivors: int,
    can_save: bool,
    unseeded: tuple[int, ...] = (),
) -> Decision:
    """Ranks were declared dead (joiners already set aside): recover, or stop (saving if it can).

    ``started``: the first ranks were numbered and started (before, no rank can
    die; from then on a death, even while the others still start, is recovered);
    ``dead_total``: every rank dead so far, these included; ``can_save``:
    ``save_path`` is set and a survivor can write; ``unseeded``: survivors that
    joined while the run trained and have not received its parameters yet (a
    joiner takes them from its first average). When those are all that is left,
    no rank holds what the run trained: going on would train from the task's
    initial weights, and saving would write those, so the run stops.
    """
    if not started:
        return Decision(Outcome.STOP, EXIT_RANK_LOST, "The run stopped before training began.")
    if survivors and len(unseeded) >= survivors:
        ranks = ", ".join(str(r) for r in unseeded)
        why = (
            f"No rank left holds the run's parameters: rank(s) {ranks} joined and had not received them yet. "
            "Resume from the last checkpoint (--resume-from) if the run saved one."
        )
        return Decision(Outcome.STOP, EXIT_RANK_LOST, why)
    problem = unrecoverable(config, world_size, dead_total, survivors)
    if problem is None:
        return Decision(Outcome.RECOVER)
    reason, why = problem
    if can_save and survivors:
        return Decision(Outcome.SAVE_AND_STOP, EXIT_RANK_LOST, why, save_reason=reason)
    return Decision(Outcome.STOP, EXIT_RANK_LOST, why)


def after_collective_error(*, reported_generation: int, generation: int, pending: bool) -> Decision:
    """A rank says a collective failed: usually a peer's death whose report is on its way.

    A report from an older generation was answered by the regroup already; a
    second report while one waits adds nothing.
    """
    if reported_generation < generation or pending:
        return Decision(Outcome.IGNORE)
    return Decision(Outcome.WAIT)


def unexplained_collective_error(*, waited_s: float, grace_s: float, retries: int, where: str, error: str) -> Decision:
    """A collective failure no death explained within ``grace_s``: rebuild it in place, a few times."""
    if waited_s <= grace_s:
        return Decision(Outcome.WAIT)
    if retries + 1 > MAX_COLLECTIVE_RETRIES:
        return Decision(Outcome.STOP, EXIT_RANK_LOST, f"{where} saw its collective fail {retries + 1} times: {error}")
    return Decision(Outcome.REBUILD, why=f"{where} saw its collective fail: {error}")


def after_rank_error(stage: str, *, joiner: bool) -> Decision:
    """A rank reported an error (``RankError.stage``): what the run does about it.

    A joiner's error only drops the joiner. A collective error waits for its
    explanation (``after_collective_error``). A NaN loss stops with its own
    code and no traceback; a bad bundle, option or task spec (a file or name
    that is not there, an empty dataset) is the user's (code 2); any
    other stage is the task raising (code 4, with the rank's traceback).
    """
    if joiner:
        return Decision(Outcome.IGNORE, why="drop the joiner")
    if stage == "collective":
        return Decision(Outcome.WAIT)
    if stage == "nonfinite":
        return Decision(Outcome.STOP, EXIT_NONFINITE)
    if stage in ("resume", "config", "task spec"):
        return Decision(Outcome.STOP, EXIT_CONFIG)
    return Decision(Outcome.STOP, EXIT_TASK_ERROR, "traceback")
