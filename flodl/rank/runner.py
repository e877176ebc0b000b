"""The rank process: one replica, trained on the slices the controller grants (``RankRunner``).

Lifecycle, in order: connect the link; build the task (model, optimizer,
dataset); say hello; on welcome join the collective and take rank 0's
parameters; then obey commands until ``Shutdown``: ``Window`` trains granted
slices of epoch permutations, averaging (through the collective or the
controller) as the window's stop rule says; ``RunEval`` scores the model;
``SaveCheckpoint`` writes this rank's part of a bundle. Errors in the user's
task are reported to the controller once with a traceback (it stops the run);
the rank then waits, bounded, for the controller's Shutdown so no peer is
left waiting on it.

``RankRunner`` keeps the lifecycle and nothing else; the work is its parts'
(docs/architecture.md, "Inside a rank"), each owning its state:

* ``Group`` (regroup.py): the group position (generation, world size, peers,
  redo state: position.py) and the averager; averages across membership changes;
* ``Replica`` (replica.py): the model, its optimizer side, the plain step;
* ``DataPath`` (data_path.py): the batches a window's grants name;
* ``Windows`` (windows.py): window training: rounds, steps (steps.py), reports,
  the time quota's debt, the epochs it enters;
* ``Evaluator`` (evaluation.py): evals and their counters;
* ``Saves`` (saves.py): checkpoints, the save at a stop, the emergency save.

What a script rank does differently is a hook the parts call (seams.py);
how work ends early is outcomes.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.bundle import CheckpointError, SavedOptimizer, load_model
from ..config import DdpRunConfig
from ..config.deadlines import Deadlines
from ..config.env import RankEnv
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
from ..probes import Probes, for_rank
from ..task import Task
from ..wire import curve
from ..wire import messages as m
from .building import build
from .collective import Superseded
from .context import JoinedRun, RankContext
from .data_path import DataPath
from .determinism import enter_training_phase
from .evaluation import Evaluator
from .flat import FlatModel, model_digest
from .handoff import OUTER_STEPS, StateHandoff
from .link import ControllerLink
from .outcomes import NonFiniteLoss, Stop, UserError, is_collective_error, user_traceback
from .regroup import Group
from .replica import Replica
from .saves import Saves
from .seams import Seams
from .windows import Windows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Joined:
    """The parts a rank has once it joined the run (built by ``RankRunner.join``)."""

    run: JoinedRun
    replica: Replica
    data: DataPath
    evaluator: Evaluator
    windows: Windows
    saves: Saves


class RankRunner:
    """Runs one rank from spawn to exit; ``run()`` returns the exit code."""

    # built by ``_build``, the first thing ``run()`` does; nothing reads them before
    task: Task
    model: torch.nn.Module

    def __init__(self, env: RankEnv, probes: Probes | None = None, seams: Seams | None = None) -> None:
        self.env = env
        self.rank = env.rank
        self.deadlines = Deadlines(heartbeat_timeout_s=env.heartbeat_timeout_s)  # the rest comes with the welcome
        probes = for_rank(env.rank) if probes is None else probes  # tests and benchmarks look in here
        self.link = ControllerLink(
            env.controller,
            secret=env.secret,
            run_id=env.run_id,
            sender=f"rank{env.rank}.{os.getpid()}",
            silence_timeout_s=self.deadlines.heartbeat_timeout_s,
            parent_pid=env.parent_pid,
            probes=probes,  # a lost Window or WindowDone is the link's to drop
        )
        self.ctx = RankContext(
            env=env,
            device=torch.device(env.device),
            link=self.link,
            probes=probes,
            seams=Seams() if seams is None else seams,
            closing=contextlib.ExitStack(),
            sigterm=threading.Event(),
            resources=ResourceSampler([env.device]),
        )
        self.group = Group(self.ctx, self.deadlines)  # the group position is consulted from the start
        self.welcome: m.RankWelcome | None = None
        self.joined: Joined | None = None  # the parts the welcome sets up (``join``); None before

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def terminated(self) -> bool:
        """SIGTERM arrived (from our worker: its controller died, or a scheduler preempts the job)."""
        return self.ctx.sigterm.is_set()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.ctx.sigterm.set()

    # ------------------------------------------------------------ lifecycle

    def run(self) -> int:
        self.ctx.seams.trap_signals(self.on_sigterm)
        with self.ctx.closing as closing:
            self.link.start()
            closing.callback(self.link.close)
            self.ctx.resources.run_in_thread()
            closing.callback(self.ctx.resources.close)
            try:
                return self._run()
            except PeerLost as exc:
                log.error("rank %d: %s; exiting", self.rank, exc)
                self._emergency_save("controller_lost", str(exc))
                return EXIT_CONTROLLER_LOST

    def _run(self) -> int:
        code = self.ctx.seams.before_build(self)
        if code is not None:
            return code
        try:
            self.ctx.probes.reach("build")  # tests: a start-up that is slow or never ends (before the hello)
            self.task, self.model, hello = build(self.ctx)
        except UserError as exc:  # the task is unusable as written (an empty dataset): the user's, no traceback
            return self.fail(exc.stage, exc.original, EXIT_CONFIG)
        except Exception as exc:
            return self.fail("build", exc, EXIT_TASK_ERROR)
        self.link.send(hello)
        try:
            reply = self._await(m.RankWelcome, m.Reject, m.Shutdown, m.ShutdownWithSave)
        except Stop:
            return self.stopped()
        if isinstance(reply, m.Reject):
            log.error("rank %d refused by the controller: %s", self.rank, reply.reason)
            return EXIT_TASK_ERROR
        if isinstance(reply, (m.Shutdown, m.ShutdownWithSave)):
            return EXIT_OK if not reply.abort else EXIT_RANK_LOST
        try:
            self.join(reply)
        except Superseded:  # the run stopped while the first group gathered
            return self.stopped()
        except UserError as exc:
            return self.fail(exc.stage, exc.original, EXIT_TASK_ERROR)
        except CheckpointError as exc:  # resume_from names a bundle this model cannot load
            return self.fail("resume", exc, EXIT_CONFIG)
        except Exception as exc:
            return self.fail("collective", exc, EXIT_RANK_LOST)
        return self._serve(self.joined)

    def join(self, welcome: m.RankWelcome) -> None:
        """The welcome: the group (its averager, the first consensus), the replica's optimizer side,
        the data path, and the parts that train, score and save; then this rank is ready."""
        start = time.perf_counter()
        self.welcome = welcome
        config = DdpRunConfig.from_dict(welcome.config)  # validated, typed: the controller's options
        deadlines = Deadlines(
            heartbeat_timeout_s=self.env.heartbeat_timeout_s,
            collective_s=welcome.collective_timeout_s,
            snapshot_s=float(config.snapshot_timeout_secs),
        )
        run = JoinedRun(welcome, config, deadlines, first_epoch=welcome.first_epoch, epochs=welcome.epochs)
        if config.checkpoint_every and self.task.checkpoint_fn is None and not config.save_path:
            raise UserError(
                "config",
                TaskError("checkpoint_every is set, but the task has no checkpoint_fn and there is no save_path: nothing would be saved"),
            )
        if config.resume_from and not welcome.late:
            load_model(self.model, config.resume_from)  # before the broadcast: every replica starts from the bundle
        # flatten before the optimizer exists, so it holds the views, not stale tensors;
        # a joiner always averages (it takes the consensus from its peers)
        flat = FlatModel(self.model, config.sync_fragments) if welcome.world_size > 1 or welcome.late else None
        self.group.join(run, self.model, flat)
        enter_training_phase(welcome.seed, self.rank)  # each rank its own stream (dropout), the same every run
        replica = Replica(self.ctx, run, self.task, self.model)
        if config.resume_from and not welcome.late and not config.resume_weights_only:
            saved = SavedOptimizer.read(config.resume_from)
            self.ctx.seams.resume_optimizer(replica, saved, 0)  # no window yet: global step 0
            self.group.resume_outer(saved.outer, int(saved.train_state.get(OUTER_STEPS, 0)))
            self.group.resume_fragments(saved.train_state)
        elif config.resume_from and welcome.late and config.sync_fragments > 1 and not config.resume_weights_only:
            # a rank joining a resumed run: the rotation the members go on with is in the bundle
            # they resumed (or in this run's own saves over it): fragments.py ``Rotation.take``
            self.group.resume_fragments(SavedOptimizer.read(config.resume_from).train_state)
        data = DataPath(self.ctx, run, self.task)
        evaluator = Evaluator(self.ctx, run, replica, self.group, data.source)
        windows = Windows(self.ctx, run, replica, self.group, data, evaluator)
        # what this rank hands a joiner as its donor, or takes from its donor as a joiner
        self.group.hand_with(StateHandoff(self.ctx, replica, lambda: windows.steps.global_step, self.group.outer))
        self.joined = Joined(run, replica, data, evaluator, windows, Saves(self.ctx, run, self.group, windows))
        self.link.send(m.RankReady(rank=self.rank, generation=welcome.generation, init_ms=(time.perf_counter() - start) * 1000))
        self.ctx.seams.joined()

    def _serve(self, joined: Joined | None) -> int:
        """Obey commands until Shutdown."""
        assert joined is not None  # join set it up
        while True:
            try:
                cmd = self._next()
            except Stop:
                return self.stopped()
            if isinstance(cmd, (m.Shutdown, m.ShutdownWithSave)):
                return self._shut_down(cmd)
            try:
                if isinstance(cmd, m.Window):
                    joined.windows.train_window(cmd)
                elif isinstance(cmd, m.RunEval):
                    joined.evaluator.evaluate(cmd)
                elif isinstance(cmd, m.SaveCheckpoint):
                    joined.saves.checkpoint(cmd)
            except Stop:
                return self.stopped()
            except NonFiniteLoss as exc:
                return self.fail("nonfinite", exc, EXIT_NONFINITE)
            except UserError as exc:
                return self.fail(exc.stage, exc.original, EXIT_TASK_ERROR)
            except DeadlineExceeded as exc:  # a CPU averaging round never came back
                return self.fail("collective", exc, EXIT_RANK_LOST)
            except RuntimeError as exc:
                # torch raises RuntimeError for collective failures (peer gone, timeout)
                stage = "collective" if is_collective_error(exc) else "train"
                return self.fail(stage, exc, EXIT_RANK_LOST if stage == "collective" else EXIT_TASK_ERROR)
            except Exception as exc:
                return self.fail("train", exc, EXIT_TASK_ERROR)

    def _completed_while_regrouping(self) -> bool:
        """A clean Shutdown is what stopped this rank, and it is still one of the run's members."""
        stop, regroup = self.link.shutdown, self.link.regroup
        if stop is None or stop.abort or self.terminated or self.link.lost is not None:
            return False
        return regroup is None or self.rank in regroup.members

    def _shut_down(self, cmd: m.Shutdown | m.ShutdownWithSave) -> int:
        """The controller's Shutdown: the last average lands (a clean end), the elected rank
        saves, and this rank says it leaves, with its parameters' digest."""
        joined = self.joined
        if not cmd.abort and joined is not None:
            joined.saves.finish_accumulation()
            self.group.settle_last()  # the last average lands, on either backend: replicas end equal
            self.group.final_average()  # with fragments: every fragment's, one consensus
            self.ctx.seams.settled()
        self._save_on_shutdown(cmd)
        digest = "" if cmd.abort else model_digest(self.model)
        code = EXIT_RANK_LOST if cmd.abort else self._completed()
        self.link.send(m.Exiting(rank=self.rank, reason=cmd.reason, digest=digest))
        return code

    def _completed(self) -> int:
        """The run completed (a clean Shutdown, the last average landed): the exit code (the seams
        enter the epochs this rank trained no batch of after its last one: seams.py ``completed``)."""
        return self.ctx.seams.completed(self.joined.windows) if self.joined is not None else EXIT_OK

    def _emergency_save(self, reason: str, why: str) -> None:
        """No controller to coordinate a consensus bundle: keep this replica (once joined, with save_path)."""
        if self.joined is not None:
            self.joined.saves.emergency(reason, why)

    def _save_on_shutdown(self, cmd: m.Shutdown | m.ShutdownWithSave) -> None:
        """ShutdownWithSave: the elected survivor writes the model and optimizer files (once joined)."""
        if self.joined is not None:
            self.joined.saves.on_shutdown(cmd)

    def stopped(self) -> int:
        """The rank's work stopped early (``Stop``): how it leaves, and its exit code."""
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
            if isinstance(stop, m.ShutdownWithSave) and stop.save_stem and stop.save_rank == self.rank and self.joined is not None:
                self.joined.saves.finish_accumulation()  # stopped between batches: the gradients are whole
            self._save_on_shutdown(self.link.shutdown)
        self.link.send(m.Exiting(rank=self.rank, reason="abort", digest=""))
        return EXIT_RANK_LOST

    def fail(self, stage: str, exc: BaseException, code: int) -> int:
        """Report an error once, then wait (bounded) for the controller's verdict; ``code``."""
        detail = user_traceback(exc)[-8000:]
        # the controller prints it, once for the run: this rank's own line would repeat it
        log.info("rank %d failed during %s: %s", self.rank, stage, exc)
        self.link.send(
            m.RankError(
                rank=self.rank, stage=stage, error=f"{type(exc).__name__}: {exc}"[:2000], detail=detail, generation=self.group.at.generation
            )
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
        early = self.link.early_command()  # taken while the rank looked for an eval between batches
        if early is not None:
            return early
        self.link.doing("idle")
        while True:
            if self.terminated:
                raise Stop
            if self.welcome is not None and self.link.shutdown is None and self.group.announced_after(self.group.at.generation):
                # join a new group while waiting, not at the next window: a survivor that lost the
                # failed average waits for this one in the new group, and the next window waits for it
                # (not once the run is over: a peer that read the Shutdown first would never come)
                self.group.maybe_regroup()
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


def main() -> int:
    """Entry point of ``python -m flodl.rank`` (spawned by a worker, never by hand)."""
    from ..host.proc import die_with_parent
    from .output import prefix_output

    try:
        env = RankEnv.from_environ()
    except (KeyError, ValueError) as exc:
        print(f"flodl.rank is started by flodl.worker, not by hand (missing {exc})", file=sys.stderr)
        return EXIT_TASK_ERROR
    die_with_parent(env.parent_pid)
    if curve.requested():
        curve.enable(env.secret)  # the worker's environment says the run is encrypted
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the controller drives shutdown
    named = prefix_output(env.rank)  # "[rank N] " on every line the rank prints
    logging.basicConfig(
        level=logging.WARNING, format=("" if named else f"[rank {env.rank}] ") + "%(levelname)s %(message)s", stream=sys.stderr
    )
    return RankRunner(env).run()
