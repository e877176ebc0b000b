"""Loopback: the real controller on 127.0.0.1 with simulated workers and ranks as tasks."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import zmq

from flodl.config import DdpRunConfig
from flodl.controller import Controller, LaunchOptions, Phase
from flodl.errors import EXIT_RANK_LOST, RunAborted
from flodl.testing.sim import SimRankSpec, SimWorker
from flodl.wire import messages as m
from flodl.wire.codec import FrameWriter
from flodl.wire.transport import make_dealer

from .helpers.history import epoch_samples

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
RUN = "loop-run"


def make_controller(console, *, epochs=2, workers=1, heartbeat=None, join_timeout=20.0, mode="nccl-sync", config=None):
    config = (config or DdpRunConfig()).with_mode(mode)
    if heartbeat is not None:
        config = config.with_heartbeat_timeout_secs(heartbeat)
    launch = LaunchOptions(task="sim:task", epochs=epochs, workers=workers, progress=False, join_timeout_secs=join_timeout)
    return Controller(launch, config, secret=SECRET, run_id=RUN, console=console)


async def run_with(controller, *workers):
    """Run the controller and sim workers together; return (summary or exception, workers)."""
    run = asyncio.create_task(controller.run())
    await controller.ready.wait()
    addr = f"tcp://127.0.0.1:{controller.port}"
    sims = [SimWorker(addr, SECRET, RUN, specs, **kw) for specs, kw in workers]
    tasks = [asyncio.create_task(s.run()) for s in sims]
    try:
        result = await run
    except RunAborted as exc:
        result = exc
    await asyncio.wait(tasks, timeout=10)
    for t in tasks:
        t.cancel()
    return result, sims


async def test_full_run_two_ranks(quiet_console):
    ctl = make_controller(quiet_console, epochs=3)
    summary, (sim,) = await run_with(ctl, ([SimRankSpec(), SimRankSpec()], {"dataset_len": 1000, "batch_size": 10}))
    assert summary["exit_reason"] == "completed"
    assert summary["epochs_completed"] == 3 and summary["world_size"] == 2
    assert summary["samples"] == 3000
    assert [r["samples"] for r in summary["per_rank"]] == [1500, 1500]
    assert summary["syncs"] == 3 * 50
    assert summary["final_eval"] == 0.5 and summary["eval_metric_name"] == "sim_metric"
    assert summary["deaths"] == []
    assert sim.outcomes == {0: "completed", 1: "completed"}
    assert [h["epoch"] for h in summary["history"]] == [0, 1, 2]


async def test_two_workers_get_consecutive_ranks(quiet_console):
    ctl = make_controller(quiet_console, epochs=1, workers=2)
    summary, sims = await run_with(
        ctl,
        ([SimRankSpec()], {"host": "a"}),
        ([SimRankSpec(), SimRankSpec()], {"host": "b"}),
    )
    assert summary["world_size"] == 3
    assert sorted(r for s in sims for r in s.outcomes) == [0, 1, 2]
    assert {r["host"] for r in summary["per_rank"]} == {"a", "b"}


@pytest.mark.parametrize("mode", ["nccl-sync", "nccl-cadence", "nccl-async"])
async def test_rank_death_stops_run_naming_rank_and_host(quiet_console, mode):
    ctl = make_controller(quiet_console, epochs=5, mode=mode, config=DdpRunConfig().with_max_failure(1))  # else rank 0 trains on alone
    start = time.monotonic()
    result, (sim,) = await run_with(ctl, ([SimRankSpec(batch_ms=1), SimRankSpec(batch_ms=1, die_at_batch=30)], {"host": "node-b"}))
    assert isinstance(result, RunAborted) and result.exit_code == EXIT_RANK_LOST
    assert "rank 1 on host node-b" in str(result) and "killed by SIGKILL" in str(result)
    assert result.summary["deaths"][0]["rank"] == 1
    assert sim.outcomes[0] == "aborted"
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("mode", ["nccl-sync", "nccl-cadence", "nccl-async"])
async def test_silent_rank_is_declared_dead_after_heartbeat_timeout(quiet_console, mode):
    ctl = make_controller(quiet_console, epochs=50, heartbeat=1, mode=mode, config=DdpRunConfig().with_max_failure(1))
    result, (sim,) = await run_with(ctl, ([SimRankSpec(batch_ms=2), SimRankSpec(batch_ms=2, silent_at_batch=20)], {}))
    assert isinstance(result, RunAborted) and result.exit_code == EXIT_RANK_LOST
    assert "rank 1" in str(result) and "sent nothing for" in str(result)


async def test_join_timeout_names_what_it_waited_for(quiet_console):
    ctl = make_controller(quiet_console, epochs=1, workers=2, join_timeout=1.0)
    result, _ = await run_with(ctl, ([SimRankSpec()], {}))
    assert isinstance(result, RunAborted)
    assert "waiting for workers to connect" in str(result)


async def _late_join(ctl, first_spec: SimRankSpec, phase: Phase, host: str):
    """Run ``ctl`` with one sim worker; once ``phase`` is reached a second one arrives.
    Returns (summary, the late worker)."""
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    addr = f"tcp://127.0.0.1:{ctl.port}"
    first = asyncio.create_task(SimWorker(addr, SECRET, RUN, [first_spec], host="a").run())
    while ctl.phase != phase:
        await asyncio.sleep(0.01)
    late = SimWorker(addr, SECRET, RUN, [SimRankSpec(batch_ms=first_spec.batch_ms)], host=host)
    await asyncio.wait_for(late.run(), 60)
    summary = await run
    await first
    return summary, late


async def test_a_worker_arriving_mid_run_joins_it(quiet_console):
    """A worker that arrives while the run trains is admitted at a window boundary and trains."""
    summary, late = await _late_join(
        make_controller(quiet_console, epochs=6, mode="nccl-cadence"), SimRankSpec(batch_ms=5), Phase.TRAINING, "late"
    )
    assert late.outcomes == {1: "completed"}
    assert summary["exit_reason"] == "completed" and summary["world_size"] == 2
    assert [j["ranks"] for j in summary["joins"]] == [[1]] and summary["joins"][0]["hosts"] == ["late"]
    assert next(r for r in summary["per_rank"] if r["rank"] == 1)["samples"] > 0
    per_epoch = epoch_samples(summary["history"])
    assert per_epoch == [per_epoch[0]] * 6


async def test_a_worker_arriving_while_the_first_ranks_start_is_held_then_admitted(quiet_console):
    ctl = make_controller(quiet_console, epochs=3, mode="nccl-cadence")
    summary, late = await _late_join(ctl, SimRankSpec(batch_ms=2, hello_delay_s=1.0), Phase.JOINING, "early")
    assert ctl.admission.initial_world == 1 and late.outcomes == {1: "completed"}
    assert [j["ranks"] for j in summary["joins"]] == [[1]] and summary["exit_reason"] == "completed"


async def test_a_worker_is_refused_while_the_run_shuts_down(quiet_console):
    """Once the run ends a worker cannot join; it is told why."""
    ctl = make_controller(quiet_console, epochs=2)
    for phase in (Phase.GATHERING, Phase.JOINING, Phase.TRAINING, Phase.SHUTTING_DOWN):
        ctl.state.to(phase)
    problem = ctl.admission.worker_problem(
        "late.1", m.WorkerHello(host="late", pid=1, devices=["cpu"], versions={"protocol": str(m.PROTOCOL_VERSION)})
    )
    assert problem == "the run is shutting down; a worker can join while it starts or trains"


async def test_garbage_frames_change_nothing(quiet_console):
    """Random, mutated, replayed and foreign frames during a run: dropped, counted, run completes."""
    ctl = make_controller(quiet_console, epochs=3)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    addr = f"tcp://127.0.0.1:{ctl.port}"
    sim = SimWorker(addr, SECRET, RUN, [SimRankSpec(batch_ms=1), SimRankSpec(batch_ms=1)])
    sim_task = asyncio.create_task(sim.run())
    attacker = make_dealer(zmq.Context.instance(), addr)
    rng = random.Random(3)
    forged = FrameWriter(b"wrong secret" * 3, RUN, "intruder")
    genuine = FrameWriter(SECRET, RUN, "rank0.forged")
    kill = genuine.encode(m.RankExited(rank=1, pid=1, code=-9))
    sent = 0
    while not run.done() and sent < 3000:
        kind = sent % 5
        if kind == 0:
            frame = rng.randbytes(rng.randint(0, 300))
        elif kind == 1:
            frame = forged.encode(m.RankExited(rank=0, pid=1, code=-9))  # unauthenticated death claim
        elif kind == 2:
            data = bytearray(kill)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)  # any bit flip breaks the tag
            frame = bytes(data)
        elif kind == 3:
            frame = FrameWriter(SECRET, "other-run", "x").encode(
                m.Heartbeat(step=1, sent_at=0.0, busy="", busy_s=0.0, step_ms=0.0, averaged=-1)
            )
        else:
            frame = kill[:-1] + bytes([kill[-1] ^ 0x80])
        attacker.send(frame)
        sent += 1
        if sent % 100 == 0:
            await asyncio.sleep(0.001)
    summary = await run
    await sim_task
    attacker.close(linger=0)
    assert summary["exit_reason"] == "completed" and summary["deaths"] == []
    assert sum(summary["dropped_frames"].values()) >= sent * 0.9
    assert {"bad_tag", "wrong_run"} <= set(summary["dropped_frames"])


def _epoch_samples(summary):
    return epoch_samples(summary["history"])


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async"])
async def test_unequal_ranks_cover_every_sample_once_and_fast_does_more(quiet_console, mode):
    """A rank 3x slower: the fast one trains about 3x the samples, coverage stays exact."""
    ctl = make_controller(quiet_console, epochs=3, mode=mode)
    summary, (sim,) = await run_with(
        ctl, ([SimRankSpec(batch_ms=2), SimRankSpec(batch_ms=2, slowdown=3.0)], {"dataset_len": 2400, "batch_size": 8})
    )
    assert summary["exit_reason"] == "completed", summary["exit_reason"]
    assert _epoch_samples(summary) == [2400, 2400, 2400]
    fast, slow = (r["samples"] for r in summary["per_rank"])
    assert 2.0 < fast / slow < 4.5, (fast, slow)
    cadence = summary["cadence"]
    assert cadence["batch_counts"][0] > cadence["batch_counts"][1]
    assert summary["syncs"] < 3 * 300 / 4  # far fewer averages than batches


async def test_async_streams_across_epochs_without_losing_samples(quiet_console):
    config = DdpRunConfig().with_max_overshoot(4)
    ctl = make_controller(quiet_console, epochs=4, mode="nccl-async", config=config)
    summary, _ = await run_with(
        ctl, ([SimRankSpec(batch_ms=1), SimRankSpec(batch_ms=1, slowdown=2.0)], {"dataset_len": 1000, "batch_size": 10})
    )
    assert _epoch_samples(summary) == [1000] * 4


async def test_progressive_sync_windows_split_equally(quiet_console):
    config = DdpRunConfig().with_progressive_dispatch(True)
    ctl = make_controller(quiet_console, epochs=2, mode="nccl-sync", config=config)
    summary, _ = await run_with(ctl, ([SimRankSpec(), SimRankSpec(), SimRankSpec()], {"dataset_len": 997, "batch_size": 10}))
    assert _epoch_samples(summary) == [997, 997]
    counts = [r["samples"] for r in summary["per_rank"]]
    assert max(counts) - min(counts) <= 3 * 10  # the epoch tails: a batch or two, and the partial one


async def test_non_progressive_cadence_uses_fixed_partitions(quiet_console):
    config = DdpRunConfig().with_progressive_dispatch(False).with_partition_ratios([3.0, 1.0])
    ctl = make_controller(quiet_console, epochs=2, mode="nccl-cadence", config=config)
    summary, _ = await run_with(ctl, ([SimRankSpec(batch_ms=1), SimRankSpec(batch_ms=1)], {"dataset_len": 800, "batch_size": 10}))
    assert _epoch_samples(summary) == [800, 800]
    assert [r["samples"] for r in summary["per_rank"]] == [1200, 400]
