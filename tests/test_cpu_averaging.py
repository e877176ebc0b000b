"""The CPU averaging backend: real bulk sockets, the controller's round state machine, rank-side apply."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from flodl.errors import ProtocolError
from flodl.wire.bulk import SLICE_BYTES, unpack_slice

from .helpers.cpu_plane import Big, controller, dies_after_first_slice, rank_side, send_raw, snapshot_header, stop, values

pytestmark = pytest.mark.timeout(60)

#: Every round-level test runs twice: ranks on the wire, and on the same-host lane (shared memory).
LANES = pytest.mark.parametrize("lane", [False, True], ids=["wire", "lane"])


@LANES
async def test_weighted_average_exact_against_float64(lane):
    ctl, task = await controller()
    models = [Big(s) for s in range(3)]
    before = [values(mo) for mo in models]
    avgs = [rank_side(ctl, r, mo, lane=lane) for r, mo in enumerate(models)]
    weights = [3.0, 1.0, 0.0]
    threads = [asyncio.to_thread(a.average, w, measure=True) for a, w in zip(avgs, weights, strict=False)]
    results = await asyncio.gather(*threads)
    want_p = [sum(w * b[i] for w, b in zip(weights, before, strict=False)) / sum(weights) for i in (0, 1)]
    want_b = (before[0][2] + before[1][2]) / 2  # buffers: equal weight among ranks that trained
    for mo in models:
        got = values(mo)
        assert torch.allclose(got[0], want_p[0], atol=1e-5) and torch.allclose(got[1], want_p[1], atol=1e-5)
        assert torch.allclose(got[2], want_b, atol=1e-6)
    assert [int(mo.count) for mo in models] == [0, 1, 2]  # integer buffers stay local
    assert all(r.divergence is not None for r in results)
    assert ctl.rounds.rounds_done == 1 and ctl.rounds.aborted == 0 and not ctl.drops
    assert (ctl.lane_bytes > 0) == lane and (ctl.update_seg is not None) == lane  # the lane really carried it
    await stop(ctl, task, avgs)


@LANES
async def test_progress_after_the_snapshot_is_kept(lane):
    ctl, task = await controller()
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=lane) for r, mo in enumerate(models)]
    for a in avgs:
        a.average(1.0, block=False)
    snap0 = models[0].weight.detach().clone()
    with torch.no_grad():
        models[0].weight.add_(10.0)  # training goes on while the round is computed
    mean = (snap0 + models[1].weight.detach()) / 2
    await asyncio.gather(*(asyncio.to_thread(a.settle) for a in avgs))
    assert torch.allclose(models[0].weight.detach(), mean + 10.0, atol=1e-6)
    assert torch.allclose(models[1].weight.detach(), mean, atol=1e-6)
    await stop(ctl, task, avgs)


@LANES
async def test_an_eval_scores_exactly_the_average_it_asks_for_whatever_was_trained_since(lane):
    """``CpuAverager.scoring``: the eval of an epoch scores the average that closed it, not that
    average plus what this rank trained since, and gives the live values back."""
    ctl, task = await controller()
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=lane) for r, mo in enumerate(models)]
    for a in avgs:
        a.average(1.0, block=False, tag=7 << 16)  # window 7's end average
    mean = (models[0].weight.detach() + models[1].weight.detach()) / 2
    with torch.no_grad():
        models[0].weight.add_(10.0)  # the next window trains on meanwhile
    await asyncio.gather(*(asyncio.to_thread(a.settle) for a in avgs))
    live = models[0].weight.detach().clone()
    assert torch.allclose(live, mean + 10.0, atol=1e-6)
    with avgs[0].scoring(7 << 16) as held:
        assert held and torch.allclose(models[0].weight.detach(), mean, atol=1e-6)
    assert torch.equal(models[0].weight.detach(), live)  # training's values back, exactly
    with avgs[0].scoring(6 << 16) as held:  # an average no longer kept: nothing changes
        assert not held and torch.equal(models[0].weight.detach(), live)
    await stop(ctl, task, avgs)


@LANES
async def test_timeout_aborts_and_late_snapshot_never_leaks(lane):
    ctl, task = await controller(timeout_s=0.5)
    models = [torch.nn.Linear(4, 4) for _ in range(3)]
    avgs = [rank_side(ctl, r, mo, timeout_s=5.0, lane=lane) for r, mo in enumerate(models)]
    # round 0: rank 2 is late, the round is aborted and ranks 0, 1 keep their own values
    kept = [mo.weight.detach().clone() for mo in models]
    await asyncio.gather(*(asyncio.to_thread(a.average, 1.0) for a in avgs[:2]))
    assert ctl.rounds.aborted == 1
    assert all(torch.equal(mo.weight.detach(), k) for mo, k in zip(models[:2], kept, strict=False))
    assert not any(ctl.landed(0, r) for r in range(3))  # aborted: nobody's snapshot is in an average
    # rank 2's round-0 snapshot arrives now: stale. Round 1 averages all three.
    with torch.no_grad():
        models[2].weight.fill_(1000.0)
    avgs[2].average(1.0, block=False)  # still round 0 from its side
    for a in avgs[:2]:
        a.start_at_round(1)  # ranks 0 and 1 have moved on to round 1
    avgs[2].start_at_round(1)
    with torch.no_grad():
        models[2].weight.fill_(3.0)
    want = (models[0].weight.detach() + models[1].weight.detach() + 3.0) / 3
    await asyncio.gather(*(asyncio.to_thread(a.average, 1.0) for a in avgs))
    assert ctl.drops["stale"] >= 1 and ctl.rounds.rounds_done == 1
    for mo in models:
        assert torch.allclose(mo.weight.detach(), want, atol=1e-5)  # no trace of the 1000s
    await stop(ctl, task, avgs)


@LANES
async def test_a_round_aborted_before_a_rank_sent_it_is_not_waited_for(lane):
    """A slower rank hears its round was aborted (the gate timed out) before it sends that round's
    snapshot: sent later, the snapshot is stale at the controller and never answered, so the rank
    must not wait for it (it did, until its own deadline, then called its collective failed)."""
    ctl, task = await controller(timeout_s=0.5)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    avgs = [rank_side(ctl, r, mo, timeout_s=5.0, lane=lane) for r, mo in enumerate(models)]
    await asyncio.to_thread(avgs[0].average, 1.0)  # rank 1 sends nothing: round 0 is aborted
    assert ctl.rounds.aborted == 1
    for _ in range(200):  # rank 1 polls between its steps and hears of the abort first
        avgs[1].poll()
        if 0 in avgs[1].aborted_ahead:
            break
        await asyncio.sleep(0.01)
    assert avgs[1].aborted_ahead == {0}
    kept = models[1].weight.detach().clone()
    avgs[1].average(1.0, block=False)  # its round 0, sent late: over at once
    assert 0 not in avgs[1].pending and avgs[1].aborted == 1 and not avgs[1].aborted_ahead
    await asyncio.wait_for(asyncio.to_thread(avgs[1].settle), 2.0)  # nothing left to wait for
    assert torch.equal(models[1].weight.detach(), kept)  # its own values kept
    await stop(ctl, task, avgs)


@LANES
async def test_round_completes_without_a_rank_that_died(lane):
    ctl, task = await controller(timeout_s=30.0)
    models = [torch.nn.Linear(2, 2) for _ in range(3)]
    avgs = [rank_side(ctl, r, mo, lane=lane) for r, mo in enumerate(models)]
    want = (models[0].weight.detach() + models[1].weight.detach()) / 2
    live = {0, 1, 2}
    ctl.live = lambda: set(live)

    async def die_later():
        await asyncio.sleep(0.3)
        live.discard(2)  # rank 2 dies before sending anything

    await asyncio.gather(die_later(), *(asyncio.to_thread(a.average, 1.0) for a in avgs[:2]))
    assert ctl.rounds.rounds_done == 1 and ctl.rounds.aborted == 0
    assert torch.allclose(models[0].weight.detach(), want, atol=1e-6)
    # what the ledger asks of a dead rank's last window: the round went on without its snapshot
    assert [ctl.landed(0, r) for r in (0, 1, 2)] == [True, True, False]
    assert ctl.landed(1, 0) is None  # round 1 has not happened: not known yet
    await stop(ctl, task, avgs)


@LANES
async def test_a_snapshot_in_the_socket_when_its_ranks_death_is_reported_is_folded(lane):
    """Rank 1 sends its whole snapshot and dies; the news of its death (the controller's
    ``rank_ended``) comes before the server has read a byte of it, and a check runs at once.
    The server takes what the socket held first: rank 1's work is in the average and the ledger
    says so. Before, its death ended its part in the round at once, the round finished without
    a snapshot that had arrived, and its window was given back and trained again. On the wire
    the snapshot is several slices, more than the read-ahead takes in one go."""
    ctl, task = await controller(timeout_s=30.0)
    models = [Big(r) for r in range(3)]
    before = [values(mo) for mo in models]
    avgs = [rank_side(ctl, r, mo, lane=lane) for r, mo in enumerate(models)]
    live = {0, 1, 2}
    ctl.live = lambda: set(live)
    both = asyncio.gather(*(asyncio.to_thread(avgs[r].average, 1.0) for r in (0, 2)))
    for _ in range(500):  # the survivors' whole snapshots are in: the round waits for rank 1
        rnd = ctl.rounds.current
        if rnd is not None and rnd.received[0] == rnd.received[2] == rnd.total:
            break
        await asyncio.sleep(0.01)
    # from here the loop holds still: rank 1 sends all of it, and its death is reported before a byte is read
    avgs[1].average(1.0, block=False)  # on this thread: the loop reads nothing meanwhile
    sock, deadline = ctl.io.sock, time.monotonic() + 10
    while not sock.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.2)  # the rest of its slices reach the socket too
    live.discard(1)
    ctl.rank_ended(1)
    await ctl.rounds.check()  # the server's periodic check, come before its reader: rank 1 still counts
    await both
    want = sum(b[0] for b in before) / 3
    for mo in (models[0], models[2]):
        assert torch.allclose(values(mo)[0], want, atol=1e-5)
    assert [ctl.landed(0, r) for r in range(3)] == [True, True, True]
    assert ctl.rounds.aborted == 0 and not ctl.drops and not ctl.ending
    await stop(ctl, task, avgs)


async def test_a_rank_that_dies_halfway_through_its_snapshot_shrinks_no_slice():
    """Rank 2 sends its first slice and dies after every weight is known: the slices it never sent are
    the average of the two that did (not their sum over all three's weight), and the round is not
    counted as holding rank 2's snapshot."""
    ctl, task = await controller(timeout_s=30.0)
    models = [Big(r) for r in range(3)]
    before = [values(mo) for mo in models]
    avgs = [rank_side(ctl, r, mo) for r, mo in enumerate(models)]
    live = {0, 1, 2}
    ctl.live = lambda: set(live)
    dies_after_first_slice(avgs[2])
    await asyncio.to_thread(avgs[2].average, 2.0, block=False)
    both = asyncio.gather(*(asyncio.to_thread(avgs[r].average, 1.0) for r in (0, 1)))
    for _ in range(500):  # the survivors' whole snapshots are in while rank 2 is still expected: then it dies
        rnd = ctl.rounds.current
        if rnd is not None and rnd.received[0] == rnd.received[1] == rnd.total:
            break
        await asyncio.sleep(0.01)
    live.discard(2)
    await both
    first = SLICE_BYTES // 4
    for mo in models[:2]:
        got = values(mo)
        assert torch.allclose(got[0][:first], (before[0][0][:first] + before[1][0][:first] + 2 * before[2][0][:first]) / 4, atol=1e-5)
        assert torch.allclose(got[0][first:], (before[0][0][first:] + before[1][0][first:]) / 2, atol=1e-5)
        assert torch.allclose(got[2], (before[0][2] + before[1][2]) / 2, atol=1e-5)
    assert [ctl.landed(0, r) for r in range(3)] == [True, True, False] and ctl.rounds.aborted == 0
    await stop(ctl, task, avgs)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(numels=[10], count=10), "slice of 16 bytes, header says 10 x float32 = 40"),
        (dict(dtypes=["int64"]), "dtype 'int64'"),
        (dict(bucket=3), "bucket 3 outside"),
        (dict(start=2, count=4), "outside tensor 0 of 4 elements"),
    ],
)
async def test_bad_slices_are_rejected_with_a_clear_error(bad, reason, caplog):
    ctl, task = await controller()
    ctl.admit(b"rank0.x", 0)
    header = snapshot_header(**bad)
    send_raw(ctl.port, b"rank0.x/bulk", header, b"\0" * 16)
    for _ in range(100):
        if ctl.drops["bulk"]:
            break
        await asyncio.sleep(0.02)
    assert ctl.drops["bulk"] == 1 and ctl.rounds.current is None
    assert reason in caplog.text
    with pytest.raises(ProtocolError, match="bulk"):
        unpack_slice(header, [b"\0" * 16])
    await stop(ctl, task)


async def test_snapshot_from_the_wrong_socket_is_unauthorized():
    ctl, task = await controller()
    ctl.admit(b"rank0.x", 0)
    header = snapshot_header()
    send_raw(ctl.port, b"rank1.impostor/bulk", header, b"\0" * 16)
    for _ in range(100):
        if ctl.drops["unauthorized"]:
            break
        await asyncio.sleep(0.02)
    assert ctl.drops["unauthorized"] == 1 and ctl.rounds.current is None
    await stop(ctl, task)
