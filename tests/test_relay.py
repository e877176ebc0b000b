"""The host relay: a host's ranks pre-averaged, one snapshot upstream, the exact average back.

Real sockets and a real controller bulk server; each "host" is a
``HostRelay`` on the same event loop with its ranks' averagers in threads.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from flodl.averaging.relay import HostRelay
from flodl.wire.bulk import SLICE_BYTES

from .helpers.cpu_plane import RUN, SECRET, Big, controller, dies_after_first_slice, rank_side, send_raw, snapshot_header, stop, values

pytestmark = pytest.mark.timeout(60)


def relay_for(ctl, identity: str, ranks: list[int]) -> HostRelay:
    ctl.admit_relay(identity.encode(), ranks)
    for r in ranks:
        ctl.admit(f"rank{r}.t".encode(), r)  # the controller admits ranks as it always does; their relay stands in
    relay = HostRelay(
        secret=SECRET, run_id=RUN, upstream=f"tcp://127.0.0.1:{ctl.port}", identity=f"{identity}/bulk", ranks=ranks, timeout_s=10.0
    )
    relay.start()
    relay.task = asyncio.create_task(relay.run())
    return relay


def ranks_under(relay: HostRelay, models: dict[int, torch.nn.Module], *, lane: bool):
    out = {}
    for r, model in models.items():
        out[r] = rank_side(relay, r, model, lane=lane)
    return out


def relay_and_lone_rank(ctl, models: dict[int, torch.nn.Module], *, lane: bool) -> tuple[HostRelay, dict]:
    """Two hosts: ranks 0 and 1 behind a relay (``lane``: on its same-host lane), rank 2 alone, sending to the controller."""
    relay = relay_for(ctl, "worker.a", [0, 1])
    avgs = ranks_under(relay, {0: models[0], 1: models[1]}, lane=lane)
    avgs[2] = rank_side(ctl, 2, models[2])
    return relay, avgs


async def close(relays, ctl, task, avgs):
    for a in avgs:
        a.close()
    for relay in relays:
        relay.task.cancel()
        relay.close()
    await stop(ctl, task, avgs)


@pytest.mark.parametrize("lane", [False, True], ids=["wire", "lane"])
async def test_relayed_hosts_average_exactly_what_every_rank_would(lane):
    ctl, task = await controller()
    models = {r: Big(r) for r in range(5)}
    before = {r: values(mo) for r, mo in models.items()}
    a = relay_for(ctl, "worker.a", [0, 1])
    b = relay_for(ctl, "worker.b", [2, 3])
    avgs = {**ranks_under(a, {0: models[0], 1: models[1]}, lane=lane), **ranks_under(b, {2: models[2], 3: models[3]}, lane=lane)}
    avgs[4] = rank_side(ctl, 4, models[4])  # a rank alone on its host sends to the controller itself
    weights = {0: 3.0, 1: 1.0, 2: 0.0, 3: 2.0, 4: 5.0}
    await asyncio.gather(*[asyncio.to_thread(avgs[r].average, weights[r], measure=True) for r in range(5)])
    total = sum(weights.values())
    want_p = [sum(weights[r] * before[r][i] for r in range(5)) / total for i in (0, 1)]
    trained = [r for r in range(5) if weights[r] > 0]
    want_b = sum(before[r][2] for r in trained) / len(trained)  # buffers: equal among ranks that trained, across hosts
    for mo in models.values():
        got = values(mo)
        assert torch.allclose(got[0], want_p[0], atol=1e-5) and torch.allclose(got[1], want_p[1], atol=1e-5)
        assert torch.allclose(got[2], want_b, atol=1e-6)
    model_bytes = sum(t.numel() * 4 for t in (models[0].w, models[0].v, models[0].stat))
    # the controller took one model per host: two relays and the lone rank, not five
    assert ctl.ingress_bytes == 3 * model_bytes, (ctl.ingress_bytes, model_bytes)
    assert ctl.rounds.rounds_done == 1 and a.rounds.rounds_done == 1 and b.rounds.rounds_done == 1 and not ctl.drops and not a.drops
    assert (a.local.lane_bytes > 0) == lane
    await close([a, b], ctl, task, avgs.values())


async def test_a_local_rank_that_dies_is_not_waited_for():
    ctl, task = await controller()
    models = {r: Big(r) for r in range(3)}
    before = {r: values(mo) for r, mo in models.items()}
    a, avgs = relay_and_lone_rank(ctl, models, lane=True)
    a.rank_ended(1)  # its process is gone (the worker reaps it)
    await asyncio.gather(*[asyncio.to_thread(avgs[r].average, 1.0) for r in (0, 2)])
    want = (before[0][0] + before[2][0]) / 2
    assert torch.allclose(models[0].w.double(), want, atol=1e-5) and torch.allclose(models[2].w.double(), want, atol=1e-5)
    assert ctl.rounds.aborted == 0 and a.rounds.aborted == 0
    await close([a], ctl, task, avgs.values())


async def test_a_snapshot_that_reached_the_relay_before_its_ranks_death_is_folded():
    """Rank 1's snapshot is in the relay's socket, unread, when the worker reports its process gone
    (it died right after sending it, its window's report out). The relay takes what the rank sent
    before it stops waiting for it: rank 1's work is in the average, and the controller's ledger
    says so. It used to stop waiting at once, and a check before its reader ran ended the round
    without a snapshot that had arrived (the window was then given back and trained again)."""
    ctl, task = await controller()
    models = {r: Big(r) for r in range(3)}
    before = {r: values(mo) for r, mo in models.items()}
    a, avgs = relay_and_lone_rank(ctl, models, lane=True)
    first = asyncio.ensure_future(asyncio.to_thread(avgs[0].average, 1.0))
    for _ in range(500):  # rank 0's whole snapshot is in: the relay's round waits for rank 1
        rnd = a.rounds.current
        if rnd is not None and rnd.received[0] == rnd.total:
            break
        await asyncio.sleep(0.01)
    # from here the loop holds still: rank 1 sends, and its death is reported before a byte of it is read
    avgs[1].average(1.0, block=False)
    sock, deadline = a.local.io.sock, time.monotonic() + 10
    while not sock.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
        time.sleep(0.001)
    a.rank_ended(1)
    await a.rounds.check()  # the relay's periodic check, come before its reader: rank 1 still counts
    await asyncio.gather(first, asyncio.to_thread(avgs[2].average, 1.0))
    want = sum(before[r][0] for r in range(3)) / 3
    assert torch.allclose(models[0].w.double(), want, atol=1e-5) and torch.allclose(models[2].w.double(), want, atol=1e-5)
    assert [ctl.landed(0, r) for r in range(3)] == [True, True, True]
    assert ctl.rounds.aborted == 0 and a.rounds.aborted == 0 and not a.drops
    await close([a], ctl, task, avgs.values())


async def test_rounds_keep_streaming_through_the_relay_over_many_rounds():
    ctl, task = await controller()
    models = {r: Big(r) for r in range(3)}
    a, avgs = relay_and_lone_rank(ctl, models, lane=True)
    for n in range(4):  # Cadence-like: nobody waits, each rank reads the last average before sending the next
        await asyncio.gather(*[asyncio.to_thread(avgs[r].average, 1.0 + n, block=False) for r in range(3)])
    await asyncio.gather(*[asyncio.to_thread(avgs[r].settle) for r in range(3)])
    assert ctl.rounds.rounds_done == 4 and a.rounds.rounds_done == 4 and ctl.rounds.aborted == 0
    # the relayed ranks read each average before their next snapshot, so both end on the last average;
    # rank 2 (the wire, no settling first) may have snapshotted before an average landed and keeps that delta
    assert torch.allclose(models[0].w, models[1].w, atol=1e-5)
    assert sum(x.overruns for x in avgs.values()) == 0
    await close([a], ctl, task, avgs.values())


async def test_an_abort_upstream_reaches_the_local_ranks():
    ctl, task = await controller(timeout_s=0.5)
    models = {r: Big(r) for r in range(3)}
    before = {r: values(mo) for r, mo in models.items()}
    a = relay_for(ctl, "worker.a", [0, 1])
    avgs = {**ranks_under(a, {0: models[0], 1: models[1]}, lane=True)}
    silent = rank_side(ctl, 2, models[2])  # admitted, never sends: the controller aborts the round
    await asyncio.gather(*[asyncio.to_thread(avgs[r].average, 1.0) for r in (0, 1)])
    assert ctl.rounds.aborted == 1 and a.rounds.aborted == 1 and all(x.aborted == 1 for x in avgs.values())
    assert torch.equal(models[0].w.double(), before[0][0])  # kept its own values
    await close([a], ctl, task, [*avgs.values(), silent])


def test_relaying_loads_no_controller_code():
    """A worker relays without the controller package: the relay is built on the averaging
    package's round core, not on controller internals. Checked in a fresh interpreter:
    other tests' imports would hide a regression here."""
    import subprocess
    import sys

    probe = (
        "import sys, flodl.averaging.relay; "
        "loaded = sorted(n for n in sys.modules if n == 'flodl.controller' or n.startswith('flodl.controller.')); "
        "assert not loaded, loaded; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


async def test_a_relay_claiming_more_ranks_than_it_carries_is_dropped(caplog):
    ctl, task = await controller()
    ctl.admit_relay(b"worker.a", [0, 1])
    header = snapshot_header(ranks=3)
    send_raw(ctl.port, b"worker.a/bulk", header, b"\0" * 16)
    for _ in range(100):
        if ctl.drops["bulk"]:
            break
        await asyncio.sleep(0.02)
    assert ctl.drops["bulk"] == 1 and ctl.rounds.current is None and "claims 3 ranks, it carries 2" in caplog.text
    assert SLICE_BYTES > 0
    await stop(ctl, task)


async def test_a_local_rank_that_dies_halfway_through_its_snapshot():
    """Rank 1 sends the first slice of its snapshot and dies: every slice is still a true weighted
    average of what it holds, the relay's weight upstream stays one number through the round, and
    the controller's ledger knows rank 1's snapshot is not in the consensus (``Snapshot.folded``)."""
    ctl, task = await controller()
    models = {r: Big(r) for r in range(3)}
    before = {r: values(mo) for r, mo in models.items()}
    a, avgs = relay_and_lone_rank(ctl, models, lane=False)
    sent = dies_after_first_slice(avgs[1])
    await asyncio.to_thread(avgs[1].average, 1.0, block=False)
    weights = {0: 3.0, 1: 1.0, 2: 2.0}
    both = asyncio.gather(*[asyncio.to_thread(avgs[r].average, weights[r]) for r in (0, 2)])
    for _ in range(500):  # rank 0's whole snapshot is in while rank 1 is still expected: then it dies
        rnd = a.rounds.current
        if rnd is not None and rnd.received[0] == rnd.total:
            break
        await asyncio.sleep(0.01)
    a.rank_ended(1)
    await both
    first = SLICE_BYTES // 4  # the slice rank 1 sent: the first of the parameter bucket
    total = sum(weights.values())
    want_first = sum(weights[r] * before[r][0][:first] for r in range(3)) / total
    rest = weights[0] + weights[1]  # the host's weight upstream, as its first slice said
    want_rest = (rest * before[0][0][first:] + weights[2] * before[2][0][first:]) / (rest + weights[2])
    want_v = (rest * before[0][1] + weights[2] * before[2][1]) / (rest + weights[2])
    want_b = (2 * before[0][2] + before[2][2]) / 3  # buffers: the host counts two ranks that trained
    for r in (0, 2):
        got = values(models[r])
        assert torch.allclose(got[0][:first], want_first, atol=1e-5)
        assert torch.allclose(got[0][first:], want_rest, atol=1e-5)  # not shrunk by rank 1's missing share
        assert torch.allclose(got[1], want_v, atol=1e-5) and torch.allclose(got[2], want_b, atol=1e-5)
    assert ctl.rounds.aborted == 0 and not ctl.drops and a.rounds.aborted == 0
    assert [ctl.landed(0, r) for r in (0, 1, 2)] == [True, False, True]
    assert len(sent) > 1  # it had more slices to send
    await close([a], ctl, task, avgs.values())


async def test_the_ledger_reads_a_relayed_rank_from_its_relays_snapshot():
    ctl, task = await controller()
    models = {r: Big(r) for r in range(3)}
    a, avgs = relay_and_lone_rank(ctl, models, lane=True)
    await asyncio.gather(*[asyncio.to_thread(avgs[r].average, 1.0) for r in range(3)])
    assert [ctl.landed(0, r) for r in range(3)] == [True, True, True]
    assert ctl.landed(1, 1) is None  # not happened yet
    await close([a], ctl, task, avgs.values())


async def test_a_relay_naming_a_rank_it_does_not_carry_is_dropped(caplog):
    ctl, task = await controller()
    ctl.admit_relay(b"worker.a", [0, 1])
    send_raw(ctl.port, b"worker.a/bulk", snapshot_header(ranks=2, folded=[0, 5]), b"\0" * 16)
    for _ in range(100):
        if ctl.drops["bulk"]:
            break
        await asyncio.sleep(0.02)
    assert ctl.drops["bulk"] == 1 and ctl.rounds.current is None and "names ranks [0, 5] it does not carry" in caplog.text
    await stop(ctl, task)
