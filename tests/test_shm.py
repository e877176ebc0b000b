"""The bulk plane's same-host lane: probes, segments, and headers that name them.

Real segments under /dev/shm, a real controller actor and real sockets; what
must never happen: a header pointing the averager at a file that is not the
sending rank's own segment, a slice outside it, a segment left behind, or a
rank applying an average whose slot was already reused.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from flodl.errors import ProtocolError
from flodl.wire import messages as m
from flodl.wire import shm

from .helpers.cpu_plane import RUN, SECRET, Big, controller, rank_side, send_raw, snapshot_header, stop

pytestmark = pytest.mark.timeout(60)


def _ours() -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith(shm.prefix(RUN)))


def test_probe_says_who_shares_the_host():
    path, nonce = shm.create_probe("probe-run")
    try:
        assert shm.probe_ok(str(path), nonce, "probe-run")
        assert not shm.probe_ok(str(path), "0" * 32, "probe-run")  # another controller's probe
        assert not shm.probe_ok(str(path), nonce, "other-run")  # not this run's name
        assert not shm.probe_ok("/tmp/" + path.name, nonce, "probe-run")  # outside the shm directory
        assert not shm.probe_ok("", "", "probe-run")
    finally:
        shm.unlink(path)
    assert not shm.probe_ok(str(path), nonce, "probe-run")  # gone: a rank elsewhere sees nothing


def test_probe_off_switch(monkeypatch):
    path, nonce = shm.create_probe("probe-run")
    try:
        monkeypatch.setenv("FLODL_SHM", "off")
        assert not shm.enabled() and not shm.probe_ok(str(path), nonce, "probe-run")
    finally:
        shm.unlink(path)


def test_segment_views_are_bounded_and_aligned():
    seg = shm.Segment.create(shm.path_for("seg-run", "r0"), 256)
    try:
        seg.view(0, 64, torch.float32).fill_(1.5)
        peer = shm.Segment.open(seg.path)
        assert float(peer.view(0, 64, torch.float32).sum()) == 96.0  # the peer sees our writes
        for offset, count in ((250, 4), (2, 1), (-4, 1)):
            with pytest.raises(ProtocolError, match="outside or misaligned"):
                peer.view(offset, count, torch.float32)
    finally:
        seg.unlink()
    link = shm.SHM_DIR / "flodl-seg-run-1.0-r0"
    os.symlink("/etc/passwd", link)
    try:
        with pytest.raises(ProtocolError, match="cannot open"):
            shm.Segment.open(link)  # never through a link
    finally:
        link.unlink()


def test_checked_path_accepts_only_the_runs_own_names():
    ok = str(shm.SHM_DIR / f"{shm.prefix('x')}123.0-r4")
    assert shm.checked_path(ok, "x", "r4") is not None
    assert shm.checked_path(ok, "x", "r5") is None  # another rank's segment
    assert shm.checked_path(ok, "y", "r4") is None
    assert shm.checked_path(str(shm.SHM_DIR / "sub" / f"{shm.prefix('x')}123-r4"), "x", "r4") is None
    assert shm.checked_path(str(shm.SHM_DIR / f"{shm.prefix('x')}../../etc-r4"), "x", "r4") is None


def test_sweep_removes_segments_of_dead_processes_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = shm.SHM_DIR / f"{shm.prefix('sweep-run')}{int(dead.stdout)}.0-update"
    live = shm.path_for("sweep-run", "probe")
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        assert shm.sweep_stale() >= 1
        assert not stale.exists() and live.exists()
    finally:
        shm.unlink(stale)
        shm.unlink(live)


async def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    """Wait for ``cond`` (checked every 20 ms): returns as soon as it holds, so the generous deadline
    costs nothing on an idle machine and keeps a loaded one from failing on speed alone."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(0.02)


async def test_the_lane_leaves_no_file_behind():
    ctl, task = await controller()
    models = [Big(s) for s in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=True) for r, mo in enumerate(models)]
    await asyncio.gather(*[asyncio.to_thread(a.average, 1.0) for a in avgs])
    assert torch.equal(models[0].w, models[1].w)
    seg = avgs[0].segment.bytes
    assert seg.data_ptr() <= models[0].w.data_ptr() < seg.data_ptr() + seg.numel()  # the model trains in its segment
    assert avgs[0].live_buckets == {0, 1}  # parameters and the floating buffer: a Sync round copies nothing
    # the rank segments were unlinked once mapped; the probe and update segment remain while the run does
    mine = {shm.Path(ctl.probe_path).name, ctl.update_seg.path.name}
    assert mine <= set(_ours()) and not any(a.segment.path.exists() for a in avgs)
    for a in avgs:
        a.close()
    await stop(ctl, task, avgs)
    assert not mine & set(_ours())


@pytest.mark.parametrize(
    "case, reason",
    [
        ("foreign", "not a segment of its own"),
        ("other-rank", "not a segment of its own"),
        ("outside", "outside or misaligned"),
        ("frame", "carries a frame"),
    ],
)
async def test_forged_lane_headers_are_dropped_with_a_reason(case, reason, caplog):
    ctl, task = await controller()
    ctl.admit(b"rank0.x", 0)
    own = shm.Segment.create(shm.path_for(RUN, "r0"), 16)
    other = shm.Segment.create(shm.path_for(RUN, "r1"), 16)
    try:
        header = {
            "foreign": snapshot_header(shm="/etc/passwd"),
            "other-rank": snapshot_header(shm=str(other.path)),
            "outside": snapshot_header(shm=str(own.path), shm_offset=8),
            "frame": snapshot_header(shm=str(own.path)),
        }[case]
        send_raw(ctl.port, b"rank0.x/bulk", header, b"\0" * 16) if case == "frame" else _send_raw_header(ctl.port, header)
        await _until(lambda: ctl.drops["bulk"], "the forged header to be dropped")
        assert ctl.drops["bulk"] == 1 and ctl.rounds.current is None and ctl.rounds.rounds_done == 0
        assert reason in caplog.text
        assert other.path.exists()  # never touched (a mapped own segment is unlinked; a foreign one is not mapped at all)
    finally:
        own.unlink()
        other.unlink()
        await stop(ctl, task)


def _send_raw_header(port: int, header: m.Snapshot) -> None:
    import zmq

    from flodl.wire.codec import FrameWriter

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"rank0.x/bulk")
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([FrameWriter(SECRET, RUN, "rank0.x/bulk").encode(header)])
    sock.close()


async def test_an_average_whose_slot_was_reused_is_never_applied():
    ctl, task = await controller()
    models = [Big(s) for s in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=True) for r, mo in enumerate(models)]
    await asyncio.gather(*[asyncio.to_thread(a.average, 1.0) for a in avgs])  # round 0: maps the update segment
    # round 1 sent without waiting, rank 0 first (its last poll comes before the round can finish);
    # before rank 0 reads the average the slot is claimed by round 3
    for a in avgs:
        await asyncio.to_thread(a.average, 1.0, block=False)
    await _until(lambda: ctl.rounds.rounds_done == 2, "round 1 to finish")
    before = models[0].w.detach().clone()
    ctl.update_seg.stamp(3)

    def received() -> bool:  # round 1 finished at the controller; its update may still be on its way here
        avgs[0].poll()
        return 1 not in avgs[0].pending

    await _until(received, "rank 0 to receive round 1's update")
    assert avgs[0].overruns >= 1
    assert torch.equal(models[0].w, before)  # kept its own values, nothing half-applied
    for a in avgs:
        a.close()
    await stop(ctl, task, avgs)


def test_a_controller_without_shm_keeps_everyone_on_the_wire(monkeypatch):
    monkeypatch.setenv("FLODL_SHM", "off")

    async def main():
        ctl, task = await controller()
        assert ctl.probe_path == ""
        avg = rank_side(ctl, 0, Big(0), lane=False)
        await asyncio.to_thread(avg.average, 1.0)
        assert ctl.lane_bytes == 0 and ctl.rounds.rounds_done == 1
        await stop(ctl, task, [avg])

    asyncio.run(main())


async def test_a_round_waits_at_the_gate_until_every_lane_rank_has_read_the_last_average():
    ctl, task = await controller()
    models = [Big(s) for s in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=True) for r, mo in enumerate(models)]
    for a in avgs:  # round 0 overlaps training (Cadence): nobody waits for it
        await asyncio.to_thread(a.average, 1.0, block=False)
    await _until(lambda: ctl.rounds.rounds_done == 1, "round 0 to finish")
    # rank 0 reads round 0 and sends round 1; rank 1 may not have read round 0 yet
    await asyncio.to_thread(avgs[0].average, 1.0, block=False)
    await _until(lambda: ctl.rounds.held.get(1), "rank 0's round-1 slices to wait at the gate")
    assert ctl.rounds.current is None and ctl.update_seg.stamp_of(ctl.update_seg) == 0  # round 0's average is intact
    await asyncio.to_thread(avgs[1].average, 1.0, block=False)  # reads round 0 first, then opens the gate
    await _until(lambda: ctl.rounds.rounds_done == 2, "round 1 to finish")
    for a in avgs:
        await asyncio.to_thread(a.settle)
    assert torch.allclose(models[0].w, models[1].w, atol=1e-5)  # blended (local + avg − snapshot): equal up to rounding
    assert ctl.rounds.aborted == 0 and sum(a.overruns for a in avgs) == 0
    for a in avgs:
        a.close()
    await stop(ctl, task, avgs)


async def test_a_round_held_at_the_gate_by_a_silent_rank_aborts_after_the_timeout():
    ctl, task = await controller(timeout_s=0.5)
    models = [Big(s) for s in range(2)]
    avgs = [rank_side(ctl, r, mo, lane=True) for r, mo in enumerate(models)]
    await asyncio.gather(*[asyncio.to_thread(a.average, 1.0) for a in avgs])
    await asyncio.to_thread(avgs[0].average, 1.0, block=False)  # rank 1 never sends round 1
    await _until(lambda: ctl.rounds.aborted == 1, "the gated round to abort")
    await asyncio.to_thread(avgs[0].settle)
    assert ctl.rounds.next_round == 2 and not ctl.rounds.held and avgs[0].aborted == 1
    for a in avgs:
        a.close()
    await stop(ctl, task, avgs)


def test_a_full_shm_is_an_error_at_creation_never_a_crash_later(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a small tmpfs)")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        monkeypatch.setattr(shm, "SHM_DIR", small)
        with pytest.raises(OSError):
            shm.Segment.create(shm.path_for("full-run", "update"), 8 << 20)  # a SIGBUS at the first write, without fallocate
        assert list(small.iterdir()) == []  # nothing left behind
        seg = shm.SnapshotSegment.create_for("full-run", 0, [4 << 20], [64 << 10])  # the live area fits, the slot does not
        assert not seg.ready_slot()
        seg.view(0, 1000, torch.float32).fill_(1.0)  # the backed part is writable
        seg.unlink()
        del seg
    finally:
        # lazy: a mapping the interpreter has not released yet must not leave the mount behind
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_sweep_takes_a_zombies_segments():
    """A controller killed outright is a zombie until its parent reaps it; the worker sweeps in that
    window, and the zombie's segments must go (signal 0 alone calls it alive)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    zombie = shm.SHM_DIR / f"{shm.prefix('sweep-zombie')}{child.pid}.0-probe"
    try:
        for _ in range(500):  # exited but not reaped: /proc says Z
            state = open(f"/proc/{child.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                break
            threading.Event().wait(0.01)
        zombie.write_bytes(b"x")
        assert shm.sweep_stale() >= 1 and not zombie.exists()
    finally:
        child.wait()
        shm.unlink(zombie)
