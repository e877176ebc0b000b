"""A frame lost to a connection reset never stalls a run: a lost ``Window`` or ``WindowDone`` is
noticed from the idle rank's heartbeat and the window is sent again (controller/resend.py,
rank/window_inbox.py). Pure logic first, then real runs with frames really dropped."""

from __future__ import annotations

import json

import pytest

from flodl.controller.resend import AFTER_SENT_S, EVERY_S, IDLE_S, WindowResender
from flodl.plan.membership import RankInfo
from flodl.plan.progress import Progress
from flodl.rank.window_inbox import KEEP_REPORTS, WindowInbox
from flodl.testing.faults import FaultPlan
from flodl.wire import messages as m

from .conftest import task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run, assert_run_gone

pytestmark = pytest.mark.timeout(180)


def window(number: int, after: int) -> m.Window:
    return m.Window(
        window=number,
        global_step=0,
        grants=[[0, 0, 8]],
        quota_batches=1,
        quota_ms=0.0,
        sync_every=0,
        rounds=1,
        measure_divergence=False,
        after=after,
    )


def report(number: int) -> m.WindowDone:
    return m.WindowDone(
        rank=0,
        window=number,
        batches=1,
        consumed=8,
        loss_sum=0.5,
        compute_ms=1.0,
        data_ms=0.0,
        sync_ms=0.0,
        wall_ms=1.0,
        divergence=None,
        pre_norm=None,
        post_norm=None,
        lr=None,
        epochs=[],
        scalars={},
        regrouped_at=-1,
        dropped=-1,
        res={},
        data={},
    )


def test_a_window_that_overtakes_a_lost_one_waits_for_it_and_both_run_in_order():
    inbox = WindowInbox()
    assert inbox.arrive(window(0, -1)) == ([window(0, -1)], None)
    assert inbox.arrive(window(2, 1)) == ([], None)  # window 1 was lost: 2 must not run before it
    ready, again = inbox.arrive(window(1, 0))  # sent again
    assert [w.window for w in ready] == [1, 2] and again is None
    assert inbox.arrive(window(2, 1)) == ([], None)  # a late copy of one already passed on is dropped
    assert inbox.duplicates == 1


def test_a_window_already_reported_is_answered_with_its_report_again_and_old_reports_are_let_go():
    inbox = WindowInbox()
    for number in range(KEEP_REPORTS + 2):
        assert inbox.arrive(window(number, number - 1))[0]
        inbox.reported(report(number))
    last = KEEP_REPORTS + 1
    assert inbox.arrive(window(last, last - 1)) == ([], report(last))
    assert inbox.arrive(window(0, -1)) == ([], None)  # too old to be waited for: dropped


def test_a_first_window_naming_an_earlier_one_waits_for_that_one():
    inbox = WindowInbox()
    assert inbox.arrive(window(5, 4)) == ([], None)  # window 4 was this rank's first, and lost
    assert [w.window for w in inbox.arrive(window(4, -1))[0]] == [4, 5]


def idle_rank(rank: int, idle_s: float, heard_at: float) -> RankInfo:
    return RankInfo(rank=rank, progress=Progress(busy="idle", busy_s=idle_s, at=heard_at))


def test_a_window_is_sent_again_only_to_a_rank_whose_heartbeat_finds_it_idle_well_after_the_send():
    resender = WindowResender()
    sent_at = 100.0
    for rank in (0, 1, 2):
        resender.sent(rank, window(3, 2), sent_at)
    resender.reported(2, 3)
    late = sent_at + EVERY_S
    ranks = {
        0: idle_rank(0, IDLE_S, sent_at + AFTER_SENT_S),  # idle long after the window left: lost
        1: RankInfo(rank=1, progress=Progress(busy="step", busy_s=5.0, at=late)),  # still training it
        2: idle_rank(2, IDLE_S, late),  # reported: nothing is due
    }
    assert resender.overdue(3, [0, 1, 2], ranks, sent_at + 1.0) == []  # too soon after the send
    assert [r for r, _ in resender.overdue(3, [0, 1, 2], ranks, late)] == [0]
    assert resender.overdue(3, [0, 1, 2], ranks, late + 0.1) == []  # not again at once
    ranks[0] = idle_rank(0, IDLE_S, late + AFTER_SENT_S)
    assert [r for r, _ in resender.overdue(3, [0], ranks, late + EVERY_S)] == [0]
    assert resender.resent == 2
    # an idle beat that left before the window got there says nothing
    resender.sent(0, window(4, 3), 200.0)
    assert resender.overdue(4, [0], {0: idle_rank(0, 10.0, 200.2)}, 200.0 + EVERY_S) == []
    resender.settled(4)
    assert resender.overdue(4, [0], {0: idle_rank(0, 10.0, 300.0)}, 300.0) == []


def test_drop_is_refused_where_no_frame_can_be_lost():
    assert FaultPlan.from_env(1, "1:report:3:drop,1:window:2").armed == {"report": (3, "drop"), "window": (2, "kill")}
    for bad in ("1:batch:3:drop", "1:window:2:stop"):
        with pytest.raises(ValueError, match="drop applies"):
            FaultPlan.from_env(1, bad)


EPOCHS = 6


# each direction on each backend; Sync (one window at a time) and a fault at the calibration window
CASES = [
    ("nccl-cadence", "1:report:3:drop"),
    ("cpu-cadence", "1:window:4:drop"),
    ("nccl-sync", "0:window:1:drop"),
    ("nccl-async", "1:window:5:drop,0:report:7:drop"),
]


@pytest.mark.parametrize(("mode", "faults"), CASES)
def test_a_lost_window_or_report_is_sent_again_and_the_run_completes_exactly(proc_env, tmp_path, mode, faults):
    """The frame is really dropped in the rank's link; the run finishes with every sample trained
    once, no rank declared dead, and the controller says what it re-sent."""
    path = tmp_path / "s.json"
    run_id = f"lost-{mode}"
    env = {**proc_env, "FLODL_INJECT_FAULT": faults, "FLODL_TEST_STEP_SLEEP": "0.01", "FLODL_RUN_ID": run_id}
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", str(EPOCHS), "--mode", mode]
    run = Run([*args, "--heartbeat-timeout-secs", "6", "--summary-json", str(path)], env)
    assert run.wait(150) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * EPOCHS  # no sample lost, none twice
    assert summary["deaths"] == []
    assert "sending the window again" in run.output
    digests = summary["final_digests"]
    if mode.startswith("nccl-"):
        assert digests["0"] == digests["1"]  # still one consensus: nobody averaged out of step
    assert_run_gone(run_id)
