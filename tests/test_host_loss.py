"""A whole host lost mid-run, with real processes: two workers started by hand (one with two
ranks, one with one), then one of them is SIGKILLed, alone (its ranks must die with it) or with
every process of its host at once (a host powered off). The controller finds the host's ranks
by their silence, and the other host's ranks finish the run with every sample trained once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from .conftest import PY, ROOT, task_spec
from .helpers.history import epoch_samples
from .helpers.procs import PICK_PORT, Run, assert_all_gone, is_rank

pytestmark = pytest.mark.timeout(180)

EPOCHS = 8
DATASET = 512  # tiny.py's samples per epoch


def _rank_of(proc: psutil.Process) -> int | None:
    try:
        return int(proc.environ().get("FLODL_RANK", ""))
    except (psutil.Error, ValueError):
        return None


class TwoHosts:
    """A controller run with ``--workers 2`` and the two workers started for it, each in a
    session of its own like a process of another host. The suite's shared zygote server is
    left out: each worker forks its ranks from its own zygote, as on a real host."""

    def __init__(self, proc_env: dict, tmp_path, mode: str, extra: tuple[str, ...] = ()) -> None:
        self.env = {k: v for k, v in proc_env.items() if k != "FLODL_ZYGOTE_SERVER"}
        self.env |= {"FLODL_RUN_SECRET": os.urandom(32).hex(), "FLODL_RUN_ID": "host-loss", "FLODL_TEST_STEP_SLEEP": "0.03"}
        if mode.startswith("cpu-"):
            # each host relays its ranks' snapshots, as a host other than the controller's does, and
            # they span several slices: a relay may go halfway through a round. The model carries a
            # parameter of ones nothing trains, and the eval is its mean: it must end exactly 1
            self.env |= {"FLODL_BULK_RELAY": "always", "FLODL_TEST_BIG_MODEL": "1"}
        self.summary_path = tmp_path / "s.json"
        args = ["--task", task_spec("tiny.py"), "--workers", "2", *PICK_PORT, "--epochs", str(EPOCHS), "--mode", mode]
        args += ["--heartbeat-timeout-secs", "2", "--summary-json", str(self.summary_path), "--dashboard-port", "-1", *extra]
        self.run = Run(args, self.env)
        self.workers: list[subprocess.Popen] = []
        try:
            port = self.run.control_port()
            for devices in ("cpu,cpu", "cpu"):
                argv = [PY, "-m", "flodl.worker", "--controller", f"tcp://127.0.0.1:{port}", "--devices", devices]
                self.workers.append(
                    subprocess.Popen(
                        argv, env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
                    )
                )
        except BaseException:
            self.close()
            raise

    def host(self, ranks: int) -> tuple[subprocess.Popen, list[psutil.Process], list[int]]:
        """The worker carrying ``ranks`` ranks, every process below it, and its ranks' numbers."""
        for worker in self.workers:
            tree = psutil.Process(worker.pid).children(recursive=True)
            numbers = sorted(n for p in tree if is_rank(p) and (n := _rank_of(p)) is not None)
            if len(numbers) == ranks:
                return worker, tree, numbers
        raise AssertionError(f"no worker with {ranks} ranks running; output:\n{self.run.output}")

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)
        self.run.kill()


@pytest.mark.parametrize(
    ("mode", "ranks", "whole"),
    [
        ("nccl-cadence", 2, True),  # the host with two ranks powered off: one rank trains on alone
        ("cpu-async", 1, False),  # the other host's worker alone: its rank dies with it
        ("nccl-sync", 1, True),
        ("cpu-cadence", 2, False),
    ],
)
def test_a_lost_host_costs_only_its_ranks_and_the_other_host_finishes(proc_env, tmp_path, mode, ranks, whole):
    hosts = TwoHosts(proc_env, tmp_path, mode)
    try:
        hosts.run.wait_for_line(f"epoch 2/{EPOCHS}", timeout=120)
        victim, tree, lost = hosts.host(ranks)
        survivor = next(w for w in hosts.workers if w is not victim)
        for pid in [victim.pid] + ([p.pid for p in tree] if whole else []):
            os.kill(pid, signal.SIGKILL)
        victim.wait(10)
        assert_all_gone(tree, 10)  # its ranks (and zygote) never outlive their worker
        assert hosts.run.wait(150) == 0, hosts.run.output
        assert survivor.wait(30) == 0, survivor.stderr.read()
        summary = json.loads(hosts.summary_path.read_text())
    finally:
        hosts.close()
    assert epoch_samples(summary["history"]) == [DATASET] * EPOCHS
    assert sorted(d["rank"] for d in summary["deaths"]) == lost
    assert all("sent nothing" in d["reason"] for d in summary["deaths"]), summary["deaths"]  # a lost host says nothing
    assert summary["recoveries"]
    if mode.startswith("cpu-"):
        # the two-rank host relayed (a one-rank host has nothing to pre-average)
        assert summary["averaging"]["relays"] == 1 and summary["final_eval"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert summary["final_eval"] > 0.7


def test_a_run_stopped_by_a_lost_host_ends_without_waiting_for_that_host(proc_env, tmp_path):
    """The lost host's ranks reach ``--max-failure 1``: the run stops. Its worker is gone and says
    nothing, so teardown must not wait for its goodbye: the run ends within the heartbeat timeout
    and a few seconds (before 2026-12: the abort waited 10 s more for that worker, ~12.5 s)."""
    hosts = TwoHosts(proc_env, tmp_path, "cpu-cadence", ("--max-failure", "1"))
    try:
        hosts.run.wait_for_line(f"epoch 2/{EPOCHS}", timeout=120)
        victim, tree, _ = hosts.host(1)
        survivor = next(w for w in hosts.workers if w is not victim)
        lost_at = time.monotonic()
        for pid in [victim.pid] + [p.pid for p in tree]:  # the host powered off: nothing of it says goodbye
            os.kill(pid, signal.SIGKILL)
        code = hosts.run.wait(60)
        took = time.monotonic() - lost_at
        assert code == 3, hosts.run.output
        assert survivor.wait(30) == 0, survivor.stderr.read()
    finally:
        hosts.close()
    assert "reaches max_failure 1" in hosts.run.output, hosts.run.output
    # 2 s of heartbeat timeout to notice, then the survivor's goodbye: well under the 10 s it waited for the lost one
    assert took < 2 + 5, f"the run took {took:.1f} s to end after its host was lost; output:\n{hosts.run.output}"


class LocalAndJoiner:
    """The embedded default's local worker (ranks 0 and 1, CPU backend) and a second host's worker
    that joins it once training began (rank 2); steps held slow (``hold_sleep``) until released."""

    def __init__(self, proc_env: dict, tmp_path, epochs: int, hold_sleep: str) -> None:
        self.hold = tmp_path / "released"
        self.epochs, self.path = epochs, tmp_path / "s.json"
        env = {**proc_env, "FLODL_RUN_SECRET": os.urandom(32).hex(), "FLODL_RUN_ID": "local-lost", "FLODL_TEST_STEP_SLEEP": "0.01"}
        env |= {"FLODL_TEST_HOLD_FILE": str(self.hold), "FLODL_TEST_HOLD_SLEEP": hold_sleep}
        args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", *PICK_PORT, "--epochs", str(epochs), "--mode", "cpu-cadence"]
        self.run = Run([*args, "--heartbeat-timeout-secs", "3", "--summary-json", str(self.path), "--dashboard-port", "-1"], env)
        self.remote: subprocess.Popen | None = None
        try:
            port = self.run.control_port()
            self.run.wait_for_line("first batch trained", timeout=120)  # the local worker's ranks are the run's first
            argv = [PY, "-m", "flodl.worker", "--controller", f"tcp://127.0.0.1:{port}", "--devices", "cpu"]
            self.remote = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            self.run.wait_for_line("training with 3 rank(s)", timeout=120)
        except BaseException:
            self.close()
            raise

    def lose_local_worker(self) -> None:
        [local] = [p for p in self.run.tree() if "flodl.worker" in " ".join(p.cmdline())]
        local.kill()
        self.hold.touch()

    def close(self) -> None:
        if self.remote is not None and self.remote.poll() is None:
            os.killpg(self.remote.pid, signal.SIGKILL)
            self.remote.wait(10)
        self.run.kill()


def test_the_controllers_own_worker_lost_leaves_the_other_hosts_rank_training(proc_env, tmp_path):
    """The embedded default's local worker (ranks 0 and 1) is SIGKILLed once a second host's worker
    has joined. On the CPU backend the run's store and averaging are the controller's own, so
    nothing needs that worker: its ranks die with it and the other host's rank finishes the run.
    (A collective run started here keeps its store in that worker's zygote, and still stops.)"""
    hosts = LocalAndJoiner(proc_env, tmp_path, epochs=20, hold_sleep="0.1")
    try:
        # the joiner holds the run's parameters only once its first round has come back (it
        # trains nothing until then): two epochs on
        seen = max([int(m.group(1)) for m in re.finditer(r"epoch (\d+)/", hosts.run.output)] or [0])
        hosts.run.wait_for_line(f"epoch {seen + 2}/{hosts.epochs}", timeout=120)
        hosts.lose_local_worker()
        assert hosts.run.wait(150) == 0, hosts.run.output
        assert hosts.remote is not None and hosts.remote.wait(30) == 0, hosts.remote.stderr
    finally:
        hosts.close()
    summary = json.loads(hosts.path.read_text())
    assert epoch_samples(summary["history"]) == [DATASET] * hosts.epochs
    assert sorted(d["rank"] for d in summary["deaths"]) == [0, 1], summary["deaths"]
    assert all("went with its worker" in d["reason"] for d in summary["deaths"]), summary["deaths"]
    assert summary["final_eval"] > 0.7


def test_a_joiner_left_alone_before_it_took_the_parameters_stops_the_run(proc_env, tmp_path):
    """The same, but the local worker goes the moment the joiner is in: the joiner trains nothing
    in its first window (held long here) and takes the run's parameters from that window's
    average, so no rank left holds them. The run stops and says so (it hung: the joiner waited
    for an average from a world of one), instead of training on from the task's initial weights."""
    hosts = LocalAndJoiner(proc_env, tmp_path, epochs=EPOCHS, hold_sleep="0.5")
    try:
        hosts.lose_local_worker()
        assert hosts.run.wait(60) == 3, hosts.run.output
        assert "No rank left holds the run's parameters: rank(s) 2 joined" in hosts.run.output
        assert hosts.remote is not None
        hosts.remote.wait(30)  # the other host's worker is told the run is over, and goes (else: TimeoutExpired)
    finally:
        hosts.close()
