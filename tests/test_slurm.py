"""``launch/slurm.sbatch`` on a real Slurm: munged, slurmctld and slurmd started by the test.

One node (this host), a job of two tasks on it: the recipe puts the controller on the first
node and one worker per task. The run completes; ``scancel`` mid-run leaves no flodl process;
a worker killed mid-run shrinks the run to the survivor, which finishes. Needs root and the
Debian packages slurmctld, slurmd, slurm-client and munge (CI installs them); skips, saying
why, without them.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest

from .conftest import PY, ROOT, process_env, task_spec
from .helpers.history import epoch_samples
from .helpers.hosts import wait_until
from .helpers.procs import reserved_port
from .slurm import SlurmCluster, Unavailable, missing

pytestmark = [pytest.mark.timeout(90), pytest.mark.skipif(missing() is not None, reason=str(missing()))]

RECIPE = ROOT / "launch" / "slurm.sbatch"


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    try:
        cluster.start()
    except Unavailable as e:
        cluster.stop()
        pytest.skip(str(e))
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, tmp_path: Path, *, epochs: int, hold: Path | None = None, flodl_args: str = "") -> int:
    """The recipe as a CPU-only job of two tasks on the one node; the job id."""
    env = process_env() | {
        "TASK": task_spec("tiny.py"),
        "EPOCHS": str(epochs),
        "PORT": str(reserved_port()),
        "PYTHON": PY,
        "FLODL_ARGS": flodl_args,
    }
    env.pop("FLODL_ZYGOTE_SERVER", None)  # a job's processes are Slurm's: each worker its own zygote, as on a cluster
    if hold is not None:  # steps sleep 0.2 s until the file exists: the run outlasts what the test does
        env |= {"FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.2"}
    # --gpus-per-node=0 overrides the recipe's GPU request: this node has no GRES
    args = ["--gpus-per-node=0", "--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/job-%j.out"]
    return slurm.sbatch(RECIPE, *args, env=env, cwd=tmp_path)


def job_procs(job: int) -> list[psutil.Process]:
    """Live flodl processes (controller, workers, ranks) of this job, found by its run id."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "flodl" not in " ".join(p.cmdline()):
                continue
            if p.environ().get("FLODL_RUN_ID") == f"slurm-{job}":
                found.append(p)
        except psutil.Error:
            pass
    return found


def role(p: psutil.Process) -> str:
    """``flodl.controller`` / ``flodl.worker`` / ``flodl.rank`` for ``python -m`` that; ``srun`` etc. otherwise."""
    cmd = p.cmdline()
    return cmd[2] if cmd[1:2] == ["-m"] and cmd[2].startswith("flodl.") else Path(cmd[0]).name


def output(tmp_path: Path, job: int) -> str:
    path = tmp_path / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def summary(tmp_path: Path, job: int) -> dict:
    return json.loads((tmp_path / f"flodl-{job}.summary.json").read_text())


def ranks_running(job: int, n: int):
    return lambda: sum(role(p) == "flodl.rank" for p in job_procs(job)) == n


def test_the_recipe_trains_with_a_worker_per_task(slurm, tmp_path):
    job = submit(slurm, tmp_path, epochs=2)
    info = slurm.wait_job(job, 60)
    out = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
    assert f"controller on {slurm.node} " in out and "2 worker(s)" in out, out
    assert "flodl: controller exited with code 0" in out, out
    s = summary(tmp_path, job)
    assert s["exit_reason"] == "completed" and s["world_size"] == 2 and s["epochs_completed"] == 2
    assert s["deaths"] == [] and s["joins"] == []  # both workers there from the start: none joined late
    assert epoch_samples(s["history"]) == [512, 512]
    assert {r["host"] for r in s["per_rank"]} == {slurm.node}
    assert job_procs(job) == []


def test_scancel_mid_run_leaves_no_flodl_process(slurm, tmp_path):
    job = submit(slurm, tmp_path, epochs=50, hold=tmp_path / "never")
    try:
        wait_until(ranks_running(job, 2), 45, "two ranks")
        roles = sorted(r for r in map(role, job_procs(job)) if r.startswith("flodl."))
        # each worker forks its ranks from a zygote (docs/architecture.md), which may also have
        # declined and exited: at most one per worker, and scancel must take them too
        assert roles.count("flodl.rank.zygote") <= 2, roles
        expected = ["flodl.controller", "flodl.rank", "flodl.rank", "flodl.worker", "flodl.worker"]
        assert [r for r in roles if r != "flodl.rank.zygote"] == expected, roles
        slurm.scancel(job)
        info = slurm.wait_job(job, 30)
        assert info["JobState"] == "CANCELLED", info
        wait_until(lambda: job_procs(job) == [], 15, "the job's flodl processes to exit")
    finally:
        for p in job_procs(job):
            p.kill()


def test_a_killed_task_shrinks_the_run(slurm, tmp_path):
    hold = tmp_path / "hold"
    # a SIGKILLed worker says nothing: its rank (stopped by it) is found dead by its silence
    job = submit(slurm, tmp_path, epochs=3, hold=hold, flodl_args="--heartbeat-timeout-secs 4")
    try:
        # training has begun (the banner lists the ranks): a death now is the elastic run's business
        wait_until(lambda: f"flodl run slurm-{job}" in output(tmp_path, job), 60, "the run to start")
        assert "2 rank(s)" in output(tmp_path, job), output(tmp_path, job)
        workers = sorted((p for p in job_procs(job) if role(p) == "flodl.worker"), key=lambda p: p.pid)
        assert len(workers) == 2
        victim = workers[1]
        victim_ranks = [c for c in victim.children(recursive=True) if role(c) == "flodl.rank"]
        assert len(victim_ranks) == 1
        victim.send_signal(signal.SIGKILL)
        # its rank follows it (PDEATHSIG); the run, still held, goes on without them
        wait_until(lambda: "continuing with 1 rank(s)" in output(tmp_path, job), 30, "the run to shrink")
        hold.touch()
        info = slurm.wait_job(job, 60)
        out = output(tmp_path, job)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
        s = summary(tmp_path, job)
        assert s["exit_reason"] == "completed" and s["epochs_completed"] == 3, out
        assert [d["pid"] for d in s["deaths"]] == [victim_ranks[0].pid], (s["deaths"], out)
        assert sum(h["samples"] for h in s["history"]) == 3 * 512  # the survivor took the dead rank's samples
        assert job_procs(job) == []
    finally:
        for p in job_procs(job):
            p.kill()
