"""Faults where they hurt, with real processes: a training thread stuck in user code, a kill
while every survivor is inside a collective, a task that takes long to build, a loss that
turns NaN. Each was a hang, a stall or a silent bad run before (issue: faults at any moment)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from flodl.errors import EXIT_RANK_LOST

from .conftest import process_env, task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run, assert_all_gone

pytestmark = pytest.mark.timeout(180)


def run_tiny(proc_env, tmp_path, mode, *, nproc=3, epochs=10, heartbeat=3, env=(), extra=()):
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.01", **dict(env)}
    path = tmp_path / "s.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            str(nproc),
            "--epochs",
            str(epochs),
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


def finished(run, path, epochs):
    assert run.wait(150) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * epochs  # no sample lost, none twice
    return summary


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory) -> Callable[[str], SimpleNamespace]:
    """Rank 1's training thread blocks for good mid-batch while its link thread keeps beating: one
    run per mode, made on first ask and shared by the tests that check what became of the rank
    (fenced; detected in time), as each run costs a start-up of three ranks."""
    runs: dict[str, SimpleNamespace] = {}

    def run_for(mode: str) -> SimpleNamespace:
        if mode not in runs:
            run, path = run_tiny(
                process_env(), tmp_path_factory.mktemp(f"hung-{mode}"), mode, env={"FLODL_INJECT_FAULT": "1:batch:40:hang"}
            )
            tree = run.tree()
            runs[mode] = SimpleNamespace(run=run, tree=tree, summary=finished(run, path, 10))
        return runs[mode]

    return run_for


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence", "nccl-sync"])
def test_a_training_thread_stuck_in_user_code_is_declared_hung_and_fenced(hung_run, mode):
    """It is declared hung within about the heartbeat timeout, killed, and the others finish."""
    hung = hung_run(mode)
    run, summary = hung.run, hung.summary
    [death] = summary["deaths"]
    assert death["rank"] == 1
    assert "made no progress in a training step" in death["reason"], death
    assert "continuing with 2 rank(s)" in run.output
    assert summary["final_eval"] > 0.7
    assert_all_gone(hung.tree)  # the hung rank was fenced (SIGKILL), not left behind


def test_a_stuck_thread_is_detected_within_the_heartbeat_timeout(hung_run):
    """Detection of a stuck training thread: heartbeat timeout + 3 steps, not a collective
    timeout or more (the stall is measured from the moment the fault fired, read off the log).
    Its peers' wait does not shorten it: a rank that beats on may be a survivor blocked in a
    collective with a lost host (at half the timeout such survivors were judged hung first)."""
    [death] = hung_run("nccl-cadence").summary["deaths"]
    stuck = float(death["reason"].split("for ")[1].split(" s")[0])
    assert 3.0 <= stuck < 4.5, death["reason"]  # the deadline (3 s heartbeat + 3 steps), printed to 0.1 s


def test_a_stopped_rank_its_peers_wait_for_is_dropped_at_half_the_heartbeat_timeout(proc_env, tmp_path):
    """SIGSTOP: alive but silent. Its peers finish their windows and wait for its report; it is
    declared dead after half the heartbeat timeout (3 s of 6), not the whole of it, and the rest finish."""
    hold = tmp_path / "stopped"
    env = {"FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.05"}  # 50 ms steps until the stop landed
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", heartbeat=6, env=env)
    ranks = run.ranks(3)
    run.wait_for_line("epoch 2/")
    os.kill(ranks[2].pid, signal.SIGSTOP)
    hold.touch()
    tree = run.tree()
    summary = finished(run, path, 10)
    [fault] = summary["faults"]
    assert fault["rank"] == 2 and "while its peers waited for it (deadline 3 s; heartbeat timeout 6 s)" in fault["reason"], fault
    assert 3.0 <= fault["detect_s"] < 4.5, fault  # from its last frame: 3 s, not 6
    assert_all_gone(tree)  # fenced: the stopped rank is killed


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
    run, path = run_tiny(proc_env, tmp_path, mode, nproc=2, env={"FLODL_INJECT_FAULT": "1:batch:30:nan"}, extra=("--save-path", str(stem)))
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
    hold = tmp_path / "kills-done"  # steps stay slow (0.2 s) until every kill is in, then the run ends fast
    run, path = run_tiny(
        proc_env,
        tmp_path,
        "nccl-sync",
        nproc=6,
        epochs=12,
        heartbeat=20,
        env={"FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.2"},
    )
    ranks = run.ranks(6)
    run.wait_for_line("epoch 1/")
    for victim in rng.sample(ranks[1:], 3):
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(victim.pid, signal.SIGKILL)
    time.sleep(3.0)  # the last recovery completes while steps are still slow
    hold.touch()
    summary = finished(run, path, 12)
    assert len(summary["deaths"]) == 3
    again = [r["training_again_s"] for r in summary["recoveries"]]
    assert all(a is not None for a in again[-1:]), summary["recoveries"]
    assert max(a for a in again if a is not None) < 5.0, (summary["recoveries"], run.output)
    assert len(set(summary["final_digests"].values())) == 1  # the survivors end on one consensus


def test_a_run_whose_every_eval_failed_is_not_a_plain_success(proc_env, tmp_path):
    """Training completes but eval_fn raised every time: exit 9 and the summary says so."""
    # every epoch scored on its own (unset, one average may close both epochs on a loaded machine: one eval)
    env, extra = {"FLODL_TEST_EVAL_FAIL": "1"}, ("--eval-every-epochs", "1")
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", nproc=2, epochs=2, env=env, extra=extra)
    assert run.wait(120) == 9, run.output
    summary = json.loads(path.read_text())
    assert summary["exit_reason"] == "completed, every eval failed" and summary["exit_code"] == 9
    assert epoch_samples(summary["history"]) == [512, 512]
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
    assert restart["delay_s"] == 0.0  # a first fault is no crash loop: restarted at once (it waited 1 s)
    assert "restarting rank 1 as rank 3 on host" in run.output and "at once (restart 1 of 2)" in run.output
    assert [j["ranks"] for j in summary["joins"]] == [[3]]
    assert set(summary["final_digests"]) == {"0", "2", "3"}
    assert len(set(summary["final_digests"].values())) == 1  # one consensus, either backend
    alive_pids = {r["pid"] for r in summary["per_rank"] if r["rank"] in (0, 2)}
    assert alive_pids <= survivors  # the survivors are the processes that started the run
    assert "restarting rank 1 as rank 3" in run.output


# Without restarts left (--max-restarts 0, the default) nothing restarts and the run goes on with the
# survivors: test_elastic.py's test_a_rank_dies_at_a_chosen_point_and_the_run_finishes checks it of
# every one of its deaths (a run of its own here cost a start-up of three ranks).


def test_a_restart_still_starting_when_the_run_ends_is_fenced_not_waited_for(proc_env, tmp_path):
    """Rank 1 dies; its restart (rank 2) is still building when training ends: its build never
    ends (a stuck import, a download), so no machine load can let it join in time. It could not
    hear the Shutdown before its hello, so its worker would wait out the 30 s grace: the
    controller drops it and its worker kills it."""
    run, path = run_tiny(
        proc_env,
        tmp_path,
        "nccl-cadence",
        nproc=2,
        epochs=4,
        env={"FLODL_TEST_STEP_SLEEP": "0.02", "FLODL_INJECT_FAULT": "1:batch:20,2:build:1:hang"},
        extra=["--max-restarts", "1"],
    )
    summary = finished(run, path, 4)
    assert [r["replaces"] for r in summary["restarts"]] == [1]
    assert "could not join the run: the run ended before it joined" in run.output, run.output
    assert "still running" not in run.output, run.output  # the worker did not wait for it


def test_a_killed_worker_does_not_keep_the_controller_waiting_for_its_dead_ranks(proc_env, tmp_path):
    """The local worker is SIGKILLed (its ranks die with it): the controller stops the run at
    once instead of waiting its abort grace (10 s) for ranks that can no longer answer."""
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", nproc=2, epochs=30, env={"FLODL_TEST_STEP_SLEEP": "0.05"})
    run.ranks(2)
    run.wait_for_line("epoch 1/")
    [worker] = [p for p in run.tree() if "flodl.worker" in " ".join(p.cmdline())]
    killed = time.monotonic()
    worker.kill()
    assert run.wait(60) == 3, run.output
    assert time.monotonic() - killed < 8.0, run.output
    assert "the local worker" in run.output


def test_an_empty_dataset_is_the_users_error_exit_2_without_a_traceback(proc_env, tmp_path):
    path = tmp_path / "s.json"
    run = Run(["--task", task_spec("tiny.py", "empty_task"), "--nproc-per-node", "2", "--summary-json", str(path)], proc_env)
    assert run.wait(90) == 2, run.output
    assert run.output.count("Task.dataset is empty") == 1, run.output  # said once, for the run
    assert "Traceback" not in run.output and "--- traceback" not in run.output
    assert "still running" not in run.output, run.output  # a rank still building is stopped at once


def test_a_rank_whose_start_the_abort_overtook_is_never_left_running(proc_env, tmp_path):
    """Rank 1's fork is slow (a loaded host): rank 0's error stops the run while rank 1 is not yet
    a process. The controller's order to kill it reaches the worker first; the worker must not
    start it afterwards and then wait its grace period for a rank nobody will talk to."""
    path = tmp_path / "s.json"
    env = {**proc_env, "FLODL_INJECT_FAULT": "1:spawn:3:delay"}
    run = Run(["--task", task_spec("tiny.py", "empty_task"), "--nproc-per-node", "2", "--summary-json", str(path)], env)
    assert run.wait(90) == 2, run.output
    assert run.output.count("Task.dataset is empty") == 1, run.output
    assert "still running" not in run.output, run.output


@pytest.mark.parametrize(("mode", "restarts"), [("nccl-cadence", 0), ("cpu-cadence", 0), ("nccl-cadence", 1)])
def test_a_rank_that_dies_while_the_others_start_costs_only_itself(proc_env, tmp_path, mode, restarts):
    """Rank 1 crashes while building its task: the others start without it (the first group
    forms among them, on rank 0's parameters) and the run finishes; with a restart left, its
    replacement joins at the first window boundary."""
    env = {"FLODL_TEST_BUILD_CRASH": "1", "FLODL_TEST_BUILD_SLEEP": "1"}
    hold = tmp_path / "joined"
    if restarts:  # steps are slow until the replacement joined, so it joins mid-run
        env.update(FLODL_TEST_HOLD_FILE=str(hold), FLODL_TEST_HOLD_SLEEP="0.2")
    run, path = run_tiny(proc_env, tmp_path, mode, epochs=6, env=env, extra=("--max-restarts", str(restarts)))
    if restarts:
        run.wait_for_line("training with 3 rank(s)", timeout=120)
        hold.touch()
    summary = finished(run, path, 6)
    assert [d["rank"] for d in summary["deaths"]] == [1]
    assert "exited with code 1" in summary["deaths"][0]["reason"]
    expected = {"0", "2", "3"} if restarts else {"0", "2"}
    assert set(summary["final_digests"]) == expected
    assert len(set(summary["final_digests"].values())) == 1  # one consensus, either backend


def test_a_death_past_max_failure_before_training_stops_without_a_bundle(proc_env, tmp_path):
    """Rank 1 dies while the others build, with --max-failure 1 (one death is already too many)
    and --save-path set: nothing was trained, so the run stops with the rank-lost code and says
    why, and writes no bundle (it used to crash reading a training loop that did not exist yet)."""
    stem = tmp_path / "ckpt"
    env = {"FLODL_TEST_BUILD_CRASH": "1", "FLODL_TEST_BUILD_SLEEP": "1"}
    run, path = run_tiny(proc_env, tmp_path, "nccl-cadence", epochs=3, env=env, extra=("--max-failure", "1", "--save-path", str(stem)))
    assert run.wait(120) == EXIT_RANK_LOST, run.output
    assert "Traceback" not in run.output, run.output
    assert "max_failure" in run.output or "max-failure" in run.output, run.output
    assert not list(tmp_path.glob("ckpt*")), sorted(p.name for p in tmp_path.iterdir())


def test_a_controller_killed_outright_leaves_no_shared_memory(proc_env, tmp_path):
    """SIGKILL on the controller of a CPU-backend run (its ranks average through /dev/shm): the
    local worker stops the ranks and, as it exits, sweeps the segments nobody owns any more."""
    shm_dir = tmp_path / "shm"  # this run's own: no other run's sweep can tidy up for it
    shm_dir.mkdir()
    run, path = run_tiny(
        proc_env, tmp_path, "cpu-cadence", nproc=2, epochs=40, env={"FLODL_TEST_STEP_SLEEP": "0.03", "FLODL_SHM_DIR": str(shm_dir)}
    )
    ranks = run.ranks(2)
    run.wait_for_line("epoch 2/")
    controller = run.proc.pid
    owned = [p.name for p in shm_dir.iterdir() if f"-{controller}." in p.name]
    assert owned, "the controller holds its update segment while the run trains"
    tree = run.tree()
    os.kill(controller, signal.SIGKILL)
    run.wait(30)
    assert_all_gone(tree + ranks, timeout=30)
    left = [p.name for p in shm_dir.iterdir()]
    assert left == []


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async"])
def test_a_cpu_backend_run_ends_on_one_consensus(proc_env, tmp_path, mode):
    """Cadence and Async send the last window's snapshot and train on; at the Shutdown the round in
    flight lands before the rank leaves, so every replica ends on the same values, as on the
    collective backend (before, a CPU rank left without waiting for it: one digest per rank)."""
    run, path = run_tiny(proc_env, tmp_path, mode, nproc=3, epochs=3, env={"FLODL_TEST_OPTIMIZER": "adam"})
    summary = finished(run, path, 3)
    digests = summary["final_digests"]
    assert set(digests) == {"0", "1", "2"} and len(set(digests.values())) == 1, digests
