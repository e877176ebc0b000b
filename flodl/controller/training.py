"""Training's books: the cadence loop, the windows' reports, each epoch's progress, stats and eval.

``Training`` owns what the training messages (``TimingMsg``, ``WindowDone``,
``EvalResult``, script mode's ``EpochEnd``) record and what the progress and epoch lines print; the
conductor (core.py) drives the windows and asks it to plan, settle and
finish epochs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config import ApplyPolicy
from ..plan.cadence import CadenceLoop
from ..plan.dispatch import FLOW_MAX_EPOCHS, PROBE_BATCHES, PROBE_MIN_MS
from ..plan.goodput import Goodput
from ..plan.metrics import EpochCounters, EpochStats
from ..plan.schedule import Schedule
from ..wire import messages as m
from ..wire.codec import Envelope
from .context import RunContext
from .epoch_ends import EpochEnds
from .resend import WindowResender

log = logging.getLogger("flodl.controller")


class Training:
    """Windows, epochs and evals: recorded as reports arrive, printed in order."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.trained = False  # a batch was reported: start-up is over
        self.info: m.RankHello | None = None  # the task (the first rank's hello), once training begins
        self.schedule: Schedule | None = None  # passes, epochs and picks, once the task's size is known
        self.cadence: CadenceLoop | None = None
        self.goodput: Goodput | None = None  # the books of goodput and lost work, once training begins
        self._faults_told = 0  # faults whose lost work the monitor was told (``tell_faults``)
        self.window_reports: dict[int, dict[int, m.WindowDone]] = {}
        self.window_batches: dict[int, int] = {}  # rank -> batches reported in the current window
        self.resender = WindowResender()  # windows a reset may have lost, sent again to idle ranks
        self._settled = -1  # the last window whose reports were taken: a late copy of one is dropped
        self._timing_window = False  # a calibration window is being timed: every TimingMsg wakes the conductor
        self.sent_window = -1  # the newest window sent to the ranks
        self._hurried = -1  # the newest window ended early for a joiner (``hurry``)
        self.history: list[EpochStats] = []
        self.evals: dict[int, m.EvalResult] = {}
        self.eval_requests: dict[int, int] = {}  # epoch -> rank asked to score it
        self.epoch_samples = 0
        self.epoch_loss: float | None = None
        self.current_epoch = -1
        self.rank_rates: dict[int, float] = {}  # rank -> samples since the last progress line
        self._rates_at = 0.0
        self.data_stats: dict[int, dict[str, int]] = {}  # rank -> staging-tier totals (hits, fetches, bytes held)
        # rank -> what its averages put on the network so far (sync_sent_bytes, sync_recv_bytes, sync_averages)
        self.sync_bytes: dict[int, dict[str, int]] = {}
        self._printed = 0  # epochs whose line is out
        # script mode: an epoch's row also waits for each script's end-of-epoch reports (epoch_ends.py)
        self.epoch_ends = EpochEnds(ctx.config.scalar_reduction_map) if ctx.launch.script else None
        self._fastest: int | None = None  # the elected eval rank under the Fastest policy

    @property
    def total_epochs(self) -> int:
        """Epochs the run trains: ``--epochs`` passes, each sliced into ``epoch_splits`` epochs."""
        return self.ctx.launch.epochs * self.ctx.config.epoch_splits

    @property
    def task(self) -> m.RankHello:
        """``info`` on the paths that run only once training has begun (``begin``)."""
        assert self.info is not None, "training has not begun"
        return self.info

    @property
    def loop(self) -> CadenceLoop:
        """``cadence`` on the paths that run only once ``open_loop`` made it."""
        assert self.cadence is not None, "the cadence loop is not open"
        return self.cadence

    @property
    def global_step(self) -> int:
        """Batches trained by the whole run so far (the loop's count: restored on resume, settled per window)."""
        return self.cadence.global_step if self.cadence is not None else 0

    # ============================================================ planning

    def begin(self, info: m.RankHello, schedule: Schedule) -> None:
        self.info, self.schedule = info, schedule

    def open_loop(self, ranks: list[int], seed: int, *, accumulate: int = 1) -> CadenceLoop:
        """The cadence loop that plans every window from here on; ``accumulate``: the ranks'
        batches per optimizer step (Sync averages at its multiples)."""
        info = self.task
        self.cadence = CadenceLoop(
            self.ctx.config,
            ranks,
            dataset_len=info.dataset_len,
            batch_size=info.batch_size,
            epochs=self.total_epochs,
            seed=seed,
            global_step=self.global_step,
            schedule=self.schedule,
            span_epochs=self._edges_needed_every(),
            grain=info.grain,
            accumulate=accumulate,
        )
        self.goodput = Goodput(start=self.ctx.run.started_at)
        self.goodput.begin(ranks)
        return self.cadence

    def _edges_needed_every(self) -> int:
        """Every how many epochs a window must end on the edge: checkpoints keep the model of an
        epoch's end (a window may span more epochs than that only in between).

        Evals do not cap windows: an eval scores the average that closed its epoch, and a window
        spans more than one epoch only where ElChe's overhead auto-tune asks for it (epochs too
        short to average each one within ``overhead_target``); capping it there made every short
        epoch pay a whole average, the cost the auto-tune exists to avoid. Epochs that one
        average closes are one row with one eval (``finish_epoch``)."""
        every = [FLOW_MAX_EPOCHS]
        if self.ctx.config.checkpoint_every:
            every.append(self.ctx.config.checkpoint_every)
        return min(every)

    def start_window(self, number: int, windows: dict[int, m.Window], *, first_in_flight: bool) -> None:
        """Window ``number`` goes out: its epoch's progress line starts, and (with nothing else in
        flight) the per-rank batch counts the calibration and a death's accounting read."""
        loop = self.loop
        self._start_epoch_progress(loop.lowest_open_epoch)
        if first_in_flight:
            self.window_batches = {rank: 0 for rank in loop.ranks}
        now = self.ctx.clock()
        for rank, window in windows.items():
            info = self.ctx.members.ranks.get(rank)
            if info is not None:  # the rank runs its windows in the order sent (a reset may reorder them)
                window.after, info.last_window = info.last_window, window.window
            self.resender.sent(rank, window, now)
            self.ctx.plane.send_rank(rank, window)
        self.sent_window = number

    def hurry(self) -> None:
        """A joiner is ready: end the windows in flight at their next batch (``EndWindow``; their
        ungranted rest goes back to the pool), so it is admitted at the boundary that follows
        instead of a whole window later (a window of a large model can last many seconds). A
        calibration window being timed is left to end as timed."""
        number = self.sent_window
        if number <= self._hurried or self.cadence is None or self._timing_window or self.reported(number):
            return
        self._hurry_to(number)

    def hurry_adoption(self, number: int) -> None:
        """CPU backend: joiners were just admitted to adopt the average of window ``number`` (not
        sent yet), its first round's, and train nothing in it: every member ends it after its
        first batch (an ``EndWindow`` that comes first ends a window a batch in: rank/windows.py),
        so they hold the consensus and their donor's state a batch into it, not a whole window
        later. Sync's first round follows the first batch already: nothing to end there."""
        if self.ctx.config.elche.mode.policy is not ApplyPolicy.SYNC:
            self._hurry_to(number)

    def _hurry_to(self, number: int) -> None:
        self._hurried = number
        self.ctx.plane.broadcast_ranks(m.EndWindow(window=number))

    async def until_window(self, number: int, done: Callable[[], bool], what: str) -> None:
        """Wait for ``done`` while window ``number`` is out; meanwhile send it again to any rank whose
        report of it is overdue while the rank sits idle (a frame lost in a connection reset)."""
        due: list[tuple[int, m.Window]] = []

        def ready() -> bool:
            if done():
                return True
            waiting = set(self.loop.waiting_on(number)) - set(self.window_reports.get(number, {}))
            due[:] = self.resender.overdue(number, sorted(waiting), self.ctx.members.ranks, self.ctx.clock())
            return bool(due)

        while True:
            await self.ctx.run.until(ready, None, what)
            if not due:
                return
            for rank, window in due:
                log.warning(
                    "rank %d is idle without having reported window %d: sending the window again (a frame lost to a connection reset?)",
                    rank,
                    number,
                )
                self.ctx.monitor.event("resend", f"window {number} sent again to idle rank {rank}", now_s=self.ctx.clock())
                self.ctx.plane.send_rank(rank, window)
            due.clear()

    async def end_when_timed(self, number: int) -> None:
        """Calibration window: end it once every rank has timed a few batches."""
        loop = self.loop
        start = self.ctx.clock()

        def timed() -> bool:
            waiting = loop.waiting_on(number)
            done = waiting <= set(self.window_reports.get(number, {}))  # grants ran out first
            counts = {r: self.window_batches.get(r, 0) for r in waiting}
            # a rank through its whole equal share would only wait for the others from here:
            # once every rank has its batches timed, end the probe then, not at PROBE_MIN_MS
            dry = any(n >= loop.granted_batches(number, r) for r, n in counts.items())
            timed_all = min(counts.values(), default=PROBE_BATCHES) >= PROBE_BATCHES
            return done or (timed_all and (dry or (self.ctx.clock() - start) * 1000 >= PROBE_MIN_MS))

        self._timing_window = True  # a flag, not loop.open_ended(): that walks every rank's plan, per frame
        try:
            await self.until_window(number, timed, f"calibration window {number}")
        finally:
            self._timing_window = False
        self.ctx.plane.broadcast_ranks(m.EndWindow(window=number))

    def reported(self, number: int) -> bool:
        """Every rank the loop waits on has reported window ``number``."""
        return self.loop.waiting_on(number) <= set(self.window_reports.get(number, {}))

    def settled(self, reports: dict[int, m.WindowDone]) -> None:
        """A window's reports are settled: an interval of the goodput books, and any fault whose lost
        work is now known told to the monitor."""
        if self.goodput is None:
            return
        samples = {r: sum(EpochCounters.from_row(row)[1].samples for row in rep.epochs) for r, rep in reports.items()}
        self.goodput.settled(self.ctx.clock(), samples)
        self.tell_faults()

    def tell_faults(self) -> None:
        """A ``fault`` event for each fault, in order, once its lost work and its recovery are known
        (its rank's windows all settled, the survivors averaging again)."""
        books, loop = self.goodput, self.cadence
        if books is None or loop is None:
            return
        while self._faults_told < len(books.faults):
            fault = books.faults[self._faults_told]
            if not loop.settled_for(fault.rank) or (fault.regrouped and fault.back_at is None):
                return
            lost = books.lost(loop.kept, fault.rank) if self.task.grain == "sample" else None
            parts = [f"detected {fault.detected - fault.since:.2f} s after it"]
            if fault.back_at is not None:
                parts.append(f"survivors averaging again {fault.back_at - fault.since:.2f} s after it")
            if lost is not None:
                parts.append(f"{lost} trained samples lost")
            self.ctx.monitor.event(
                "fault", f"rank {fault.rank} lost ({fault.reason}): {', '.join(parts)}", rank=fault.rank, now_s=self.ctx.clock()
            )
            self._faults_told += 1

    def take_reports(self, number: int) -> tuple[dict[int, m.WindowDone], dict[int, int]]:
        """Window ``number``'s reports, and the batches each rank that died in it reported."""
        dead_batches = {r: self.window_batches.get(r, 0) for r in self.loop.dead}
        self._settled = max(self._settled, number)
        self.resender.settled(number)
        return self.window_reports.pop(number, {}), dead_batches

    def _start_epoch_progress(self, epoch: int) -> None:
        if epoch != self.current_epoch:
            self.current_epoch = epoch
            self.epoch_samples = 0
            self.epoch_loss = None

    # ============================================================ epochs, evals

    def finish_epoch(self, stats: EpochStats, window: int = -1) -> None:
        """An epoch, or a group of epochs one average closed, is fully trained and averaged (by
        ``window``): record its row and ask for its eval, which scores that average: after the
        row's last epoch (one eval for a group: its epochs' models are that one model)."""
        if self.epoch_ends is not None:
            self.epoch_ends.close(stats)
        self.history.append(stats)
        if self.evals_on and any(self._eval_due(e) for e in stats.epochs):
            self.request_eval(stats.epoch, window)

    @property
    def evals_on(self) -> bool:
        """The task has an eval function and ``eval_every_epochs`` is not 0 (False before training)."""
        return self.info is not None and self.info.has_eval and self.ctx.config.evals_enabled

    def _eval_due(self, epoch: int) -> bool:
        """``eval_every_epochs``: every N epochs and always the last (unset: every epoch)."""
        every = self.ctx.config.eval_every_epochs
        return every is None or (epoch + 1) % every == 0 or epoch == self.total_epochs - 1

    def request_eval(self, epoch: int, window: int = -1) -> None:
        """The eval rank scores the averaged model between two of its batches: exactly the average
        of ``window`` (the one that closed the epoch) on the collective backend, even when it
        has trained into the next window since (-1: the model once its last average landed)."""
        rank = self.eval_rank()
        self.eval_requests[epoch] = rank
        final = epoch == self.total_epochs - 1
        self.ctx.plane.send_rank(rank, m.RunEval(epoch=epoch, final=final, window=window))

    def reask_evals_of(self, dead: set[int]) -> None:
        """Evals asked of ranks that died and never answered go to the next rank."""
        for epoch, rank in list(self.eval_requests.items()):
            if rank in dead and epoch not in self.evals:
                self.request_eval(epoch)

    def eval_rank(self) -> int:
        """Who runs eval: ``epoch_callback_policy``'s rank, or the fastest live rank.

        Fastest is resolved once ElChe has timed the ranks and then sticks, so
        evals do not hop between ranks on timing noise (rank 0 until then).
        """
        policy = self.ctx.config.epoch_callback_policy
        live = self.ranks()
        if not policy.is_fastest and policy.rank in live:
            return policy.rank
        if self._fastest not in live:
            self._fastest = None
        cadence = self.cadence
        if self._fastest is None and cadence is not None and cadence.elche.calibrated:
            ms = cadence.elche.ms_per_batch
            timed = [r for r in live if r in cadence.ranks and ms[cadence.ranks.index(r)] > 0]
            if timed:
                self._fastest = min(timed, key=lambda r: ms[cadence.ranks.index(r)])
        return self._fastest if self._fastest is not None else live[0]

    def ranks(self, joiners: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The ranks in the collective and the plans: live, and admitted. Once the loop
        plans, its ranks are exactly the admitted ones (a joiner enters them as it stops
        being one); before, the caller names the ``joiners`` to leave out."""
        live = {r.rank for r in self.ctx.members.live_ranks()} - joiners
        if self.cadence is not None:
            live &= set(self.cadence.ranks)
        return sorted(live)

    def flush_epoch_lines(self, *, over: bool = False) -> None:
        """Print and record each finished epoch once its eval (if any) and, in script mode, every
        live script's end of it are in, in order. ``over``: the ranks are gone or going, no
        ``EpochEnd`` is still to come: rows wait for evals only."""
        if self.info is None:
            return  # nothing trained yet
        metric = self.info.eval_metric if self.evals_on else None
        live = set(self.ranks())
        while self._printed < len(self.history):
            stats = self.history[self._printed]
            if self.epoch_ends is not None and not over and not self.epoch_ends.complete(stats, live):
                return
            if metric is not None and stats.epoch in self.eval_requests:
                result = self.evals.get(stats.epoch)
                if result is None:
                    return
                stats.eval_value, stats.eval_ms = result.value, result.elapsed_ms
                if result.error:
                    self.ctx.console.line(f"epoch {stats.epoch + 1}: eval failed on rank {result.rank}: {result.error}")
            following = stats.epoch + 1
            next_len = self.schedule.epoch_len(following) if self.schedule is not None and following < self.total_epochs else 0
            self.ctx.console.epoch(stats, self.total_epochs, metric, next_len=next_len if self.task.grain == "sample" else 0)
            self.ctx.monitor.epoch_done(stats, alive=set(self.ranks()), now_s=self.ctx.clock(), root=self._goodput_so_far())
            self._printed += 1

    def _goodput_so_far(self) -> dict[str, float]:
        """The root epoch record's ``goodput`` (once every slot has a rate) and ``lost_samples`` so far."""
        if self.goodput is None or self.cadence is None:
            return {}
        return self.goodput.live(self.ctx.clock(), sum(s.samples for s in self.history), self.cadence.kept)

    def goodput_summary(self, end: float, samples: int) -> dict | None:
        """The summary's goodput figures (None before training began)."""
        if self.goodput is None or self.cadence is None:
            return None
        return self.goodput.report(end, samples, self.cadence.kept if self.task.grain == "sample" else None)

    def description(self, run_id: str) -> dict:
        """What the dashboard and the record stream say about this run."""
        info = self.task
        return {
            "run_id": run_id,
            "mode": self.ctx.config.elche.mode.name,
            "task": self.ctx.launch.label,
            "world_size": self.ctx.members.world_size,
            "epochs": self.total_epochs,
            "dataset_len": info.dataset_len,
            "batch_size": info.batch_size,
            "eval_metric": info.eval_metric if self.evals_on else None,
            "reports_per_epoch": self.ctx.config.reports_per_epoch,
        }

    # ============================================================ handlers

    def on_batch_done(self, identity: bytes, env: Envelope, msg: m.TimingMsg) -> None:
        if not self.trained:
            self.trained = True
            self.ctx.startup.first_batch()
        batches = max(1, msg.batches)  # a report covers one or more steps (step_reports.py)
        if msg.rank in self.window_batches:
            self.window_batches[msg.rank] += batches
            if self._timing_window:
                self.ctx.run.changed()  # the calibration window waits on these
        self.rank_rates[msg.rank] = self.rank_rates.get(msg.rank, 0.0) + msg.samples
        if self.goodput is not None:
            self.goodput.batch(msg.rank, msg.samples)
        if msg.epoch != self.current_epoch:
            return
        self.epoch_samples += msg.samples
        # a moving average of the steps' losses, each step weighing 0.1 as when every step was a report
        keep = 0.9**batches
        self.epoch_loss = msg.loss if self.epoch_loss is None else keep * self.epoch_loss + (1.0 - keep) * msg.loss
        if not self.ctx.console.due():
            return  # the hot path: most frames only bump counters
        assert self.schedule is not None  # a frame of the current epoch: its window went out after begin
        # streamed shards: an epoch's samples are not known ahead (its length counts shards)
        total = self.schedule.epoch_len(msg.epoch) if self.task.grain == "sample" else 0
        elapsed = max(1e-9, self.ctx.clock() - self.ctx.run.started_at)
        done_total = sum(s.samples for s in self.history) + self.epoch_samples
        self.ctx.console.progress(
            epoch=msg.epoch,
            epochs=self.total_epochs,
            done=self.epoch_samples,
            total=total,
            rate=done_total / elapsed,
            loss=self.epoch_loss,
            ranks=self._rank_rates(),
        )

    def _rank_rates(self) -> dict[int, float]:
        """Samples per second of each rank since the last progress line."""
        now = self.ctx.clock()
        span = now - self._rates_at if self._rates_at else now - self.ctx.run.started_at
        rates = {r: n / span for r, n in sorted(self.rank_rates.items())} if span > 0 else {}
        self.rank_rates, self._rates_at = {}, now
        return rates

    def on_window_done(self, identity: bytes, env: Envelope, msg: m.WindowDone) -> None:
        if msg.window <= self._settled:
            return  # a report sent again that crossed its first copy: the window is settled
        self.resender.reported(msg.rank, msg.window)
        self.window_reports.setdefault(msg.window, {})[msg.rank] = msg
        wire = self.sync_bytes.setdefault(msg.rank, {})
        for key, value in msg.res.items():
            if key.startswith("sync_"):  # running totals: the largest is the latest, whatever order reports come in
                wire[key] = max(wire.get(key, 0), int(value))
        if msg.data:
            row = self.data_stats.setdefault(msg.rank, {})
            for key, value in msg.data.items():  # hits and fetches add up; bytes held are the latest
                row[key] = int(value) if key.endswith("_bytes") else row.get(key, 0) + int(value)
        if self.cadence is not None:
            self.ctx.monitor.window_done(msg, started_s=self.cadence.started.get(msg.window), arrived_s=self.ctx.clock())
        self.ctx.run.changed()

    def on_epoch_end(self, identity: bytes, env: Envelope, msg: m.EpochEnd) -> None:
        """Script mode: a rank's script ended an epoch (its reports come with it)."""
        if self.epoch_ends is None:
            return  # a Task rank never sends one
        closed = next((s for s in reversed(self.history) if msg.epoch in s.epochs), None)
        self.epoch_ends.note(msg, closed)
        self.flush_epoch_lines()

    def on_eval_result(self, identity: bytes, env: Envelope, msg: m.EvalResult) -> None:
        self.evals[msg.epoch] = msg
        if self.cadence is not None:
            self.cadence.note_pause(msg.elapsed_ms)
        if self.goodput is not None:
            self.goodput.paused(msg.elapsed_ms / 1000.0)
        now = self.ctx.clock()
        self.ctx.monitor.span(
            f"eval epoch {msg.epoch + 1}",
            start_s=now - msg.elapsed_ms / 1000.0,
            end_s=now,
            rank=msg.rank,
            args={"value": msg.value, "error": msg.error},
        )
        self.flush_epoch_lines()
        self.ctx.run.changed()
