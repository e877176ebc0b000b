"""Faults where they hurt, with real processes: a training thread stuck in user code, a kill
while every survivor is inside a collective, a task that takes long to build, a loss that
turns NaN. Each was a hang, a stall or a silent bad run before (issue: faults at any moment)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from .conftest import task_spec
from .test_process import Run, assert_all_gone

pytestmark = pytest.mark.timeout(180)


def run_tiny(proc_env, tmp_path, mode, *, nproc=3, epochs=10, heartbeat=3, env=(), extra=()):
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.01", **dict(env)}
    path = tmp_path / "s.json"
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", str(nproc), "--epochs", str(epochs), "--mode", mode,
               "--heartbeat-timeout-secs", str(heartbeat), "--summary-json", str(path), *extra], env)
    return run, path


def finished(run, path, epochs):
    assert run.wait(150) == 0, run.output
    summary = json.loads(path.read_text())
    assert [h["samples"] for h in summary["history"]] == [512] * epochs  # no sample lost, none twice
    return summary


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence", "nccl-sync"])
def test_a_training_thread_stuck_in_user_code_is_declared_hung_and_fenced(proc_env, tmp_path, mode):
    """Rank 1's training thread blocks for good mid-batch while its link thread keeps beating:
    it is declared hung within about the heartbeat timeout, killed, and the others finish."""
    run, path = run_tiny(proc_env, tmp_path, mode, env={"FLODL_INJECT_FAULT": "1:batch:40:hang"})
    tree = run.tree()
    summary = finished(run, path, 10)
    [death] = summary["deaths"]
    assert death["rank"] == 1
    assert "made no progress in a training step" in death["reason"], death
    assert "continuing with 2 rank(s)" in run.output
    assert summary["final_eval"] > 0.7
    assert_all_gone(tree)  # the hung rank was fenced (SIGKILL), not left behind


def test_a_stuck_thread_is_detected_within_the_heartbeat_timeout(proc_env, tmp_path):
    """Detection of a stuck training thread: heartbeat timeout + 3 steps, not a collective
    timeout or more (the stall is measured from the moment the fault fired, read off the log)."""
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", heartbeat=3, env={"FLODL_INJECT_FAULT": "2:batch:30:hang"})
    summary = finished(run, path, 10)
    [death] = summary["deaths"]
    stuck = float(death["reason"].split("for ")[1].split(" s")[0])
    assert 3.0 < stuck < 4.5, death["reason"]


def test_a_task_slower_to_build_than_the_heartbeat_timeout_starts(proc_env, tmp_path):
    """The factory prepares its data for longer than the heartbeat timeout: the rank is not
    mistaken for one that lost its controller (it used to exit blaming the controller)."""
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", nproc=2, epochs=2, heartbeat=2, env={"FLODL_TEST_BUILD_SLEEP": "5"})
    summary = finished(run, path, 2)
    assert summary["deaths"] == []
    assert "heard nothing from the controller" not in run.output


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_a_nan_loss_stops_the_run_and_saves_nothing(proc_env, tmp_path, mode):
    """Rank 1's gradients turn NaN: its next loss is NaN. The run stops with exit 8, naming the
    rank, epoch and step, and the final save never writes the NaN weights over a bundle."""
    stem = tmp_path / "ckpt" / "run"
    run, path = run_tiny(proc_env, tmp_path, mode, nproc=2, env={"FLODL_INJECT_FAULT": "1:batch:30:nan"},
                         extra=("--save-path", str(stem)))
    assert run.wait(120) == 8, run.output
    assert "rank 1 on host" in run.output and "the loss became nan at epoch" in run.output
    meta = stem.parent / "run.meta.json"
    assert not meta.exists() or json.loads(meta.read_text()).get("save_reason") != "final"


def test_random_kills_mid_collective_never_stall_the_survivors(proc_env, tmp_path):
    """Three of six ranks are SIGKILLed at random moments of a run that averages after every
    batch (every moment is close to a collective). With a collective timeout of 20 s, a survivor
    left waiting on another survivor used to stall that long; every recovery must complete its
    first average of all survivors within a few seconds of the death."""
    rng = random.Random(int(os.environ.get("FLODL_TEST_SEED", "16")))
    run, path = run_tiny(proc_env, tmp_path, "nccl-sync", nproc=6, epochs=6, heartbeat=20,
                         env={"FLODL_TEST_STEP_SLEEP": "0.02"})
    ranks = run.ranks(6)
    run.wait_for_line("epoch 1/")
    for victim in rng.sample(ranks[1:], 3):
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(victim.pid, signal.SIGKILL)
    summary = finished(run, path, 6)
    assert len(summary["deaths"]) == 3
    again = [r["training_again_s"] for r in summary["recoveries"]]
    assert all(a is not None for a in again[-1:]), summary["recoveries"]
    assert max(a for a in again if a is not None) < 5.0, summary["recoveries"]
    assert len(set(summary["final_digests"].values())) == 1  # the survivors end on one consensus


def test_a_run_whose_every_eval_failed_is_not_a_plain_success(proc_env, tmp_path):
    """Training completes but eval_fn raised every time: exit 9 and the summary says so."""
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", nproc=2, epochs=2, env={"FLODL_TEST_EVAL_FAIL": "1"})
    assert run.wait(120) == 9, run.output
    summary = json.loads(path.read_text())
    assert summary["exit_reason"] == "completed, every eval failed" and summary["exit_code"] == 9
    assert [h["samples"] for h in summary["history"]] == [512, 512]
    assert "every eval failed (2 of 2; the last: ValueError: injected eval failure)" in run.output


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_healing_restarts_a_dead_rank_and_the_world_returns_to_full_size(proc_env, tmp_path, mode):
    """Rank 1 SIGKILLs itself; with --max-restarts its worker starts rank 3 in its place, which
    joins at a window boundary: the survivors never restart, and the run ends with 3 ranks on one
    consensus and every sample trained once. (Steps are slow until the join, so it happens mid-run.)"""
    hold = tmp_path / "joined"
    env = {"FLODL_INJECT_FAULT": "1:batch:20", "FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.2"}
    run, path = run_tiny(proc_env, tmp_path, mode, epochs=8, env=env, extra=("--max-restarts", "2"))
    survivors = {p.pid for p in run.ranks(3)}
    run.wait_for_line("training with 3 rank(s)", timeout=120)
    hold.touch()
    summary = finished(run, path, 8)
    [restart] = summary["restarts"]
    assert (restart["rank"], restart["replaces"], restart["attempt"]) == (3, 1, 1)
    assert [j["ranks"] for j in summary["joins"]] == [[3]]
    assert set(summary["final_digests"]) == {"0", "2", "3"}
    if mode != "cpu-cadence":
        assert len(set(summary["final_digests"].values())) == 1
    alive_pids = {r["pid"] for r in summary["per_rank"] if r["rank"] in (0, 2)}
    assert alive_pids <= survivors  # the survivors are the processes that started the run
    assert "restarting rank 1 as rank 3" in run.output


def test_healing_stops_after_max_restarts(proc_env, tmp_path):
    """Without restarts left (--max-restarts 0, the default) the run goes on with the survivors."""
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", env={"FLODL_INJECT_FAULT": "1:batch:20"})
    summary = finished(run, path, 10)
    assert summary["restarts"] == [] and summary["joins"] == []
    assert set(summary["final_digests"]) == {"0", "2"}
