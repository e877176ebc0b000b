"""The CPU averaging backend's bulk server: the socket sources send snapshot slices to.

Ranks send parameter snapshots to a bulk ROUTER socket of their own (heartbeats
and timing never queue behind a model). ``CpuAveraging`` admits the sources,
authenticates and unpacks their slices, and feeds them to the round core
(``rounds.py``), which folds them and says when an average is ready; here it
goes back to every source (``SendBack``, the controller's egress). A host
relay (``relay.py``) runs the same server for its local ranks with an egress
of its own that sends the average upstream instead.

The socket stops being read while a few slices wait to be folded, so an end
holds a few slices per peer besides its accumulator.

Ranks on the same host take the same-host lane (``shm.py``): their slices are
read straight out of their shared-memory segments, and the accumulator itself
lives in the server's update segment, so their ``Update`` headers carry no
frame at all. The accumulator is reused every round (the round core gates
it), and ranks elsewhere get frames copied off it once per slice (a slow
peer's queued frame must not see it rewritten).

Sources are keyed by their lowest rank; a relay is waited for while any of
its ranks lives.

When ranks join, their donor's optimizer state comes here as ``StateSlice``
messages and is passed on, slice by slice as it comes, to the joiners
(``hand_over``; rank/state_lane.py); a donor that dies first owes them a
"none", which is sent in its place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from ..errors import ProtocolError
from ..wire import curve, shm
from ..wire import messages as m
from ..wire.bulk import (
    MAX_MSG_BYTES,
    as_frame,
    check_slice,
    check_state_segment,
    check_state_slice,
    is_announcement,
    state_slices,
    unpack_slice,
)
from ..wire.codec import FrameReader, FrameWriter
from ..wire.quant import BY_WIRE_NAME
from ..wire.transport import AsyncSocket, Routes, peer_name
from .deltas import Downlink
from .rounds import Egress, Round, Rounds, empty_update

log = logging.getLogger("flodl.averaging")

#: Slices received but not yet folded before the socket stops being read.
READ_AHEAD = 4


class CpuAveraging:
    """Collects snapshot slices from its sources and averages them on the CPU in rounds.

    Where each average goes is ``egress``: left out, back to the sources (the
    controller's); a host relay passes itself and sends it upstream.
    ``join_late``: the first round is whatever the sources send first, not 0
    (a relay may join a running job). ``compressed``: the run's averages
    travel compressed (``--sync-compression``): the controller keeps the
    consensus and compresses what it sends back (deltas.py ``Downlink``).
    """

    def __init__(
        self,
        *,
        secret: bytes,
        run_id: str,
        bind: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        egress: Egress | None = None,
        join_late: bool = False,
        compressed: bool = False,
    ) -> None:
        self.reader = FrameReader(secret, run_id, max_frame=1 << 20, name="controller bulk", own="controller")
        self.writer = FrameWriter(secret, run_id, "controller/bulk")
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
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
        self.handoffs: dict[int, tuple[int, int]] = {}  # joiner -> (its first round, its donor): the state it awaits
        self.state_links: dict[int, Path] = {}  # joiner -> the link to its donor's state segment it was named
        self.state_lane_bytes = 0  # donors' state handed to joiners through shared memory
        self.state_wire_bytes = 0  # ... and through the socket (each joiner's copy counted)
        self.live: Callable[[], set[int]] = lambda: set().union(*self.members.values())  # the controller plugs in its membership
        self.ending: set[int] = set()  # dead ranks still counted until what they sent before is taken (rank_ended)
        self.drops: Counter[str] = Counter()
        self.on_round: Callable[[int, float], None] = lambda number, ms: None
        # the core calls on_round through a lambda: the controller plugs its hook in after construction
        self.rounds = Rounds(
            endpoint=self,
            egress=egress or SendBack(self),
            timeout_s=timeout_s,
            clock=clock,
            drops=self.drops,
            on_round=lambda number, ms: self.on_round(number, ms),
            join_late=join_late,
        )
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
        self.lane_bytes = 0  # bytes that came through the lane instead of a socket
        self.ingress_bytes = 0  # snapshot bytes that came through the socket
        self.egress_bytes = 0  # update bytes sent through the socket (each recipient's copy counted)
        self.ingress_by: Counter[int] = Counter()  # source -> its snapshot bytes through the socket
        self.downlink = Downlink() if compressed else None

    # ------------------------------------------------------------------ wiring

    def admit(self, identity: bytes, rank: int, *, from_round: int = 0) -> None:
        """``identity`` is the rank's control sender name; its bulk headers are signed as ``<identity>/bulk``.

        A rank joining a running job is expected from ``from_round`` on: the
        rounds before it are its peers' alone.
        A rank whose host relays (``admit_relay``) sends nothing here itself:
        admitting it makes its relay expected from ``from_round``.
        """
        source = self.relayed.get(rank)
        if self.downlink is not None:
            self.downlink.admitted(rank if source is None else source)
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

    def hand_over(self, round_: int, members: list[int], joiners: list[int]) -> int:
        """Ranks ``joiners`` join at round ``round_``: the donor of their state (the lowest of
        ``members`` not behind a relay), which then sends it here for them; -1 for none (no such
        member, or every joiner is behind a relay, which passes no state on)."""
        direct = [rank for rank in joiners if rank not in self.relayed]
        donor = next((rank for rank in members if rank not in self.relayed and rank in self.members), -1)
        if donor < 0 or not direct:
            return -1
        for rank in direct:
            self.handoffs[rank] = (round_, donor)
        return donor

    def _pass_state(self, donor: int, msg: m.StateSlice, frames: list) -> None:
        """A donor's state slice, passed on as it came (re-signed) to the joiners awaiting it; once
        all of it (or its "none") is out, they await nothing more. A state in a segment goes on as
        ``_pass_segment`` says."""
        joiners = [rank for rank, (round_, by) in self.handoffs.items() if by == donor and round_ == msg.round]
        if msg.shm:
            self._pass_segment(donor, msg, frames, joiners)
            return
        try:
            check_state_slice(msg, frames)
        except ProtocolError as exc:
            self.drops["bulk"] += 1
            log.error("rejected a state slice from rank %d: %s", donor, exc.detail)
            return
        self._send_state(joiners, msg, frames)
        if msg.total == -1 or msg.start + msg.count >= msg.total:
            for rank in joiners:
                del self.handoffs[rank]

    def _send_state(self, joiners: list[int], msg: m.StateSlice, frames: list) -> None:
        """``msg`` (re-signed) and its frames to each of ``joiners``."""
        encoded = self.writer.encode(msg)
        identities = {rank: identity for identity, rank in self.ranks.items()}
        for rank in joiners:
            route = self.routes.get(identities[rank].decode()) if rank in identities else None
            if route is None or not self.io.send([route, encoded, *frames], copy=False):
                self.drops["unreachable"] += 1
            elif frames:
                self.state_wire_bytes += sum(len(f) for f in frames)

    def _pass_segment(self, donor: int, msg: m.StateSlice, frames: list, joiners: list[int]) -> None:
        """A donor's state in a segment of its own (this host): each joiner on the lane gets a link
        of its own to it (it maps and unlinks it), the others its bytes as slices; then the donor's
        name goes. A segment that cannot be read is a "none" to its joiners (a fresh optimizer)."""
        try:
            path = check_state_segment(msg, frames, self.run_id) if self.probe_path else None
            if path is None:
                raise ProtocolError("shm", "a state segment, but no same-host lane here")
        except ProtocolError as exc:
            self.drops["bulk"] += 1
            log.error("rejected a state segment from rank %d: %s", donor, exc.detail)
            self._pass_state(donor, m.StateSlice(rank=donor, round=msg.round, total=-1, start=0, count=0, shm=""), [])
            return
        try:
            identities = {rank: identity for identity, rank in self.ranks.items()}
            wire = [rank for rank in joiners if identities.get(rank) not in self.shm_identities or not self._link_state(rank, path, msg)]
            if wire:
                seg = shm.Segment.open(path, min_bytes=msg.total)
                view = memoryview(seg.mm)[: msg.total]
                for start, count in state_slices(msg.total):
                    piece = m.StateSlice(rank=donor, round=msg.round, total=msg.total, start=start, count=count, shm="")
                    self._send_state(wire, piece, [view[start : start + count]])  # ZeroMQ keeps the mapping alive until sent
        except ProtocolError as exc:  # the donor's segment is not there or too short: nothing to pass
            self.drops["bulk"] += 1
            log.error("could not read the state segment of rank %d: %s", donor, exc.detail)
            none = m.StateSlice(rank=donor, round=msg.round, total=-1, start=0, count=0, shm="")
            self._send_state([r for r in joiners if r not in self.state_links], none, [])
        finally:
            shm.unlink(path)
        for rank in joiners:
            del self.handoffs[rank]

    def _link_state(self, rank: int, path: Path, msg: m.StateSlice) -> bool:
        """Give joiner ``rank`` a link of its own to the state segment ``path`` and name it to it;
        False when the link cannot be made (the joiner then gets slices)."""
        link = shm.path_for(self.run_id, shm.STATE_ROLE)
        try:
            os.link(path, link)
        except OSError as exc:
            log.warning("no link to rank %d's state segment for rank %d (%s): it goes as slices", msg.rank, rank, exc)
            return False
        self.drop_state_link(rank)
        self.state_links[rank] = link
        self._send_state([rank], m.StateSlice(rank=msg.rank, round=msg.round, total=msg.total, start=0, count=msg.total, shm=str(link)), [])
        self.state_lane_bytes += msg.total
        return True

    def drop_state_link(self, rank: int) -> None:
        """Unlink the state segment link joiner ``rank`` was given, if it has not (it died first)."""
        link = self.state_links.pop(rank, None)
        if link is not None:
            shm.unlink(link)

    def _donor_ended(self, donor: int) -> None:
        """A donor died with state still owed: its joiners are told none comes (they train afresh)."""
        owed = {round_ for round_, by in self.handoffs.values() if by == donor}
        for round_ in sorted(owed):
            self._pass_state(donor, m.StateSlice(rank=donor, round=round_, total=-1, start=0, count=0, shm=""), [])

    def rank_ended(self, rank: int) -> None:
        """``rank``'s process is gone: rounds stop waiting for it once the actor has taken every
        slice the socket held when the death was reported. A snapshot that left the rank before it
        died is then folded, not raced by the news of its death (its window would be given back and
        trained again for nothing)."""
        self.ending.add(rank)
        self.drop_state_link(rank)  # a joiner that died before it took its state leaves no segment
        self._queue_end(rank)

    def _queue_end(self, rank: int) -> None:
        """Read what the socket holds, and queue ``rank``'s end behind it. With reads paused (the
        read-ahead is full) the socket may hold more of what the rank sent: the end says so, and
        ``run`` queues it again behind that once it comes to it."""
        self.io.read_pending()
        self.rounds.queue.put_nowait((rank, None, self.io.paused))

    def counted(self) -> set[int]:
        """The ranks rounds wait for: the live ones, and the dead whose last slices are still queued."""
        return self.live() | self.ending

    def landed(self, number: int, rank: int) -> bool | None:
        """Was ``rank``'s snapshot folded whole into round ``number``'s average (False: the round went
        on without it, or was aborted)? A relayed rank: its relay's snapshot was, with the rank in
        every slice of it (``Snapshot.folded``). None while the round is open, or for a round too old."""
        done = self.rounds.landed.get(number)
        if done is None:
            return None
        return rank in done.get(self.relayed.get(rank, rank), ())

    def expected(self, number: int) -> set[int]:
        """The sources round ``number`` waits for: admitted by then, and carrying a live rank."""
        live = self.counted()
        return {s for s, ranks in self.members.items() if ranks & live and self.first_round.get(s, number + 1) <= number}

    def start(self) -> None:
        self.io.start()

    def close(self) -> None:
        self.io.close()
        for rank in list(self.state_links):
            self.drop_state_link(rank)
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
        if isinstance(msg, m.StateSlice) and rank is not None and rank == msg.rank:
            self._route(env, route)
            self._pass_state(rank, msg, frames)
            return
        if not isinstance(msg, m.Snapshot) or rank is None or rank != msg.rank:
            self.drops["unauthorized"] += 1
            return
        self._route(env, route)
        if not set(msg.folded) <= self.members.get(rank, set()):
            self.drops["bulk"] += 1
            log.error("rejected a snapshot slice from source %d: it names ranks %s it does not carry", rank, sorted(set(msg.folded)))
            return
        if not 0 <= msg.ranks <= len(self.members.get(rank, ())):
            self.drops["bulk"] += 1
            log.error(
                "rejected a snapshot slice from source %d: it claims %d ranks, it carries %d",
                rank,
                msg.ranks,
                len(self.members.get(rank, ())),
            )
            return
        if not msg.shm:
            size = sum(len(f) for f in frames)
            self.ingress_bytes += size
            self.ingress_by[rank] += size
        try:
            piece = self._lane_slice(identity, rank, msg, frames) if msg.shm else unpack_slice(msg, frames)
        except ProtocolError as exc:
            self.drops["bulk"] += 1
            log.error("rejected a snapshot slice from rank %d: %s", rank, exc.detail)
            return
        if piece is None:
            self.drops["bulk"] += 1
            return
        self.rounds.queue.put_nowait((rank, msg, piece))
        # read ahead a few slices while one is folded, then stop: memory stays bounded
        self.io.paused = self.rounds.queue.qsize() >= READ_AHEAD

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
        rounds = self.rounds
        while True:
            try:
                async with asyncio.timeout(0.1):
                    rank, msg, piece = await rounds.queue.get()
            except TimeoutError:
                await rounds.check()
                continue
            if msg is None:  # a rank's end, queued behind what it sent before it (rank_ended)
                self._read_on()
                if piece:  # reads were paused behind it: what the rank sent may still be in the socket
                    self._queue_end(rank)
                    continue
                self.ending.discard(rank)
                self._donor_ended(rank)  # after what it sent before it died: a state it finished is out
                await rounds.check()
                continue
            try:
                await rounds.take(rank, msg, piece)
            except ProtocolError as exc:
                self.drops["bulk"] += 1
                log.error("rejected a snapshot slice from rank %d: %s", rank, exc.detail)
            finally:
                del piece  # release the ZeroMQ buffer before reading more
                self._read_on()
            await rounds.check()

    def _read_on(self) -> None:
        """Resume reads paused by a full read-ahead, once the actor has taken it below READ_AHEAD."""
        if self.io.paused and self.rounds.queue.qsize() < READ_AHEAD:
            self.io.resume()

    # ------------------------------------------------- what the round core asks

    def lane_ranks(self) -> set[int] | None:
        """Ranks on the lane, which read averages in place; None while there is no update segment (nothing to gate)."""
        return None if self.update_seg is None else set(self.segments)

    def accumulators(self, number: int, numels: list[int]) -> list[torch.Tensor]:
        """Round ``number``'s accumulators: the update segment once a rank is on the lane, else private memory.

        Raises:
            ProtocolError: ``bulk`` for a layout other than the update segment's.
        """
        if self.shm_identities and self.update_seg is None:
            try:
                self.update_seg = shm.UpdateSegment.create_for(self.run_id, numels)
            except OSError as exc:
                log.warning("no update segment (%s): averages go to every rank as frames", exc)
                self.shm_identities.clear()
        seg = self.update_seg
        if seg is not None and seg.numels != numels:
            raise ProtocolError("bulk", "a snapshot's model layout differs from the run's")
        return seg.accumulators(number, numels) if seg is not None else [torch.empty(n, dtype=torch.float32) for n in numels]

    def lane_header(self, fields: dict, bucket: int, start: int) -> m.Update | None:
        """The ``Update`` for ranks on the lane, naming where the slice's average lies in the update segment; None without one."""
        if self.update_seg is None:
            return None
        return m.Update(**fields, shm=str(self.update_seg.path), shm_offset=self.update_seg.offset(bucket, start))

    def on_wire(self) -> bool:
        """Does any source get averages as frames (not on the lane)?"""
        return len(self.shm_identities) < len(self.ranks)

    def broadcast(self, header: m.Update, frames: list, *, lane: m.Update | None = None) -> None:
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
            elif len(parts) > 2:
                self.egress_bytes += sum(len(f) for f in frames)

    def telemetry(self) -> dict:
        ms = sorted(self.rounds.round_ms)
        return {
            "rounds": self.rounds.rounds_done,
            "aborted": self.rounds.aborted,
            "round_ms_p50": ms[len(ms) // 2] if ms else None,
            "round_ms_max": ms[-1] if ms else None,
            "lane_mb": round(self.lane_bytes / 2**20, 1),
            # donors' optimizer state handed to joiners: through shared memory, through the socket
            "state_lane_bytes": self.state_lane_bytes,
            "state_wire_bytes": self.state_wire_bytes,
            "ingress_mb": round(self.ingress_bytes / 2**20, 1),
            "ingress_bytes": self.ingress_bytes,  # snapshot bytes that came through the socket (exact)
            "egress_bytes": self.egress_bytes,  # averages sent back through the socket, every recipient's copy
            # per source (a rank, or a host relay by its lowest rank): its snapshot bytes through the socket
            "ingress_by_source": {str(s): n for s, n in sorted(self.ingress_by.items())},
            "compressed": self.downlink is not None,
            "relays": len([s for s, ranks in self.members.items() if len(ranks) > 1 or s in self.relayed.values()]),
            "dropped": dict(self.drops) | {f"header_{k}": v for k, v in self.reader.drops.items()},
        }


class SendBack:
    """The controller's egress: each slice's average goes back to every source as soon as it is in."""

    def __init__(self, server: CpuAveraging) -> None:
        self.server = server

    async def slice_ready(self, rnd: Round, bucket: int, start: int, count: int) -> None:
        """Normalise one slice of the accumulator and send it to every source."""
        param_weight, buffer_weight = rnd.sums(rnd.expected & set(rnd.weights))
        if param_weight <= 0:
            return  # nobody trained: the empty update goes out when the round is done
        out, acc = rnd.averaged(bucket, start, count)
        dtypes, downlink = rnd.dtypes, self.server.downlink
        if downlink is not None:  # compressed averages: the bucket goes out compressed, or whole (deltas.py)
            dtypes = downlink.dtypes(rnd)
            if rnd.dtypes[bucket] in BY_WIRE_NAME:
                out = downlink.out(rnd, bucket, start, count, acc)
            else:
                downlink.seen(rnd, bucket, start, out)
        fields: dict[str, Any] = dict(
            round=rnd.number,
            aborted=False,
            ranks=int(buffer_weight),
            groups=rnd.groups,
            dtypes=dtypes,
            numels=rnd.numels,
            bucket=bucket,
            start=start,
            count=count,
        )
        lane = self.server.lane_header(fields, bucket, start)
        if lane is not None and out is acc and self.server.on_wire():
            out = acc.clone()  # frames outlive the slot: a slow peer's queue must not see it reused
        self.server.broadcast(m.Update(**fields, shm="", shm_offset=0), [as_frame(out)], lane=lane)
        rnd.streamed.add((bucket, start))

    async def round_ready(self, rnd: Round) -> bool:
        """Send the slices not streamed yet, or the empty update when nobody trained: the round is done."""
        if sum(rnd.weights.get(r, 0.0) for r in rnd.complete()) > 0:
            # slices not streamed yet: their last fold came before a rank that left
            # stopped being expected; they go out now
            for bucket, start, count in rnd.slices():
                if (bucket, start) not in rnd.streamed:
                    await self.slice_ready(rnd, bucket, start, count)
            if self.server.downlink is not None:
                self.server.downlink.done(rnd)
        else:  # nobody trained: there is nothing to average
            self.server.broadcast(empty_update(rnd, rnd.number, aborted=False), [])
        return True

    def round_overdue(self, rnd: Round) -> None:
        """Never called: this egress hands no round over (``round_ready`` is always True)."""
