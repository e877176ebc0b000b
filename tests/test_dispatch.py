"""Window planning per policy: triggers, tails, throttle, streaming, and exact coverage."""

from __future__ import annotations

import pytest

from flodl.config import ApplyPolicy
from flodl.plan.dispatch import Dispatcher, Grant, WindowPlan
from flodl.plan.elche import ElChe

pytestmark = pytest.mark.timeout(30)


def calibrated(ms: list[float], anchor: int = 10) -> ElChe:
    che = ElChe(len(ms), anchor=anchor, gate_growth=False)
    che.report_timing([m * anchor for m in ms], [anchor] * len(ms), 0.0)
    return che


def consume_all(d: Dispatcher, plans, fraction: float = 1.0):
    """Ranks train ``fraction`` of their grants (whole batches)."""
    for plan in plans.values():
        batches = -(-plan.samples // d.batch_size)
        use = int(batches * fraction)
        if plan.quota_batches:
            use = min(use, plan.quota_batches)
        d.settle(plan, min(plan.samples, use * d.batch_size))


def test_sync_windows_are_equal_and_average_every_batch():
    d = Dispatcher(ApplyPolicy.SYNC, [0, 1], 1000, 10, 1)
    plans = d.plan(ElChe(2, anchor=1))
    assert {p.quota_batches for p in plans.values()} == {5}
    assert all(p.sync_every == 1 and p.rounds == 5 for p in plans.values())
    assert [p.grants[0].start for p in plans.values()] == [0, 50]


@pytest.mark.parametrize("progressive", [True, False])
def test_sync_averages_once_per_optimizer_step_when_the_ranks_accumulate(progressive):
    """accumulate_grad_batches=2 (the ranks' hellos): a round is 2 batches, so a window of 50
    batches a rank (non-progressive: its whole partition) costs 25 averages, not 50 rounds of
    which half would find the rank inside an accumulation; progressive windows are whole accumulations."""
    d = Dispatcher(ApplyPolicy.SYNC, [0, 1], 1000, 10, 1, progressive=progressive, accumulate=2)
    plans = d.plan(ElChe(2, anchor=1))
    quota = 6 if progressive else 50  # progressive: 5 batches a rank, rounded up to whole accumulations
    assert all(p.quota_batches == quota and p.sync_every == 2 and p.rounds == quota // 2 for p in plans.values())


def test_probe_is_open_ended_equal_shares():
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1, 2], 900, 10, 1)
    plans = d.plan(ElChe(3))
    assert all(p.open_ended and not p.quota_batches and not p.quota_ms for p in plans.values())
    assert [p.samples for p in plans.values()] == [300, 300, 300]


def test_cadence_uses_the_wall_time_trigger_with_headroom():
    che = calibrated([2.0, 6.0])
    assert che.batch_counts == [30, 10]
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 10_000, 10, 1)
    plans = d.plan(che)
    assert all(p.quota_ms == pytest.approx(che.anchor_wall_ms()) and p.quota_batches == 0 for p in plans.values())
    assert [-(-p.samples // 10) for p in plans.values()] == [38, 13]  # counts x 1.25 + 1, handed back if unused


def test_async_uses_batch_counts():
    che = calibrated([2.0, 6.0])
    d = Dispatcher(ApplyPolicy.ASYNC, [0, 1], 10_000, 10, 1)
    plans = d.plan(che)
    assert [p.quota_batches for p in plans.values()] == [30, 10]
    assert all(p.quota_ms == 0 for p in plans.values())


def test_max_batch_diff_throttles_the_fast_rank():
    che = calibrated([1.0, 8.0])
    d = Dispatcher(ApplyPolicy.ASYNC, [0, 1], 10_000, 10, 1, max_batch_diff=4)
    assert [p.quota_batches for p in d.plan(che).values()] == [14, 10]
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 10_000, 10, 1, max_batch_diff=0)
    assert {p.quota_batches for p in d.plan(che).values()} == {10}  # lockstep


def test_tail_is_split_by_speed_so_ranks_finish_together():
    che = calibrated([2.0, 6.0])  # counts [30, 10]
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 200, 10, 1)  # 20 batches: less than one window
    plans = d.plan(che)
    assert [p.quota_batches for p in plans.values()] == [15, 5]
    assert all(p.quota_ms == 0 for p in plans.values())


def test_async_streams_into_the_next_epoch_up_to_max_overshoot():
    che = calibrated([2.0, 6.0])
    d = Dispatcher(ApplyPolicy.ASYNC, [0, 1], 200, 10, 3, max_overshoot=4)
    plans = d.plan(che)
    epochs = {r: sorted({g.epoch for g in p.grants}) for r, p in plans.items()}
    assert epochs[0] == [0, 1]  # 15 from epoch 0, then 4 streamed from epoch 1
    assert plans[0].quota_batches == 15 + 4 and plans[1].quota_batches == 5 + 4
    consume_all(d, plans)
    assert d.take_completed() == [0]


def test_sync_and_cadence_never_stream():
    che = calibrated([2.0, 6.0])
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 200, 10, 3, max_overshoot=4)
    assert {g.epoch for p in d.plan(che).values() for g in p.grants} == {0}


@pytest.mark.parametrize("policy", list(ApplyPolicy))
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.0])
def test_every_sample_of_every_epoch_exactly_once(policy, fraction):
    """Whatever share of their grants ranks train, epochs close with exact coverage, in order."""
    che = calibrated([1.0, 3.0, 2.0]) if policy is not ApplyPolicy.SYNC else ElChe(3, anchor=1)
    d = Dispatcher(policy, [0, 1, 2], 1013, 8, 4, max_overshoot=3 if policy is ApplyPolicy.ASYNC else None)
    done, windows = [], 0
    while (plans := d.plan(che)) is not None:
        windows += 1
        assert windows < 5000
        # every few windows someone trains only part of its grant (time quotas, stops)
        consume_all(d, plans, fraction if windows % 3 == 0 and fraction else 1.0)
        done += d.take_completed()
    assert done == [0, 1, 2, 3]
    assert d.finished


def test_removed_rank_work_goes_to_survivors():
    che = calibrated([1.0, 1.0, 1.0])
    d = Dispatcher(ApplyPolicy.ASYNC, [0, 1, 2], 600, 10, 1)
    plans = d.plan(che)
    d.settle(plans[0], plans[0].samples)
    d.settle(plans[2], plans[2].samples)
    d.remove_rank(1)  # died holding its grant
    che2 = calibrated([1.0, 1.0])
    done = []
    while (plans := d.plan(che2)) is not None:
        assert set(plans) == {0, 2}
        consume_all(d, plans)
        done += d.take_completed()
    assert done == [0]


def test_non_progressive_partitions_follow_ratios():
    che = ElChe(2, anchor=10, partition_ratios=[3.0, 1.0])
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 400, 10, 1, progressive=False)
    totals = {0: 0, 1: 0}
    while (plans := d.plan(che)) is not None:
        for r, p in plans.items():
            totals[r] += p.samples
        consume_all(d, plans)
    assert totals == {0: 300, 1: 100}


@pytest.mark.parametrize("policy", [ApplyPolicy.SYNC, ApplyPolicy.CADENCE])
def test_non_progressive_dead_rank_partition_goes_to_the_survivors(policy):
    """A partitioned epoch must not strand a dead rank's partition outside every
    survivor's (it used to loop on empty windows)."""
    che = ElChe(3, anchor=10) if policy is ApplyPolicy.SYNC else calibrated([1.0, 1.0, 1.0])
    d = Dispatcher(policy, [0, 1, 2], 300, 10, 2, progressive=False)
    plans = d.plan(che)
    consume_all(d, {r: p for r, p in plans.items() if r != 1})
    d.settle(plans[1], 0)
    d.remove_rank(1)
    che2 = ElChe(2, anchor=10) if policy is ApplyPolicy.SYNC else calibrated([1.0, 1.0])
    trained = {0: 0, 2: 0}
    done = []
    while (plans := d.plan(che2)) is not None:
        assert set(plans) == {0, 2}
        for r, p in plans.items():
            trained[r] += p.samples
        consume_all(d, plans)
        done += d.take_completed()
    assert done == [0, 1]
    assert trained[0] == trained[2]  # the orphaned partition was split evenly


@pytest.mark.parametrize("policy", [ApplyPolicy.CADENCE, ApplyPolicy.ASYNC])
def test_a_flowing_window_that_reaches_an_epochs_end_ends_on_its_edge(policy):
    """Epochs flowing (max_overshoot auto): the window that reaches an epoch's end takes its rest,
    split by speed, and stops on the edge (the next epoch, 30 batches, is more than twice what the
    window has left), with batch quotas only: no time quota, no headroom. Its average closes the
    epoch exactly; the eval of that epoch scores nothing of the next."""
    che = calibrated([2.0, 6.0])  # counts [30, 10]
    d = Dispatcher(policy, [0, 1], 300, 10, 3)  # 30 batches an epoch: less than 1.5 windows
    plans = d.plan(che)
    assert all(p.kind == "full" and p.quota_ms == 0 for p in plans.values())
    assert [[g.epoch for g in p.grants] for p in plans.values()] == [[0], [0]]
    assert [sum(g.size for g in p.grants) for p in plans.values()] == [230, 70]  # the rest, by speed
    assert [p.quota_batches for p in plans.values()] == [23, 7]  # exactly the batches granted
    consume_all(d, plans)
    done, windows = d.take_completed(), 1
    while (plans := d.plan(che)) is not None:
        assert {g.epoch for p in plans.values() for g in p.grants} == {d.next_epoch - 1}
        consume_all(d, plans)
        done += d.take_completed()
        windows += 1
    assert done == [0, 1, 2] and windows == 3  # one average per epoch, each closing it on its edge
    assert Dispatcher(ApplyPolicy.ASYNC, [0, 1], 300, 10, 3, max_overshoot=4).flows is False  # explicit: tails stream
    # the auto-tuned overshoot bound is left to Async that cannot flow (fixed partitions)
    assert not d.overshoot_auto and Dispatcher(ApplyPolicy.ASYNC, [0, 1], 300, 10, 3, progressive=False).overshoot_auto


def test_the_window_before_an_edge_stretches_to_take_what_would_be_a_short_tail():
    che = calibrated([2.0, 6.0])  # 40 batches a window
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 1000, 10, 2)  # 100-batch epochs
    plans = d.plan(che)  # 100 left: a full window (40 batches and 11 of headroom), leaving 49
    assert all(p.quota_ms > 0 for p in plans.values())
    consume_all(d, plans)
    plans = d.plan(che)  # 49 batches left, under 1.5 windows: this one takes them all and ends on the edge
    assert all(p.quota_ms == 0 for p in plans.values())
    assert sum(p.samples for p in plans.values()) == 490 and {g.epoch for p in plans.values() for g in p.grants} == {0}
    consume_all(d, plans)
    assert d.take_completed() == [0]


def test_a_window_ending_on_an_edge_waits_for_the_windows_in_flight_in_its_epoch():
    """What a window in flight leaves untrained goes back to its epoch: the window that closes the
    epoch is planned only once those settled, so it takes that too and the epoch closes on its edge."""
    che = calibrated([2.0, 6.0])  # 40 batches a window, 51 granted with headroom
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 1500, 10, 2)
    first = d.plan(che)
    assert not d.must_settle_first(che)  # the next window (99 left) is not the edge's: plan ahead
    second = d.plan(che)
    assert d.must_settle_first(che)  # 48 left, the first two in flight: the edge window waits for them
    consume_all(d, first, 0.9)  # a time quota cut the first window short: its rest goes back
    assert d.must_settle_first(che)
    consume_all(d, second, 0.95)
    assert not d.must_settle_first(che)
    last = d.plan(che)
    assert all(p.quota_ms == 0 for p in last.values())
    consume_all(d, last)
    assert d.take_completed() == [0]  # every position the first two gave back is in the edge window


def test_a_flowing_window_spans_several_short_epochs_whole_and_coverage_stays_exact():
    che = calibrated([2.0, 6.0])  # counts [30, 10]: 40 batches a window
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 100, 10, 8)  # 10-batch epochs
    plans = d.plan(che)
    assert {g.epoch for p in plans.values() for g in p.grants} == {0, 1, 2, 3}  # four whole epochs: 40 batches
    assert sum(p.samples for p in plans.values()) == 400 and all(p.quota_ms == 0 for p in plans.values())
    assert [p.quota_batches for p in plans.values()] == [d.batches_of(p.grants) for p in plans.values()]
    consume_all(d, plans)
    done = d.take_completed()
    assert done == [0, 1, 2, 3]
    windows = 0
    while (plans := d.plan(che)) is not None:
        windows += 1
        assert windows < 1000
        consume_all(d, plans, 0.5 if windows % 3 == 0 else 1.0)  # now and then a rank dies mid-window
        done += d.take_completed()
    assert done == list(range(8)) and d.finished


def test_a_hard_edge_stops_a_flowing_window():
    che = calibrated([2.0, 6.0])
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 100, 10, 8, hard_edge=lambda epoch: epoch % 2 == 1)
    plans = d.plan(che)
    assert {g.epoch for p in plans.values() for g in p.grants} == {0, 1}  # a checkpoint keeps epoch 1's end


def test_batches_of_grants_are_cut_at_every_epoch_edge():
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 100, 10, 8)
    # 5 + 18 samples of epoch 0 make 3 batches (a batch spans two grants of one epoch), then 4 of epoch 1 one
    assert d.batches_of([Grant(0, 0, 5), Grant(0, 40, 18), Grant(1, 0, 4)]) == 4
    assert d.batches_of([]) == 0


def test_cadence_flow_ends_at_the_last_epoch_and_an_explicit_zero_keeps_the_barrier():
    che = calibrated([2.0, 6.0])
    last = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 200, 10, 1)
    assert {g.epoch for p in last.plan(che).values() for g in p.grants} == {0}
    barrier = Dispatcher(ApplyPolicy.CADENCE, [0, 1], 200, 10, 3, max_overshoot=0)
    plans = barrier.plan(che)
    assert {g.epoch for p in plans.values() for g in p.grants} == {0}
    assert [p.quota_batches for p in plans.values()] == [15, 5]


@pytest.mark.parametrize("mode", ["nccl-async", "nccl-cadence"])
def test_a_ranks_own_overhead_between_batches_counts_in_its_pace(mode):
    """Rank 0 computes a batch in 1 ms but spends 0.25 ms more per batch on its own bookkeeping;
    rank 1 takes 4 ms. ElChe learns 1.25 ms for rank 0 (its window wall less its averages), so the
    windows it plans end together; from compute alone it would plan rank 0 a quarter too many."""
    from flodl.config import DdpRunConfig
    from flodl.plan.cadence import CadenceLoop
    from tests.helpers.windows import fold_window

    loop = CadenceLoop(DdpRunConfig().with_mode(mode), [0, 1], dataset_len=40_000, batch_size=10, epochs=4, seed=3)
    for _ in range(6):
        number = loop.window
        assert loop.next_windows(now=float(number)) is not None
        fold_window(loop, number, {0: 1.0, 1: 4.0}, overhead_ms={0: 0.25})
    ms = loop.elche.ms_per_batch
    assert ms[0] == pytest.approx(1.25, rel=0.05) and ms[1] == pytest.approx(4.0, rel=0.05)


def test_unsettle_reopens_a_closed_epoch_and_counts_every_grant_of_it_late():
    """A dead rank's window held two grants of an epoch that has closed since: both go back, both late."""
    d = Dispatcher(ApplyPolicy.CADENCE, [0, 1], dataset_len=100, batch_size=10, epochs=2)
    d.next_epoch = 1  # epoch 0 opened and closed (no pool left)
    plan = WindowPlan(rank=1, grants=[Grant(0, 0, 10), Grant(0, 40, 10), Grant(1, 0, 10)])
    given, late = d.unsettle(plan, 20)  # the first 20 samples: both grants of epoch 0
    assert (given, late) == (20, 20)
    assert d.reopened == {0} and d.pools[0].remaining == 20


def test_one_average_that_closes_several_epochs_closes_them_as_one_row():
    """A row per average that closes epochs: one for a group (``first_epoch`` to ``epoch``), its
    wall the span since the last close (never split by samples: no figure copied between epochs),
    each epoch's own loss kept; rows cover every epoch once, in order, and nothing trained ahead."""
    from flodl.config import DdpRunConfig
    from flodl.plan.cadence import CadenceLoop
    from tests.helpers.windows import fold_window

    loop = CadenceLoop(DdpRunConfig().with_mode("nccl-cadence"), [0, 1], dataset_len=100, batch_size=10, epochs=12, seed=3)
    rows: list = []
    while loop.next_windows(now=float(number := loop.window)) is not None:
        before = len(rows)
        fold_window(loop, number, {0: 1.0, 1: 2.0}, closed=rows)
        assert len(rows) - before <= 1  # at most one row per settle
    assert [e for row in rows for e in row.epochs] == list(range(12))
    groups = [row for row in rows if row.first_epoch < row.epoch]
    assert groups, "no average closed several 5-batch epochs: the test tests nothing"
    for row in rows:
        assert sorted(row.epoch_losses) == list(row.epochs) and row.ahead_samples == 0
        assert row.samples == 100 * len(row.epochs) and row.wall_ms > 0
