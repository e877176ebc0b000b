"""Growing with real processes: a worker started after training began joins and trains."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from flodl.averaging.server import CpuAveraging
from flodl.config import DdpRunConfig
from flodl.plan.cadence import CadenceLoop

from .conftest import PY, ROOT, task_spec
from .helpers.history import epoch_samples
from .helpers.observed import assert_same_state, observed
from .helpers.procs import PICK_PORT, Run
from .helpers.windows import fold_window

pytestmark = pytest.mark.timeout(180)

EPOCHS = 20  # cheap once released; held, they are the joiner's time to arrive


# ------------------------------------------------------------------ pure parts


def test_a_joiner_is_planned_from_the_next_window_with_an_anchor_share():
    loop = CadenceLoop(DdpRunConfig().with_mode("nccl-async"), [0, 1], dataset_len=4000, batch_size=10, epochs=10, seed=1)
    for _ in range(3):  # probe, then timed windows: rank 1 is 3x slower
        number = loop.window
        assert loop.next_windows(now=float(number)) is not None
        fold_window(loop, number, {0: 1.0, 1: 3.0})
    anchor, counts = loop.elche.anchor, list(loop.elche.batch_counts)
    loop.add_ranks([2])
    assert loop.ranks == [0, 1, 2]
    assert loop.elche.world_size == 3 and loop.elche.anchor == anchor
    assert loop.elche.batch_counts[:2] == counts  # the survivors keep their measured shares
    assert loop.elche.ms_per_batch[2] == 0.0 and loop.elche.batch_counts[2] == min(counts)  # untimed: the anchor's share
    number = loop.window
    windows = loop.next_windows(now=10.0)
    assert set(windows) == {0, 1, 2} and windows[2].grants
    fold_window(loop, number, {0: 1.0, 1: 3.0, 2: 1.5})
    assert loop.elche.ms_per_batch[2] > 0  # timed by its first window


def test_growing_refuses_reused_numbers_and_fixed_ratios():
    loop = CadenceLoop(DdpRunConfig().with_mode("nccl-cadence"), [0, 3], dataset_len=400, batch_size=10, epochs=1, seed=1)
    with pytest.raises(ValueError, match="numbered above"):
        loop.add_ranks([2])
    fixed = CadenceLoop(
        DdpRunConfig().with_mode("nccl-cadence").with_partition_ratios([1.0, 2.0]), [0, 1], dataset_len=400, batch_size=10, epochs=1, seed=1
    )
    with pytest.raises(ValueError, match="partition_ratios"):
        fixed.add_ranks([2])


def test_round_numbers_follow_the_windows_rounds():
    loop = CadenceLoop(DdpRunConfig().with_mode("cpu-sync"), [0, 1], dataset_len=400, batch_size=10, epochs=1, seed=1)
    assert loop.round_base == 1  # round 0 is the start-of-run broadcast
    windows = loop.next_windows(now=0.0)
    assert loop.round_base == 1 + windows[0].rounds


def test_cpu_rounds_expect_a_joiner_only_from_its_first_round():
    actor = CpuAveraging(secret=b"k" * 32, run_id="r", bind="127.0.0.1", timeout_s=5.0)
    try:
        actor.admit(b"rank0.a", 0)
        actor.admit(b"rank1.b", 1)
        actor.admit(b"rank2.c", 2, from_round=7)
        assert actor.expected(6) == {0, 1}
        assert actor.expected(7) == {0, 1, 2}
        actor.live = lambda: {0, 2}  # rank 1 died
        assert actor.expected(9) == {0, 2}
    finally:
        actor.close()


# -------------------------------------------------------------- real processes


class Cluster:
    """A controller waiting for one external worker, plus the workers started for it."""

    def __init__(self, proc_env, tmp_path, mode: str, extra=(), task: str = task_spec("tiny.py")) -> None:
        # slow steps until the test releases the run (``release_after``): however long the late
        # worker takes to start on a loaded machine, the run cannot end before it has been seen
        # (held, an epoch of 2 ranks lasts about 2 s: the 19 after the first give a joiner over 30 s,
        # 5x what one takes to start and join here under load). Released, the steps are short: what
        # is asserted is coverage, membership and consensus, not speed.
        self.hold = tmp_path / "released"
        self.env = {
            **proc_env,
            "FLODL_RUN_SECRET": os.urandom(32).hex(),
            "FLODL_RUN_ID": "grow-run",
            "FLODL_TEST_STEP_SLEEP": "0.01",
            "FLODL_TEST_HOLD_FILE": str(self.hold),
            "FLODL_TEST_HOLD_SLEEP": "0.12",
        }
        self.summary_path = tmp_path / "s.json"
        self.run = Run(
            [
                "--task",
                task,
                "--workers",
                "1",
                *PICK_PORT,
                "--epochs",
                str(EPOCHS),
                "--mode",
                mode,
                "--heartbeat-timeout-secs",
                "5",
                "--summary-json",
                str(self.summary_path),
                *extra,
            ],
            self.env,
        )
        self.workers: list[subprocess.Popen] = []

    def worker(self, *devices: str) -> subprocess.Popen:
        port = self.run.control_port()
        proc = subprocess.Popen(
            [PY, "-m", "flodl.worker", "--controller", f"tcp://127.0.0.1:{port}", "--devices", ",".join(devices)],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers.append(proc)
        return proc

    def release_after(self, needle: str) -> None:
        """Once the controller printed ``needle``, let the ranks train at full speed."""
        self.run.wait_for_line(needle, timeout=120)
        self.hold.touch()

    def finish(self) -> dict:
        try:
            assert self.run.wait(150) == 0, self.run.output
            for proc in self.workers:
                assert proc.wait(30) == 0, proc.stderr.read()
            return json.loads(self.summary_path.read_text())
        finally:
            for proc in self.workers:
                if proc.poll() is None:
                    proc.kill()


def grown(proc_env, tmp_path, mode: str, env: dict, fault: str, extra: list[str]) -> dict:
    """A run of one worker that a second worker joins after the first epoch (``fault``: injected
    into the run's ranks; ``extra``: run options): its summary, once every sample was trained
    exactly once and every joined rank trained and averaged."""
    cluster = Cluster(proc_env | env | ({"FLODL_INJECT_FAULT": fault} if fault else {}), tmp_path, mode, extra=extra)
    cluster.worker("cpu", "cpu")
    cluster.run.wait_for_line(f"epoch 1/{EPOCHS}", timeout=90)
    cluster.worker("cpu", "cpu") if mode.startswith("cpu") else cluster.worker("cpu")
    cluster.release_after(f"training with {4 if mode.startswith('cpu') else 3} rank(s)")
    summary = cluster.finish()
    assert epoch_samples(summary["history"]) == [512] * EPOCHS
    per_rank = {row["rank"]: row for row in summary["per_rank"]}
    assert all(per_rank[r]["samples"] > 0 and per_rank[r]["sync_averages"] > 0 for r in summary["joins"][0]["ranks"])
    return summary


def test_relayed_hosts_train_and_a_relayed_joiner_takes_the_consensus(proc_env, tmp_path):
    """cpu-cadence with host relays (forced on this one machine): a 2-rank worker pre-averages
    its ranks; a second 2-rank worker joins mid-run through its own relay."""
    cluster = Cluster(proc_env | {"FLODL_BULK_RELAY": "always"}, tmp_path, "cpu-cadence")
    cluster.worker("cpu", "cpu")
    cluster.run.wait_for_line(f"epoch 1/{EPOCHS}", timeout=90)
    cluster.worker("cpu", "cpu")
    cluster.release_after("training with 4 rank(s)")
    summary = cluster.finish()
    assert epoch_samples(summary["history"]) == [512] * EPOCHS
    assert [j["ranks"] for j in summary["joins"]] == [[2, 3]]
    per_rank = {row["rank"]: row for row in summary["per_rank"]}
    assert per_rank[2]["samples"] > 0 and per_rank[3]["samples"] > 0
    avg = summary["averaging"]
    assert avg["relays"] == 2 and avg["aborted"] == 0 and avg["rounds"] >= summary["syncs"]
    assert summary["deaths"] == []


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_a_late_worker_joins_and_trains(proc_env, tmp_path, mode):
    """Two ranks start; a third host's worker arrives in epoch 2, is admitted at a
    window boundary with the consensus parameters and its donor's optimizer state (SGD's
    momentum, bit for bit: the collective backend's group, the CPU backend's bulk plane),
    gets an ElChe share, and trains."""
    probes = tmp_path / "probes"
    probes.mkdir()
    cluster = Cluster(proc_env | {"FLODL_TEST_OPTIMIZER": "momentum", "FLODL_PROBE_DIR": str(probes)}, tmp_path, mode)
    cluster.worker("cpu", "cpu")
    cluster.run.wait_for_line(f"epoch 1/{EPOCHS}", timeout=90)
    cluster.worker("cpu")
    cluster.release_after("training with 3 rank(s)")
    summary = cluster.finish()
    out = cluster.run.output
    assert "worker on host" in out and "joins: starting rank(s) [2]" in out
    assert epoch_samples(summary["history"]) == [512] * EPOCHS  # coverage exact through the change
    assert [j["ranks"] for j in summary["joins"]] == [[2]]
    assert summary["joins"][0]["world"] == 3
    per_rank = {row["rank"]: row for row in summary["per_rank"]}
    assert per_rank[2]["samples"] > 0  # the joiner got a share and trained it
    assert summary["deaths"] == []
    digests = summary["final_digests"]
    assert set(digests) == {"0", "1", "2"}
    if not mode.startswith("cpu-"):
        assert len(set(digests.values())) == 1  # one consensus, the joiner's included
    assert summary["final_eval"] > 0.7
    sent, taken = observed(probes, "handoff.sent"), observed(probes, "handoff.taken")
    assert set(sent) == {0} and set(taken) == {2}
    assert_same_state(taken[2][0], sent[0][0])
    assert sent[0][0]["state.0.momentum_buffer"].abs().sum() > 0


def test_a_member_lost_while_a_joiner_is_admitted_leaves_the_joiner_training(proc_env, tmp_path):
    """Rank 1 dies after every member gathered for the grown group, before it connected: the
    consensus broadcast never happens. The joiner takes the consensus from its first average
    instead (it adds nothing to it) and trains from the window after."""
    cluster = Cluster(proc_env | {"FLODL_INJECT_FAULT": "1:regroup:1"}, tmp_path, "nccl-cadence")
    cluster.worker("cpu", "cpu")
    cluster.run.wait_for_line(f"epoch 1/{EPOCHS}", timeout=90)
    cluster.worker("cpu")
    cluster.release_after("training with 3 rank(s)")
    summary = cluster.finish()
    assert epoch_samples(summary["history"]) == [512] * EPOCHS
    assert [j["ranks"] for j in summary["joins"]] == [[2]]
    assert [d["rank"] for d in summary["deaths"]] == [1]
    per_rank = {row["rank"]: row for row in summary["per_rank"]}
    assert per_rank[2]["samples"] > 0
    digests = summary["final_digests"]
    assert set(digests) == {"0", "2"} and digests["0"] == digests["2"]
    assert summary["final_eval"] > 0.7


def test_a_late_worker_with_another_model_is_refused_and_the_run_goes_on(proc_env, tmp_path):
    """A joiner whose model differs is turned away; the run neither stops nor counts it as lost."""
    spec = tmp_path / "mixed.py"
    spec.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests' / 'tasks')!r})\n"
        "import tiny\n"
        "def task():\n"
        "    return tiny.other_model_task() if os.environ['FLODL_RANK'] == '2' else tiny.task()\n"
    )
    cluster = Cluster(proc_env, tmp_path, "nccl-cadence", task=f"{spec}:task")
    cluster.worker("cpu", "cpu")
    cluster.run.wait_for_line(f"epoch 1/{EPOCHS}", timeout=90)
    cluster.worker("cpu")
    cluster.release_after("could not join the run")
    summary = cluster.finish()
    assert "could not join the run: its model signature" in cluster.run.output
    assert summary["joins"] == [] and summary["deaths"] == []
    assert epoch_samples(summary["history"]) == [512] * EPOCHS


# ------------------------------------------------------------------ loopback


async def test_a_joiners_second_rank_ready_before_its_first_waits_for_it(quiet_console):
    """A late worker's ranks join in rank order: its second rank, ready first, is admitted with its
    first (once that one is ready), never ahead of it (the plans only grow at the end)."""
    import asyncio

    from flodl.controller import Controller, LaunchOptions, Phase
    from flodl.testing.sim import SimRankSpec, SimWorker

    secret, run_id = b"g" * 32, "grow-order"
    launch = LaunchOptions(task="sim:task", epochs=8, workers=1, progress=False, join_timeout_secs=20.0)
    ctl = Controller(launch, DdpRunConfig().with_mode("nccl-cadence"), secret=secret, run_id=run_id, console=quiet_console)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    addr = f"tcp://127.0.0.1:{ctl.port}"
    first = asyncio.create_task(SimWorker(addr, secret, run_id, [SimRankSpec(batch_ms=5)], host="a").run())
    try:
        async with asyncio.timeout(30):
            while ctl.phase is not Phase.TRAINING:
                await asyncio.sleep(0.01)
        late = SimWorker(addr, secret, run_id, [SimRankSpec(batch_ms=5, hello_delay_s=1.0), SimRankSpec(batch_ms=5)], host="late")
        await asyncio.wait_for(late.run(), 60)
        summary = await asyncio.wait_for(run, 60)
        await first
    finally:
        run.cancel()
        first.cancel()
    assert summary["exit_reason"] == "completed"
    assert [j["ranks"] for j in summary["joins"]] == [[1, 2]]
    assert late.outcomes == {1: "completed", 2: "completed"}
