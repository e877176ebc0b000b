"""The rank's place in its group, and its averages across membership changes (``Group``).

``Group`` owns the rank's ``GroupPosition`` (position.py: generation, world
size, peers, where its averages stand, what is to be redone) and its averager
(either backend: averager.py). Nothing else writes them; the other parts
read the position, and ask ``Group`` to average, land, settle and regroup.

When a collective fails (a peer died) the rank puts its values back, waits
for the controller's ``Regroup``, joins the survivors' new group (gathering
first: collective.py says why) and redoes the same average there; a
``Regroup`` for ranks that joined also carries whose parameters (the
consensus) every member takes.

**The averaging step is one seam.** Every average the rank takes, through
either backend, on any path (a round's end, after a redo), is applied to the
rank in one place, ``_took``: the position moves on, the redo is cleared, the
parts subscribed with ``on_average`` hear of it (the evaluator: BatchNorm
statistics are stale), the liveness clock is told. A part that acts on each
average (an outer optimizer on the averaged delta) subscribes there; the
values of a background average reach the model later, at a batch boundary
(``land_background``: collective.py ``_land``, cpu_average.py ``_apply``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.bundle import CheckpointError
from ..config import AverageBackend
from ..config.deadlines import Deadlines
from ..errors import DeadlineExceeded
from ..wire import messages as m
from ..wire.quant import codec
from .collective import CollectiveAverager, Superseded, build_group
from .cpu_average import CpuAverager
from .flat import PARAMS, Averaged, FlatModel
from .fragments import Rotation
from .joining import cpu_averager, first_group
from .outcomes import Stop, is_collective_error
from .outer import OuterConfig, OuterStep
from .position import GroupPosition
from .window_stats import RoundStats

if TYPE_CHECKING:
    from .averager import Averager
    from .context import JoinedRun, RankContext
    from .handoff import StateHandoff

log = logging.getLogger("flodl.rank.runner")


def redo_roles(mine: int, *, redo: bool, adopting: bool, top: int, top_redo: int) -> tuple[bool, bool]:
    """Who does what about a lost average when a new group forms (no consensus broadcast).

    Every member reports ``mine`` (the place of the average it does next, or of
    the one it lost) and, if it lost one, that place again; ``top`` and
    ``top_redo`` are the largest over the group. Returns ``(skip, join)``:
    ``skip`` — this member lost an average another member has behind it, so it
    takes their consensus from the next average instead of repeating it;
    ``join`` — this member is a joiner with nothing to repeat while others do
    repeat theirs (a redoer at the highest place), so it takes part with weight
    0: every member must do the same collectives in the same order.
    """
    skip = redo and top > mine
    join = adopting and not redo and top_redo >= 0 and top_redo == top
    return skip, join


class Group:
    """The rank's group position and averager: averages, and the rebuilt process groups they continue in."""

    def __init__(self, ctx: RankContext, deadlines: Deadlines) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.rank = ctx.rank
        self.at = GroupPosition()  # replaced whole, only here
        self.deadlines = deadlines  # the heartbeat's until the welcome brings the rest (``join``)
        self.averager: Averager | None = None  # set up by ``join``, before the first window, eval or regroup
        self.welcome: m.RankWelcome | None = None  # the store regroups build their groups through
        self.model: torch.nn.Module | None = None  # flattened when a run that started alone grows
        self.listeners: list[Callable[[GroupPosition], object]] = []  # told of every average (``on_average``)
        # this rank's state as a donor hands it and a joiner takes it (handoff.py): set once the replica exists
        self.handoff: StateHandoff | None = None
        self._evals_at_launch = 0  # the evals asked when the last average was launched (``_waited``)

    # ---------------------------------------------------------------- joining

    def join(self, run: JoinedRun, model: torch.nn.Module, flat: FlatModel | None) -> None:
        """The welcome's group: the averager of the run's backend (CPU: through the controller or
        this host's relay; collective: the first process group), and the first consensus (rank 0's
        parameters; a joiner, ``welcome.late``, takes it with the Regroup that admits it)."""
        welcome = run.welcome
        self.welcome, self.model, self.deadlines = welcome, model, run.deadlines
        self.at = GroupPosition(generation=welcome.generation, world_size=welcome.world_size)
        if flat is not None and run.config.elche.mode.backend is AverageBackend.CPU:
            cpu = self.averager = cpu_averager(self.ctx, run, flat)
            cpu.took_state = self._took_state
            # named the donor of ranks that join: its state goes with its snapshot of their first round
            # (heard on the link thread, so no newer Regroup can hide it before the training thread looks)
            self.link.call_on_regroup(lambda msg: cpu.hand_state_at(msg.first_round) if self._donates(msg) else None)
        else:
            group = None
            if flat is not None and not welcome.late:  # a joiner's comes with its Regroup
                group = first_group(self.ctx, welcome, run.deadlines, self.announced_after, self.report_collective_failure)
            collective = self.averager = CollectiveAverager(
                flat,
                group,
                must_stop=self.ctx.must_stop,
                superseded=self.group_broken,
                adopting=welcome.late,
                compression=codec(run.config.sync_compression),
                fragments=run.config.sync_fragments,
            )
            self.at = dataclasses.replace(self.at, peers=frozenset(range(welcome.world_size)) if group is not None else frozenset())
            # NCCL: break a hang on a dead peer (a regroup that only adds ranks leaves every collective able to finish)
            self.link.call_on_regroup(lambda msg: collective.abort() if self._loses_peer(msg) else None)
        if not welcome.late:
            self._take_first_consensus(welcome)
        self._outer(run, flat)

    def _outer(self, run: JoinedRun, flat: FlatModel | None) -> None:
        """The outer optimizer the run asks for (outer.py), from the consensus just taken (a joiner:
        from its own values, which the broadcast that admits it replaces with the members' state)."""
        outer = OuterConfig.of(run.config)
        averager = self.averager
        if flat is None or averager is None or not outer.active:
            return
        for bucket in flat.buckets:
            bucket.copy_in()
        step = OuterStep(outer, [b.values for b in flat.buckets], [b.group == PARAMS for b in flat.buckets])
        if isinstance(averager, CollectiveAverager):
            averager.outer, averager.equal_weights = step, run.config.average_weights == "equal"
        elif isinstance(averager, CpuAverager):
            averager.outer = step

    def hand_with(self, handoff: StateHandoff) -> None:
        """This rank's state, as a donor hands it and a joiner takes it (the replica exists now)."""
        self.handoff = handoff
        if isinstance(self.averager, CpuAverager):
            self.averager.state_out.dump = lambda: handoff.dump(outer=True)  # the CPU backend's joiners step the outer optimizer too

    def _donates(self, msg: m.Regroup) -> bool:
        """CPU backend: does ``msg`` name this rank the donor of the ranks it admits?"""
        return msg.sync_from == self.rank and msg.first_round >= 0 and self.rank in msg.members

    def _took_state(self, state: bytearray | memoryview | None) -> bool:
        """A joiner's donor state came (None: it did not): loaded; True when the outer optimizer's came with it."""
        if state is None or self.handoff is None:
            log.warning("rank %d: no optimizer state came from the donor; training with a fresh optimizer", self.rank)
            return False
        return self.handoff.load(state)

    def outer(self) -> OuterStep | None:
        """The outer optimizer (outer.py), when the run has one."""
        averager = self.averager
        return averager.outer if isinstance(averager, (CollectiveAverager, CpuAverager)) else None

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's state as a bundle keeps it (empty without one)."""
        step = self.outer()
        return step.tensors() if step is not None else {}

    def resume_outer(self, saved: dict[str, torch.Tensor], steps: int) -> None:
        """A resumed run: the bundle's outer optimizer state (its anchor and momentum), so the first
        averages step on from where the saved run stood. A bundle without one (written before it was
        kept, or by a run without an outer optimizer) leaves the fresh state, anchored at the bundle's
        parameters, with a warning.

        Raises:
            CheckpointError: the saved state does not fit this model's buckets.
        """
        step = self.outer()
        if step is None:
            return
        if not saved:
            log.warning("rank %d: the bundle holds no outer optimizer state: its momentum starts from zero", self.rank)
            return
        try:
            step.load_tensors(saved)
        except ValueError as exc:
            raise CheckpointError(f"the bundle's outer optimizer state: {exc}") from None
        step.steps = steps
        self.ctx.probes.observe("resumed", lambda: dict(step.tensors()))

    def rotation(self) -> Rotation | None:
        """Where ``--sync-fragments``' rotation stands (fragments.py); None without fragments."""
        averager = self.averager
        rotation = averager.rotation if isinstance(averager, (CollectiveAverager, CpuAverager)) else None
        return rotation if rotation is not None and rotation.active else None

    def fragment_state(self) -> dict[str, Any]:
        """What a bundle keeps of the rotation (fragments.py ``Rotation.state``; empty without fragments)."""
        rotation = self.rotation()
        return rotation.state(self.ctx.env.run_id) if rotation is not None else {}

    def resume_fragments(self, train_state: dict[str, Any]) -> None:
        """A resumed run (or a rank joining one): go on with the bundle's rotation, so this rank's
        averages take the fragments the other members' take (fragments.py ``Rotation.take``)."""
        rotation = self.rotation()
        if rotation is not None:
            rotation.take(train_state, self.ctx.env.run_id)

    def final_average(self) -> None:
        """A clean end with ``--sync-fragments``: one more average, of every fragment (a plain mean
        of the replicas, each weighing 1; an adopting joiner 0), so the run ends on one consensus.
        A failure (a peer lost at the very end) keeps this replica, as a failed average does."""
        averager = self.averager
        if self.rotation() is None or averager is None or self.at.world_size <= 1:
            return
        if isinstance(averager, CollectiveAverager) and (averager.group is None or self.announced_after(self.at.generation)):
            return  # no group, or a Regroup crossed the Shutdown: the members are not one group to average in
        self.link.doing("average")
        try:
            if isinstance(averager, CpuAverager):
                averager.settle()  # the rounds in flight land first: the last one's values are in the mean
            averager.average(0.0 if averager.adopting else 1.0, block=True, final=True)
        except (RuntimeError, DeadlineExceeded) as exc:
            log.warning("rank %d: the final full average failed (%s); this replica ends as it is", self.rank, exc)
            return
        for listener in self.listeners:  # it changed the model: the BatchNorm statistics are stale again
            listener(self.at)

    def _take_first_consensus(self, welcome: m.RankWelcome) -> None:
        """Take rank 0's parameters, unless the first group never formed or a rank died during
        the broadcast: the survivors' Regroup then names whose parameters every member takes."""
        averager = self.averaging()
        try:
            averager.broadcast_from(0)
        except RuntimeError as exc:
            if not isinstance(averager, CollectiveAverager) or not is_collective_error(exc):
                raise
            log.warning("rank %d: the first broadcast failed (%s); waiting for the survivors' group", self.rank, exc)
            self.report_collective_failure(exc, welcome.generation)

    def announced_after(self, generation: int) -> bool:
        """Has the controller announced a membership generation newer than ``generation``?"""
        announced = self.link.regroup
        return announced is not None and announced.generation > generation

    def wire_gauges(self) -> dict[str, int]:
        """The bytes this rank's averages put on the network so far (``WireTally``), for its window report."""
        return self.averager.wire.gauges() if self.averager is not None else {}

    def averaging(self) -> Averager:
        """The averager: ``join`` sets it up before the first window, eval or regroup."""
        assert self.averager is not None, "averaging before the rank joined"
        return self.averager

    def _collective(self) -> CollectiveAverager:
        """The averager on a path only the collective backend takes (its groups are rebuilt, its
        averages redone: the CPU backend's rounds need neither, so they never get here)."""
        averager = self.averager
        assert isinstance(averager, CollectiveAverager), "a regroup step without a collective averager"
        return averager

    def _move(self, **changes: object) -> None:
        """The one writer of the position: a new value with ``changes``."""
        self.at = dataclasses.replace(self.at, **changes)  # type: ignore[arg-type]  # the fields, by name

    # --------------------------------------------------------------- averaging

    def on_average(self, listener: Callable[[GroupPosition], object]) -> None:
        """Call ``listener(position)`` after every average this rank takes (``_took``)."""
        self.listeners.append(listener)

    def at_round(self, window: int, round_index: int) -> None:
        """The next average is window ``window``'s round ``round_index``."""
        self._move(position=(window << 16) | round_index)

    def take_dropped_window(self) -> int:
        """The window whose background average was dropped since the last report (-1: none), for this report."""
        dropped = self.at.dropped_window
        if dropped >= 0:
            self._move(dropped_window=-1)
        return dropped

    def average(self, weight: float, *, measure: bool, block: bool, round_index: int, stats: RoundStats) -> Averaged:
        """Average, surviving a peer's death: if the collective fails, put the values
        back, join the survivors' new group, and do this same average again there."""
        self.ctx.probes.reach("average")
        self.link.doing("average")
        averager = self.averaging()
        while True:
            self.regroup_in_round(stats, round_index)
            if self.at.skip_redo:
                # the others completed the average this rank lost: it holds what we sent, and we
                # take it from the next average, adding nothing to it (the adopting path)
                self._collective().adopt_next()
                self._move(skip_redo=False, redoing=False, position=self.at.position + 1)
                log.warning("rank %d: the survivors completed the failed average; taking their consensus next", self.rank)
                self.link.doing("step")  # not an average of this generation: the adopting one will be
                return Averaged(0.0)
            t0 = time.perf_counter()
            landed = self._previous_landed()
            self._waited((time.perf_counter() - t0) * 1000.0, stats)
            if not landed:
                continue  # it was dropped: the survivors' group (above, next turn) repeats it first
            try:
                averaged = averager.average(weight, measure=measure, block=block, tag=self.at.position)
            except RuntimeError as exc:
                if not isinstance(averager, CollectiveAverager) or not is_collective_error(exc):
                    raise
                if self.ctx.must_stop():
                    raise Stop from None  # the run stops: an abandoned average is not worth redoing
                self._move(redoing=True)
                log.warning("rank %d: averaging failed (%s); waiting for the survivors' new group", self.rank, exc)
                announced = self.link.regroup
                if announced is None or announced.generation <= self.at.generation:
                    # tell the controller: a death it has not seen yet, or a group to rebuild
                    # (a failure a newer generation already explains needs no hint)
                    self.report_collective_failure(exc, self.at.generation)
                averager.restore()
                self._await_regroup()
                stats.regrouped(round_index)
                continue
            return self._took(averaged)

    def _waited(self, ms: float, stats: RoundStats) -> None:
        """This rank waited ``ms`` for the previous average to land. With an eval asked since that
        average was launched, the wait is for a late peer (its eval, a pause): not this rank's
        pace, nor averaging cost (window_stats.py RoundStats.finish). Otherwise it is the average
        itself, slower than a window (a slow link): averaging cost, which ElChe's overhead tune must
        see to lengthen the windows (as a pause it saw none, and shortened them: a 100 Mbit/50 ms
        link made 123 averages of a run that made 50 unshaped)."""
        if self.link.evals_asked != self._evals_at_launch:
            stats.paused_ms += ms
        else:
            stats.sync_ms += ms

    def _took(self, averaged: Averaged) -> Averaged:
        """An average completed (a background one: launched): the rank moves on past it. The one
        place an average is applied to the rank: its position, the redo, the listeners (the
        evaluator; an outer optimizer would be one), and progress for the controller's liveness
        (the first average in a new generation is reported at once: the recovery is timed by it)."""
        self._move(redoing=False, position=self.at.position + 1)
        self._evals_at_launch = self.link.evals_asked
        for listener in self.listeners:
            listener(self.at)
        self.link.doing("step")
        self.link.averaged_in(self.at.generation)
        return averaged

    def _previous_landed(self) -> bool:
        """Before an average: the background one still in flight lands first (one at a time).
        False when it failed: it is dropped, and the rank waits for the survivors' new group."""
        averager = self.averaging()
        if not isinstance(averager, CollectiveAverager):
            return True
        try:
            averager.settle()
            return True
        except RuntimeError as exc:
            self._background_failed(exc)
        self._await_regroup()
        return False

    def land_background(self) -> None:
        """Land an average that completed while this rank trained (never blocks).

        A collective one that failed (a peer died) is dropped, the live values
        kept; the controller is told unless a newer generation already explains
        it, and training goes on until its Regroup (``maybe_regroup``).
        """
        try:
            self.averaging().poll()
        except RuntimeError as exc:
            self._background_failed(exc)

    def settle_background(self) -> None:
        """Wait for the collective average still in flight and land it (eval, save, exit):
        bounded like every collective wait; a failure drops it and is reported."""
        if not isinstance(self.averager, CollectiveAverager):
            return
        busy = self.link.busy
        self.link.doing("average")
        try:
            self.averager.settle()
        except RuntimeError as exc:
            self._background_failed(exc)
        finally:
            self.link.doing(busy)

    def settle_last(self) -> None:
        """A clean end: the last average still in flight lands on either backend, so the replicas end
        equal (on the CPU backend a Cadence or Async round sent with the last window was never waited
        for: each replica ended on its own values). Bounded; a round that never comes is said, not fatal."""
        self.settle_background()
        if isinstance(self.averager, CpuAverager) and self.averager.pending:
            try:
                self.averager.settle()
            except DeadlineExceeded as exc:
                log.warning("the last average did not come back before the end (%s): this replica ends on its own values", exc)
            # it changed the model after the listeners last heard (a CPU round lands after its
            # launch): the BatchNorm statistics re-estimated since then are stale again
            for listener in self.listeners:
                listener(self.at)

    def _background_failed(self, exc: RuntimeError) -> None:
        if not isinstance(self.averager, CollectiveAverager) or not is_collective_error(exc):
            raise exc
        if self.ctx.must_stop():
            raise Stop from None
        # every member must do the same number of averages in the new group: this one is repeated
        # there, unless a survivor already has it behind it (``_enter`` compares positions); the
        # window that launched it (an average's tag is its position: window << 16 | round): the
        # next report names it, so the controller knows whether a dead peer's last window landed anywhere
        self._move(bg_redo=True, dropped_window=max(self.at.dropped_window, self.averager.dropped_tag >> 16))
        log.warning("rank %d: a background average failed (%s); keeping this replica's values", self.rank, exc)
        announced = self.link.regroup
        if announced is None or announced.generation <= self.at.generation:
            self.report_collective_failure(exc, self.at.generation)

    # ------------------------------------------------------------- regrouping

    def regroup_in_round(self, stats: RoundStats, round_index: int) -> None:
        """``maybe_regroup`` inside a window's round ``round_index``, before its average: a
        generation that lost a member makes this round's average the survivors' alone, so the
        window's report says so (``regrouped_at``) and the controller counts none of the dead
        rank's batches from this round on as averaged in (cadence.py ``_dead_consumed``)."""
        if self.regroup_lost_peer():
            stats.regrouped(round_index)

    def regroup_lost_peer(self) -> bool:
        """``maybe_regroup``; True if the generation it joined left out a member of this rank's group."""
        before = self.at
        self.maybe_regroup()
        return self.at.generation != before.generation and not before.peers <= self.at.peers

    def maybe_regroup(self) -> None:
        """Act on a new membership generation the controller announced.

        Collective backend: rebuild the group among the members; when ranks
        joined, every member then takes ``sync_from``'s parameters (the
        consensus) in one broadcast. CPU backend: only a joiner acts, learning
        which averaging round is its first.
        """
        msg = self.link.regroup
        if msg is None or msg.generation <= self.at.generation:
            return
        averager = self.averaging()
        if isinstance(averager, CpuAverager):
            if self.rank not in msg.members:
                return
            if averager.adopting and msg.first_round >= 0:
                averager.start_at_round(msg.first_round)
                if msg.sync_from >= 0 and not self.ctx.env.relay_addr:
                    # the donor's state comes with that round (a rank behind a host relay gets none: not relayed)
                    averager.expect_state(msg.first_round)
            self._move(generation=msg.generation)  # a joiner, or the donor (``_donates``)
            return
        self.settle_background()  # an average of the old group: landed if it completed, else dropped
        busy = self.link.busy
        self.link.doing("average")
        try:
            self._regroup_to(msg)
            self._redo_background()
        finally:
            self.link.doing(busy)

    def _redo_background(self) -> None:
        """Repeat, in the new group, the background average this rank dropped, unless another
        member completed it (``_enter``: it is ahead); then the next average blends ours in."""
        if not self.at.bg_redo:
            return
        skip = self.at.skip_redo
        self._move(bg_redo=False, skip_redo=False)
        averager = self._collective()
        if skip or averager.group is None:
            return
        averager.average(averager.dropped_weight, block=False, tag=averager.dropped_tag)  # the position stays

    def _regroup_to(self, msg: m.Regroup) -> None:
        """Join ``msg``'s generation, or a newer one when the world changes again meanwhile."""
        while True:
            if self.rank not in msg.members:
                raise Stop  # declared dead (we were too slow, or cut off): leave
            try:
                self._enter(msg)
                return
            except Superseded:
                if self.ctx.ending():
                    raise Stop from None  # the run stops or is over: no group to build (runner.py ``stopped``)
                msg = self._newest()  # the world changed again while we gathered: join the newer one
            except RuntimeError as exc:
                if not is_collective_error(exc):
                    raise
                # a member died after everyone arrived, while torch connected the group or the
                # consensus went out: like a failed average, tell the controller and join the
                # generation that follows (a joiner left without the consensus takes it from
                # its first average: CollectiveAverager.adopting)
                log.warning("rank %d: building generation %d failed (%s); waiting for the next one", self.rank, msg.generation, exc)
                self.report_collective_failure(exc, msg.generation)
                self._await_regroup(after=msg.generation)
                msg = self._newest()

    def _newest(self) -> m.Regroup:
        """The newest generation announced, once a wait ended on one (``announced_after``: the
        link only ever replaces it with a newer one, never with None)."""
        msg = self.link.regroup
        assert msg is not None, "no membership generation announced"
        return msg

    def report_collective_failure(self, exc: RuntimeError, generation: int) -> None:
        """Tell the controller a collective of ``generation`` failed (a death it may not have seen yet)."""
        self.link.send(
            m.RankError(rank=self.rank, stage="collective", error=f"{type(exc).__name__}: {exc}"[:2000], detail="", generation=generation)
        )

    def _enter(self, msg: m.Regroup) -> None:
        """Become one of ``msg``'s members: its group, then (ranks joined) the consensus."""
        averager = self._collective()
        group = self._group_for(msg)
        world = len(msg.members)
        self._move(generation=msg.generation)
        averager.enter_group(group)
        self._move(peers=frozenset(msg.members) if group is not None else frozenset(), world_size=world)
        if msg.sync_from >= 0 and msg.sync_from in msg.members:
            root, joining = msg.members.index(msg.sync_from), averager.adopting
            averager.broadcast_from(root)  # a joiner stops adopting
            self._move(bg_redo=False)  # every member now holds the same values: nothing to repeat
            self._hand_over(averager, root, msg.members.index(self.rank), joining=joining)
        elif group is not None:
            # A death mid-average can leave some survivors with the average done and others
            # without (a ring's last step reached some). Every member says which average it does
            # next (``position``: window and round); a member redoing a failed average that
            # another member already has behind it skips the redo and takes the others'
            # consensus from the next average (``average``); otherwise all do it together.
            # a dropped background average counts at its own position: the one it repeats
            mine = averager.dropped_tag if self.at.bg_redo else self.at.position
            redo = self.at.redoing or self.at.bg_redo
            top, top_redo = averager.highest(mine, mine if redo else -1)  # every member calls it: a collective
            skip, join = redo_roles(mine, redo=redo, adopting=averager.adopting, top=top, top_redo=top_redo)
            self._move(skip_redo=skip)
            if join:
                # a joiner holds nothing of the average the survivors repeat, but it must take part
                # (one collective each, in the same order): with weight 0, which also hands it their
                # consensus. A failure leaves it adopting, like any failed first average.
                try:
                    averager.average(0.0, block=True, tag=top)  # the redone average's place: its fragment
                except RuntimeError:
                    averager.restore()
                    raise
        (log.info if msg.sync_from >= 0 else log.warning)(
            "rank %d: now one of %d ranks (generation %d): %s", self.rank, world, msg.generation, msg.reason
        )

    def _hand_over(self, averager: CollectiveAverager, root: int, me: int, *, joining: bool) -> None:
        """After the consensus broadcast: the members that joined (they held no consensus) take the
        broadcasting member's state too (handoff.py), straight from it. Every member first says
        whether it joined (one tiny all-reduce); a world where nobody did sends nothing more."""
        if averager.group is None:
            return
        joiners = averager.joining(me, joining)
        if not joiners:
            return
        if me == root:
            averager.send_state(self.handoff.dump(outer=False) if self.handoff is not None else bytearray(), joiners)
        elif me in joiners:
            received = averager.receive_state(root)
            self._took_state(received if len(received) else None)

    def _loses_peer(self, msg: m.Regroup) -> bool:
        """Does ``msg`` leave out a member of this rank's group? Only then can a collective of the
        group no longer finish; a regroup that only adds ranks lets every member settle first."""
        return not self.at.peers <= set(msg.members)

    def group_broken(self) -> bool:
        """A newer generation was announced without one of this group's members: abandon its collectives."""
        msg = self.link.regroup
        return msg is not None and msg.generation > self.at.generation and self._loses_peer(msg)

    def _group_for(self, msg: m.Regroup) -> torch.distributed.ProcessGroup | None:
        """Build ``msg``'s process group (None for a world of one).

        Members arrive at different times: a survivor can sit in the failed
        collective until its own timeout, and one that lost the race to a
        newer generation never comes. So every member first waits for all the
        others, long enough to outlast a collective timeout, and gives up as
        soon as a newer generation is announced or the run stops.
        """
        world = len(msg.members)
        if world <= 1:
            return None
        assert self.welcome is not None and self.model is not None  # regroups come after the welcome (join)
        self._collective().flatten(self.model)  # a run that started alone and just grew
        return build_group(
            store_host=self.welcome.store_host,
            store_port=self.welcome.store_port,
            prefix=msg.store_prefix,
            rank=msg.members.index(self.rank),
            world_size=world,
            device=self.ctx.device,
            timeout_s=self.deadlines.collective_timeout_s,
            gather_s=self.deadlines.group_gather_s,
            give_up=lambda: self.ctx.ending() or self.announced_after(msg.generation),
            on_gathered=lambda: self.ctx.probes.reach("regroup"),
        )

    def _await_regroup(self, after: int | None = None) -> None:
        """Wait (bounded) for the controller to announce the survivors' new world:
        a generation above ``after`` (default: the one this rank is in)."""
        after = self.at.generation if after is None else after
        deadline = time.monotonic() + self.deadlines.regroup_wait_s
        while not self.announced_after(after):
            if self.ctx.ending():
                raise Stop  # the run stops or is over: no new group will come (runner.py ``stopped``)
            if time.monotonic() > deadline:
                raise DeadlineExceeded("a collective failed and no new membership generation came")
            time.sleep(0.01)
