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

Ranks on the controller's own host take the same-host lane (``shm.py``):
their slices are read straight out of their shared-memory segments, and the
accumulator itself lives in the controller's update segment, so their
``Update`` headers carry no frame at all. The accumulator is reused every
round, so a round opens only once every rank on the lane has sent a header of
it (which it does only after reading the previous average: the gate), and
ranks elsewhere get frames copied off it once per slice (a slow peer's queued
frame must not see it rewritten).

A **source** is what sends one snapshot per round: a rank, or a host relay
(``flodl/relay.py``) that pre-averaged its host's ranks and sends their
weighted average with the summed weight and the count of ranks that trained
(``Snapshot.ranks``, which weighs floating buffers). Sources are keyed by their
lowest rank; a relay is waited for while any of its ranks lives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import zmq

from .. import curve, shm
from ..bulk import DTYPES, MAX_MSG_BYTES, as_frame, check_slice, is_announcement, slices, unpack_slice
from ..errors import ProtocolError
from ..protocol import messages as m
from ..protocol.codec import FrameReader, FrameWriter
from ..transport import AsyncSocket, Routes, peer_name

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
    received: Counter = field(default_factory=Counter)  # source -> elements folded
    weights: dict[int, float] = field(default_factory=dict)  # source -> batches trained (summed over a relay's ranks)
    counts: dict[int, int] = field(default_factory=dict)  # source -> ranks that trained in it (weighs buffers)
    folded: Counter = field(default_factory=Counter)  # (bucket, start) -> ranks folded into it
    streamed: set = field(default_factory=set)  # (bucket, start) of slices already sent back
    first: dict = field(default_factory=dict)  # (bucket, start) -> folded pre-normalised?

    @property
    def total(self) -> int:
        return sum(self.numels)

    def scale_known(self) -> bool:
        """Every expected source's weight is known (and so the normalising totals)."""
        return bool(self.expected) and self.expected <= set(self.weights)

    def sums(self, sources: set[int]) -> tuple[float, float]:
        """Summed parameter weight and buffer weight (ranks that trained) of ``sources``."""
        return sum(self.weights[s] for s in sources), float(sum(self.counts[s] for s in sources if self.weights[s] > 0))

    def total_for(self, bucket: int) -> float:
        """The divisor of a bucket: summed weights (parameters) or ranks that trained (buffers)."""
        params, buffers = self.sums(self.expected)
        total = params if self.groups[bucket] == "p" else buffers
        return total if total > 0 else 1.0

    def complete(self) -> set[int]:
        return {r for r, n in self.received.items() if n == self.total}


class CpuAveraging:
    """Collects snapshot slices, averages them on the CPU, sends the average back."""

    def __init__(self, *, secret: bytes, run_id: str, bind: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = FrameReader(secret, run_id, max_frame=1 << 20, name="controller bulk", own="controller")
        self.writer = FrameWriter(secret, run_id, "controller/bulk")
        self.timeout_s = timeout_s
        self.clock = clock
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 4)  # a few slices per peer in flight; TCP holds the rest
        sock.setsockopt(zmq.SNDHWM, 0)  # updates reference the accumulator: never dropped
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)  # a part bigger than a slice closes the connection unread
        curve.server(sock)
        self.port = sock.bind_to_random_port(f"tcp://{bind}")
        self.io = AsyncSocket(sock, self._on_parts)
        self.ranks: dict[bytes, int] = {}  # bulk sender name -> source (a rank, or a relay's lowest rank)
        self.routes = Routes()  # bulk sender name -> the connection its signed headers come on
        self.members: dict[int, set[int]] = {}  # source -> the ranks it carries
        self.relayed: dict[int, int] = {}  # rank -> the relay source that carries it
        self.first_round: dict[int, int] = {}  # source -> the first round it takes part in (joiners start later)
        self.live: Callable[[], set[int]] = lambda: set().union(*self.members.values())  # the controller plugs in its membership
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
        # the same-host lane: a probe ranks check, their mapped segments, our update segment
        self.run_id = run_id
        self.probe_path, self.probe_nonce = "", ""
        if shm.enabled():
            shm.sweep_stale()
            try:
                path, self.probe_nonce = shm.create_probe(run_id)
                self.probe_path = str(path)
            except OSError as exc:  # no usable /dev/shm: every rank stays on the wire
                log.warning("same-host shared-memory lane off: %s", exc)
        self.segments: dict[int, shm.Segment] = {}  # rank -> its snapshot segment, mapped
        self.shm_identities: set[bytes] = set()  # bulk identities of ranks on the lane
        self.update_seg: shm.UpdateSegment | None = None
        self.arrived: dict[int, set[int]] = {}  # round -> ranks a slice of it came from
        self.gate_since: float | None = None  # when the next round first waited at the gate
        self.lane_bytes = 0  # bytes that came through the lane instead of a socket
        self.ingress_bytes = 0  # snapshot bytes that came through the socket

    # ------------------------------------------------------------------ wiring

    def admit(self, identity: bytes, rank: int, *, from_round: int = 0) -> None:
        """``identity`` is the rank's control sender name; its bulk headers are signed as ``<identity>/bulk``.

        A rank joining a running job is expected from ``from_round`` on: the
        rounds before it are its peers' alone.
        A rank whose host relays (``admit_relay``) sends nothing here itself:
        admitting it makes its relay expected from ``from_round``.
        """
        source = self.relayed.get(rank)
        if source is not None:
            self.first_round[source] = from_round
            return
        self.ranks[identity + b"/bulk"] = rank
        self.members[rank] = {rank}
        self.first_round[rank] = from_round

    def admit_relay(self, identity: bytes, ranks: list[int]) -> None:
        """``identity`` (a worker's control sender name, ``/bulk`` added) relays ``ranks``.

        It becomes one source, keyed by the lowest of them, expected once they are admitted.
        """
        source = min(ranks)
        for rank in ranks:
            self.relayed[rank] = source
        self.ranks[identity + b"/bulk"] = source
        self.members[source] = set(ranks)

    def _expected(self, number: int) -> set[int]:
        """The sources round ``number`` waits for: admitted by then, and carrying a live rank."""
        live = self.live()
        return {s for s, ranks in self.members.items() if ranks & live and self.first_round.get(s, number + 1) <= number}

    def start(self) -> None:
        self.io.start()

    def close(self) -> None:
        self.io.close()
        if self.probe_path:
            shm.unlink(self.probe_path)
        if self.update_seg is not None:
            self.update_seg.unlink()

    def _on_parts(self, parts: list) -> None:
        if len(parts) < 2:
            self.drops["malformed"] += 1
            return
        route, header, frames = parts[0], parts[1], parts[2:]
        env = self.reader.read(header, peer_name(route))
        if env is None:
            return
        msg = env.msg
        if isinstance(msg, m.Snapshot) and is_announcement(msg) and not frames:
            self._route(env, route)  # a bulk socket's first header (it may come before the rank is admitted)
            return
        identity = env.sender.encode()  # signed: the routing id is the connection's, chosen by nobody we trust
        rank = self.ranks.get(identity)
        if not isinstance(msg, m.Snapshot) or rank is None or rank != msg.rank:
            self.drops["unauthorized"] += 1
            return
        self._route(env, route)
        if not 0 <= msg.ranks <= len(self.members.get(rank, ())):
            self.drops["bulk"] += 1
            log.error("rejected a snapshot slice from source %d: it claims %d ranks, it carries %d", rank, msg.ranks, len(self.members.get(rank, ())))
            return
        if not msg.shm:
            self.ingress_bytes += sum(len(f) for f in frames)
        try:
            piece = self._lane_slice(identity, rank, msg, frames) if msg.shm else unpack_slice(msg, frames)
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

    def _route(self, env: Any, route: bytes) -> None:
        """The connection that reaches a sender: its first authenticated header binds it, its newest moves it (a reconnect)."""
        if self.routes.get(env.sender) is None:
            self.routes.bind(env.sender, route)
        else:
            self.routes.follow(env, route)

    def _lane_slice(self, identity: bytes, rank: int, msg: m.Snapshot, frames: list) -> torch.Tensor:
        """The slice a header names in the rank's segment (mapped on first use, then unlinked).

        Raises:
            ProtocolError: ``bulk``/``shm`` for frames next to a lane header, a foreign
                path, a layout the header does not hold, or a slice outside the segment.
        """
        if frames:
            raise ProtocolError("bulk", "a shared-memory slice header carries a frame")
        seg = self.segments.get(rank)
        if seg is None or str(seg.path) != msg.shm:
            path = shm.checked_path(msg.shm, self.run_id, f"r{rank}") if self.probe_path else None
            if path is None:
                raise ProtocolError("shm", f"rank {rank} named {msg.shm!r}, not a segment of its own in this run")
            seg = self.segments[rank] = shm.Segment.open(path)
            seg.unlink()  # mapped: the name is no longer needed, and a killed rank leaves nothing
            self.shm_identities.add(identity)
        dtype = check_slice(msg)
        self.lane_bytes += msg.count * dtype.itemsize
        return seg.view(msg.shm_offset, msg.count, dtype)

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
        self.arrived.setdefault(msg.round, set()).add(rank)
        if self.current is None and msg.round == self.next_round:
            if not self._gate_open(msg.round):
                self.gate_since = self.gate_since or self.clock()
                self.held.setdefault(msg.round, []).append((rank, msg, piece))
                return
            self._start(msg)
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
        if rnd.weights.setdefault(rank, msg.weight) != msg.weight or rnd.counts.setdefault(rank, msg.ranks) != msg.ranks:
            raise ProtocolError("bulk", f"source {rank} changed its weight within round {rnd.number}")
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

    def _gate_open(self, number: int) -> bool:
        """May round ``number`` start writing the update segment?

        Only once every live rank on the lane expected in it has sent a header
        of it: a rank sends one only after it has read the previous average
        out of the segment, so no reader is ever overwritten.
        """
        return self.update_seg is None or not self._lane_missing(number)

    def _lane_missing(self, number: int) -> set[int]:
        """Ranks on the lane that round ``number`` expects and that have sent nothing of it yet."""
        expected = self._expected(number)
        return {r for r in self.segments if r in expected} - self.arrived.get(number, set())

    def _start(self, msg: m.Snapshot) -> None:
        """Open ``msg``'s round and replay the slices held at its gate."""
        self.gate_since = None
        self.current = self._open(msg)
        for item in self.held.pop(msg.round, []):
            self.queue.put_nowait(item)

    def _open(self, msg: m.Snapshot) -> _Round:
        numels = list(msg.numels)
        if self.shm_identities and self.update_seg is None:
            try:
                self.update_seg = shm.UpdateSegment.create_for(self.run_id, numels)
            except OSError as exc:
                log.warning("no update segment (%s): averages go to every rank as frames", exc)
                self.shm_identities.clear()
        seg = self.update_seg
        if seg is not None and seg.numels != numels:
            raise ProtocolError("bulk", "a snapshot's model layout differs from the run's")
        return _Round(
            number=msg.round, started=self.clock(), expected=self._expected(msg.round),
            groups=list(msg.groups), dtypes=list(msg.dtypes), numels=numels,
            acc=seg.accumulators(msg.round, numels) if seg is not None else [torch.empty(n, dtype=torch.float32) for n in numels],
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
        scale = w if rnd.groups[msg.bucket] == "p" else (float(msg.ranks) if w > 0 else 0.0)
        if rnd.first[key]:
            scale /= rnd.total_for(msg.bucket)
        if rnd.folded[key] == 0:
            torch.mul(piece, scale, out=seg)
        elif scale:
            seg.add_(piece, alpha=scale)

    async def _send_slice(self, rnd: _Round, bucket: int, start: int, count: int) -> None:
        """Normalise one slice of the accumulator and send it to every rank."""
        param_weight, buffer_weight = rnd.sums(rnd.expected & set(rnd.weights))
        if param_weight <= 0:
            return  # nobody trained: the empty update goes out when the round is done
        out, acc = self._averaged(rnd, bucket, start, count, param_weight, buffer_weight)
        fields = dict(round=rnd.number, aborted=False, ranks=int(buffer_weight), groups=rnd.groups, dtypes=rnd.dtypes,
                      numels=rnd.numels, bucket=bucket, start=start, count=count)
        lane = None
        if self.update_seg is not None:
            lane = m.Update(**fields, shm=str(self.update_seg.path), shm_offset=self.update_seg.offset(bucket, start))
            if out is acc and len(self.shm_identities) < len(self.ranks):
                out = acc.clone()  # frames outlive the slot: a slow peer's queue must not see it reused
        self._broadcast(m.Update(**fields, shm="", shm_offset=0), [as_frame(out)], lane=lane)
        rnd.streamed.add((bucket, start))

    async def _finish(self, rnd: _Round) -> None:
        if sum(rnd.weights.get(r, 0.0) for r in rnd.complete()) > 0:
            # slices not streamed yet: their last fold came before a rank that left
            # stopped being expected; they go out now
            for bucket, start, count in slices(rnd.numels, [DTYPES[d].itemsize for d in rnd.dtypes]):
                if (bucket, start) not in rnd.streamed:
                    await self._send_slice(rnd, bucket, start, count)
        else:  # nobody trained: there is nothing to average
            self._broadcast(self._empty(rnd, rnd.number, aborted=False), [])
        self._round_done(rnd)

    def _round_done(self, rnd: _Round) -> None:
        """Count a finished round, time it, and move to the next."""
        ms = (self.clock() - rnd.started) * 1000.0
        self.round_ms.append(ms)
        self.rounds_done += 1
        self._next(rnd.number)
        self.on_round(rnd.number, ms)

    def _averaged(self, rnd: _Round, bucket: int, start: int, count: int, weight: float, trained: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(average, accumulator slice)`` of one slice: normalised in place, in its bucket's dtype.

        ``weight`` and ``trained`` are the sums over the sources that sent it
        (parameters divide by the first, floating buffers by the second); a
        slice folded pre-normalised needs no division. The average is the
        accumulator slice itself for float32.
        """
        total = 1.0 if rnd.first.get((bucket, start)) else (weight if rnd.groups[bucket] == "p" else trained)
        acc = rnd.acc[bucket][start : start + count]
        return self._normalise(acc, total, DTYPES[rnd.dtypes[bucket]]), acc

    @staticmethod
    def _normalise(acc: torch.Tensor, total: float, dtype: torch.dtype) -> torch.Tensor:
        if total > 0 and total != 1.0:
            acc.div_(total)
        return acc if dtype is torch.float32 else acc.to(dtype)

    @staticmethod
    def _empty(layout: Any, number: int, *, aborted: bool) -> m.Update:
        """Round ``number``'s update with no slice (aborted, or nobody trained); ``layout`` is a round or a header."""
        return m.Update(round=number, aborted=aborted, ranks=0, groups=list(layout.groups), dtypes=list(layout.dtypes),
                        numels=list(layout.numels), bucket=-1, start=0, count=0, shm="", shm_offset=0)

    def _next(self, number: int) -> None:
        """Close round ``number`` and replay what was held for the round after it."""
        self.current = None
        self.gate_since = None
        self.next_round = number + 1
        for item in self.held.pop(self.next_round, []):
            self.queue.put_nowait(item)
        for stale in [r for r in self.held if r < self.next_round]:
            self.drops["stale"] += len(self.held.pop(stale))
        for old in [r for r in self.arrived if r < self.next_round]:
            del self.arrived[old]

    async def _check_timeout(self) -> None:
        rnd = self.current
        if rnd is None:
            self._check_gate()
            return
        rnd.expected &= self.live()  # a rank that left is not waited for
        if rnd.expected and rnd.complete() >= rnd.expected:
            await self._finish(rnd)
            return
        if (self.clock() - rnd.started) > self.timeout_s:
            missing = sorted(rnd.expected - rnd.complete())
            log.warning("averaging round %d aborted: no complete snapshot from rank(s) %s within %g s", rnd.number, missing, self.timeout_s)
            self._broadcast(self._empty(rnd, rnd.number, aborted=True), [])
            self.aborted += 1
            self._next(rnd.number)

    def _check_gate(self) -> None:
        """A round waiting at the gate opens once the ranks it waits for are in or gone; it aborts after the timeout."""
        held = self.held.get(self.next_round)
        if not held or self.gate_since is None:
            return
        if self._gate_open(self.next_round):
            self.queue.put_nowait(held.pop(0))  # the first held slice opens it; the rest replay behind it
            return
        if self.clock() - self.gate_since > self.timeout_s:
            _, msg, _ = held[0]
            missing = sorted(self._lane_missing(self.next_round))
            log.warning("averaging round %d aborted: rank(s) %s sent nothing within %g s", self.next_round, missing, self.timeout_s)
            self._broadcast(self._empty(msg, self.next_round, aborted=True), [])
            self.aborted += 1
            self._next(self.next_round)

    def _broadcast(self, header: m.Update, frames: list, *, lane: m.Update | None = None) -> None:
        """``header`` and its frames to every rank; ranks on the lane get ``lane`` alone when given."""
        # through AsyncSocket.send: it re-checks the socket for input after sending,
        # without which an edge-triggered ZeroMQ FD can swallow the next arrival
        encoded = self.writer.encode(header)
        on_lane = self.writer.encode(lane) if lane is not None else None
        for identity in self.ranks:
            route = self.routes.get(identity.decode())
            if route is None:  # never heard from: nothing reaches it yet
                self.drops["unreachable"] += 1
                continue
            parts = [route, on_lane] if on_lane is not None and identity in self.shm_identities else [route, encoded, *frames]
            if not self.io.send(parts, copy=False):
                self.drops["unreachable"] += 1

    def telemetry(self) -> dict:
        ms = sorted(self.round_ms)
        return {
            "rounds": self.rounds_done,
            "aborted": self.aborted,
            "round_ms_p50": ms[len(ms) // 2] if ms else None,
            "round_ms_max": ms[-1] if ms else None,
            "lane_mb": round(self.lane_bytes / 2**20, 1),
            "ingress_mb": round(self.ingress_bytes / 2**20, 1),
            "ingress_bytes": self.ingress_bytes,  # snapshot bytes that came through the socket (exact)
            "relays": len([s for s, ranks in self.members.items() if len(ranks) > 1 or s in self.relayed.values()]),
            "dropped": dict(self.drops) | {f"header_{k}": v for k, v in self.reader.drops.items()},
        }
