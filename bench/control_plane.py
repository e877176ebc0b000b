"""Control-plane benchmark: how many frames the controller ingests, and how fast it answers.

    python bench/control_plane.py [--quick | --smoke] [--pin]

The real ``Controller`` runs in this process on uvloop. A second (spawned)
process plays one worker with N simulated ranks over real ZeroMQ sockets made
by flodl's own ``make_dealer``: it joins through the whole protocol (hellos,
welcomes, ``RankReady``), takes the one ``Window`` each rank is given (Sync,
non-progressive: a rank's whole partition of the epoch, batch size 1), signs
every ``TimingMsg`` frame of it in advance, then sends them as fast as it can,
so the controller, not the sender, is the bottleneck; each rank then reports
its ``WindowDone`` and the run completes. The controller counts the frames it
handled between the first and the last arrival.

Round trip: before the load, the worker sends ``Ping`` and waits for the
controller's ``Pong`` (rank → controller → rank, signed and verified at both
ends), one at a time, blocking receive, as a rank's link thread does. In turns
with each of those it sends a frame of the ``Ping``'s size to two bare echoes
answering with a frame of the ``Pong``'s size, both ROUTERs made by flodl's
``make_router`` (same socket options) in the controller's process: the
baseline, bare pyzmq in a blocking loop on a thread of its own (own context
and I/O thread); and, to say where flodl's excess goes, the same echo on the
controller's event loop through flodl's ``AsyncSocket`` (no codec). Taking
the three in turns (a fresh random order each turn) makes the machine's drift hit all
three alike: on a small shared VM the same echo swings between 40 and 200 µs
from one minute to the next. A fourth series splits flodl's excess: the same
Ping signed before the clock starts (on a connection of its own) and its Pong
taken unread, as the echoes are, is the controller's share; the rest of the
round trip is the rank's (signing the Ping, verifying the Pong); those two
calls are also timed in place, inside the round trip. ``--pin`` (diagnosis)
runs the controller's process on CPU 0 and the worker's on CPU 1 and writes
``control_plane_pinned.json``: how much of the excess is two processes taking
turns on one core. With ``FLODL_PURE_CODEC=1`` (or where the compiled codec is not built) the
run measures the pure-Python codec and writes ``control_plane_pure.json`` (``_pinned_pure``).

Goals (issues 2, 22): ≥ 50,000 frames/s ingested; round trip p50 ≤ bare pyzmq p50 + 10 µs.
``--smoke`` runs the whole path with tiny sizes (seconds) and writes its JSON
under ``$FLODL_BENCH_RESULTS`` or a temporary folder, never ``bench/results``.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from bench.common import Row, report, size_parser, smoke_results
from flodl import __version__
from flodl.config import DdpRunConfig
from flodl.controller import Controller, ControllerHooks, LaunchOptions, run_loop
from flodl.controller.console import Console
from flodl.plan.metrics import EpochCounters, epoch_rows
from flodl.testing.sim import window_batches
from flodl.wire import messages as m
from flodl.wire.codec import NATIVE, FrameReader, FrameWriter
from flodl.wire.messages import PROTOCOL_VERSION
from flodl.wire.transport import AsyncSocket, make_dealer, make_router

SECRET = bytes.fromhex(os.environ.setdefault("FLODL_BENCH_SECRET", os.urandom(32).hex()))  # children inherit it
RUN = "bench-run"
VERSIONS = {"flodl": __version__, "protocol": str(PROTOCOL_VERSION)}
WORKER = "worker.bench"
#: The sender of the Pings signed ahead (the controller's share of a round trip, ``_round_trips``).
PRESIGNED = "bench.presigned"
#: Round trips dropped at the start of every series (connection set-up, first-call caches).
WARMUP_PINGS = 50
#: A bench process never waits longer than this for one reply.
RECV_TIMEOUT_MS = 30_000


class IngestCount(ControllerHooks):
    """Times the real controller's TimingMsg ingest: how many it handled, the first and the last."""

    def __init__(self) -> None:
        self.count = 0
        self.first = self.last = 0.0

    def handled(self, msg: object) -> None:
        if type(msg) is m.TimingMsg:
            now = time.perf_counter()
            if not self.count:
                self.first = now
            self.count += 1
            self.last = now


def bench_config() -> DdpRunConfig:
    """Sync without progressive dispatch: one window per epoch, each rank its whole partition."""
    return DdpRunConfig().with_mode("nccl-sync").with_progressive_dispatch(False)


def frame_sizes() -> tuple[int, int]:
    """Bytes of a Ping as the worker signs it and of a Pong as the controller signs it."""
    ping = FrameWriter(SECRET, RUN, WORKER).encode(m.Ping(nonce=1000, sent_at=time.perf_counter()))
    pong = FrameWriter(SECRET, RUN, "controller").encode(m.Pong(nonce=1000, sent_at=time.perf_counter()))
    return len(ping), len(pong)


def _recv(sock: zmq.Socket, reader: FrameReader, *kinds: type, timeout_ms: int = 60_000):
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        if poller.poll(1000):
            env = reader.read(sock.recv())
            if env is not None and isinstance(env.msg, kinds):
                return env.msg
    raise TimeoutError(f"no {' or '.join(k.__name__ for k in kinds)}")


def _epoch_row(batches: list[tuple[int, int]]) -> list[list[float]]:
    rows: dict[int, EpochCounters] = {}
    for epoch, samples in batches:
        rows.setdefault(epoch, EpochCounters()).add_batch(samples, 0.5, 1.0, 0.0)
    return epoch_rows(rows)


def sim_worker(
    addr: str, bare_addrs: dict[str, str], nranks: int, frames: int, pings: int, wait_ms: int, out: mp.Queue, cpu: int | None = None
) -> None:
    """The load process: one worker, ``nranks`` ranks, blocking sockets; gives up after ``wait_ms`` without an expected reply.
    ``cpu``: run on that CPU alone (``--pin``), its ZeroMQ I/O thread too (made after)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ctx = zmq.Context()
    reader = FrameReader(SECRET, RUN)
    wsock = make_dealer(ctx, addr)
    wwriter = FrameWriter(SECRET, RUN, WORKER)
    wsock.send(wwriter.encode(m.WorkerHello(host="bench", pid=os.getpid(), devices=["cpu"] * nranks, versions=VERSIONS)))
    welcome = _recv(wsock, reader, m.WorkerWelcome, timeout_ms=wait_ms)
    rtts = _round_trips(ctx, wsock, addr, wwriter, reader, bare_addrs, pings)  # before any load
    ranks = []
    for r in welcome.ranks:
        sock = make_dealer(ctx, addr)
        writer = FrameWriter(SECRET, RUN, f"rank{r}.bench")
        sock.send(
            writer.encode(
                m.RankHello(r, "bench", os.getpid(), "cpu", VERSIONS, "sig", 1, "shuf", frames, "", False, "none", 1, "sample", 1, "")
            )
        )
        ranks.append((r, sock, writer, FrameReader(SECRET, RUN)))
    for r, sock, writer, rdr in ranks:
        w = _recv(sock, rdr, m.RankWelcome, timeout_ms=wait_ms)
        sock.send(writer.encode(m.RankReady(r, w.generation, 0.0)))
    sent = 0
    send_s = 0.0
    while True:  # one Window per rank and epoch (Sync, not progressive); Shutdown ends the run
        cmds = [_recv(sock, rdr, m.Window, m.Shutdown, m.ShutdownWithSave, timeout_ms=wait_ms) for _, sock, _, rdr in ranks]
        if any(isinstance(c, (m.Shutdown, m.ShutdownWithSave)) for c in cmds):
            break
        plans = [window_batches(c, 1, 0.0) for c in cmds]
        # sign everything first: the measurement is the controller's, not the signer's
        signed = [
            [writer.encode(m.TimingMsg(r, e, i + 1, s, 0.5, 1.0, 0.0, 0.0, 1)) for i, (e, s) in enumerate(p)]
            for (r, _, writer, _), p in zip(ranks, plans, strict=False)
        ]
        longest = max(len(f) for f in signed)
        t0 = time.perf_counter()
        for i in range(longest):
            for (_, sock, _, _), fs in zip(ranks, signed, strict=False):
                if i < len(fs):
                    sock.send(fs[i], copy=False)
        send_s += time.perf_counter() - t0
        sent += sum(len(f) for f in signed)
        for (r, sock, writer, _), c, p in zip(ranks, cmds, plans, strict=False):
            n = len(p)
            sock.send(
                writer.encode(
                    m.WindowDone(
                        rank=r,
                        window=c.window,
                        batches=n,
                        consumed=sum(s for _, s in p),
                        loss_sum=0.5 * n,
                        compute_ms=float(n),
                        data_ms=0.0,
                        sync_ms=0.0,
                        wall_ms=float(n),
                        divergence=None,
                        pre_norm=None,
                        post_norm=None,
                        lr=None,
                        epochs=_epoch_row(p),
                        scalars={},
                        regrouped_at=-1,
                        dropped=-1,
                        res={},
                        data={},
                    )
                )
            )
    out.put({"rtts": rtts, "send_s": send_s, "sent": sent})
    for r, sock, writer, _ in ranks:
        sock.send(writer.encode(m.Exiting(r, "done", "")))
    _recv(wsock, reader, m.Shutdown, timeout_ms=wait_ms)
    wsock.send(wwriter.encode(m.Exiting(-1, "done", "")))
    time.sleep(0.2)
    ctx.destroy(linger=100)


def _round_trips(
    ctx: zmq.Context, wsock: zmq.Socket, addr: str, writer: FrameWriter, reader: FrameReader, bare_addrs: dict[str, str], pings: int
) -> dict[str, list[float]]:
    """µs of one-at-a-time round trips to the controller and to each bare echo, taken in turns
    (in a fresh random order each turn: a fixed cyclic order put flodl always right after the
    event-loop echo, which biased its series by ~10 µs), so the machine's drift hits every series
    alike; blocking receives, as a rank's link thread. The first ``WARMUP_PINGS`` of each series
    are dropped."""
    ping_len, _ = frame_sizes()
    frame = os.urandom(ping_len)
    # the controller's share alone: Pings signed before the clock starts (by a sender of their own,
    # on a connection of their own) and the Pong taken unread, as the bare echoes are
    ahead = FrameWriter(SECRET, RUN, PRESIGNED)
    signed = [ahead.encode(m.Ping(i, 0.0)) for i in range(WARMUP_PINGS + pings)]
    server = make_dealer(ctx, addr)
    targets = [("flodl", wsock), ("server", server)] + [(name, make_dealer(ctx, a)) for name, a in bare_addrs.items()]
    rtts: dict[str, list[float]] = {name: [] for name, _ in targets}
    rtts["sign"], rtts["verify"] = [], []
    for _, sock in targets:
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    order = random.Random(0)  # seeded: a rerun takes the same turns
    for i in range(WARMUP_PINGS + pings):
        for name, sock in order.sample(targets, len(targets)):
            if sock is wsock:
                t0 = time.perf_counter()
                frame_out = writer.encode(m.Ping(i, t0))
                t1 = time.perf_counter()
                sock.send(frame_out)
                while True:
                    data = sock.recv()
                    t2 = time.perf_counter()
                    env = reader.read(data)
                    t3 = time.perf_counter()
                    if env is not None and isinstance(env.msg, m.Pong):
                        break
                if i >= WARMUP_PINGS:
                    rtts["sign"].append((t1 - t0) * 1e6)
                    rtts["verify"].append((t3 - t2) * 1e6)
            elif sock is server:
                t0 = time.perf_counter()
                sock.send(signed[i])
                sock.recv()
            else:
                t0 = time.perf_counter()
                sock.send(frame)
                sock.recv()
            if i >= WARMUP_PINGS:
                rtts[name].append((time.perf_counter() - t0) * 1e6)
    wsock.setsockopt(zmq.RCVTIMEO, -1)
    for _, sock in targets[1:]:  # all but the worker's own
        sock.close(linger=0)
    return rtts


class BareEcho:
    """Bare pyzmq: a ROUTER as flodl makes it (own context and I/O thread) answering every
    frame with one of a Pong's size, in a blocking loop on a thread of this process."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock, self.port = make_router(self.ctx, "127.0.0.1", 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.pong = os.urandom(frame_sizes()[1])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bare-echo", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, pong = self.sock, self.pong
        while not self.stop.is_set():
            try:
                identity, _ = sock.recv_multipart()
            except zmq.Again:
                continue
            sock.send_multipart([identity, pong])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def loop_echo(ctx: zmq.Context) -> tuple[AsyncSocket, int]:
    """The same echo on the running event loop through flodl's ``AsyncSocket`` (no codec)."""
    sock, port = make_router(ctx, "127.0.0.1", 0)
    pong = os.urandom(frame_sizes()[1])
    io_ = AsyncSocket(sock, lambda parts: io_.send([parts[0], pong]))
    io_.start()
    return io_, port


def measure(nranks: int, frames: int, pings: int, wait_s: float = 120.0, worker_cpu: int | None = None) -> dict:
    launch = LaunchOptions(task="bench:task", epochs=1, workers=1, progress=False, join_timeout_secs=wait_s)
    ingest = IngestCount()
    ctl = Controller(launch, bench_config(), secret=SECRET, run_id=RUN, console=Console(out=io.StringIO(), live=False), hooks=ingest)
    spawn = mp.get_context("spawn")
    out: mp.Queue = spawn.Queue()
    bare = BareEcho()

    async def main() -> dict:
        task = asyncio.create_task(ctl.run())
        await ctl.ready.wait()
        echo, port = loop_echo(zmq.Context.instance())
        addrs = {"bare": f"tcp://127.0.0.1:{bare.port}", "loop": f"tcp://127.0.0.1:{port}"}
        proc = spawn.Process(
            target=sim_worker, args=(f"tcp://127.0.0.1:{ctl.port}", addrs, nranks, frames, pings, int(wait_s * 1000), out, worker_cpu)
        )
        proc.start()
        try:
            return await task
        finally:
            echo.close()
            proc.join(30)

    try:
        summary = run_loop(main())
    finally:
        bare.close()
    load = out.get(timeout=wait_s)
    span = ingest.last - ingest.first
    return {
        "frames_per_s": ingest.count / span if span > 0 else 0.0,
        "count": ingest.count,
        "sent": load["sent"],
        "sender_rate": load["sent"] / load["send_s"] if load["send_s"] > 0 else 0.0,
        "rtts": load["rtts"],
        "completed": summary["exit_reason"],
    }


# ------------------------------------------------------------------- main


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def main(argv: list[str] | None = None) -> Path:
    parser = size_parser(__doc__, "fewer frames, pings and repetitions (under a minute)", "tiny sizes")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="diagnosis: the controller's process on CPU 0, the worker's on CPU 1 (is the excess two processes sharing a core?)",
    )
    args = parser.parse_args(argv)
    worker_cpu = None
    if args.pin:
        os.sched_setaffinity(0, {0})  # before any context: ZeroMQ's I/O threads inherit it
        worker_cpu = 1
    if args.smoke:
        frames, pings, reps, cases, wait_s = 2_000, 100, 1, (4,), 20.0  # a broken protocol fails in seconds, not minutes
    elif args.quick:
        frames, pings, reps, cases, wait_s = 60_000, 2_000, 1, (8, 32, 128), 120.0
    else:
        frames, pings, reps, cases, wait_s = 200_000, 5_000, 3, (8, 32, 128), 120.0  # this kind of VM is noisy: report medians
    rows: list[Row] = []
    rtts: dict[str, list[float]] = {"flodl": [], "server": [], "bare": [], "loop": [], "sign": [], "verify": []}
    for n in cases:
        runs = []
        for _ in range(reps):
            res = measure(n, frames, pings, wait_s, worker_cpu)
            assert res["completed"] == "completed" and res["count"] == res["sent"] == frames, res
            runs.append(res)
            for name, values in res["rtts"].items():
                rtts[name] += values
        rate = statistics.median(r["frames_per_s"] for r in runs)
        rows.append(Row(f"ingest, {n} ranks", "frames/s (median)", rate, "frames/s", "≥ 50,000 frames/s", rate >= 50_000))
        rows.append(Row(f"ingest, {n} ranks", "frames/s (worst)", min(r["frames_per_s"] for r in runs), "frames/s"))
        rows.append(Row(f"sender, {n} ranks", "frames/s offered", statistics.median(r["sender_rate"] for r in runs), "frames/s"))
    flodl_rtts, bare = rtts["flodl"], rtts["bare"]
    p50, bare50, loop50 = _p(flodl_rtts, 0.5), _p(bare, 0.5), _p(rtts["loop"], 0.5)
    case = "round trip rank→controller→rank"
    rows.append(Row(case, "p50", p50, "µs", f"≤ bare pyzmq + 10 µs ({bare50 + 10:.0f} µs)", p50 <= bare50 + 10))
    rows.append(Row(case, "p99", _p(flodl_rtts, 0.99), "µs"))
    rows.append(Row(case, "p50 over bare pyzmq", p50 - bare50, "µs", "≤ 10 µs", p50 - bare50 <= 10))
    rows.append(Row(case, "p50 over the event-loop echo", p50 - loop50, "µs"))  # the codec and the dispatch alone
    # split at the rank: the same round trip with the Ping signed ahead and the Pong unread
    server50 = _p(rtts["server"], 0.5)
    rows.append(Row(case, "p50, rank's codec excluded (Ping signed ahead, Pong unread)", server50, "µs"))
    rows.append(Row(case, "controller's share over the event-loop echo (p50)", server50 - loop50, "µs"))
    rows.append(Row(case, "rank's share: signing the Ping, verifying the Pong (p50)", p50 - server50, "µs"))
    rows.append(Row(case, "rank signing the Ping, in the round trip (p50)", _p(rtts["sign"], 0.5), "µs"))
    rows.append(Row(case, "rank reading the Pong, in the round trip (p50)", _p(rtts["verify"], 0.5), "µs"))
    rows.append(Row("bare pyzmq DEALER→ROUTER echo", "p50", bare50, "µs"))
    rows.append(Row("bare pyzmq DEALER→ROUTER echo", "p99", _p(bare, 0.99), "µs"))
    rows.append(Row("bare echo on the event loop (AsyncSocket)", "p50", loop50, "µs"))
    rows.append(Row("bare echo on the event loop (AsyncSocket)", "p99", _p(rtts["loop"], 0.99), "µs"))
    ping_len, pong_len = frame_sizes()
    note = (
        f"{frames} pre-signed TimingMsg frames per case, {reps} repetition(s); {len(flodl_rtts)} idle Ping/Pong round trips "
        f"pooled over all runs, taken in turns with as many to each bare echo ({ping_len} B out, {pong_len} B back, same socket options); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.pin:
        note += "; pinned: the controller's process on CPU 0, the worker's on CPU 1"
    note += "; codec: " + ("compiled (flodl/wire/_framec.c)" if NATIVE else "pure Python (FLODL_PURE_CODEC=1, or the extension not built)")
    # a diagnosis never replaces the plain run: pinned, or the pure-Python codec where the compiled one is the product's
    name = ("control_plane_pinned" if args.pin else "control_plane") + ("" if NATIVE else "_pure")
    return report(name, rows, note=note, results=smoke_results() if args.smoke else None)


if __name__ == "__main__":
    main()
