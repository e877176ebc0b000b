"""Divergence signal, trend guard and meta-controller: the reference ElChe's acceptance items 11-17
(MsfGuard excluded; docs/cadence.md#convergence-guard-and-meta-controller), make_guard's choices and meta-controller sequences."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flodl.config import ElCheConfig
from flodl.plan.elche import ElChe
from flodl.plan.guard import (
    MetaController,
    NoGuard,
    TrendGuard,
    cosine_and_shift,
    make_guard,
    make_meta_controller,
    max_relative_delta,
)
from flodl.plan.signals import Phase, Verdict

pytestmark = pytest.mark.timeout(30)

STABLE = Verdict.STABLE
SUPPRESS = Verdict.SUPPRESS_GROWTH


# ---------------------------------------------------------------------------
# Verdict
# ---------------------------------------------------------------------------


def test_verdict_constants_and_nudge():
    assert STABLE.kind == "stable" and STABLE.factor is None and STABLE.is_stable
    assert SUPPRESS.kind == "suppress_growth" and SUPPRESS.is_pressure
    nudge = Verdict.nudge(0.5)
    assert nudge == Verdict("nudge_down", 0.5) and nudge.is_pressure and not nudge.is_stable
    assert Verdict.from_list(nudge.to_list()) == nudge
    with pytest.raises(dataclasses.FrozenInstanceError):
        nudge.factor = 0.9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kind", "factor"),
    [("sideways", None), ("nudge_down", None), ("nudge_down", 0.0), ("nudge_down", math.nan), ("stable", 0.5), ("nudge_down", True)],
)
def test_bad_verdicts_are_rejected(kind, factor):
    with pytest.raises(ValueError):
        Verdict(kind, factor)


# ---------------------------------------------------------------------------
# acceptance items 11-12: the signal
# ---------------------------------------------------------------------------


def test_max_relative_delta_picks_the_worst_rank():
    assert max_relative_delta([0.01, 0.05, 0.02]) == 0.05
    assert max_relative_delta([0.01, None, 0.03]) == 0.03
    assert max_relative_delta([]) == 0.0
    assert max_relative_delta([None, None]) == 0.0


def test_cosine_near_one_for_tiny_delta():
    cosine, shift = cosine_and_shift(10.0, 10.0, 1e-6)
    assert cosine == pytest.approx(1.0, abs=1e-9)
    assert shift == 0.0


def test_magnitude_shift_is_pre_minus_post():
    cosine, shift = cosine_and_shift(12.0, 10.0, 0.2)  # |pre - post| = 2: parallel vectors
    assert shift == pytest.approx(2.0)
    assert cosine == pytest.approx(1.0)
    cosine, _ = cosine_and_shift(1.0, 1.0, math.sqrt(2.0))  # orthogonal unit vectors
    assert cosine == pytest.approx(0.0, abs=1e-12)
    cosine, _ = cosine_and_shift(1.0, 1.0, 5.0)  # impossible geometry: clamped
    assert cosine == -1.0


def test_cosine_without_norms_or_direction():
    assert cosine_and_shift(None, 10.0, 0.1) == (None, None)
    assert cosine_and_shift(10.0, None, 0.1) == (None, None)
    assert cosine_and_shift(1.0, 0.0, 0.1) == (None, 1.0)  # zero average: no direction
    assert cosine_and_shift(0.0, 1.0, 1.0) == (0.0, -1.0)  # zero replica


# ---------------------------------------------------------------------------
# acceptance items 13-15: the trend guard
# ---------------------------------------------------------------------------


def feed(guard, values):
    return [guard.report(v) for v in values]


def test_sync_policy_is_always_stable():
    guard = TrendGuard(0.05, sync_policy=True)
    assert feed(guard, [0.06, 0.07, 0.08, 0.2, 0.9]) == [STABLE] * 5
    assert guard.history == (0.06, 0.07, 0.08, 0.2, 0.9)  # still recorded


def test_disabled_guard_is_always_stable():
    guard = NoGuard()
    assert feed(guard, [0.06, 0.07, 0.08, 0.2, 0.9]) == [STABLE] * 5
    assert guard.history == ()
    guard.reset()
    guard.load_state_dict(guard.state_dict())


def test_three_rising_values_above_threshold_suppress():
    guard = TrendGuard(0.05)
    assert feed(guard, [0.06, 0.07, 0.08]) == [STABLE, STABLE, SUPPRESS]
    assert guard.report(0.09) == SUPPRESS  # still rising


def test_rising_but_below_threshold_is_stable():
    assert feed(TrendGuard(0.05), [0.01, 0.02, 0.04]) == [STABLE] * 3
    assert feed(TrendGuard(0.05), [0.03, 0.04, 0.05]) == [STABLE] * 3  # not strictly above


def test_non_monotone_is_stable():
    assert feed(TrendGuard(0.05), [0.06, 0.09, 0.08]) == [STABLE] * 3
    assert feed(TrendGuard(0.05), [0.07, 0.07, 0.08]) == [STABLE] * 3  # not strictly rising
    assert feed(TrendGuard(0.05), [0.09, 0.08, 0.07]) == [STABLE] * 3


def test_single_spike_does_not_suppress():
    assert feed(TrendGuard(0.05), [0.03, 0.03, 0.09, 0.03, 0.03]) == [STABLE] * 5


def test_history_capped_at_five_and_reset():
    guard = TrendGuard(0.05)
    feed(guard, [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07])
    assert guard.history == (0.03, 0.04, 0.05, 0.06, 0.07)
    guard.reset()
    assert guard.history == ()
    assert feed(guard, [0.07, 0.08]) == [STABLE, STABLE]  # the trend starts over


def test_trend_guard_never_nudges_even_far_above_threshold():
    """As in the reference: a trend suppresses growth; shrinking is the meta-controller's call."""
    assert feed(TrendGuard(0.05), [0.06, 0.2, 0.9]) == [STABLE, STABLE, SUPPRESS]
    assert feed(TrendGuard(0.05), [0.3, 0.2, 0.15]) == [STABLE] * 3  # high but falling: no action


def test_trend_guard_state_round_trip():
    guard = TrendGuard(0.05)
    feed(guard, [0.06, 0.07])
    restored = TrendGuard(0.05)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.history == guard.history
    assert restored.report(0.08) == SUPPRESS  # the trend carries across the resume
    fresh = TrendGuard(0.05)
    fresh.load_state_dict(NoGuard().state_dict())
    assert fresh.history == ()


def test_trend_guard_rejects_bad_threshold():
    for bad in (0.0, -0.1, math.inf, True):
        with pytest.raises(ValueError):
            TrendGuard(bad)


# ---------------------------------------------------------------------------
# make_guard
# ---------------------------------------------------------------------------


def test_make_guard_sync_config_is_sync_trend_guard():
    guard = make_guard(ElCheConfig(mode="nccl-sync"))
    assert isinstance(guard, TrendGuard)
    assert guard.threshold == 0.05 and guard.sync_policy
    assert feed(guard, [0.06, 0.07, 0.08]) == [STABLE] * 3


def test_make_guard_default_config_is_cadence_trend_guard():
    guard = make_guard(ElCheConfig())  # nccl-cadence
    assert isinstance(guard, TrendGuard) and not guard.sync_policy


def test_make_guard_cadence_and_async_behave_identically():
    cadence = make_guard(ElCheConfig(mode="cpu-cadence"))
    asynchronous = make_guard(ElCheConfig(mode="cpu-async"))
    assert isinstance(cadence, TrendGuard) and not cadence.sync_policy
    values = [0.06, 0.07, 0.08, 0.05, 0.06, 0.07, 0.2]
    assert feed(cadence, values) == feed(asynchronous, values)
    assert feed(make_guard(ElCheConfig(mode="nccl-cadence")), [0.06, 0.07, 0.08])[-1] == SUPPRESS


def test_make_guard_disabled_choices():
    assert isinstance(make_guard(ElCheConfig(mode="cpu-cadence", no_divergence_guard=True)), NoGuard)
    assert isinstance(make_guard(ElCheConfig(mode="cpu-cadence", convergence_guard="none")), NoGuard)
    assert isinstance(make_guard(ElCheConfig(mode="cpu-cadence", convergence_guard="trend")), TrendGuard)


def test_make_guard_thresholds():
    assert make_guard(ElCheConfig(mode="cpu-cadence", easgd_alpha=0.5)).threshold == 0.3
    assert make_guard(ElCheConfig(mode="cpu-cadence", divergence_threshold=0.2, easgd_alpha=0.5)).threshold == 0.2


# ---------------------------------------------------------------------------
# acceptance item 17: meta-controller
# ---------------------------------------------------------------------------


def run(meta: MetaController, steps):
    """Observe ``(lr, anchor, verdict, phase)`` steps; the list of results."""
    return [meta.observe(*step) for step in steps]


def test_probe_never_acts():
    meta = MetaController()
    steps = [(1.0, 10, SUPPRESS, Phase.PROBE), (0.1, 40, SUPPRESS, Phase.PROBE)] + [(0.01, 40, SUPPRESS, Phase.PROBE)] * 5
    assert run(meta, steps) == [None] * 7
    assert len(meta.verdict_window) == 5  # observed, just never acted on


def test_windows_are_capped():
    meta = MetaController()
    for i in range(10):
        meta.observe(0.1, 100 + i, STABLE, Phase.STABLE)
    assert len(meta.lr_window) == 3
    assert meta.anchor_window == (105, 106, 107, 108, 109)
    assert len(meta.verdict_window) == 5


def test_lr_cliff_fires_with_base_half_on_flat_anchor():
    meta = MetaController()
    assert meta.observe(1.0, 10, STABLE, Phase.WARMUP) is None
    assert meta.observe(0.5, 10, STABLE, Phase.WARMUP) == Verdict.nudge(0.5)
    assert meta.observe(0.5, 10, STABLE, Phase.WARMUP) is None  # the cliff is behind us


def test_gentle_lr_changes_do_not_fire():
    meta = MetaController()
    assert (
        run(
            meta,
            [
                (1.0, 10, STABLE, Phase.STABLE),
                (0.75, 10, STABLE, Phase.STABLE),
                (2.0, 10, STABLE, Phase.STABLE),
                (None, 10, STABLE, Phase.STABLE),
            ],
        )
        == [None] * 4
    )
    assert meta.lr_window == (1.0, 0.75, 2.0)  # an unknown LR is not recorded


def test_convergence_watcher_in_stable_after_three_suppressions():
    meta = MetaController()
    results = run(meta, [(0.1, 10, SUPPRESS, Phase.STABLE)] * 3)
    assert results == [None, None, Verdict.nudge(0.5)]
    # The evidence was consumed: the next pressure verdict alone does not fire again.
    assert meta.verdict_window == ()
    assert run(meta, [(0.1, 10, SUPPRESS, Phase.STABLE)] * 2) == [None, None]
    assert meta.observe(0.1, 10, Verdict.nudge(0.5), Phase.STABLE) == Verdict.nudge(0.5)


def test_convergence_watcher_per_phase():
    warm = run(MetaController(), [(0.1, 10, SUPPRESS, Phase.WARMUP)] * 5)
    assert warm == [None] * 4 + [Verdict.nudge(0.3)]
    mature = run(MetaController(), [(0.1, 10, SUPPRESS, Phase.MATURE)] * 2)
    assert mature == [None, Verdict.nudge(0.7)]


def test_a_stable_verdict_breaks_the_run():
    meta = MetaController()
    steps = [
        (0.1, 10, SUPPRESS, Phase.STABLE),
        (0.1, 10, SUPPRESS, Phase.STABLE),
        (0.1, 10, STABLE, Phase.STABLE),
        (0.1, 10, SUPPRESS, Phase.STABLE),
    ]
    assert run(meta, steps) == [None] * 4


def test_rising_anchor_makes_it_harsher():
    meta = MetaController()
    steps = [
        (0.1, 10, STABLE, Phase.STABLE),
        (0.1, 10, STABLE, Phase.STABLE),
        (0.1, 10, SUPPRESS, Phase.STABLE),
        (0.1, 10, SUPPRESS, Phase.STABLE),
        (0.1, 20, SUPPRESS, Phase.STABLE),
    ]
    results = run(meta, steps)
    trend = (20 - 12) / 12
    assert results[-1].factor == pytest.approx(0.5 - 0.5 * trend)
    assert results[-1].factor < 0.5


def test_recovering_anchor_makes_it_gentler():
    meta = MetaController()
    steps = [(0.1, 100, STABLE, Phase.STABLE)] * 2 + [(0.1, 100, SUPPRESS, Phase.STABLE)] * 2 + [(0.1, 10, SUPPRESS, Phase.STABLE)]
    factor = run(meta, steps)[-1].factor
    trend = (10 - 82) / 82
    assert factor == pytest.approx(0.5 - 0.5 * trend)
    assert 0.5 < factor < 0.95


def test_factor_clamp_bounds():
    harsh = MetaController()
    steps = [(0.1, 10, STABLE, Phase.STABLE)] * 2 + [(0.1, 10, SUPPRESS, Phase.STABLE)] * 2 + [(0.1, 100, SUPPRESS, Phase.STABLE)]
    assert run(harsh, steps)[-1] == Verdict.nudge(0.1)
    gentle = MetaController()
    steps = [(0.1, 100, STABLE, Phase.STABLE)] * 2 + [(0.1, 100, SUPPRESS, Phase.STABLE)] * 2 + [(0.1, 1, SUPPRESS, Phase.STABLE)]
    assert run(gentle, steps)[-1] == Verdict.nudge(0.95)


def test_both_watchers_compound():
    meta = MetaController()
    steps = [(1.0, 10, SUPPRESS, Phase.STABLE), (1.0, 10, SUPPRESS, Phase.STABLE), (0.1, 10, SUPPRESS, Phase.STABLE)]
    assert run(meta, steps) == [None, None, Verdict.nudge(0.25)]
    harsh = MetaController()
    steps = [
        (1.0, 10, STABLE, Phase.STABLE),
        (1.0, 10, STABLE, Phase.STABLE),
        (1.0, 10, SUPPRESS, Phase.STABLE),
        (1.0, 10, SUPPRESS, Phase.STABLE),
        (0.1, 30, SUPPRESS, Phase.STABLE),
    ]
    assert run(harsh, steps)[-1] == Verdict.nudge(0.1)  # 0.1 * 0.1 clamped back up to 0.1


def test_anchor_trend_and_settled():
    meta = MetaController()
    assert meta.anchor_trend() == 0.0 and meta.is_settled()
    meta.observe(0.1, 10, STABLE, Phase.STABLE)
    assert meta.anchor_trend() == 0.0  # one sample: no trend yet
    meta.observe(0.1, 10, STABLE, Phase.STABLE)
    assert meta.is_settled()
    meta.observe(0.1, 13, STABLE, Phase.STABLE)
    assert meta.anchor_trend() == pytest.approx((13 - 11) / 11)
    assert not meta.is_settled()


def test_meta_controller_state_round_trip():
    meta = MetaController()
    run(meta, [(1.0, 10, SUPPRESS, Phase.STABLE), (0.9, 12, Verdict.nudge(0.5), Phase.STABLE)])
    restored = MetaController()
    restored.load_state_dict(json.loads(json.dumps(meta.state_dict())))
    assert restored.state_dict() == meta.state_dict()
    assert restored.verdict_window == (SUPPRESS, Verdict.nudge(0.5))
    # Same evidence, same decision on the next cycle.
    assert restored.observe(0.9, 12, SUPPRESS, Phase.STABLE) == meta.observe(0.9, 12, SUPPRESS, Phase.STABLE)


def test_make_meta_controller_follows_config():
    assert isinstance(make_meta_controller(ElCheConfig()), MetaController)
    assert make_meta_controller(ElCheConfig(meta_controller=False)) is None


# ---------------------------------------------------------------------------
# Guard and meta-controller driving ElChe
# ---------------------------------------------------------------------------


def test_guard_verdicts_drive_elche():
    che = ElChe(2, anchor=10, overhead_target=0.1)
    guard = TrendGuard(0.05)
    che.report_timing([1000.0, 1000.0], [10, 10], 500.0)  # proposes 50
    che.apply_verdict(guard.report(0.01))
    assert che.anchor == 50
    che.report_timing([5000.0, 5000.0], [50, 50], 2500.0)  # proposes 250
    che.apply_verdict(guard.report(0.06))
    assert che.anchor == 250
    che.report_timing([25000.0, 25000.0], [250, 250], 12500.0)  # proposes 1000 (max_anchor)
    assert che.pending_anchor == 1000
    che.apply_verdict(guard.report(0.07))  # three rising readings above 0.05: dropped and latched
    assert che.anchor == 250 and che.pending_anchor is None and che.growth_latched_off
    assert che.phase is Phase.WARMUP
    meta = MetaController()
    results = [meta.observe(0.1, che.anchor, SUPPRESS, che.phase) for _ in range(5)]
    assert results == [None] * 4 + [Verdict.nudge(0.3)]  # Warmup: K = 5, base 0.3
    che.apply_verdict(results[-1])
    assert che.anchor == 75
    assert che.batch_counts == [75, 75]
