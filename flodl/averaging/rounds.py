"""The round core of CPU averaging: snapshot slices in, weighted averages out, no sockets.

Both ends that average on the CPU run it: the controller's bulk server
(``server.py``) and a worker's host relay (``relay.py``). They collect rounds
the same way and differ only in where an average goes, their ``Egress``: back
to the sources that sent it (the controller), or upstream (a relay). What the
core needs of the socket its sources send to is an ``Endpoint``.

Each round is a small state machine:

    Idle ──first slice──▶ Collecting ──every expected source's slices in──▶ Ready ──averages out──▶ Idle
                               │                                              └──handed over (relay)──▶ Idle when its egress says
                               └──snapshot_timeout_secs──▶ aborted (Update{aborted}) ──▶ Idle

A snapshot arrives as slices of at most 8 MiB (``bulk.py``); each slice is
folded into one float32 accumulator as it comes (inline: well under a
millisecond a slice), so an end holds one model's worth of accumulator plus a
few slices per peer, not one model per rank. Parameters are weighted by the
batches each rank trained; floating buffers count equally among the ranks
that trained. A round that times out is aborted (counted, the ranks told to
keep their own parameters); its late slices are stale and dropped, so none
leaks into a later round.

A **source** is what sends one snapshot per round: a rank, or a host relay
that pre-averaged its host's ranks and sends their weighted average with the
summed weight and the count of ranks that trained (``Snapshot.ranks``, which
weighs floating buffers).

When the accumulator is shared memory that ranks on the same host read the
average out of (the same-host lane, ``shm.py``), it is reused every round, so
a round opens only once every rank on the lane has sent a header of it (which
it does only after reading the previous average): the gate.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import ProtocolError
from ..wire import messages as m
from ..wire.bulk import DTYPES, itemsize, slices
from ..wire.quant import BY_WIRE_NAME

log = logging.getLogger("flodl.averaging")

#: Rounds whose folded sources are remembered (``Rounds.landed``): a dead rank's last window is
#: settled within a window or two of its round.
LANDED_KEPT = 64


@dataclass
class Round:
    """One round's bookkeeping and accumulator: who it waits for, what each source sent, what went out."""

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
    streamed: set = field(default_factory=set)  # (bucket, start) of slices already sent on
    # (bucket, start) -> the divisor its folds were scaled by (1.0: not pre-normalised, divided when it goes out)
    norm: dict = field(default_factory=dict)
    # (bucket, start) -> the summed raw scale (weight, or ranks for buffers) of the sources folded into it
    mass: dict = field(default_factory=dict)
    # (bucket, start) -> the sources folded into it: the first writes it, it streams once every expected
    # source is in, and a relay names them upstream (``Snapshot.folded``)
    sources: dict = field(default_factory=dict)
    # source -> the ranks folded into every slice of its so far (a relay's ``Snapshot.folded``; a rank: itself)
    members: dict = field(default_factory=dict)
    # (weight, ranks trained) a relay sent upstream with the round's first slice: every later slice says the
    # same (the controller rejects a source whose weight changes within a round), even after a local rank died
    sent_weight: tuple[float, int] | None = None
    handed_over: bool = False  # every slice is in and sent on; the average comes from elsewhere (a relay's upstream)
    # the layout its averages go out in, when it is not ``dtypes`` (compressed buckets sent whole: deltas.py)
    out_dtypes: list[str] | None = None

    @property
    def total(self) -> int:
        return sum(self.numels)

    def fits(self, header: Any) -> bool:
        """Does ``header`` describe this round's model layout?"""
        return list(header.groups) == self.groups and list(header.dtypes) == self.dtypes and list(header.numels) == self.numels

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

    def slices(self) -> list[tuple[int, int, int]]:
        """``(bucket, start, count)`` of every slice of the round's model."""
        return slices(self.numels, [itemsize(d) for d in self.dtypes])

    def fold(self, source: int, msg: m.Snapshot, piece: torch.Tensor) -> None:
        """acc[slice] (+)= scale · piece, one pass over memory.

        The first contribution to a slice writes it (the accumulator starts
        uninitialised: no zero-fill pass). When every expected source's weight is
        already known (their first slices came first, as they do), each
        contribution is scaled by weight / total at once, so the slice needs no
        division pass before it goes out. Every fold of a slice uses the divisor
        its first fold chose, and the slice keeps the summed raw scale of what
        was folded into it (``mass``): a source that dies halfway through its
        snapshot is in some slices and not others, and each slice is still
        divided by exactly what it holds (``averaged``).
        """
        key = (msg.bucket, msg.start)
        seg = self.acc[msg.bucket][msg.start : msg.start + msg.count]
        codec = BY_WIRE_NAME.get(self.dtypes[msg.bucket])
        if codec is not None:  # a compressed delta (every source's of this bucket): averaged as the values are
            piece = codec.decode(piece, msg.count)
        norm = self.norm.get(key)
        if norm is None:
            norm = self.norm[key] = self.total_for(msg.bucket) if self.scale_known() else 1.0
        w = float(msg.weight)
        raw = w if self.groups[msg.bucket] == "p" else (float(msg.ranks) if w > 0 else 0.0)
        scale = raw / norm
        if key not in self.sources:  # the first contribution writes the slice
            torch.mul(piece, scale, out=seg)
        elif scale:
            seg.add_(piece, alpha=scale)
        self.mass[key] = self.mass.get(key, 0.0) + raw
        self.sources.setdefault(key, set()).add(source)

    def averaged(self, bucket: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(average, accumulator slice)`` of one slice: normalised in place, in its bucket's dtype.

        The divisor is the summed raw scale of the sources folded into this
        slice (parameters: batches trained; floating buffers: ranks that
        trained); a slice folded pre-normalised by exactly that needs no
        division. The average is the accumulator slice itself for float32,
        and for a compressed bucket (float32 deltas: the egress encodes them).
        """
        key = (bucket, start)
        norm, mass = self.norm.get(key, 1.0), self.mass.get(key, 0.0)
        acc = self.acc[bucket][start : start + count]
        if mass > 0 and abs(mass - norm) > 1e-9 * norm:  # what it holds is not what it was scaled for
            acc.div_(mass / norm)
        dtype = DTYPES.get(self.dtypes[bucket], torch.float32)
        return (acc if dtype is torch.float32 else acc.to(dtype)), acc


def empty_update(layout: Any, number: int, *, aborted: bool) -> m.Update:
    """Round ``number``'s update with no slice (aborted, or nobody trained); ``layout`` is a round or a header."""
    return m.Update(
        round=number,
        aborted=aborted,
        ranks=0,
        groups=list(layout.groups),
        dtypes=list(layout.dtypes),
        numels=list(layout.numels),
        bucket=-1,
        start=0,
        count=0,
        shm="",
        shm_offset=0,
    )


class Endpoint(Protocol):
    """What the round core needs of the socket its sources send to (``server.CpuAveraging``)."""

    def counted(self) -> set[int]:
        """The ranks a round still waits for (alive, or dead with slices still to take); it stops waiting for the rest."""
        ...

    def expected(self, number: int) -> set[int]:
        """The sources round ``number`` waits for."""
        ...

    def lane_ranks(self) -> set[int] | None:
        """Ranks on the same-host lane; None while no shared accumulator exists (no gate)."""
        ...

    def accumulators(self, number: int, numels: list[int]) -> list[torch.Tensor]:
        """Round ``number``'s float32 accumulators."""
        ...

    def broadcast(self, header: m.Update, frames: list, *, lane: m.Update | None = None) -> None:
        """``header`` and its frames to every source; those on the lane get ``lane`` alone when given."""
        ...


class Egress(Protocol):
    """Where a round's averages go: back to its sources (the controller), or upstream (a host relay)."""

    async def slice_ready(self, rnd: Round, bucket: int, start: int, count: int) -> None:
        """Every expected source's part of this slice is folded in (the rest of the round may still be arriving)."""
        ...

    async def round_ready(self, rnd: Round) -> bool:
        """Every expected source's snapshot is in.

        True: the round is done. False: it is handed over, its average comes
        later from elsewhere, and the egress ends it then (``Rounds.round_done``
        or ``Rounds.close``).
        """
        ...

    def round_overdue(self, rnd: Round) -> None:
        """A round handed over has waited past the timeout for its average."""
        ...


class Rounds:
    """Orders rounds, folds each source's slices into the open one, and hands what is ready to the egress.

    The endpoint puts ``(source, header, slice)`` into ``queue`` and calls
    ``take`` with each, and ``check`` often (timeouts need it when nothing
    arrives). A slice of a later round waits in ``held`` until its round opens.
    """

    def __init__(
        self,
        *,
        endpoint: Endpoint,
        egress: Egress,
        timeout_s: float,
        clock: Callable[[], float],
        drops: Counter[str],
        on_round: Callable[[int, float], None],
        join_late: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.egress = egress
        self.timeout_s = timeout_s
        self.clock = clock
        self.drops = drops  # the endpoint's tally: what was dropped and why is reported as one
        self.on_round = on_round
        # a host relay starts at whatever round its ranks send first: it may join a running job
        self.join_late = join_late
        self.current: Round | None = None
        self.next_round = 0
        self.queue: asyncio.Queue = asyncio.Queue()  # slices to fold: the endpoint's intake, and held ones replayed
        # slices of later rounds from ranks a window ahead (CPU Cadence/Async keep two
        # windows in flight): held until their round opens, at most a window per rank
        self.held: dict[int, list] = {}
        self.arrived: dict[int, set[int]] = {}  # round -> sources a slice of it came from
        self.gate_since: float | None = None  # when the next round first waited at the gate
        self.rounds_done = 0
        self.aborted = 0
        self.round_ms: list[float] = []
        # round -> {source whose snapshot it folded whole: the ranks in every slice of it} (empty: aborted),
        # for the last few rounds: the controller's ledger asks whether a rank that died had its last
        # window's snapshot in
        self.landed: dict[int, dict[int, set[int]]] = {}

    async def take(self, source: int, msg: m.Snapshot, piece: torch.Tensor) -> None:
        """Fold one slice into its round, or hold it for a later round, or drop it as stale.

        Raises:
            ProtocolError: ``bulk`` for a slice that breaks its round: another model
                layout, a weight that changed within the round, more than one snapshot.
        """
        if self.join_late:
            self.join_late = False
            self.next_round = max(self.next_round, msg.round)
        if msg.round < self.next_round:
            self.drops["stale"] += 1  # a round already done or aborted
            return
        self.arrived.setdefault(msg.round, set()).add(source)
        if self.current is None and msg.round == self.next_round:
            if not self._gate_open(msg.round):
                self.gate_since = self.gate_since or self.clock()
                self.held.setdefault(msg.round, []).append((source, msg, piece))
                return
            self._start(msg)
        rnd = self.current
        if rnd is None or msg.round != rnd.number:
            self.held.setdefault(msg.round, []).append((source, msg, piece))
            return
        if not rnd.fits(msg):
            raise ProtocolError("bulk", f"rank {source}'s snapshot does not have the round's model layout")
        if source not in rnd.weights and msg.weight > 0 and not any(w > 0 for w in rnd.weights.values()):
            # the round's clock starts with the first rank that trained: a joining rank
            # sends its empty snapshot a window early and must not time the round out
            rnd.started = self.clock()
        if rnd.weights.setdefault(source, msg.weight) != msg.weight or rnd.counts.setdefault(source, msg.ranks) != msg.ranks:
            raise ProtocolError("bulk", f"source {source} changed its weight within round {rnd.number}")
        if rnd.received[source] + msg.count > rnd.total:
            raise ProtocolError("bulk", f"rank {source} sent more than one snapshot for round {rnd.number}")
        # inline, not in a worker thread: a fold is well under a millisecond per slice,
        # while handing it to a thread costs up to the GIL switch interval (5 ms) twice
        folded = set(msg.folded) if msg.folded else {source}
        rnd.members[source] = rnd.members[source] & folded if source in rnd.members else folded
        rnd.fold(source, msg, piece)
        rnd.received[source] += msg.count
        key = (msg.bucket, msg.start)
        if rnd.expected and rnd.expected <= rnd.sources[key]:
            # streaming: this slice is in from every expected source, send its average now while
            # the rest still arrives (receiving and sending overlap). By who, not how many: a source
            # the round does not expect (one that died after sending this round ahead, its slices
            # held at the gate; a joiner's early empty snapshot) must not stand in for one it does
            await self.egress.slice_ready(rnd, msg.bucket, msg.start, msg.count)
        if rnd.expected and rnd.complete() >= rnd.expected:
            await self._finish(rnd)

    async def check(self) -> None:
        """Finish the open round once nobody live is missing, abort it after the timeout; likewise a round at the gate."""
        rnd = self.current
        if rnd is None:
            self._check_gate()
            return
        if rnd.handed_over:
            # its average comes from elsewhere now: the egress says what the wait is worth
            if self.clock() - rnd.started > self.timeout_s:
                self.egress.round_overdue(rnd)
            return
        rnd.expected &= self.endpoint.counted()  # a rank that left is not waited for
        if rnd.expected and rnd.complete() >= rnd.expected:
            await self._finish(rnd)
            return
        if (self.clock() - rnd.started) > self.timeout_s:
            missing = sorted(rnd.expected - rnd.complete())
            log.warning("averaging round %d aborted: no complete snapshot from rank(s) %s within %g s", rnd.number, missing, self.timeout_s)
            self.close(rnd.number, rnd, aborted=True)

    def round_done(self, rnd: Round) -> None:
        """Count a finished round (its average is out), time it, and move to the next."""
        ms = (self.clock() - rnd.started) * 1000.0
        self.round_ms.append(ms)
        self.rounds_done += 1
        self._remember(rnd.number, {s: rnd.members.get(s, {s}) for s in rnd.complete()})
        self._next(rnd.number)
        self.on_round(rnd.number, ms)

    def close(self, number: int, layout: Any, *, aborted: bool) -> bool:
        """End round ``number`` without an average (aborted, or nobody trained): its sources are told, the round is passed.

        Only the round open, or next to open: for any other nothing here waits
        on it, and nothing is done (False). ``layout`` is a round or a header.
        """
        if number != (self.current.number if self.current is not None else self.next_round):
            return False
        self.endpoint.broadcast(empty_update(layout, number, aborted=aborted), [])
        self.aborted += aborted
        self._remember(number, {})
        self._next(number)
        return True

    def _remember(self, number: int, sources: dict[int, set[int]]) -> None:
        self.landed[number] = sources
        if len(self.landed) > LANDED_KEPT:
            del self.landed[min(self.landed)]

    # ------------------------------------------------------------------ internals

    async def _finish(self, rnd: Round) -> None:
        if rnd.handed_over:
            return  # sent on already: what ends it comes from elsewhere
        if await self.egress.round_ready(rnd):
            self.round_done(rnd)
        else:
            rnd.handed_over = True

    def _gate_open(self, number: int) -> bool:
        """May round ``number`` start writing the shared accumulator?

        Only once every live rank on the lane expected in it has sent a header
        of it: a rank sends one only after it has read the previous average
        out of the accumulator, so no reader is ever overwritten.
        """
        return self.endpoint.lane_ranks() is None or not self._lane_missing(number)

    def _lane_missing(self, number: int) -> set[int]:
        """Ranks on the lane that round ``number`` expects and that have sent nothing of it yet."""
        expected = self.endpoint.expected(number)
        return {r for r in self.endpoint.lane_ranks() or () if r in expected} - self.arrived.get(number, set())

    def _start(self, msg: m.Snapshot) -> None:
        """Open ``msg``'s round and replay the slices held at its gate."""
        self.gate_since = None
        self.current = self._open(msg)
        for item in self.held.pop(msg.round, []):
            self.queue.put_nowait(item)

    def _open(self, msg: m.Snapshot) -> Round:
        numels = list(msg.numels)
        acc = self.endpoint.accumulators(msg.round, numels)
        return Round(
            number=msg.round,
            started=self.clock(),
            expected=self.endpoint.expected(msg.round),
            groups=list(msg.groups),
            dtypes=list(msg.dtypes),
            numels=numels,
            acc=acc,
        )

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
            self.close(self.next_round, msg, aborted=True)
