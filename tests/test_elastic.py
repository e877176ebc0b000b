"""Elastic membership with real processes: a dead rank never costs the run."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from .conftest import task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run, assert_all_gone

pytestmark = pytest.mark.timeout(180)

EPOCHS = 12


def start(proc_env, tmp_path, mode, nproc=3, heartbeat=4, extra=(), step_sleep="0.01"):
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": step_sleep}
    path = tmp_path / "s.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            str(nproc),
            "--epochs",
            str(EPOCHS),
            "--mode",
            mode,
            "--heartbeat-timeout-secs",
            str(heartbeat),
            "--summary-json",
            str(path),
            *extra,
        ],
        env,
    )
    return run, path


def finish(run, path):
    assert run.wait(150) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * EPOCHS  # no sample lost, none twice
    return summary


# every point on one mode of each backend, one point on every other mode (the suite stays short)
CASES = [(mode, fault) for mode in ("nccl-cadence", "cpu-cadence") for fault in ("batch:40", "average:6", "epoch:3")] + [
    ("nccl-sync", "average:6"),
    ("nccl-async", "batch:40"),
    ("cpu-sync", "epoch:3"),
    ("cpu-async", "average:6"),
]


@pytest.mark.parametrize(("mode", "fault"), CASES)
def test_a_rank_dies_at_a_chosen_point_and_the_run_finishes(proc_env, tmp_path, mode, fault):
    """Rank 1 SIGKILLs itself mid-batch, mid-averaging or at an epoch edge. No restarts are left
    (--max-restarts 0, the default): nothing restarts, the run goes on with the survivors."""
    proc_env = {**proc_env, "FLODL_INJECT_FAULT": f"1:{fault}"}
    run, path = start(proc_env, tmp_path, mode)
    summary = finish(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1]
    assert summary["restarts"] == [] and summary["joins"] == []
    assert "killed by SIGKILL" in summary["deaths"][0]["reason"]
    assert summary["recoveries"][0]["survivors"] == [0, 2]
    assert "continuing with 2 rank(s)" in run.output
    digests = summary["final_digests"]
    assert set(digests) == {"0", "2"}
    assert digests["0"] == digests["2"]  # the survivors end on one consensus (the CPU backend lands its last round)
    assert summary["final_eval"] > 0.7


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async", "cpu-cadence", "cpu-cadence-relay"])
def test_a_rank_that_dies_right_after_its_report_costs_no_sample(proc_env, tmp_path, mode):
    """Rank 1 SIGKILLs itself the moment its 5th window's report has left, that window's average
    still in flight. Its report counts the window; the survivors' next reports say whether any of
    them completed that average (then the dead rank's work is in the consensus) or all gave it up
    (then its samples are trained again). Either way every epoch holds its samples once."""
    proc_env = {**proc_env, "FLODL_INJECT_FAULT": "1:reported:5"}
    if mode == "cpu-cadence-relay":  # the host's ranks behind a relay, as on a host other than the controller's
        proc_env, mode = {**proc_env, "FLODL_BULK_RELAY": "always"}, "cpu-cadence"
    run, path = start(proc_env, tmp_path, mode)
    summary = finish(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1]
    given_back = "which went on without it" in run.output
    if mode.startswith("nccl-"):
        assert summary["final_digests"]["0"] == summary["final_digests"]["2"]
        gave_up = [r for r in (0, 2) if f"rank {r}: a background average failed" in run.output]
        # the controller gives the dead rank's window back exactly when every survivor gave its average up
        assert given_back == (gave_up == [0, 2]), run.output
    else:
        # the CPU backend: the snapshot's frame is queued before the report, but ZeroMQ sends from its
        # own thread (and behind a relay it may still sit in the rank's bulk socket), so on a loaded
        # machine the kill can come first (seen in full suite runs, direct and relayed): the round then
        # goes on without it and its samples are trained again, said and counted; else it was folded whole
        assert given_back or summary["late_samples"] == 0, run.output


def test_a_rank_that_dies_after_its_last_report_leaves_no_survivor_waiting_for_a_group(proc_env, tmp_path):
    """Rank 1 SIGKILLs itself the moment its last window's report has left (Sync trains one window an
    epoch, so its 12th is the run's last). The controller then announces the survivors' group and
    ends the run at once: a survivor that reads the Shutdown first leaves, so one that read the
    Regroup first must not wait for it to build the group (it waited 22 s, then crashed)."""
    run, path = start({**proc_env, "FLODL_INJECT_FAULT": f"1:reported:{EPOCHS}"}, tmp_path, "nccl-sync")
    summary = finish(run, path)
    # its exit may also come after the run ended, when an exit is no longer a death
    assert [d["rank"] for d in summary["deaths"]] in ([], [1]), run.output
    assert "never arrived" not in run.output and "Traceback" not in run.output, run.output
    assert {"0", "2"} <= set(summary["final_digests"]), run.output  # both survivors left cleanly


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async", "cpu-sync", "cpu-cadence-relay"])
def test_a_rank_that_dies_halfway_through_its_snapshot_shrinks_no_parameter(proc_env, tmp_path, mode):
    """Rank 1 SIGKILLs itself once the first 8 MiB slice of its 5th snapshot has left, the rest of it
    never sent. The model carries a parameter of ones that nothing trains: every average of it must
    stay exactly ones (the eval reads its mean). Before each slice was divided by exactly what was
    folded into it, the slices rank 1 never sent went out scaled by the survivors' share."""
    proc_env = {**proc_env, "FLODL_INJECT_FAULT": "1:slice:5", "FLODL_TEST_BIG_MODEL": "1"}
    if mode == "cpu-cadence-relay":
        proc_env, mode = {**proc_env, "FLODL_BULK_RELAY": "always"}, "cpu-cadence"
    run, path = start(proc_env, tmp_path, mode)
    summary = finish(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1], run.output
    assert summary["averaging"]["aborted"] == 0, summary["averaging"]
    assert summary["final_eval"] == pytest.approx(1.0, abs=1e-6), run.output


def test_a_survivor_lost_while_the_group_is_rebuilt_costs_only_itself(proc_env, tmp_path):
    """Rank 3 dies averaging; rank 1 dies after the survivors gathered for the new group but
    before it connected. Ranks 0 and 2, waiting in torch's rendezvous, leave it when the next
    generation is announced and join that one: the run finishes on them."""
    proc_env = {**proc_env, "FLODL_INJECT_FAULT": "3:average:6,1:regroup:1"}
    run, path = start(proc_env, tmp_path, "nccl-cadence", nproc=4)
    summary = finish(run, path)
    assert sorted(d["rank"] for d in summary["deaths"]) == [1, 3]
    assert summary["recoveries"][-1]["survivors"] == [0, 2]
    assert set(summary["final_digests"]) == {"0", "2"}
    assert summary["final_digests"]["0"] == summary["final_digests"]["2"]
    # they leave the half-connected group behind as soon as the next generation is announced
    assert "now one of 2 ranks (generation 2)" in run.output, run.output
    assert summary["final_eval"] > 0.7


def test_kill_9_from_outside_mid_run(proc_env, tmp_path):
    # steps slow enough (50 ms) that the run is still training when the kill lands after "epoch 4/";
    # once it has landed, 10 ms: the epochs after it only have to happen, not to last
    killed = tmp_path / "killed"
    env = {**proc_env, "FLODL_TEST_HOLD_FILE": str(killed), "FLODL_TEST_HOLD_SLEEP": "0.05"}
    run, path = start(env, tmp_path, "nccl-cadence")
    ranks = run.ranks(3)
    run.wait_for_line("epoch 4/")
    victim = ranks[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed.touch()
    summary = finish(run, path)
    assert [d["pid"] for d in summary["deaths"]] == [victim.pid]
    assert "continuing with 2 rank(s)" in run.output


def test_stopped_rank_is_dropped_through_the_heartbeat(proc_env, tmp_path):
    run, path = start(proc_env, tmp_path, "nccl-cadence", heartbeat=3)
    ranks = run.ranks(3)
    run.wait_for_line("epoch 2/")
    stopped_at = time.monotonic()
    os.kill(ranks[2].pid, signal.SIGSTOP)
    tree = run.tree()
    summary = finish(run, path)
    assert "sent nothing for" in summary["deaths"][0]["reason"]
    assert summary["recoveries"][0]["at_s"] > 0
    assert time.monotonic() - stopped_at < 150
    assert_all_gone(tree)  # the worker kills the stopped rank at the end


def test_one_of_two_collective_ranks_lost_the_other_trains_alone(proc_env, tmp_path):
    """Rank 0 of two dies: rank 1 trains alone (its averages are the identity) to the end."""
    run, path = start(proc_env, tmp_path, "nccl-cadence", nproc=2)
    ranks = run.ranks(2)
    run.wait_for_line("epoch 1/")
    os.kill(ranks[0].pid, signal.SIGKILL)
    summary = finish(run, path)
    assert "continuing with 1 rank(s)" in run.output
    assert set(summary["final_digests"]) == {"1"} and summary["final_eval"] > 0.7


def test_one_of_two_collective_ranks_lost_and_healed_back(proc_env, tmp_path):
    """With --max-restarts the lone survivor is joined by rank 0's replacement: two ranks again."""
    hold = tmp_path / "joined"
    env = {**proc_env, "FLODL_INJECT_FAULT": "0:batch:20", "FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.2"}
    run, path = start(env, tmp_path, "nccl-cadence", nproc=2, extra=("--max-restarts", "1"))
    run.wait_for_line("training with 2 rank(s)", timeout=120)
    hold.touch()
    summary = finish(run, path)
    assert [r["replaces"] for r in summary["restarts"]] == [0]
    assert set(summary["final_digests"]) == {"1", "2"}
    assert summary["final_digests"]["1"] == summary["final_digests"]["2"]


def test_max_failure_stops_the_run(proc_env, tmp_path):
    run, path = start(proc_env, tmp_path, "cpu-cadence", extra=("--max-failure", "1"))
    ranks = run.ranks(3)
    run.wait_for_line("epoch 1/")
    os.kill(ranks[2].pid, signal.SIGKILL)
    assert run.wait(60) == 3, run.output
    assert "reaches max_failure 1" in run.output
