"""Pure, table-driven tests of what a fault leads to (flodl/plan/decisions.py), healing's back-off,
and the one writer of the membership generation."""

from __future__ import annotations

import pytest

from flodl.config import DdpRunConfig
from flodl.errors import EXIT_CONFIG, EXIT_NONFINITE, EXIT_RANK_LOST, EXIT_TASK_ERROR
from flodl.plan.decisions import (
    MAX_COLLECTIVE_RETRIES,
    Outcome,
    after_collective_error,
    after_deaths,
    after_rank_error,
    unexplained_collective_error,
)
from flodl.plan.membership import RESTART_QUICK_S, Membership, quick_deaths, restart_delay

NCCL = DdpRunConfig().with_mode("nccl-cadence")
CPU = DdpRunConfig().with_mode("cpu-cadence")
LIMIT_1 = NCCL.with_max_failure(1)


@pytest.mark.parametrize(
    ("config", "started", "world", "dead", "survivors", "can_save", "outcome", "code", "save_reason"),
    [
        (NCCL, True, 3, 1, 2, False, Outcome.RECOVER, 0, ""),
        (NCCL, True, 2, 1, 1, False, Outcome.RECOVER, 0, ""),  # one collective rank trains alone
        (CPU, True, 2, 1, 1, True, Outcome.RECOVER, 0, ""),
        (NCCL, True, 2, 2, 0, True, Outcome.STOP, EXIT_RANK_LOST, ""),  # nobody left to save
        (CPU, True, 3, 3, 0, False, Outcome.STOP, EXIT_RANK_LOST, ""),
        (LIMIT_1, True, 3, 1, 2, True, Outcome.SAVE_AND_STOP, EXIT_RANK_LOST, "max_failure_exceeded"),
        (LIMIT_1, True, 3, 1, 2, False, Outcome.STOP, EXIT_RANK_LOST, ""),
        (NCCL, False, 3, 1, 2, True, Outcome.STOP, EXIT_RANK_LOST, ""),  # before the ranks were started
    ],
)
def test_after_deaths(config, started, world, dead, survivors, can_save, outcome, code, save_reason):
    decision = after_deaths(config, started=started, world_size=world, dead_total=dead, survivors=survivors, can_save=can_save)
    assert (decision.outcome, decision.code, decision.save_reason) == (outcome, code, save_reason)
    if outcome is not Outcome.RECOVER:
        assert decision.why


def test_max_failure_reason_names_the_limit():
    decision = after_deaths(LIMIT_1, started=True, world_size=3, dead_total=1, survivors=2, can_save=False)
    assert decision.why == "1 of 3 ranks lost reaches max_failure 1 (limit 1)"


def test_a_world_left_with_only_unseeded_joiners_stops_without_saving():
    # rank 2 joined and has not taken the consensus yet: nothing it holds is the run's
    decision = after_deaths(NCCL, started=True, world_size=3, dead_total=2, survivors=1, can_save=True, unseeded=(2,))
    assert (decision.outcome, decision.code) == (Outcome.STOP, EXIT_RANK_LOST)
    assert "rank(s) 2 joined and had not received them" in decision.why and "--resume-from" in decision.why
    # one survivor holds them: the joiner takes them from it, and the run goes on
    decision = after_deaths(NCCL, started=True, world_size=4, dead_total=2, survivors=2, can_save=True, unseeded=(3,))
    assert decision.outcome is Outcome.RECOVER
    # past max_failure with a holder left: it saves, from the holder
    decision = after_deaths(LIMIT_1, started=True, world_size=3, dead_total=1, survivors=2, can_save=True, unseeded=(2,))
    assert decision.outcome is Outcome.SAVE_AND_STOP


@pytest.mark.parametrize(
    ("reported", "current", "pending", "outcome"),
    [
        (1, 1, False, Outcome.WAIT),  # a death may explain it: wait for the report
        (2, 1, False, Outcome.WAIT),
        (0, 1, False, Outcome.IGNORE),  # an older generation: the regroup answered it
        (1, 1, True, Outcome.IGNORE),  # one wait at a time
    ],
)
def test_after_collective_error(reported, current, pending, outcome):
    assert after_collective_error(reported_generation=reported, generation=current, pending=pending).outcome is outcome


@pytest.mark.parametrize(
    ("waited", "retries", "outcome"),
    [
        (0.5, 0, Outcome.WAIT),
        (1.5, 0, Outcome.REBUILD),
        (1.5, MAX_COLLECTIVE_RETRIES - 1, Outcome.REBUILD),
        (1.5, MAX_COLLECTIVE_RETRIES, Outcome.STOP),
    ],
)
def test_unexplained_collective_error(waited, retries, outcome):
    decision = unexplained_collective_error(waited_s=waited, grace_s=1.0, retries=retries, where="rank 1", error="boom")
    assert decision.outcome is outcome
    if outcome is Outcome.STOP:
        assert decision.code == EXIT_RANK_LOST and decision.why == f"rank 1 saw its collective fail {retries + 1} times: boom"


@pytest.mark.parametrize(
    ("stage", "joiner", "outcome", "code"),
    [
        ("train", True, Outcome.IGNORE, 0),  # a joiner's failure only drops the joiner
        ("collective", False, Outcome.WAIT, 0),
        ("nonfinite", False, Outcome.STOP, EXIT_NONFINITE),
        ("resume", False, Outcome.STOP, EXIT_CONFIG),
        ("config", False, Outcome.STOP, EXIT_CONFIG),
        ("task spec", False, Outcome.STOP, EXIT_CONFIG),
        ("train", False, Outcome.STOP, EXIT_TASK_ERROR),
        ("build", False, Outcome.STOP, EXIT_TASK_ERROR),
        ("eval_fn", False, Outcome.STOP, EXIT_TASK_ERROR),
    ],
)
def test_after_rank_error(stage, joiner, outcome, code):
    decision = after_rank_error(stage, joiner=joiner)
    assert (decision.outcome, decision.code) == (outcome, code)


@pytest.mark.parametrize(
    ("used", "max_restarts", "delay"),
    [(0, 0, None), (0, 3, 0.0), (1, 3, 1.0), (2, 3, 2.0), (3, 3, None), (7, 10, 30.0)],
)
def test_restart_backoff(used, max_restarts, delay):
    assert restart_delay(used, max_restarts) == delay


def test_the_backoff_grows_in_a_crash_loop_and_starts_again_after_a_rank_that_trained_a_while():
    """A slot restarted 6 times waited 30 s before its 7th restart however long each rank had trained:
    in a long run with a fault now and then, every fault soon cost a slot 30 s. The back-off now
    doubles only while restarts die soon after their start, and a rank that trained a while is
    restarted at once (it waited 1 s: most of a healed kill's time back at full size)."""
    streak = 0
    delays = []
    for used, lived_s in enumerate([600.0, 2.0, 3.0, 5.0, 400.0, 12.0, 1.0]):  # each dead rank's life before its restart
        streak = quick_deaths(streak, lived_s) if used else 0  # the first death is of a rank the run started with
        delays.append(restart_delay(used, 10, streak))
    assert delays == [0.0, 1.0, 2.0, 4.0, 0.0, 0.0, 1.0]
    assert quick_deaths(0, RESTART_QUICK_S - 0.1) == 1 and quick_deaths(3, RESTART_QUICK_S) == 0
    assert restart_delay(9, 10, 0) == 0.0 and restart_delay(10, 10, 0) is None  # the budget still counts every restart


def test_the_generation_has_one_writer():
    members = Membership(heartbeat_timeout_s=1.0)
    members.expect_rank(0, host="h", device="cpu", now=0.0)
    assert members.new_generation("a collective rebuilt") == 1
    members.rank_exited(0, -9)
    verdict = members.assess(0.5)
    assert verdict.dead == (0,) and members.generation == 1  # a verdict bumps nothing ...
    members.apply(verdict)
    assert members.generation == 2  # ... applying it does, through new_generation
    assert members.assess(0.6).healthy and members.generation == 2
    with pytest.raises(AttributeError):
        members.generation = 7  # read-only: new_generation is the only writer
