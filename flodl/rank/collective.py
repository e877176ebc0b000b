"""Parameter averaging through torch.distributed (the collective backend).

``build_group`` makes the rank's process group straight from the
controller's TCPStore, under a per-generation key prefix, without touching
torch's global default group, so a later membership generation can build a
fresh group without restarting the process. NCCL on CUDA devices, gloo
otherwise ("Nccl" modes mean this collective backend).

Before the group itself forms, every member marks its arrival in the store
and waits for all the others (``gather_members``), in short slices that can
give up. Members reach a new generation at different times (one survivor may
still sit in the collective that failed until its timeout), and torch's own
rendezvous waits only ``timeout_s``: without the barrier a survivor late by
more than that ended the run instead of joining it.

``CollectiveAverager`` averages a ``FlatModel`` (flat.py): one all-reduce per
bucket; every bucket carries one spare slot for the rank's weight, so a single
collective returns both the weighted sum and the sum of weights. A rank that
trained nothing since the last average joins with weight 0 and simply
receives the result.

A blocking average (Sync's per-batch rounds, a joiner adopting) reduces the
live buckets in place. A window's end average in Cadence and Async runs in the
background instead, as the CPU backend's does: the weighted values go into a
send buffer, the all-reduce runs on gloo's threads (or NCCL's stream) while the
rank trains on, and when it completes the result lands at a batch boundary as

    local ← (local − snapshot) + average

so a fast rank never waits at the barrier for a slow one, and the progress made
meanwhile is kept.

With ``--sync-fragments F`` an average takes only its fragment's buckets
(fragments.py: which one, from the average's position); the others are
neither sent nor touched, and keep each rank's own values until their turn. With no step in between this is exactly ``local ← average``
(the subtraction gives exact zeros), so replicas that stop training together
end bit-identical. A background average that fails (a peer died) is dropped:
the live values were never touched, so there is nothing to restore.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..wire.quant import Codec
from .compressed import Deltas, Exchange
from .flat import PARAMS, Averaged, FlatModel, WireTally, drift
from .fragments import Rotation, position_counter
from .outer import OuterStep

log = logging.getLogger(__name__)

#: The point-to-point tag of a donor's state (its size; the bytes take the next tag).
_STATE_TAG = 0x5E1D


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


class Superseded(Exception):
    """A member gave up gathering: a newer membership generation was announced (or the run stops)."""


def gather_members(
    store: dist.Store, rank: int, world_size: int, *, wait_s: float, give_up: Callable[[], bool] | None = None, poll_s: float = 0.02
) -> None:
    """Mark this member's arrival and wait until every member of the generation has arrived.

    Raises:
        Superseded: ``give_up()`` turned true while waiting.
        RuntimeError: not every member arrived within ``wait_s`` (names the missing ones).
    """
    store.set(f"arrived/{rank}", b"1")  # type: ignore[arg-type]  # torch's stub says str; the binding takes bytes too
    keys = [f"arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        if give_up is not None and give_up():
            raise Superseded
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise RuntimeError(f"process group: member(s) {missing} of {world_size} never arrived within {wait_s:g} s")
        time.sleep(poll_s)


def build_group(
    *,
    store_host: str,
    store_port: int,
    prefix: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    gather_s: float | None = None,
    give_up: Callable[[], bool] | None = None,
    on_gathered: Callable[[], object] | None = None,
) -> dist.ProcessGroup:
    """Join this generation's process group through the controller's store.

    ``gather_s`` (when set): first wait up to that long for every member to
    arrive (``gather_members``), giving up when ``give_up()`` turns true;
    then ``on_gathered()`` (fault injection's ``regroup`` point).

    Raises:
        Superseded: ``give_up()`` turned true before every member arrived.
        RuntimeError: the group could not form within ``timeout_s`` (a peer
            never arrived); torch's own error text is kept.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout, wait_for_workers=False)
    pstore = dist.PrefixStore(prefix, store)
    if gather_s is not None:
        gather_members(pstore, rank, world_size, wait_s=gather_s, give_up=give_up)
    if on_gathered is not None:
        on_gathered()
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # flodl's own detection (heartbeats, exits) must act first: its Regroup aborts the
        # communicator; NCCL's watchdog is the backstop, later, and set (in the rank's
        # environment) to clean up without killing the process
        opts._timeout = datetime.timedelta(seconds=2 * timeout_s + 10)
        # torch's stub makes ProcessGroupNCCL/Gloo a bare Backend, without the collectives its
        # binding has (allreduce, broadcast): they are used here as the ProcessGroup they act as
        return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)  # type: ignore[return-value]
    if give_up is None:
        return dist.ProcessGroupGloo(pstore, rank, world_size, timeout)  # type: ignore[return-value]  # the stub, as above
    return _interruptible(lambda: dist.ProcessGroupGloo(pstore, rank, world_size, timeout), give_up)


def _interruptible(make: Callable[[], Any], give_up: Callable[[], bool], poll_s: float = 0.02) -> Any:
    """Run ``make()`` (gloo connecting a group: it blocks until every member connected, or its
    timeout) on a thread of its own, so a member lost after everyone gathered costs the others
    nothing: once ``give_up()`` turns true (the next generation is announced) they leave it
    behind, and the abandoned attempt ends with its own timeout.

    Raises:
        Superseded: ``give_up()`` turned true first.
        RuntimeError: ``make()`` failed (torch's error is kept).
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def attempt() -> None:
        try:
            box["value"] = make()
        except BaseException as exc:  # handed to the caller, or dropped with an abandoned attempt
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=attempt, name="flodl-group-connect", daemon=True).start()
    while not done.wait(poll_s):
        if give_up():
            raise Superseded
    if "error" in box:
        raise box["error"]
    return box["value"]


def _aborted() -> RuntimeError:
    """The error of an average a regroup voided (the rank reads it as a collective failure)."""
    return RuntimeError("collective aborted: the membership changed (peer lost) during the average")


def ring_bytes(tensor: torch.Tensor, world: int) -> int:
    """What a member sends in a ring all-reduce of ``tensor``: ``2 (W-1)/W`` of its bytes."""
    return 2 * (world - 1) * tensor.numel() * tensor.element_size() // max(world, 1)


def _plain(average: torch.Tensor, outer: OuterStep | None, *, measured: bool) -> torch.Tensor:
    """The plain average, as the drift must read it: a copy where the outer step is about to change
    ``average`` in place. The drift is the replicas' disagreement (‖snapshot − average‖), not the
    outer step's move past the average: that grows as its momentum warms up, and the guard read
    the rising readings as diverging replicas and shrank the window below ``--min-anchor``."""
    return average.clone() if measured and outer is not None else average


class _Reduce:
    """A bucket's plain background average: one all-reduce of its weighted values and weight slot."""

    def __init__(self, work: Any, sent: int) -> None:
        self.works = [work]
        self.sent, self.extra = sent, 0

    def advance(self) -> bool:
        self.works[0].wait()  # completed: raises the collective's own error, if any
        return True


@dataclass
class _Background:
    """An average in flight while the rank trains: per bucket a job (``_Reduce``, or a compressed
    ``Exchange`` of several phases), its result into ``sends``. Jobs advance strictly in bucket
    order, so every member launches its collectives in the same order."""

    jobs: list[Any]
    sends: list[torch.Tensor]
    snapshot: list[torch.Tensor]  # the values at launch (the averager's ``backup``)
    measure: bool
    weight: float
    tag: int  # the rank's position of this average (regroup.py aligns redos by it)
    done: int = 0  # jobs completed, from the first
    # a compressed average's later phases are launched by a thread of its own (``_progress``): a
    # peer that stops polling (idle between windows, at the run's end) must not hold the others
    # in a phase it never started. ``finished``: set when that thread ends (None: no thread)
    finished: threading.Event | None = None
    error: BaseException | None = None
    cancelled: bool = False  # dropped: the thread launches nothing more
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def works(self) -> list[Any]:
        """The collectives in flight, every job's (None: a bucket outside the average's fragment)."""
        return [w for job in self.jobs if job is not None for w in job.works]

    @property
    def extra(self) -> int:
        """Bytes of the broadcasts its exchanges needed."""
        return sum(job.extra for job in self.jobs if job is not None)


class CollectiveAverager:
    """Weighted in-place averaging of a ``FlatModel`` over a process group.

    Parameters are weighted by the batches each rank trained since the last
    average; floating buffers equally among the ranks that trained. With no
    group (one rank) averaging is the identity and costs nothing.

    No wait here is uninterruptible. A gloo collective blocked on a peer (a
    dead one, or a survivor that already left the failed round) is not woken
    by aborting its group, so the rank never blocks in ``work.wait()``: it
    waits on the work's completion event in short slices and, once a regroup
    aborts the group or the run stops, abandons the collective at once. The
    abandoned work keeps running in gloo's threads until its own timeout, so
    it is parked with its group (``_graveyard``: dropping a group whose work
    still runs would block in its destructor) and the buckets it may still
    write into are replaced by fresh storage before the values are restored.
    """

    def __init__(
        self,
        flat: FlatModel | None,
        group: dist.ProcessGroup | None,
        must_stop: Callable[[], bool] = lambda: False,
        superseded: Callable[[], bool] = lambda: False,
        *,
        adopting: bool = False,
        compression: Codec | None = None,
        fragments: int = 1,
    ) -> None:
        self.flat = flat
        self._group = group
        self.must_stop = must_stop  # the run stops: no collective is worth waiting for
        # a newer generation was announced: this group is obsolete (read directly, so an abort that
        # came while the group was still being built is never lost to the setter's reset)
        self.superseded = superseded
        self.aborted = False  # set from the link thread when a regroup aborts the group
        self._graveyard: list[tuple[Any, Any]] = []  # (group, work) abandoned while the work still ran
        # joined a running job: no consensus until the admitting regroup's broadcast, or (when a
        # death broke that broadcast) until an average the others trained for lands here whole
        self.adopting = adopting
        self._backed_up = 0  # buckets whose backup belongs to the average in progress
        self.backup: list[torch.Tensor] | None = None  # values before the last average, for recovery
        # the background average (at most one): ``backup`` then holds its snapshot, ``_sends`` its buffers
        self._background: _Background | None = None
        self._sends: list[torch.Tensor] | None = None
        self.last_drift: tuple[float | None, float, float] | None = None
        self.dropped = 0  # background averages given up (a peer lost)
        self.dropped_tag, self.dropped_weight = -1, 0.0  # the last one given up: what a redo repeats
        # the last background average to land: its tag, and whether ``_sends`` still hold its result
        # (until the next launch): an eval asked for that average scores exactly it (``scoring``)
        self.landed_tag = -1
        self._kept: list[bool] | None = None  # per bucket: the send buffer holds the average
        self._scratch: list[torch.Tensor] | None = None
        # an optimizer on the averaged update (outer.py), set once the first consensus is taken: each
        # average's parameter buckets go through it before they land; ``equal_weights``: every rank
        # that trained weighs 1 (a bucket's total weight is then the number of ranks in the average)
        self.outer: OuterStep | None = None
        self.equal_weights = False
        # ``--sync-compression``: parameter buckets travel as compressed deltas from an anchor (compressed.py)
        self.deltas = Deltas(compression) if compression is not None else None
        # ``--sync-fragments``: which fragment each average takes (fragments.py); a joiner adopting
        # takes the consensus fragment by fragment, and holds it once every parameter bucket came
        self.rotation = Rotation(fragments)
        self._adopted: set[int] = set()
        self.wire = WireTally()  # bytes this rank's averages sent (a ring's count) and received

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @property
    def _model(self) -> FlatModel:
        """``flat``, on every path that averages, restores or scores: those run only with a
        group, and a rank has a flat model before its first group (``flatten``)."""
        assert self.flat is not None, "averaging a model that was never flattened"
        return self.flat

    def enter_group(self, group: dist.ProcessGroup | None) -> None:
        """A new generation's group: averages may run again (one still in flight on the old group is given up)."""
        if self._background is not None:
            self._drop(self._background)
        self._group = group
        self.aborted = False
        if self.deltas is not None:
            self.deltas.regrouped()

    def restore(self) -> None:
        """After a failed average: put back the values it started from (a failed
        all-reduce leaves half-reduced, pre-scaled values behind)."""
        if self.backup is None:
            return
        with torch.no_grad():
            for bucket in self._model.buckets:
                if bucket.flat.is_cuda:
                    # the aborted NCCL kernel ran on its own stream: let it end before
                    # we write the buffers it was reducing into
                    torch.cuda.synchronize(bucket.flat.device)
            # only the buckets this average reached hold a fresh backup
            for bucket, saved in list(zip(self._model.buckets, self.backup, strict=False))[: self._backed_up]:
                bucket.values.copy_(saved)
                bucket.copy_out()

    def abort(self) -> None:
        """Break a collective that is waiting on a dead peer (called from the link thread on a regroup).

        NCCL hangs rather than raise, so its communicator is aborted; a gloo
        wait ends through ``aborted`` (``_wait``), since aborting a gloo group
        does not wake a blocked receive.
        """
        group = self.group
        self.aborted = True  # NCCL may hand back half-reduced values without an error: never trust them
        if group is not None and isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
            try:
                group.abort()
            except Exception:  # already aborted or not abortable: the timeout still applies
                log.debug("process group abort failed", exc_info=True)

    def _wait(self, work: dist.Work, abandon: Callable[[dist.Work], None] | None = None) -> None:
        """Wait for a collective, abandoning it once a regroup aborts the group or the run stops
        (``abandon``: how; by default the live buckets it reduces into are moved away).

        Raises:
            RuntimeError: the collective failed, or was abandoned (``_aborted``).
        """
        if self.flat is not None and self.flat.buckets and self.flat.buckets[0].flat.is_cuda:
            self._await_device(work)
            work.wait()
            return
        if not work.is_completed():
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            while not done.wait(0.05):
                if self.aborted or self.must_stop() or self.superseded():
                    (abandon or self._abandon)(work)
                    raise _aborted()
        work.wait()  # raises the collective's own error

    def _abandon(self, work: dist.Work) -> None:
        """Leave a running collective behind: park it with its group, and move every bucket
        to fresh storage so a late write of the abandoned work lands in memory nobody reads."""
        self._graveyard.append((self._group, work))
        flat = self._model
        for index, bucket in enumerate(flat.buckets):
            flat.rehome(index, torch.empty_like(bucket.flat))
        self._bury()

    def _bury(self) -> None:
        """Drop abandoned collectives that have ended (their timeout passed), and their groups."""
        self._graveyard = [(g, w) for g, w in self._graveyard if not w.is_completed()]

    def highest(self, *values: int) -> list[int]:
        """Each of ``values``' largest over the group (one tiny all-reduce): how members agree on a redo."""
        if self.group is None:
            return list(values)
        top = torch.tensor(values, dtype=torch.int64, device=self._device())
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch's stub: RedOpType converts to ReduceOp (pybind)
        self._wait(self.group.allreduce([top], opts))
        return top.tolist()

    def _await_device(self, work: dist.Work) -> None:
        """Wait for an NCCL collective without holding the GIL.

        ``.item()`` on the result would block inside CUDA with the GIL held, so
        the link thread could not heartbeat and a rank waiting on a hung peer
        would look hung itself. Polling with short sleeps keeps it beating, and
        lets a regroup's abort end the wait at once.
        """
        delay = 0.0001
        while not work.is_completed():
            if self.aborted or self.must_stop() or self.superseded():
                raise _aborted()
            time.sleep(delay)
            delay = min(delay * 2, 0.002)

    def broadcast_from(self, root: int = 0) -> None:
        """Make every replica equal to ``root``'s (start of training, ranks joined): this one
        then holds the consensus, so a joiner stops adopting."""
        if self.group is not None:
            with torch.no_grad():
                for bucket in self._model.buckets:
                    bucket.copy_in()
                    self._wait(self.group.broadcast(bucket.flat, root))
                    self.wire.broadcast += bucket.flat.numel() * bucket.flat.element_size()
                    bucket.copy_out()
                if self.outer is not None:  # and the outer optimizer's state: every member steps alike from here
                    for tensor in self.outer.tensors().values():
                        self._wait(self.group.broadcast(tensor, root))
        if self.deltas is not None and self.flat is not None:
            self.deltas.rebase(self.flat.buckets)  # every replica holds these values: the anchor
        self.adopting = False
        self._adopted.clear()

    # ------------------------------------------------------- a donor's state (handoff.py)

    def joining(self, me: int, joining: bool) -> list[int]:
        """The members (group ranks) that joined: held no consensus before the broadcast (one tiny
        all-reduce every member calls; ``me``: this member's group rank)."""
        assert self.group is not None, "no group to ask"
        flags = torch.zeros(self.group.size(), dtype=torch.int64, device=self._device())
        flags[me] = int(joining)
        self._wait(self.group.allreduce([flags]))
        return [index for index, flag in enumerate(flags.tolist()) if flag]

    def send_state(self, state: bytearray, to: list[int]) -> None:
        """Send ``state``'s bytes to each of the members ``to`` (its size first: 0 sends nothing more).

        Raises:
            RuntimeError: a member was lost (the collective's own error), or the wait was abandoned.
        """
        assert self.group is not None, "no group to send through"
        device = self._device()
        size = torch.tensor([len(state)], dtype=torch.int64, device=device)
        data = torch.frombuffer(state, dtype=torch.uint8).to(device) if state else None
        for dst in to:
            self._wait_p2p(self.group.send([size], dst, _STATE_TAG))
            if data is not None:
                self._wait_p2p(self.group.send([data], dst, _STATE_TAG + 1))

    def receive_state(self, root: int) -> memoryview:
        """The bytes member ``root`` sends (``send_state``), in host memory (writable, no copy on a
        CPU rank); empty when it had none.

        Raises:
            RuntimeError: the root was lost (the collective's own error), or the wait was abandoned.
        """
        assert self.group is not None, "no group to receive through"
        device = self._device()
        size = torch.zeros(1, dtype=torch.int64, device=device)
        self._wait_p2p(self.group.recv([size], root, _STATE_TAG))
        if not int(size.item()):
            return memoryview(bytearray())
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._wait_p2p(self.group.recv([data], root, _STATE_TAG + 1))
        return memoryview(data.cpu().numpy())  # type: ignore[arg-type]  # numpy's stubs: an ndarray is a buffer

    def _wait_p2p(self, work: dist.Work) -> None:
        """Wait for a point-to-point transfer, abandoning it like any collective (``_wait``). Gloo
        moves a send's or a receive's bytes inside ``wait()`` itself (it never completes on its
        own, and has no future), so the wait runs on a thread of its own; an abandoned one is
        parked with its group and ends with gloo's timeout (its buffers are its own).

        Raises:
            RuntimeError: the transfer failed (a peer was lost), or was abandoned (``_aborted``).
        """
        if self._device().type == "cuda":
            self._wait(work, abandon=lambda w: self._graveyard.append((self._group, w)))
            return
        try:
            _interruptible(work.wait, lambda: self.aborted or self.must_stop() or self.superseded())
        except Superseded:
            self._graveyard.append((self._group, work))
            raise _aborted() from None

    def _device(self) -> torch.device:
        """Where this group's tensors live (NCCL: the rank's GPU)."""
        return self.flat.buckets[0].flat.device if self.flat is not None and self.flat.buckets else torch.device("cpu")

    def _outer_step(self, index: int, average: torch.Tensor, total: float) -> bool:
        """Bucket ``index``'s ``average`` through the outer optimizer (in place), when there is one;
        ``total``: the bucket's total weight (equal weights: the ranks in the average)."""
        if self.outer is None:
            return False
        group = self.group
        ranks = round(total) if self.equal_weights else (group.size() if group is not None else 1)
        self.outer.step_(index, average, ranks=ranks)
        return True

    def _values(self) -> list[torch.Tensor]:
        """Every bucket's values as the model holds them now."""
        out = []
        for bucket in self._model.buckets:
            bucket.copy_in()
            out.append(bucket.values)
        return out

    def adopt_next(self) -> None:
        """Take the next average whole, adding nothing to it: the others completed an average
        this rank lost, and their consensus is the next one's result (with fragments: the next
        averages, until every fragment came)."""
        self.adopting = True
        self._adopted.clear()

    def _adopted_all(self) -> bool:
        """Every parameter bucket came in an average since adopting began (one average without fragments)."""
        return all(i in self._adopted for i, b in enumerate(self._model.buckets) if b.group == PARAMS)

    def flatten(self, model: torch.nn.Module) -> None:
        """Average ``model`` from now on (a run that started alone and just grew: not flat yet)."""
        if self.flat is None:
            self.flat = FlatModel(model, self.rotation.fragments)

    # ------------------------------------------------------- background averages

    def poll(self) -> bool:
        """Land the background average if its collectives completed (never blocks); True if one landed.

        Raises:
            RuntimeError: it failed (a peer died); it is dropped, the live values kept.
        """
        bg = self._background
        if bg is None:
            return False
        try:
            if bg.finished is not None:
                if not bg.finished.is_set():
                    return False
                self._raise_unfinished(bg)
            elif not self._advance(bg):
                return False
        except BaseException:
            self._drop(bg)
            raise
        self._land(bg)
        return True

    @staticmethod
    def _raise_unfinished(bg: _Background) -> None:
        """A progress thread ended: raise what stopped it short of the last job, if anything did."""
        if bg.error is not None:
            raise bg.error
        if bg.done < len(bg.jobs):
            raise _aborted()

    def _progress(self, bg: _Background) -> None:
        """The progress thread of a compressed background average: each job's next phase starts as
        soon as its collectives complete, in bucket order, whatever the training loop is doing."""

        def stop() -> bool:
            return bg.cancelled or self.aborted or self.must_stop() or self.superseded()

        try:
            while bg.done < len(bg.jobs):
                job = bg.jobs[bg.done]
                for work in list(job.works) if job is not None else []:
                    if not work.is_completed():
                        done = threading.Event()
                        work.get_future().add_done_callback(lambda _, done=done: done.set())
                        while not done.wait(0.05):
                            if stop():
                                return
                with bg.lock:
                    if bg.cancelled:
                        return
                    if job is None or job.advance():
                        bg.done += 1
        except BaseException as exc:  # handed to the training thread at its next poll or settle
            bg.error = exc
        finally:
            assert bg.finished is not None
            bg.finished.set()

    def _advance(self, bg: _Background, wait: Callable[[Any], None] | None = None) -> bool:
        """Move ``bg``'s jobs on, in bucket order: each whose collectives completed starts its next
        phase or is done. ``wait``: block on each collective with it (else stop at the first one
        still running). True once every job is done."""
        while bg.done < len(bg.jobs):
            job = bg.jobs[bg.done]
            if job is None:  # outside the average's fragment
                bg.done += 1
                continue
            if wait is not None:
                for work in job.works:
                    wait(work)
            elif not all(w.is_completed() for w in job.works):
                return False
            if job.advance():
                bg.done += 1
        return True

    def settle(self) -> bool:
        """Wait for the background average and land it; True if one landed. The wait gives up
        like any other (a regroup, the run stopping): the average is then dropped.

        Raises:
            RuntimeError: it failed or was given up; the live values are kept.
        """
        bg = self._background
        if bg is None:
            return False
        cuda = self._model.buckets[0].flat.is_cuda
        try:
            if bg.finished is not None:
                while not bg.finished.wait(0.05):
                    if self.aborted or self.must_stop() or self.superseded():
                        raise _aborted()
                self._raise_unfinished(bg)
            else:
                self._advance(bg, wait=self._await_device if cuda else lambda work: self._wait(work, abandon=lambda _: None))
        except BaseException:
            self._drop(bg)
            raise
        self._land(bg)
        return True

    def _land(self, bg: _Background) -> None:
        """``local ← (local − snapshot) + average``, bucket by bucket (see the module docstring)."""
        self._background = None
        pre_all, post_all = [], []
        kept = []
        self.wire.add(bg.extra)  # a broadcast the exchange needed (its phases: at launch)
        try:
            with torch.no_grad():
                for index, (bucket, pre, send, job) in enumerate(zip(self._model.buckets, bg.snapshot, bg.sends, bg.jobs, strict=False)):
                    if job is None:  # another fragment's: this rank's own values stay
                        kept.append(False)
                        continue
                    compressed = isinstance(job, Exchange)
                    total = job.total if compressed else float(send[bucket.numel :].item())
                    if self.aborted:
                        raise _aborted()  # NCCL may hand back half-reduced values after an abort
                    kept.append(total > 0)
                    if total <= 0:
                        continue  # nobody trained since the last average: nothing to take
                    # a compressed bucket's exchange left the average itself in the send buffer
                    average = send[: bucket.numel] if compressed else send[: bucket.numel].div_(total)
                    measured = bg.measure and bucket.group == PARAMS
                    plain = _plain(average, self.outer, measured=measured)
                    self._outer_step(index, average, total)
                    bucket.copy_in()
                    bucket.values.sub_(pre).add_(average)
                    bucket.copy_out()
                    if compressed and self.deltas is not None:
                        self.deltas.landed(index, average, job)
                    if measured:
                        pre_all.append(pre)
                        post_all.append(plain)
        except BaseException:
            self._drop(bg)
            raise
        self.landed_tag, self._kept = bg.tag, kept
        if self.outer is not None and any(kept):
            self.outer.round_done()
        if bg.measure:
            self.last_drift = drift(pre_all, post_all)

    def _drop(self, bg: _Background) -> None:
        """Give up a background average; unfinished collectives are parked with their group
        and their send buffers left to them (the next average allocates fresh ones)."""
        self._background = None
        self._kept = None
        self.dropped += 1
        self.dropped_tag, self.dropped_weight = bg.tag, bg.weight
        with bg.lock:  # its progress thread launches nothing more: what runs now is all that will
            bg.cancelled = True
            running = [w for w in bg.works if not w.is_completed()]
        self.wire.add(bg.extra)
        if running:
            self._graveyard.extend((self._group, w) for w in running)
            self._sends = None

    def _launch(
        self, group: dist.ProcessGroup, backup: list[torch.Tensor], weight: float, measure: bool, tag: int, chosen: list[bool]
    ) -> Averaged:
        """Start the average in the background on ``group`` from a snapshot of the values (into
        ``backup``), of the buckets ``chosen`` (its fragment's)."""
        start = time.perf_counter()
        buckets = self._model.buckets
        if self._sends is None:
            self._sends = [torch.empty_like(b.flat) for b in buckets]
        self._kept = None  # the buffers are about to hold the next average
        jobs: list[Any] = []
        world = group.size()
        with torch.no_grad():
            for index, (bucket, pre, send) in enumerate(zip(buckets, backup, self._sends, strict=False)):
                bucket.copy_in()
                w = weight if bucket.group == PARAMS else (1.0 if weight > 0 else 0.0)
                pre.copy_(bucket.values)
                if not chosen[index]:
                    jobs.append(None)
                    continue
                if self.deltas is not None and self.deltas.compressed(bucket):
                    jobs.append(Exchange(group, self.deltas, index, bucket.values, w, out=send[: bucket.numel]))
                    continue
                torch.mul(bucket.values, w, out=send[: bucket.numel])
                send[bucket.numel :].fill_(w)
                jobs.append(_Reduce(group.allreduce([send]), ring_bytes(send, world)))
        self.wire.begin()
        self.wire.add(sum(job.sent for job in jobs if job is not None))  # a background average's bytes are counted as it starts
        bg = self._background = _Background(jobs, self._sends, backup, measure, weight, tag)
        if any(isinstance(job, Exchange) for job in jobs):
            bg.finished = threading.Event()
            threading.Thread(target=self._progress, args=(bg,), name="flodl-average-phases", daemon=True).start()
        ms = (time.perf_counter() - start) * 1000.0
        if not measure:
            return Averaged(ms)
        return Averaged(ms, *(self.last_drift or (None, 0.0, 0.0)))

    def pending_tag(self) -> int:
        """The tag of the background average in flight (-1: none)."""
        return self._background.tag if self._background is not None else -1

    @contextlib.contextmanager
    def scoring(self, tag: int) -> Iterator[bool]:
        """Hold the result of the background average ``tag`` in the model while the block runs,
        then put the live values back: an eval scores the model exactly as that average left it,
        whatever this rank trained since. Yields False (and changes nothing) when that result is
        no longer held (a later average launched, or it was dropped)."""
        if self._kept is None or self.landed_tag != tag:
            yield False
            return
        # a landed average's send buffers and snapshot: kept with ``_kept`` until the next launch or drop
        assert self._sends is not None and self.backup is not None
        buckets = self._model.buckets
        if self._scratch is None:
            self._scratch = [torch.empty_like(b.values) for b in buckets]
        with torch.no_grad():
            for bucket, keep, send, pre, live in zip(buckets, self._kept, self._sends, self.backup, self._scratch, strict=False):
                bucket.copy_in()
                live.copy_(bucket.values)
                # a bucket nobody trained kept its launch values (the snapshot): that is the average's
                bucket.values.copy_(send[: bucket.numel] if keep else pre)
                bucket.copy_out()
        try:
            yield True
        finally:
            with torch.no_grad():
                for bucket, live in zip(buckets, self._scratch, strict=False):
                    bucket.values.copy_(live)
                    bucket.copy_out()

    # ------------------------------------------------------------------ average

    def average(self, weight: float, *, measure: bool = False, block: bool = True, tag: int = -1, final: bool = False) -> Averaged:
        """Replace every replica's tensors by the weighted average (``tag``: the caller's name for
        it, and with ``--sync-fragments`` the place that picks its fragment: fragments.py).

        ``final``: the run's last average (a clean end with fragments): every fragment, a plain
        mean of the replicas (no outer step), so the run ends on one consensus.

        ``block=False`` (a window's end in Cadence and Async) starts it in the
        background and returns at once; it lands at a later ``poll``/``settle``
        (drift then reported one average late, as on the CPU backend). A
        joiner still adopting always blocks. Either way the previous background
        average lands first: one average in flight at a time.

        With ``measure`` the replica's drift ``‖pre − post‖ / ‖post‖`` is reported
        too (one copy of the values, not counted in ``ms``).

        Raises:
            RuntimeError: the collective failed (a peer died) or timed out.
        """
        if self.group is None:
            return Averaged(0.0, 0.0 if measure else None)
        self._backed_up = 0  # a failure from here on leaves the live values as they are, until the backup below
        if self._graveyard:
            self._bury()
        self.settle()
        self._kept = None  # the buffers the landed result lies in are reused from here
        if self.backup is None:  # allocated once: an average must not allocate a model each time
            self.backup = [torch.empty_like(b.values) for b in self._model.buckets]
        chosen = self._model.chosen(None if final else self.rotation.of(position_counter(tag)))
        if not block and not self.adopting:
            return self._launch(self.group, self.backup, weight, measure, tag, chosen)
        collective_ms = 0.0  # what ElChe weighs against compute: the collective, not our bookkeeping
        pre_all, post_all = [], []
        landed = True  # every parameter bucket came back as the others' weighted average
        stepped = False  # the outer step took this average
        self.wire.begin()
        world = self.group.size()
        with torch.no_grad():
            for index, (bucket, pre) in enumerate(zip(self._model.buckets, self.backup, strict=False)):
                bucket.copy_in()
                values, slot = bucket.values, bucket.flat[bucket.numel :]
                plain = values  # what the drift reads: the plain average (_plain), else the values that land
                w = weight if bucket.group == PARAMS else (1.0 if weight > 0 else 0.0)
                # the values before the average: to measure drift, to recover if a peer
                # dies mid-collective, and for a zero-weight rank if nobody trained
                pre.copy_(values)
                self._backed_up += 1
                if not chosen[index]:
                    continue  # another fragment's: this rank's own values stay
                start = time.perf_counter()
                exchange = None
                if self.deltas is not None and self.deltas.compressed(bucket):
                    # the average lands in the live values only once every phase is in (a failure restores them)
                    exchange = Exchange(self.group, self.deltas, index, values, w, out=values)
                    try:
                        while True:
                            for work in exchange.works:
                                self._wait(work)
                            if exchange.advance():
                                break
                    finally:
                        self.wire.add(exchange.sent + exchange.extra)
                    total = exchange.total
                else:
                    if w != 1.0:
                        values.mul_(w)
                    slot.fill_(w)
                    self._wait(self.group.allreduce([bucket.flat]))
                    self.wire.add(ring_bytes(bucket.flat, world))
                    total = float(slot.item())
                if self.aborted:
                    raise _aborted()
                collective_ms += (time.perf_counter() - start) * 1000.0
                if total > 0:
                    if exchange is None:
                        values.div_(total)
                    if measure and bucket.group == PARAMS:
                        plain = _plain(values, self.outer, measured=True)
                    if self.adopting:
                        self._adopted.add(index)
                    elif not final:  # a joiner's adoption is the others' consensus, their step in it
                        stepped = self._outer_step(index, values, total) or stepped
                    if exchange is not None and self.deltas is not None:
                        self.deltas.landed(index, values, exchange)
                else:
                    values.copy_(pre)
                    landed = landed and bucket.group != PARAMS
                bucket.copy_out()
                if measure and bucket.group == PARAMS:
                    pre_all.append(pre)
                    post_all.append(plain)
        if stepped and self.outer is not None:
            self.outer.round_done()
        if self.adopting and landed and weight == 0 and self._adopted_all():
            self.adopting = False  # we added nothing, so what came back is the others' consensus
            if self.outer is not None:
                self.outer.rebase(self._values())
        if not measure:
            return Averaged(collective_ms)
        return Averaged(collective_ms, *drift(pre_all, post_all))
