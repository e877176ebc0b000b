"""Control-plane benchmark: how many frames the controller ingests, and how fast it answers.

    python bench/control_plane.py [--quick]

The real ``Controller`` runs in this process on uvloop. A second process plays
one worker with N simulated ranks over real ZeroMQ sockets: it joins through
the whole protocol, signs every ``BatchDone`` frame of its epoch in advance,
then sends them as fast as it can, so the controller, not the sender, is the
bottleneck. The controller counts the frames it handled between the first
and the last arrival. Before the epoch, the worker measures Ping → Pong round
trips through the controller (rank → controller → rank).

Goals (issue 2): ≥ 50,000 frames/s ingested; round trip p50 ≤ 150 µs.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq  # noqa: E402

from bench.common import Row, quick_flag, report  # noqa: E402
from flodl import __version__  # noqa: E402
from flodl.config import DdpRunConfig  # noqa: E402
from flodl.controller import Controller, LaunchOptions, run_loop  # noqa: E402
from flodl.controller.console import Console  # noqa: E402
from flodl.protocol import messages as m  # noqa: E402
from flodl.protocol.codec import FrameReader, FrameWriter  # noqa: E402
from flodl.protocol.messages import PROTOCOL_VERSION  # noqa: E402

SECRET = bytes.fromhex(os.environ.setdefault("FLODL_BENCH_SECRET", os.urandom(32).hex()))  # children inherit it
RUN = "bench-run"
VERSIONS = {"flodl": __version__, "protocol": str(PROTOCOL_VERSION)}


class CountingController(Controller):
    """The real controller, timing its BatchDone ingest."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.count = 0
        self.first = self.last = 0.0

    def _h_batch_done(self, identity, env, msg) -> None:
        now = time.perf_counter()
        if not self.count:
            self.first = now
        self.count += 1
        self.last = now
        super()._h_batch_done(identity, env, msg)


def _recv(sock: zmq.Socket, reader: FrameReader, kind: type, timeout_ms: int = 60_000):
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        if poller.poll(1000):
            env = reader.read(sock.recv())
            if env is not None and isinstance(env.msg, kind):
                return env.msg
    raise TimeoutError(f"no {kind.__name__}")


def sim_worker(addr: str, nranks: int, frames: int, pings: int, out: mp.Queue) -> None:
    """The load process: one worker, ``nranks`` ranks, blocking sockets."""
    ctx = zmq.Context()
    reader = FrameReader(SECRET, RUN)
    wsock = ctx.socket(zmq.DEALER)
    wsock.setsockopt(zmq.ROUTING_ID, b"worker.bench")
    wsock.connect(addr)
    wwriter = FrameWriter(SECRET, RUN, "worker.bench")
    wsock.send(wwriter.encode(m.WorkerHello(host="bench", pid=os.getpid(), devices=["cpu"] * nranks, versions=VERSIONS)))
    welcome = _recv(wsock, reader, m.WorkerWelcome)
    # round trips through the controller, before any load
    rtts = []
    wsock.setsockopt(zmq.RCVTIMEO, 10_000)  # a blocking receive, as a rank's link thread does
    for i in range(pings):
        t0 = time.perf_counter()
        wsock.send(wwriter.encode(m.Ping(nonce=i, sent_at=t0)))
        while True:
            env = reader.read(wsock.recv())
            if env is not None and isinstance(env.msg, m.Pong):
                break
        rtts.append((time.perf_counter() - t0) * 1e6)
    wsock.setsockopt(zmq.RCVTIMEO, -1)
    ranks = []
    for r in welcome.ranks:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"rank{r}.bench".encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(addr)
        writer = FrameWriter(SECRET, RUN, f"rank{r}.bench")
        sock.send(writer.encode(m.RankHello(r, "bench", os.getpid(), "cpu", VERSIONS, "sig", 1, "shuf", frames, False, "none", 1)))
        ranks.append((r, sock, writer, FrameReader(SECRET, RUN)))
    plans = []
    for r, sock, writer, rdr in ranks:
        w = _recv(sock, rdr, m.RankWelcome)
        sock.send(writer.encode(m.RankReady(r, w.generation, 0.0)))
    for r, sock, writer, rdr in ranks:
        plans.append(_recv(sock, rdr, m.StartEpoch))
    # sign everything first: the measurement is the controller's, not the signer's
    frames = [[writer.encode(m.BatchDone(r, p.epoch, i + 1, 1, 0.5, 1.0, 0.0, 0.0)) for i in range(p.size)] for (r, _, writer, _), p in zip(ranks, plans)]
    longest = max(len(f) for f in frames)
    t0 = time.perf_counter()
    for i in range(longest):
        for (r, sock, _, _), fs in zip(ranks, frames):
            if i < len(fs):
                sock.send(fs[i], copy=False)
    send_s = time.perf_counter() - t0
    for (r, sock, writer, _), p in zip(ranks, plans):
        sock.send(writer.encode(m.EpochDone(r, p.epoch, p.size, p.size, 0.5 * p.size, 1.0, 1.0, 0.0, 0.0, p.rounds, {})))
    out.put({"rtts": rtts, "send_s": send_s, "sent": sum(len(f) for f in frames)})
    for r, sock, writer, rdr in ranks:
        _recv(sock, rdr, m.Shutdown, 120_000)
        sock.send(writer.encode(m.Exiting(r, "done")))
    _recv(wsock, reader, m.Shutdown, 120_000)
    wsock.send(wwriter.encode(m.Exiting(-1, "done")))
    time.sleep(0.2)
    ctx.destroy(linger=100)


def measure(nranks: int, frames: int, pings: int) -> dict:
    launch = LaunchOptions(task="bench:task", epochs=1, workers=1, progress=False)
    ctl = CountingController(launch, DdpRunConfig(), secret=SECRET, run_id=RUN, console=Console(out=io.StringIO(), live=False))
    out: mp.Queue = mp.get_context("spawn").Queue()
    me = psutil.Process()

    async def main() -> dict:
        task = asyncio.create_task(ctl.run())
        await ctl.ready.wait()
        proc = mp.get_context("spawn").Process(target=sim_worker, args=(f"tcp://127.0.0.1:{ctl.port}", nranks, frames, pings, out))
        proc.start()
        cpu0 = me.cpu_times()
        summary = await task
        cpu1 = me.cpu_times()
        proc.join(30)
        return summary | {"cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)}

    summary = run_loop(main())
    load = out.get(timeout=60)
    span = ctl.last - ctl.first
    return {
        "frames_per_s": ctl.count / span if span > 0 else 0.0,
        "count": ctl.count,
        "sent": load["sent"],
        "sender_rate": load["sent"] / load["send_s"],
        "rtts": load["rtts"],
        "completed": summary["exit_reason"],
    }


def main() -> None:
    quick = quick_flag(__doc__, "fewer frames, pings and repetitions (under a minute)")
    frames = 60_000 if quick else 200_000
    pings = 2_000 if quick else 5_000
    reps = 1 if quick else 3  # this kind of VM is noisy: report medians
    rows: list[Row] = []
    rtts: list[float] = []
    for n in (8, 32, 128):
        runs = []
        for _ in range(reps):
            res = measure(n, frames, pings)
            assert res["completed"] == "completed" and res["count"] == res["sent"], res
            runs.append(res)
            rtts += res["rtts"]
        rate = statistics.median(r["frames_per_s"] for r in runs)
        rows.append(Row(f"ingest, {n} ranks", "frames/s (median)", rate, "frames/s", "≥ 50,000 frames/s", rate >= 50_000))
        rows.append(Row(f"ingest, {n} ranks", "frames/s (worst)", min(r["frames_per_s"] for r in runs), "frames/s"))
        rows.append(Row(f"sender, {n} ranks", "frames/s offered", statistics.median(r["sender_rate"] for r in runs), "frames/s"))
    rtts.sort()
    p50, p99 = rtts[len(rtts) // 2], rtts[int(len(rtts) * 0.99)]
    rows.append(Row("round trip rank→controller→rank", "p50", p50, "µs", "≤ 150 µs", p50 <= 150))
    rows.append(Row("round trip rank→controller→rank", "p99", p99, "µs"))
    report("control_plane", rows, note=f"{frames} pre-signed BatchDone frames per case, {reps} repetition(s); {len(rtts)} idle Ping/Pong round trips pooled over all runs")


if __name__ == "__main__":
    main()
