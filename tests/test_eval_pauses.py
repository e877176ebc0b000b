"""An eval pauses one rank once an epoch; it must not read to ElChe as that rank's pace.

The eval rank scores between two batches, inside a window, and its peer then waits at the next
window's end for the eval rank's late average. Both are pauses, not speeds: counted as training
time, they made ElChe plan the eval rank a fraction of its batches in the windows after (and then
its peer, in turn), so that equal ranks trained an epoch 53:203. Each rank leaves its pauses out of
the wall it reports (flodl/rank/window_stats.py), and equal ranks keep equal shares.
"""

from __future__ import annotations

import json

import pytest

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
