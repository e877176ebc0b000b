"""Pure tests of liveness as progress (flodl/plan/progress.py) and its use by Membership: table-driven, a fake clock."""

from __future__ import annotations

import pytest

from flodl.plan.membership import Membership, PeerState
from flodl.plan.progress import Progress, ProgressLimits, stalled

LIMITS = ProgressLimits(heartbeat_timeout_s=30.0, first_step_s=120.0, eval_s=600.0)


@pytest.mark.parametrize(
    ("busy", "step_ms", "limits", "deadline"),
    [
        ("step", 200.0, LIMITS, 30.6),  # heartbeat + 3 steps
        ("step", 10_000.0, LIMITS, 60.0),  # long steps stretch it
        ("step", 0.0, LIMITS, 120.0),  # the first step: compilation, warm-up
        ("step", 200.0, ProgressLimits(30.0, 120.0, 600.0, step_s=900.0), 900.0),  # the user's override
        ("step", 0.0, ProgressLimits(30.0, 120.0, 600.0, step_s=900.0), 900.0),
        ("average", 200.0, LIMITS, 150.0),  # a backstop
        ("eval", 200.0, LIMITS, 600.0),
        ("callback", 200.0, LIMITS, 600.0),
        ("save", 200.0, LIMITS, 600.0),
        ("build", 0.0, LIMITS, 120.0),
        ("idle", 200.0, LIMITS, None),  # waiting for the controller is never a hang
        ("", 0.0, LIMITS, None),  # a worker's or the controller's beat
    ],
)
def test_deadlines(busy, step_ms, limits, deadline):
    got = limits.deadline(busy, step_ms)
    assert got == pytest.approx(deadline) if deadline is not None else got is None


@pytest.mark.parametrize(
    ("progress", "now", "hung"),
    [
        (Progress("step", 10.0, 200.0, at=100.0), 100.0, False),
        (Progress("step", 29.0, 200.0, at=100.0), 101.5, False),  # 30.5 s stuck, deadline 30.6
        (Progress("step", 29.0, 200.0, at=100.0), 101.9, True),  # the time since the beat counts too ...
        (Progress("step", 10.0, 200.0, at=100.0), 200.0, False),  # ... while beats are due: silent, not stuck
        (Progress("step", 31.0, 200.0, at=100.0), 100.0, True),
        (Progress("idle", 10_000.0, 200.0, at=100.0), 10_000.0, False),
        (Progress("eval", 599.0, 200.0, at=100.0), 100.5, False),
        (Progress("eval", 599.0, 200.0, at=100.0), 101.5, True),
    ],
)
def test_stalled(progress, now, hung):
    assert (stalled(progress, now, LIMITS) is not None) is hung


def test_the_reason_names_the_activity_the_deadline_and_the_option():
    why = stalled(Progress("step", 31.0, 200.0, at=0.0), 0.0, LIMITS)
    assert why == (
        "made no progress in a training step for 31.0 s (deadline 30.6 s: heartbeat timeout 30 s + 3 × its 0.20 s step;"
        " raise with --step-timeout-secs)"
    )
    assert "eval_timeout_secs" in stalled(Progress("eval", 601.0, 0.0, at=0.0), 0.0, LIMITS)
    assert "join_timeout_secs" in stalled(Progress("step", 121.0, 0.0, at=0.0), 0.0, LIMITS)


def test_membership_declares_a_stuck_rank_dead_with_that_reason():
    members = Membership(heartbeat_timeout_s=30.0)
    for rank in (0, 1):
        info = members.expect_rank(rank, host="h", device="cpu", now=0.0)
        info.state, info.pid = PeerState.READY, 40 + rank
    members.heard_progress(members.ranks[0], "step", 0.5, 100.0, 0, now=10.0)
    members.heard_progress(members.ranks[1], "step", 29.0, 100.0, 0, now=10.0)
    for rank in (0, 1):
        members.seen_rank(rank, 10.0)  # both beat: silence alone would find nothing
    assert members.assess(12.0).healthy  # without the limits only silence and exits count
    verdict = members.assess(12.0, LIMITS)
    assert verdict.dead == (1,)
    assert verdict.reason.startswith("rank 1 on host h (pid 41) made no progress in a training step for 31.0 s")
    members.apply(verdict)
    assert members.ranks[1].death.startswith("made no progress in a training step")
    assert members.ranks[0].state is PeerState.READY and members.generation == 1


def test_the_newest_average_generation_is_kept():
    members = Membership(heartbeat_timeout_s=30.0)
    info = members.expect_rank(0, host="h", device="cpu", now=0.0)
    members.heard_progress(info, "step", 0.0, 1.0, 2, now=1.0)
    members.heard_progress(info, "step", 0.0, 1.0, 1, now=2.0)  # a late, reordered beat
    assert info.averaged == 2
