"""The CPU averaging backend, rank side: snapshots out, averages in, never blocking on peers.

At the end of a window the rank copies its flat buckets (``flat.py``) and
sends them to the controller over its bulk socket as one multipart message
(a signed ``Snapshot`` header plus raw tensor frames, no copy), then keeps
training. When the round's ``Update`` arrives it is applied at the next batch
boundary as

    local ← local + α · (average − snapshot)

so the average lands and the progress made since the snapshot is kept (at
α = 1; smaller α blends elastically, ``easgd_alpha``). In Sync the rank waits
for the update, so this is exactly ``local ← average``. GPU tensors are staged
through host memory in both directions.

Rounds are numbered by every rank in the same order (every rank enters the
same number of averages per window), so round ``n`` of one rank meets round
``n`` of the others at the controller without anyone naming it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from ..bulk import as_frame, dtype_name, slices, unpack_slice
from ..errors import DeadlineExceeded, ProtocolError
from ..protocol import messages as m
from ..protocol.codec import FrameReader, FrameWriter
from .flat import PARAMS, Averaged, FlatModel

log = logging.getLogger(__name__)


class BulkLink:
    """The rank's bulk-plane DEALER (used by the training thread only)."""

    def __init__(self, addr: str, *, identity: bytes, secret: bytes, run_id: str, sender: str, send_timeout_s: float = 60.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 4)  # back-pressure: a few slices in flight, never a pile of models
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))  # a stalled controller is an error, not a hang
        self.sock.connect(addr)
        self.writer = FrameWriter(secret, run_id, sender)
        self.reader = FrameReader(secret, run_id, max_frame=1 << 20, name=f"{sender} bulk")
        self.rejected = 0

    def send(self, header: m.Snapshot, piece: torch.Tensor) -> None:
        """Send one slice (blocks only while ZeroMQ already holds a few of ours: back-pressure).

        Raises:
            DeadlineExceeded: the controller took nothing for the send timeout.
        """
        try:
            self.sock.send_multipart([self.writer.encode(header), as_frame(piece)], copy=False)
        except zmq.Again:
            raise DeadlineExceeded("the controller's bulk socket took no snapshot slice within the send timeout") from None

    def receive(self, timeout_ms: int) -> tuple[m.Update, torch.Tensor | None] | None:
        """One update slice if it arrives within ``timeout_ms``; bad messages are dropped and counted."""
        if not self.sock.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart(copy=False)
        env = self.reader.read(parts[0].bytes, "controller")
        if env is None or not isinstance(env.msg, m.Update):
            self.rejected += 1
            return None
        try:
            return env.msg, unpack_slice(env.msg, parts[1:])
        except ProtocolError as exc:
            self.rejected += 1
            log.error("rejected an update from the controller: %s", exc)
            return None

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass
class _Pending:
    """A round this rank has sent its snapshot for, waiting for the average."""

    snap: list[torch.Tensor] | None  # the values sent, on the buckets' devices (None: overwrite)
    left: int  # elements of the average not yet applied
    measure: bool
    sq: list[float]  # running ‖pre‖², ‖post‖², ‖pre − post‖² over parameter slices


class CpuAverager:
    """Averages a ``FlatModel`` through the controller (same interface as the collective one)."""

    backend = "cpu"

    def __init__(self, flat: FlatModel, bulk: BulkLink, *, rank: int, alpha: float = 1.0, timeout_s: float, must_stop: Callable[[], bool]) -> None:
        self.flat = flat
        self.bulk = bulk
        self.rank = rank
        self.alpha = alpha
        self.timeout_s = timeout_s
        self.must_stop = must_stop
        self.round = 0
        # a rank that joined a running job holds no consensus yet: it trains nothing
        # and takes the next real average as its parameters (weight 0, overwrite)
        self.adopting = False
        self.pending: dict[int, _Pending] = {}
        self.last_drift: tuple[float | None, float, float] | None = None
        self.applied = self.aborted = 0

    def broadcast_from(self, root: int = 0) -> None:
        """Start every replica from ``root``'s values: a round only ``root`` weighs in."""
        self.average(1.0 if self.rank == root else 0.0, block=True, overwrite=True)

    def average(self, weight: float, *, measure: bool = False, block: bool = True, overwrite: bool = False) -> Averaged:
        """Send this replica's snapshot; with ``block`` wait until the average is applied.

        Raises:
            DeadlineExceeded: no complete update for this round within the timeout.
        """
        start = time.perf_counter()
        adopt = self.adopting
        if adopt:
            weight, measure, block, overwrite = 0.0, False, True, True
        buckets = self.flat.buckets
        layout = dict(groups=[b.group for b in buckets], dtypes=[dtype_name(b.flat.dtype) for b in buckets], numels=[b.numel for b in buckets])
        if block and not measure:
            # nothing trains before the average lands, so the average simply replaces the
            # values and the live buffers can go out as they are: no copy on CPU ranks
            for bucket in buckets:
                bucket.copy_in()
            snap, overwrite = None, True
            host = [b.values.detach() if b.flat.device.type == "cpu" else b.values.detach().to("cpu") for b in buckets]
        else:
            snap = self.flat.snapshot()
            host = [s if s.device.type == "cpu" else s.to("cpu") for s in snap]
            if overwrite:
                snap = None
        mine = self.round
        self.pending[mine] = _Pending(snap, sum(b.numel for b in buckets), measure, [0.0, 0.0, 0.0])
        self.round += 1
        for bucket, first, count in slices(layout["numels"], [t.element_size() for t in host]):
            header = m.Snapshot(rank=self.rank, round=mine, weight=float(weight), bucket=bucket, start=first, count=count, **layout)
            self.bulk.send(header, host[bucket][first : first + count])
            self.poll()  # updates may arrive meanwhile: keep the receive side moving too
        if block:
            # adopting waits a whole window for the peers' average; the controller
            # (which it hears from) bounds that round, so no deadline of our own
            self._wait_for(mine, bounded=not adopt)
        ms = (time.perf_counter() - start) * 1000.0
        d = self.last_drift if measure and self.last_drift else (None, 0.0, 0.0)
        return Averaged(ms, *d) if measure else Averaged(ms)

    def poll(self) -> None:
        """Apply every update slice that has arrived (never blocks)."""
        while (got := self.bulk.receive(0)) is not None:
            self._apply(*got)

    def settle(self) -> None:
        """Wait (bounded) until every round sent has its average applied."""
        for round_ in sorted(self.pending):
            self._wait_for(round_)

    def _wait_for(self, round_: int, *, bounded: bool = True) -> None:
        deadline = time.monotonic() + self.timeout_s
        while round_ in self.pending:
            if self.must_stop():
                return
            if bounded and time.monotonic() > deadline:
                raise DeadlineExceeded(f"no average for round {round_} within {self.timeout_s:g} s")
            got = self.bulk.receive(100)
            if got is not None:
                self._apply(*got)

    def _apply(self, update: m.Update, piece: torch.Tensor | None) -> None:
        pending = self.pending.get(update.round)
        if pending is None:
            return  # a round we hold no snapshot for (done, or given up): stale
        if update.aborted or update.ranks == 0:
            del self.pending[update.round]
            self.aborted += update.aborted
            return
        bucket = self.flat.buckets[update.bucket]
        seg = slice(update.start, update.start + update.count)
        with torch.no_grad():
            avg = piece.to(bucket.flat.device)
            if bucket.copied:  # tensors with storage of their own: refresh our copy first
                bucket.copy_in()
            values = bucket.values[seg]
            if pending.snap is None:
                values.copy_(avg)
            else:
                s = pending.snap[update.bucket][seg]
                if pending.measure and bucket.group == PARAMS:
                    pending.sq[0] += float(s.norm()) ** 2
                    pending.sq[1] += float(avg.norm()) ** 2
                    pending.sq[2] += float(torch.dist(s, avg)) ** 2
                # local + α·(avg − snapshot), in place: two passes, no temporary
                values.add_(avg, alpha=self.alpha).sub_(s, alpha=self.alpha)
            if bucket.copied:
                bucket.copy_out()
        pending.left -= update.count
        if pending.left <= 0:
            del self.pending[update.round]
            if pending.snap is None:
                self.adopting = False  # a whole average landed: this replica holds the consensus
            pre_sq, post_sq, diff_sq = pending.sq
            post = post_sq**0.5
            self.last_drift = ((diff_sq**0.5) / post if post > 1e-10 else None, pre_sq**0.5, post)
            self.applied += 1
