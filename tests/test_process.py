"""Real processes: controller, worker and ranks started as users start them, then hurt."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import zmq

from flodl.wire import messages as m
from flodl.wire.codec import FrameWriter

from .conftest import PY, ROOT, process_env, task_spec
from .helpers.history import epoch_samples, epochs
from .helpers.procs import PICK_PORT, Run, assert_all_gone, assert_run_gone, runs_module

pytestmark = pytest.mark.timeout(120)


MODES = ["nccl-sync", "nccl-cadence", "nccl-async", "cpu-sync", "cpu-cadence", "cpu-async"]
DIGITS = 1500  # examples/digits.py's training split: 47 batches of 32 an epoch
DIGITS_EPOCHS = 4


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Callable[[str], SimpleNamespace]:
    """One real 2-rank digits run per mode, rank 1 made 3x slower (simulated), made on first ask
    and shared by the tests that each check one side of it (what a summary holds, the accuracy
    band, coverage and pace): a run per test cost a process start-up each, most of such a test's
    time. nccl-cadence is the default mode: its run passes no --mode, so the default is checked."""
    runs: dict[str, SimpleNamespace] = {}

    def run_for(mode: str) -> SimpleNamespace:
        if mode not in runs:
            path = tmp_path_factory.mktemp(f"digits-{mode}") / "s.json"
            env = {**process_env(), "FLODL_SIMULATE_SLOWDOWN": "1:3"}
            args = [
                "--task",
                "examples/digits.py:task",
                "--nproc-per-node",
                "2",
                "--epochs",
                str(DIGITS_EPOCHS),
                "--summary-json",
                str(path),
            ]
            run = Run(args + ([] if mode == "nccl-cadence" else ["--mode", mode]), env)
            assert run.wait(120) == 0, run.output
            runs[mode] = SimpleNamespace(run=run, summary=json.loads(path.read_text()))
        return runs[mode]

    return run_for


def test_digits_trains_on_two_ranks(digits_run):
    """The default mode's run (it passes no --mode): what the summary holds, and a model that learned."""
    digits = digits_run("nccl-cadence")
    run, summary = digits.run, digits.summary
    for key in (
        "mode",
        "world_size",
        "epochs",
        "wall_s",
        "samples_per_s",
        "per_rank",
        "syncs",
        "final_loss",
        "final_eval",
        "eval_metric_name",
        "deaths",
        "exit_reason",
    ):
        assert key in summary
    assert summary["world_size"] == 2 and summary["epochs"] == DIGITS_EPOCHS and summary["mode"] == "NcclCadence"
    start, end = summary["trained_unix"]  # the span wall_s measures, after the process started
    assert end - start == pytest.approx(summary["wall_s"]) and summary["startup"]["started_unix"] < start < end < time.time()
    assert summary["exit_reason"] == "completed" and summary["deaths"] == []
    assert summary["final_eval"] > 0.85, run.output
    assert summary["final_loss"] < summary["history"][0]["loss"]
    assert {r["device"] for r in summary["per_rank"]} == {"cpu"}
    assert sum(r["samples"] for r in summary["per_rank"]) == DIGITS_EPOCHS * DIGITS
    # the last epoch's line, or a group's that closed it ("epochs 3-4/4": one average closed them)
    assert run.closed(DIGITS_EPOCHS) and "final accuracy" in run.output, run.output


def test_kill_9_rank_stops_run_fast_and_leaves_nothing(proc_env):
    timeout = 5
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    # --max-failure 1: one death stops the run (one rank left would otherwise train on alone)
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "2",
            "--epochs",
            "200",
            "--heartbeat-timeout-secs",
            str(timeout),
            "--max-failure",
            "1",
        ],
        env,
    )
    ranks = run.ranks(2)
    run.wait_for_line("epoch 1/200")
    tree = run.tree()
    killed_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)
    code = run.wait(timeout + 10)
    elapsed = time.monotonic() - killed_at
    assert code == 3, run.output
    assert elapsed < timeout + 2, f"took {elapsed:.1f} s"
    assert f"pid {ranks[1].pid}) was killed by SIGKILL" in run.output
    assert "run stopped" in run.output
    assert_all_gone(tree)


def test_stopped_rank_is_found_by_heartbeat_and_killed(proc_env):
    timeout = 3
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "2",
            "--epochs",
            "200",
            "--heartbeat-timeout-secs",
            str(timeout),
            "--max-failure",
            "1",
        ],
        env,
    )
    ranks = run.ranks(2)
    run.wait_for_line("epoch 1/200")
    tree = run.tree()
    stopped_at = time.monotonic()
    os.kill(ranks[0].pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
    code = run.wait(timeout + 20)
    assert code == 3, run.output
    # silence, or (when its last beat already showed a stall) no progress: either way the heartbeats told
    assert ("sent nothing for" in run.output or "made no progress" in run.output) and f"pid {ranks[0].pid}" in run.output
    assert time.monotonic() - stopped_at < timeout + 12
    assert_all_gone(tree)


def test_killed_controller_takes_everything_down(proc_env):
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "200", "--heartbeat-timeout-secs", "5"], env)
    run.ranks(2)
    run.wait_for_line("epoch 1/200")
    tree = run.tree()
    run.proc.kill()
    run.wait(10)
    assert_all_gone(tree, timeout=15)


def test_frozen_controller_is_detected_by_worker_and_ranks(proc_env):
    """SIGSTOP the controller: no death signal reaches anyone, only silence does."""
    timeout = 3
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "200", "--heartbeat-timeout-secs", str(timeout)], env)
    run.ranks(2)
    run.wait_for_line("epoch 1/200")
    tree = run.tree()
    os.kill(run.proc.pid, signal.SIGSTOP)
    try:
        assert_all_gone(tree, timeout=timeout + 12)
    finally:
        os.kill(run.proc.pid, signal.SIGKILL)
        run.wait(10)


def test_task_error_is_reported_once_with_traceback(proc_env):
    # the ranks fail seconds after they start: the check for leftovers scans by run id after the exit,
    # not the tree at a moment a busy machine may have let pass
    run_id = f"fail-{os.getpid()}-{time.monotonic_ns()}"
    env = {**proc_env, "FLODL_TEST_FAIL_AT": "5", "FLODL_RUN_SECRET": os.urandom(32).hex(), "FLODL_RUN_ID": run_id}
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "3"], env)
    assert run.wait(60) == 4, run.output
    assert "failed during train: RuntimeError: injected failure at step 5" in run.output
    assert "Traceback" in run.output and "tiny.py" in run.output
    # the user's frames, once: not flodl's runner, not one copy per rank and per log
    assert run.output.count("injected failure at step 5") == 2, run.output  # the traceback's last line, the verdict
    assert run.output.count("Traceback") == 1 and "flodl/rank" not in run.output, run.output
    assert f"flodl run {run_id}" in run.output, run.output  # the run the scan below looks for
    assert_run_gone(run_id)


def test_a_task_spec_naming_nothing_is_refused_before_any_rank_starts(proc_env, tmp_path):
    """A missing file, a missing attribute: the controller checks the spec (reading, not running, the
    module) and exits 2 with one line naming it, before a worker or rank starts."""
    (tmp_path / "mine.py").write_text("import torch\n\ndef task():\n    pass\n")
    for spec, said in ((f"{tmp_path / 'missing.py'}:task", "missing.py"), (f"{tmp_path / 'mine.py'}:tsak", "'tsak'")):
        run = Run(["--task", spec, "--nproc-per-node", "2", "--epochs", "1"], proc_env)
        assert run.wait(30) == 2, run.output
        assert len(run.lines) == 1 and said in run.output and "task" in run.output, run.output
        assert "dashboard" not in run.output  # nothing was started


def test_model_mismatch_is_refused_before_training(proc_env, tmp_path):
    # rank 1 builds a different model than rank 0: the run must not start
    spec = tmp_path / "mixed.py"
    spec.write_text(
        "import os\n"
        f"import importlib.util, sys\nsys.path.insert(0, {str(ROOT / 'tests' / 'tasks')!r})\n"
        "import tiny\n"
        "def task():\n"
        "    return tiny.other_model_task() if os.environ['FLODL_RANK'] == '1' else tiny.task()\n"
    )
    run = Run(["--task", f"{spec}:task", "--nproc-per-node", "2", "--epochs", "1"], proc_env)
    assert run.wait(60) == 4, run.output
    assert "cannot join: its model signature" in run.output


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-grad-norm", "-1"], ["max_grad_norm"]),
        (["--max-log-size", "-5"], ["max_log_size"]),
        (["--mode", "nccl-turbo"], ["mode", "cpu-async"]),
        (["--mode", "nccl-sync", "--easgd-alpha", "0.5"], ["easgd_alpha", "nccl-sync"]),
        (["--mode", "cpu-async", "--deterministic"], ["deterministic", "cpu-async"]),
    ],
)
def test_bad_option_fails_fast_naming_it(proc_env, flags, named):
    res = subprocess.run(
        [PY, "-m", "flodl.controller", "--task", task_spec("tiny.py"), *flags], env=proc_env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and all(word in res.stderr for word in named), res.stderr


def test_worker_without_secret_refuses_to_start(proc_env):
    env = {k: v for k, v in proc_env.items() if not k.startswith("FLODL_RUN")}
    res = subprocess.run(
        [PY, "-m", "flodl.worker", "--controller", "tcp://127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "FLODL_RUN_SECRET" in res.stderr


def test_10000_hostile_frames_do_not_stop_training(proc_env, tmp_path):
    """A live controller takes 10,000 random and mutated frames and still trains."""
    secret, run_id = os.urandom(32), "fuzz-run"
    # long enough that the controller reads every hostile frame before the run ends
    env = {**proc_env, "FLODL_RUN_SECRET": secret.hex(), "FLODL_RUN_ID": run_id, "FLODL_TEST_STEP_SLEEP": "0.02"}
    summary_path = tmp_path / "s.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "2",
            "--epochs",
            "6",
            *PICK_PORT,
            "--summary-json",
            str(summary_path),
        ],
        env,
    )
    port = run.control_port()
    run.wait_for_line("epoch 1/6")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"fuzzer")
    sock.setsockopt(zmq.LINGER, 5000)  # deliver every frame before close
    sock.connect(f"tcp://127.0.0.1:{port}")
    rng = random.Random(11)
    signed = FrameWriter(secret, run_id, "fuzzer")
    stolen = [signed.encode(m.RankExited(rank=0, pid=1, code=-9)) for _ in range(10)]  # never sent intact
    for i in range(10_000):
        base = bytearray(rng.choice(stolen))
        if i % 3 == 0:
            frame = rng.randbytes(rng.randint(0, 400))
        elif i % 3 == 1:
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
            frame = bytes(base)
        else:
            frame = bytes(base[: rng.randrange(len(base))]) + rng.randbytes(rng.randint(0, 8))
        sock.send(frame)
    sock.close()
    assert run.wait(100) == 0, run.output
    summary = json.loads(summary_path.read_text())
    assert summary["deaths"] == [] and summary["epochs_completed"] == 6
    assert sum(summary["dropped_frames"].values()) >= 9_990
    assert summary["final_eval"] > 0.7


def test_sigterm_to_worker_is_forwarded_and_nothing_is_left(proc_env):
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "200", "--heartbeat-timeout-secs", "5"], env)
    run.ranks(2)
    run.wait_for_line("epoch 1/200")
    tree = run.tree()
    worker = next(p for p in tree if runs_module(p, "flodl.worker"))
    worker.send_signal(signal.SIGTERM)
    code = run.wait(30)
    assert code == 3, run.output
    assert "run stopped" in run.output
    assert_all_gone(tree)


def test_trainer_api_runs_like_the_cli(tmp_path):
    """Trainer.builder(fn)...run() in this process: same run, same summary."""
    from examples.quickstart import task
    from flodl import ConfigError, DdpRunConfig, Trainer

    with pytest.raises(ConfigError, match="transform"):  # ranks import it by name: a lambda cannot travel
        Trainer.builder(task).config(DdpRunConfig().with_transform(lambda rows, keys: rows)).build()
    summary = (
        Trainer.builder(task)
        .nproc_per_node(2)
        .epochs(2)
        .progress(False)
        .config(DdpRunConfig().with_max_grad_norm(1.0).with_lr_scale_ratio(0.5))
        .summary_json(str(tmp_path / "s.json"))
        .run()
    )
    assert summary["exit_reason"] == "completed" and summary["world_size"] == 2
    assert summary["final_eval"] > 0.8
    assert summary["config"]["max_grad_norm"] == 1.0 and summary["config"]["lr_scale_ratio"] == 0.5
    assert json.loads((tmp_path / "s.json").read_text())["run_id"] == summary["run_id"]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_with_a_3x_slower_rank_covers_every_sample(digits_run, mode):
    """A real 2-process run per mode, rank 1 made 3x slower (simulated): exact coverage, fast rank does more."""
    summary = digits_run(mode).summary
    assert epoch_samples(summary["history"]) == [DIGITS] * DIGITS_EPOCHS  # the ledger closed every epoch exactly
    fast, slow = (r["samples"] for r in summary["per_rank"])
    if mode.endswith("sync") and not mode.endswith("async"):
        # lockstep: each epoch's even split of its 47 batches (24 and 23), whatever the speeds
        assert (fast, slow) == (DIGITS_EPOCHS * 24 * 32, DIGITS_EPOCHS * (DIGITS - 24 * 32)), (fast, slow)
        assert summary["syncs"] == DIGITS_EPOCHS * 24
    else:
        # over the run the fast rank was planned more: 3.3:1 on a quiet machine, where an equal
        # split would give 1:1. Not near 3: rank 0 runs the evals while rank 1 trains on, and on
        # a loaded machine (CI beside a CPU hog, two test workers) they took long enough to leave
        # 1.36:1. ElChe's last plan alone is one window's reading, which load can even invert.
        assert fast > 1.25 * slow, (fast, slow)
        assert summary["syncs"] < DIGITS_EPOCHS * 24
    assert summary["final_eval"] > 0.7


def two_rank_summary(tmp_path, env: dict[str, str], task: str, *flags: str) -> dict:
    """Run ``task`` on two local ranks with ``flags`` to a clean exit (120 s at most); its run summary."""
    path = tmp_path / "s.json"
    run = Run(["--task", task, "--nproc-per-node", "2", *flags, "--summary-json", str(path)], env)
    assert run.wait(120) == 0, run.output
    summary: dict = json.loads(path.read_text())
    return summary


def test_a_first_step_warm_up_is_not_taken_for_the_rank_pace(proc_env, tmp_path):
    """A first step 40x longer than the rest (a GPU's lazy set-up) is timed as the step after it:
    the compute the ranks report stays far below it, while the wall clock still holds it."""
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_TEST_FIRST_STEP_SLEEP": "0.8", "FLODL_SIMULATE_SLOWDOWN": "1:3"}
    summary = two_rank_summary(tmp_path, env, task_spec("tiny.py"), "--epochs", "2", "--mode", "nccl-cadence")
    compute = {r: sum(h["per_rank"][r]["compute_ms"] for h in summary["history"]) for r in ("0", "1")}
    batches = {r: sum(h["per_rank"][r]["batches"] for h in summary["history"]) for r in ("0", "1")}
    # without the retiming each rank would report >= 800 ms (rank 1, slowed 3x, >= 2400 ms)
    assert compute["0"] < 800 and compute["1"] < 800, (compute, batches)
    assert summary["wall_s"] >= 0.8
    assert batches["0"] > 1.5 * batches["1"], batches  # the 3x slower rank was seen as such, not as 1:1 or 40:1


def test_epoch_walls_do_not_overlap_when_windows_are_planned_ahead(proc_env, tmp_path):
    """Two windows in flight: the next epoch's first window is planned while the previous epoch
    trains. Each epoch's wall must start at the previous epoch's close, so the epochs' walls add
    up to at most the run's wall; counted from the plan they overlapped (six epochs of a 1.9 s
    run read 4.0 s in all)."""
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.002"}
    summary = two_rank_summary(tmp_path, env, task_spec("tiny.py"), "--epochs", "6", "--mode", "nccl-cadence")
    walls = [h["wall_s"] for h in summary["history"]]
    assert epochs(summary["history"]) == list(range(6)) and all(w > 0 for w in walls), walls
    assert sum(walls) <= summary["wall_s"] + 0.05, (walls, summary["wall_s"])
    # the controller timed what its windows cost it (planning, settling) and ElChe read it
    assert summary["cadence"]["fixed_ms"] > 0, summary["cadence"]


def test_epoch_fn_and_lr_schedule_follow_the_global_step(proc_env, tmp_path):
    summary = two_rank_summary(
        tmp_path, proc_env, task_spec("tiny.py", "scheduled_task"), "--epochs", "4", "--mode", "nccl-sync", "--lr-scale-ratio", "0"
    )
    lrs = [h["scalars"]["lr_at_epoch_start"] for h in summary["history"]]
    # 16 batches per rank per epoch, 32 global steps per epoch: x0.5 every 2 epochs; from epoch 2, epoch_fn pins 0.001
    assert lrs[0] == pytest.approx(0.1) and lrs[1] == pytest.approx(0.1)
    assert lrs[2] == pytest.approx(0.05) and lrs[3] == pytest.approx(0.001)
    assert summary["history"][0]["scalars"]["world"] == 2


@pytest.mark.parametrize("mode", MODES)
def test_all_six_modes_train_digits_to_the_same_band(digits_run, mode):
    """Every mode trains digits into one accuracy band, with rank 1 3x slower at that (the shared run)."""
    summary = digits_run(mode).summary
    assert summary["mode"].lower() == mode.replace("-", "")
    assert epoch_samples(summary["history"]) == [DIGITS] * DIGITS_EPOCHS
    assert summary["final_eval"] >= 0.88, (mode, summary["final_eval"])
    if mode.startswith("cpu"):
        assert summary["averaging"]["rounds"] >= summary["syncs"] and summary["averaging"]["aborted"] == 0
        assert summary["averaging"]["lane_mb"] > 0  # ranks on the controller's host averaged through shared memory


def test_mixed_device_types_need_the_cpu_backend(proc_env):
    res = subprocess.run(
        [PY, "-m", "flodl.controller", "--task", task_spec("tiny.py"), "--devices", "cuda:0,cpu", "--mode", "nccl-cadence"],
        env=proc_env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "mix device types" in res.stdout + res.stderr and "cpu-cadence" in res.stdout + res.stderr
