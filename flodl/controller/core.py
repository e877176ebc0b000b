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
import os
import signal
import sys
import time
from typing import Any, Callable

import zmq

from .. import __version__, curve
from ..config import ApplyPolicy, AverageBackend, DdpRunConfig
from ..env import PARENT_PID, child_environ, credentials_env, new_run_id, new_run_secret
from ..checkpoint import CheckpointError, read_meta
from ..errors import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_RANK_LOST, EXIT_SAVED, EXIT_TASK_ERROR, RunAborted
from ..membership import Membership, PeerState, WorkerInfo, describe_exit, unrecoverable
from ..metrics import EpochStats
from ..protocol import messages as m
from ..protocol.codec import Envelope
from ..protocol.messages import PROTOCOL_VERSION
from ..proc import terminate_then_kill
from ..schedule import Schedule
from ..transport import ControlEndpoint, host_name, make_router
from ..dispatch import PROBE_BATCHES, PROBE_MIN_MS
from .averaging import CpuAveraging
from .cadence import CadenceLoop
from .checkpoints import SHUTDOWN_SAVE, Checkpointer
from .console import Console
from .launch import LaunchOptions
from ..monitor.hub import Monitor

log = logging.getLogger("flodl.controller")

HEARTBEAT_INTERVAL_S = 1.0
LIVENESS_TICK_S = 0.2
#: A collective error on one rank usually means a peer died; wait this long for
#: the death report so the message names the dead rank, not the witness.
COLLECTIVE_ERROR_GRACE_S = 1.0
#: Collective failures no death explains, rebuilt in place, before the run is stopped.
MAX_COLLECTIVE_RETRIES = 3
SHUTDOWN_WAIT_S = 40.0
ABORT_WAIT_S = 10.0
CHECKPOINT_WAIT_S = 120.0  # a rank writing a large model to slow storage
#: Open files the controller keeps for itself (sockets' mailboxes, the store, logs, the dashboard).
FD_RESERVE = 128


class Controller:
    """Runs one training run from start to summary (``await run()``)."""

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
        self.heartbeat_timeout_s = float(config.effective_heartbeat_timeout_secs)
        self.members = Membership(self.heartbeat_timeout_s)
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
        self.deaths_handled = 0
        self.recoveries: list[dict] = []  # every regroup: when, generation, survivors, why
        self._back: tuple[float, set[int]] | None = None  # a recovery waiting for every survivor's next batch
        self.eval_requests: dict[int, int] = {}  # epoch -> rank asked to score it
        self.checkpoints = Checkpointer(config, say=self.console.line)
        self.monitor = Monitor(config, say=self.console.line, clock=clock,
                               dashboard=None if launch.dashboard_port < 0 else (launch.bind, launch.dashboard_port))
        self.rank_rates: dict[int, float] = {}  # rank -> samples since the last progress line
        self._rates_at = 0.0
        self._drops_seen = 0  # dropped control frames already alerted
        self.data_stats: dict[int, dict[str, int]] = {}  # rank -> staging-tier totals (hits, fetches, bytes held)
        self.resume_meta: dict | None = None  # the bundle sidecar this run continues from
        self.shutdown_save: tuple[str, int] | None = None  # ShutdownWithSave: (stem, writer rank)
        self._storage_reminded = False
        self.started_at = 0.0
        self.finished_at = 0.0
        self._printed = 0  # epochs whose line is out
        self._fastest: int | None = None  # the elected eval rank under the Fastest policy
        # growing: ranks of workers that arrived while training, until admitted at a window boundary
        self.joiners: dict[int, float] = {}  # rank -> deadline to be ready
        self.joins: list[dict] = []  # every admission: when, generation, ranks, host
        self.initial_world = 0  # ranks the run started with (the LR factor every replica keeps)
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
                self.resume_meta = read_meta(self.config.resume_from)
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
            self.averaging = CpuAveraging(
                secret=self.secret, run_id=self.run_id, bind=self.launch.bind,
                timeout_s=float(self.config.snapshot_timeout_secs), clock=self.clock,
            )
            self.averaging.live = lambda: {r.rank for r in self.members.live_ranks()}
            self.averaging.start()
        log.info("controller listening on tcp://%s:%d (store port %d)", self.launch.bind, self.port, self.store.port)
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
        await self._until(lambda: all(r in self.hellos for r in first), self.launch.join_timeout_secs, "ranks to start and say hello")
        self._welcome_ranks()
        await self._until(lambda: all(self.members.ranks[r].state is PeerState.READY for r in first if r in self.members.ranks),
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
        if info.has_eval:
            await self._until(lambda: self.total_epochs - 1 in self.evals, self.launch.eval_timeout_secs, "the final eval")
        if self.checkpoints.stem:
            await self._checkpoint("final", call_fn=False, wait=True)
        self.finished_at = self.clock()
        self._flush_epoch_lines()
        await self._shutdown_peers()
        summary = self.summary("completed", 0)
        self.console.done(summary)
        return summary

    async def _run_windows(self) -> None:
        """Progressive dispatch: window after window until every epoch is trained.

        On the CPU backend (Cadence/Async) the next window is planned and sent
        while the current one trains (two in flight): ranks never wait for the
        average, so they must never wait for their next plan either.
        """
        ranks = self._training_ranks()  # workers that arrived while these started join at a boundary
        self.cadence = loop = CadenceLoop(
            self.config, ranks, dataset_len=self.task_info.dataset_len, batch_size=self.task_info.batch_size,
            epochs=self.total_epochs, seed=self._seed(), global_step=self.global_step, schedule=self.schedule,
        )
        if self.resume_meta is not None:
            self._resume(loop)
        if self.averaging is not None:
            self.averaging.on_round = lambda number, ms: loop.note_round(ms)
        policy = self.config.elche.mode.policy
        depth = 2 if self.averaging is not None and policy is not ApplyPolicy.SYNC else 1
        in_flight: list[int] = []
        while True:
            while len(in_flight) < depth:
                self._admit_joiners(loop, in_flight)
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
                self._finish_epoch(stats)
            self.monitor.window_settled(number, reports, now_s=self.clock())
            self.monitor.event("sync", f"window {number}: {sum(r.consumed for r in reports.values())} samples averaged", now_s=self.clock())
            self.monitor.anchor_changed(loop.elche.anchor, now_s=self.clock(), counts=list(loop.elche.batch_counts))
            self.global_step = loop.global_step
            if self.checkpoints.at_epoch_due(loop.dispatcher.next_epoch - 1):
                await self._checkpoint("checkpoint", call_fn=False)

    async def _end_when_timed(self, number: int, loop: CadenceLoop) -> None:
        """Calibration window: end it once every rank has timed a few batches."""
        start = self.clock()

        def timed() -> bool:
            waiting = loop.waiting_on(number)
            done = waiting <= set(self.window_reports.get(number, {}))  # grants ran out first
            counts = [self.window_batches.get(r, 0) for r in waiting]
            enough = min(counts, default=PROBE_BATCHES) >= PROBE_BATCHES and (self.clock() - start) * 1000 >= PROBE_MIN_MS
            return done or enough

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

    def _finish_epoch(self, stats: EpochStats) -> None:
        """An epoch is fully trained and averaged: record it, ask for its eval, print it."""
        self.history.append(stats)
        if self.task_info.has_eval and self._eval_due(stats.epoch):
            self._request_eval(stats.epoch)
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

    def _request_eval(self, epoch: int) -> None:
        """The eval rank scores the averaged model, then takes its next plan."""
        rank = self._eval_rank()
        self.eval_requests[epoch] = rank
        self._send_rank(rank, m.RunEval(epoch=epoch, final=epoch == self.total_epochs - 1))

    # ========================================================= checkpoints

    def _seed(self) -> int:
        """A resumed run keeps the saved run's shuffle, whatever --seed says."""
        return int(self.resume_meta["coverage"]["seed"]) if self.resume_meta is not None else self.launch.seed

    def _resume(self, loop: CadenceLoop) -> None:
        """Continue the bundle's trajectory: only what it had not trained is planned."""
        meta, info = self.resume_meta, self.task_info
        cov = meta["coverage"]
        for field_name, mine in (("dataset_len", info.dataset_len), ("batch_size", info.batch_size)):
            if int(cov[field_name]) != mine:
                raise RunAborted(f"resume_from {self.config.resume_from}: the bundle was saved with {field_name} "
                                 f"{cov[field_name]}, this task has {mine}; resume the same task", EXIT_CONFIG)
        if int(cov["epochs"]) != self.total_epochs:
            log.warning("resume: the bundle planned %s epochs, this run %d", cov["epochs"], self.total_epochs)
        loop.restore(meta)
        self._remind_shared_storage()
        self.global_step = loop.global_step
        for field_name, mine in (("augment", self.config.augment), ("epoch_splits", self.config.epoch_splits)):
            if int(cov.get(field_name, 1)) != mine:
                raise RunAborted(f"resume_from {self.config.resume_from}: the bundle was saved with {field_name} "
                                 f"{cov.get(field_name, 1)}, this run has {mine}; resume with the same schedule", EXIT_CONFIG)
        left = sum(s for item in cov["open"] for _, s in item["uncovered"])
        left += sum(self.schedule.epoch_len(e) for e in range(int(cov["next_epoch"]), self.total_epochs))
        self.console.line(f"resuming {self.config.resume_from}: epoch {meta['epoch']}, global step {meta['global_step']}, "
                          f"{left:,} samples left to train ({meta['save_reason']})")

    def _trajectory(self) -> dict:
        """Where the run stands now, for a sidecar; coverage first, before parameters move on."""
        loop = self.cadence
        return {
            "epoch": loop.lowest_open_epoch, "global_step": loop.global_step, "sync_round": loop.syncs,
            "world_at_save": len(self.members.live_ranks()), "mode": self.config.elche.mode.name,
            "run_id": self.run_id, "flodl_version": __version__, "param_count": self.task_info.param_count,
            "elche_state": loop.elche.state_dict(), "coverage": loop.coverage(),
        }

    def _remind_shared_storage(self) -> None:
        hosts = {w.host for w in self.members.workers.values()}
        if len(hosts) > 1 and not self._storage_reminded:
            self._storage_reminded = True
            self.console.line(f"note: the bundle {self.checkpoints.stem or self.config.resume_from} is written by a rank on its "
                              "host and the sidecar by the controller on this one: it must be on storage every host sees")

    def _checkpoint_now(self, reason: str, *, call_fn: bool, files: bool = True) -> int:
        """Ask the elected rank for a checkpoint; returns its version."""
        self._remind_shared_storage()
        rank = self._eval_rank()
        epoch = self.cadence.lowest_open_epoch
        msg = self.checkpoints.request(rank=rank, reason=reason, epoch=epoch, meta=self._trajectory(), call_fn=call_fn, files=files)
        self._send_rank(rank, msg)
        return msg.version

    async def _checkpoint(self, reason: str, *, call_fn: bool, wait: bool = False) -> None:
        version = self._checkpoint_now(reason, call_fn=call_fn)
        if wait:
            await self._until(lambda: not self.checkpoints.waiting(version), CHECKPOINT_WAIT_S, "the checkpoint to be written")

    def _h_checkpoint_done(self, identity: bytes, env: Envelope, msg: m.CheckpointDone) -> None:
        if self.checkpoints.on_done(msg):
            last = self.checkpoints.written[-1]
            self.console.line(f"checkpoint ({last['reason']}) at epoch {last['epoch']} -> {last['stem']}.fdl/.optim/.meta.json")
            now = self.clock()
            self.monitor.span("checkpoint", start_s=now - msg.elapsed_ms / 1000.0, end_s=now, rank=msg.rank, args={"reason": last["reason"]})
            self.monitor.event("checkpoint", f"checkpoint ({last['reason']}) at epoch {last['epoch']} written by rank {msg.rank}", rank=msg.rank, now_s=now)
        self._changed.set()

    def _save_and_stop(self, message: str, reason: str, code: int = EXIT_SAVED) -> None:
        """ShutdownWithSave: the run stops here; a survivor writes the bundle on its way out."""
        self._remind_shared_storage()
        rank = self._eval_rank()
        self.checkpoints.request_shutdown_save(rank=rank, reason=reason, meta=self._trajectory())
        self.shutdown_save = (self.checkpoints.stem, rank)
        self._fail(message, code)

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
                self._fail(f"timed out after {timeout_s:g} s waiting for {what} ({self.members.assess(self.clock()).reason})", EXIT_RANK_LOST)
                continue
            self._changed.clear()
            try:
                async with asyncio.timeout(0.5):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def _fail(self, message: str, code: int) -> None:
        """Latch the run's failure (the first one wins) and wake the conductor."""
        if self.failure is None:
            log.error("%s", message)
            self.failure = RunAborted(message, code)
        self._changed.set()

    def _on_signal(self, sig: int) -> None:
        message = f"interrupted by {signal.Signals(sig).name}"
        if self.checkpoints.stem and self.phase == "training" and self.cadence is not None and self.failure is None:
            self._save_and_stop(message, "interrupted", EXIT_INTERRUPTED)  # Ctrl-C keeps the work: resume later
        else:
            self._fail(message, EXIT_INTERRUPTED)

    # ============================================================ welcome

    def _welcome_workers(self) -> None:
        for worker in self.members.workers.values():
            self._assign_ranks(worker)
        self.initial_world = self._next_rank
        devices = {d.split(":")[0] for w in self.members.workers.values() for d in w.devices}
        if len(devices) > 1 and self.averaging is None:
            self._fail(
                f"ranks mix device types {sorted(devices)}: the collective backend needs one type; "
                "use a Cpu* mode (e.g. --mode cpu-cadence) to average through the controller",
                EXIT_CONFIG,
            )
            return
        for worker in self.members.workers.values():
            self._send_worker_welcome(worker)
        self._changed.set()

    def _assign_ranks(self, worker: WorkerInfo) -> None:
        """Number ``worker``'s ranks from the next unused number and expect them (silence counts from now)."""
        first = self._next_rank
        worker.ranks = list(range(first, first + len(worker.devices)))
        self._next_rank += len(worker.devices)
        now = self.clock()
        for rank, device in zip(worker.ranks, worker.devices):
            self.members.expect_rank(rank, worker.host, device, now)
        # every worker and rank holds a connection here, and every rank one to the store (or the bulk plane)
        need = 2 * self._next_rank + len(self.members.workers) + FD_RESERVE
        if self.fd_limit and need > self.fd_limit and not self._fd_warned:
            self._fd_warned = True
            self.console.line(f"warning: {self._next_rank} ranks on {len(self.members.workers)} workers need about {need} open files in the "
                              f"controller, its limit is {self.fd_limit}: peers past it cannot connect (raise the hard limit, ulimit -Hn)")

    def _send_worker_welcome(self, worker: WorkerInfo) -> None:
        relay = self._relays(worker)
        if relay:
            self.averaging.admit_relay(worker.identity, worker.ranks)
        self.endpoint.send(
            m.WorkerWelcome(ranks=worker.ranks, world_size=self._next_rank, task=self.launch.task, heartbeat_timeout_s=self.heartbeat_timeout_s,
                            bulk_port=self.averaging.port if self.averaging is not None else 0, bulk_relay=relay),
            worker.identity,
        )

    def _relays(self, worker: WorkerInfo) -> bool:
        """Does ``worker`` pre-average its ranks (CPU backend, two ranks or more, on another host)?

        Ranks on this host reach the averager through shared memory already.
        ``FLODL_BULK_RELAY=off`` sends every rank's snapshot here, ``always``
        relays on this host too (benchmarks and tests compare).
        """
        setting = os.environ.get("FLODL_BULK_RELAY", "on").lower()
        if self.averaging is None or len(worker.ranks) < 2 or setting in ("off", "0", "no"):
            return False
        return setting == "always" or worker.host != host_name()

    def _check_hello(self, hello: m.RankHello) -> str | None:
        """Why ``hello`` cannot join this run, or None."""
        if hello.versions.get("protocol") != str(PROTOCOL_VERSION):
            return f"protocol {hello.versions.get('protocol')} != controller's {PROTOCOL_VERSION}"
        if hello.versions.get("flodl") != __version__:
            return f"flodl {hello.versions.get('flodl')} != controller's {__version__}"
        first = self.task_info
        if first is None:
            return None
        checks = [
            ("model signature", hello.model_signature, first.model_signature),
            ("dataset length", hello.dataset_len, first.dataset_len),
            ("shuffle signature (torch RNG differs)", hello.shuffle_signature, first.shuffle_signature),
            ("batch size", hello.batch_size, first.batch_size),
        ]
        for what, mine, theirs in checks:
            if mine != theirs:
                return f"its {what} {mine} differs from rank {first.rank}'s {theirs}"
        return None

    def _welcome_ranks(self) -> None:
        for rank in range(self.initial_world):
            self._send_rank(rank, self._rank_welcome(rank, late=False))
            if self.averaging is not None:
                self.averaging.admit(self.members.ranks[rank].identity, rank)

    def _rank_welcome(self, rank: int, *, late: bool) -> m.RankWelcome:
        """A late rank gets the world the run started with (so its LR factor matches
        its peers'); its collective membership comes with the Regroup that admits it."""
        return m.RankWelcome(
            rank=rank,
            world_size=self.initial_world,
            generation=self.members.generation,
            store_host=self.launch.advertise_host,
            store_port=self.store.port,
            store_prefix=f"{self.run_id}/gen{self.members.generation}",
            collective_timeout_s=self.heartbeat_timeout_s,
            config=self.config.to_dict(),
            seed=self._seed(),  # a resumed run keeps the bundle's shuffle on every rank
            bulk_port=self.averaging.port if self.averaging is not None else 0,
            late=late,
            shm_probe=self.averaging.probe_path if self.averaging is not None else "",
            shm_nonce=self.averaging.probe_nonce if self.averaging is not None else "",
        )

    # ============================================================ handlers

    def _on_message(self, identity: bytes, env: Envelope) -> None:
        now = self.clock()
        msg = env.msg
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return  # a message we never act on in this direction
        rank = getattr(msg, "rank", None)
        if rank is not None and rank >= 0 and type(msg) is not m.RankExited:
            if not self._is_rank_sender(rank, identity, msg):
                return
            self.members.seen_rank(rank, now)
        else:
            self.members.seen_worker(env.sender, now)
            if rank is None:
                self._seen_by_identity(identity, now)
        getattr(self, handler)(identity, env, msg)

    def _is_rank_sender(self, rank: int, identity: bytes, msg: Any) -> bool:
        """A rank message must come from the identity that said that rank's hello."""
        info = self.members.ranks.get(rank)
        if info is None:
            return False
        if isinstance(msg, m.RankHello):
            return True
        if isinstance(msg, m.RankError) and not info.identity:
            return True  # it failed before its hello (building the task): say so now, not at a timeout
        return info.identity == identity

    def _seen_by_identity(self, identity: bytes, now: float) -> None:
        info = self.members.by_identity.get(identity)
        if info is not None:
            info.last_seen = now

    def _h_worker_hello(self, identity: bytes, env: Envelope, msg: m.WorkerHello) -> None:
        problem = self._worker_problem(env.sender, msg)
        if problem:
            self.endpoint.send(m.Reject(reason=problem), identity)
            if self.phase in ("joining", "training"):
                self.console.line(f"refused a worker on host {msg.host} (pid {msg.pid}): {problem}")
            return
        worker = WorkerInfo(env.sender, identity, msg.host, msg.pid, list(msg.devices))
        self.members.add_worker(worker, self.clock())
        if self.phase in ("joining", "training"):
            self._grow(worker)
        self._changed.set()

    def _worker_problem(self, sender: str, msg: m.WorkerHello) -> str | None:
        """Why a worker cannot join now, or None (during gathering, or to grow a training run)."""
        if sender in self.members.workers:
            return "this worker already joined"
        if msg.versions.get("protocol") != str(PROTOCOL_VERSION):
            return f"protocol {msg.versions.get('protocol')} != {PROTOCOL_VERSION}"
        if not msg.devices:
            return "no devices"
        if self.phase in ("starting", "gathering"):
            return None
        if self.phase not in ("joining", "training") or self.failure is not None:
            return f"the run is {self.phase}; a worker can join while it starts or trains"
        if self.config.elche.partition_ratios is not None:
            return "partition_ratios fixes the world size; this run cannot grow"
        if self.averaging is not None and self.initial_world < 2:
            return "a one-rank Cpu* run does not average, so it cannot take a joiner; start it with two ranks to let it grow"
        kinds = {d.split(":")[0] for d in msg.devices} | {r.device.split(":")[0] for r in self.members.live_ranks()}
        if len(kinds) > 1 and self.averaging is None:
            return f"its devices {list(msg.devices)} mix device types with the run's; the collective backend needs one type"
        return None

    def _grow(self, worker: WorkerInfo) -> None:
        """A worker arrived while training: number its ranks above every rank so far
        and start them; they join at a window boundary once ready (``_admit_joiners``)."""
        self._assign_ranks(worker)
        deadline = self.clock() + self.launch.join_timeout_secs
        for rank in worker.ranks:
            self.joiners[rank] = deadline
        self.console.line(f"worker on host {worker.host} joins: starting rank(s) {worker.ranks} on {', '.join(worker.devices)}")
        self._send_worker_welcome(worker)

    def _h_rank_hello(self, identity: bytes, env: Envelope, msg: m.RankHello) -> None:
        info = self.members.ranks[msg.rank]
        if info.identity and info.identity != identity:
            return  # a second process claiming a rank that already said hello
        problem = self._check_hello(msg)
        if problem:
            self.endpoint.send(m.Reject(reason=problem), identity)
            if msg.rank in self.joiners:
                self._drop_joiner(msg.rank, problem)  # a bad latecomer never stops a training run
            else:
                self._fail(f"rank {msg.rank} on host {msg.host} (pid {msg.pid}) cannot join: {problem}", EXIT_TASK_ERROR)
            return
        info.identity, info.host, info.pid, info.device = identity, msg.host, msg.pid, msg.device
        self.members.by_identity[identity] = info
        self.hellos[msg.rank] = msg
        if self.task_info is None:
            self.task_info = msg
        if msg.rank in self.joiners:
            self._send_rank(msg.rank, self._rank_welcome(msg.rank, late=True))
        self._changed.set()

    def _h_rank_ready(self, identity: bytes, env: Envelope, msg: m.RankReady) -> None:
        self.members.ranks[msg.rank].state = PeerState.READY
        self._changed.set()

    def _h_batch_done(self, identity: bytes, env: Envelope, msg: m.BatchDone) -> None:
        if self._back is not None:
            since, waiting = self._back
            waiting.discard(msg.rank)
            if not waiting:
                self.recoveries[-1]["training_again_s"] = self.clock() - since
                self._back = None
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

    def _h_rank_error(self, identity: bytes, env: Envelope, msg: m.RankError) -> None:
        info = self.members.ranks[msg.rank]
        if msg.rank in self.joiners:
            self._drop_joiner(msg.rank, f"failed during {msg.stage}: {msg.error}")
            return
        if msg.stage == "collective":
            # usually a symptom of a peer's death: give the death report a moment to arrive
            if self.collective_error is None and msg.generation >= self.members.generation:
                self.collective_error = (self.clock(), msg.rank, msg)
            return
        misconfigured = msg.stage in ("resume", "config")  # a bad bundle or option: no traceback needed
        if self.failure is None and not misconfigured:
            sys.stderr.write(f"--- traceback from {info.where()} ---\n{msg.detail}\n")
        self._fail(f"{info.where()} failed during {msg.stage}: {msg.error}", EXIT_CONFIG if misconfigured else EXIT_TASK_ERROR)

    def _h_rank_exited(self, identity: bytes, env: Envelope, msg: m.RankExited) -> None:
        worker = self.members.workers.get(env.sender)
        if worker is None or worker.identity != identity or msg.rank not in worker.ranks:
            self.endpoint.drops["unauthorized"] += 1  # only a rank's own worker may report its exit
            return
        if self.phase in ("shutting down", "aborting", "done"):
            # we told it to go: leaving now is not a death, whatever the code
            info = self.members.ranks.get(msg.rank)
            if info is not None:
                info.exit_code = msg.code
                self.members.rank_left(msg.rank)
            self._changed.set()
            return
        info = self.members.rank_exited(msg.rank, msg.code)
        if info is not None and info.pid == 0:
            info.pid = msg.pid
        self._judge()

    def _h_exiting(self, identity: bytes, env: Envelope, msg: m.Exiting) -> None:
        if msg.rank >= 0:
            self.members.rank_left(msg.rank)
            if msg.digest:
                self.final_digests[msg.rank] = msg.digest
        else:
            worker = self.members.workers.get(env.sender)
            if worker is not None:
                worker.exited = True
        self._changed.set()

    def _h_ping(self, identity: bytes, env: Envelope, msg: m.Ping) -> None:
        self.endpoint.send(m.Pong(nonce=msg.nonce, sent_at=msg.sent_at), identity)

    def _h_heartbeat(self, identity: bytes, env: Envelope, msg: m.Heartbeat) -> None:
        pass  # liveness was recorded in _on_message

    # ============================================================ liveness

    async def _liveness(self) -> None:
        """Beat to every peer every second; judge silence and deaths several times a second."""
        next_beat = 0.0
        while True:
            now = self.clock()
            if now >= next_beat:
                frame = self.endpoint.writer.encode(m.Heartbeat(step=self.global_step, sent_at=time.time()))
                for identity in self._peer_identities():
                    self.endpoint.send_frame(frame, identity)
                next_beat = now + HEARTBEAT_INTERVAL_S
                self._report_drops()
            self._judge()
            await asyncio.sleep(LIVENESS_TICK_S)

    def _report_drops(self) -> None:
        """Frames dropped (forged, malformed, unauthorized) since the last beat: a control_drop alert."""
        total = sum(self.endpoint.drops.values())
        if total > self._drops_seen:
            detail = ", ".join(f"{k} {v}" for k, v in sorted(self.endpoint.drops.items()))
            self.monitor.event("control_drop", f"{total - self._drops_seen} control frame(s) dropped (so far: {detail})", now_s=self.clock())
            self._drops_seen = total

    def _peer_identities(self) -> list[bytes]:
        ids = [w.identity for w in self.members.workers.values() if not w.exited]
        ids += [r.identity for r in self.members.ranks.values() if r.identity and r.state not in (PeerState.EXITED, PeerState.DEAD)]
        return ids

    def _judge(self) -> None:
        """Turn deaths, silence and lingering collective errors into a failure."""
        if self.phase in ("shutting down", "aborting", "done"):
            return
        now = self.clock()
        # a rank that never said hello is judged by the join timeout, not by heartbeats
        for info in self.members.ranks.values():
            if not info.identity and info.death is None:
                info.last_seen = now
        verdict = self.members.assess(now)
        if not verdict.healthy:
            self._on_deaths(set(verdict.dead), verdict.reason)
            return
        for worker in self.members.silent_workers(now):
            if any(r.state is not PeerState.DEAD for r in self.members.ranks.values() if r.rank in worker.ranks):
                continue  # its ranks are judged on their own heartbeats
            worker.exited = True
        if self.collective_error is not None and now - self.collective_error[0] > COLLECTIVE_ERROR_GRACE_S:
            # a collective failed and no death explains it: rebuild it among the same ranks
            _, rank, err = self.collective_error
            self.collective_error = None
            self.collective_retries += 1
            if self.collective_retries > MAX_COLLECTIVE_RETRIES:
                self._fail(f"{self.members.ranks[rank].where()} saw its collective fail {self.collective_retries} times: {err.error}", EXIT_RANK_LOST)
                return
            self.members.generation += 1
            self._regroup(f"{self.members.ranks[rank].where()} saw its collective fail: {err.error}")

    def _on_deaths(self, dead: set[int], reason: str) -> None:
        """Ranks died: go on without them if the run can, else stop (saving if asked)."""
        for rank in sorted(dead & set(self.joiners)):
            self._drop_joiner(rank, self.members.ranks[rank].death or "died")  # never admitted: nothing to recover
        dead -= set(self.joiners) | {r for r in dead if r not in self.members.ranks}
        if not dead:
            return
        if self.phase != "training" or self.cadence is None:
            self._fail(f"{reason}. The run stopped before training began.", EXIT_RANK_LOST)
            return
        dead_total = sum(1 for r in self.members.ranks.values() if r.state is PeerState.DEAD)
        survivors = sorted(r.rank for r in self.members.live_ranks())
        problem = unrecoverable(self.config, len(self.members.ranks), dead_total, len(survivors))
        if problem:
            code, why = problem
            if self.checkpoints.stem and survivors:
                self._save_and_stop(f"{reason}. {why}", code)
            else:
                self._fail(f"{reason}. {why}", EXIT_RANK_LOST)
            return
        self._fence(dead, reason)
        for lost in [s for r in dead for s in self.checkpoints.rank_died(r)]:
            self.console.line(f"rank {lost.rank} died before writing checkpoint {lost.version}; asking another rank")
            self._checkpoint_now(lost.reason, call_fn=False, files=bool(lost.stem))
        self.collective_error = None  # the death explains it
        self.deaths_handled += len(dead)
        for rank in sorted(dead):
            self.monitor.event("rank_lost", f"{self.members.ranks[rank].where()} {self.members.ranks[rank].death}", rank=rank, now_s=self.clock())
        self.cadence.remove_ranks(dead)
        self._regroup(reason)
        self.console.line(f"lost {reason}; continuing with {len(survivors)} rank(s) (generation {self.members.generation})")
        for epoch, rank in list(self.eval_requests.items()):
            if rank in dead and epoch not in self.evals:
                self._request_eval(epoch)  # its eval died with it: ask the next rank
        self._changed.set()

    def _fence(self, dead: set[int], reason: str) -> None:
        """A rank declared dead whose process may live on (hung, stopped, cut off)
        is killed by its worker: it must never rejoin a world that went on without it."""
        for rank in dead:
            info = self.members.ranks[rank]
            if info.exit_code is not None:
                continue  # its worker saw it exit: nothing to kill
            for worker in self.members.workers.values():
                if rank in worker.ranks and not worker.exited:
                    self.endpoint.send(m.Fence(rank=rank, reason=reason[:500]), worker.identity)

    def _regroup(self, reason: str) -> None:
        """Tell the survivors of the collective backend to rebuild it (CPU ranks need nothing)."""
        survivors = self._training_ranks()
        self.recoveries.append({"at_s": self.clock() - self.started_at, "unix_time": time.time(), "generation": self.members.generation,
                                "survivors": survivors, "reason": reason, "training_again_s": None})
        # "training again" = every survivor has reported a batch since this moment
        self._back: tuple[float, set[int]] | None = (self.clock(), set(survivors))
        if self.averaging is not None:
            return  # the CPU backend has no group: rounds simply stop waiting for the dead
        msg = m.Regroup(generation=self.members.generation, members=survivors,
                        store_prefix=f"{self.run_id}/gen{self.members.generation}", reason=reason[:500],
                        sync_from=-1, first_round=-1)
        self._send_ranks(survivors, msg)

    def _training_ranks(self) -> list[int]:
        """The ranks in the collective and the plans: live, and admitted (not joiners)."""
        live = {r.rank for r in self.members.live_ranks()} - set(self.joiners)
        if self.cadence is not None:
            live &= set(self.cadence.ranks)
        return sorted(live)

    def _admit_joiners(self, loop: CadenceLoop, in_flight: list[int]) -> None:
        """Growing, at a window boundary: admit the joiners that are ready.

        Collective backend: only between windows (no rank inside an average);
        a Regroup names the grown world and the lowest surviving rank, whose
        parameters (the consensus) every member takes after rebuilding the
        group. CPU backend: the joiners are expected from the next window's
        first averaging round, whose average they take whole before training.
        Either way ElChe plans them from the next window on.
        """
        now = self.clock()
        for rank, deadline in list(self.joiners.items()):
            if now > deadline and self.members.ranks[rank].state is not PeerState.READY:
                self._drop_joiner(rank, f"not ready within join_timeout_secs ({self.launch.join_timeout_secs:g} s)")
        ready = sorted(r for r in self.joiners if self.members.ranks[r].state is PeerState.READY)
        if self.averaging is not None:
            # a relaying host joins whole: its relay sends one snapshot for all its ranks, from one first round
            waiting = {self.averaging.relayed[r] for r in self.joiners
                       if r in self.averaging.relayed and self.members.ranks[r].state is not PeerState.READY}
            ready = [r for r in ready if self.averaging.relayed.get(r) not in waiting]
        if not ready or loop.dispatcher.finished or (self.averaging is None and in_flight):
            return
        old = list(loop.ranks)
        loop.add_ranks(ready)
        for rank in ready:
            del self.joiners[rank]
        self.members.generation += 1
        generation, members = self.members.generation, list(loop.ranks)
        hosts = sorted({self.members.ranks[r].host for r in ready})
        reason = f"rank(s) {', '.join(map(str, ready))} on {', '.join(hosts)} joined"
        if self.averaging is None:
            msg = m.Regroup(generation=generation, members=members, store_prefix=f"{self.run_id}/gen{generation}",
                            reason=reason, sync_from=old[0], first_round=-1)
            targets = members
        else:
            for rank in ready:
                self.averaging.admit(self.members.ranks[rank].identity, rank, from_round=loop.round_base)
            msg = m.Regroup(generation=generation, members=members, store_prefix="", reason=reason,
                            sync_from=-1, first_round=loop.round_base)
            targets = ready  # the others' CPU rounds simply start expecting the joiners
        self._send_ranks(targets, msg)
        self.joins.append({"at_s": now - self.started_at, "unix_time": time.time(), "generation": generation,
                           "ranks": ready, "hosts": hosts, "world": len(members)})
        self.monitor.ranks_joined({r: (self.members.ranks[r].host, self.members.ranks[r].device) for r in ready}, now_s=now)
        self.console.line(f"{reason}; training with {len(members)} rank(s) (generation {generation})")

    def _drop_joiner(self, rank: int, why: str) -> None:
        """A joiner that cannot join leaves the run's books; its process is fenced."""
        self.joiners.pop(rank, None)
        self.hellos.pop(rank, None)
        info = self.members.ranks.pop(rank, None)
        if info is None:
            return
        self.members.by_identity.pop(info.identity, None)
        self.console.line(f"{info.where()} could not join the run: {why}")
        if info.exit_code is None:
            for worker in self.members.workers.values():
                if rank in worker.ranks and not worker.exited:
                    self.endpoint.send(m.Fence(rank=rank, reason=why[:500]), worker.identity)

    # ======================================================= embedded worker

    async def _embedded_worker(self) -> None:
        """Start the local worker and treat its unexpected exit as a failure."""
        cmd = [sys.executable, "-m", "flodl.worker", "--controller", self.address]
        if self.launch.nproc_per_node is not None:
            cmd += ["--nproc", str(self.launch.nproc_per_node)]
        if self.launch.devices:
            cmd += ["--devices", self.launch.devices]
        env = child_environ({**credentials_env(self.secret, self.run_id), PARENT_PID: str(os.getpid())})
        # its own session: a terminal's Ctrl-C reaches the controller alone, which
        # then stops everyone in order instead of racing the children's deaths
        self.worker_proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
        code = await self.worker_proc.wait()
        if self.phase not in ("shutting down", "aborting", "done"):
            self._fail(f"the local worker (pid {self.worker_proc.pid}) {describe_exit(code)} before the run finished", EXIT_RANK_LOST if code else EXIT_FAILED)

    # ============================================================ teardown

    def _broadcast_shutdown(self, msg: m.Shutdown) -> None:
        """To every worker and every rank that ever said hello, dead ones included:
        a rank we gave up on may still be listening and can exit on its own."""
        frame = self.endpoint.writer.encode(msg)
        identities = [w.identity for w in self.members.workers.values() if not w.exited]
        identities += [r.identity for r in self.members.ranks.values() if r.identity and r.state is not PeerState.EXITED]
        for identity in identities:
            self.endpoint.send_frame(frame, identity)

    def _send_rank(self, rank: int, msg: Any) -> None:
        self.endpoint.send(msg, self.members.ranks[rank].identity)

    def _send_ranks(self, ranks: list[int], msg: Any) -> None:
        """The same message to several ranks, signed once (a Regroup lists every
        member: signing it per rank made each death cost O(world²))."""
        frame = self.endpoint.writer.encode(msg)
        for rank in ranks:
            self.endpoint.send_frame(frame, self.members.ranks[rank].identity)

    async def _shutdown_peers(self) -> None:
        """Clean end: Shutdown to everyone, then wait (bounded) for them to leave."""
        self.phase = "shutting down"
        self._broadcast_shutdown(m.Shutdown(reason="run complete", abort=False, save_stem="", save_rank=-1))
        await self._wait_peers_gone(SHUTDOWN_WAIT_S)
        self.phase = "done"

    async def _abort(self, exc: RunAborted) -> None:
        """Failure: tell everyone to stop now, then wait (bounded) for them to go."""
        self.phase = "aborting"
        self.finished_at = self.finished_at or self.clock()
        self.console.failed(str(exc))
        stem, writer = self.shutdown_save or ("", -1)
        if self.endpoint is not None:
            self._broadcast_shutdown(m.Shutdown(reason=str(exc)[:500], abort=True, save_stem=stem, save_rank=writer))
        await self._wait_peers_gone(ABORT_WAIT_S + (CHECKPOINT_WAIT_S if stem else 0.0))
        if stem:
            if self.checkpoints.written and self.checkpoints.written[-1]["version"] == SHUTDOWN_SAVE:
                self.console.line(f"saved the run to {stem}.fdl/.optim/.meta.json; continue it with --resume-from {stem}")
            else:
                if exc.exit_code == EXIT_SAVED:
                    exc.exit_code = EXIT_RANK_LOST
                self.console.line(f"the save to {stem} did not complete: {'; '.join(self.checkpoints.failed) or 'no answer from rank ' + str(writer)}")
        exc.summary = self.summary(str(exc), exc.exit_code)
        self.phase = "done"

    async def _wait_peers_gone(self, timeout_s: float) -> None:
        def gone() -> bool:
            ranks = all(r.state in (PeerState.EXITED, PeerState.DEAD) or r.exit_code is not None for r in self.members.ranks.values())
            if self.worker_proc is not None:
                return ranks and self.worker_proc.returncode is not None
            return ranks and all(w.exited for w in self.members.workers.values())

        deadline = self.clock() + timeout_s
        while not gone() and self.clock() < deadline:
            self._changed.clear()
            try:
                async with asyncio.timeout(0.2):
                    await self._changed.wait()
            except TimeoutError:
                pass
        if not gone():
            log.warning("peers still running %.0f s after shutdown; stopping the local worker", timeout_s)

    # ============================================================= summary

    def summary(self, exit_reason: str, exit_code: int) -> dict:
        """The run summary (also ``--summary-json`` and ``Trainer.run()``'s result)."""
        wall = max(0.0, (self.finished_at or self.clock()) - self.started_at)
        samples = sum(s.samples for s in self.history)
        per_rank: dict[int, dict] = {}
        for rank, info in sorted(self.members.ranks.items()):
            per_rank[rank] = {"rank": rank, "host": info.host, "device": info.device, "pid": info.pid, "samples": 0, "batches": 0, "sync_ms": 0.0}
        for stats in self.history:
            for rank, part in stats.per_rank.items():
                row = per_rank.setdefault(rank, {"rank": rank, "samples": 0, "batches": 0, "sync_ms": 0.0})
                row["samples"] += part.samples
                row["batches"] += part.batches
                row["sync_ms"] += part.sync_ms
        last = self.history[-1] if self.history else None
        has_eval = self.task_info is not None and self.task_info.has_eval
        final_eval = self.evals.get(self.total_epochs - 1)
        eval_s = sum(e.elapsed_ms for e in self.evals.values()) / 1000.0
        train_wall = max(1e-9, wall - eval_s)
        return {
            "run_id": self.run_id,
            "mode": self.config.elche.mode.name,
            "world_size": self.members.world_size,
            "epochs": self.total_epochs,
            "epochs_completed": len(self.history),
            "wall_s": wall,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            # evals pause training on every rank; without them, what training alone sustained
            "eval_s": eval_s,
            "train_samples_per_s": samples / train_wall if samples else 0.0,
            "samples": samples,
            "per_rank": list(per_rank.values()),
            # a window that straddles two epochs counts in both epochs' rows, once here
            "syncs": self.cadence.syncs if self.cadence else 0,
            "final_loss": last.avg_loss if last else None,
            "final_eval": final_eval.value if final_eval else None,
            "eval_metric_name": self.task_info.eval_metric if has_eval else None,
            "history": [s.to_dict() for s in self.history],
            "deaths": [
                {"rank": r.rank, "host": r.host, "pid": r.pid, "reason": r.death}
                for r in self.members.ranks.values()
                if r.state is PeerState.DEAD
            ],
            "recoveries": self.recoveries,
            "joins": self.joins,
            "checkpoints": self.checkpoints.written,
            "regranted_samples": self.cadence.regranted if self.cadence else 0,
            "data": {str(r): row for r, row in sorted(self.data_stats.items())},
            "resumed_from": self.config.resume_from and str(self.config.resume_from),
            "final_digests": {str(r): d for r, d in sorted(self.final_digests.items())},
            "generation": self.members.generation,
            "exit_reason": exit_reason,
            "exit_code": exit_code,
            "dropped_frames": dict(self.endpoint.drops) if self.endpoint else {},
            "config": self.config.to_dict(),
            "cadence": self.cadence.telemetry() if self.cadence else None,
            "averaging": self.averaging.telemetry() if self.averaging else None,
        }


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
