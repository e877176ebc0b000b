"""ElChe cadence balancer (docs/cadence.md#elche): the reference ElChe's golden values, its acceptance
items 1-10 (numbered as in the reference's list, which is not in this repository) and the 0.7 deltas (phases, election, gated growth, relax_up, window cap, ratios, checkpoints)."""

from __future__ import annotations

import json
import math

import pytest

from flodl.config import ElCheConfig
from flodl.plan.elche import SOLO_WINDOW_MS, ElChe, cap_window, elect_anchor_rank, phase_for
from flodl.plan.signals import Phase, Verdict

pytestmark = pytest.mark.timeout(30)


def report(che: ElChe, walls, sync_ms: float = 0.0, batches=None) -> None:
    """One window: each rank ran its planned batches (or ``batches``) in ``walls`` ms."""
    che.report_timing(walls, list(batches if batches is not None else che.batch_counts), sync_ms)


def ungated(world_size: int = 2, **kwargs) -> ElChe:
    """0.5.3 behaviour: overhead growth applies inside report_timing."""
    return ElChe(world_size, gate_growth=False, **kwargs)


# ---------------------------------------------------------------------------
# acceptance item 1: construction
# ---------------------------------------------------------------------------


def test_new_elche_plans_anchor_everywhere_uncalibrated():
    che = ElChe(3, anchor=7)
    assert che.batch_counts == [7, 7, 7]
    assert che.ms_per_batch == [0.0, 0.0, 0.0]
    assert not che.calibrated
    assert che.phase is Phase.PROBE
    assert che.anchor_rank is None and che.pending_anchor is None
    assert che.anchor_wall_ms() == 0.0
    assert che.total_batches() == 21


def test_one_rank_world_is_legal():
    che = ElChe(1, anchor=10)
    assert che.batch_counts == [10]
    report(che, [500.0], sync_ms=0.0)
    assert che.batch_counts == [10]
    assert che.anchor_rank == 0
    assert che.anchor_wall_ms() == pytest.approx(500.0)
    assert che.shares() == [1.0]


def test_a_world_of_one_sizes_its_window_by_wall_time():
    # nothing to average against: 1 ms batches make a SOLO_WINDOW_MS window, whatever sync costs
    che = ElChe(1, anchor=10)
    report(che, [10.0], sync_ms=0.0)
    assert che.anchor == che.batch_counts[0] == math.ceil(SOLO_WINDOW_MS / 1.0)
    assert che.anchor_wall_ms() == pytest.approx(SOLO_WINDOW_MS, rel=0.01)
    # jitter inside the dead zone re-plans nothing
    report(che, [che.anchor * 1.05], sync_ms=0.0)
    assert che.anchor == math.ceil(SOLO_WINDOW_MS / 1.0)


def test_a_world_of_one_keeps_its_bounds_and_cap():
    assert ElChe(1, anchor=10, max_anchor=40).anchor == 10
    capped = ElChe(1, anchor=10, max_anchor=40)
    report(capped, [1.0], sync_ms=0.0)  # 0.1 ms batches would want 2,500
    assert capped.batch_counts == [40]
    slow = ElChe(1, anchor=10)
    report(slow, [1000.0], sync_ms=0.0)  # 100 ms batches: min_anchor holds
    assert slow.batch_counts == [10]
    epoch = ElChe(1, anchor=10, max_total_batches=120)
    report(epoch, [10.0], sync_ms=0.0)
    assert epoch.batch_counts == [120]  # never past the window cap (an epoch's batches)


def test_sync_policy_and_two_ranks_ignore_the_solo_rule():
    sync = ElChe(1, anchor=10, sync_policy=True)
    report(sync, [10.0], sync_ms=0.0)
    assert sync.batch_counts == [10]
    pair = ElChe(2, anchor=10)
    report(pair, [10.0, 10.0], sync_ms=0.0)
    assert pair.anchor == 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 0},
        {"world_size": -1},
        {"world_size": 2, "anchor": 0},
        {"world_size": 2, "max_anchor": 0},
        {"world_size": 2, "min_anchor": 0},
        {"world_size": 2, "max_batch_diff": -1},
        {"world_size": 2, "max_count_step": -1},
        {"world_size": 2, "max_total_batches": 0},
        {"world_size": 2, "overhead_target": float("nan")},
        {"world_size": True},
        {"world_size": 2, "partition_ratios": [1.0]},
        {"world_size": 2, "partition_ratios": [0.0, 0.0]},
        {"world_size": 2, "partition_ratios": [1.0, -1.0]},
    ],
)
def test_invalid_construction_is_rejected(kwargs):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError):
        ElChe(world, **kwargs)


def test_construction_clamps_like_the_reference():
    assert ElChe(2, overhead_target=0.9).overhead_target == 0.5
    assert ElChe(2, overhead_target=0.0).overhead_target == 0.01
    che = ElChe(2, anchor=10)
    assert che.min_anchor == 10 and che.max_anchor == 1000 and che.overhead_target == 0.05
    pinned = ElChe(2, anchor=10, max_anchor=4)
    assert (pinned.min_anchor, pinned.max_anchor, pinned.anchor) == (4, 4, 4)
    assert pinned.batch_counts == [4, 4]


# ---------------------------------------------------------------------------
# golden values, acceptance items 2-6
# ---------------------------------------------------------------------------


def test_two_to_one_speed_gives_20_10():
    che = ElChe(2, anchor=10, overhead_target=0.5)
    report(che, [500.0, 1000.0], sync_ms=10.0)
    assert che.batch_counts == [20, 10]
    assert che.anchor == 10
    assert che.calibrated
    assert che.anchor_rank == 1
    assert che.anchor_wall_ms() == pytest.approx(1000.0)


def test_rtx_vs_gtx_ratio_gives_22_or_23():
    che = ElChe(2, anchor=10, overhead_target=0.5)
    report(che, [730.0, 1640.0], sync_ms=10.0)
    assert che.batch_counts[1] == 10
    assert che.batch_counts[0] in (22, 23)


def test_overhead_fifty_percent_grows_anchor_fivefold():
    che = ungated(anchor=10, overhead_target=0.1)
    report(che, [1000.0, 1000.0], sync_ms=500.0)
    assert che.anchor == 50
    assert che.batch_counts == [50, 50]


def test_overhead_growth_with_two_to_one_speed():
    che = ungated(anchor=10, overhead_target=0.1)
    report(che, [500.0, 1000.0], sync_ms=400.0)
    assert che.anchor == 40  # 0.4 / 0.1 is 4.000000000000001 in floats: no extra batch
    assert che.batch_counts == [80, 40]


def test_anchor_growth_is_capped_at_max_anchor():
    che = ungated(anchor=10, overhead_target=0.01, max_anchor=30)
    report(che, [100.0, 100.0], sync_ms=500.0)
    assert che.anchor == 30
    assert che.batch_counts == [30, 30]


def test_max_anchor_one_never_grows():
    che = ungated(anchor=1, max_anchor=1).with_speed_hint(1, 2.0)
    assert che.batch_counts == [2, 1]
    report(che, [100.0, 200.0], sync_ms=500.0)
    assert che.anchor == 1


def test_low_overhead_at_min_anchor_keeps_anchor():
    che = ungated(anchor=10)
    report(che, [1000.0, 1000.0], sync_ms=5.0)  # 0.5 % overhead, anchor == min_anchor
    assert che.anchor == 10
    assert che.batch_counts == [10, 10]


def test_low_overhead_above_min_anchor_decreases_by_one_even_when_gated():
    che = ElChe(2, anchor=10, min_anchor=5)  # gated: shrinking needs no verdict
    report(che, [1000.0, 1000.0], sync_ms=5.0)
    assert che.anchor == 9
    assert che.batch_counts == [9, 9]  # an anchor change is a decision, not noise: no dead zone
    report(che, [900.0, 900.0], sync_ms=5.0)
    assert che.anchor == 8


def test_three_ranks_three_two_one():
    che = ElChe(3, anchor=10)
    report(che, [333.0, 500.0, 1000.0])
    assert che.batch_counts == [30, 20, 10]
    for _ in range(5):  # the same speeds again: the plan must not move
        report(che, [999.0, 1000.0, 1000.0])
        assert che.batch_counts == [30, 20, 10]


def test_max_count_step_limits_a_single_update():
    che = ElChe(2, anchor=10, max_count_step=3)
    report(che, [100.0, 20.0])
    assert che.batch_counts == [10, 50]
    report(che, [100.0, 450.0])  # rank 1 slows to 9 ms/batch: EMA alpha 0.8 -> 7.6 ms
    assert che.ms_per_batch[1] == pytest.approx(7.6)
    assert che.batch_counts == [10, 47]  # raw target 13, but one update moves at most 3


def test_dead_zone_ignores_small_jitter():
    che = ElChe(2, anchor=10)
    report(che, [500.0, 1000.0])
    assert che.batch_counts == [20, 10]
    report(che, [20 * 60.0, 1000.0])  # EMA alpha 0.2 -> 52 ms: target 19, within 5 % of 20
    assert che.ms_per_batch[0] == pytest.approx(52.0)
    assert che.batch_counts == [20, 10]


def test_ema_first_reading_raw_then_error_adaptive():
    che = ElChe(2, anchor=10)
    report(che, [100.0, 200.0])
    assert che.ms_per_batch == [10.0, 20.0]
    report(che, [105.0 * 2, 200.0], batches=[20, 10])  # 10.5 ms: err 5 % -> alpha 0.1
    assert che.ms_per_batch[0] == pytest.approx(0.1 * 10.5 + 0.9 * 10.0)
    assert che.ms_per_batch[1] == pytest.approx(20.0)


def test_a_probe_reading_gives_way_to_the_first_settled_one():
    # the probe's warm-up read the fast rank 30 ms/batch; it really takes 22.5
    che = ElChe(2, anchor=10)
    che.report_timing([390.0, 480.0], [13, 5], 0.0, provisional=[True, True])
    assert che.ms_per_batch == [30.0, 96.0] and che.provisional == [True, True]
    assert che.batch_counts == [32, 10]
    report(che, [32 * 22.5, 960.0])
    # taken raw, not blended (an EMA would read 28.6 and keep the count at 32, 10 batches short)
    assert che.ms_per_batch == [22.5, 96.0] and che.provisional == [False, False]
    assert che.batch_counts == [43, 10]
    report(che, [43 * 23.0, 960.0])
    assert che.ms_per_batch[0] == pytest.approx(0.1 * 23.0 + 0.9 * 22.5)  # settled: the EMA as before


def test_a_provisional_reading_never_moves_a_settled_speed():
    che = ElChe(2, anchor=10)
    report(che, [200.0, 400.0])
    che.report_timing([900.0, 400.0], [20, 10], 0.0, provisional=[True, False])
    assert che.ms_per_batch == [20.0, 40.0] and che.provisional == [False, False]
    with pytest.raises(ValueError, match="provisional"):
        che.report_timing([1.0, 1.0], [1, 1], 0.0, provisional=[True])


def test_the_provisional_flags_survive_a_checkpoint():
    che = ElChe(2, anchor=10)
    che.report_timing([390.0, 480.0], [13, 5], 0.0, provisional=[True, False])
    restored = ElChe(2, anchor=10)
    restored.load_state_dict(che.state_dict())
    assert restored.provisional == [True, False]
    older = {k: v for k, v in che.state_dict().items() if k != "provisional"}  # a bundle from before the flags
    restored.load_state_dict(older)
    assert restored.provisional == [False, False]


def test_report_without_usable_timing_changes_nothing():
    che = ElChe(2, anchor=10)
    report(che, [0.0, 0.0], sync_ms=100.0, batches=[0, 0])
    assert not che.calibrated and che.calibration_count == 0 and che.phase is Phase.PROBE
    assert che.batch_counts == [10, 10]


def test_report_needs_one_entry_per_rank():
    with pytest.raises(ValueError):
        ElChe(2).report_timing([1.0], [1, 1], 0.0)


def test_nccl_style_zero_sync_never_tunes_anchor():
    che = ungated(anchor=10, min_anchor=2)
    for _ in range(10):
        report(che, [500.0, 1000.0], sync_ms=0.0)
    assert che.anchor == 10


def test_speed_ratio_is_capped_at_64():
    che = ElChe(2, anchor=10)
    report(che, [1.0, 1000.0])  # 1000x faster
    assert che.batch_counts == [640, 10]


# ---------------------------------------------------------------------------
# acceptance item 7: clamp_total
# ---------------------------------------------------------------------------


def test_clamp_total_keeps_sum_and_order():
    che = ElChe(3, anchor=10)
    report(che, [333.0, 500.0, 1000.0])  # [30, 20, 10]
    clamped = che.clamp_total(25)
    assert sum(clamped) == 25
    assert clamped[0] >= clamped[1] >= clamped[2] >= 1
    assert clamped == [13, 8, 4]  # floors [12, 8, 4], +1 to ranks in index order
    assert che.batch_counts == [30, 20, 10]  # a view, not a change


def test_clamp_total_noop_when_within():
    che = ElChe(2, anchor=10)
    assert che.clamp_total(20) == [10, 10]
    assert che.clamp_total(100) == [10, 10]


def test_clamp_total_remainder_in_index_order():
    che = ElChe(3, anchor=10)  # [10, 10, 10]
    assert che.clamp_total(10) == [4, 3, 3]


# ---------------------------------------------------------------------------
# acceptance item 9: speed hints
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "slow", "ratio", "expected"),
    [
        (2, 1, 2.0, [20, 10]),
        (2, 1, 2.3, [23, 10]),
        (2, 0, 3.0, [10, 30]),
        (2, 1, 1.0, [10, 10]),
        (2, 1, 0.5, [10, 10]),  # ratios below 1 mean "no faster": clamped to 1
        (3, 2, 3.0, [30, 30, 10]),
        (3, 1, 2.0, [20, 10, 20]),
    ],
)
def test_speed_hints(world, slow, ratio, expected):
    che = ElChe(world, anchor=10).with_speed_hint(slow, ratio)
    assert che.batch_counts == expected
    assert che.has_speed_hint() == (len(set(expected)) > 1)
    assert not che.calibrated


def test_speed_hint_rejects_unknown_rank():
    with pytest.raises(ValueError):
        ElChe(2).with_speed_hint(2, 2.0)


def test_wrong_speed_hint_self_corrects_after_one_report():
    che = ElChe(2, anchor=10, overhead_target=0.5).with_speed_hint(0, 2.0)
    assert che.batch_counts == [10, 20]  # wrong: rank 0 is really the fast one
    report(che, [500.0, 2000.0], sync_ms=10.0)
    assert che.anchor_rank == 1
    assert che.batches(1) == che.anchor
    assert che.batches(0) > che.batches(1)
    assert che.batch_counts == [20, 10]


# ---------------------------------------------------------------------------
# acceptance item 10: nudge_anchor_down
# ---------------------------------------------------------------------------


def test_nudge_halves_anchor_and_recomputes_counts():
    che = ElChe(2, anchor=20)
    report(che, [500.0, 1000.0], batches=[20, 20])
    assert che.batch_counts == [40, 20]
    che.nudge_anchor_down(0.5)
    assert che.anchor == 10
    assert che.batch_counts == [20, 10]


def test_nudge_floors_at_one_and_bypasses_min_anchor():
    che = ElChe(2, anchor=5)
    che.nudge_anchor_down(0.1)
    assert che.anchor == 1
    assert che.min_anchor == 5
    assert che.batch_counts == [1, 1]
    che.nudge_anchor_down(0.01)
    assert che.anchor == 1


def test_nudge_factor_above_one_never_increases():
    che = ElChe(2, anchor=10)
    che.nudge_anchor_down(2.0)
    assert che.anchor == 10
    che.nudge_anchor_down(1.0)
    assert che.anchor == 10


def test_nudge_before_timing_keeps_the_hint_shape():
    che = ElChe(2, anchor=10).with_speed_hint(1, 2.0)
    che.nudge_anchor_down(0.5)
    assert che.anchor == 5
    assert che.batch_counts == [10, 5]


# ---------------------------------------------------------------------------
# 0.7: phases and election
# ---------------------------------------------------------------------------


def test_phase_thresholds():
    assert [phase_for(n) for n in (0, 1, 4, 5, 19, 20, 1000)] == [
        Phase.PROBE,
        Phase.WARMUP,
        Phase.WARMUP,
        Phase.STABLE,
        Phase.STABLE,
        Phase.MATURE,
        Phase.MATURE,
    ]
    assert Phase.PROBE < Phase.WARMUP < Phase.STABLE < Phase.MATURE
    assert Phase.MATURE >= "stable"


def test_phases_advance_at_1_5_20_calibrations():
    che = ElChe(2, anchor=10)
    seen = []
    for _ in range(21):
        report(che, [500.0, 1000.0])
        seen.append(che.phase)
    assert seen[0] is Phase.WARMUP
    assert seen[3] is Phase.WARMUP and seen[4] is Phase.STABLE
    assert seen[18] is Phase.STABLE and seen[19] is Phase.MATURE
    assert seen[20] is Phase.MATURE
    assert che.calibration_count == 21


def test_elect_anchor_rank_rules():
    assert elect_anchor_rank([0.0, 0.0], None) is None
    assert elect_anchor_rank([50.0, 100.0], None) == 1
    # Within the cohort, no current pick: lowest index.
    assert elect_anchor_rank([95.0, 100.0], None) == 0
    # Sticky within the 10 % margin, replaced beyond it.
    assert elect_anchor_rank([100.0, 105.0], 0) == 0
    assert elect_anchor_rank([100.0, 110.0], 0) == 1
    assert elect_anchor_rank([100.0, 112.0], 0) == 1
    # A current pick that left the cohort is replaced by the lowest cohort index.
    assert elect_anchor_rank([50.0, 100.0, 100.0], 0) == 1
    # Equal challengers: the lowest index wins.
    assert elect_anchor_rank([80.0, 100.0, 100.0], 0) == 1


def _speeds(che: ElChe, ms_per_batch) -> None:
    """Report a window in which each rank ran its plan at ``ms_per_batch`` (EMA converges fast)."""
    report(che, [m * c for m, c in zip(ms_per_batch, che.batch_counts, strict=False)])


def test_election_held_through_warmup_and_switches_only_from_stable():
    che = ElChe(2, anchor=10)
    _speeds(che, [100.0, 80.0])
    assert che.anchor_rank == 0
    for _ in range(4):  # calibrations 2-5: rank 1 now clearly slower, but Warmup holds the pick
        _speeds(che, [100.0, 130.0])
        assert che.anchor_rank == 0
    assert che.phase is Phase.STABLE
    # Counts are planned against the pinned rank: the slower rank 1 gets fewer than anchor.
    assert che.batch_counts[0] == 10 and che.batch_counts[1] < 10
    _speeds(che, [100.0, 130.0])  # first report seen from Stable: re-elect
    assert che.anchor_rank == 1
    assert che.batch_counts[1] == 10 and che.batch_counts[0] > 10


def test_election_keeps_rank_within_margin():
    che = ElChe(2, anchor=10)
    _speeds(che, [100.0, 90.0])
    assert che.anchor_rank == 0
    for _ in range(10):
        _speeds(che, [100.0, 105.0])  # rank 1 only 5 % slower: no churn
    assert che.phase >= Phase.STABLE
    assert che.anchor_rank == 0
    for _ in range(3):
        _speeds(che, [100.0, 130.0])
    assert che.anchor_rank == 1


# ---------------------------------------------------------------------------
# 0.7: gated growth (acceptance item 18)
# ---------------------------------------------------------------------------


def high_overhead(che: ElChe) -> None:
    report(che, [1000.0, 1000.0], sync_ms=500.0)  # overhead 0.5 against target 0.1


def test_growth_is_staged_and_committed_on_stable():
    che = ElChe(2, anchor=10, overhead_target=0.1)
    high_overhead(che)
    assert che.anchor == 10
    assert che.pending_anchor == 50
    assert che.batch_counts == [10, 10]
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 50
    assert che.pending_anchor is None
    assert che.batch_counts == [50, 50]
    assert che.stable_streak == 1


def test_suppress_growth_drops_proposal_and_latches_until_five_stables():
    che = ElChe(2, anchor=10, overhead_target=0.1)
    high_overhead(che)
    che.apply_verdict(Verdict.SUPPRESS_GROWTH)
    assert che.pending_anchor is None and che.growth_latched_off and che.stable_streak == 0
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 10
    high_overhead(che)
    assert che.pending_anchor is None  # latched: nothing is even proposed
    for _ in range(3):
        che.apply_verdict(Verdict.STABLE)
    assert che.growth_latched_off  # 4 consecutive Stables so far
    che.apply_verdict(Verdict.STABLE)
    assert not che.growth_latched_off
    high_overhead(che)
    assert che.pending_anchor == 50
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 50


def test_suppress_resets_the_rearm_streak():
    che = ElChe(2, anchor=10, overhead_target=0.1)
    che.apply_verdict(Verdict.SUPPRESS_GROWTH)
    for _ in range(4):
        che.apply_verdict(Verdict.STABLE)
    che.apply_verdict(Verdict.SUPPRESS_GROWTH)
    for _ in range(4):
        che.apply_verdict(Verdict.STABLE)
    assert che.growth_latched_off


def test_nudge_down_discards_staged_growth():
    che = ElChe(2, anchor=20, overhead_target=0.1)
    high_overhead(che)
    assert che.pending_anchor == 100
    che.apply_verdict(Verdict.nudge(0.5))
    assert che.anchor == 10
    assert che.pending_anchor is None
    che.apply_verdict(Verdict.STABLE)  # a later Stable cannot undo the nudge
    assert che.anchor == 10
    assert che.batch_counts == [10, 10]


def test_low_overhead_drops_stale_proposal():
    che = ElChe(2, anchor=10, overhead_target=0.1)
    high_overhead(che)
    assert che.pending_anchor == 50
    report(che, [1000.0, 1000.0], sync_ms=60.0)  # back on target
    assert che.pending_anchor is None


def test_ungated_growth_respects_the_latch():
    che = ungated(anchor=10, overhead_target=0.1)
    che.apply_verdict(Verdict.SUPPRESS_GROWTH)
    high_overhead(che)
    assert che.anchor == 10


def test_unknown_verdict_kind_is_rejected():
    class Odd:
        kind = "sideways"
        factor = None

    with pytest.raises(ValueError):
        ElChe(2).apply_verdict(Odd())


# ---------------------------------------------------------------------------
# 0.7: relax_up
# ---------------------------------------------------------------------------


def test_relax_up_grows_by_one_per_stable():
    che = ElChe(2, anchor=10, relax_up=True)
    report(che, [500.0, 1000.0])
    assert che.batch_counts == [20, 10]
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 11
    assert che.batch_counts == [22, 11]
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 12
    assert che.batch_counts == [24, 12]


def test_relax_up_stops_at_max_anchor():
    che = ElChe(2, anchor=10, max_anchor=11, relax_up=True)
    for _ in range(3):
        che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 11


def test_relax_up_respects_max_batch_diff():
    che = ElChe(2, anchor=10, max_batch_diff=12, relax_up=True)
    report(che, [500.0, 1000.0])  # 2:1 -> spread equals the anchor
    assert che.batch_counts == [20, 10]
    che.apply_verdict(Verdict.STABLE)
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 12 and che.batch_counts == [24, 12]
    che.apply_verdict(Verdict.STABLE)  # 13 would make the spread 13 > 12
    assert che.anchor == 12


def test_the_spread_cap_and_the_step_limit_are_two_limits_and_the_option_sets_both():
    spread = ElChe(2, anchor=10, max_batch_diff=3)  # the spread cap alone does not slow a re-plan
    report(spread, [100.0, 20.0])
    report(spread, [100.0, 450.0])
    assert spread.batch_counts == [10, 13]
    step = ElChe(2, anchor=10, max_count_step=3, relax_up=True)  # the step limit alone caps no spread
    report(step, [500.0, 1000.0])
    for _ in range(5):
        step.apply_verdict(Verdict.STABLE)
    assert step.anchor == 15 and step.batch_counts[0] - step.batch_counts[1] > 3
    both = ElChe.from_config(ElCheConfig(mode="nccl-cadence", max_batch_diff=3), 2)
    assert both.max_batch_diff == both.max_count_step == 3


def test_relax_up_yields_to_a_staged_proposal():
    che = ElChe(2, anchor=10, overhead_target=0.1, relax_up=True)
    high_overhead(che)
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 50  # the proposal, not 50 + 1


def test_relax_up_is_off_by_default():
    che = ElChe(2, anchor=10)
    che.apply_verdict(Verdict.STABLE)
    assert che.anchor == 10


# ---------------------------------------------------------------------------
# 0.7: window cap and partition ratios
# ---------------------------------------------------------------------------


def test_cap_window_rule():
    assert cap_window([30, 20, 10], 100) == [30, 20, 10]
    assert cap_window([30, 20, 10], 25) == [13, 8, 4]  # floors [12, 8, 4]; +1 to the largest
    assert cap_window([100, 1], 10) == [9, 1]  # min 1 each, then taken back from the largest
    assert cap_window([5, 5, 5], 2) == [1, 1, 1]  # below the world size the floor wins


def test_window_cap_keeps_total_at_cap():
    che = ElChe(3, anchor=10, max_total_batches=40)
    assert che.total_batches() == 30
    report(che, [333.0, 500.0, 1000.0])
    assert che.total_batches() == 40
    assert che.batch_counts == [21, 13, 6]  # floors [20, 13, 6] + remainder to the largest
    for _ in range(3):
        report(che, [999.0, 1000.0, 1000.0], batches=[30, 20, 10])
        assert che.total_batches() == 40


def test_window_cap_applies_to_hints_and_growth():
    che = ungated(anchor=10, overhead_target=0.1, max_total_batches=30)
    che.with_speed_hint(1, 3.0)
    assert che.total_batches() == 30
    high_overhead(che)
    assert che.total_batches() == 30


def test_window_cap_blocks_growth_proposals():
    che = ElChe(2, anchor=10, overhead_target=0.1, max_total_batches=20)
    high_overhead(che)
    assert che.pending_anchor is None


def test_partition_ratios_fix_counts():
    che = ElChe(3, anchor=10, partition_ratios=[3, 2, 1])
    assert che.batch_counts == [30, 20, 10]
    assert che.anchor_rank == 2
    for walls in ([100.0, 100.0, 100.0], [1000.0, 10.0, 500.0]):
        report(che, walls)
        assert che.batch_counts == [30, 20, 10]
    assert che.ms_per_batch[0] > 0 and che.phase is Phase.WARMUP
    assert che.partition_ratios == (3.0, 2.0, 1.0)


def test_partition_ratios_follow_the_anchor():
    che = ungated(3, anchor=10, overhead_target=0.1, partition_ratios=[0.5, 1 / 3, 1 / 6])
    assert che.batch_counts == [30, 20, 10]
    report(che, [1000.0, 1000.0, 1000.0], sync_ms=200.0)  # overhead 0.2 -> anchor 20
    assert che.anchor == 20
    assert che.batch_counts == [60, 40, 20]
    che.nudge_anchor_down(0.5)
    assert che.batch_counts == [30, 20, 10]
    che.with_speed_hint(0, 5.0)  # ratios win over hints
    assert che.batch_counts == [30, 20, 10]


def test_partition_ratios_from_config():
    config = ElCheConfig(mode="cpu-cadence", partition_ratios=[3, 2, 1])
    che = ElChe.from_config(config, 3)
    assert che.batch_counts == [30, 20, 10]
    assert che.shares() == pytest.approx([0.5, 1 / 3, 1 / 6])


# ---------------------------------------------------------------------------
# from_config and checkpoints
# ---------------------------------------------------------------------------


def test_from_config_defaults_and_overrides():
    sync = ElChe.from_config(ElCheConfig(mode="nccl-sync"), 2)
    assert sync.anchor == 1 and sync.min_anchor == 1 and sync.max_anchor == 1000
    assert sync.overhead_target == 0.05 and sync.max_batch_diff is None and not sync.relax_up
    config = ElCheConfig(mode="cpu-cadence", min_anchor=4, max_anchor=50, overhead_target=0.2, max_batch_diff=5, relax_up=True)
    che = ElChe.from_config(config, 4, max_total_batches=30)
    assert che.anchor == 10 and che.min_anchor == 4 and che.max_anchor == 50
    assert che.overhead_target == 0.2 and che.max_batch_diff == 5 and che.max_count_step == 5 and che.relax_up
    assert che.max_total_batches == 30
    assert che.batch_counts == [9, 7, 7, 7]  # floors [7, 7, 7, 7]; remainder to the largest
    assert che.gate_growth


def test_sync_modes_never_grow_the_anchor():
    sync = ElChe.from_config(ElCheConfig(mode="cpu-sync", relax_up=True), 2)
    assert sync.sync_policy and sync.anchor == 1
    report(sync, [100.0, 100.0], sync_ms=500.0)
    assert sync.pending_anchor is None
    sync.apply_verdict(Verdict.STABLE)
    assert sync.anchor == 1
    cadence = ElChe.from_config(ElCheConfig(mode="cpu-cadence"), 2)
    assert not cadence.sync_policy


def test_from_config_rejects_ratio_count_mismatch():
    config = ElCheConfig(partition_ratios=(0.5, 0.5))
    with pytest.raises(ValueError):
        ElChe.from_config(config, 3)


def _trained() -> ElChe:
    che = ElChe(3, anchor=10, overhead_target=0.1, max_batch_diff=40)
    for walls in ([333.0, 500.0, 1000.0], [1000.0, 1000.0, 1100.0], [300.0, 450.0, 1000.0]):
        report(che, walls, sync_ms=3.0)
    report(che, [1000.0, 1000.0, 1000.0], sync_ms=500.0)
    che.apply_verdict(Verdict.STABLE)
    report(che, [1000.0, 1000.0, 1000.0], sync_ms=500.0)
    assert che.pending_anchor is not None
    return che


def test_state_dict_round_trip_exact():
    che = _trained()
    state = che.state_dict()
    fresh = ElChe(3)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert fresh.batch_counts == che.batch_counts and fresh.ms_per_batch == che.ms_per_batch
    assert fresh.phase is che.phase and fresh.anchor_rank == che.anchor_rank


def test_state_dict_survives_json():
    che = _trained()
    che.apply_verdict(Verdict.SUPPRESS_GROWTH)
    state = che.state_dict()
    # Options come from the run's config, learned state from the checkpoint.
    restored = ElChe(3, anchor=10, overhead_target=0.1, max_batch_diff=40)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.growth_latched_off
    # The restored balancer behaves like the original from here on.
    for target in (che, restored):
        report(target, [400.0, 500.0, 1000.0], sync_ms=3.0)
    assert restored.state_dict() == che.state_dict()


def test_load_state_dict_rejects_world_size_change():
    state = ElChe(2).state_dict()
    with pytest.raises(ValueError, match="world"):
        ElChe(3).load_state_dict(state)


# ---------------------------------------------------------------------------
# a window's fixed cost (issue 22): the controller's planning and settling, whatever the model
# ---------------------------------------------------------------------------


def test_a_fixed_cost_over_two_percent_grows_the_anchor_though_averaging_is_cheap():
    """1 ms of fixed cost against a 20 ms window is 5%: the anchor grows 2.5x (to 2%), though
    the averaging's 0.4 ms (2%) is under half its 5% target and alone would shrink the anchor."""
    che = ungated(anchor=10, min_anchor=5)
    che.report_timing([20.0, 20.0], [10, 10], 0.4, fixed_ms=1.0)
    assert che.anchor == 25
    cheap = ungated(anchor=10, min_anchor=5)
    cheap.report_timing([20.0, 20.0], [10, 10], 0.4)
    assert cheap.anchor == 9


def test_a_fixed_cost_within_two_percent_leaves_the_averaging_overhead_in_charge():
    che = ungated(anchor=10, overhead_target=0.1)
    che.report_timing([1000.0, 1000.0], [10, 10], 500.0, fixed_ms=10.0)  # fixed 1%, averaging 50%
    assert che.anchor == 50  # as test_overhead_fifty_percent_grows_anchor_fivefold
    small = ungated(anchor=10, min_anchor=5)
    small.report_timing([1000.0, 1000.0], [10, 10], 5.0, fixed_ms=5.0)  # 0.5% of 5%, 0.5% of 2%: both low
    assert small.anchor == 9


def test_a_fixed_cost_alone_tunes_when_averaging_was_not_measured():
    che = ungated(anchor=10)
    che.report_timing([10.0, 10.0], [10, 10], 0.0, fixed_ms=1.0)  # 10% of the window
    assert che.anchor == 50
