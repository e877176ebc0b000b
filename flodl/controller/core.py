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

``Controller`` is a composition. Each part owns its slice of the run's state
(only its own methods write it) and is handed, at construction, one frozen
``RunContext`` (context.py: the launch options, config, deadlines, identity,
clock, console, roster, run state, sockets, monitor, start-up, checkpoints'
books and hooks, which no part reassigns) and, by name, the parts it uses; a
part uses only parts built before it:

- ``RunState`` (phase.py): the phase and its one transition method, the failure, start and end
- ``ControlPlane`` (plane.py): the sockets, and every message out
- ``Training`` (training.py): the cadence loop, the windows' reports, epochs and evals
- ``Resume`` (resume.py): the bundle a run continues from
- ``Admission`` (admission.py): workers and ranks in, rank numbers, joiners
- ``Saving`` (saving.py): checkpoints, ShutdownWithSave, Ctrl-C
- ``Liveness`` (liveness.py): heartbeats, deaths, regrouping, healing
- ``Teardown`` (teardown.py): the local worker, peers leaving, stopping them

This module holds the conductor, which drives the parts through the run, and
routes each message to the bound method of the part that handles it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.files import CheckpointError
from ..config import ApplyPolicy, DdpRunConfig
from ..config.deadlines import Deadlines
from ..config.env import new_run_id, new_run_secret
from ..config.joinfile import JoinInfo
from ..config.outer import OuterConfig
from ..errors import EXIT_CONFIG, EXIT_EVALS_FAILED, EXIT_FAILED, EXIT_UNSAVED, ConfigError, RunAborted
from ..monitor.hooks import check as check_loggers
from ..monitor.hub import Monitor
from ..plan.cadence import CadenceLoop
from ..plan.membership import Membership, PeerState
from ..plan.metrics import EpochStats
from ..plan.schedule import Schedule
from ..wire import curve
from ..wire import messages as m
from ..wire.codec import Envelope
from ..wire.transport import ControlEndpoint, route_moves
from .admission import Admission
from .checkpoints import Checkpointer
from .console import Console
from .context import RunContext
from .hooks import ControllerHooks
from .launch import LaunchOptions
from .liveness import Liveness
from .phase import Phase, RunState
from .plane import ControlPlane
from .resume import Resume
from .saving import Saving
from .setting import RunSetting
from .startup import Startup
from .summary import summarize
from .teardown import Teardown
from .training import Training

log = logging.getLogger("flodl.controller")

#: A message handler: the sender's connection, the verified envelope, the message.
Handler = Callable[[bytes, Envelope, Any], None]


def _answered(identity: bytes, env: Envelope, msg: Any) -> None:
    """A ``Ping``: its ``Pong`` went out from the endpoint (``answer_pings``) before the dispatch."""


def _cores(hello: m.RankHello | None) -> str:
    """The banner's " [cores 2-7]": the cores a rank is pinned to (GPU and CPU ranks sharing a host), else ""."""
    return f" [cores {hello.cores}]" if hello is not None and hello.cores else ""


def averaging_line(config: DdpRunConfig) -> str | None:
    """The banner's line on how replicas are combined, when not the default (docs/cadence.md, *Combining replicas*)."""
    parts = []
    if config.average_weights != DdpRunConfig().average_weights:
        parts.append(f"{config.average_weights}-weighted averages")
    outer = OuterConfig.of(config)
    if outer.kind != "none":
        parts.append(f"outer optimizer {outer.kind} (rate {outer.lr:g}, momentum {outer.momentum:g})")
    if config.sync_compression != "none":
        parts.append(f"{config.sync_compression}-compressed averages (parameter deltas, error feedback; docs/compression.md)")
    if config.sync_fragments > 1:
        parts.append(f"averages in {config.sync_fragments} fragments, in rotation (the last takes all; docs/fragments.md)")
    return "; ".join(parts) or None


class Controller:
    """Runs one training run from start to summary (``await run()``).

    ``hooks`` (a ``ControllerHooks``) is how a bench or a test looks in at
    named points of the run; the parts themselves are not an API.
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
        hooks: ControllerHooks | None = None,
        started_unix: float | None = None,
    ) -> None:
        console = console or Console.for_progress(launch.progress)
        # start-up counts from ``started_unix`` (the CLI: the process start), else from now
        startup = Startup(console, started_unix=started_unix)
        # where workers started by hand get the secret from, said when they are awaited
        self.secret_source = "FLODL_RUN_SECRET" if secret else "made here"
        self._observed = hooks is not None  # the per-message hook costs a call on the hot path: only when asked for
        self.ready = asyncio.Event()  # set once the socket is bound (tests read .port)
        deadlines = Deadlines.from_config(config)
        setting = RunSetting(
            launch=launch,
            config=config,
            deadlines=deadlines,
            run_id=run_id or new_run_id(),
            secret=secret or new_run_secret(),
            clock=clock,
            console=console,
            members=Membership(deadlines.heartbeat_timeout_s),
        )
        say = console.line
        checkpoints = Checkpointer(config, say=say)
        dashboard = None if launch.dashboard_port < 0 else (launch.bind, launch.dashboard_port)
        monitor = Monitor(config, say=say, clock=clock, dashboard=dashboard)
        self.ctx = ctx = RunContext.on(
            setting,
            run=RunState(setting.members, clock),
            plane=ControlPlane(setting),
            monitor=monitor,
            startup=startup,
            checkpoints=checkpoints,
            hooks=hooks or ControllerHooks(),
        )
        # each part: the context, and by name the parts it uses (built before it)
        self.training = training = Training(ctx)
        self.resume = resume = Resume(ctx)
        self.admission = admission = Admission(ctx, training=training, resume=resume)
        self.saving = saving = Saving(ctx, training=training)
        self.liveness = Liveness(ctx, admission=admission, training=training, saving=saving)
        self.teardown = Teardown(ctx, admission=admission, saving=saving)
        # every message the controller acts on, to the part that handles it (others are ignored)
        self._handlers: dict[type, Handler] = {
            m.WorkerHello: self.admission.on_worker_hello,
            m.RankHello: self.admission.on_rank_hello,
            m.RankReady: self.admission.on_rank_ready,
            m.TimingMsg: self.training.on_batch_done,
            m.WindowDone: self.training.on_window_done,
            m.EvalResult: self.training.on_eval_result,
            m.EpochEnd: self.training.on_epoch_end,
            m.RankError: self.liveness.on_rank_error,
            m.RankExited: self.liveness.on_rank_exited,
            m.Heartbeat: self.liveness.on_heartbeat,
            m.Exiting: self.teardown.on_exiting,
            m.CheckpointDone: self.saving.on_checkpoint_done,
            m.Ping: _answered,  # the endpoint answered it before this dispatch: here only the bookkeeping (a sign of life)
        }

    # ============================================================ views (tests and benches read these)

    @property
    def phase(self) -> Phase:
        return self.ctx.run.phase

    @property
    def state(self) -> RunState:
        return self.ctx.run

    @property
    def plane(self) -> ControlPlane:
        return self.ctx.plane

    @property
    def port(self) -> int | None:
        return self.plane.port

    @property
    def endpoint(self) -> ControlEndpoint | None:
        return self.plane.endpoint

    @property
    def cadence(self) -> CadenceLoop | None:
        return self.training.cadence

    @property
    def address(self) -> str:
        return self.plane.address

    # ================================================================ run

    async def run(self) -> dict:
        """Run to completion and return the summary.

        Raises:
            RunAborted: the run failed or was interrupted; ``exit_code`` says
                why and ``summary`` holds what was done.
        """
        self.ctx.run.mark_started()
        try:
            self.ctx.checkpoints.claim(self.ctx.run_id)  # first: no other run writes the stem while we read or save it
            self.resume.load()
            check_loggers(self.ctx.config)  # W&B not installed, a --logger not importable: before anything starts
        except (CheckpointError, ConfigError) as exc:  # before anything starts: only the lock to give back
            self.ctx.checkpoints.release()
            message = str(exc) if isinstance(exc, ConfigError) else f"resume_from: {exc}"
            self.ctx.console.failed(message)
            raise RunAborted(message, EXIT_CONFIG, self.summary(message, EXIT_CONFIG)) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.saving.on_signal, sig)
            except (RuntimeError, ValueError):  # not the main thread (tests): no signal handling
                pass
        try:
            self._open()
            url = await self.ctx.monitor.start(
                {"run_id": self.ctx.run_id, "task": self.ctx.launch.label, "config": self.ctx.config.to_dict()}
            )
            if url:
                self.ctx.console.line(f"dashboard: {url}")
            self._hand_out_credentials()
            self.ready.set()  # tests read .port once everything listens
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(self.liveness.watch())]
                if self.plane.averaging is not None:
                    helpers.append(tg.create_task(self.plane.averaging.run()))
                if self.ctx.launch.embedded:
                    helpers.append(tg.create_task(self.teardown.embedded_worker()))
                try:
                    return await self._conduct()
                except RunAborted as exc:
                    self.training.flush_epoch_lines(over=True)  # script mode: rows still waiting for an end that will not come
                    await self.teardown.abort(exc)
                    exc.summary = self.summary(str(exc), exc.exit_code)
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
            for path in await self.ctx.monitor.close():
                self.ctx.console.line(f"wrote {path}")
            await self.teardown.stop_worker()
            self.ctx.checkpoints.release()  # every writer of this run is stopped: the save path is free
            self.plane.close()
            if self.ctx.launch.join_file:
                Path(self.ctx.launch.join_file).unlink(missing_ok=True)  # it holds the secret of a run that is over

    def _hand_out_credentials(self) -> None:
        """Write ``--join-file``, and say where workers started by hand connect and where their
        secret comes from (never the secret itself: stdout ends up in logs)."""
        if self.ctx.launch.join_file:
            JoinInfo(self.ctx.run_id, self.ctx.secret, self.plane.address, curve.enabled()).write(self.ctx.launch.join_file)
        if self.ctx.launch.embedded:
            return
        source = f"join file {self.ctx.launch.join_file}" if self.ctx.launch.join_file else self.secret_source
        how = f"--join-file {self.ctx.launch.join_file}" if self.ctx.launch.join_file else f"--controller {self.plane.address}"
        self.ctx.console.line(
            f"waiting for {self.ctx.launch.workers} worker(s) at {self.plane.address}, run {self.ctx.run_id}, secret from {source}: "
            f"python -m flodl.worker {how}"
        )

    def _open(self) -> None:
        self.plane.open(self._on_message)
        log.info("deadlines: %s", self.ctx.deadlines.describe())
        self.ctx.hooks.opened(self.plane.live_endpoint)
        # everything alive now (and torch's import, once the store opened: plane.py) lives as long as the
        # run: keep it out of the collector's full passes, which otherwise stall the event loop 60-170 ms
        # (1,000-rank bench)
        gc.freeze()

    def summary(self, exit_reason: str, exit_code: int) -> dict:
        """The run summary (also ``--summary-json`` and ``Trainer.run()``'s result)."""
        return summarize(
            exit_reason,
            exit_code,
            self.ctx,
            admission=self.admission,
            training=self.training,
            liveness=self.liveness,
            teardown=self.teardown,
        )

    # =========================================================== conductor

    async def _conduct(self) -> dict:
        run, admission, training = self.ctx.run, self.admission, self.training
        run.to(Phase.GATHERING)
        await run.until(
            lambda: len(self.ctx.members.workers) >= admission.expected_workers, self.ctx.launch.join_timeout_secs, "workers to connect"
        )
        admission.welcome_workers()
        self.ctx.startup.workers_up([w.host for w in self.ctx.members.workers.values()], admission.initial_world)
        run.to(Phase.JOINING)
        first = [r for r in range(admission.initial_world)]  # a worker arriving meanwhile waits to be admitted
        lost = lambda r: r in self.ctx.members.ranks and self.ctx.members.ranks[r].state is PeerState.DEAD  # noqa: E731  (died starting: the run goes on)
        await run.until(
            lambda: all(r in admission.hellos or lost(r) for r in first), self.ctx.launch.join_timeout_secs, "ranks to start and say hello"
        )
        built = sum(1 for r in first if not lost(r))
        if admission.task_info is not None:
            hello = admission.task_info
            self.ctx.startup.ranks_built(built, len(first), params=hello.param_count, samples=hello.dataset_len, grain=hello.grain)
        # before the group forms: a world the data cannot feed is refused at once
        warning = self._check_shares(built)
        await self.plane.store_open()  # opened on a thread meanwhile (plane.py): the welcome names its port
        admission.welcome_ranks()
        if any(lost(r) for r in first):
            reason = f"rank(s) {', '.join(str(r) for r in first if lost(r))} died while starting"
            self.ctx.members.new_generation(reason)
            self.liveness.regroup(reason)
        await run.until(
            lambda: all(self.ctx.members.ranks[r].state is PeerState.READY or lost(r) for r in first if r in self.ctx.members.ranks),
            self.ctx.launch.join_timeout_secs,
            "ranks to join the collective",
        )
        self.ctx.startup.group_formed(built, collective=self.plane.averaging is None)
        run.to(Phase.TRAINING)
        info = admission.task_info
        # every first rank said hello or died, and with none left the deaths have failed the run
        assert info is not None
        schedule = self._schedule(info)
        training.begin(info, schedule)
        total_epochs = training.total_epochs
        ranks = [r for r in sorted(self.ctx.members.ranks.values(), key=lambda r: r.rank) if r.rank not in admission.joiners]
        self.ctx.console.header(
            run_id=self.ctx.run_id,
            mode=str(self.ctx.config.elche.mode.name),
            task=self.ctx.launch.label,
            ranks=[f"rank{r.rank} {r.device}@{r.host}{_cores(admission.hellos.get(r.rank))}" for r in ranks],
            dataset_len=info.dataset_len,
            batch_size=info.batch_size,
            epochs=total_epochs,
            grain=info.grain,
            lr_factor=self.ctx.config.lr_factor(len(ranks)),  # the factor each first rank applies (RankWelcome.world_size)
            lr_scale_on=self.ctx.config.lr_scale_on,
            averaging=averaging_line(self.ctx.config),
            lr_scale_ratio=self.ctx.config.lr_scale_ratio,
        )
        if self.ctx.config.augment > 1 or self.ctx.config.epoch_splits > 1:
            self.ctx.console.line(
                f"  {self.ctx.launch.epochs} pass(es) of {schedule.pass_len} picks (each sample x{self.ctx.config.augment}), "
                f"{self.ctx.config.epoch_splits} epoch(s) per pass of ~{schedule.epoch_len(0)} samples"
            )
        if warning:
            self.ctx.console.line(f"flodl: warning: {warning}")
        run.mark_started()
        self.ctx.monitor.begin(
            training.description(self.ctx.run_id),
            {r.rank: (r.host, r.device) for r in self.ctx.members.ranks.values()},
            steps_per_epoch=max(1, schedule.epoch_len(0) // info.batch_size),
        )
        await self._run_windows()
        if training.evals_on and total_epochs - 1 not in training.eval_requests:
            # nothing was left to train (a resumed bundle that was complete): score it once all the same
            training.request_eval(total_epochs - 1)
        if training.evals_on:
            await run.until(lambda: total_epochs - 1 in training.evals, self.ctx.launch.eval_timeout_secs, "the final eval")
        final_save = None
        if self.ctx.checkpoints.stem and self.ctx.config.sync_fragments > 1:
            # fragments: the replicas are one consensus only after the Shutdown's full average, so
            # the final bundle is written on the way out, after it (docs/fragments.md)
            final_save = self.saving.final_on_shutdown()
        elif self.ctx.checkpoints.stem:
            await self.saving.checkpoint("final", call_fn=False, wait=True)
        run.mark_finished()
        training.flush_epoch_lines()
        await self.teardown.shutdown_peers(final_save)
        training.flush_epoch_lines(over=True)  # script mode: the last epoch's ends came before the scripts' Exiting
        if self.ctx.checkpoints.stem and not self.ctx.checkpoints.saved("final"):
            # trained, but the bundle on disk is not what it trained: not a success (docs/fault-tolerance.md)
            summary = self.summary("completed_unsaved", EXIT_UNSAVED)
            summary["failure"] = self.ctx.checkpoints.final_failure()
            self.ctx.console.done(summary)
            self.ctx.console.line(f"flodl: {summary['failure']}")
            return summary  # run_controller turns a non-zero exit_code into RunAborted, summary written
        failed = [e for e in training.evals.values() if e.error] if training.evals_on else []
        if failed and len(failed) == len(training.evals):
            # trained, but nothing says how well: not a plain success (the last error says why)
            summary = self.summary("completed, every eval failed", EXIT_EVALS_FAILED)
            summary["failure"] = f"every eval failed ({len(failed)} of {len(failed)}; the last: {failed[-1].error})"
            self.ctx.console.done(summary)
            self.ctx.console.line(f"flodl: {summary['failure']}")
            return summary  # run_controller turns a non-zero exit_code into RunAborted, summary written
        summary = self.summary("completed", 0)
        self.ctx.console.done(summary)
        return summary

    def _schedule(self, info: m.RankHello) -> Schedule:
        try:
            return Schedule(info.dataset_len, self.ctx.config.augment, self.ctx.config.epoch_splits, self.ctx.launch.epochs)
        except ValueError as exc:
            raise RunAborted(f"epoch_splits: {exc}", EXIT_CONFIG) from None

    def _check_shares(self, world: int) -> str | None:
        """Refuse (exit 2) a world the data cannot feed; return a warning for one it feeds thinly."""
        info = self.admission.task_info
        if info is None:  # every first rank died starting: the run fails on that
            return None
        # a shard is one position and a rank's batches are its own: only the shard count can be short
        refusal, warning = self._schedule(info).share_problem(1 if info.grain == "shard" else info.batch_size, world)
        if refusal:
            raise RunAborted(refusal, EXIT_CONFIG)
        return warning

    async def _run_windows(self) -> None:
        """Progressive dispatch: window after window until every epoch is trained.

        Cadence and Async keep two windows in flight on either backend: the
        next window is planned and sent while the current one trains, so a
        rank goes from one window's average straight into the next without a
        controller round trip (ElChe plans from timings one window old). Sync
        plans one at a time. A collective joiner drains the pipeline first:
        its group is rebuilt with nothing queued on any rank.
        """
        admission, training, averaging = self.admission, self.training, self.plane.averaging
        # workers that arrived while these started join at a boundary
        ranks = admission.training_ranks()
        # the longest accumulation of the ranks that start: Sync's rounds are whole accumulations of each
        accumulate = max((admission.hellos[r].accumulate_grad_batches for r in ranks if r in admission.hellos), default=1)
        loop = training.open_loop(ranks, self.resume.seed(), accumulate=accumulate)
        if self.resume.meta is not None:
            assert training.schedule is not None  # _conduct began training with it
            self.resume.apply(loop, training.task, training.schedule, training.total_epochs)
        if averaging is not None:

            def on_round(number: int, ms: float) -> None:
                loop.note_round(ms)
                self.liveness.cpu_round_done(number, ms)

            averaging.on_round = on_round
            loop.snapshots = averaging  # whose snapshot each round folded: a dead rank's last window (cadence.py _land)
        # deterministic: one window at a time too, so an epoch's RunEval reaches the eval rank
        # before its next window does, and scores exactly the average that closed the epoch
        depth = 1 if self.ctx.config.elche.mode.policy is ApplyPolicy.SYNC or self.ctx.config.deterministic else 2
        in_flight: list[int] = []
        plan_s = 0.0  # the last window's planning (and sending), in seconds
        while True:
            # a joiner on its way: plan one window at a time, so it waits for one boundary, not two (and on
            # the CPU backend the window it adopts is the next one, not the one after a window in flight)
            while len(in_flight) < (1 if admission.joiners else depth):
                if admission.admit_joiners(loop, in_flight):
                    break  # ready joiners wait for an empty pipeline
                if in_flight and loop.dispatcher.must_settle_first(loop.elche):
                    break  # the window that closes an epoch waits for what those in flight give back to it
                number = loop.window
                t0 = time.perf_counter()
                windows = loop.next_windows(self.ctx.clock())
                if windows is None:
                    break
                self.ctx.hooks.planned(number, len(windows), time.perf_counter() - t0)
                training.start_window(number, windows, first_in_flight=not in_flight)
                plan_s = time.perf_counter() - t0  # planned and sent: half of a window's fixed cost
                if loop.dispatcher.throttled:
                    self.ctx.monitor.throttled(number, loop.dispatcher.throttled, now_s=self.ctx.clock())
                in_flight.append(number)
                if loop.open_ended(number):
                    await training.end_when_timed(number)
                    break  # calibrate before planning ahead
            if not in_flight:
                if loop.finished:
                    return
                raise RunAborted("the dispatcher stalled with samples left and nothing in flight (a bug)", EXIT_FAILED)
            number = in_flight.pop(0)
            await training.until_window(number, lambda: training.reported(number), f"window {number}")  # noqa: B023 - awaited in this iteration
            reports, dead_batches = training.take_reports(number)
            t0 = time.perf_counter()
            closed = loop.on_reports(number, reports, self.ctx.clock(), dead_batches)
            training.settled(reports)
            self.ctx.hooks.settled(number, time.perf_counter() - t0)
            t1 = time.perf_counter()
            for stats in closed:
                self._finish_epoch(stats, number)
            epochs_s = time.perf_counter() - t1
            self.ctx.monitor.window_settled(number, reports, now_s=self.ctx.clock())
            self.ctx.monitor.event(
                "sync", f"window {number}: {sum(r.consumed for r in reports.values())} samples averaged", now_s=self.ctx.clock()
            )
            self.ctx.monitor.anchor_changed(loop.elche.anchor, now_s=self.ctx.clock(), counts=list(loop.elche.batch_counts))
            # what this window cost whatever the model (planning one, settling one; an epoch's close
            # and its checkpoint are the epoch's costs, not the window's): ElChe keeps it small
            loop.note_fixed((plan_s + time.perf_counter() - t0 - epochs_s) * 1000.0)
            if self.ctx.checkpoints.at_epoch_due(loop.dispatcher.next_epoch - 1):
                await self.saving.checkpoint("checkpoint", call_fn=False)

    def _finish_epoch(self, stats: EpochStats, window: int) -> None:
        """An epoch is fully trained and averaged (by ``window``): record it, ask for its eval
        and (when due) a checkpoint, print it."""
        self.training.finish_epoch(stats, window)
        if self.ctx.checkpoints.every_due(stats.epoch):
            self.saving.checkpoint_now("checkpoint", call_fn=True, files=bool(self.ctx.checkpoints.stem))
        self.training.flush_epoch_lines()

    # ============================================================ messages in

    def _on_message(self, identity: bytes, env: Envelope) -> None:
        msg = env.msg
        handler = self._handlers.get(type(msg))
        if handler is None:
            return  # a message we never act on in this direction
        ctx = self.ctx
        now = ctx.clock()
        self._follow_route(identity, env)
        rank = getattr(msg, "rank", None)
        members = ctx.members
        if rank is not None and rank >= 0 and type(msg) is not m.RankExited:
            if not self._is_rank_sender(rank, env.sender, msg):
                return
            members.seen_rank(rank, now)
        else:
            members.seen_worker(env.sender, now)
            if rank is None:
                members.seen_route(identity, now)
        handler(identity, env, msg)
        if self._observed:
            self.ctx.hooks.handled(msg)

    def _is_rank_sender(self, rank: int, sender: str, msg: Any) -> bool:
        """A rank message must be signed by the sender that said that rank's hello
        (sender names are authenticated; the connection it came on is not)."""
        info = self.ctx.members.ranks.get(rank)
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
        members = self.ctx.members
        peer = members.workers.get(env.sender) or members.by_sender.get(env.sender)
        if peer is None or not route_moves(peer.identity, identity, env):
            return
        log.info("%s now reaches us on another connection", env.sender)
        members.route_moved(peer, identity)
