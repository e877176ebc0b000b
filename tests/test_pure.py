"""Pure logic: membership verdicts, epoch slices, metric aggregation, console, devices."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

from flodl.controller.console import Console
from flodl.errors import ConfigError
from flodl.host.devices import choose_devices, parse_devices
from flodl.plan.membership import Membership, PeerState, WorkerInfo, describe_exit
from flodl.plan.metrics import EpochReport as EpochDone
from flodl.plan.metrics import aggregate
from flodl.plan.progress import ProgressLimits
from flodl.plan.schedule import epoch_permutation, shuffle_signature, slice_indices

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------ membership


def _members(clock, timeout=5.0, ranks=2):
    mem = Membership(timeout)
    worker = WorkerInfo("w", b"w", "h", 1, ["cpu"] * ranks)
    mem.add_worker(worker, clock())
    for r in mem.assign_ranks(worker, 0, clock()):
        mem.ranks[r].pid = 100 + r
        mem.rank_ready(r)
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
    mem.apply(verdict)
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


def _snapshot(mem):
    """Everything a verdict could change, copied."""
    return copy.deepcopy((mem.ranks, mem.workers, mem.by_identity, mem.by_sender, mem.generation))


def test_a_verdict_changes_nothing(clock):
    mem = _members(clock, ranks=3)
    mem.rank_exited(0, -9)  # reported dead
    mem.heard_progress(mem.ranks[1], "step", 200.0, 100.0, 0, now=clock())  # stuck in a step
    clock.advance(6)  # rank 2 and the worker silent past the timeout
    before = _snapshot(mem)
    limits = ProgressLimits(heartbeat_timeout_s=5.0, first_step_s=60.0, eval_s=60.0)
    verdict = mem.assess(clock(), limits)
    assert verdict.dead == (0, 1, 2)
    assert mem.assess(clock(), limits) == verdict  # asked again: the same answer
    assert _snapshot(mem) == before  # nobody marked dead, no generation bumped


def test_apply_marks_the_dead_and_bumps_the_generation_once_per_change(clock):
    mem = _members(clock, ranks=3)
    mem.rank_exited(0, 1)
    clock.advance(6)
    mem.seen_rank(2, clock())  # ranks 0 (exit) and 1 (silence) die together
    verdict = mem.assess(clock())
    mem.apply(verdict)
    assert [mem.ranks[r].state for r in range(3)] == [PeerState.DEAD, PeerState.DEAD, PeerState.READY]
    assert mem.ranks[0].death == "exited with code 1"
    assert mem.ranks[1].death.startswith("sent nothing for 6.0 s")
    assert mem.generation == 1  # two deaths, one change of the world
    mem.apply(verdict)  # applied again: nothing left to change
    assert mem.generation == 1
    mem.rank_exited(2, -15)
    mem.apply(mem.assess(clock()))
    assert mem.ranks[2].state is PeerState.DEAD and mem.generation == 2


def test_a_verdict_overtaken_by_a_goodbye_changes_nothing(clock):
    mem = _members(clock)
    clock.advance(6)
    mem.seen_rank(0, clock())
    verdict = mem.assess(clock())
    assert verdict.dead == (1,)
    mem.rank_left(1, code=0)  # it said goodbye before the verdict was applied
    mem.apply(verdict)
    assert mem.ranks[1].state is PeerState.EXITED and mem.ranks[1].exit_code == 0
    assert mem.generation == 0


def test_a_silent_worker_is_given_up_only_once_its_ranks_are_dead(clock):
    mem = _members(clock)
    clock.advance(6)  # the worker and both its ranks silent
    deaths = mem.assess(clock())
    assert deaths.dead == (0, 1) and deaths.retired_workers == ()  # the ranks' deaths come first
    mem.apply(deaths)
    assert not mem.workers["w"].exited
    calm = mem.assess(clock())
    assert calm.healthy and calm.retired_workers == ("w",)
    assert not mem.workers["w"].exited  # still only a verdict
    mem.apply(calm)
    assert mem.workers["w"].exited and mem.generation == 1  # giving a worker up changes no world


def test_a_silent_worker_with_a_rank_that_left_is_kept(clock):
    mem = _members(clock)
    mem.rank_left(0)
    mem.rank_exited(1, -9)
    mem.apply(mem.assess(clock()))
    clock.advance(6)
    assert mem.assess(clock()).retired_workers == ()  # rank 0 left cleanly: it is not dead


def test_new_generation_says_why(caplog):
    mem = Membership(5.0)
    with caplog.at_level(logging.DEBUG, logger="flodl.plan.membership"):
        assert mem.new_generation("rank(s) 2 on h joined") == 1
        assert mem.new_generation("a collective rebuilt") == 2
    assert "membership generation 2: a collective rebuilt" in caplog.text


def test_the_registry_follows_hellos_routes_and_dropped_ranks(clock):
    mem = _members(clock)
    mem.rank_said_hello(1, b"r1", "rank-1", "h2", 42, "cpu")
    assert mem.by_identity[b"r1"] is mem.by_sender["rank-1"] is mem.ranks[1]
    assert mem.ranks[1].where() == "rank 1 on host h2 (pid 42)"
    mem.route_moved(mem.ranks[1], b"r1b")
    assert b"r1" not in mem.by_identity and mem.by_identity[b"r1b"].identity == b"r1b"
    info = mem.forget_rank(1)
    assert info.rank == 1 and 1 not in mem.ranks and not mem.by_identity and not mem.by_sender
    assert mem.forget_rank(1) is None


def test_silence_counts_from_the_hello(clock):
    mem = _members(clock)
    mem.rank_said_hello(0, b"r0", "rank-0", "h", 100, "cpu")
    clock.advance(6)
    mem.seen_worker("w", clock())  # its worker beats on while rank 1 builds its task
    mem.excuse_silence_before_hello(clock())  # rank 1 never said hello: the join timeout judges it
    assert mem.assess(clock()).dead == (0,)


def test_a_rank_whose_worker_went_before_it_started_is_dead_at_the_heartbeat_timeout(clock):
    """A host lost right after the controller told its worker to restart a rank there: the restart
    never comes. It waited out the join timeout (120 s), and every later joiner with it."""
    mem = _members(clock, ranks=1)
    mem.rank_said_hello(0, b"r0", "rank-0", "h", 100, "cpu")
    mem.expect_restart(mem.workers["w"], 1, "cpu", clock())
    clock.advance(4.9)
    mem.seen_rank(0, clock())
    mem.excuse_silence_before_hello(clock())
    assert mem.assess(clock()).healthy  # the worker may only be slow to say so
    clock.advance(0.2)
    mem.seen_rank(0, clock())
    mem.excuse_silence_before_hello(clock())
    verdict = mem.assess(clock())
    assert verdict.dead == (1,) and "never started: its worker on host h (pid 1) is gone" in verdict.reason
    # a worker's own first ranks start while it may be silent a while (a relay importing torch): the join timeout judges them
    mem = _members(clock, ranks=1)
    mem.expect_rank(1, "h", "cpu", clock())
    clock.advance(5.1)
    mem.seen_rank(0, clock())
    mem.excuse_silence_before_hello(clock())
    assert mem.assess(clock()).healthy


def test_a_restarted_rank_belongs_to_its_worker(clock):
    mem = Membership(5.0)
    worker = WorkerInfo("w", b"w", "h", 1, ["cpu", "cpu"])
    mem.add_worker(worker, clock())
    assert mem.assign_ranks(worker, 3, clock()) == [3, 4]
    mem.expect_restart(worker, 5, "cpu", clock())
    assert worker.ranks == [3, 4, 5] and sorted(mem.ranks) == [3, 4, 5] and mem.ranks[5].host == "h"


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
    """The reference runtime's golden values for epoch aggregation (docs/architecture.md, step 6)."""
    stats = aggregate(
        0,
        [
            _done(0, 0.5, 60, 1000.0, 1920, {"loss": [60.0, 60.0], "acc": [36.0, 60.0]}),
            _done(1, 0.7, 40, 1200.0, 1280, {"loss": [80.0, 40.0], "acc": [16.0, 40.0]}),
        ],
    )
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
    from flodl.testing.faults import FaultPlan

    plan = FaultPlan.from_env(1, "1:average:5, 2:batch:3:stop,1:epoch:2:stop,1:regroup:1")
    assert plan.armed == {"average": (5, "kill"), "epoch": (2, "stop"), "regroup": (1, "kill")}
    assert FaultPlan.from_env(3, "1:average:5").armed == {}
    assert FaultPlan.from_env(1, "1:spawn:3:delay").spawn_delay_s() == 3.0 and plan.spawn_delay_s() == 0.0
    for bad in ("1:average", "x:batch:1", "1:nowhere:1", "1:batch:1:explode", "1:spawn:3", "1:batch:2:delay"):
        with pytest.raises(ValueError, match="FLODL_INJECT_FAULT"):
            FaultPlan.from_env(1, bad)
    plan.reach("average")  # 1st of 5: nothing happens
    assert plan.seen["average"] == 1 and "average" in plan.armed


def test_an_epoch_fault_fires_at_the_first_epoch_at_or_past_its_own():
    from flodl.testing.faults import FaultPlan

    plan = FaultPlan.from_env(2, "2:epoch:3:kill")
    plan.armed["epoch"] = (3, "nan")  # an action the caller carries out, so nothing is signalled in this test
    assert plan.reach("epoch", index=1) is None and plan.reach("epoch", index=2) is None
    # this rank's share skipped epoch 3 (windows flow across epoch edges): the fault is not lost
    assert plan.reach("epoch", index=4) == "nan" and "epoch" not in plan.armed
    assert plan.reach("epoch", index=5) is None  # once


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

    probe = (
        "import sys, flodl.controller, flodl.checkpoint.meta, flodl.plan.schedule; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(flodl.plan.schedule.Schedule(10).epochs)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_epoch_counters_keep_the_wire_row_format():
    """WindowDone.epochs rows stay [epoch, batches, samples, loss_sum, compute_ms, data_ms], floats."""
    from flodl.plan.metrics import EpochCounters, epoch_rows

    a = EpochCounters()
    a.add_batch(32, 0.5, 10.0, 2.0)
    a.add_batch(16, 0.25, 12.0, 1.0)
    b = EpochCounters()
    b.add_batch(8, 1.0, 3.0, 0.0)
    rows = epoch_rows({3: b, 2: a})
    assert rows == [[2.0, 2.0, 48.0, 0.75, 22.0, 3.0], [3.0, 1.0, 8.0, 1.0, 3.0, 0.0]]
    assert all(type(v) is float for row in rows for v in row)
    epoch, back = EpochCounters.from_row(rows[0])
    assert epoch == 2 and back == EpochCounters(2, 48, 0.75, 22.0, 3.0) and type(back.batches) is int
    back.add(EpochCounters(1, 8, 1.0, 3.0, 0.0, sync_ms=4.0))
    assert back == EpochCounters(3, 56, 1.75, 25.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        EpochCounters.from_row([1.0, 2.0, 3.0])  # a row of another width is refused, not misread
