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


def _world(heartbeat_s: float, words: dict[int, tuple[str, float]], now: float) -> Membership:
    """Ranks in the collective, each having beat at ``now`` with the word ``words[rank]`` (busy, busy_s)."""
    members = Membership(heartbeat_timeout_s=heartbeat_s)
    for rank, (busy, busy_s) in words.items():
        info = members.expect_rank(rank, host="h", device="cpu", now=0.0)
        info.state, info.pid = PeerState.READY, 40 + rank
        members.heard_progress(info, busy, busy_s, 50.0, 0, now=now)
        members.seen_rank(rank, now)
    return members


def test_a_silent_rank_its_peers_wait_for_is_dead_at_half_the_heartbeat_timeout():
    """Rank 2 went silent mid-step (SIGSTOP, a lost host) while ranks 0 and 1 sit idle, waiting for its
    report: dead after half the heartbeat timeout (they stalled for the whole of it before)."""
    members = _world(10.0, {0: ("idle", 0.0), 1: ("idle", 0.0), 2: ("step", 0.1)}, now=100.0)
    for rank in (0, 1):
        members.heard_progress(members.ranks[rank], "idle", 0.0, 50.0, 0, now=104.9)
        members.seen_rank(rank, 104.9)
    assert members.assess(104.9, LIMITS).healthy
    verdict = members.assess(105.1, LIMITS)
    assert verdict.dead == (2,)
    assert "sent nothing for 5.1 s while its peers waited for it (deadline 5 s; heartbeat timeout 10 s)" in verdict.reason
    # a judge that cannot trust its own last moments (its loop was held up) waits the whole timeout
    assert members.assess(105.1, LIMITS, waited=False).healthy


@pytest.mark.parametrize(
    ("peers", "silent_word", "dead"),
    [
        ("step", "step", False),  # nobody waits: every rank trains (a slow link, a busy host)
        ("idle", "eval", False),  # an eval keeps its own deadline, and may hold up its beats
        ("idle", "save", False),
        ("idle", "build", False),
        ("average", "step", True),  # blocked in an average with it (Sync)
        ("idle", "idle", True),  # everyone waits for the controller, and it stopped beating
    ],
)
def test_who_waits_and_for_what(peers, silent_word, dead):
    members = _world(10.0, {0: (peers, 0.0), 1: (silent_word, 0.1)}, now=100.0)
    members.heard_progress(members.ranks[0], peers, 0.0, 50.0, 0, now=106.0)
    members.seen_rank(0, 106.0)
    assert (members.assess(106.0, LIMITS).dead == (1,)) is dead


def test_a_peer_waiting_never_makes_silence_shorter_than_three_missed_beats():
    members = _world(2.0, {0: ("idle", 0.0), 1: ("step", 0.0)}, now=0.0)
    members.seen_rank(0, 1.4)
    members.heard_progress(members.ranks[0], "idle", 0.0, 50.0, 0, now=1.4)
    assert members.assess(1.4, LIMITS).healthy  # 1.4 s of silence: under WAITED_MIN_S (1.5 s), not half of 2 s
    assert members.assess(1.6, LIMITS).dead == (1,)


def test_a_stuck_step_keeps_the_whole_heartbeat_slack_even_while_its_peers_wait():
    """A training thread stuck in a step while its link beats on: heartbeat timeout + 3 steps, its
    peers idle or not. A rank that beats but makes no progress may be a survivor blocked in a
    collective with a lost host: judged at half the timeout, such survivors went first (a CI run
    lost two host-loss tests to it). Silence alone is judged sooner (the test above)."""
    members = _world(30.0, {0: ("step", 0.0), 1: ("step", 16.0)}, now=10.0)
    members.heard_progress(members.ranks[0], "idle", 0.0, 50.0, 0, now=10.0)
    assert members.assess(10.0, LIMITS).healthy  # 16 s stuck: under 30 s + 3 × 50 ms, peers waiting or not
    members = _world(30.0, {0: ("idle", 0.0), 1: ("step", 30.2)}, now=10.0)
    verdict = members.assess(10.0, LIMITS)
    assert (
        verdict.dead == (1,)
        and "made no progress in a training step for 30.2 s (deadline 30.1 s: heartbeat timeout 30 s +" in verdict.reason
    )
