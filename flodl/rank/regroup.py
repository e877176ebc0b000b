"""Averaging that survives membership changes: a rank's side of regrouping.

A mixin of ``RankRunner`` (runner.py), which holds the state these methods
read and write. When a collective fails (a peer died) the rank puts its
values back, waits for the controller's ``Regroup``, joins the survivors'
new group (gathering first: collective.py says why) and redoes the same
average there; a ``Regroup`` for ranks that joined also carries whose
parameters (the consensus) every member takes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..errors import DeadlineExceeded
from ..wire import messages as m
from .collective import CollectiveAverager, Superseded, build_group
from .cpu_average import CpuAverager
from .flat import Averaged
from .outcomes import Stop, is_collective_error
from .window_stats import RoundStats

if TYPE_CHECKING:
    from ..config.deadlines import Deadlines
    from ..probes import Probes
    from .averager import Averager
    from .link import ControllerLink

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


class Regrouping:
    """Averages, and the rebuilt process groups they continue in."""

    # RankRunner's state that these methods read and write (runner.py sets it up)
    rank: int
    device: torch.device
    link: ControllerLink
    deadlines: Deadlines
    probes: Probes
    model: torch.nn.Module
    averager: Averager | None
    welcome: m.RankWelcome | None
    terminated: bool
    world_size: int
    generation: int
    position: int
    redoing: bool
    skip_redo: bool
    bg_redo: bool
    dropped_window: int
    peers: frozenset[int]
    norms_stale: bool

    if TYPE_CHECKING:

        def _announced_after(self, generation: int) -> bool: ...  # runner.py

    def _averaging(self) -> Averager:
        """The averager: ``_join`` sets it up before the first window, eval or regroup."""
        assert self.averager is not None, "averaging before the rank joined"
        return self.averager

    def _collective(self) -> CollectiveAverager:
        """The averager on a path only the collective backend takes (its groups are rebuilt, its
        averages redone: the CPU backend's rounds need neither, so they never get here)."""
        averager = self.averager
        assert isinstance(averager, CollectiveAverager), "a regroup step without a collective averager"
        return averager

    def _average(self, weight: float, *, measure: bool, block: bool, round_index: int, stats: RoundStats) -> Averaged:
        """Average, surviving a peer's death: if the collective fails, put the values
        back, join the survivors' new group, and do this same average again there."""
        self.probes.reach("average")
        self.link.doing("average")
        averager = self._averaging()
        while True:
            self._regroup_in_round(stats, round_index)
            if self.skip_redo:
                # the others completed the average this rank lost: it holds what we sent, and we
                # take it from the next average, adding nothing to it (the adopting path)
                self.skip_redo = self.redoing = False
                self._collective().adopt_next()
                self.position += 1
                log.warning("rank %d: the survivors completed the failed average; taking their consensus next", self.rank)
                self.link.doing("step")  # not an average of this generation: the adopting one will be
                return Averaged(0.0)
            t0 = time.perf_counter()
            landed = self._previous_landed()
            # waiting here is waiting for a late peer (its eval, a pause), not this rank's pace
            # (window_stats.py RoundStats.finish)
            stats.paused_ms += (time.perf_counter() - t0) * 1000.0
            if not landed:
                continue  # it was dropped: the survivors' group (above, next turn) repeats it first
            try:
                averaged = averager.average(weight, measure=measure, block=block, tag=self.position)
                self.norms_stale = self.norms_stale or self.world_size > 1
                self.redoing = False
                self.position += 1
                return self._averaged(averaged)
            except RuntimeError as exc:
                if not isinstance(averager, CollectiveAverager) or not is_collective_error(exc):
                    raise
                if self.link.must_stop or self.terminated:
                    raise Stop from None  # the run stops: an abandoned average is not worth redoing
                self.redoing = True
                log.warning("rank %d: averaging failed (%s); waiting for the survivors' new group", self.rank, exc)
                announced = self.link.regroup
                if announced is None or announced.generation <= self.generation:
                    # tell the controller: a death it has not seen yet, or a group to rebuild
                    # (a failure a newer generation already explains needs no hint)
                    self._report_collective_failure(exc, self.generation)
                averager.restore()
                self._await_regroup()
                stats.regrouped(round_index)

    def _averaged(self, averaged: Averaged) -> Averaged:
        """An average completed: progress for the controller's liveness; the first in a new
        generation is reported at once (the controller times the recovery by it)."""
        self.link.doing("step")
        self.link.averaged_in(self.generation)
        return averaged

    def _previous_landed(self) -> bool:
        """Before an average: the background one still in flight lands first (one at a time).
        False when it failed: it is dropped, and the rank waits for the survivors' new group."""
        averager = self._averaging()
        if not isinstance(averager, CollectiveAverager):
            return True
        try:
            averager.settle()
            return True
        except RuntimeError as exc:
            self._background_failed(exc)
        self._await_regroup()
        return False

    def _land_background(self) -> None:
        """Land an average that completed while this rank trained (never blocks).

        A collective one that failed (a peer died) is dropped, the live values
        kept; the controller is told unless a newer generation already explains
        it, and training goes on until its Regroup (``_maybe_regroup``).
        """
        try:
            self._averaging().poll()
        except RuntimeError as exc:
            self._background_failed(exc)

    def _settle_background(self) -> None:
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

    def _background_failed(self, exc: RuntimeError) -> None:
        if not isinstance(self.averager, CollectiveAverager) or not is_collective_error(exc):
            raise exc
        if self.link.must_stop or self.terminated:
            raise Stop from None
        # every member must do the same number of averages in the new group: this one is repeated
        # there, unless a survivor already has it behind it (``_enter`` compares positions)
        self.bg_redo = True
        # the window that launched it (an average's tag is its position: window << 16 | round): the
        # next report names it, so the controller knows whether a dead peer's last window landed anywhere
        self.dropped_window = max(self.dropped_window, self.averager.dropped_tag >> 16)
        log.warning("rank %d: a background average failed (%s); keeping this replica's values", self.rank, exc)
        announced = self.link.regroup
        if announced is None or announced.generation <= self.generation:
            self._report_collective_failure(exc, self.generation)

    def _regroup_in_round(self, stats: RoundStats, round_index: int) -> None:
        """``_maybe_regroup`` inside a window's round ``round_index``, before its average: a
        generation that lost a member makes this round's average the survivors' alone, so the
        window's report says so (``regrouped_at``) and the controller counts none of the dead
        rank's batches from this round on as averaged in (cadence.py ``_dead_consumed``)."""
        if self._regroup_lost_peer():
            stats.regrouped(round_index)

    def _regroup_lost_peer(self) -> bool:
        """``_maybe_regroup``; True if the generation it joined left out a member of this rank's group."""
        generation, peers = self.generation, self.peers
        self._maybe_regroup()
        return self.generation != generation and not peers <= self.peers

    def _maybe_regroup(self) -> None:
        """Act on a new membership generation the controller announced.

        Collective backend: rebuild the group among the members; when ranks
        joined, every member then takes ``sync_from``'s parameters (the
        consensus) in one broadcast. CPU backend: only a joiner acts, learning
        which averaging round is its first.
        """
        msg = self.link.regroup
        if msg is None or msg.generation <= self.generation:
            return
        averager = self._averaging()
        if isinstance(averager, CpuAverager):
            if averager.adopting and self.rank in msg.members and msg.first_round >= 0:
                averager.start_at_round(msg.first_round)
                self.generation = msg.generation
            return
        self._settle_background()  # an average of the old group: landed if it completed, else dropped
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
        if not self.bg_redo:
            return
        self.bg_redo = False
        skip, self.skip_redo = self.skip_redo, False
        averager = self._collective()
        if skip or averager.group is None:
            return
        current = self.position
        averager.average(averager.dropped_weight, block=False, tag=averager.dropped_tag)
        self.position = current

    def _regroup_to(self, msg: m.Regroup) -> None:
        """Join ``msg``'s generation, or a newer one when the world changes again meanwhile."""
        while True:
            if self.rank not in msg.members:
                raise Stop  # declared dead (we were too slow, or cut off): leave
            try:
                self._enter(msg)
                return
            except Superseded:
                if self.link.ending or self.terminated:
                    raise Stop from None  # the run stops or is over: no group to build (runner._stopped)
                msg = self._newest()  # the world changed again while we gathered: join the newer one
            except RuntimeError as exc:
                if not is_collective_error(exc):
                    raise
                # a member died after everyone arrived, while torch connected the group or the
                # consensus went out: like a failed average, tell the controller and join the
                # generation that follows (a joiner left without the consensus takes it from
                # its first average: CollectiveAverager.adopting)
                log.warning("rank %d: building generation %d failed (%s); waiting for the next one", self.rank, msg.generation, exc)
                self._report_collective_failure(exc, msg.generation)
                self._await_regroup(after=msg.generation)
                msg = self._newest()

    def _newest(self) -> m.Regroup:
        """The newest generation announced, once a wait ended on one (``_announced_after``: the
        link only ever replaces it with a newer one, never with None)."""
        msg = self.link.regroup
        assert msg is not None, "no membership generation announced"
        return msg

    def _report_collective_failure(self, exc: RuntimeError, generation: int) -> None:
        """Tell the controller a collective of ``generation`` failed (a death it may not have seen yet)."""
        self.link.send(
            m.RankError(rank=self.rank, stage="collective", error=f"{type(exc).__name__}: {exc}"[:2000], detail="", generation=generation)
        )

    def _enter(self, msg: m.Regroup) -> None:
        """Become one of ``msg``'s members: its group, then (ranks joined) the consensus."""
        averager = self._collective()
        group = self._group_for(msg)
        self.generation = msg.generation
        world = len(msg.members)
        averager.enter_group(group)
        self.peers = frozenset(msg.members) if group is not None else frozenset()
        self.world_size = world
        if msg.sync_from >= 0 and msg.sync_from in msg.members:
            averager.broadcast_from(msg.members.index(msg.sync_from))  # a joiner stops adopting
            self.bg_redo = False  # every member now holds the same values: nothing to repeat
        elif group is not None:
            # A death mid-average can leave some survivors with the average done and others
            # without (a ring's last step reached some). Every member says which average it does
            # next (``position``: window and round); a member redoing a failed average that
            # another member already has behind it skips the redo and takes the others'
            # consensus from the next average (``_average``); otherwise all do it together.
            # a dropped background average counts at its own position: the one it repeats
            mine = averager.dropped_tag if self.bg_redo else self.position
            redo = self.redoing or self.bg_redo
            top, top_redo = averager.highest(mine, mine if redo else -1)  # every member calls it: a collective
            self.skip_redo, join = redo_roles(mine, redo=redo, adopting=averager.adopting, top=top, top_redo=top_redo)
            if join:
                # a joiner holds nothing of the average the survivors repeat, but it must take part
                # (one collective each, in the same order): with weight 0, which also hands it their
                # consensus. A failure leaves it adopting, like any failed first average.
                try:
                    averager.average(0.0, block=True)
                except RuntimeError:
                    averager.restore()
                    raise
        (log.info if msg.sync_from >= 0 else log.warning)(
            "rank %d: now one of %d ranks (generation %d): %s", self.rank, world, msg.generation, msg.reason
        )

    def _loses_peer(self, msg: m.Regroup) -> bool:
        """Does ``msg`` leave out a member of this rank's group? Only then can a collective of the
        group no longer finish; a regroup that only adds ranks lets every member settle first."""
        return not self.peers <= set(msg.members)

    def _group_broken(self) -> bool:
        """A newer generation was announced without one of this group's members: abandon its collectives."""
        msg = self.link.regroup
        return msg is not None and msg.generation > self.generation and self._loses_peer(msg)

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
        assert self.welcome is not None  # regroups come after the welcome (_join)
        self._collective().flatten(self.model)  # a run that started alone and just grew
        return build_group(
            store_host=self.welcome.store_host,
            store_port=self.welcome.store_port,
            prefix=msg.store_prefix,
            rank=msg.members.index(self.rank),
            world_size=world,
            device=self.device,
            timeout_s=self.deadlines.collective_timeout_s,
            gather_s=self.deadlines.group_gather_s,
            give_up=lambda: self.link.ending or self.terminated or self._announced_after(msg.generation),
            on_gathered=lambda: self.probes.reach("regroup"),
        )

    def _await_regroup(self, after: int | None = None) -> None:
        """Wait (bounded) for the controller to announce the survivors' new world:
        a generation above ``after`` (default: the one this rank is in)."""
        after = self.generation if after is None else after
        deadline = time.monotonic() + self.deadlines.regroup_wait_s
        while not self._announced_after(after):
            if self.link.ending or self.terminated:
                raise Stop  # the run stops or is over: no new group will come (runner._stopped)
            if time.monotonic() > deadline:
                raise DeadlineExceeded("a collective failed and no new membership generation came")
            time.sleep(0.01)
