"""The host relay: a host's ranks average locally first, one snapshot goes upstream.

On the CPU averaging backend, a worker on another host than the controller
(with two ranks or more) runs a relay on its event loop. Its ranks send their
snapshots to it instead of the controller, over the same-host lane when they
can (``shm.py``), so on a host with N ranks the controller receives one
model per round instead of N: its ingress grows with hosts, not ranks.

The relay runs the controller's bulk server (``server.py``) for its local
ranks and is that server's egress: a slice folded from every local rank is
normalised to the local weighted average and sent upstream at once (streaming
across the host boundary as the controller streams back), carrying the summed
weight and how many local ranks trained (``Snapshot.ranks``), so the
controller's average is exactly what it would have computed from every rank
itself. The controller's averaged slices come back to the relay, land in its
update segment and go to the local ranks as lane headers (or frames).

The controller stays in charge of rounds: it times them out and aborts them,
and the relay passes aborts on. The relay only stops waiting for a local rank
whose process has ended (the worker tells it at once; what that rank sent
before it died is read and taken first), and, as a safety net,
gives a round up when nothing comes back for several snapshot timeouts.

With ``--sync-compression`` the local ranks' snapshots are compressed deltas:
the relay averages them decoded and sends the host's average upstream
compressed again, with error feedback of its own (deltas.py ``Uplink``); the
controller's compressed averages pass through to the ranks as they came.

It imports nothing of ``flodl.controller``: a relaying worker loads only
this package.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import zmq

from ..errors import ProtocolError
from ..wire import curve
from ..wire import messages as m
from ..wire.bulk import MAX_MSG_BYTES, announcement, as_frame, unpack_slice
from ..wire.codec import FrameReader, FrameWriter
from ..wire.quant import BY_WIRE_NAME
from ..wire.transport import AsyncSocket
from .deltas import Uplink
from .rounds import Round
from .server import CpuAveraging

log = logging.getLogger("flodl.relay")


class HostRelay:
    """Pre-averages this host's ranks (weighted) and exchanges one snapshot per round with the controller."""

    def __init__(self, *, secret: bytes, run_id: str, upstream: str, identity: str, ranks: list[int], timeout_s: float) -> None:
        # the local ranks send to a bulk server of our own, as they would to the controller's; we are its egress
        self.local = CpuAveraging(secret=secret, run_id=run_id, bind="127.0.0.1", timeout_s=timeout_s, egress=self, join_late=True)
        self.rounds = self.local.rounds
        self.drops = self.local.drops  # one tally: upstream drops are reported with the local side's
        # what the worker tells its ranks: they connect to us as they would to the controller
        self.port, self.probe_path, self.probe_nonce = self.local.port, self.local.probe_path, self.local.probe_nonce
        self.timeout_s = timeout_s
        self.source = min(ranks)
        self.local_live: set[int] = set(ranks)  # the worker drops a rank the moment its process ends
        self.local.live = lambda: self.local_live
        self.up_writer = FrameWriter(secret, run_id, identity)
        self.up_reader = FrameReader(secret, run_id, max_frame=1 << 20, name=f"{identity} upstream", own=identity)
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)  # routing id assigned upstream; ``identity`` signs our headers
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)  # partial averages are copies we own: queued, never dropped
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        curve.client(sock)
        sock.connect(upstream)
        self.up = AsyncSocket(sock, self._on_upstream)
        self.received_up: Counter[int] = Counter()  # round -> averaged elements back from upstream
        self.egress_bytes = 0
        self.uplink = Uplink()  # compressed averages upstream: the relay's residual

    def start(self) -> None:
        self.local.start()
        self.up.start()
        self.up.send([self.up_writer.encode(announcement(self.source))])  # binds our route upstream before any round

    async def run(self) -> None:
        """The local side's loop: fold the local ranks' slices, send averages upstream."""
        await self.local.run()

    def close(self) -> None:
        self.local.close()
        self.up.close()

    def admit(self, identity: bytes, rank: int) -> None:
        """A local rank, by its control sender name (its bulk headers are signed as ``<identity>/bulk``)."""
        self.local.admit(identity, rank)

    def rank_ended(self, rank: int) -> None:
        """A local rank's process is gone: rounds stop waiting for it, once what it sent before it
        went has been taken (a snapshot that left just before the rank died still counts)."""
        self.local_live.discard(rank)
        self.local.rank_ended(rank)

    # ------------------------------------------- egress: the local side's averages

    async def slice_ready(self, rnd: Round, bucket: int, start: int, count: int) -> None:
        """Send this host's weighted average of one slice upstream (weight 0 when no local rank trained),
        naming the local ranks folded into it (``Snapshot.folded``: the controller's ledger asks)."""
        if (bucket, start) in rnd.streamed:
            return
        if rnd.sent_weight is None:
            params, buffers = rnd.sums(rnd.expected & set(rnd.weights))
            rnd.sent_weight = (params, int(buffers))
        weight, trained = rnd.sent_weight
        out, acc = rnd.averaged(bucket, start, count)
        if rnd.dtypes[bucket] in BY_WIRE_NAME:
            out = self.uplink.out(rnd, bucket, start, count, acc, weight=weight)  # compressed again, a buffer of its own
        elif out is acc:
            out = acc.clone()  # the controller's average will land in this slot: send a copy of ours
        header = m.Snapshot(
            rank=self.source,
            round=rnd.number,
            weight=float(weight),
            ranks=trained,
            groups=rnd.groups,
            dtypes=rnd.dtypes,
            numels=rnd.numels,
            bucket=bucket,
            start=start,
            count=count,
            shm="",
            shm_offset=0,
            folded=sorted(rnd.sources.get((bucket, start), ())),
        )
        if not self.up.send([self.up_writer.encode(header), as_frame(out)], copy=False):
            self.drops["upstream"] += 1
        self.egress_bytes += out.numel() * out.element_size()
        rnd.streamed.add((bucket, start))

    async def round_ready(self, rnd: Round) -> bool:
        """Every local snapshot is in: send what has not gone upstream yet; the controller's average ends the round."""
        for bucket, start, count in rnd.slices():
            await self.slice_ready(rnd, bucket, start, count)
        return False

    def round_overdue(self, rnd: Round) -> None:
        """The safety net: the controller owns the round now, and it may be gone."""
        log.warning("relay: no average for round %d from the controller within %g s; giving it up", rnd.number, self.timeout_s)
        self._close_round(rnd.number, rnd, aborted=True)

    # ---------------------------------------------------------- upstream side

    def _on_upstream(self, parts: list) -> None:
        env = self.up_reader.read(parts[0], "controller")
        if env is None:
            return
        msg = env.msg
        if not isinstance(msg, m.Update):
            self.drops["upstream_unexpected"] += 1
            return
        if msg.round < self.rounds.next_round:
            self.drops["stale"] += 1
            return
        if msg.aborted or msg.ranks == 0:
            self._close_round(msg.round, msg, aborted=msg.aborted)
            return
        rnd = self.rounds.current
        if rnd is None or rnd.number != msg.round:
            self.drops["upstream_unexpected"] += 1  # an average for a round we sent nothing of
            return
        try:
            piece = unpack_slice(msg, parts[1:])
        except ProtocolError as exc:
            self.drops["bulk"] += 1
            log.error("relay: rejected an averaged slice from the controller: %s", exc.detail)
            return
        fields: dict[str, Any] = dict(
            round=msg.round,
            aborted=False,
            ranks=msg.ranks,
            groups=msg.groups,
            dtypes=msg.dtypes,
            numels=msg.numels,
            bucket=msg.bucket,
            start=msg.start,
            count=msg.count,
        )
        lane = self.local.lane_header(fields, msg.bucket, msg.start)
        if lane is not None:
            # local ranks on the lane read the average where our partial sum was (sent already)
            assert piece is not None  # ranks > 0: not an empty update, so it carries a slice
            rnd.acc[msg.bucket][msg.start : msg.start + msg.count].copy_(piece)
        self.local.broadcast(m.Update(**fields, shm="", shm_offset=0), [parts[1]], lane=lane)
        self.uplink.delivered(msg.round, msg.bucket, msg.start)
        self.received_up[msg.round] += msg.count
        if self.received_up[msg.round] >= rnd.total:
            self.received_up.pop(msg.round, None)
            self.uplink.closed(msg.round)
            self.rounds.round_done(rnd)

    def _close_round(self, number: int, layout: Any, *, aborted: bool) -> None:
        """Pass an abort (or an empty average) on to the local ranks and move past the round."""
        self.uplink.closed(number)
        if self.rounds.close(number, layout, aborted=aborted):
            self.received_up.pop(number, None)

    def telemetry(self) -> dict:
        return self.local.telemetry() | {"egress_mb": round(self.egress_bytes / 2**20, 1), "upstream_drops": dict(self.up.send_drops)}
