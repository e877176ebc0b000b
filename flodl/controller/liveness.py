"""Liveness: heartbeats out, silence and deaths in, and the run going on without the dead.

``Liveness`` beats to every peer and judges the roster several times a
second (``Membership.assess`` decides, with a reason; ``Membership.apply``
carries the verdict out); a death either ends the run (no rank left, or past
``max_failure``: saving first when asked) or is recovered: the dead are
fenced, their work re-planned, the survivors regrouped, and
(``max_restarts``) the dead restarted by their workers. It owns the record
of every recovery and restart.
"""

from __future__ import annotations

import asyncio
import sys
import time

from ..errors import EXIT_CONFIG, EXIT_NONFINITE
from ..plan.decisions import Outcome, after_collective_error, after_deaths, after_rank_error, unexplained_collective_error
from ..plan.goodput import fault_moment
from ..plan.membership import PeerState, quick_deaths, restart_delay
from ..plan.progress import ProgressLimits
from ..scriptspec import BEFORE_INIT
from ..wire import messages as m
from ..wire.codec import Envelope
from .admission import Admission
from .before_init import BeforeInit
from .context import RunContext
from .phase import Phase
from .saving import Saving
from .training import Training

HEARTBEAT_INTERVAL_S = 1.0
LIVENESS_TICK_S = 0.2
#: A liveness tick this late means the controller's own loop was held up (a pause, a long GC): the frames
#: that came meanwhile may not be read yet, so for ``JUDGE_SETTLE_S`` after it (and while ticks are late)
#: ranks are judged by the full heartbeat timeout only (no peer's wait shortens it: progress.py).
JUDGE_LATE_S = 0.5
JUDGE_SETTLE_S = 1.0
#: A collective error on one rank usually means a peer died; wait this long for
#: the death report so the message names the dead rank, not the witness.
COLLECTIVE_ERROR_GRACE_S = 1.0


class Liveness:
    """Heartbeats, deaths, fencing, regrouping and healing."""

    def __init__(self, ctx: RunContext, *, admission: Admission, training: Training, saving: Saving) -> None:
        self.ctx = ctx
        self.admission = admission
        self.training = training
        self.saving = saving
        self.limits = ProgressLimits(
            heartbeat_timeout_s=ctx.deadlines.heartbeat_timeout_s,
            first_step_s=ctx.launch.join_timeout_secs,
            eval_s=ctx.launch.eval_timeout_secs,
            step_s=ctx.launch.step_timeout_secs,
        )
        self.collective_error: tuple[float, int, m.RankError] | None = None
        # collectives rebuilt in place in a row (no death explained them): past MAX_COLLECTIVE_RETRIES the run
        # stops. The row ends when the survivors average again or a death explains the failure
        self.collective_retries = 0
        self.recoveries: list[dict] = []  # every regroup: when, generation, survivors, why
        self.restarts: list[dict] = []  # healing: every rank started in place of a dead one
        self._slot_of: dict[int, int] = {}  # a restarted rank -> the original rank whose restarts it counts against
        self._restarts_used: dict[int, int] = {}  # original rank -> restarts so far
        self._quick: dict[int, int] = {}  # original rank -> its restarts in a row that died soon after their start
        self._started: dict[int, float] = {}  # original rank -> when its latest restart started (after its back-off)
        self._back: tuple[float, set[int]] | None = None  # a recovery waiting for every survivor's first average in it
        self._drops_seen = 0  # dropped control frames already alerted
        self.before_init = BeforeInit()  # script ranks that failed before flodl.init(): the run stops, once told
        self._ticked: float | None = None  # the last liveness tick (``watch``)
        self._trusted_from = 0.0  # short deadlines are trusted from then on (a late tick pushes it back)

    async def watch(self) -> None:
        """Beat to every peer every second; judge silence and deaths several times a second."""
        next_beat = 0.0
        while True:
            now = self.ctx.clock()
            if self._ticked is not None and now - self._ticked > LIVENESS_TICK_S + JUDGE_LATE_S:
                self._trusted_from = now + JUDGE_SETTLE_S
            self._ticked = now
            if now >= next_beat:
                beat = m.Heartbeat(step=self.training.global_step, sent_at=time.time(), busy="", busy_s=0.0, step_ms=0.0, averaged=-1)
                self.ctx.plane.send_all(beat, self._peer_identities())
                next_beat = now + HEARTBEAT_INTERVAL_S
                self._report_drops()
            self.judge()
            await asyncio.sleep(LIVENESS_TICK_S)

    def _keeps_time(self, now: float) -> bool:
        """Has the liveness tick run on time lately (so every frame that came is read)?"""
        return self._ticked is not None and now - self._ticked <= LIVENESS_TICK_S + JUDGE_LATE_S and now >= self._trusted_from

    def _report_drops(self) -> None:
        """Frames dropped (forged, malformed, unauthorized) since the last beat: a control_drop alert."""
        drops = self.ctx.plane.live_endpoint.drops
        total = sum(drops.values())
        if total > self._drops_seen:
            detail = ", ".join(f"{k} {v}" for k, v in sorted(drops.items()))
            self.ctx.monitor.event(
                "control_drop", f"{total - self._drops_seen} control frame(s) dropped (so far: {detail})", now_s=self.ctx.clock()
            )
            self._drops_seen = total

    def _peer_identities(self) -> list[bytes]:
        ids = [w.identity for w in self.ctx.members.workers.values() if not w.exited]
        ids += [r.identity for r in self.ctx.members.ranks.values() if r.identity and r.state not in (PeerState.EXITED, PeerState.DEAD)]
        return ids

    def judge(self) -> None:
        """Turn deaths, silence and lingering collective errors into a failure."""
        if self.ctx.run.ended:
            return
        now = self.ctx.clock()
        if self.before_init.since is not None and self.before_init.due(now, waiting=self._may_fail_before_init()):
            printed, message = self.before_init.told(sorted(self.ctx.members.ranks), lambda r: self.ctx.members.ranks[r].where())
            sys.stderr.write(printed)
            self.ctx.run.fail(message, EXIT_CONFIG)
            return
        self.ctx.members.excuse_silence_before_hello(now)
        # the limits: a training thread stuck in user code is hung; a peer's wait shortens them only while
        # this loop keeps time (after it was held up, what came meanwhile may not be read yet)
        verdict = self.ctx.members.assess(now, self.limits, waited=self._keeps_time(now))
        self.ctx.members.apply(verdict)
        if not verdict.healthy:
            self._on_deaths(set(verdict.dead), verdict.reason)
            return
        if self.collective_error is not None:
            # a collective failed and no death explains it (yet): rebuild it among the same ranks
            since, rank, err = self.collective_error
            decision = unexplained_collective_error(
                waited_s=now - since,
                grace_s=COLLECTIVE_ERROR_GRACE_S,
                retries=self.collective_retries,
                where=self.ctx.members.ranks[rank].where(),
                error=err.error,
            )
            if decision.outcome is Outcome.WAIT:
                return
            self.collective_error = None
            self.collective_retries += 1
            if decision.outcome is Outcome.STOP:
                self.ctx.run.fail(decision.why, decision.code)
                return
            self.ctx.members.new_generation(decision.why)
            self.regroup(decision.why)

    # ============================================================ handlers

    def on_heartbeat(self, identity: bytes, env: Envelope, msg: m.Heartbeat) -> None:
        """Liveness was recorded on arrival; a rank's beat also says whether it makes progress."""
        info = self.ctx.members.by_identity.get(identity)
        if info is None or not msg.busy:
            return
        self.ctx.members.heard_progress(info, msg.busy, msg.busy_s, msg.step_ms, msg.averaged, self.ctx.clock())
        self._note_averaging_again(info.rank, msg.averaged)

    def on_rank_error(self, identity: bytes, env: Envelope, msg: m.RankError) -> None:
        if msg.stage == BEFORE_INIT:
            self._failed_before_init(env, msg)
            return
        info = self.ctx.members.ranks[msg.rank]
        decision = after_rank_error(msg.stage, joiner=msg.rank in self.admission.joiners)
        if decision.outcome is Outcome.IGNORE:
            self.admission.drop_joiner(msg.rank, f"failed during {msg.stage}: {msg.error}")
        elif decision.outcome is Outcome.WAIT:
            # usually a symptom of a peer's death: give the death report a moment to arrive
            waiting = after_collective_error(
                reported_generation=msg.generation, generation=self.ctx.members.generation, pending=self.collective_error is not None
            )
            if waiting.outcome is Outcome.WAIT:
                self.collective_error = (self.ctx.clock(), msg.rank, msg)
        elif decision.code == EXIT_NONFINITE:  # the rank names epoch and step: no traceback, no save over a good bundle
            self.ctx.run.fail(f"{info.where()}: {msg.error.split(': ', 1)[-1]}", decision.code)
        else:
            if self.ctx.run.failure is None and decision.why == "traceback":  # a bad bundle or option needs none
                sys.stderr.write(f"--- traceback from {info.where()} ---\n{msg.detail}\n")
            self.ctx.run.fail(f"{info.where()} failed during {msg.stage}: {msg.error}", decision.code)

    def _failed_before_init(self, env: Envelope, msg: m.RankError) -> None:
        """A script rank's worker says its script failed before ``flodl.init()`` (its exit comes
        next): the user's error of the whole run (before_init.py), not a rank to go on without. A
        joiner's (a restart, a late worker's) only drops the joiner, as any failure of a joiner does."""
        worker = self.ctx.members.workers.get(env.sender)
        if worker is None or msg.rank not in worker.ranks:
            self.ctx.plane.live_endpoint.drops["unauthorized"] += 1  # only the rank's own worker speaks for a rank that never joined
            return
        if msg.rank in self.admission.joiners:
            self.admission.drop_joiner(msg.rank, f"the script failed before flodl.init(): {msg.error}")
            return
        self.ctx.members.rank_left(msg.rank)  # its exit is the script's error, not a death
        self.before_init.note(msg.rank, msg.error, msg.detail, self.ctx.clock())
        self.judge()

    def _may_fail_before_init(self) -> bool:
        """Might another rank still report a failure before ``flodl.init()``? One that is starting
        (alive, no hello yet) may."""
        joiners = self.admission.joiners
        return any(not r.identity and r.rank not in joiners for r in self.ctx.members.live_ranks())

    def on_rank_exited(self, identity: bytes, env: Envelope, msg: m.RankExited) -> None:
        worker = self.ctx.members.workers.get(env.sender)
        if worker is None or msg.rank not in worker.ranks:
            self.ctx.plane.live_endpoint.drops["unauthorized"] += 1  # only a rank's own worker (its signed sender name) may report its exit
            return
        if self.ctx.run.ended:
            # we told it to go: leaving now is not a death, whatever the code
            self.ctx.members.rank_left(msg.rank, code=msg.code)
            self.ctx.run.changed()
            return
        self.ctx.members.rank_exited(msg.rank, msg.code, pid=msg.pid)
        self.judge()

    # ============================================================ deaths

    def _on_deaths(self, dead: set[int], reason: str) -> None:
        t0 = time.perf_counter()
        self._go_on_without(dead, reason)
        self.ctx.hooks.deaths_handled(dead, time.perf_counter() - t0)

    def _go_on_without(self, dead: set[int], reason: str) -> None:
        """Ranks died: go on without them if the run can, else stop (saving if asked)."""
        joiners = self.admission.joiners
        for rank in sorted(dead & set(joiners)):
            self.admission.drop_joiner(rank, self.ctx.members.ranks[rank].death or "died")  # never admitted: nothing to recover
        dead -= set(joiners) | {r for r in dead if r not in self.ctx.members.ranks}
        if not dead:
            return
        if self.training.goodput is not None:  # each death a fault of the goodput books, from its moment
            now = self.ctx.clock()
            for rank in sorted(dead):
                info = self.ctx.members.ranks[rank]
                self.training.goodput.died(rank, now=now, since=fault_moment(info.last_seen, info.progress), reason=info.death or reason)
        dead_total = sum(1 for r in self.ctx.members.ranks.values() if r.state is PeerState.DEAD)
        survivors = sorted(r.rank for r in self.ctx.members.live_ranks())
        decision = after_deaths(
            self.ctx.config,
            started=self.ctx.run.admitting,
            world_size=len(self.ctx.members.ranks),
            dead_total=dead_total,
            survivors=len(survivors),
            # before the first window there is no consensus nor coverage to write: the run stops
            # and says so, rather than writing a bundle that would resume nothing
            can_save=bool(self.ctx.checkpoints.stem) and self.training.cadence is not None,
            unseeded=tuple(r for r in survivors if not self._holds_parameters(r)),
        )
        if decision.outcome is Outcome.SAVE_AND_STOP:
            self.saving.save_and_stop(f"{reason}. {decision.why}", decision.save_reason)
            return
        if decision.outcome is Outcome.STOP:
            self.ctx.run.fail(f"{reason}. {decision.why}", decision.code)
            return
        self._fence(dead, reason)
        if self.ctx.plane.averaging is not None:
            for rank in sorted(dead):  # rounds stop waiting for them once what they sent before is taken
                self.ctx.plane.averaging.rank_ended(rank)
        for lost in [s for r in dead for s in self.ctx.checkpoints.rank_died(r)]:
            self.ctx.console.line(f"rank {lost.rank} died before writing checkpoint {lost.version}; asking another rank")
            self.saving.checkpoint_now(lost.reason, call_fn=False, files=bool(lost.stem))
        self.collective_error = None  # the death explains it
        self.collective_retries = 0  # and the rebuilds that went before it
        for rank in sorted(dead):
            self.ctx.monitor.event(
                "rank_lost",
                f"{self.ctx.members.ranks[rank].where()} {self.ctx.members.ranks[rank].death}",
                rank=rank,
                now_s=self.ctx.clock(),
            )
        if self.training.cadence is not None:
            self.training.cadence.remove_ranks(dead)
        if self.ctx.run.phase is Phase.TRAINING or self.admission.welcomed:  # before the welcomes, those leave the dead out
            self.regroup(reason)
        self.ctx.console.line(f"lost {reason}; continuing with {len(survivors)} rank(s) (generation {self.ctx.members.generation})")
        for rank in sorted(dead):
            self._heal(rank)
        self.training.reask_evals_of(dead)  # their evals died with them: ask the next rank
        self.ctx.run.changed()

    def _holds_parameters(self, rank: int) -> bool:
        """Does ``rank`` hold the run's parameters? The first ranks do from the start; a rank
        admitted later (grown or restarted) once it completed an average in the generation that
        admitted it or a later one (its first average is where it takes the consensus)."""
        if rank in self.admission.joiners:  # not admitted yet: it holds nothing of the run's
            return False
        admitted = [j["generation"] for j in self.admission.joins if rank in j["ranks"]]
        return not admitted or self.ctx.members.ranks[rank].averaged >= admitted[-1]

    def _heal(self, rank: int) -> None:
        """Healing: have the dead rank's worker start a new rank in its place (``max_restarts``
        per original rank, with back-off); it joins at a window boundary like any joiner."""
        slot = self._slot_of.get(rank, rank)
        used = self._restarts_used.get(slot, 0)
        now = self.ctx.clock()
        if used:  # a restart that died soon after its start grows the back-off; one that trained a while resets it
            self._quick[slot] = quick_deaths(self._quick.get(slot, 0), now - self._started.get(slot, now))
        delay = restart_delay(used, self.ctx.launch.max_restarts, self._quick.get(slot, 0))
        info = self.ctx.members.ranks[rank]
        worker = next((w for w in self.ctx.members.workers.values() if rank in w.ranks and not w.exited), None)
        if delay is None or worker is None or self.admission.grow_problem() is not None:
            return
        averaging = self.ctx.plane.averaging
        if averaging is not None and rank in averaging.relayed:
            return  # a relaying host's relay counts its ranks from its welcome: not healed (docs)
        new = self.admission.restart(worker, info.device, delay, now)
        self._slot_of[new] = slot
        self._restarts_used[slot] = used + 1
        self._started[slot] = now + delay
        if self.training.goodput is not None:
            self.training.goodput.restarted(new, rank)
        self.restarts.append(
            {
                "at_s": now - self.ctx.run.started_at,
                "unix_time": time.time(),
                "rank": new,
                "replaces": rank,
                "slot": slot,
                "attempt": used + 1,
                "delay_s": delay,
                "host": worker.host,
                "device": info.device,
            }
        )
        self.ctx.plane.send(m.Respawn(rank=new, device=info.device, replaces=rank, attempt=used + 1, delay_s=delay), worker.identity)
        when = "at once" if delay == 0 else f"in {delay:g} s"  # a crash loop waits: restart_delay
        self.ctx.console.line(
            f"restarting rank {rank} as rank {new} on host {worker.host} ({info.device}) {when} "
            f"(restart {used + 1} of {self.ctx.launch.max_restarts}); it joins at a window boundary"
        )

    def _fence(self, dead: set[int], reason: str) -> None:
        """A rank declared dead whose process may live on (hung, stopped, cut off)
        is killed by its worker: it must never rejoin a world that went on without it."""
        for rank in dead:
            info = self.ctx.members.ranks[rank]
            if info.exit_code is not None:
                continue  # its worker saw it exit: nothing to kill
            for worker in self.ctx.members.workers.values():
                if rank in worker.ranks and not worker.exited:
                    self.ctx.plane.send(m.Fence(rank=rank, reason=reason[:500]), worker.identity)

    # ============================================================ recovery

    def regroup(self, reason: str) -> None:
        """Tell the survivors of the collective backend to rebuild it (CPU ranks need nothing)."""
        survivors = self.admission.training_ranks()
        self.recoveries.append(
            {
                "at_s": self.ctx.clock() - self.ctx.run.started_at,
                "unix_time": time.time(),
                "generation": self.ctx.members.generation,
                "survivors": survivors,
                "reason": reason,
                "training_again_s": None,
            }
        )
        # "training again" = every survivor has completed an average since this moment (a local
        # batch says nothing: a survivor can train alone while its peers sit in a stalled collective)
        self._back = (self.ctx.clock(), set(survivors))
        if self.training.goodput is not None:
            self.training.goodput.regrouped()
        if self.ctx.plane.averaging is not None:
            return  # the CPU backend has no group: rounds stop waiting for the dead (rank_ended above)
        # while the run starts, the first group may never have formed (nor rank 0's parameters
        # reached everyone): the survivors then all take the lowest one's
        sync_from = survivors[0] if self.ctx.run.phase is Phase.JOINING and survivors else -1
        msg = m.Regroup(
            generation=self.ctx.members.generation,
            members=survivors,
            store_prefix=f"{self.ctx.run_id}/gen{self.ctx.members.generation}",
            reason=reason[:500],
            sync_from=sync_from,
            first_round=-1,
        )
        self.ctx.plane.send_ranks(survivors, msg)

    def _note_averaging_again(self, rank: int, averaged: int) -> None:
        """Collective backend: a survivor's heartbeat says it completed an average in the
        recovery's generation; once every survivor has, the run is averaging again."""
        if self._back is None or averaged < self.recoveries[-1]["generation"]:
            return
        since, waiting = self._back
        waiting.discard(rank)
        if not waiting:
            self._averaging_again(since)

    def cpu_round_done(self, number: int, ms: float) -> None:
        """CPU backend: the first averaging round that started after a recovery and
        closed (with every survivor: rounds no longer wait for the dead) marks it done."""
        if self._back is None or self.ctx.plane.averaging is None:
            return
        since, _ = self._back
        if self.ctx.clock() - ms / 1000.0 >= since:
            self._averaging_again(since)

    def _averaging_again(self, since: float) -> None:
        """Every survivor of the last recovery (from ``since``) averages in the new membership."""
        now = self.ctx.clock()
        self.recoveries[-1]["training_again_s"] = now - since
        self._back = None
        self.collective_retries = 0  # the collective works again: a later failure starts a new row
        if self.training.goodput is not None:
            self.training.goodput.back(now)
            self.training.tell_faults()
