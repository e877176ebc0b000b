"""Script mode (``--script``, ``flodl.init()``): the user's own loop, run as a rank, with real processes."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import torch

from flodl import scriptspec
from flodl.checkpoint.bundle import read_meta
from flodl.checkpoint.files import CheckpointError
from flodl.controller.before_init import BeforeInit
from flodl.controller.epoch_ends import EpochEnds
from flodl.errors import EXIT_CONFIG, EXIT_RANK_LOST, EXIT_TASK_ERROR
from flodl.plan.metrics import EpochReport, aggregate
from flodl.rank.flat import FlatModel
from flodl.rank.script_state import ScriptState
from flodl.wire import messages as m

from .conftest import PY, ROOT, TASKS
from .helpers.history import epoch_samples
from .helpers.observed import assert_same_state, observed, train_state
from .helpers.procs import Run, assert_all_gone, runs_module
from .tasks.script import Counter

SCRIPT = str(TASKS / "script.py")
EPOCHS = 3


def start(proc_env, tmp_path, *, mode="nccl-cadence", env=(), extra=(), epochs=EPOCHS, name="s.json"):
    path = tmp_path / name
    args = ["--script", SCRIPT, "--nproc-per-node", "2", "--epochs", str(epochs), "--mode", mode, "--summary-json", str(path), *extra]
    return Run(args, {**proc_env, **dict(env)}), path


def scripts(run, count=2, timeout=30.0) -> list:
    """The run's process tree once ``count`` script-mode ranks are in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = run.tree()
        if sum(runs_module(p, SCRIPT) for p in tree) >= count:
            return tree
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} script ranks; output:\n{run.output}")


def finished(run, path) -> dict:
    assert run.wait(60) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * EPOCHS  # every sample once, none lost
    assert summary["exit_reason"] == "completed" and summary["final_eval"] is None
    return summary


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
def test_a_script_trains_on_two_ranks(proc_env, tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    # every epoch its own row (no window runs past an epoch's end), for its end-of-epoch report
    run, path = start(proc_env, tmp_path, mode=mode, env={"FLODL_TEST_OUT": str(out)}, extra=("--eval-every-epochs", "1"))
    summary = finished(run, path)
    assert summary["world_size"] == 2 and summary["deaths"] == []
    assert summary["final_loss"] < summary["history"][0]["loss"]
    # run.report after an epoch's batches lands in that epoch's row, the last epoch's too
    assert [h["scalars"]["epoch_seen"] for h in summary["history"]] == list(range(EPOCHS))
    assert 0.7 < summary["history"][-1]["scalars"]["accuracy"] <= 1.0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, record in enumerate(ranks):
        assert record["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
        # run.epochs() yields every epoch, in order, on every rank (one it trains no batch of too)
        assert record["epochs"] == list(range(EPOCHS))
        assert record["world_size"] == 2
    assert sum(r["steps"] for r in ranks) == EPOCHS * 512 // 16  # the loops trained every granted batch, once
    if mode == "nccl-cadence":  # the last average lands before the script's loop ends: equal replicas
        assert ranks[0]["weights"] == ranks[1]["weights"]
        # a window's batches run on the script's thread: the rank's thread takes a turn per round
        # (and at prepare and the last epoch's end), not per batch
        assert all(r["driver_turns"] < r["steps"] for r in ranks), ranks
        assert len(set(summary["final_digests"].values())) == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["nccl-sync", "nccl-async"])
def test_a_report_after_an_epochs_batches_lands_in_that_epoch(proc_env, tmp_path, mode):
    """Each script reports epoch_seen=e after epoch e's batches (the script's end-of-epoch code runs
    when its rank begins the next epoch, or when the run completes): every epoch's row holds e,
    in the summary, the console's order and the record stream, root and per rank."""
    logs = tmp_path / "logs"
    run, path = start(proc_env, tmp_path, mode=mode, extra=("--record-log-dir", str(logs), "--eval-every-epochs", "1"))
    summary = finished(run, path)
    assert [h["scalars"]["epoch_seen"] for h in summary["history"]] == list(range(EPOCHS))
    for log in (logs / "root.log", logs / "root" / "rank0.log", logs / "root" / "rank1.log"):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        epochs = [(r["epoch"], r["metrics"].get("epoch_seen")) for r in records if r.get("epoch_complete")]
        assert epochs == [(e, e) for e in range(EPOCHS)], (log, epochs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("declared", [":declared", ":explicit", ""])
def test_no_average_falls_inside_a_declared_accumulation(proc_env, tmp_path, declared):
    """Rank 0 steps its optimizer every 2 batches, rank 1 every 4, each checking that its weights
    are still those of its accumulation's first batch when the next one comes (no average between).
    Declared (prepare(accumulate_grad_batches=N), or run.step(loss, optimizer_stepped=...) batch by
    batch), Sync averages only between accumulations: no
    weights ever change inside one, every sample still trained once. Undeclared, Sync averages
    after every batch, and rank 0's steps reach rank 1 inside its accumulations."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"FLODL_TEST_ACCUM": f"2,4{declared}", "FLODL_TEST_OUT": str(out)}
    run, path = start(proc_env, tmp_path, mode="nccl-sync", env=env)
    summary = finished(run, path)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sum(r["steps"] for r in ranks) == EPOCHS * 512 // 16
    breaks = [r["accum_breaks"] for r in ranks]
    assert breaks == [0, 0] if declared else breaks[1] > 0, breaks
    # the declared N travel in the hellos: Sync plans a round per 4 batches (the longest), not one per batch
    rounds = 16 // 4 if declared == ":declared" else 16
    assert [h["syncs"] for h in summary["history"]] == [rounds] * EPOCHS


@pytest.mark.timeout(90)
def test_a_rank_killed_mid_epoch_costs_nothing(proc_env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {"FLODL_INJECT_FAULT": "1:batch:12", "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_TEST_OUT": str(out)}
    run, path = start(proc_env, tmp_path, env=env)
    summary = finished(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1] and "killed by SIGKILL" in summary["deaths"][0]["reason"]
    assert "continuing with 1 rank(s)" in run.output
    survivor = json.loads((out / "rank0.json").read_text())
    assert survivor["world_size"] == 1 and survivor["env"]["WORLD_SIZE"] == "2"  # run.world_size is live, WORLD_SIZE is not
    assert not (out / "rank1.json").exists()


@pytest.mark.timeout(120)
def test_a_dead_script_rank_is_restarted_as_a_new_rank_with_torchruns_variables(proc_env, tmp_path):
    """--max-restarts: rank 1 dies, its worker starts the script again as rank 2 in its place, which
    takes its donor's state: the script's optimizer's (momentum) and the objects it registered."""
    out, hold, probes = tmp_path / "out", tmp_path / "joined", tmp_path / "probes"
    out.mkdir()
    probes.mkdir()
    env = {
        "FLODL_INJECT_FAULT": "1:batch:12",
        "FLODL_TEST_HOLD_FILE": str(hold),
        "FLODL_TEST_OUT": str(out),
        "FLODL_TEST_STATE": "1",
        "FLODL_PROBE_DIR": str(probes),
    }
    run, path = start(proc_env, tmp_path, env=env, extra=("--max-restarts", "1"), epochs=6)
    run.wait_for_line("training with 2 rank(s)", timeout=90)
    hold.touch()
    assert run.wait(60) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * 6
    assert [(r["rank"], r["replaces"]) for r in summary["restarts"]] == [(2, 1)]
    assert len(set(summary["final_digests"].values())) == 1 and set(summary["final_digests"]) == {"0", "2"}
    # a new number, the place of the rank it replaces; WORLD_SIZE counts the ranks numbered so far
    env = json.loads((out / "rank2.json").read_text())["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "3", "1", "2")
    sent, taken = observed(probes, "handoff.sent")[0][0], observed(probes, "handoff.taken")[2][0]
    assert_same_state(taken, sent)
    assert sent["state.0.momentum_buffer"].abs().sum() > 0
    script = train_state(taken)["script"]  # run.register_state's objects, as the donor's were
    assert script == train_state(sent)["script"] and script["counter"]["ends"] >= 1


@pytest.mark.timeout(90)
def test_a_script_stuck_in_its_own_code_is_declared_hung_and_fenced(proc_env, tmp_path):
    """Rank 1's loop blocks for good mid-epoch; its link thread keeps beating: the step deadline
    finds it, its worker kills it, rank 0 trains the rest."""
    # steps of 5 ms: at sub-ms steps, on a loaded machine rank 0 could train (nearly) everything
    # before rank 1 reached its 10th step, and nothing would hang
    env = {"FLODL_TEST_HANG_AT": "1:10", "FLODL_TEST_STEP_SLEEP": "0.005"}
    run, path = start(proc_env, tmp_path, env=env, extra=("--heartbeat-timeout-secs", "3"))
    tree = scripts(run)
    summary = finished(run, path)
    [death] = summary["deaths"]
    assert death["rank"] == 1 and "made no progress in a training step" in death["reason"], death
    assert_all_gone(tree)


@pytest.mark.timeout(120)
def test_a_death_past_max_failure_saves_and_the_script_resumes_the_rest(proc_env, tmp_path):
    """The survivor's loop ends with SystemExit once the bundle (the script's model and its
    optimizer) is written; the resumed scripts start at the saved epoch and train exactly the rest."""
    stem, out = tmp_path / "ck" / "run", tmp_path / "out"
    out.mkdir()
    env = {
        "FLODL_TEST_STEP_SLEEP": "0.005",
        "FLODL_INJECT_FAULT": "1:batch:40",
    }  # 16 batches a rank an epoch: epoch 3 (averages vary as windows grow)
    extra = ("--max-failure", "1", "--save-path", str(stem))
    run, path = start(proc_env, tmp_path, env=env, extra=extra, epochs=6)
    assert run.wait(60) == 6, run.output
    meta = read_meta(stem)
    assert meta["save_reason"] == "max_failure_exceeded" and meta["epoch"] >= 1
    first = json.loads(path.read_text())
    covered_open = sum(item["total"] - sum(z for _, z in item["uncovered"]) for item in meta["coverage"]["open"])
    run2, path2 = start(proc_env, tmp_path, env={"FLODL_TEST_OUT": str(out)}, extra=("--resume-from", str(stem)), epochs=6, name="s2.json")
    assert run2.wait(60) == 0, run2.output
    second = json.loads(path2.read_text())
    trained = sum(h["samples"] for h in first["history"]) + covered_open + sum(h["samples"] for h in second["history"])
    assert trained == 6 * 512  # every sample of every epoch once, across the two runs
    # every resumed rank starts at the bundle's first epoch with samples left, and sees every epoch after it
    cov = meta["coverage"]
    first = min((item["epoch"] for item in cov["open"] if item["uncovered"]), default=cov["next_epoch"])
    for r in (0, 1):
        assert json.loads((out / f"rank{r}.json").read_text())["epochs"] == list(range(first, 6)), cov


@pytest.mark.timeout(150)
def test_registered_state_is_saved_and_a_resumed_script_ends_as_a_straight_run(proc_env, tmp_path):
    """An LR scheduler and a counter, registered with run.register_state, stepped at every epoch's end:
    stopped in epoch 2 (rank 1 dies past --max-failure, rank 0 writes the bundle) and resumed,
    the scripts end with the LR and the count of a run never stopped (fresh ones would count
    only the resumed epochs and halve the restored LR again)."""
    straight_out, out = tmp_path / "straight", tmp_path / "out"
    straight_out.mkdir()
    out.mkdir()
    epochs, sync = 6, ("--mode", "nccl-sync")
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_STATE": "1", "FLODL_TEST_OUT": str(straight_out)}, extra=sync, epochs=epochs)
    assert run.wait(60) == 0, run.output
    straight = [json.loads((straight_out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(s["counter"], s["lr"]) for s in straight] == [(epochs, straight[0]["lr"])] * 2 and straight[0]["lr"] > 0

    stem = tmp_path / "ck" / "run"
    env = {"FLODL_TEST_STATE": "1", "FLODL_INJECT_FAULT": "1:average:40"}  # 16 batches a rank an epoch: epoch 2
    run1, _ = start(
        proc_env, tmp_path, env=env, extra=(*sync, "--max-failure", "1", "--save-path", str(stem)), epochs=epochs, name="s1.json"
    )
    assert run1.wait(60) == 6, run1.output
    meta = read_meta(stem)
    assert meta["save_reason"] == "max_failure_exceeded" and 1 <= meta["epoch"] < epochs
    env = {"FLODL_TEST_STATE": "1", "FLODL_TEST_OUT": str(out)}
    run2, _ = start(proc_env, tmp_path, env=env, extra=(*sync, "--resume-from", str(stem)), epochs=epochs, name="s2.json")
    assert run2.wait(60) == 0, run2.output
    resumed = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert resumed[0]["epochs"][0] <= meta["epoch"]  # the resumed loops began where the bundle stood
    assert [(r["counter"], r["lr"]) for r in resumed] == [(s["counter"], s["lr"]) for s in straight]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("env", "says"),
    [
        # the loop raises at its 5th step: the traceback reaches the controller, the run stops
        ({"FLODL_TEST_FAIL_AT": "5"}, ["failed during train: RuntimeError: injected failure at step 5", f'File "{SCRIPT}", line']),
        # misuse of the API: one clear error, the same way
        ({"FLODL_TEST_MISUSE": "step"}, ["run.step(loss) is called once per batch, inside `for batch in run.batches()`"]),
        # a loop that never steps: refused at its second batch, the traceback at that loop's line
        (
            {"FLODL_TEST_MISUSE": "skip"},
            ["call run.step(loss) for every batch before taking the next", "for _ in run.batches():  # never steps"],
        ),
    ],
)
def test_an_error_in_the_script_stops_the_run_as_a_task_error(proc_env, tmp_path, env, says):
    run, _ = start(proc_env, tmp_path, env=env)
    assert run.wait(45) == EXIT_TASK_ERROR, run.output
    for text in says:
        assert text in run.output


@pytest.mark.timeout(60)
def test_an_empty_dataset_is_the_users_error_exit_2_in_one_line(proc_env, tmp_path):
    """prepare() given no samples: the rank reports it as the user's error, not as the script
    raising (as a Task's empty dataset: tests/test_liveness.py)."""
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_EMPTY": "1"})
    assert run.wait(45) == EXIT_CONFIG, run.output
    assert run.output.count("run.prepare(..., dataset): the dataset is empty") == 1, run.output
    assert "Traceback" not in run.output and "--- traceback" not in run.output, run.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("early", "zygote"),
    [("missing", "on"), ("missing", "off"), ("argparse", "on")],  # off: the rank is exec'd, not forked
)
def test_a_script_that_fails_before_init_stops_the_run_as_the_users_error_told_once(proc_env, tmp_path, early, zygote):
    """A data file that is not there, an argument argparse requires: every rank fails before
    flodl.init(). Not two lost ranks: one traceback of the user's own frames, naming every rank, exit 2."""
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_EARLY": early, "FLODL_ZYGOTE": zygote})
    assert run.wait(45) == EXIT_CONFIG, run.output
    out = run.output
    assert "lost rank" not in out and "continuing with" not in out and not re.search(r"\(pid \d+\) exited with code", out), out
    assert "run stopped: the script failed before flodl.init() on every rank (0, 1): " in out, out
    if early == "missing":
        assert out.count("Traceback (most recent call last)") == 1, out
        [frames] = re.findall(r"Traceback \(most recent call last\):\n(.*?)\nFileNotFoundError: ", out, re.S)
        assert set(re.findall(r'File "([^"]+)"', frames)) == {SCRIPT}, frames  # no flodl frame (zygote, script_start), no runpy
        assert "no-such-data.csv" in out
    else:  # argparse said why, on each rank's stderr, as under torchrun; the run says the rest once
        assert "Traceback" not in out and "error: the following arguments are required: --data" in out, out
        assert "it exited with code 2 (its own message is above)" in out


@pytest.mark.timeout(60)
def test_a_script_that_fails_before_init_on_one_rank_names_it(proc_env, tmp_path):
    """Rank 1 alone fails before flodl.init(); rank 0 joins and waits: the run stops all the same
    (the same script fails on a rank's host: the user's to fix), naming rank 1, exit 2."""
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_EARLY": "1:missing"})
    assert run.wait(45) == EXIT_CONFIG, run.output
    assert re.search(r"run stopped: the script failed before flodl.init\(\) on rank 1 on host \S+: FileNotFoundError", run.output)
    assert "lost rank" not in run.output and run.output.count("Traceback (most recent call last)") == 1, run.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--task", "--script"])
def test_a_file_that_does_not_compile_is_refused_at_the_door(proc_env, tmp_path, flag):
    """Compiled by the controller, never run: Python's report of the syntax error (file, line,
    caret), exit 2, before any worker or rank starts."""
    bad = tmp_path / "train.py"
    bad.write_text("import torch\n\ndef task(:\n    return None\n")
    argv = [PY, "-m", "flodl.controller", flag, f"{bad}:task" if flag == "--task" else str(bad), "--nproc-per-node", "2"]
    t0 = time.monotonic()
    done = subprocess.run(argv, env=proc_env, cwd=ROOT, capture_output=True, text=True, timeout=50)
    took = time.monotonic() - t0
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    said = done.stderr
    assert f'File "{bad}", line 3\n    def task(:\n             ^\nSyntaxError: invalid syntax' in said, said
    assert "start-up" not in done.stdout + said and took < 20, (took, done.stdout)  # nothing started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-sync", "cpu-async"])
def test_a_torchrun_scripts_idioms_work(proc_env, tmp_path, mode):
    """The DDP tutorial's idioms: each epoch peeks at a batch (len(next(iter(loader))[0])) before
    its loop, and reads len(loader); a leftover init_process_group(). The peeked batch is the loop's
    first and is trained once; len() is DistributedSampler's share; torch.distributed has no
    default group (docs/script-mode.md says why), and init_process_group() says so."""
    out = tmp_path / "out"
    out.mkdir()
    run, path = start(proc_env, tmp_path, mode=mode, env={"FLODL_TEST_IDIOMS": "1", "FLODL_TEST_OUT": str(out)})
    finished(run, path)  # every sample of every epoch trained once
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sum(r["steps"] for r in ranks) == EPOCHS * 512 // 16  # a peeked batch is trained by the loop, once
    for record in ranks:
        idioms = record["idioms"]
        assert idioms["len"] == 16 and idioms["lens"] == [16] * len(record["epochs"])  # ceil(ceil(512 / 2) / 16)
        peeked = [n for n in idioms["peeked"] if n is not None]
        assert peeked and all(1 <= n <= 16 for n in peeked), idioms
        assert idioms["first_is_peeked"] == [True] * len(peeked), idioms
        seen = idioms["dist"]
        assert seen["initialized"] is False and seen["master"] == [None, None] and seen["sync_bn"] == [4, 2], seen
        assert seen["init_error"].startswith("RuntimeError: flodl: a --script does not call torch.distributed.init_process_group()")


@pytest.mark.timeout(60)
def test_a_script_that_never_calls_init_is_named(proc_env, tmp_path):
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_NO_INIT": "1"})
    assert run.wait(45) == EXIT_RANK_LOST, run.output
    assert "exited with code 0 before its hello (does the --script call flodl.init()?)" in run.output


@pytest.mark.timeout(60)
def test_a_killed_controller_takes_the_scripts_down(proc_env, tmp_path):
    run, _ = start(proc_env, tmp_path, env={"FLODL_TEST_STEP_SLEEP": "0.05"})
    tree = scripts(run)
    run.wait_for_line("epoch 1/")
    run.proc.kill()
    run.wait(10)
    assert_all_gone(tree, timeout=15)


def test_a_script_started_by_hand_says_how_to_start_it(proc_env):
    done = subprocess.run([PY, SCRIPT], env=proc_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.count("\n") == 1 and "start it with python -m flodl.controller --script" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--script", "no/such/train.py"], "script: 'no/such/train.py' is not a file"),
        (["--script", SCRIPT, "--task", "tests/tasks/tiny.py:task"], "give --task or --script, not both"),
        (["--task", "tests/tasks/tiny.py:task", "--", "--lr", "1"], "arguments after -- go to a --script"),
        (["--script", SCRIPT, "--epochs", "2", "--", "--epochs=3"], "flodl's --epochs 2 and the script's --epochs 3 (after --) differ"),
    ],
)
def test_bad_script_options_fail_fast(proc_env, args, says):
    done = subprocess.run([PY, "-m", "flodl.controller", *args], env=proc_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG and says in done.stderr and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.timeout(90)
def test_the_scripts_own_epochs_are_the_runs_given_once(proc_env, tmp_path):
    """``-- --epochs 3`` alone: the run trains the script's 3 epochs (flodl's default is 1), and
    ``run.num_epochs`` says 3 to a script that takes no --epochs of its own."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["--script", str(TASKS / "epochs_script.py"), "--nproc-per-node", "2", "--no-progress", "--", "--epochs", "3"]
    run = Run(args, {**proc_env, "FLODL_TEST_OUT": str(out)})
    assert run.wait(75) == 0, run.output
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert (record["seen"], record["epochs"], record["num_epochs"]) == ([0, 1, 2], 3, 3)


@pytest.mark.parametrize(
    ("args", "epochs"),
    [
        (["--epochs", "4"], 4),
        (["--lr", "1", "--epochs=5"], 5),
        (["--epochs", "2", "--epochs", "6"], 6),  # the last one, as argparse keeps it
        (["--epochs", "x"], None),  # not a number: the script's own business
        (["--", "--epochs", "4"], None),  # past the script's own --
        (["--num-epochs", "4"], None),
    ],
)
def test_the_scripts_epochs_are_read_as_argparse_reads_them(args, epochs):
    assert scriptspec.script_epochs(args) == epochs
    assert scriptspec.one_epochs(None, args) == epochs  # flodl's unsaid: the script's
    assert scriptspec.one_epochs(epochs, args) == epochs  # the same number twice: fine


def test_the_script_and_its_args_travel_in_the_task_field():
    spec = scriptspec.encode("train.py", ["--lr", "0.1", "a b"])
    assert scriptspec.decode(spec) == ["train.py", "--lr", "0.1", "a b"]
    assert scriptspec.decode("examples/digits.py:task") is None
    argv, env = scriptspec.rank_command(spec, rank=3, world_size=2, local_rank=1, local_world=2)
    assert argv[1:] == ["-m", "flodl.rank.script_start", "train.py", "--lr", "0.1", "a b"]  # runs it as python train.py would
    # a restarted rank's number is new: WORLD_SIZE counts the ranks numbered so far
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert scriptspec.rank_command("m:f", rank=0, world_size=1, local_rank=0, local_world=1) == ([PY, "-m", "flodl.rank"], {})
    with pytest.raises(ValueError, match="malformed script spec"):
        scriptspec.decode("script:{not json")


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.AdamW(ps, lr=0.01)])
def test_an_optimizer_made_before_flattening_steps_the_flat_buffers(make):
    """prepare() takes the script's optimizer, made before flodl flattens the model: flattening
    rebinds each parameter's .data and keeps the Parameter objects, so its steps land in the
    buffers flodl averages."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = make(model.parameters())
    flat = FlatModel(model)
    before = flat.snapshot()[0]
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    after = flat.buckets[0].values
    assert not torch.equal(before, after)
    with torch.no_grad():  # and the model reads the buffers: an average written there is what it computes with
        flat.buckets[0].values.zero_()
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())


@pytest.mark.timeout(90)
def test_the_shipped_example_runs_as_documented(proc_env, tmp_path):
    pytest.importorskip("sklearn")
    path = tmp_path / "s.json"
    run = Run(["--script", "examples/script_mode.py", "--nproc-per-node", "2", "--epochs", "2", "--summary-json", str(path)], proc_env)
    assert run.wait(80) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [1500, 1500]
    # the last epoch's loop ends after the final average: both replicas score the consensus
    last = [float(a) for a in re.findall(r"rank \d: epoch 2 done, replica accuracy ([\d.]+)", run.output)]
    assert len(last) == 2 and last[0] == last[1] > 0.8, run.output
    assert "accuracy" in summary["history"][-1]["scalars"]  # run.report reached the epoch rows


def test_register_state_refuses_what_no_bundle_could_hold_and_restores_what_one_does():
    """ScriptState, without processes: refusals name the object; a resumed bundle's state loads
    into an object registered before or after it was read; the saved copy does not follow the object."""
    states = ScriptState()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(TypeError, match=r"register_state\('bad', obj\): obj needs state_dict\(\) and load_state_dict\(\)"):
        states.register("bad", object())
    with pytest.raises(TypeError, match=r"register_state\('tensor'\): its state_dict\(\) must be JSON"):
        states.register("tensor", torch.nn.Linear(1, 1))  # a module's state holds tensors
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    states.register("sched", sched)
    with pytest.raises(ValueError, match="registered already"):
        states.register("sched", sched)
    optimizer.step()
    sched.step()
    saved = states.saved()
    sched.step()
    assert saved["script"]["sched"]["last_epoch"] == 1  # a copy, taken at the save

    resumed = ScriptState()
    early = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=1, gamma=0.5)
    resumed.register("sched", early)
    resumed.resume({**saved, "script": {**saved["script"], "later": {"ends": 7}}})
    assert early.last_epoch == 1
    late = Counter()
    resumed.register("later", late)  # registered after the bundle was read: loaded at once
    assert late.ends == 7
    with pytest.raises(CheckpointError, match=r"register_state\('broken'\): the bundle's state does not load"):
        broken = ScriptState()
        broken.resume({"script": {"broken": {"nope": 1}}})
        broken.register("broken", Counter())


def test_an_epochs_row_waits_for_every_live_script_that_trained_in_it():
    """EpochEnds, without processes: values reported before the epoch closed and after it both
    reach its row (per rank and folded, weighted by batches); the row is complete once every live
    rank that trained in it ended it, a dead or idle rank not awaited."""
    ends = EpochEnds()
    early = m.EpochEnd(rank=0, epoch=1, scalars={"acc": [1.8, 2.0]})  # before the close: two reports, mean 0.9
    ends.note(early, None)
    reports = [
        EpochReport(rank, 1, batches, batches * 16, 0.0, 10.0, 0.0, 0.0, 0.0, 1, {}) for rank, batches in ((0, 30), (1, 10), (2, 0), (3, 5))
    ]
    stats = aggregate(1, reports)
    ends.close(stats)
    assert stats.scalars == {"acc": 0.9} and stats.per_rank[0].scalars == {"acc": [1.8, 2.0]}
    assert not ends.complete(stats, live={0, 1, 2})  # rank 1 trained in it and has not ended it
    ends.note(m.EpochEnd(rank=1, epoch=1, scalars={"acc": [0.5, 1.0]}), stats)  # after the close
    assert stats.scalars == {"acc": pytest.approx((0.9 * 30 + 0.5 * 10) / 40)}
    assert ends.complete(stats, live={0, 1, 2})  # rank 2 trained nothing of it; rank 3 is dead
    assert not ends.complete(stats, live={0, 1, 3})


def test_failures_before_init_wait_a_moment_for_the_other_ranks_and_are_told_once_each():
    """BeforeInit, without processes: the first report waits for the others (not once none may
    still come); each distinct traceback is printed once with the ranks it came from."""
    early = BeforeInit(grace_s=1.0)
    assert not early.due(5.0, waiting=False)  # nothing reported
    early.note(0, "OSError: no data", "Traceback: A\n", now=10.0)
    assert not early.due(10.5, waiting=True) and early.due(11.0, waiting=True) and early.due(10.1, waiting=False)
    early.note(2, "OSError: no data", "Traceback: A\n", now=10.2)
    early.note(1, "it exited with code 2 (its own message is above)", "", now=10.3)
    printed, message = early.told([0, 1, 2], lambda r: f"rank {r} on host h")
    assert printed == "--- the script before flodl.init(), on ranks 0, 2 ---\nTraceback: A\n"  # none for argparse's exit
    assert message == "the script failed before flodl.init() on ranks 0, 2: OSError: no data (and 1 other failure(s), above)"
    assert not early.due(20.0, waiting=False)  # told once: the run stops
    every = BeforeInit()
    for rank in (0, 1):
        every.note(rank, "E: x", "T\n", now=0.0)
    assert every.told([0, 1], str)[1] == "the script failed before flodl.init() on every rank (0, 1): E: x"
    one = BeforeInit()
    one.note(1, "E: x", "T\n", now=0.0)
    assert one.told([0, 1], lambda r: f"rank {r} on host h")[1] == "the script failed before flodl.init() on rank 1 on host h: E: x"
