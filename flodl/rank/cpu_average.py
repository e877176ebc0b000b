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

On the controller's own host (``BulkLink.lane``, decided by the probe the
welcome names) no tensor bytes cross the socket: the snapshot is copied into
a shared-memory segment of the rank's (where, on CPU, the model's values
live anyway, so a Sync round copies nothing), whose snapshot slot also serves as the snapshot kept for the blend, and the average is read
straight from the controller's update segment (``shm.py``).

Rounds are numbered by every rank in the same order (every rank enters the
same number of averages per window), so round ``n`` of one rank meets round
``n`` of the others at the controller without anyone naming it.

With ``--sync-compression`` parameter buckets travel as compressed deltas from
an anchor (cpu_deltas.py), always as frames (the lane saves no bytes of a
wire), one round in flight.

With ``--sync-fragments F`` a round carries only its fragment's buckets
(fragments.py: which one, from the round number): the layout names every
bucket, the others with no elements, so the controller and relays average the
round as they do any other; snapshots go as frames (the lane's in-place rounds
read whole models, and saves no network bytes anyway).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from ..errors import DeadlineExceeded, ProtocolError
from ..wire import curve, shm
from ..wire import messages as m
from ..wire.bulk import MAX_MSG_BYTES, announcement, as_frame, check_slice, dtype_name, itemsize, slices, unpack_slice
from ..wire.codec import FrameReader, FrameWriter
from ..wire.quant import Codec
from .cpu_deltas import SnapshotDeltas
from .flat import PARAMS, Averaged, FlatModel, WireTally
from .fragments import Rotation
from .outer import OuterStep
from .state_lane import StateIn, StateOut

log = logging.getLogger(__name__)


class BulkLink:
    """The rank's bulk-plane DEALER (used by the training thread only)."""

    def __init__(
        self,
        addr: str,
        *,
        rank: int,
        secret: bytes,
        run_id: str,
        sender: str,
        send_timeout_s: float = 60.0,
        shm_probe: str = "",
        shm_nonce: str = "",
    ) -> None:
        # no routing id of our own: the receiver assigns one per connection and binds it to ``sender``
        # (the name our headers are signed with) on the first of them, the announcement below
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 4)  # back-pressure: a few slices in flight, never a pile of models
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))  # a stalled controller is an error, not a hang
        curve.client(self.sock)
        self.sock.connect(addr)
        self.writer = FrameWriter(secret, run_id, sender)
        self.reader = FrameReader(secret, run_id, max_frame=1 << 20, name=f"{sender} bulk")
        self.run_id = run_id
        try:
            self.sock.send(self.writer.encode(announcement(rank)), zmq.NOBLOCK)  # queued until connected
        except zmq.Again:  # cannot happen on a fresh socket; its first snapshot binds the route then
            pass
        # the same-host lane: taken only when the controller's probe is visible from here
        self.lane = shm.probe_ok(shm_probe, shm_nonce, run_id)
        self.update_seg: shm.Segment | None = None
        self.wire = WireTally()  # tensor bytes through the socket, both ways (the lane's are no network's)

    def send_header(self, header: m.Snapshot) -> None:
        """Send a lane header (the slice lies in our segment). Raises like ``send``."""
        try:
            self.sock.send(self.writer.encode(header))
        except zmq.Again:
            raise DeadlineExceeded("the controller's bulk socket took no snapshot slice within the send timeout") from None

    def stamp(self) -> int:
        """The round the controller's update segment holds now (asked once a lane update was read from it)."""
        assert self.update_seg is not None, "no update segment opened yet"  # _lane_slice opens it
        return shm.UpdateSegment.stamp_of(self.update_seg)

    def _lane_slice(self, update: m.Update, frames: list) -> torch.Tensor:
        if frames:
            raise ProtocolError("bulk", "a shared-memory update header carries a frame")
        check_slice(update)
        if self.update_seg is None or str(self.update_seg.path) != update.shm:
            path = shm.checked_path(update.shm, self.run_id, "update") if self.lane else None
            if path is None:
                raise ProtocolError("shm", f"the controller named {update.shm!r}, not its update segment in this run")
            self.update_seg = shm.Segment.open(path)
        return self.update_seg.view(update.shm_offset, update.count, torch.float32)

    def send(self, header: m.Snapshot, piece: torch.Tensor) -> None:
        """Send one slice (blocks only while ZeroMQ already holds a few of ours: back-pressure).

        Raises:
            DeadlineExceeded: the controller took nothing for the send timeout.
        """
        try:
            self.sock.send_multipart([self.writer.encode(header), as_frame(piece)], copy=False)
        except zmq.Again:
            raise DeadlineExceeded("the controller's bulk socket took no snapshot slice within the send timeout") from None
        self.wire.add(piece.numel() * piece.element_size(), 0)

    def send_state(self, header: m.StateSlice, piece: memoryview | None) -> None:
        """Send one slice of this rank's state for joiners (state_lane.py), or the "none" (no frame).

        Raises:
            DeadlineExceeded: the controller took nothing for the send timeout.
        """
        try:
            self.sock.send_multipart([self.writer.encode(header), *([piece] if piece is not None else [])], copy=False)
        except zmq.Again:
            raise DeadlineExceeded("the controller's bulk socket took no state slice within the send timeout") from None

    def receive(self, timeout_ms: int) -> tuple[m.Update, torch.Tensor | None] | tuple[m.StateSlice, list] | None:
        """One update slice (or a donor's state slice, its frames unchecked: state_lane.py) if it
        arrives within ``timeout_ms``; bad messages are dropped and counted."""
        if not self.sock.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart(copy=False)
        self.wire.add(0, sum(len(p) for p in parts[1:]))
        env = self.reader.read(parts[0].bytes, "controller")
        if env is not None and isinstance(env.msg, m.StateSlice):
            return env.msg, parts[1:]
        if env is None or not isinstance(env.msg, m.Update):  # a bad frame (the reader counts and logs it), or not ours
            return None
        try:
            if env.msg.shm:
                return env.msg, self._lane_slice(env.msg, parts[1:])
            return env.msg, unpack_slice(env.msg, parts[1:])
        except ProtocolError as exc:
            log.error("rejected an update from the controller: %s", exc)
            return None

    def use_frames(self) -> None:
        """Send every snapshot as frames, even on the controller's host (no segment of our own)."""
        self.lane = False

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass
class _Pending:
    """A round this rank has sent its snapshot for, waiting for the average."""

    snap: list[torch.Tensor] | None  # the values sent, on the buckets' devices (None: overwrite)
    left: int  # elements of the average not yet applied
    measure: bool
    sq: list[float]  # running ‖pre‖², ‖post‖², ‖pre − post‖² over parameter slices
    tag: int = -1  # the caller's name for this average (the rank's window << 16 | round)
    overwrite: bool = False  # its result replaces the values whole (a broadcast, an adoption): no outer step
    chosen: list[bool] | None = None  # the buckets the round carries (its fragment's; None: all)
    total: int = 0  # elements of the whole average (``left`` when none was applied yet)

    def __post_init__(self) -> None:
        self.total = self.left


class CpuAverager:
    """Averages a ``FlatModel`` through the controller (``Averager``, averager.py, as the collective one)."""

    def __init__(
        self,
        flat: FlatModel,
        bulk: BulkLink,
        *,
        rank: int,
        alpha: float = 1.0,
        timeout_s: float,
        must_stop: Callable[[], bool],
        adopting: bool = False,
        compression: Codec | None = None,
    ) -> None:
        self.flat = flat
        self.bulk = bulk
        self.rank = rank
        self.alpha = alpha
        self.timeout_s = timeout_s
        self.must_stop = must_stop
        # tests: called once a snapshot's first slice has gone (the ``slice`` fault point: a rank that
        # dies halfway through its snapshot); None in a real run
        self.first_slice_out: Callable[[], object] | None = None
        self.round = 0
        # a rank that joined a running job holds no consensus yet: it trains nothing
        # and takes the next real average as its parameters (weight 0, overwrite)
        self.adopting = adopting
        self.pending: dict[int, _Pending] = {}
        self.last_drift: tuple[float | None, float, float] | None = None
        self.aborted = 0  # rounds the controller aborted, or whose average was overwritten here
        # rounds the controller aborted before this rank sent its snapshot of them (a slower peer's
        # round timed out at the gate while this rank still trained): sent later, they would be
        # dropped as stale and never answered, so they are not waited for (``_sent``)
        self.aborted_ahead: set[int] = set()
        self.overruns = 0  # lane updates found overwritten before they were read (never expected)
        self.segment: shm.SnapshotSegment | None = None
        self.live_buckets: set[int] = set()  # buckets whose live values lie in our segment
        # the last blended (background) average, as it came, and its tag: an eval asked for that
        # average scores exactly it, whatever this rank trained since (``scoring``); ``kept_tag`` is
        # -1 while a newer one is being written over it
        self._kept: list[torch.Tensor] | None = None
        self.kept_tag = -1
        # an optimizer on the averaged update (outer.py), set once the first consensus is taken: each
        # average's parameter slices go through it as they land (``Update.ranks``: the ranks in it)
        self.outer: OuterStep | None = None
        # a donor's state for joiners (state_lane.py): this rank's to hand, or the one it joins with;
        # ``took_state(state)`` loads what came (None: nothing did) and says whether it held the outer
        # optimizer's state, which then steps the adopted average as the members stepped it
        self.state_out = StateOut(bulk, rank)
        self.state_in = StateIn(bulk.run_id)
        self.took_state: Callable[[bytearray | memoryview | None], bool] = lambda state: False
        self.adopted_ranks = 0  # ``Update.ranks`` of the average this joiner adopted
        # ``--sync-compression``: parameter buckets travel as compressed deltas, as frames (cpu_deltas.py)
        self.deltas = SnapshotDeltas(compression, flat.buckets) if compression is not None else None
        # ``--sync-fragments``: which fragment each round carries (fragments.py); a joiner adopting
        # takes the consensus fragment by fragment, and holds it once every parameter bucket came
        self.rotation = Rotation(flat.fragments)
        self._adopted: set[int] = set()
        if self.deltas is not None or self.rotation.active:
            bulk.use_frames()
        if bulk.lane:
            self._take_lane()

    @property
    def wire(self) -> WireTally:
        """What this rank's snapshots and averages put on the network."""
        return self.bulk.wire

    def broadcast_from(self, root: int = 0) -> None:
        """Start every replica from ``root``'s values: a round only ``root`` weighs in (its bytes
        counted as a broadcast, not an average)."""
        mark = self.wire.mark()
        self.average(1.0 if self.rank == root else 0.0, block=True, overwrite=True)
        self.wire.set_aside(mark)
        self.wire.averages -= 1

    def start_at_round(self, first: int) -> None:
        """Number the next average ``first`` (a joiner: the round the controller admits it at)."""
        self.round = first

    def hand_state_at(self, round_: int) -> None:
        """Hand this rank's state to the ranks joining at round ``round_``, with its snapshot of it
        (called on the link thread, as the Regroup naming this rank the donor arrives)."""
        self.state_out.due_at(round_)

    def expect_state(self, round_: int) -> None:
        """A joiner: its donor's state comes with round ``round_``, the one it adopts."""
        self.state_in.expect(round_)

    def average(
        self, weight: float, *, measure: bool = False, block: bool = True, overwrite: bool = False, tag: int = -1, final: bool = False
    ) -> Averaged:
        """Send this replica's snapshot; with ``block`` wait until the average is applied.

        With ``--sync-fragments`` the round carries its fragment's buckets (a broadcast, and the
        ``final`` average of a clean end, every one: the latter a plain mean, no outer step).

        Raises:
            DeadlineExceeded: no complete update for this round within the timeout.
        """
        start = time.perf_counter()
        # chosen before an adopting joiner's overwrite below: its round's layout is the members'
        chosen = self.flat.chosen(None if overwrite or final else self.rotation.of(self.round - 1))  # round 0: the first broadcast
        adopt = self.adopting
        if final:
            measure, block, overwrite = False, True, True
        if adopt:
            weight, measure, block, overwrite = 0.0, False, True, True
        buckets = self.flat.buckets
        dtypes = [dtype_name(b.flat.dtype) for b in buckets]
        if self.deltas is not None:
            self.settle()  # one round in flight: every rank's anchor is the consensus of the last one
            dtypes = self.deltas.dtypes(buckets, whole=overwrite and not adopt)  # a broadcast goes whole
        numels = [b.numel if c else 0 for b, c in zip(buckets, chosen, strict=True)]
        layout = dict(groups=[b.group for b in buckets], dtypes=dtypes, numels=numels)
        self.wire.begin()
        handing, passed = self.state_out.take(self.round)
        for round_ in passed:
            self.state_out.send(round_, None)
        state = None
        if handing:
            if self.outer is not None:
                # every earlier round lands first: the outer optimizer's state goes as this round's average is stepped from it
                self.settle()
            state = self.state_out.capture()
        seg = self.segment
        if seg is None or not self._send_on_lane(seg, weight, layout, measure=measure, block=block, overwrite=overwrite):
            self._send_frames(weight, layout, measure=measure, block=block, overwrite=overwrite, chosen=chosen)
        mine = self.round - 1
        if handing:
            self.state_out.send(mine, state)  # after the snapshot: the round is not held up by it
        if mine in self.pending:
            self.pending[mine].tag = tag
        self._sent(mine)
        if block:
            # adopting waits a whole window for the peers' average; the controller
            # (which it hears from) bounds that round, so no deadline of our own
            self._wait_for(mine, bounded=not adopt)
        if adopt and not self.adopting and self.state_in.awaited:
            self._take_state()
        ms = (time.perf_counter() - start) * 1000.0
        d = self.last_drift if measure and self.last_drift else (None, 0.0, 0.0)
        return Averaged(ms, *d) if measure else Averaged(ms)

    def _sent(self, mine: int) -> None:
        """Round ``mine`` is sent: if the controller already aborted it, it is over here too (local values kept)."""
        if mine in self.aborted_ahead and self.pending.pop(mine, None) is not None:
            self.aborted += 1
            log.info("rank %d: round %d was aborted before this rank sent it; keeping local values", self.rank, mine)
        self.aborted_ahead = {r for r in self.aborted_ahead if r > mine}

    def _take_lane(self) -> None:
        """Create our segment and move the CPU buckets' live values into it (the same-host lane)."""
        buckets = self.flat.buckets
        live = [b.flat.device.type == "cpu" for b in buckets]
        try:
            self.segment = shm.SnapshotSegment.create_for(
                self.bulk.run_id,
                self.rank,
                [b.numel * b.flat.element_size() for b in buckets],
                [b.flat.numel() * b.flat.element_size() if here else 0 for b, here in zip(buckets, live, strict=False)],
            )
        except OSError as exc:  # /dev/shm full or gone: the wire still works
            log.warning("rank %d: no shared-memory segment (%s); snapshots go as frames", self.rank, exc)
            self.bulk.use_frames()
            return
        for i, (b, here) in enumerate(zip(buckets, live, strict=False)):
            if here:
                self.flat.rehome(i, self.segment.view(self.segment.live_offset(i), b.flat.numel(), b.flat.dtype))
                self.live_buckets.add(i)

    def _send_on_lane(self, seg: shm.SnapshotSegment, weight: float, layout: dict, *, measure: bool, block: bool, overwrite: bool) -> bool:
        """Send the snapshot's headers, the slices lying in our segment ``seg``; False when we must use frames.

        Every earlier round's average is read first: our header of this round
        tells the controller it may reuse its update slot (and our own slot is
        free again). In a blocking round nothing trains until the average
        lands, so CPU buckets go from their live storage with no copy at all;
        otherwise (and for GPU buckets) each slice is copied into the slot just
        before its header goes, and on CPU the slot is also the snapshot kept
        for the blend.
        """
        self.settle()
        if self.pending or self.must_stop():
            return False  # stopping: whatever goes out now goes as frames
        buckets = self.flat.buckets
        in_place = block and not measure
        live = [in_place and i in self.live_buckets for i in range(len(buckets))]
        if not all(live) and not seg.ready_slot():
            return False  # no room in /dev/shm for a snapshot copy: this one goes as frames
        # the snapshot slot's view of each bucket not sent from its live storage
        views = {
            i: seg.view(seg.offset(i, 0), b.numel, b.flat.dtype) for i, (b, here) in enumerate(zip(buckets, live, strict=False)) if not here
        }
        with torch.no_grad():
            for b in buckets:
                b.copy_in()
            if in_place or overwrite:
                snap = None  # the average replaces the values: nothing to blend against
            else:
                snap = [views[i] if b.flat.device.type == "cpu" else b.values.detach().clone() for i, b in enumerate(buckets)]
            mine = self.round
            self.pending[mine] = _Pending(snap, sum(b.numel for b in buckets), measure, [0.0, 0.0, 0.0], overwrite=overwrite)
            self.round += 1
            # no update is applied until every slice is in: the snapshot stays one moment's values
            for bucket, first, count in slices(layout["numels"], [b.flat.element_size() for b in buckets]):
                size = buckets[bucket].flat.element_size()
                if live[bucket]:
                    offset = seg.live_offset(bucket, first * size)
                else:
                    src = buckets[bucket].values if snap is None or snap[bucket] is views[bucket] else snap[bucket]
                    views[bucket][first : first + count].copy_(src[first : first + count])
                    offset = seg.offset(bucket, first * size)
                self.bulk.send_header(
                    m.Snapshot(
                        rank=self.rank,
                        round=mine,
                        weight=float(weight),
                        bucket=bucket,
                        start=first,
                        count=count,
                        shm=str(seg.path),
                        shm_offset=offset,
                        ranks=1,
                        folded=[],
                        **layout,
                    )
                )
                if self.first_slice_out is not None and bucket == 0 and first == 0:
                    self.first_slice_out()
        self.poll()
        return True

    def _send_frames(self, weight: float, layout: dict, *, measure: bool, block: bool, overwrite: bool, chosen: list[bool]) -> None:
        """The snapshot as frames on the socket (the controller is on another host)."""
        buckets = self.flat.buckets
        if block and not measure:
            # nothing trains before the average lands, so the average simply replaces the
            # values and the live buffers can go out as they are: no copy on CPU ranks
            for b in buckets:
                b.copy_in()
            snap, overwrite = None, True
            src = [b.values.detach() for b in buckets]
        else:
            src = snap = self.flat.snapshot()
            if overwrite:
                snap = None
        # encoded buckets are compressed where they live; the others go to the host whole
        encoded = [d != dtype_name(b.flat.dtype) for d, b in zip(layout["dtypes"], buckets, strict=True)]
        host = [t if t.device.type == "cpu" or enc else t.to("cpu") for t, enc in zip(src, encoded, strict=True)]
        mine = self.round
        self.pending[mine] = _Pending(snap, sum(layout["numels"]), measure, [0.0, 0.0, 0.0], overwrite=overwrite, chosen=chosen)
        self.round += 1
        for bucket, first, count in slices(layout["numels"], [itemsize(d) for d in layout["dtypes"]]):
            header = m.Snapshot(
                rank=self.rank,
                round=mine,
                weight=float(weight),
                bucket=bucket,
                start=first,
                count=count,
                shm="",
                shm_offset=0,
                ranks=1,
                folded=[],
                **layout,
            )
            piece = host[bucket][first : first + count]
            if encoded[bucket]:
                assert self.deltas is not None  # only it names an encoding
                piece = self.deltas.encode(mine, bucket, piece, first, weight)
            self.bulk.send(header, piece)
            if self.first_slice_out is not None and bucket == 0 and first == 0:
                self.first_slice_out()
            self.poll()  # updates may arrive meanwhile: keep the receive side moving too

    def _overrun(self, update: m.Update) -> None:
        """The slot already holds a later round: this round is lost here, as if aborted."""
        log.warning("rank %d: round %d's average was overwritten before it was read; keeping local values", self.rank, update.round)
        self.overruns += 1
        self.aborted += 1
        del self.pending[update.round]

    def _keep(self, bucket: int, seg: slice, avg: torch.Tensor, pending: _Pending) -> None:
        """Keep a blended round's slice of the average as it came (``scoring`` puts it back); the
        buckets of other fragments as the snapshot held them (the model that average left)."""
        if self._kept is None:
            self._kept = [torch.empty_like(b.values) for b in self.flat.buckets]
        if pending.left == pending.total:  # its first slice
            self.kept_tag = -1  # being written over: no longer the last round's whole average
            if pending.chosen is not None and pending.snap is not None:
                for index, taken in enumerate(pending.chosen):
                    if not taken:
                        self._kept[index].copy_(pending.snap[index])
        self._kept[bucket][seg].copy_(avg)

    def wait_for_tag(self, tag: int) -> None:
        """Wait (bounded) for the average named ``tag`` to land, if it is still in flight."""
        for round_, pending in sorted(self.pending.items()):
            if pending.tag == tag:
                self._wait_for(round_)

    @contextlib.contextmanager
    def scoring(self, tag: int) -> Iterator[bool]:
        """Hold the average ``tag`` (a blended round's, as it came) in the model while the block runs,
        then put the live values back: an eval scores the model exactly as that average made it,
        whatever this rank trained since. Yields False (and changes nothing) when that average is
        no longer kept (a later one landed, or it never came)."""
        if self._kept is None or tag < 0 or self.kept_tag != tag:
            yield False
            return
        buckets = self.flat.buckets
        live = []
        with torch.no_grad():
            for bucket, kept in zip(buckets, self._kept, strict=True):
                bucket.copy_in()
                live.append(bucket.values.clone())
                bucket.values.copy_(kept)
                bucket.copy_out()
        try:
            yield True
        finally:
            with torch.no_grad():
                for bucket, values in zip(buckets, live, strict=True):
                    bucket.values.copy_(values)
                    bucket.copy_out()

    def close(self) -> None:
        """Drop our segments' names (the controller normally already has)."""
        if self.segment is not None:
            self.segment.unlink()
        self.state_out.close()

    def poll(self) -> None:
        """Apply every update slice that has arrived (never blocks)."""
        while self._receive(0):
            pass

    def _receive(self, timeout_ms: int) -> bool:
        """Take one message if it arrives within ``timeout_ms``: an update slice is applied, a
        donor's state slice gathered (state_lane.py). False when nothing came."""
        got = self.bulk.receive(timeout_ms)
        if got is None:
            return False
        if isinstance(got[0], m.StateSlice):
            try:
                self.state_in.take(got[0], got[1])
            except ProtocolError as exc:
                log.error("rejected a state slice from the controller: %s", exc)
            return True
        self._apply(got[0], got[1])
        return True

    def _take_state(self) -> None:
        """This joiner adopted its first average: load its donor's state once it is all in (bounded),
        and with the outer optimizer's state step the average as every member stepped it."""
        state = self.state_in.wait(self._receive, self.timeout_s, self.must_stop)
        if self.took_state(state) and self.outer is not None and self.adopted_ranks > 0:
            with torch.no_grad():
                for index, bucket in enumerate(self.flat.buckets):
                    if bucket.copied:
                        bucket.copy_in()
                    self.outer.step_(index, bucket.values, ranks=self.adopted_ranks)
                    if bucket.copied:
                        bucket.copy_out()
            self.outer.round_done()

    def _adopted_all(self) -> bool:
        """Not adopting, or every parameter bucket came whole since (one round without fragments)."""
        return not self.adopting or all(i in self._adopted for i, b in enumerate(self.flat.buckets) if b.group == PARAMS)

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
            self._receive(100)

    def _apply(self, update: m.Update, piece: torch.Tensor | None) -> None:
        pending = self.pending.get(update.round)
        if pending is None:
            if update.aborted and update.round >= self.round:
                self.aborted_ahead.add(update.round)  # not sent yet: remembered for when it is (_sent)
            return  # a round we hold no snapshot for (done, or given up): stale
        if update.aborted or update.ranks == 0:
            del self.pending[update.round]
            self.aborted += update.aborted
            return
        if update.shm and self.bulk.stamp() != update.round:
            self._overrun(update)
            return
        bucket = self.flat.buckets[update.bucket]
        seg = slice(update.start, update.start + update.count)
        assert piece is not None  # only an empty update (ranks 0, above) carries no slice: rounds.empty_update
        with torch.no_grad():
            if self.deltas is not None and self.deltas.params[update.bucket]:
                consensus = self.deltas.values(
                    update.bucket, update.start, update.count, update.dtypes[update.bucket], piece, bucket.flat.device
                )
                if consensus is None:  # a delta, and no anchor to add it to: this round is lost here
                    log.warning(
                        "rank %d: round %d's average is a delta and this rank holds no anchor; keeping local values",
                        self.rank,
                        update.round,
                    )
                    del self.pending[update.round]
                    self.aborted += 1
                    return
                self.deltas.landed(update.round, update.bucket, update.start, consensus)
                avg = consensus  # a tensor of its own: the outer step may change it
            else:
                avg = piece.to(bucket.flat.device)
            if pending.snap is not None and pending.measure and bucket.group == PARAMS:
                # the drift reads the plain average, before the outer step moves past it (collective.py ``_plain``)
                s = pending.snap[update.bucket][seg]
                pending.sq[0] += float(s.norm()) ** 2
                pending.sq[1] += float(avg.norm()) ** 2
                pending.sq[2] += float(torch.dist(s, avg)) ** 2
            if self.outer is not None and not pending.overwrite and not self.adopting:
                if avg.data_ptr() == piece.data_ptr():
                    avg = avg.clone()  # the piece may be the controller's shared segment, or a frame's buffer
                self.outer.step_(update.bucket, avg, update.start, ranks=update.ranks)
            if bucket.copied:  # tensors with storage of their own: refresh our copy first
                bucket.copy_in()
            values = bucket.values[seg]
            if pending.snap is None:
                values.copy_(avg)
                if self.adopting:
                    self.adopted_ranks = update.ranks
                    self._adopted.add(update.bucket)
            else:
                self._keep(update.bucket, seg, avg, pending)
                s = pending.snap[update.bucket][seg]
                # local + α·(avg − snapshot), in place: two passes, no temporary; the snapshot off
                # first, so a replica that trained nothing since lands on the average exactly
                values.sub_(s, alpha=self.alpha).add_(avg, alpha=self.alpha)
            if bucket.copied:
                bucket.copy_out()
        if update.shm and self.bulk.stamp() != update.round:
            log.warning("rank %d: round %d's average was overwritten while it was applied", self.rank, update.round)
            self.overruns += 1
        pending.left -= update.count
        if pending.left <= 0:
            del self.pending[update.round]
            if pending.snap is not None:
                self.kept_tag = pending.tag  # every slice of it is kept
            if self.outer is not None and not pending.overwrite and not self.adopting:
                self.outer.round_done()
            if pending.snap is None and pending.overwrite and self.outer is not None:
                # the consensus, set whole (of the round's buckets): the next anchor
                self.outer.rebase([b.values for b in self.flat.buckets], only=pending.chosen)
            if pending.snap is None and self._adopted_all():
                self.adopting = False  # a whole average landed (every fragment's): this replica holds the consensus
                self._adopted.clear()
            pre_sq, post_sq, diff_sq = pending.sq
            post = post_sq**0.5
            self.last_drift = ((diff_sq**0.5) / post if post > 1e-10 else None, pre_sq**0.5, post)
