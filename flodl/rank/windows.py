"""Window training: a ``Window``'s rounds of batches, each ended by an average (``Windows``).

A window trains granted positions of the epochs' permutations until its stop
rule (a batch or time quota, ``sync_every`` batches a round, or the
controller's ``EndWindow``), averaging after every round (through ``Group``),
and reports what it trained (``WindowDone``). Between batches its loop lands a
background average that completed, scores the evals asked for, joins a new
group; each step's record goes to the window's tally and, a step late, to the
controller's ``TimingMsg`` reports. Cadence's time quota carries a debt: what
one window ran past its quota is taken off the next one's.

Every epoch of the run is an event this rank sees, in order, even one it trains
no batch of (``enter_epoch``): its fault point and the user's ``epoch_fn``.

The round's batch loop is a generator (``round_steps``): a ``Task`` rank steps
what it yields here (``drive``); a script rank hands the round to the script's
thread (seams.py, script_round.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from .. import scalars
from ..plan.metrics import epoch_rows
from ..wire import messages as m
from .cpu_average import CpuAverager
from .handle import WorkerHandle
from .outcomes import Stop, UserError
from .round_loop import Due, RoundLoop
from .shard_source import ShardPicks
from .step_meter import StepRecord
from .step_reports import StepReports
from .steps import Steps
from .window_stats import RoundStats

if TYPE_CHECKING:
    from .context import JoinedRun, RankContext
    from .data_path import DataPath
    from .evaluation import Evaluator
    from .regroup import Group
    from .replica import Replica


class Windows:
    """The rank's windows: their rounds, steps, reports and quota debt, and the epochs they enter."""

    def __init__(self, ctx: RankContext, run: JoinedRun, replica: Replica, group: Group, data: DataPath, evaluator: Evaluator) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.rank = ctx.rank
        self.replica = replica
        self.group = group
        self.data = data
        self.evaluator = evaluator
        self.deterministic = run.config.deterministic  # every average blocks: none lands at a clock's choice
        self.equal_weights = run.config.average_weights == "equal"  # how this rank weighs in each average
        self.steps = Steps(ctx, replica, data)
        self.reports = StepReports(self.rank)  # steps trained, not reported yet (step_reports.py)
        # every epoch of the run is an event this rank sees, in order (``enter_epoch``): from
        # ``first_epoch`` (-1: its first batch's, a joiner) to the run's last, ``epochs - 1``
        self.current_epoch = -1
        self.first_epoch, self.epochs = run.first_epoch, run.epochs
        # Cadence's time quota: how far this rank's last window ran past its quota (it stops at the
        # first batch edge after it, a slow rank's batch later than a fast one's). Taken off the next
        # quota, so the ranks' windows stay aligned on the sum of their quotas instead of the slow
        # rank drifting behind by half a batch a window until the fast one waits for it.
        self.quota_debt_ms = 0.0
        self.handle = WorkerHandle(self)  # what the user's epoch_fn and checkpoint_fn see

    # ---------------------------------------------------------------- windows

    def train_window(self, window: m.Window) -> None:
        """Train granted positions until a quota, average, and report (progressive dispatch)."""
        self.steps.window_start(window.global_step, probing=not (window.quota_batches or window.quota_ms or window.sync_every))
        self.replica.window_start(window.global_step)  # "global" schedulers: every rank at the same LR
        self.link.doing("step")
        lost_peer = self.group.regroup_lost_peer()  # a membership change announced between windows (a rank joined, or died)
        if self.steps.count:  # once the first window trained: the rest of the dataset into the tiers
            self.data.start_warmer()
        stats = self.run_rounds(
            window.grants,
            rounds=window.rounds,
            sync_every=window.sync_every,
            quota_batches=window.quota_batches,
            quota_ms=window.quota_ms,
            measure=window.measure_divergence,
            window=window.window,
        )
        if lost_peer:  # a member left before this window's first average: none of it is theirs
            stats.regrouped(0)
        last = stats.last_average
        window_scalars, data = scalars.drain(), self.data.stats()
        self.replica.report(window_scalars, data)
        self.link.send_report(
            m.WindowDone(
                rank=self.rank,
                window=window.window,
                batches=stats.batches,
                # positions trained: samples, or whole shards for a Shards dataset
                consumed=stats.positions if self.data.sharded else stats.samples,
                loss_sum=stats.loss_sum,
                compute_ms=stats.compute_ms,
                data_ms=stats.data_ms,
                sync_ms=stats.sync_ms,
                wall_ms=stats.wall_ms,
                divergence=last.divergence if last else None,
                pre_norm=last.pre_norm if last else None,
                post_norm=last.post_norm if last else None,
                lr=self.replica.lr.current,
                epochs=epoch_rows(stats.per_epoch),
                scalars=window_scalars,
                regrouped_at=stats.regrouped_at,
                dropped=self.group.take_dropped_window(),
                res=self.ctx.resources.summary() | self.group.wire_gauges(),
                data=data,
            )
        )
        # tests: die with this window's average in flight, its report out (the ledger must hold either way)
        self.ctx.probes.reach("reported", before=lambda: self.link.drain(1.0))

    def run_rounds(
        self,
        grants: list[list[int]],
        *,
        rounds: int,
        sync_every: int,
        quota_batches: int = 0,
        quota_ms: float = 0.0,
        measure: bool = False,
        window: int | None = None,
    ) -> RoundStats:
        """The training loop: ``rounds`` averages, each after ``sync_every`` batches
        (0: after the quota), stopping early at the batch or time quota, or when
        the controller ends the window (``EndWindow``).

        Every rank runs the same ``rounds``; one that runs out of batches still
        joins the remaining averages with weight zero, so no peer waits forever.
        """
        with self.data.window_batches(grants) as batches:
            return self._run(
                RoundStats(),
                batches,
                rounds=rounds,
                sync_every=sync_every,
                quota_batches=quota_batches,
                quota_ms=quota_ms,
                measure=measure,
                window=window,
            )

    def _run(
        self,
        stats: RoundStats,
        batches: Any,
        *,
        rounds: int,
        sync_every: int,
        quota_batches: int,
        quota_ms: float,
        measure: bool,
        window: int | None,
    ) -> RoundStats:
        """``rounds`` rounds over ``batches`` (the window's ``(epoch, picks, batch)`` stream), each
        ended by an average; the window's tally."""
        start = time.perf_counter()
        self.replica.model.train()  # once per window, not per step: it walks every module
        # batches already where the model is (in memory, placed after the first step) skip the move
        self.replica.deliver_resident(self.data.resident())
        loop = RoundLoop(
            stats,
            batches,
            averager=self.group.averaging(),
            start=start,
            sync_every=sync_every,
            quota_batches=quota_batches,
            # Cadence's time quota less what the last window ran past its own
            target_ms=quota_ms - self.quota_debt_ms if quota_ms else 0.0,
            quota_ms=quota_ms,
            window=window,
            # a Shards dataset: positions are shards; the window stops, averages (Sync) and counts
            # coverage only where a shard ends (shard_source.py), and its quota counts shards
            sharded=self.data.sharded,
        )
        self.quota_debt_ms = 0.0
        for round_index in range(rounds):
            self.group.at_round(window or 0, round_index)
            loop.stepped = loop.shards = 0
            loop.last = None
            self.ctx.seams.drive_round(self, self.round_steps(loop, round_index))
            # grants that ended inside an accumulation: its step now, before the average
            self.replica.window_end(self.steps.global_step, flush=self.group.at.world_size > 1)
            last = self.report(self.steps.meter.drain(), stats, loop.last)  # the device catches up: a window's end may wait
            # a window's end average (Cadence, Async) runs in the background on either backend:
            # a rank never waits at it for a slower peer; Sync's per-batch rounds block, and so
            # does every average of a deterministic run (a background one lands at whichever
            # batch is running when it completes: a clock's choice)
            block = bool(sync_every) or self.deterministic
            averaged = self.group.average(self._weight(loop.stepped), measure=measure, block=block, round_index=round_index, stats=stats)
            stats.averaged(averaged)
            if last is not None:  # the round's last step, with every step still held: after its average
                self._hold_report(last)
                self.link.send_lazy(self.reports.take(sync_ms=averaged.ms))
        stats.finish((time.perf_counter() - start) * 1000.0)
        return stats

    def _weight(self, stepped: int) -> float:
        """This rank's weight in the round's average: the batches it trained (``average_weights``
        ``batches``), or 1 if it trained any (``equal``: every rank's update counts whole)."""
        if self.equal_weights:
            return 1.0 if stepped else 0.0
        return float(stepped)

    def drive(self, steps: Generator[Due, list[StepRecord], None]) -> None:
        """Train one round's batches: each ``Due`` the round's loop yields is stepped here and its
        records sent back (a ``Task`` rank; script mode hands the whole round to the script's
        thread instead, script_round.py, so the per-batch bookkeeping runs there)."""
        due = next(steps, None)
        while due is not None:
            if due.epoch > self.current_epoch:
                self.enter_epoch(due.epoch)
            records = self.steps.step(due.batch, epoch=due.epoch, samples=due.samples, data_ms=due.data_ms)
            try:
                due = steps.send(records)
            except StopIteration:
                due = None

    def round_steps(self, loop: RoundLoop, round_index: int) -> Generator[Due, list[StepRecord], None]:
        """One round's batch loop: the checks and bookkeeping between batches; yields each batch
        to train (its epoch not yet entered) and takes back its step records."""
        stats, seams, replica = loop.stats, self.ctx.seams, self.replica
        while not loop.exhausted and (
            not loop.sync_every or (loop.shards if loop.sharded else loop.stepped) < loop.sync_every or seams.accumulating(replica)
        ):
            if loop.averager.adopting:
                loop.exhausted = True  # a joiner without the consensus yet trains nothing (its grants go back)
                return
            done = stats.positions if loop.sharded else stats.batches + self.steps.meter.pending
            if (
                not seams.accumulating(replica)
                and loop.whole
                and (
                    (loop.quota_batches and done >= loop.quota_batches)
                    # the quota clock is the window's wall time less its averages: a fast rank's
                    # per-step work outside compute and data (hundreds of steps' worth) must not
                    # make it arrive late at the average its slow partner is already waiting in
                    or (loop.target_ms and self._past_quota(loop.start, stats, loop.target_ms, loop.quota_ms))
                    # the controller ends it (a window that had not started yet ends a batch in where its
                    # average must hold something: a joiner adopts it, controller/training.py hurry_adoption)
                    or (loop.window is not None and self.link.end_window >= loop.window and (done > 0 or self._ends_empty(loop)))
                )
            ):
                loop.exhausted = True
                return
            if self.ctx.must_stop():
                raise Stop
            t0 = time.perf_counter()
            item = next(loop.batches, None)
            data_ms = (time.perf_counter() - t0) * 1000.0
            if item is None:
                loop.exhausted = True
                return
            epoch, idx, batch = item
            if isinstance(idx, ShardPicks):
                stats.positions += idx.ends
                loop.shards += idx.ends
                loop.whole = bool(idx.ends)
                if batch is None:  # an empty shard: trained, with nothing to step
                    continue
            self.group.land_background()  # an average that completed meanwhile lands here, between steps
            if self.evaluator.asked():
                t0 = time.perf_counter()
                self.evaluator.take_asked()
                stats.paused_ms += (time.perf_counter() - t0) * 1000.0
            # a peer died: join the survivors' new group now (and the report says so: no average
            # failed, yet the dead peer is out of this round's average, cadence.py _dead_consumed).
            # Looked at here first: a call chain per step for the rare batch that has one to join
            announced = self.link.regroup
            if announced is not None and announced.generation > self.group.at.generation:
                self.group.regroup_in_round(stats, round_index)
            records = yield Due(epoch, batch, idx if type(idx) is int else len(idx), data_ms)
            loop.stepped += 1
            loop.last = self.report(records, stats, loop.last)

    @staticmethod
    def _ends_empty(loop: RoundLoop) -> bool:
        """May a window the controller ended before its first batch end with none? On the CPU
        backend, yes (its round goes with weight 0), unless this rank hands joiners its state with
        that round's snapshot: the average they adopt is then its values. Before, such a window (sent
        ahead, ended for a joiner that became ready) trained a batch first: a batch more between the
        joiner's ready and its state. The collective backend's windows keep theirs (a group rebuilt
        wants no empty average)."""
        averager = loop.averager
        return isinstance(averager, CpuAverager) and not averager.state_out.due(averager.round)

    def _past_quota(self, start: float, stats: RoundStats, target_ms: float, quota_ms: float) -> bool:
        """The window's time quota is used up (its wall less its averages): True, and what it ran
        over is owed to the next window (bounded: half a quota)."""
        over = (time.perf_counter() - start) * 1000.0 - stats.sync_ms - target_ms
        if over < 0.0:
            return False
        self.quota_debt_ms = min(over, 0.5 * quota_ms)
        return True

    # ---------------------------------------------------------------- reports

    def report(self, records: list[StepRecord], stats: RoundStats, last: StepRecord | None) -> StepRecord | None:
        """Count steps whose records are known, and hold them for the next report (each one a step
        late: the round's last is held until its average, whose time its report carries)."""
        for rec in records:
            stats.add(rec.epoch, rec.samples, rec.loss, rec.compute_ms, rec.data_ms)
            if last is not None and last.step == 1 and rec.step == 2:
                # the process's first step carries lazy CUDA/cuDNN set-up, kernel autotuning and
                # allocator warm-up (hundreds of ms on a GPU): no device's pace. Timed as the step
                # after it, ElChe and the dispatcher learn the real speed from the first window.
                stats.retime(last.epoch, last.compute_ms, rec.compute_ms)
                last = dataclasses.replace(last, compute_ms=rec.compute_ms)
            if last is not None:
                self._hold_report(last)
                if self.steps.probing:  # a probe's end waits on these counts: a fast rank through its
                    # share would otherwise idle for the flush interval, a short epoch's worth
                    self.link.send(self.reports.take())
                elif self.reports.due():
                    self.link.send_lazy(self.reports.take())  # rides the link's next flush
            last = rec
        return last

    def _hold_report(self, rec: StepRecord) -> None:
        """Add ``rec`` to the steps held for the next report; a report holds one epoch's steps."""
        if not self.reports.fits(rec):
            self.link.send_lazy(self.reports.take())
        self.reports.add(rec)

    # ----------------------------------------------------------------- epochs

    def enter_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` and, first, every epoch before it this rank has not begun (one it
        trained no batch of: windows flow across epoch edges and a rank's share of an epoch can
        be nothing), in order: the user's epoch_fn runs once for each."""
        while (empty := self.epoch_before(epoch)) is not None:
            self._begin_epoch(empty)
        if epoch > self.current_epoch:
            self._begin_epoch(epoch)

    def epoch_before(self, epoch: int) -> int | None:
        """The first epoch this rank has not begun, if it comes before ``epoch`` (one it trains no batch of), else None."""
        nxt = self.current_epoch + 1 if self.current_epoch >= 0 else (self.first_epoch if self.first_epoch >= 0 else epoch)
        return nxt if nxt < epoch else None

    def _begin_epoch(self, epoch: int) -> None:
        """``epoch`` begins on this rank: its fault point and the user's epoch_fn."""
        self.current_epoch = epoch
        self.ctx.probes.reach("epoch", index=epoch)
        epoch_fn = self.replica.task.epoch_fn
        if epoch_fn is not None:
            self.replica.lr.apply(self.steps.lr_step)  # so the handle shows the LR of the step about to run
            busy = self.link.busy
            self.link.doing("callback")
            try:
                epoch_fn(epoch, self.handle)
            except Exception as exc:
                raise UserError("epoch_fn", exc) from exc
            self.link.doing(busy)

    def enter_last_epoch(self) -> None:
        """The run completed: the epochs this rank trained no batch of after its last one begin here
        (their ``epoch_fn`` runs), so every rank reaches the run's last epoch.

        Raises:
            UserError: an ``epoch_fn`` raised.
        """
        self.enter_epoch(self.epochs - 1)
