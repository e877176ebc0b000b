"""An eval pauses one rank once an epoch; it must not read to ElChe as that rank's pace.

The eval rank scores between two batches, inside a window, and its peer then waits at the next
window's end for the eval rank's late average. Both are pauses, not speeds: counted as training
time, they made ElChe plan the eval rank a fraction of its batches in the windows after (and then
its peer, in turn), so that equal ranks trained an epoch 53:203. Each rank leaves its pauses out of
the wall it reports (flodl/rank/window_stats.py), and equal ranks keep equal shares.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flodl.config import DdpRunConfig
from flodl.plan.cadence import CadenceLoop
from flodl.rank.regroup import Group
from flodl.rank.window_stats import RoundStats

from .conftest import task_spec
from .helpers.procs import Run


@pytest.mark.timeout(120)
def test_equal_ranks_keep_equal_shares_across_a_long_eval(proc_env, tmp_path):
    out = tmp_path / "summary.json"
    # the eval rank trains nothing while it evaluates and the other trains on, so an epoch holding the
    # whole 0.5 s eval gives it (W - 0.5) / 2W of the batches at best, W the epoch's rank-seconds of
    # training: with 4096 samples (W ~ 0.7 s) that floor was 0.14, under the 0.35 asked, and a CI run
    # whose eval fell inside one epoch read 0.137. 16384 samples (W ~ 2.8 s) put the floor at 0.41, so
    # only a planner that takes the pause for slowness (the bug this guards) goes under: with the
    # pauses put back into the reported wall, two runs read 0.148 and 0.064
    env = {**proc_env, "FLODL_TEST_SAMPLES": "16384", "FLODL_TEST_STEP_SLEEP": "0.002", "FLODL_TEST_EVAL_SLEEP": "0.5"}
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "3", "--mode", "nccl-cadence"]
    run = Run([*args, "--summary-json", str(out), "--dashboard-port", "-1", "--no-progress"], env)
    assert run.wait(100) == 0, run.output
    history = json.loads(out.read_text())["history"]
    assert [h["samples"] for h in history] == [16384] * 3
    for h in history[1:]:  # each after an eval: 0.5 s, where a window lasts some 30 ms
        shares = sorted(part["batch_share"] for part in h["per_rank"].values())
        assert len(shares) == 2 and shares[0] >= 0.35, history


def test_a_wait_for_the_previous_average_is_averaging_cost_unless_an_eval_was_asked_since():
    """A slow link: the average in flight outlasts a window, and the rank waits for it before the
    next. That wait is averaging cost (sync_ms: ElChe's overhead tune lengthens the windows); only
    with an eval asked since that average's launch is it a late peer's pause. Before, every wait
    was a pause: ElChe saw no cost, and a 100 Mbit/50 ms link made 123 averages of a run that made
    50 unshaped (bench/wan.py)."""
    group = Group.__new__(Group)  # the one method under test reads the link's eval count only
    group.link, group._evals_at_launch = SimpleNamespace(evals_asked=3), 3
    slow_link = RoundStats()
    group._waited(40.0, slow_link)
    assert (slow_link.sync_ms, slow_link.paused_ms) == (40.0, 0.0)
    group.link.evals_asked = 4  # an eval asked since: the peer waited for the eval rank
    late_peer = RoundStats()
    group._waited(40.0, late_peer)
    assert (late_peer.sync_ms, late_peer.paused_ms) == (0.0, 40.0)


def _tune(loop: CadenceLoop, window: int, sync_ms: float) -> int:
    """One full background window of two equal ranks, each held ``sync_ms`` by its averages: the anchor after."""
    reports = {
        r: SimpleNamespace(
            batches=10, consumed=100, compute_ms=100.0, data_ms=0.0, wall_ms=100.0 + sync_ms, sync_ms=sync_ms, divergence=0.0, lr=0.1
        )
        for r in (0, 1)
    }
    loop._tune(window, {r: SimpleNamespace(kind="full") for r in (0, 1)}, reports, 100.0 + sync_ms)
    return loop.elche.anchor


def test_the_windows_after_an_eval_do_not_read_a_peers_wait_as_averaging_cost():
    """The eval rank's peer counts its wait as averaging (no eval was asked of it): in the eval's window
    and the next, the controller leaves that cost unread, and reads it again after."""
    loop = CadenceLoop(DdpRunConfig().with_mode("nccl-cadence"), [0, 1], dataset_len=40000, batch_size=10, epochs=3, seed=3)
    assert [_tune(loop, w, 1.0) for w in range(3)] == [10, 10, 10]
    loop.note_pause(500.0)
    assert [_tune(loop, w, 200.0) for w in (3, 4)] == [10, 10]
    assert _tune(loop, 5, 200.0) > 10  # a slow average, read: longer windows
