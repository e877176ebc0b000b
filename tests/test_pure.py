"""Pure logic: membership verdicts, epoch slices, metric aggregation, console, devices."""

from __future__ import annotations

import io

import pytest
import torch

from flodl.controller.console import Console
from flodl.devices import choose_devices, parse_devices
from flodl.errors import ConfigError
from flodl.membership import Membership, PeerState, WorkerInfo, describe_exit
from flodl.metrics import aggregate
from flodl.metrics import EpochReport as EpochDone
from flodl.schedule import epoch_permutation, shuffle_signature, slice_indices

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------ membership


def _members(clock, timeout=5.0, ranks=2):
    mem = Membership(timeout)
    mem.add_worker(WorkerInfo("w", b"w", "h", 1, ["cpu"] * ranks), clock())
    for r in range(ranks):
        info = mem.expect_rank(r, "h", "cpu", clock())
        info.pid = 100 + r
        info.state = PeerState.READY
    return mem


def test_silence_past_timeout_is_death(clock):
    mem = _members(clock)
    clock.advance(4.9)
    mem.seen_rank(0, clock())
    assert mem.assess(clock()).healthy
    clock.advance(0.2)  # rank 1 now silent 5.1 s > 5 s
    verdict = mem.assess(clock())
    assert verdict.dead == (1,)
    assert "rank 1 on host h (pid 101) sent nothing for 5.1 s" in verdict.reason
    assert mem.generation == 1
    assert mem.assess(clock()).healthy  # judged once


def test_reported_exit_is_death_with_signal_name(clock):
    mem = _members(clock)
    mem.rank_exited(0, -9)
    verdict = mem.assess(clock())
    assert verdict.dead == (0,)
    assert "was killed by SIGKILL" in verdict.reason


def test_clean_exit_is_not_death(clock):
    mem = _members(clock)
    mem.rank_left(1)
    clock.advance(100)
    mem.seen_rank(0, clock())
    assert mem.assess(clock()).healthy


def test_silent_worker(clock):
    mem = _members(clock)
    clock.advance(6)
    assert [w.sender for w in mem.silent_workers(clock())] == ["w"]


def test_describe_exit():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-15) == "was killed by SIGTERM"
    assert describe_exit(-99) == "was killed by signal 99"


# -------------------------------------------------------------------- schedule


def test_permutation_is_seeded_and_differs_per_epoch():
    a, b = epoch_permutation(50, 42, 0), epoch_permutation(50, 42, 0)
    assert torch.equal(a, b)
    assert not torch.equal(a, epoch_permutation(50, 42, 1))
    assert sorted(a.tolist()) == list(range(50))
    assert torch.equal(slice_indices(50, 42, 0, 10, 5), a[10:15])
    with pytest.raises(ValueError):
        slice_indices(50, 42, 0, 48, 5)
    assert len(shuffle_signature()) == 16


# --------------------------------------------------------------------- metrics


def _done(rank, loss, batches, ms, samples, scalars):
    return EpochDone(rank, 0, batches, samples, loss * batches, ms, ms, 0.0, 0.0, batches, scalars)


def test_epoch_aggregation_golden():
    """The reference runtime's golden values (flodl-core §4.10)."""
    stats = aggregate(0, [
        _done(0, 0.5, 60, 1000.0, 1920, {"loss": [60.0, 60.0], "acc": [36.0, 60.0]}),
        _done(1, 0.7, 40, 1200.0, 1280, {"loss": [80.0, 40.0], "acc": [16.0, 40.0]}),
    ])
    assert stats.avg_loss == pytest.approx(0.58)
    assert stats.wall_ms == 1200.0
    assert stats.scalars["loss"] == pytest.approx(1.4)
    assert stats.scalars["acc"] == pytest.approx(0.52)
    assert stats.per_rank[0].throughput == pytest.approx(1920.0)
    assert stats.per_rank[1].throughput == pytest.approx(1066.6667, rel=1e-4)
    assert stats.batch_share == pytest.approx({0: 0.6, 1: 0.4})


def test_aggregation_sums_chunks_of_one_rank():
    stats = aggregate(0, [_done(0, 1.0, 2, 10.0, 20, {}), _done(0, 3.0, 2, 30.0, 20, {})])
    assert stats.per_rank[0].batches == 4 and stats.per_rank[0].wall_ms == 40.0
    assert stats.avg_loss == pytest.approx(2.0)


# --------------------------------------------------------------------- console


def test_console_plain_lines_are_throttled(clock):
    out = io.StringIO()
    con = Console(out=out, live=False, clock=clock)
    con.header(run_id="r", mode="NcclSync", task="t", ranks=["rank0 cpu@h"], dataset_len=100, batch_size=10, epochs=1)
    con.progress(epoch=0, epochs=1, done=10, total=100, rate=50.0, loss=1.0)
    clock.advance(5.1)
    con.progress(epoch=0, epochs=1, done=20, total=100, rate=50.0, loss=0.9)
    con.progress(epoch=0, epochs=1, done=30, total=100, rate=50.0, loss=0.9)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # 3 header lines + exactly one progress line
    assert "20/100" in lines[-1] and "\r" not in out.getvalue()


def test_console_live_line_is_rewritten(clock):
    out = io.StringIO()
    con = Console(out=out, live=True, clock=clock)
    clock.advance(1)
    con.progress(epoch=0, epochs=2, done=5, total=10, rate=5.0, loss=None)
    con.line("epoch 1/2 done")
    text = out.getvalue()
    assert text.startswith("\r\033[K") and "\r\033[Kepoch 1/2 done\n" in text


def test_console_progress_shows_each_ranks_rate_and_the_eta(clock):
    out = io.StringIO()
    con = Console(out=out, live=False, clock=clock)
    clock.advance(5.1)
    con.progress(epoch=1, epochs=3, done=40, total=100, rate=20.0, loss=0.5, ranks={0: 15.0, 1: 5.0})
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("epoch 2/3") and "40/100" in line and "eta    3 s" in line
    assert "[r0 15/s r1 5/s]" in line


# --------------------------------------------------------------------- devices


def test_devices():
    assert choose_devices(3, None, gpus=0) == ["cpu"] * 3
    assert choose_devices(None, None, gpus=0) == ["cpu"]
    assert choose_devices(None, None, gpus=2) == ["cuda:0", "cuda:1"]
    assert choose_devices(1, None, gpus=2) == ["cuda:0"]
    assert parse_devices("cuda:0, cpu,cpu") == ["cuda:0", "cpu", "cpu"]
    for bad in ("gpu0", "cuda:0,cuda:0", ""):
        with pytest.raises(ConfigError):
            parse_devices(bad)
    with pytest.raises(ConfigError, match="NCCL runs one rank per GPU"):
        choose_devices(3, None, gpus=2)
    with pytest.raises(ConfigError, match="disagrees"):
        choose_devices(2, "cpu", gpus=0)


def test_fault_plan_parses_and_names_bad_items():
    from flodl.faults import FaultPlan

    plan = FaultPlan.from_env(1, "1:average:5, 2:batch:3:stop,1:epoch:2:stop,1:regroup:1")
    assert plan.armed == {"average": (5, "kill"), "epoch": (2, "stop"), "regroup": (1, "kill")}
    assert FaultPlan.from_env(3, "1:average:5").armed == {}
    for bad in ("1:average", "x:batch:1", "1:nowhere:1", "1:batch:1:explode"):
        with pytest.raises(ValueError, match="FLODL_INJECT_FAULT"):
            FaultPlan.from_env(1, bad)
    plan.reach("average")  # 1st of 5: nothing happens
    assert plan.seen["average"] == 1 and "average" in plan.armed


def test_console_progress_summarises_many_ranks(clock):
    out = io.StringIO()
    con = Console(out=out, live=False, clock=clock)
    clock.advance(5.1)
    con.progress(epoch=0, epochs=1, done=10, total=100, rate=1.0, loss=None, ranks={r: float(r) for r in range(1000)})
    line = out.getvalue().splitlines()[-1]
    assert "[1000 ranks: slowest r0 0/s, median 500/s, fastest r999 999/s]" in line and len(line) < 200


def test_the_worker_starts_without_importing_torch():
    """A worker only spawns and watches ranks: torch's import (about a second, more on a
    loaded host) is paid by the ranks, and by the worker only when it relays snapshots."""
    import subprocess
    import sys

    probe = "import sys, flodl.worker, flodl; assert 'torch' not in sys.modules, 'torch imported'; print(flodl.DdpRunConfig().elche.mode)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=25)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "nccl-cadence"


@pytest.mark.timeout(60)
def test_the_controller_starts_without_importing_torch():
    """The controller reads and writes sidecars, grants ranges and watches peers: none of it
    needs torch, so its import (about a second) stays off every run's and every test's start.
    Checked in a fresh interpreter: other tests' imports would hide a regression here."""
    import subprocess
    import sys

    probe = ("import sys, flodl.controller, flodl.checkpoint_meta, flodl.schedule; "
             "assert 'torch' not in sys.modules, 'torch imported'; print(flodl.schedule.Schedule(10).epochs)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
