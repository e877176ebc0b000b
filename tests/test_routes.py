"""Routes and sizes on real sockets: who a frame comes from is what it proves, not what it claims.

* every flodl socket has ``ZMQ_MAXMSGSIZE``: a stranger's oversize frame closes its
  connection at the size header, is never read into memory and never reaches a handler;
* routing ids are assigned by the controller's ROUTER, so a stranger who connects
  first with a rank's sender name, or takes it after a reset, squats nothing: a
  rank's route is bound by its signed hello and follows its newest signed frame;
* the controller drops its own frames reflected back at it.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import msgpack
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from flodl.averaging.server import CpuAveraging
from flodl.config import DdpRunConfig
from flodl.controller import Controller, LaunchOptions
from flodl.testing import sim
from flodl.testing.sim import SimRankSpec, SimWorker
from flodl.wire import bulk
from flodl.wire import messages as m
from flodl.wire.codec import DEFAULT_MAX_FRAME, HEADER, MAGIC, Envelope, FrameReader, FrameWriter, sign
from flodl.wire.messages import PROTOCOL_VERSION
from flodl.wire.transport import CONTROL_MAX_MSG_BYTES, ControlEndpoint, Routes, make_router

from .conftest import PY

pytestmark = pytest.mark.timeout(90)

SECRET = b"r" * 32
RUN = "routes-run"


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _stranger(port: int, part_bytes: int, parts: int = 1) -> subprocess.Popen:
    """Another process (its memory is not ours) sends one message of ``parts`` parts of ``part_bytes`` each."""
    # linger 3 s, bounded: the message must leave before the process ends, and term() waits for it
    code = (
        f"import zmq,time\nc=zmq.Context();s=c.socket(zmq.DEALER);s.setsockopt(zmq.LINGER,3000)\n"
        f"s.connect('tcp://127.0.0.1:{port}');b=bytes({part_bytes})\ns.send_multipart([b]*{parts});time.sleep(0.5);s.close();c.term()"
    )
    return subprocess.Popen([PY, "-c", code])


async def _disconnected(mon: zmq.Socket, timeout_s: float = 30.0) -> int:
    """Wait for the socket monitor's first EVENT_DISCONNECTED; how many it saw."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mon.poll(0):
            if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
                return 1
        else:
            await asyncio.sleep(0.02)
    return 0


# ------------------------------------------------------------------ message size


async def test_an_oversize_control_frame_closes_the_connection_unread_and_a_max_size_frame_passes():
    got: list[Envelope] = []
    sock, port = make_router(zmq.Context.instance(), "127.0.0.1", 0)
    assert sock.getsockopt(zmq.MAXMSGSIZE) == CONTROL_MAX_MSG_BYTES > DEFAULT_MAX_FRAME
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    ep = ControlEndpoint(sock, secret=SECRET, run_id=RUN, sender="controller", on_message=lambda ident, env: got.append(env))
    ep.start()
    rss = psutil.Process().memory_info().rss
    stranger = _stranger(port, 200 << 20)
    try:
        assert await _disconnected(mon) == 1  # libzmq closed it at the size header
        await asyncio.to_thread(stranger.wait, 30)
        grown = psutil.Process().memory_info().rss - rss
        assert grown < 50 << 20, f"RSS grew by {grown >> 20} MB for a 200 MB frame"
        assert got == [] and ep.drops == {}  # never reached the codec, let alone a handler
        # the largest valid control frame still passes
        big = m.WorkerHello(host="h", pid=1, devices=["x" * 60_000] * 17, versions={})
        frame = FrameWriter(SECRET, RUN, "worker.h.1").encode(big)
        assert DEFAULT_MAX_FRAME - 30_000 < len(frame) <= DEFAULT_MAX_FRAME
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(frame)
        await _until(lambda: got, "the max-size frame")
        assert got[0].msg == big
        dealer.close()
    finally:
        stranger.kill()
        sock.disable_monitor()
        mon.close(linger=0)
        ep.close()


async def test_an_oversize_bulk_part_closes_the_connection_unread():
    actor = CpuAveraging(secret=SECRET, run_id=RUN, bind="127.0.0.1", timeout_s=5.0)
    sock = actor.io.sock
    assert sock.getsockopt(zmq.MAXMSGSIZE) == bulk.MAX_MSG_BYTES > bulk.SLICE_BYTES + DEFAULT_MAX_FRAME
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    actor.start()
    stranger = _stranger(actor.port, bulk.MAX_MSG_BYTES + 1, parts=2)
    try:
        assert await _disconnected(mon) == 1
        assert actor.drops == {} and actor.reader.drops == {} and actor.rounds.queue.empty()
    finally:
        await asyncio.to_thread(stranger.wait, 30)
        sock.disable_monitor()
        mon.close(linger=0)
        actor.close()


# ------------------------------------------------------------------------ routes


def _env(sender: str, newest: bool) -> Envelope:
    return Envelope(4, 11, sender, 1, RUN, None, newest=newest)


def test_a_route_moves_only_on_the_newest_signed_frame():
    routes = Routes()
    assert not routes.follow(_env("rank1.9", True), b"\0a")  # unbound: only a hello binds
    routes.bind("rank1.9", b"\0a")
    assert not routes.follow(_env("rank1.9", False), b"\0b")  # authentic but not the newest (out of order)
    assert routes.get("rank1.9") == b"\0a"
    assert routes.follow(_env("rank1.9", True), b"\0b")  # the rank reconnected
    assert routes.get("rank1.9") == b"\0b" and routes.moves == 1


def _controller(console, *, epochs: int, heartbeat: int = 3, join_timeout: float = 8.0) -> Controller:
    config = DdpRunConfig().with_mode("nccl-cadence").with_heartbeat_timeout_secs(heartbeat)
    launch = LaunchOptions(task="sim:task", epochs=epochs, workers=1, progress=False, join_timeout_secs=join_timeout)
    return Controller(launch, config, secret=SECRET, run_id=RUN, console=console)


def _squatter(addr: str, routing_id: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    sock.send(b"GARBAGE!" + b"\0" * 56)  # counted once the connection is in: proof it holds the id
    return sock


async def _squat_once_free(ctl, addr: str, routing_id: bytes, timeout_s: float = 20.0) -> zmq.Socket:
    """Connect with ``routing_id`` again and again until the controller takes the connection (the id is free)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        drops = ctl.endpoint.drops["bad_magic"]
        sock = _squatter(addr, routing_id)
        try:
            await _until(lambda: ctl.endpoint.drops["bad_magic"] > drops, "the stranger's connection", 0.5)  # noqa: B023 - awaited in this iteration
            return sock
        except AssertionError:
            sock.close()
    raise AssertionError(f"{routing_id!r} never became free")


def _received(socks: list[zmq.Socket]) -> int:
    got = 0
    for s in socks:
        while s.poll(0):
            s.recv_multipart()
            got += 1
    return got


async def test_a_stranger_who_connects_first_with_the_peers_names_squats_nothing(quiet_console):
    """The names a run's peers sign with are in every frame, in clear: a stranger who holds them as
    routing ids before the peers connect must neither block them nor hear what is meant for them."""
    ctl = _controller(quiet_console, epochs=2)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    addr = f"tcp://127.0.0.1:{ctl.port}"
    worker = SimWorker(addr, SECRET, RUN, [SimRankSpec(batch_ms=1), SimRankSpec(batch_ms=1)])
    names = [worker.sender] + [f"rank{r}.sim{id(worker)}" for r in (0, 1)]
    squatters = [_squatter(addr, n.encode()) for n in names]
    try:
        await _until(lambda: ctl.endpoint.drops["bad_magic"] >= len(squatters), "the squatters' connections")
        sim_task = asyncio.create_task(worker.run())
        summary = await asyncio.wait_for(run, 60)
        await sim_task
        assert summary["exit_reason"] == "completed" and summary["deaths"] == []
        assert worker.outcomes == {0: "completed", 1: "completed"}
        assert _received(squatters) == 0
    finally:
        run.cancel()
        for s in squatters:
            s.close()


async def test_a_stranger_racing_a_reset_connection_takes_nothing(quiet_console, monkeypatch):
    """A rank's connection resets; a stranger connects with the rank's name as its routing id before
    the rank reconnects. The rank's next signed frame moves its route to its new connection: it is
    not declared dead, and nothing meant for it reaches the stranger."""
    peers: list = []

    class Recorded(sim._Peer):
        """A sim peer the test can reach; ``held`` queues its frames while it is cut off, as
        ZeroMQ's own pipe does across a real reset (a ``disconnect`` would drop them instead)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.held: list | None = None
            peers.append(self)

        def send(self, msg):
            if self.held is not None:
                self.held.append(msg)
            else:
                super().send(msg)

    monkeypatch.setattr(sim, "_Peer", Recorded)
    training = asyncio.Event()
    ctl = _controller(quiet_console, epochs=40, heartbeat=5)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    addr = f"tcp://127.0.0.1:{ctl.port}"
    worker = SimWorker(addr, SECRET, RUN, [SimRankSpec(batch_ms=2), SimRankSpec(batch_ms=2)], training=training)
    sim_task = asyncio.create_task(worker.run())
    squatter = None
    try:
        await asyncio.wait_for(training.wait(), 30)
        victim = next(p for p in peers if p.sender.startswith("rank1."))
        before = ctl.ctx.members.ranks[1].identity
        victim.held = []
        # what ZeroMQ had already queued goes out before the cut: a real reset loses none of it (the
        # pipe keeps it for the next connection), where ``disconnect`` here would drop it, and a lost
        # window report would leave the controller waiting on a rank that is alive
        await asyncio.sleep(0.2)
        victim.endpoint.io.sock.disconnect(addr)  # the reset
        squatter = await _squat_once_free(ctl, addr, victim.sender.encode())
        victim.endpoint.io.sock.connect(addr)  # the rank reconnects
        held, victim.held = victim.held, None
        for msg in held:
            victim.send(msg)
        await _until(lambda: ctl.ctx.members.ranks[1].identity != before, "rank 1's route to follow its reconnect")
        summary = await asyncio.wait_for(run, 80)
        await sim_task
        assert summary["exit_reason"] == "completed" and summary["deaths"] == [], summary["deaths"]
        assert worker.outcomes == {0: "completed", 1: "completed"}
        assert _received([squatter]) == 0
    finally:
        run.cancel()
        sim_task.cancel()
        if squatter is not None:
            squatter.close()


async def test_the_controllers_own_frames_reflected_back_are_dropped():
    got: list[Envelope] = []
    sock, port = make_router(zmq.Context.instance(), "127.0.0.1", 0)
    ep = ControlEndpoint(sock, secret=SECRET, run_id=RUN, sender="controller", on_message=lambda ident, env: got.append(env))
    ep.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        own = [ep.writer.encode(m.Pong(nonce=i, sent_at=0.0)) for i in range(3)]  # what a sniffer copied off the wire
        own.append(FrameWriter(SECRET, RUN, "controller/bulk").encode(m.Pong(nonce=9, sent_at=0.0)))
        for frame in own:
            dealer.send(frame)
        await _until(lambda: ep.drops["reflected"] == len(own), "the reflected frames to be dropped")
        assert got == [] and ep.reader.accepted == 0
    finally:
        dealer.close()
        ep.close()


async def test_the_controllers_endpoint_answers_an_accepted_ping_and_no_other():
    """``answer_pings``: a Ping's Pong leaves from the endpoint, but only for a frame the reader accepted;
    forged, replayed, wrong-run, reflected, malformed and ill-typed Pings are dropped, counted, unanswered."""
    got: list[Envelope] = []
    sock, port = make_router(zmq.Context.instance(), "127.0.0.1", 0)
    ep = ControlEndpoint(
        sock, secret=SECRET, run_id=RUN, sender="controller", on_message=lambda ident, env: got.append(env), answer_pings=True
    )
    ep.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    worker = FrameWriter(SECRET, RUN, "worker.a")

    def signed(body: list) -> bytes:  # a frame signed with the run's secret around any body
        packed = msgpack.packb(body, use_bin_type=True)
        unsigned = HEADER.pack(MAGIC, PROTOCOL_VERSION, m.Ping.KIND, len(packed)) + packed
        return unsigned + sign(SECRET, unsigned)

    try:
        first = worker.encode(m.Ping(nonce=1, sent_at=0.5))
        tampered = bytearray(worker.encode(m.Ping(nonce=66, sent_at=0.5)))
        tampered[HEADER.size + 2] ^= 0x01
        bad = {
            "bad_tag": [FrameWriter(b"x" * 32, RUN, "worker.a").encode(m.Ping(nonce=60, sent_at=0.5)), bytes(tampered)],
            "replayed": [first],
            "wrong_run": [FrameWriter(SECRET, "other-run", "worker.a").encode(m.Ping(nonce=61, sent_at=0.5))],
            "reflected": [FrameWriter(SECRET, RUN, "controller").encode(m.Ping(nonce=62, sent_at=0.5))],
            "malformed": [first + b"\x00"],
            "schema": [signed(["worker.b", 1, RUN, "63", 0.5]), signed(["worker.b", 2, RUN, 64])],
        }
        dealer.send(first)
        for frames in bad.values():
            for frame in frames:
                dealer.send(frame)
        dealer.send(worker.encode(m.Ping(nonce=2, sent_at=1.5)))
        await _until(lambda: ep.reader.accepted == 2 and sum(ep.drops.values()) == 8, "the pings read or dropped")
        assert {reason: ep.drops[reason] for reason in bad} == {reason: len(frames) for reason, frames in bad.items()}
        reader = FrameReader(SECRET, RUN)
        pongs = []
        deadline = time.monotonic() + 10
        while len(pongs) < 2 and time.monotonic() < deadline:
            if dealer.poll(100):
                env = reader.read(dealer.recv())
                assert env is not None and env.sender == "controller"
                pongs.append(env.msg)
        assert pongs == [m.Pong(nonce=1, sent_at=0.5), m.Pong(nonce=2, sent_at=1.5)]
        await asyncio.sleep(0.2)
        assert not dealer.poll(0)  # nothing answered the dropped ones
        assert [env.msg for env in got] == [m.Ping(nonce=1, sent_at=0.5), m.Ping(nonce=2, sent_at=1.5)]  # still dispatched
    finally:
        dealer.close()
        ep.close()


async def test_an_endpoint_answers_no_ping_unless_asked():
    got: list[Envelope] = []
    sock, port = make_router(zmq.Context.instance(), "127.0.0.1", 0)
    ep = ControlEndpoint(sock, secret=SECRET, run_id=RUN, sender="controller", on_message=lambda ident, env: got.append(env))
    ep.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send(FrameWriter(SECRET, RUN, "worker.a").encode(m.Ping(nonce=1, sent_at=0.5)))
        await _until(lambda: len(got) == 1, "the ping to be dispatched")
        await asyncio.sleep(0.2)
        assert not dealer.poll(0)
    finally:
        dealer.close()
        ep.close()
