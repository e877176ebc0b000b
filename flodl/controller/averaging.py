"""The CPU averaging backend, controller side: rounds of snapshots in, one average out.

Ranks send parameter snapshots to a bulk ROUTER socket of their own (heartbeats
and timing never queue behind a model). Each round is a small state machine:

    Idle ──first slice──▶ Collecting ──every live rank's slices in──▶ Computing ──Update sent──▶ Idle
                               └──snapshot_timeout_secs──▶ aborted (Update{aborted}) ──▶ Idle

A snapshot arrives as slices of at most 8 MiB (``bulk.py``); each slice is
folded into one float32 accumulator as it comes (inline: well under a
millisecond a slice), and the socket stops being read while a few slices
wait to be folded. So the controller holds one model's worth of accumulator plus a few
slices per peer, not one model per rank. Parameters are weighted by the
batches each rank trained; floating buffers count equally among the ranks
that trained. A round that times out is aborted (counted, the ranks told to
keep their own parameters); its late slices are stale and dropped, so none
leaks into a later round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import zmq

from ..bulk import DTYPES, as_frame, slices, unpack_slice
from ..errors import ProtocolError
from ..protocol import messages as m
from ..protocol.codec import FrameReader, FrameWriter
from ..transport import AsyncSocket

log = logging.getLogger("flodl.averaging")

#: Slices received but not yet folded before the socket stops being read.
READ_AHEAD = 4


@dataclass
class _Round:
    number: int
    started: float
    expected: set[int]
    groups: list[str]
    dtypes: list[str]
    numels: list[int]
    acc: list[torch.Tensor]  # float32 accumulators, one per flat tensor
    received: Counter = field(default_factory=Counter)  # rank -> elements folded
    weights: dict[int, float] = field(default_factory=dict)
    folded: Counter = field(default_factory=Counter)  # (bucket, start) -> ranks folded into it
    streamed: set = field(default_factory=set)  # (bucket, start) of slices already sent back
    first: dict = field(default_factory=dict)  # (bucket, start) -> folded pre-normalised?

    @property
    def total(self) -> int:
        return sum(self.numels)

    def scale_known(self) -> bool:
        """Every expected rank's weight is known (and so the normalising totals)."""
        return bool(self.expected) and self.expected <= set(self.weights)

    def total_for(self, bucket: int) -> float:
        """The divisor of a bucket: summed weights (parameters) or ranks that trained (buffers)."""
        ws = [self.weights[r] for r in self.expected]
        total = sum(ws) if self.groups[bucket] == "p" else float(sum(1 for w in ws if w > 0))
        return total if total > 0 else 1.0

    def complete(self) -> set[int]:
        return {r for r, n in self.received.items() if n == self.total}


class CpuAveraging:
    """Collects snapshot slices, averages them on the CPU, sends the average back."""

    def __init__(self, *, secret: bytes, run_id: str, bind: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = FrameReader(secret, run_id, max_frame=1 << 20, name="controller bulk")
        self.writer = FrameWriter(secret, run_id, "controller/bulk")
        self.timeout_s = timeout_s
        self.clock = clock
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 4)  # a few slices per peer in flight; TCP holds the rest
        sock.setsockopt(zmq.SNDHWM, 0)  # updates reference the accumulator: never dropped
        self.port = sock.bind_to_random_port(f"tcp://{bind}")
        self.io = AsyncSocket(sock, self._on_parts)
        self.ranks: dict[bytes, int] = {}  # bulk identity -> rank
        self.first_round: dict[int, int] = {}  # rank -> the first round it takes part in (joiners start later)
        self.live: Callable[[], set[int]] = lambda: set(self.ranks.values())
        self.current: _Round | None = None
        self.next_round = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        # slices of later rounds from ranks a window ahead (CPU Cadence/Async keep two
        # windows in flight): held until their round opens, at most a window per rank
        self.held: dict[int, list] = {}
        self.drops: Counter[str] = Counter()
        self.rounds_done = 0
        self.aborted = 0
        self.round_ms: list[float] = []
        self.on_round: Callable[[int, float], None] = lambda number, ms: None

    # ------------------------------------------------------------------ wiring

    def admit(self, identity: bytes, rank: int, *, from_round: int = 0) -> None:
        """``identity`` is the rank's control routing id; its bulk socket adds ``/bulk``.

        A rank joining a running job is expected from ``from_round`` on: the
        rounds before it are its peers' alone.
        """
        self.ranks[identity + b"/bulk"] = rank
        self.first_round[rank] = from_round

    def _expected(self, number: int) -> set[int]:
        """The live ranks round ``number`` waits for."""
        return {r for r in self.live() if self.first_round.get(r, number + 1) <= number}

    def start(self) -> None:
        self.io.start()

    def close(self) -> None:
        self.io.close()

    def _on_parts(self, parts: list) -> None:
        if len(parts) < 2:
            self.drops["malformed"] += 1
            return
        identity, header, frames = parts[0], parts[1], parts[2:]
        env = self.reader.read(header, identity.decode("utf-8", "replace"))
        if env is None:
            return
        msg = env.msg
        rank = self.ranks.get(identity)
        if not isinstance(msg, m.Snapshot) or rank is None or rank != msg.rank:
            self.drops["unauthorized"] += 1
            return
        try:
            piece = unpack_slice(msg, frames)
        except ProtocolError as exc:
            self.drops["bulk"] += 1
            log.error("rejected a snapshot slice from rank %d: %s", rank, exc.detail)
            return
        if piece is None:
            self.drops["bulk"] += 1
            return
        self.queue.put_nowait((rank, msg, piece))
        # read ahead a few slices while one is folded, then stop: memory stays bounded
        self.io.paused = self.queue.qsize() >= READ_AHEAD

    # -------------------------------------------------------------------- actor

    async def run(self) -> None:
        """Fold slices as they come, finish or abort rounds (the actor's loop)."""
        while True:
            try:
                async with asyncio.timeout(0.1):
                    rank, msg, piece = await self.queue.get()
            except TimeoutError:
                await self._check_timeout()
                continue
            try:
                await self._take(rank, msg, piece)
            except ProtocolError as exc:
                self.drops["bulk"] += 1
                log.error("rejected a snapshot slice from rank %d: %s", rank, exc.detail)
            finally:
                del piece  # release the ZeroMQ buffer before reading more
                if self.io.paused and self.queue.qsize() < READ_AHEAD:
                    self.io.resume()
            await self._check_timeout()

    async def _take(self, rank: int, msg: m.Snapshot, piece: torch.Tensor) -> None:
        if msg.round < self.next_round:
            self.drops["stale"] += 1  # a round already done or aborted
            return
        if self.current is None and msg.round == self.next_round:
            self.current = self._open(msg)
        rnd = self.current
        if rnd is None or msg.round != rnd.number:
            self.held.setdefault(msg.round, []).append((rank, msg, piece))
            return
        if list(msg.groups) != rnd.groups or list(msg.dtypes) != rnd.dtypes or list(msg.numels) != rnd.numels:
            raise ProtocolError("bulk", f"rank {rank}'s snapshot does not have the round's model layout")
        if rank not in rnd.weights and msg.weight > 0 and not any(w > 0 for w in rnd.weights.values()):
            # the round's clock starts with the first rank that trained: a joining rank
            # sends its empty snapshot a window early and must not time the round out
            rnd.started = self.clock()
        if rnd.weights.setdefault(rank, msg.weight) != msg.weight:
            raise ProtocolError("bulk", f"rank {rank} changed its weight within round {rnd.number}")
        if rnd.received[rank] + msg.count > rnd.total:
            raise ProtocolError("bulk", f"rank {rank} sent more than one snapshot for round {rnd.number}")
        # inline, not in a worker thread: a fold is well under a millisecond per slice,
        # while handing it to a thread costs up to the GIL switch interval (5 ms) twice
        self._fold(rnd, msg, piece)
        rnd.received[rank] += msg.count
        key = (msg.bucket, msg.start)
        rnd.folded[key] += 1  # after the fold: it reads the count to know the first contribution
        if rnd.folded[key] == len(rnd.expected) and rnd.expected <= set(rnd.weights):
            # streaming: this slice is in from every rank, send its average now while
            # the rest still arrives (receiving and sending overlap)
            await self._send_slice(rnd, msg.bucket, msg.start, msg.count)
        if rnd.expected and rnd.complete() >= rnd.expected:
            await self._finish(rnd)

    def _open(self, msg: m.Snapshot) -> _Round:
        return _Round(
            number=msg.round, started=self.clock(), expected=self._expected(msg.round),
            groups=list(msg.groups), dtypes=list(msg.dtypes), numels=list(msg.numels),
            acc=[torch.empty(n, dtype=torch.float32) for n in msg.numels],
        )

    @staticmethod
    def _fold(rnd: _Round, msg: m.Snapshot, piece: torch.Tensor) -> None:
        """acc[slice] (+)= scale · piece, one pass over memory.

        The first contribution to a slice writes it (the accumulator starts
        uninitialised: no zero-fill pass). When every expected rank's weight is
        already known (their first slices came first, as they do), each
        contribution is scaled by weight / total at once, so the slice needs no
        division pass before it goes back.
        """
        key = (msg.bucket, msg.start)
        seg = rnd.acc[msg.bucket][msg.start : msg.start + msg.count]
        if key not in rnd.first:
            rnd.first[key] = rnd.scale_known()
        w = float(msg.weight)
        scale = w if rnd.groups[msg.bucket] == "p" else (1.0 if w > 0 else 0.0)
        if rnd.first[key]:
            scale /= rnd.total_for(msg.bucket)
        if rnd.folded[key] == 0:
            torch.mul(piece, scale, out=seg)
        elif scale:
            seg.add_(piece, alpha=scale)

    async def _send_slice(self, rnd: _Round, bucket: int, start: int, count: int) -> None:
        """Normalise one slice of the accumulator and send it to every rank."""
        ranks = rnd.expected & set(rnd.weights)
        param_weight = sum(rnd.weights[r] for r in ranks)
        if param_weight <= 0:
            return  # nobody trained: the empty update goes out when the round is done
        buffer_weight = sum(1.0 for r in ranks if rnd.weights[r] > 0)
        total = param_weight if rnd.groups[bucket] == "p" else buffer_weight
        if rnd.first.get((bucket, start)):
            total = 1.0  # folded pre-normalised
        out = self._normalise(rnd.acc[bucket][start : start + count], total, DTYPES[rnd.dtypes[bucket]])
        header = m.Update(round=rnd.number, aborted=False, ranks=len(ranks), groups=rnd.groups, dtypes=rnd.dtypes,
                          numels=rnd.numels, bucket=bucket, start=start, count=count)
        self._broadcast(header, [as_frame(out)])
        rnd.streamed.add((bucket, start))

    async def _finish(self, rnd: _Round) -> None:
        if sum(rnd.weights.get(r, 0.0) for r in rnd.complete()) > 0:
            # slices not streamed yet: their last fold came before a rank that left
            # stopped being expected; they go out now
            for bucket, start, count in slices(rnd.numels, [DTYPES[d].itemsize for d in rnd.dtypes]):
                if (bucket, start) not in rnd.streamed:
                    await self._send_slice(rnd, bucket, start, count)
        else:  # nobody trained: there is nothing to average
            self._broadcast(self._empty(rnd, aborted=False), [])
        ms = (self.clock() - rnd.started) * 1000.0
        self.round_ms.append(ms)
        self.rounds_done += 1
        self._next(rnd)
        self.on_round(rnd.number, ms)

    @staticmethod
    def _normalise(acc: torch.Tensor, total: float, dtype: torch.dtype) -> torch.Tensor:
        if total > 0 and total != 1.0:
            acc.div_(total)
        return acc if dtype is torch.float32 else acc.to(dtype)

    @staticmethod
    def _empty(rnd: _Round, *, aborted: bool) -> m.Update:
        return m.Update(round=rnd.number, aborted=aborted, ranks=0, groups=rnd.groups, dtypes=rnd.dtypes,
                        numels=rnd.numels, bucket=-1, start=0, count=0)

    def _next(self, rnd: _Round) -> None:
        """Close ``rnd`` and replay what was held for the round after it."""
        self.current = None
        self.next_round = rnd.number + 1
        for item in self.held.pop(self.next_round, []):
            self.queue.put_nowait(item)
        for stale in [r for r in self.held if r < self.next_round]:
            self.drops["stale"] += len(self.held.pop(stale))

    async def _check_timeout(self) -> None:
        rnd = self.current
        if rnd is None:
            return
        rnd.expected &= self.live()  # a rank that left is not waited for
        if rnd.expected and rnd.complete() >= rnd.expected:
            await self._finish(rnd)
            return
        if (self.clock() - rnd.started) > self.timeout_s:
            missing = sorted(rnd.expected - rnd.complete())
            log.warning("averaging round %d aborted: no complete snapshot from rank(s) %s within %g s", rnd.number, missing, self.timeout_s)
            self._broadcast(self._empty(rnd, aborted=True), [])
            self.aborted += 1
            self._next(rnd)

    def _broadcast(self, header: m.Update, frames: list) -> None:
        # through AsyncSocket.send: it re-checks the socket for input after sending,
        # without which an edge-triggered ZeroMQ FD can swallow the next arrival
        encoded = self.writer.encode(header)
        for identity in self.ranks:
            if not self.io.send([identity, encoded, *frames], copy=False):
                self.drops["unreachable"] += 1

    def telemetry(self) -> dict:
        ms = sorted(self.round_ms)
        return {
            "rounds": self.rounds_done,
            "aborted": self.aborted,
            "round_ms_p50": ms[len(ms) // 2] if ms else None,
            "round_ms_max": ms[-1] if ms else None,
            "dropped": dict(self.drops) | {f"header_{k}": v for k, v in self.reader.drops.items()},
        }
