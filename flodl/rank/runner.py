"""The rank process: one replica, trained on the slices the controller grants.

Lifecycle, in order: connect the link; build the task (model, optimizer,
dataset); say hello; on welcome join the collective and take rank 0's
parameters; then obey commands until ``Shutdown``: ``Window`` trains granted
slices of epoch permutations, averaging (through the collective or the
controller) as the window's stop rule says; ``RunEval`` scores the model.
Errors in the user's task are reported to the controller once with a
traceback (it stops the run); the rank then waits, bounded, for the
controller's Shutdown so no peer is left waiting on it.

Averaging across membership changes is regroup.py's, scoring evaluation.py's
(mixins of ``RankRunner``); how work ends early is outcomes.py's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Generator
from typing import Any

import torch
from torch.utils.data import TensorDataset

from .. import __version__, scalars
from ..checkpoint.bundle import CheckpointError, load_model, load_optimizer
from ..config import AverageBackend, DdpRunConfig
from ..config.deadlines import Deadlines
from ..config.env import (
    RankEnv,
    nccl_errors_raise,
    omp_threads_set,
    vram_pool_disabled,
)
from ..errors import (
    EXIT_CONFIG,
    EXIT_CONTROLLER_LOST,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_RANK_LOST,
    EXIT_TASK_ERROR,
    DeadlineExceeded,
    PeerLost,
    TaskError,
)
from ..host.gauges import ResourceSampler
from ..plan.metrics import epoch_rows
from ..plan.schedule import Schedule, shuffle_signature
from ..probes import Probes, for_rank
from ..shards import Shards
from ..task import Task
from ..taskspec import load_task
from ..taskspec import resolve as resolve_spec
from ..wire import curve
from ..wire import messages as m
from ..wire.messages import PROTOCOL_VERSION
from ..wire.transport import host_name
from .averager import Averager
from .collective import CollectiveAverager, Superseded, build_group
from .compiling import compile_model
from .cpu_average import BulkLink, CpuAverager
from .data import BatchSource, to_device
from .dataset_digest import dataset_digest
from .determinism import enter_build_phase, enter_training_phase
from .disk_stage import DiskStage
from .evaluation import Evaluating
from .flat import FlatModel, model_digest
from .handle import LrState, WorkerHandle
from .link import ControllerLink
from .loader import WorkerReads
from .norms import norm_layers
from .outcomes import NonFiniteLoss, Stop, UserError, is_collective_error, user_traceback
from .prefetch import CacheWarmer, Prefetcher
from .regroup import Regrouping
from .round_loop import Due, RoundLoop
from .saving import checkpoint, emergency_save
from .shard_source import ShardPicks, ShardSource
from .staging import RamCache, TieredSamples, VramPool, ram_budget, vram_budget
from .step_meter import StepMeter, StepRecord
from .step_reports import StepReports
from .update import Update, build_optimizer, check_precision, needs_update, train_state
from .window_stats import RoundStats

log = logging.getLogger(__name__)

#: Batches fetched ahead of training, for datasets not already in memory.
PREFETCH_DEPTH = 4
#: How long a window's end waits for its reader thread to leave a batch it is reading.
READER_JOIN_S = 30.0


def model_signature(model: torch.nn.Module) -> str:
    """Hash of parameter and buffer names, shapes and dtypes (not values)."""
    h = hashlib.sha256()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    return {
        "flodl": __version__,
        "protocol": str(PROTOCOL_VERSION),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
    }


class RankRunner(Regrouping, Evaluating):
    """Runs one rank from spawn to exit; ``run()`` returns the exit code."""

    # built by ``_build``, the first thing ``run()`` does; nothing reads them before
    task: Task
    model: torch.nn.Module

    def __init__(self, env: RankEnv, probes: Probes | None = None) -> None:
        self.env = env
        # tests and benchmarks look in here (faults, a simulated pace): no-ops in a real run
        self.probes = for_rank(env.rank) if probes is None else probes
        self.deadlines = Deadlines(heartbeat_timeout_s=env.heartbeat_timeout_s)  # the rest comes with the welcome
        self.rank = env.rank
        self.device = torch.device(env.device)
        self.link = ControllerLink(
            env.controller,
            secret=env.secret,
            run_id=env.run_id,
            sender=f"rank{env.rank}.{os.getpid()}",
            silence_timeout_s=self.deadlines.heartbeat_timeout_s,
            parent_pid=env.parent_pid,
            probes=self.probes,  # a lost Window or WindowDone is the link's to drop
        )
        self.terminated = False
        self.step_count = 0
        # set up by ``_join`` (None before: what an early exit checks); windows and evals come after it
        self.optimizer: Any = None  # the task's optimizer, or several as one (update.Optimizers)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.update: Update | None = None  # accumulation, mixed precision, schedulers: None on the plain step
        self.averager: Averager | None = None
        self.source: BatchSource | ShardSource | None = None
        self.max_grad_norm: float | None = None
        self.lr: LrState | None = None
        self.world_size = 1
        self.global_step = 0
        self.current_epoch = -1
        # every epoch of the run is an event this rank sees, in order, even one it trains no batch
        # of (docs/script-mode.md): from ``first_epoch`` (-1: its first batch's, a joiner) to the
        # run's last, ``epochs - 1`` (set at the welcome)
        self.first_epoch = -1
        self.epochs = 0
        self.config: DdpRunConfig | None = None
        self.deterministic = False  # the run's ``deterministic`` option (set at join)
        self._saved_on_shutdown = False
        self.generation = 0
        self.redoing = False  # an average failed and is to be redone in the next generation
        self.skip_redo = False  # ... unless the other survivors completed it (regroup.py)
        self.bg_redo = False  # a background average was dropped: the survivors' group repeats it (regroup.py)
        # the window whose background average was dropped since the last report (-1: none): the next
        # report says so, and the controller learns whether a dead peer's last window is in a replica
        self.dropped_window = -1
        self.peers: frozenset[int] = frozenset()  # the ranks of this rank's process group (regroup.py: did one leave?)
        self.deferred: collections.deque = collections.deque()  # commands taken early that wait their turn
        self.evals_taken = 0  # RunEvals scored (compared with the link's count between batches)
        # an open-ended (calibration) window: the controller ends it once every rank has timed a
        # few batches, so those reports go out at once, each step measured on its own
        self.probing = False
        self.graphed = False  # the model's forward replays CUDA graphs: each step marks its start (compiling.py)
        # Cadence's time quota: how far this rank's last window ran past its quota (it stops at the
        # first batch edge after it, a slow rank's batch later than a fast one's). Taken off the next
        # quota, so the ranks' windows stay aligned on the sum of their quotas instead of the slow
        # rank drifting behind by half a batch a window until the fast one waits for it.
        self.quota_debt_ms = 0.0
        self.position = 0  # the next average's place in the run: window << 16 | round (regroup.py compares them)
        self.welcome: m.RankWelcome | None = None
        self.handle = WorkerHandle(self)
        # a simulated slowdown paces every step, so each is measured on its own, even on a GPU
        self.meter = StepMeter(self.device, per_step=True if self.probes.paced_alone else None)
        self.reports = StepReports(self.rank)  # steps trained, not reported yet (step_reports.py)
        self.norm_layers: list = []  # BatchNorm layers to re-estimate before an eval (none until set up)
        self.norms_stale = False  # an average changed the model since they were last re-estimated
        self.batches_resident = False  # this window's batches come out on the device already (_rounds)
        self.resources = ResourceSampler([env.device])  # gauges for the monitor, summarised per window
        self._data_seen: dict[str, int] = {}  # staging-tier counters already reported
        self.warmer: CacheWarmer | None = None
        # what this rank opens on its way (link, sockets, segments, threads, files) registers its
        # clean-up here as it opens; run() closes them all, last opened first, on every exit path
        self.closing = contextlib.ExitStack()

    # ------------------------------------------------------------ lifecycle

    def run(self) -> int:
        self._trap_signals()
        with self.closing:
            self.link.start()
            self.closing.callback(self.link.close)
            self.resources.run_in_thread()
            self.closing.callback(self.resources.close)
            try:
                return self._run()
            except PeerLost as exc:
                log.error("rank %d: %s; exiting", self.rank, exc)
                self._emergency_save("controller_lost", str(exc))
                return EXIT_CONTROLLER_LOST

    def _run(self) -> int:
        try:
            hello = self._build()
        except UserError as exc:  # the task is unusable as written (an empty dataset): the user's, no traceback
            return self._fail(exc.stage, exc.original, EXIT_CONFIG)
        except Exception as exc:
            return self._fail("build", exc, EXIT_TASK_ERROR)
        self.link.send(hello)
        try:
            reply = self._await(m.RankWelcome, m.Reject, m.Shutdown, m.ShutdownWithSave)
        except Stop:
            return self._stopped()
        if isinstance(reply, m.Reject):
            log.error("rank %d refused by the controller: %s", self.rank, reply.reason)
            return EXIT_TASK_ERROR
        if isinstance(reply, (m.Shutdown, m.ShutdownWithSave)):
            return EXIT_OK if not reply.abort else EXIT_RANK_LOST
        try:
            self._join(reply)
        except Superseded:  # the run stopped while the first group gathered
            return self._stopped()
        except UserError as exc:
            return self._fail(exc.stage, exc.original, EXIT_TASK_ERROR)
        except CheckpointError as exc:  # resume_from names a bundle this model cannot load
            return self._fail("resume", exc, EXIT_CONFIG)
        except Exception as exc:
            return self._fail("collective", exc, EXIT_RANK_LOST)
        return self._serve()

    def _serve(self) -> int:
        """Obey commands until Shutdown."""
        while True:
            try:
                cmd = self._next()
            except Stop:
                return self._stopped()
            if isinstance(cmd, (m.Shutdown, m.ShutdownWithSave)):
                return self._shut_down(cmd)
            try:
                if isinstance(cmd, m.Window):
                    self._train_window(cmd)
                elif isinstance(cmd, m.RunEval):
                    self._evaluate(cmd)
                elif isinstance(cmd, m.SaveCheckpoint):
                    self._checkpoint(cmd)
            except Stop:
                return self._stopped()
            except NonFiniteLoss as exc:
                return self._fail("nonfinite", exc, EXIT_NONFINITE)
            except UserError as exc:
                return self._fail(exc.stage, exc.original, EXIT_TASK_ERROR)
            except DeadlineExceeded as exc:  # a CPU averaging round never came back
                return self._fail("collective", exc, EXIT_RANK_LOST)
            except RuntimeError as exc:
                # torch raises RuntimeError for collective failures (peer gone, timeout)
                stage = "collective" if is_collective_error(exc) else "train"
                return self._fail(stage, exc, EXIT_RANK_LOST if stage == "collective" else EXIT_TASK_ERROR)
            except Exception as exc:
                return self._fail("train", exc, EXIT_TASK_ERROR)

    def _completed_while_regrouping(self) -> bool:
        """A clean Shutdown is what stopped this rank, and it is still one of the run's members."""
        stop, regroup = self.link.shutdown, self.link.regroup
        if stop is None or stop.abort or self.terminated or self.link.lost is not None:
            return False
        return regroup is None or self.rank in regroup.members

    def _shut_down(self, cmd: m.Shutdown | m.ShutdownWithSave) -> int:
        """The controller's Shutdown: the last average lands (a clean end), the elected rank
        saves, and this rank says it leaves, with its parameters' digest."""
        if not cmd.abort:
            self._finish_accumulation()
            self._settle_background()  # the last average lands: replicas end equal
        self._save_on_shutdown(cmd)
        digest = "" if cmd.abort else model_digest(self.model)
        code = EXIT_RANK_LOST if cmd.abort else self._completed()
        self.link.send(m.Exiting(rank=self.rank, reason=cmd.reason, digest=digest))
        return code

    def _completed(self) -> int:
        """The run completed (a clean Shutdown, the last average landed): the exit code. The
        epochs this rank trained no batch of after its last one begin here (their ``epoch_fn``
        runs), so every rank reaches the run's last epoch; script mode also hands the script each
        remaining epoch's end, before this rank says it leaves."""
        try:
            self._enter_epoch(self.epochs - 1)
        except UserError as exc:
            log.error("rank %d: epoch_fn raised after the last batch:\n%s", self.rank, user_traceback(exc.original))
            return EXIT_TASK_ERROR
        return EXIT_OK

    def _emergency_save(self, reason: str, why: str) -> None:
        """No controller to coordinate a consensus bundle: keep this replica (with save_path)."""
        if self.config is None or not self.config.save_path or self.optimizer is None or self._saved_on_shutdown:
            return
        self._saved_on_shutdown = True
        self.link.hold_exit()  # never released: the process exits once the replica is written
        emergency_save(
            model=self.model,
            optimizer=self.optimizer,
            stem=self.config.save_path,
            rank=self.rank,
            reason=reason,
            why=why,
            epoch=max(0, self.current_epoch),
            global_step=self.global_step,
            train_state=self._train_state(),
        )

    def _stopped(self) -> int:
        if self._completed_while_regrouping():
            # the run completed while this rank waited on a new group (Regroup and Shutdown
            # crossed: a peer that read the Shutdown first never comes): end as the Shutdown says
            assert self.link.shutdown is not None
            return self._shut_down(self.link.shutdown)
        if self.terminated:
            # SIGTERM from our worker (its controller died, or a scheduler preempts the job)
            self._emergency_save("controller_lost" if self.link.lost else "interrupted", "terminated by SIGTERM")
            return EXIT_INTERRUPTED
        if self.link.lost:
            raise PeerLost(self.link.lost)
        if self.link.shutdown is not None:
            stop = self.link.shutdown
            if isinstance(stop, m.ShutdownWithSave) and stop.save_stem and stop.save_rank == self.rank:
                self._finish_accumulation()  # stopped between batches: the gradients are whole
            self._save_on_shutdown(self.link.shutdown)
        self.link.send(m.Exiting(rank=self.rank, reason="abort", digest=""))
        return EXIT_RANK_LOST

    def _checkpoint(self, cmd: m.SaveCheckpoint) -> None:
        """Write this rank's part of a consensus checkpoint between windows and say so."""
        self.link.doing("save")
        self._finish_accumulation()
        self._settle_background()  # the consensus includes the last window's average
        done = checkpoint(
            rank=self.rank,
            model=self.model,
            optimizer=self.optimizer,
            stem=cmd.stem,
            tag=cmd.tag,
            version=cmd.version,
            call_fn=self.task.checkpoint_fn if cmd.call_fn else None,
            handle=self.handle,
            train_state=self._train_state(),
        )
        self.probes.reach("save")  # tests: the files are written, the controller has not committed them
        self.link.send(done)

    def _save_on_shutdown(self, cmd: m.Shutdown | m.ShutdownWithSave) -> None:
        """ShutdownWithSave: the elected survivor writes the model and optimizer files."""
        if not isinstance(cmd, m.ShutdownWithSave) or cmd.save_rank != self.rank or self.optimizer is None or self._saved_on_shutdown:
            return
        self._saved_on_shutdown = True
        with self.link.saving():  # the link must not hard-exit us mid-write
            self.link.send(
                checkpoint(
                    rank=self.rank,
                    model=self.model,
                    optimizer=self.optimizer,
                    stem=cmd.save_stem,
                    tag=cmd.save_tag,
                    version=-1,
                    call_fn=None,
                    handle=self.handle,
                    train_state=self._train_state(),
                )
            )

    def _finish_accumulation(self) -> None:
        """A solo rank carries an accumulation across windows (no average ends them): a save steps it first."""
        if self.update is not None:
            self.update.window_end(self.global_step, flush=True)

    def _train_state(self) -> dict[str, Any] | None:
        """What the .optim file keeps beside the optimizer state (schedulers, scaler, the optimizers' split)."""
        return train_state(self.optimizers, self.update, lr_base=self.lr.base if self.lr is not None else None)

    def _fail(self, stage: str, exc: BaseException, code: int) -> int:
        """Report an error once, then wait (bounded) for the controller's verdict."""
        detail = user_traceback(exc)[-8000:]
        # the controller prints it, once for the run: this rank's own line would repeat it
        log.info("rank %d failed during %s: %s", self.rank, stage, exc)
        self.link.send(
            m.RankError(rank=self.rank, stage=stage, error=f"{type(exc).__name__}: {exc}"[:2000], detail=detail, generation=self.generation)
        )
        try:
            self._await(m.Shutdown, m.ShutdownWithSave, timeout_s=self.deadlines.verdict_wait_s)
        except (DeadlineExceeded, PeerLost, Stop):
            pass
        if self.link.shutdown is not None:
            self._save_on_shutdown(self.link.shutdown)  # the run stops, but what we hold is kept
        return code

    def _next(self, deadline: float | None = None) -> Any:
        """The next command, checking for SIGTERM while waiting.

        Raises:
            Stop: SIGTERM arrived. PeerLost: the controller is gone.
            DeadlineExceeded: ``deadline`` (monotonic) passed.
        """
        if self.deferred:
            return self.deferred.popleft()
        self.link.doing("idle")
        while True:
            if self.terminated:
                raise Stop
            if self.welcome is not None and self.link.shutdown is None and self._announced_after(self.generation):
                # join a new group while waiting, not at the next window: a survivor that lost the
                # failed average waits for this one in the new group, and the next window waits for it
                # (not once the run is over: a peer that read the Shutdown first would never come)
                self._maybe_regroup()
                self.link.doing("idle")
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                raise DeadlineExceeded("no command from the controller in time")
            try:
                return self.link.next_command(wait)
            except DeadlineExceeded:
                continue

    def _await(self, *kinds: type, timeout_s: float | None = None) -> Any:
        """The next command of one of ``kinds`` (others are ignored before joining)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            cmd = self._next(deadline)
            if isinstance(cmd, kinds):
                return cmd

    def _trap_signals(self) -> None:
        """SIGTERM ends the rank at its next batch (script mode traps it in the script's main thread)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    # ---------------------------------------------------------------- setup

    def _build(self) -> m.RankHello:
        self.probes.reach("build")  # tests: a start-up that is slow or never ends (before the hello)
        self._enter_build_phase()  # before CUDA, and before the task draws any random number
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # a collective NCCL gives up on must raise in this rank, not kill it: the
            # survivors of a dead peer rebuild their group and go on (2 = clean up only)
            nccl_errors_raise()
        try:  # a spec that names nothing, or a task whose dataset is unusable (empty): the user's, exit 2
            task = self.task = self._load_task()
            dataset = task.build_dataset()
            check_precision(task.precision, self.device)
        except TaskError as exc:
            raise UserError("task spec", exc) from exc
        if not omp_threads_set():
            torch.set_num_threads(
                cpu_threads(
                    os.cpu_count() or 1,
                    self.env.local_world,
                    staged=not isinstance(dataset, TensorDataset),
                    accelerator=self.device.type != "cpu",
                )
            )
        self.model = task.model().to(self.device)
        return m.RankHello(
            rank=self.rank,
            host=host_name(),
            pid=os.getpid(),
            device=str(self.device),
            versions=versions(),
            model_signature=model_signature(self.model),
            param_count=sum(p.numel() for p in self.model.parameters()),
            shuffle_signature=shuffle_signature(),
            dataset_len=len(dataset),
            dataset_digest=dataset_digest(dataset),  # its reads leave the RNGs as they were
            has_eval=task.eval_fn is not None,
            eval_metric=task.eval_metric,
            batch_size=task.batch_size,
            grain="shard" if isinstance(dataset, Shards) else "sample",
            accumulate_grad_batches=task.accumulate_grad_batches,
        )

    def _enter_build_phase(self) -> None:
        """The build phase's RNGs, the same on every rank (determinism.py); script mode enters it
        at ``flodl.init()``, before the script builds its model and data."""
        enter_build_phase(self.env)

    def _load_task(self) -> Task:
        """The user's task, imported by its spec (script mode: made of what the script prepared)."""
        return load_task(self.env.task)

    def _join(self, welcome: m.RankWelcome) -> None:
        start = time.perf_counter()
        self.welcome = welcome
        self.generation = welcome.generation
        config = self.config = DdpRunConfig.from_dict(welcome.config)  # validated, typed: the controller's options
        self.deadlines = Deadlines(
            heartbeat_timeout_s=self.env.heartbeat_timeout_s,
            collective_s=welcome.collective_timeout_s,
            snapshot_s=float(config.snapshot_timeout_secs),
        )
        if config.checkpoint_every and self.task.checkpoint_fn is None and not config.save_path:
            raise UserError(
                "config",
                TaskError("checkpoint_every is set, but the task has no checkpoint_fn and there is no save_path: nothing would be saved"),
            )
        if config.resume_from and not welcome.late:
            load_model(self.model, config.resume_from)  # before the broadcast: every replica starts from the bundle
        # flatten before the optimizer exists, so it holds the views, not stale tensors;
        # a joiner always averages (it takes the consensus from its peers)
        flat = FlatModel(self.model) if welcome.world_size > 1 or welcome.late else None
        if flat is not None and config.elche.mode.backend is AverageBackend.CPU:
            # snapshots go to this host's relay when the worker runs one, else to the controller
            addr, probe, nonce = f"tcp://{welcome.store_host}:{welcome.bulk_port}", welcome.shm_probe, welcome.shm_nonce
            if self.env.relay_addr:
                addr, probe, nonce = [*self.env.relay_addr.split(" "), "", ""][:3]
            bulk = BulkLink(
                addr,
                rank=self.rank,
                secret=self.env.secret,
                run_id=self.env.run_id,
                sender=f"{self.link.sender}/bulk",
                send_timeout_s=self.deadlines.snapshot_wait_s,
                shm_probe=probe,
                shm_nonce=nonce,
            )
            self.closing.callback(bulk.close)
            cpu = self.averager = CpuAverager(
                flat,
                bulk,
                rank=self.rank,
                alpha=config.elche.easgd_alpha or 1.0,
                timeout_s=self.deadlines.snapshot_wait_s,
                must_stop=lambda: self.link.must_stop or self.terminated,
                adopting=welcome.late,
            )
            self.closing.callback(cpu.close)  # its shared-memory segment's name
            if self.probes.armed("slice"):  # tests: a death halfway through a snapshot
                # ZeroMQ sends from its own I/O thread and has no flush: the slice is given a moment to leave
                cpu.first_slice_out = lambda: self.probes.reach("slice", before=lambda: time.sleep(0.2))
        else:
            group = self._first_group(welcome) if flat is not None and not welcome.late else None  # a joiner's comes with its Regroup
            collective = self.averager = CollectiveAverager(
                flat,
                group,
                must_stop=lambda: self.link.must_stop or self.terminated,
                superseded=self._group_broken,
                adopting=welcome.late,
            )
            self.peers = frozenset(range(welcome.world_size)) if group is not None else frozenset()
            # NCCL: break a hang on a dead peer (a regroup that only adds ranks leaves every collective able to finish)
            self.link.call_on_regroup(lambda msg: collective.abort() if self._loses_peer(msg) else None)
        # a joiner (``welcome.late``) adopts: the consensus comes with the Regroup that admits it
        # (collective: a broadcast; CPU: the next average, taken whole)
        if not welcome.late:
            self._take_first_consensus(welcome)
        self.deterministic = config.deterministic
        enter_training_phase(welcome.seed, self.rank)  # each rank its own stream (dropout), the same every run
        try:
            self.optimizer, self.optimizers = build_optimizer(self.task, self.model)
            # the LR factor goes on before the schedulers are built (they take it as their base)
            # and before a saved state is loaded (whose LRs hold it already)
            self.lr = LrState(self.optimizer, config.lr_factor(welcome.world_size), self.task.lr_schedule)
            if needs_update(self.task):
                self.update = Update(
                    self.task, self.optimizer, self.optimizers, self.device, self.lr, forward=self._forward, grads_ready=self._grads_ready
                )
        except TaskError as exc:
            raise UserError("task", exc) from exc
        self.graphed = compile_model(self.model, self.task.compile, self.device)  # after flattening: see compiling.py
        if config.resume_from and not welcome.late and not config.resume_weights_only:
            self._resume_optimizer(config.resume_from)
        self.world_size = welcome.world_size
        self.first_epoch, self.epochs = welcome.first_epoch, welcome.epochs
        self.max_grad_norm = config.max_grad_norm
        self.source = self._batch_source(config, welcome.seed)
        self._place_before_training()
        self.norm_layers = norm_layers(self.model) if self.task.bn_recalibration_batches and self.task.train_step is None else []
        self.link.send(m.RankReady(rank=self.rank, generation=welcome.generation, init_ms=(time.perf_counter() - start) * 1000))

    def _resume_optimizer(self, stem: str) -> None:
        """Load the bundle's optimizer state (required: a fresh optimizer only when asked for), and its
        schedulers' and scaler's. The LR: a scheduler's state holds it; otherwise the loaded
        groups' LRs become the base, as before schedulers existed."""
        saved = load_optimizer(self.optimizer, stem, fits=[len(o.param_groups) for o in self.optimizers])
        if self.update is not None:
            self.update.load_state_dict(saved)
        if self.update is None or not self.update.schedulers:
            assert self.lr is not None  # _join builds it before loading a saved state
            self.lr.restore(saved.get("lr_base"), self.global_step)

    def _first_group(self, welcome: m.RankWelcome) -> torch.distributed.ProcessGroup | None:
        """The run's first process group, or None when a rank died while it formed: the
        controller then regroups the survivors, naming whose parameters all take (``sync_from``)."""
        try:
            return build_group(
                store_host=welcome.store_host,
                store_port=welcome.store_port,
                prefix=welcome.store_prefix,
                rank=self.rank,
                world_size=welcome.world_size,
                device=self.device,
                timeout_s=self.deadlines.collective_timeout_s,
                gather_s=self.deadlines.group_gather_s,
                give_up=lambda: self.link.must_stop or self.terminated or self._announced_after(welcome.generation),
            )
        except Superseded:
            if self.link.must_stop or self.terminated:
                raise
        except RuntimeError as exc:
            if not is_collective_error(exc):
                raise
            log.warning("rank %d: the first group did not form (%s); waiting for the survivors' group", self.rank, exc)
            self._report_collective_failure(exc, welcome.generation)
        return None

    def _announced_after(self, generation: int) -> bool:
        """Has the controller announced a membership generation newer than ``generation``?"""
        return self.link.regroup is not None and self.link.regroup.generation > generation

    def _take_first_consensus(self, welcome: m.RankWelcome) -> None:
        """Take rank 0's parameters, unless the first group never formed or a rank died during
        the broadcast: the survivors' Regroup then names whose parameters every member takes."""
        averager = self._averaging()
        try:
            averager.broadcast_from(0)
        except RuntimeError as exc:
            if not isinstance(averager, CollectiveAverager) or not is_collective_error(exc):
                raise
            log.warning("rank %d: the first broadcast failed (%s); waiting for the survivors' group", self.rank, exc)
            self._report_collective_failure(exc, welcome.generation)

    def _data_source(self) -> BatchSource | ShardSource:
        """The rank's batch source, which ``_join`` sets up before the first window."""
        assert self.source is not None, "no batch source before the welcome"
        return self.source

    def _batch_source(self, config: DdpRunConfig, seed: int) -> BatchSource | ShardSource:
        """The rank's data path: the run's schedule (augment, epoch_splits), its
        delivery transform, and the staging tiers for datasets not already in memory;
        shards stream through a ``ShardSource`` (no tiers: each grant is read once)."""
        dataset = self.task.build_dataset()
        if isinstance(dataset, Shards):
            if config.transform is not None:  # its PickKeys name samples, which a stream of shards has no index for
                raise UserError("config", TaskError("transform: not available with a flodl.Shards dataset (transform in open_shard)"))
            if self.task.num_workers:  # the loader workers read samples by index; a shard is one stream
                raise UserError("config", TaskError("num_workers: not available with a flodl.Shards dataset (read ahead in open_shard)"))
            schedule = Schedule(len(dataset), config.augment, config.epoch_splits)
            return ShardSource(dataset, self.task.batch_size, seed=seed, collate_fn=self.task.collate_fn, schedule=schedule)
        transform = config.transform
        if isinstance(transform, str):
            try:
                transform = resolve_spec(transform)
            except TaskError as exc:
                raise UserError("config", TaskError(f"transform: {exc}")) from exc
        schedule = Schedule(len(dataset), config.augment, config.epoch_splits)
        source = BatchSource(
            dataset, self.task.batch_size, seed=seed, collate_fn=self.task.collate_fn, schedule=schedule, transform=transform
        )
        if not source.in_memory:  # a tensor dataset is already in memory: nothing to stage
            source.stage(self._staging_tiers(config, dataset))
        self._loading(source, dataset, seed)
        return source

    def _loading(self, source: BatchSource, dataset: Any, seed: int) -> None:
        """The task's DataLoader-style options: worker processes reading the samples, pinned batches."""
        task = self.task
        if source.in_memory:
            if task.num_workers or task.pin_memory:
                log.warning("rank %d: a TensorDataset is gathered in memory: Task.num_workers/pin_memory go unused", self.rank)
            return
        if task.pin_memory and self.device.type != "cuda":
            log.warning("rank %d: Task.pin_memory has no effect on a %s device (it pins for copies to CUDA)", self.rank, self.device.type)
        workers = None
        if task.num_workers:
            workers = WorkerReads(
                dataset, workers=task.num_workers, prefetch_factor=task.prefetch_factor, seed=seed, collate_fn=task.collate_fn
            )
            self.closing.callback(workers.close)
        source.read_with(workers, pin=task.pin_memory and self.device.type == "cuda")

    def _staging_tiers(self, config: DdpRunConfig, dataset: Any) -> TieredSamples:
        """RAM cache (pinned on CUDA ranks) and disk stage now; the VRAM pool after the
        first step, when what the model and its activations take is known."""
        budget = ram_budget(config.ram_max_usage, self.env.local_world) if config.sample_cache else 0
        ram = RamCache(budget, pin=self.device.type == "cuda") if budget > 0 else None
        disk = DiskStage(config.disk_stage_dir, config.disk_stage_gb * 10**9) if config.disk_stage_gb > 0 else None
        if disk is not None:
            self.closing.callback(disk.close)
        return TieredSamples(dataset.__getitem__, vram=None, ram=ram, disk=disk)

    def _place_before_training(self) -> None:
        """A tensor dataset that is small beside the VRAM budget goes to the device now, during
        start-up, as a hand-written loop uploads its data before its first step: uploading it
        after the first step (``_open_vram_pool``) put a copy of the whole dataset (a gigabyte
        for the 1 ms overhead case) inside the first window. Only at most ``EARLY_PLACE_SHARE``
        of the budget: what the model's steps will take is not known yet."""
        source = self.source
        if isinstance(source, BatchSource) and source.in_memory:  # asked first: the budget asks the device
            self._place_if_fits(source, EARLY_PLACE_SHARE * self._vram_budget())

    def _place_if_fits(self, source: BatchSource, limit: float) -> None:
        """A tensor dataset of at most ``limit`` bytes goes to the device whole: batches are then gathered there."""
        if 0 < source.resident_bytes <= limit:
            source.place_on(self.device)

    def _vram_budget(self) -> int:
        """Bytes the VRAM pool may take now (0: no pool: not CUDA, switched off, or not set up)."""
        config = self.config
        if config is None or self.device.type != "cuda" or not config.vram_pool:
            return 0
        return vram_budget(
            self.device, max_usage=config.vram_max_usage, gpu_ram_share=config.gpu_ram_share, kill_switch=vram_pool_disabled()
        )

    def _open_vram_pool(self) -> None:
        """After the first step: keep samples in the VRAM left under ``vram_max_usage`` (a tensor
        dataset that fits goes there whole: batches are then gathered on the device)."""
        source = self.source
        if source is None or self.config is None:  # not set up (a bare ``_step``, as tests run one): nothing to pool
            return
        if not isinstance(source, BatchSource):  # streamed shards: nothing staged
            return
        if (source.tiers is None and not source.in_memory) or source.device == self.device:  # nothing to pool, or placed already
            return
        budget = self._vram_budget()
        if not budget:
            return
        if source.in_memory:
            self._place_if_fits(source, budget)
            return
        source.pool_in_vram(VramPool(self.device, budget))

    # ------------------------------------------------------------- training

    def _train_window(self, window: m.Window) -> None:
        """Train granted positions until a quota, average, and report (progressive dispatch)."""
        assert self.lr is not None  # _join set it up: windows come after the welcome
        self.global_step = window.global_step
        if self.update is not None:
            self.update.window_start(window.global_step)  # "global" schedulers: every rank at the same LR
        self.probing = not (window.quota_batches or window.quota_ms or window.sync_every)
        self.link.doing("step")
        lost_peer = self._regroup_lost_peer()  # a membership change announced between windows (a rank joined, or died)
        self._start_warmer()
        stats = self._run_rounds(
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
        window_scalars, data = scalars.drain(), self._data_stats()
        if self.update is not None:
            self.update.report(window_scalars, data)
        self.link.send_report(
            m.WindowDone(
                rank=self.rank,
                window=window.window,
                batches=stats.batches,
                # positions trained: samples, or whole shards for a Shards dataset
                consumed=stats.positions if isinstance(self._data_source(), ShardSource) else stats.samples,
                loss_sum=stats.loss_sum,
                compute_ms=stats.compute_ms,
                data_ms=stats.data_ms,
                sync_ms=stats.sync_ms,
                wall_ms=stats.wall_ms,
                divergence=last.divergence if last else None,
                pre_norm=last.pre_norm if last else None,
                post_norm=last.post_norm if last else None,
                lr=self.lr.current,
                epochs=epoch_rows(stats.per_epoch),
                scalars=window_scalars,
                regrouped_at=stats.regrouped_at,
                dropped=self.dropped_window,
                res=self.resources.summary(),
                data=data,
            )
        )
        self.dropped_window = -1
        # tests: die with this window's average in flight, its report out (the ledger must hold either way)
        self.probes.reach("reported", before=lambda: self.link.drain(1.0))

    def _start_warmer(self) -> None:
        """Once the first window trained: read the rest of the dataset into the tiers in the background.

        Not with loader workers: the warmer reads in the rank's threads, under its GIL, which is
        what workers are there to spare it (``__getitem__`` holding the GIL); the workers' reads
        fill the tiers instead."""
        source = self._data_source()
        tiers = source.tiers
        loading = isinstance(source, BatchSource) and source.workers is not None
        if self.warmer is not None or tiers is None or loading or self.step_count == 0 or tiers.full():
            return
        order = torch.randperm(source.length, generator=torch.Generator().manual_seed(source.seed + 7919 * self.rank))
        self.warmer = CacheWarmer(tiers.get, order.tolist(), held=tiers.holds, full=tiers.full)
        self.warmer.start()
        self.closing.callback(self.warmer.stop)

    def _data_stats(self) -> dict[str, int]:
        """The staging tiers over the last window: hits and source fetches (deltas), bytes held now."""
        tiers = self._data_source().tiers
        if tiers is None:
            return {}
        now = tiers.stats()
        counts = {f"{name}_hits": now[name]["hits"] for name in ("vram", "ram", "disk")}
        counts["source_fetches"] = now["source"]["fetches"]
        out = {key: value - self._data_seen.get(key, 0) for key, value in counts.items()}
        out.update({f"{name}_bytes": int(now[name]["bytes"]) for name in ("vram", "ram", "disk")})
        self._data_seen = counts
        return out

    def _run_rounds(
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
        stats = RoundStats()
        source = self._data_source()
        prefetch = None
        if not source.in_memory:
            # worker reads start here, in the training thread (their processes die with it)
            produced: Any  # a batch source's or a shard source's (epoch, picks, batch) stream
            if isinstance(source, BatchSource) and source.workers is not None:
                produced = source.loaded_batches(grants)
            else:
                produced = source.window_batches(grants)
            prefetch = Prefetcher(produced, depth=PREFETCH_DEPTH, join_timeout_s=READER_JOIN_S)
        try:
            return self._rounds(
                stats,
                # the loop counts samples: an in-memory batch's places are not cut (BatchSource._emit)
                iter(prefetch) if prefetch is not None else source.window_batches(grants, places=False),
                rounds=rounds,
                sync_every=sync_every,
                quota_batches=quota_batches,
                quota_ms=quota_ms,
                measure=measure,
                window=window,
            )
        finally:
            if prefetch is not None:
                prefetch.close()  # what it read ahead is not trained, nor reported: only trained batches are
                if prefetch.abandoned and isinstance(source, BatchSource) and source.workers is not None:
                    source.workers.discard()  # never two threads in one loader: the next window starts new workers

    def _rounds(
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
        start = time.perf_counter()
        self.model.train()  # once per window, not per step: it walks every module
        # batches already where the model is (in memory, placed after the first step) skip the move
        source = self._data_source()
        self.batches_resident = isinstance(source, BatchSource) and source.delivers_on(self.device)
        loop = RoundLoop(
            stats,
            batches,
            averager=self._averaging(),
            start=start,
            sync_every=sync_every,
            quota_batches=quota_batches,
            # Cadence's time quota less what the last window ran past its own
            target_ms=quota_ms - self.quota_debt_ms if quota_ms else 0.0,
            quota_ms=quota_ms,
            window=window,
            # a Shards dataset: positions are shards; the window stops, averages (Sync) and counts
            # coverage only where a shard ends (shard_source.py), and its quota counts shards
            sharded=isinstance(self._data_source(), ShardSource),
        )
        self.quota_debt_ms = 0.0
        for round_index in range(rounds):
            self.position = ((window or 0) << 16) | round_index
            loop.stepped = loop.shards = 0
            loop.last = None
            self._drive_round(self._round_steps(loop, round_index))
            if self.update is not None:  # grants that ended inside an accumulation: its step now, before the average
                self.update.window_end(self.global_step, flush=self.world_size > 1)
            last = self._report(self.meter.drain(), stats, loop.last)  # the device catches up: a window's end may wait
            # a window's end average (Cadence, Async) runs in the background on either backend:
            # a rank never waits at it for a slower peer; Sync's per-batch rounds block, and so
            # does every average of a deterministic run (a background one lands at whichever
            # batch is running when it completes: a clock's choice)
            block = bool(sync_every) or self.deterministic
            averaged = self._average(float(loop.stepped), measure=measure, block=block, round_index=round_index, stats=stats)
            stats.averaged(averaged)
            if last is not None:  # the round's last step, with every step still held: after its average
                self._hold_report(last)
                self.link.send_lazy(self.reports.take(sync_ms=averaged.ms))
        stats.finish((time.perf_counter() - start) * 1000.0)
        return stats

    def _drive_round(self, steps: Generator[Due, list[StepRecord], None]) -> None:
        """Train one round's batches: each ``Due`` the round's loop yields is stepped here and its
        records sent back. Script mode hands the whole round to the script's thread instead
        (script_round.py), so the per-batch bookkeeping runs there, between its batches."""
        due = next(steps, None)
        while due is not None:
            if due.epoch > self.current_epoch:
                self._enter_epoch(due.epoch)
            records = self._step(due.batch, epoch=due.epoch, samples=due.samples, data_ms=due.data_ms)
            try:
                due = steps.send(records)
            except StopIteration:
                due = None

    def _round_steps(self, loop: RoundLoop, round_index: int) -> Generator[Due, list[StepRecord], None]:
        """One round's batch loop: the checks and bookkeeping between batches; yields each batch
        to train (its epoch not yet entered) and takes back its step records."""
        stats = loop.stats
        while not loop.exhausted and (
            not loop.sync_every or (loop.shards if loop.sharded else loop.stepped) < loop.sync_every or self._accumulating()
        ):
            if loop.averager.adopting:
                loop.exhausted = True  # a joiner without the consensus yet trains nothing (its grants go back)
                return
            if (
                not self._accumulating()
                and loop.whole
                and (
                    (loop.quota_batches and (stats.positions if loop.sharded else stats.batches + self.meter.pending) >= loop.quota_batches)
                    # the quota clock is the window's wall time less its averages: a fast rank's
                    # per-step work outside compute and data (hundreds of steps' worth) must not
                    # make it arrive late at the average its slow partner is already waiting in
                    or (loop.target_ms and self._past_quota(loop.start, stats, loop.target_ms, loop.quota_ms))
                    or (loop.window is not None and self.link.end_window >= loop.window)
                )
            ):
                loop.exhausted = True
                return
            if self.link.must_stop or self.terminated:
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
            self._land_background()  # an average that completed meanwhile lands here, between steps
            if self.link.evals_asked > self.evals_taken:
                t0 = time.perf_counter()
                self._evals_now()
                stats.paused_ms += (time.perf_counter() - t0) * 1000.0
            # a peer died: join the survivors' new group now (and the report says so: no average
            # failed, yet the dead peer is out of this round's average, cadence.py _dead_consumed).
            # Looked at here first: a call chain per step for the rare batch that has one to join
            announced = self.link.regroup
            if announced is not None and announced.generation > self.generation:
                self._regroup_in_round(stats, round_index)
            records = yield Due(epoch, batch, idx if type(idx) is int else len(idx), data_ms)
            loop.stepped += 1
            loop.last = self._report(records, stats, loop.last)

    @property
    def lr_step(self) -> int:
        """The global step LR schedules see: all ranks' optimizer steps (batches / accumulate_grad_batches)."""
        return self.global_step // self.task.accumulate_grad_batches

    def _accumulating(self) -> bool:
        """Inside a gradient accumulation: no average, no window end, until it is complete (docs/task.md)."""
        return self.update is not None and self.update.pending > 0

    def _past_quota(self, start: float, stats: RoundStats, target_ms: float, quota_ms: float) -> bool:
        """The window's time quota is used up (its wall less its averages): True, and what it ran
        over is owed to the next window (bounded: half a quota)."""
        over = (time.perf_counter() - start) * 1000.0 - stats.sync_ms - target_ms
        if over < 0.0:
            return False
        self.quota_debt_ms = min(over, 0.5 * quota_ms)
        return True

    def _evals_now(self) -> None:
        """Between batches: score the evals the controller asked for now rather than after this
        window (the average they are for is still held then: ``CollectiveAverager.scoring``).
        Other commands taken on the way keep their order (``deferred``)."""
        busy = self.link.busy
        while self.link.evals_asked > self.evals_taken:
            cmd = self.link.poll_command()
            if cmd is None:
                break
            if isinstance(cmd, m.RunEval):
                self._evaluate(cmd)
            else:
                self.deferred.append(cmd)
        self.link.doing(busy)

    def _enter_epoch(self, epoch: int) -> None:
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
        self.probes.reach("epoch", index=epoch)
        if self.task.epoch_fn is not None:
            assert self.lr is not None  # _join set it up: epochs are trained in windows
            self.lr.apply(self.lr_step)  # so the handle shows the LR of the step about to run
            busy = self.link.busy
            self.link.doing("callback")
            try:
                self.task.epoch_fn(epoch, self.handle)
            except Exception as exc:
                raise UserError("epoch_fn", exc) from exc
            self.link.doing(busy)

    def _report(self, records: list[StepRecord], stats: RoundStats, last: StepRecord | None) -> StepRecord | None:
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
                if self.probing:  # a probe's end waits on these counts: a fast rank through its
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

    def _forward(self, batch: Any) -> torch.Tensor:
        """The batch's loss: the task's ``train_step``, or ``loss_fn(model(x), y)``."""
        task = self.task
        if task.train_step is not None:
            return task.train_step(self.model, batch, self.device)
        assert task.loss_fn is not None  # a Task has exactly one of the two (Task.validate)
        x, y = batch if self.batches_resident else to_device(batch, self.device)
        return task.loss_fn(self.model(x), y)

    def _grads_ready(self) -> None:
        """Between backward and the optimizer step: clipping (and the tests' diverging step)."""
        if self.probes.reach("batch") == "nan":  # tests: a diverging step
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def _step(self, batch: Any, *, epoch: int, samples: int, data_ms: float) -> list[StepRecord]:
        """One batch: an optimizer step, or part of one when accumulating (update.py). Returns the
        step records now known (step_meter.py: on a GPU, earlier steps', once the device has run
        them; nothing here waits for it)."""
        t0 = self._step_begins()
        # the plain step: nothing else per step (update.py has the rest)
        loss = self._train_batch(batch) if self.update is None else self.update.batch(batch, self.global_step)
        return self._step_ended(t0, loss, epoch=epoch, samples=samples, data_ms=data_ms)

    def _step_begins(self) -> float:
        """A step's start: its clock (returned), and the plain step's LR."""
        t0 = self.meter.begin()
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()
        if self.update is None and self.lr is not None:
            self.lr.apply(self.global_step)
        return t0

    def _step_ended(self, t0: float, loss: torch.Tensor, *, epoch: int, samples: int, data_ms: float) -> list[StepRecord]:
        """A step's end (``loss`` computed, the optimizer stepped): count and time it, pace it when
        simulating, and tell the link it progressed; the step records now known."""
        self.step_count += 1
        records = self.meter.measured(
            t0, loss, epoch=epoch, step=self.step_count, samples=samples, data_ms=data_ms, close=self.step_count == 1 or self.probing
        )  # the warm-up step is timed alone, and a probe's steps each
        if self.probes.paces:  # SIMULATION (FLODL_SIMULATE_*): a slower device, re-timed with its sleep
            records = [self.probes.pace(rec, t0) for rec in records]
        if self.step_count == 1:
            self._open_vram_pool()
        self.global_step += 1
        # progress for the controller's liveness; the first step (warm-up) sets no pace
        now = time.perf_counter()
        for rec in records:
            self.link.progressed(now, rec.compute_ms if rec.step > 1 else 0.0, step=self.step_count)
        if not records:
            self.link.progressed(now, None, step=self.step_count)
        return records

    def _train_batch(self, batch: Any) -> torch.Tensor:
        """The plain step's own work: forward, backward, optimizer step; returns the loss (not
        synced). Script mode hands this part to the user's loop (script_rank.py)."""
        loss = self._forward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._grads_ready()
        self.optimizer.step()
        return loss


#: A tensor dataset up to this share of the VRAM budget goes to the device before training
#: (the rest of the budget is left to what the steps take, unknown before the first one).
EARLY_PLACE_SHARE = 0.5

#: Intra-op threads of a GPU rank: its CPU work is batch gathers and small host ops.
ACCELERATOR_THREADS = 4


def cpu_threads(cores: int, local_world: int, *, staged: bool, accelerator: bool = False) -> int:
    """Intra-op threads of a rank: its share of the host's cores (a few, for a GPU rank).

    Co-hosted ranks share the cores instead of each grabbing all of them (an
    explicit OMP_NUM_THREADS wins). A rank whose data goes through the staging
    tiers also runs the prefetcher, the parallel readers and the cache warmer:
    it leaves them a core or two, because an OpenMP team that loses a core to
    them waits at every barrier for the descheduled thread (measured on 16
    cores: a warm epoch 15x slower with all 16 threads busy). A GPU rank's host
    work is a batch gather and a few small ops, which an OpenMP team of every
    core only slows down (measured on the H200 host: with 16 threads the gather
    of an in-memory batch took a third of a 1.6 ms step): it takes at most
    ``ACCELERATOR_THREADS``.
    """
    share = max(1, cores // max(1, local_world))
    if accelerator:
        return min(share, ACCELERATOR_THREADS)
    if staged:
        share -= 2 if share >= 8 else 1 if share >= 4 else 0
    return max(1, share)


def main() -> int:
    """Entry point of ``python -m flodl.rank`` (spawned by a worker, never by hand)."""
    from ..host.proc import die_with_parent

    try:
        env = RankEnv.from_environ()
    except (KeyError, ValueError) as exc:
        print(f"flodl.rank is started by flodl.worker, not by hand (missing {exc})", file=sys.stderr)
        return EXIT_TASK_ERROR
    die_with_parent(env.parent_pid)
    if curve.requested():
        curve.enable(env.secret)  # the worker's environment says the run is encrypted
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the controller drives shutdown
    logging.basicConfig(level=logging.WARNING, format=f"[rank {env.rank}] %(levelname)s %(message)s", stream=sys.stderr)
    return RankRunner(env).run()
