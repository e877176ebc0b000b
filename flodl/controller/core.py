"""The controller: the only process with global state, one asyncio loop.

It owns one ROUTER socket (every worker and rank dials it), the TCPStore the
ranks build their process group from, and, in the embedded default, the
local worker process. One ``TaskGroup`` owns its actors: the conductor (the
run as a sequence of phases: gather → join → epochs → final eval →
shutdown), the liveness watch (heartbeats out, silence and deaths in), and
the embedded worker's supervisor. Incoming frames are handled synchronously
as they are drained; handlers only record facts and wake the conductor.

Any failure (a rank killed, silent, or raising) latches one ``RunAborted``
with a message naming the rank and host; the conductor then aborts every
peer (``Shutdown(abort=True)``), waits for processes to go, and raises it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from typing import TYPE_CHECKING, Any, Callable

import zmq

from .. import curve
from ..config import ApplyPolicy, AverageBackend, DdpRunConfig
from ..deadlines import Deadlines
from ..env import new_run_id, new_run_secret
from ..checkpoint_files import CheckpointError
from ..checkpoint_meta import read_meta
from ..errors import EXIT_CONFIG, EXIT_EVALS_FAILED, EXIT_FAILED, EXIT_RANK_LOST, RunAborted
from ..membership import Membership, PeerState
from ..progress import ProgressLimits
from ..metrics import EpochStats
from ..protocol import messages as m
from ..protocol.codec import Envelope
from ..proc import terminate_then_kill
from ..schedule import Schedule
from ..transport import ControlEndpoint, make_router, route_moves
from ..dispatch import FLOW_MAX_EPOCHS, PROBE_BATCHES, PROBE_MIN_MS
from .admission import Admission
from .cadence import CadenceLoop
from .checkpoints import Checkpointer
from .console import Console
from .launch import LaunchOptions
from .liveness import Liveness
from .saving import Saving
from .summary import RunSummary
from .teardown import Teardown
from ..monitor.hub import Monitor

if TYPE_CHECKING:
    from ..averaging.server import CpuAveraging  # torch: imported in _open, only when the CPU backend averages

log = logging.getLogger("flodl.controller")


class Controller(Admission, Liveness, Saving, Teardown, RunSummary):
    """Runs one training run from start to summary (``await run()``).

    This module holds the state, the run's phases (the conductor), the
    training messages; admission.py, liveness.py, saving.py, teardown.py and
    summary.py hold the methods for joining, deaths, checkpoints, stopping
    and the summary.
    """

    def __init__(
        self,
        launch: LaunchOptions,
        config: DdpRunConfig,
        *,
        secret: bytes | None = None,
        run_id: str | None = None,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.launch = launch
        self.config = config
        self.secret = secret or new_run_secret()
        self.run_id = run_id or new_run_id()
        self.console = console or Console(live=launch.progress)
        self.clock = clock
        self.deadlines = Deadlines.from_config(config)
        self.members = Membership(self.deadlines.heartbeat_s)
        self.progress_limits = ProgressLimits(heartbeat_s=self.deadlines.heartbeat_s, first_step_s=launch.join_timeout_secs,
                                              eval_s=launch.eval_timeout_secs, step_s=launch.step_timeout_secs)
        self.endpoint: ControlEndpoint | None = None
        self.port: int | None = None
        self.ready = asyncio.Event()  # set once the socket is bound (tests read .port)
        self.store = None
        self.averaging: CpuAveraging | None = None  # the CPU backend's bulk plane, when used
        self.worker_proc: asyncio.subprocess.Process | None = None
        self.failure: RunAborted | None = None
        self.phase = "starting"
        self._changed = asyncio.Event()
        # join
        self.expected_workers = 1 if launch.embedded else launch.workers
        self.hellos: dict[int, m.RankHello] = {}
        self.task_info: m.RankHello | None = None
        # training
        self.window_reports: dict[int, dict[int, m.WindowDone]] = {}
        self.window_batches: dict[int, int] = {}  # rank -> batches reported in the current window
        self.cadence: CadenceLoop | None = None
        self.history: list[EpochStats] = []
        self.evals: dict[int, m.EvalResult] = {}
        self.epoch_samples = 0
        self.epoch_loss: float | None = None
        self.current_epoch = -1
        self.global_step = 0
        self.collective_error: tuple[float, int, m.RankError] | None = None
        self.final_digests: dict[int, str] = {}  # rank -> sha256 of its parameters at a clean exit
        self.collective_retries = 0
        self.recoveries: list[dict] = []  # every regroup: when, generation, survivors, why
        self.restarts: list[dict] = []  # healing: every rank started in place of a dead one
        self._slot_of: dict[int, int] = {}  # a restarted rank -> the original rank whose restarts it counts against
        self._restarts_used: dict[int, int] = {}  # original rank -> restarts so far
        self._back: tuple[float, set[int]] | None = None  # a recovery waiting for every survivor's first average in it
        self.eval_requests: dict[int, int] = {}  # epoch -> rank asked to score it
        self.checkpoints = Checkpointer(config, say=self.console.line)
        self.monitor = Monitor(config, say=self.console.line, clock=clock,
                               dashboard=None if launch.dashboard_port < 0 else (launch.bind, launch.dashboard_port))
        self.rank_rates: dict[int, float] = {}  # rank -> samples since the last progress line
        self._rates_at = 0.0
        self._drops_seen = 0  # dropped control frames already alerted
        self.data_stats: dict[int, dict[str, int]] = {}  # rank -> staging-tier totals (hits, fetches, bytes held)
        self.resume_meta: dict | None = None  # the bundle sidecar this run continues from
        self.shutdown_save: tuple[str, int, str] | None = None  # ShutdownWithSave: (stem, writer rank, file tag)
        self._storage_reminded = False
        self.started_at = 0.0
        self.finished_at = 0.0
        self._printed = 0  # epochs whose line is out
        self._fastest: int | None = None  # the elected eval rank under the Fastest policy
        # growing: ranks of workers that arrived while training, until admitted at a window boundary
        self.joiners: dict[int, float] = {}  # rank -> deadline to be ready
        self.joins: list[dict] = []  # every admission: when, generation, ranks, host
        self.initial_world = 0  # ranks the run started with (the LR factor every replica keeps)
        self.welcomed = False  # the first ranks were welcomed: a death from now on regroups them
        self.schedule: Schedule | None = None  # passes, epochs and picks, once the task's size is known
        self._next_rank = 0  # rank numbers are never reused, so a late report can't be misread
        self._timing_window = False  # a calibration window is being timed: every BatchDone wakes the conductor
        self.fd_limit = 0  # the soft limit on open files once _open lifted it (0: unknown)
        self._fd_warned = False

    # ================================================================ run

    async def run(self) -> dict:
        """Run to completion and return the summary.

        Raises:
            RunAborted: the run failed or was interrupted; ``exit_code`` says
                why and ``summary`` holds what was done.
        """
        self.started_at = self.clock()
        if self.config.resume_from:
            try:
                self.resume_meta = read_meta(self.config.resume_from, weights_only=self.config.resume_weights_only)
            except CheckpointError as exc:  # before anything starts: nothing to clean up
                message = f"resume_from: {exc}"
                self.console.failed(message)
                raise RunAborted(message, EXIT_CONFIG, self.summary(message, EXIT_CONFIG)) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (RuntimeError, ValueError):  # not the main thread (tests): no signal handling
                pass
        try:
            self._open()
            url = await self.monitor.start()
            if url:
                self.console.line(f"dashboard: {url}")
            self.ready.set()  # tests read .port once everything listens
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(self._liveness())]
                if self.averaging is not None:
                    helpers.append(tg.create_task(self.averaging.run()))
                if self.launch.embedded:
                    helpers.append(tg.create_task(self._embedded_worker()))
                try:
                    return await self._conduct()
                except RunAborted as exc:
                    await self._abort(exc)
                    raise
                finally:
                    for task in helpers:
                        task.cancel()
        except* RunAborted as group:
            raise group.exceptions[0] from None
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (RuntimeError, ValueError):
                    pass
            for path in await self.monitor.close():
                self.console.line(f"wrote {path}")
            await self._close()

    def _open(self) -> None:
        import torch.distributed as dist

        ctx = zmq.Context.instance()
        if curve.requested():
            curve.enable(self.secret)
        if not _is_loopback(self.launch.bind):
            if curve.enabled():
                self.console.line(f"note: serving on {self.launch.bind}: frames are authenticated and encrypted (CURVE); "
                                  "torch's store and any nccl/gloo collectives are not")
            else:
                # every frame is signed (HMAC with the run secret), but nothing is encrypted
                self.console.line(f"note: serving on {self.launch.bind} beyond loopback: frames are authenticated, not encrypted; "
                                  "keep the network trusted, tunnel it, or run with --encrypt")
        self.fd_limit = _lift_fd_limit()
        sock, self.port = make_router(ctx, self.launch.bind, self.launch.port)
        self.endpoint = ControlEndpoint(sock, secret=self.secret, run_id=self.run_id, sender="controller", on_message=self._on_message)
        self.endpoint.start()
        # the ranks' rendezvous; survives membership generations (each gets a key prefix)
        self.store = dist.TCPStore(self.launch.bind, 0, is_master=True, wait_for_workers=False)
        if self.config.elche.mode.backend is AverageBackend.CPU:
            from ..averaging.server import CpuAveraging  # torch, shm, bulk: only the CPU backend needs them

            self.averaging = CpuAveraging(
                secret=self.secret, run_id=self.run_id, bind=self.launch.bind,
                timeout_s=self.deadlines.snapshot_s, clock=self.clock,
            )
            self.averaging.live = lambda: {r.rank for r in self.members.live_ranks()}
            self.averaging.start()
        log.info("controller listening on tcp://%s:%d (store port %d)", self.launch.bind, self.port, self.store.port)
        log.info("deadlines: %s", self.deadlines.describe())
        # everything alive now (torch's import, above all) lives as long as the run: keep it out of
        # the collector's full passes, which otherwise stall the event loop 60-170 ms (1,000-rank bench)
        gc.freeze()

    async def _close(self) -> None:
        if self.worker_proc is not None and self.worker_proc.returncode is None:
            await terminate_then_kill([self.worker_proc], 3.0)
        if self.endpoint is not None:
            self.endpoint.close()
        if self.averaging is not None:
            self.averaging.close()
        self.store = None

    @property
    def total_epochs(self) -> int:
        """Epochs the run trains: ``--epochs`` passes, each sliced into ``epoch_splits`` epochs."""
        return self.launch.epochs * self.config.epoch_splits

    @property
    def address(self) -> str:
        return f"tcp://{self.launch.advertise_host}:{self.port}"

    # =========================================================== conductor

    async def _conduct(self) -> dict:
        self.phase = "gathering"
        await self._until(lambda: len(self.members.workers) >= self.expected_workers, self.launch.join_timeout_secs, "workers to connect")
        self._welcome_workers()
        self.phase = "joining"
        first = [r for r in range(self.initial_world)]  # a worker arriving meanwhile waits to be admitted
        lost = lambda r: r in self.members.ranks and self.members.ranks[r].state is PeerState.DEAD  # noqa: E731  (died starting: the run goes on)
        await self._until(lambda: all(r in self.hellos or lost(r) for r in first), self.launch.join_timeout_secs, "ranks to start and say hello")
        self._welcome_ranks()
        if any(lost(r) for r in first):
            reason = f"rank(s) {', '.join(str(r) for r in first if lost(r))} died while starting"
            self.members.new_generation(reason)
            self._regroup(reason)
        await self._until(lambda: all(self.members.ranks[r].state is PeerState.READY or lost(r) for r in first if r in self.members.ranks),
                          self.launch.join_timeout_secs, "ranks to join the collective")
        self.phase = "training"
        info = self.task_info
        try:
            self.schedule = Schedule(info.dataset_len, self.config.augment, self.config.epoch_splits, self.launch.epochs)
        except ValueError as exc:
            raise RunAborted(f"epoch_splits: {exc}", EXIT_CONFIG) from None
        self.console.header(
            run_id=self.run_id,
            mode=str(self.config.elche.mode.name),
            task=self.launch.task,
            ranks=[f"rank{r.rank} {r.device}@{r.host}" for r in sorted(self.members.ranks.values(), key=lambda r: r.rank) if r.rank not in self.joiners],
            dataset_len=info.dataset_len,
            batch_size=info.batch_size,
            epochs=self.total_epochs,
        )
        if self.config.augment > 1 or self.config.epoch_splits > 1:
            self.console.line(f"  {self.launch.epochs} pass(es) of {self.schedule.pass_len} picks (each sample x{self.config.augment}), "
                              f"{self.config.epoch_splits} epoch(s) per pass of ~{self.schedule.epoch_len(0)} samples")
        self.started_at = self.clock()
        self.monitor.begin(self._run_description(), {r.rank: (r.host, r.device) for r in self.members.ranks.values()},
                           steps_per_epoch=max(1, self.schedule.epoch_len(0) // info.batch_size))
        await self._run_windows()
        if info.has_eval and self.total_epochs - 1 not in self.eval_requests:
            # nothing was left to train (a resumed bundle that was complete): score it once all the same
            self._request_eval(self.total_epochs - 1)
        if info.has_eval:
            await self._until(lambda: self.total_epochs - 1 in self.evals, self.launch.eval_timeout_secs, "the final eval")
        if self.checkpoints.stem:
            await self._checkpoint("final", call_fn=False, wait=True)
        self.finished_at = self.clock()
        self._flush_epoch_lines()
        await self._shutdown_peers()
        failed = [e for e in self.evals.values() if e.error] if info.has_eval else []
        if failed and len(failed) == len(self.evals):
            # trained, but nothing says how well: not a plain success (the last error says why)
            summary = self.summary("completed, every eval failed", EXIT_EVALS_FAILED)
            summary["failure"] = f"every eval failed ({len(failed)} of {len(failed)}; the last: {failed[-1].error})"
            self.console.done(summary)
            self.console.line(f"flodl: {summary['failure']}")
            return summary  # run_controller turns a non-zero exit_code into RunAborted, summary written
        summary = self.summary("completed", 0)
        self.console.done(summary)
        return summary

    async def _run_windows(self) -> None:
        """Progressive dispatch: window after window until every epoch is trained.

        Cadence and Async keep two windows in flight on either backend: the
        next window is planned and sent while the current one trains, so a
        rank goes from one window's average straight into the next without a
        controller round trip (ElChe plans from timings one window old). Sync
        plans one at a time. A collective joiner drains the pipeline first:
        its group is rebuilt with nothing queued on any rank.
        """
        ranks = self._training_ranks()  # workers that arrived while these started join at a boundary
        self.cadence = loop = CadenceLoop(
            self.config, ranks, dataset_len=self.task_info.dataset_len, batch_size=self.task_info.batch_size,
            epochs=self.total_epochs, seed=self._seed(), global_step=self.global_step, schedule=self.schedule,
            span_epochs=self._edges_needed_every(),
        )
        if self.resume_meta is not None:
            self._resume(loop)
        if self.averaging is not None:
            self.averaging.on_round = lambda number, ms: (loop.note_round(ms), self._cpu_round_done(number, ms))
        policy = self.config.elche.mode.policy
        depth = 1 if policy is ApplyPolicy.SYNC else 2
        in_flight: list[int] = []
        while True:
            # a collective joiner on its way: plan one window at a time, so it waits for one boundary, not two
            while len(in_flight) < (1 if self.averaging is None and self.joiners else depth):
                if self._admit_joiners(loop, in_flight):
                    break  # ready joiners wait for an empty pipeline
                number = loop.window
                windows = loop.next_windows(self.clock())
                if windows is None:
                    break
                self._start_epoch_progress(loop.lowest_open_epoch)
                if not in_flight:
                    self.window_batches = {rank: 0 for rank in loop.ranks}
                for rank, window in windows.items():
                    self._send_rank(rank, window)
                if loop.dispatcher.throttled:
                    self.monitor.throttled(number, loop.dispatcher.throttled, now_s=self.clock())
                in_flight.append(number)
                if loop.open_ended(number):
                    self._timing_window = True
                    try:
                        await self._end_when_timed(number, loop)
                    finally:
                        self._timing_window = False
                    break  # calibrate before planning ahead
            if not in_flight:
                if loop.finished:
                    return
                raise RunAborted("the dispatcher stalled with samples left and nothing in flight (a bug)", EXIT_FAILED)
            number = in_flight.pop(0)
            await self._until(lambda: loop.waiting_on(number) <= set(self.window_reports.get(number, {})), None, f"window {number}")
            dead_batches = {r: self.window_batches.get(r, 0) for r in loop.dead}
            reports = self.window_reports.pop(number, {})
            for stats in loop.on_reports(number, reports, self.clock(), dead_batches):
                self._finish_epoch(stats, number)
            self.monitor.window_settled(number, reports, now_s=self.clock())
            self.monitor.event("sync", f"window {number}: {sum(r.consumed for r in reports.values())} samples averaged", now_s=self.clock())
            self.monitor.anchor_changed(loop.elche.anchor, now_s=self.clock(), counts=list(loop.elche.batch_counts))
            self.global_step = loop.global_step
            if self.checkpoints.at_epoch_due(loop.dispatcher.next_epoch - 1):
                await self._checkpoint("checkpoint", call_fn=False)

    def _edges_needed_every(self) -> int:
        """Every how many epochs an average must fall on the edge: evals and checkpoints score and
        keep the model of an epoch's end (a window may span more epochs than that only in between)."""
        every = [FLOW_MAX_EPOCHS]
        if self.task_info.has_eval:
            every.append(self.config.eval_every_epochs or 1)
        if self.config.checkpoint_every:
            every.append(self.config.checkpoint_every)
        return min(every)

    async def _end_when_timed(self, number: int, loop: CadenceLoop) -> None:
        """Calibration window: end it once every rank has timed a few batches."""
        start = self.clock()

        def timed() -> bool:
            waiting = loop.waiting_on(number)
            done = waiting <= set(self.window_reports.get(number, {}))  # grants ran out first
            counts = {r: self.window_batches.get(r, 0) for r in waiting}
            # a rank through its whole equal share would only wait for the others from here:
            # once every rank has its batches timed, end the probe then, not at PROBE_MIN_MS
            dry = any(n >= loop.granted_batches(number, r) for r, n in counts.items())
            timed_all = min(counts.values(), default=PROBE_BATCHES) >= PROBE_BATCHES
            return done or (timed_all and (dry or (self.clock() - start) * 1000 >= PROBE_MIN_MS))

        await self._until(timed, None, f"calibration window {number}")
        self._broadcast_ranks(m.EndWindow(window=number))

    def _broadcast_ranks(self, msg: Any) -> None:
        frame = self.endpoint.writer.encode(msg)
        for info in self.members.live_ranks():
            self.endpoint.send_frame(frame, info.identity)

    def _start_epoch_progress(self, epoch: int) -> None:
        if epoch != self.current_epoch:
            self.current_epoch = epoch
            self.epoch_samples = 0
            self.epoch_loss = None

    def _finish_epoch(self, stats: EpochStats, window: int = -1) -> None:
        """An epoch is fully trained and averaged (by ``window``): record it, ask for its eval, print it."""
        self.history.append(stats)
        if self.task_info.has_eval and self._eval_due(stats.epoch):
            self._request_eval(stats.epoch, window)
        if self.checkpoints.every_due(stats.epoch):
            self._checkpoint_now("checkpoint", call_fn=True, files=bool(self.checkpoints.stem))
        self._flush_epoch_lines()

    def _eval_due(self, epoch: int) -> bool:
        """``eval_every_epochs``: every N epochs and always the last (unset: every epoch)."""
        every = self.config.eval_every_epochs
        return every is None or (epoch + 1) % every == 0 or epoch == self.total_epochs - 1

    def _run_description(self) -> dict:
        """What the dashboard and the record stream say about this run."""
        info = self.task_info
        return {"run_id": self.run_id, "mode": self.config.elche.mode.name, "task": self.launch.task,
                "world_size": self.members.world_size, "epochs": self.total_epochs, "dataset_len": info.dataset_len,
                "batch_size": info.batch_size, "eval_metric": info.eval_metric if info.has_eval else None,
                "reports_per_epoch": self.config.reports_per_epoch}

    def _request_eval(self, epoch: int, window: int = -1) -> None:
        """The eval rank scores the averaged model between two of its batches: exactly the average
        of ``window`` (the one that closed the epoch) on the collective backend, even when it
        has trained into the next window since (-1: the model once its last average landed)."""
        rank = self._eval_rank()
        self.eval_requests[epoch] = rank
        self._send_rank(rank, m.RunEval(epoch=epoch, final=epoch == self.total_epochs - 1, window=window))

    # ===================================================== evals, failure

    def _eval_rank(self) -> int:
        """Who runs eval: ``epoch_callback_policy``'s rank, or the fastest live rank.

        Fastest is resolved once ElChe has timed the ranks and then sticks, so
        evals do not hop between ranks on timing noise (rank 0 until then).
        """
        policy = self.config.epoch_callback_policy
        live = self._training_ranks()
        if not policy.is_fastest and policy.rank in live:
            return policy.rank
        if self._fastest not in live:
            self._fastest = None
        if self._fastest is None and self.cadence is not None and self.cadence.elche.calibrated:
            ms = self.cadence.elche.ms_per_batch
            timed = [r for r in live if r in self.cadence.ranks and ms[self.cadence.ranks.index(r)] > 0]
            if timed:
                self._fastest = min(timed, key=lambda r: ms[self.cadence.ranks.index(r)])
        return self._fastest if self._fastest is not None else live[0]

    def _flush_epoch_lines(self) -> None:
        """Print each finished epoch once its eval (if any) is in, in order."""
        metric = self.task_info.eval_metric if self.task_info.has_eval else None
        while self._printed < len(self.history):
            stats = self.history[self._printed]
            if metric is not None and stats.epoch in self.eval_requests:
                result = self.evals.get(stats.epoch)
                if result is None:
                    return
                stats.eval_value = result.value
                if result.error:
                    self.console.line(f"epoch {stats.epoch + 1}: eval failed on rank {result.rank}: {result.error}")
            self.console.epoch(stats, self.total_epochs, metric)
            self.monitor.epoch_done(stats, alive=set(self._training_ranks()), now_s=self.clock())
            self._printed += 1

    async def _until(self, predicate: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        """Wait for ``predicate`` (re-checked on every state change).

        Raises:
            RunAborted: a failure was latched, or ``timeout_s`` passed.
        """
        deadline = None if timeout_s is None else self.clock() + timeout_s
        while True:
            if self.failure is not None:
                raise self.failure
            if predicate():
                return
            if deadline is not None and self.clock() > deadline:
                # assess is pure: a verdict asked for only to explain the timeout marks nobody dead
                self._fail(f"timed out after {timeout_s:g} s waiting for {what} ({self.members.assess(self.clock()).reason})", EXIT_RANK_LOST)
                continue
            await self._next_change(0.5)

    async def _next_change(self, at_most_s: float) -> None:
        """Sleep until a handler records a change (``_changed``), or ``at_most_s`` passes."""
        self._changed.clear()
        try:
            async with asyncio.timeout(at_most_s):
                await self._changed.wait()
        except TimeoutError:
            pass

    def _fail(self, message: str, code: int) -> None:
        """Latch the run's failure (the first one wins) and wake the conductor."""
        if self.failure is None:
            log.error("%s", message)
            self.failure = RunAborted(message, code)
        self._changed.set()

    # ============================================================ handlers

    def _on_message(self, identity: bytes, env: Envelope) -> None:
        msg = env.msg
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return  # a message we never act on in this direction
        if type(msg) is m.Ping:  # answered at once, the bookkeeping after: a round trip waits on nothing else
            getattr(self, handler)(identity, env, msg)
            handler = None
        now = self.clock()
        self._follow_route(identity, env)
        rank = getattr(msg, "rank", None)
        if rank is not None and rank >= 0 and type(msg) is not m.RankExited:
            if not self._is_rank_sender(rank, env.sender, msg):
                return
            self.members.seen_rank(rank, now)
        else:
            self.members.seen_worker(env.sender, now)
            if rank is None:
                self.members.seen_route(identity, now)
        if handler is not None:
            getattr(self, handler)(identity, env, msg)

    def _is_rank_sender(self, rank: int, sender: str, msg: Any) -> bool:
        """A rank message must be signed by the sender that said that rank's hello
        (sender names are authenticated; the connection it came on is not)."""
        info = self.members.ranks.get(rank)
        if info is None:
            return False
        if isinstance(msg, m.RankHello):
            return True
        if isinstance(msg, m.RankError) and not info.sender:
            return True  # it failed before its hello (building the task): say so now, not at a timeout
        return info.sender == sender

    def _follow_route(self, identity: bytes, env: Envelope) -> None:
        """A known peer's frame on another connection (it reconnected after a reset): its route
        moves there if the frame is the newest ever accepted from it, never for a replay."""
        peer = self.members.workers.get(env.sender) or self.members.by_sender.get(env.sender)
        if peer is None or not route_moves(peer.identity, identity, env):
            return
        log.info("%s now reaches us on another connection", env.sender)
        self.members.route_moved(peer, identity)

    def _h_batch_done(self, identity: bytes, env: Envelope, msg: m.BatchDone) -> None:
        if msg.rank in self.window_batches:
            self.window_batches[msg.rank] += 1
            if self._timing_window:  # a flag, not loop.open_ended(): that walks every rank's plan, per frame
                self._changed.set()  # the calibration window waits on these
        self.rank_rates[msg.rank] = self.rank_rates.get(msg.rank, 0.0) + msg.samples
        if msg.epoch != self.current_epoch:
            return
        self.epoch_samples += msg.samples
        self.epoch_loss = msg.loss if self.epoch_loss is None else 0.9 * self.epoch_loss + 0.1 * msg.loss
        if not self.console.due():
            return  # the hot path: most frames only bump counters
        total = self.schedule.epoch_len(msg.epoch)
        elapsed = max(1e-9, self.clock() - self.started_at)
        done_total = sum(s.samples for s in self.history) + self.epoch_samples
        self.console.progress(epoch=msg.epoch, epochs=self.total_epochs, done=self.epoch_samples, total=total, rate=done_total / elapsed,
                              loss=self.epoch_loss, ranks=self._rank_rates())

    def _rank_rates(self) -> dict[int, float]:
        """Samples per second of each rank since the last progress line."""
        now = self.clock()
        span = now - self._rates_at if self._rates_at else now - self.started_at
        rates = {r: n / span for r, n in sorted(self.rank_rates.items())} if span > 0 else {}
        self.rank_rates, self._rates_at = {}, now
        return rates

    def _h_window_done(self, identity: bytes, env: Envelope, msg: m.WindowDone) -> None:
        self.window_reports.setdefault(msg.window, {})[msg.rank] = msg
        if msg.data:
            row = self.data_stats.setdefault(msg.rank, {})
            for key, value in msg.data.items():  # hits and fetches add up; bytes held are the latest
                row[key] = int(value) if key.endswith("_bytes") else row.get(key, 0) + int(value)
        if self.cadence is not None:
            self.monitor.window_done(msg, started_s=self.cadence.started.get(msg.window), arrived_s=self.clock())
        self._changed.set()

    def _h_eval_result(self, identity: bytes, env: Envelope, msg: m.EvalResult) -> None:
        self.evals[msg.epoch] = msg
        if self.cadence is not None:
            self.cadence.note_pause(msg.elapsed_ms)
        now = self.clock()
        self.monitor.span(f"eval epoch {msg.epoch + 1}", start_s=now - msg.elapsed_ms / 1000.0, end_s=now, rank=msg.rank,
                          args={"value": msg.value, "error": msg.error})
        self._flush_epoch_lines()
        self._changed.set()

    def _h_exiting(self, identity: bytes, env: Envelope, msg: m.Exiting) -> None:
        if msg.rank >= 0:
            self.members.rank_left(msg.rank)
            if msg.digest:
                self.final_digests[msg.rank] = msg.digest
        else:
            self.members.worker_gone(env.sender)
        self._changed.set()

    def _h_ping(self, identity: bytes, env: Envelope, msg: m.Ping) -> None:
        self.endpoint.send(m.Pong(msg.nonce, msg.sent_at), identity)

    def _h_heartbeat(self, identity: bytes, env: Envelope, msg: m.Heartbeat) -> None:
        """Liveness was recorded in _on_message; a rank's beat also says whether it makes progress."""
        info = self.members.by_identity.get(identity)
        if info is None or not msg.busy:
            return
        self.members.heard_progress(info, msg.busy, msg.busy_s, msg.step_ms, msg.averaged, self.clock())
        self._note_averaging_again(info.rank, msg.averaged)

    # ============================================================ sending

    def _send_rank(self, rank: int, msg: Any) -> None:
        self.endpoint.send(msg, self.members.ranks[rank].identity)

    def _send_ranks(self, ranks: list[int], msg: Any) -> None:
        """The same message to several ranks, signed once (a Regroup lists every
        member: signing it per rank made each death cost O(world²))."""
        frame = self.endpoint.writer.encode(msg)
        for rank in ranks:
            self.endpoint.send_frame(frame, self.members.ranks[rank].identity)


def _lift_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit
    in force (0 if unknown). Every rank and worker holds a TCP connection to the controller,
    so the common default of 1024 caps a run at a few hundred ranks: past it, connections
    fail in ZeroMQ's I/O thread (which then spins on accept) and ranks look silent."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):  # e.g. macOS caps the soft limit below an unlimited hard one
            pass
    return soft


def _is_loopback(address: str) -> bool:
    """``127.x``, ``::1`` or ``localhost``: reachable from this host only."""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name or "*": assume it reaches beyond this machine


#: Message type → handler method name (looked up on the instance, so subclasses can hook in).
_HANDLERS: dict[type, str] = {
    m.WorkerHello: "_h_worker_hello",
    m.RankHello: "_h_rank_hello",
    m.RankReady: "_h_rank_ready",
    m.BatchDone: "_h_batch_done",
    m.WindowDone: "_h_window_done",
    m.EvalResult: "_h_eval_result",
    m.RankError: "_h_rank_error",
    m.RankExited: "_h_rank_exited",
    m.Exiting: "_h_exiting",
    m.CheckpointDone: "_h_checkpoint_done",
    m.Ping: "_h_ping",
    m.Heartbeat: "_h_heartbeat",
}
