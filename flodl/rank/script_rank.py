"""``ScriptRank``: the rank of script mode, driven from a thread beside the user's loop.

It runs a ``RankRunner`` (the rank every ``Task`` gets, from hello to exit:
windows, averages, regroups, saves, liveness) with the seams (seams.py)
filled for a script:

* ``trap_signals``: none here (signals reach the main thread: ``flodl.init()``
  traps SIGTERM there);
* ``before_build`` waits for the script's ``run.prepare(...)``;
* ``enter_build_phase``: the RNGs are seeded alike on every rank at
  ``flodl.init()``, before the script builds its model and data, not when
  the rank builds its hello (determinism.py); ``run.prepare()`` returns with
  each rank's own stream, as a Task's first batch has it;
* ``load_task`` makes a ``Task`` of what the script prepared (its model,
  optimizer and dataset; its ``train_step`` is never called); ``hello`` says
  the script's accumulation; ``joined`` lets ``run.prepare()`` return;
* ``drive_round`` hands each round of the batch loop to the script's thread
  (script_round.py): ``run.batches()`` runs the rank's bookkeeping between
  the script's batches there, and the script runs forward, backward and its
  optimizer's step itself, giving ``run.step`` the loss; an epoch that ends
  in a round hands the script its end, so its code after ``for batch in
  run.batches()`` (an eval, a report) runs before the next epoch's first
  batch, watched as a callback is;
* ``accumulating``: inside the script's own accumulation (``run.step``);
* ``completed``: the script's epochs after its last batch end, in order;
* ``settled``: before a consensus bundle and at the clean end, the model's
  BatchNorm statistics are re-estimated (norms.py), as before the script's
  first eval-mode forward after each epoch's batches (``fresh_norms``): that
  code may score the model, and a ``Task`` re-estimates them before its evals
  too;
* ``train_state`` / ``resume_optimizer`` keep the objects the script
  registers (``run.register_state``: its LR schedulers, a GradScaler, its
  counters) in the bundle's ``.optim`` file beside the optimizer's state, and
  restore them on resume (script_state.py).

Every handoff goes through the ``Bridge``: one thread runs at a time, and a
round's batches switch no thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from .. import scalars
from ..checkpoint.bundle import SavedOptimizer
from ..config.deadlines import Deadlines
from ..config.env import RankEnv
from ..errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_TASK_ERROR, PeerLost, TaskError
from ..task import Task
from ..wire import messages as m
from .bridge import EPOCH, EPOCH_END, PREPARED, ROUND, Bridge, Item, ScriptFailed
from .data import BatchSource
from .determinism import enter_build_phase
from .outcomes import Stop, UserError, user_traceback
from .replica import Replica
from .round_loop import Due
from .runner import RankRunner
from .script_round import InlineRound, Raised
from .script_state import ScriptState
from .seams import Seams
from .shard_source import ShardSource
from .step_meter import StepRecord
from .windows import Windows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """What the script's ``run.prepare`` hands the rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Any
    batch_size: int
    collate_fn: Any = None
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    accumulate_grad_batches: int = 1  # the script steps its optimizer once every this many batches
    bn_recalibration_batches: int = 16  # BatchNorm statistics re-estimated from this many batches (0: never)


@dataclass(slots=True)  # one a batch (run.step): a frozen dataclass costs several times as much to build
class Stepped:
    """What ``run.step`` hands the rank: the batch's loss, and whether the script stepped its
    optimizer after it (None: unsaid, counted from ``accumulate_grad_batches``)."""

    loss: torch.Tensor
    optimizer_stepped: bool | None = None


def _never(model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
    raise AssertionError("script mode: the script's own loop computes the loss")


class ScriptRank(Seams):
    """A rank whose training step is the script's own loop body: the seams filled for a script,
    and the ``RankRunner`` they serve (``runner``), run on a thread of its own (``start``)."""

    def __init__(self, env: RankEnv, bridge: Bridge) -> None:
        self.bridge = bridge
        self.runner = RankRunner(env, seams=self)
        self.rank, self.device = env.rank, self.runner.device
        self.deadlines: Deadlines = self.runner.deadlines  # the heartbeat's: how long a failed rank waits for its verdict
        self.prepared: Prepared | None = None
        self.threads = 0  # intra-op threads the build chose for this rank (0: not yet)
        self.states = ScriptState()  # what run.register_state gave, and what a resumed bundle holds for it
        self.micro = 0  # batches since the script last stepped its optimizer (inside an accumulation: > 0)
        self._norms_epoch = -1  # an epoch just ended: its first eval-mode forward re-estimates BatchNorm first
        # flodl.init(), on the script's thread: the script builds its model and data from here on
        enter_build_phase(env)

    # what the script's ``Run`` reads of its rank

    @property
    def world_size(self) -> int:
        return self.runner.group.at.world_size

    @property
    def epochs(self) -> int:
        """The epochs the run trains in all (0 before it joined)."""
        joined = self.runner.joined
        return joined.run.epochs if joined is not None else 0

    @property
    def source(self) -> BatchSource | ShardSource | None:
        """The rank's batch source (None before it joined)."""
        joined = self.runner.joined
        return joined.data.source if joined is not None else None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.runner.on_sigterm(signum, frame)

    def start(self) -> threading.Thread:
        """Run the rank on a daemon thread (a stuck driver never holds the process); ``bridge.ended`` says how it ended."""
        thread = threading.Thread(target=self._drive, name="flodl-rank", daemon=True)
        thread.start()
        return thread

    def _drive(self) -> None:
        code = EXIT_FAILED
        try:
            code = self.runner.run()
        except Exception:  # a flodl bug: say so; the script still gets its end
            log.exception("rank %d: the driver failed", self.rank)
        finally:
            self.bridge.finish(code)

    # ------------------------------------------------------------- the seams

    def trap_signals(self, on_sigterm: Callable[[int, Any], None]) -> None:
        """Signals reach the main thread only: ``flodl.init()`` traps SIGTERM there."""

    def before_build(self, runner: RankRunner) -> int | None:
        """Wait for the script's ``run.prepare(...)``: None once it came; the exit code when the run
        stopped first or the script failed before it."""
        try:
            self.prepared = self.bridge.first(self._check_alive)
        except Stop:
            return runner.stopped()
        except ScriptFailed as exc:
            if isinstance(exc.reason, TaskError):  # flodl refused what the script gave it (an empty Shards): exit 2
                return runner.fail("task spec", exc.reason, EXIT_CONFIG)
            return runner.fail("build", exc.reason, EXIT_TASK_ERROR)
        return None

    def _check_alive(self) -> None:
        """Before prepare(): the run may end while the script builds its model and data."""
        link = self.runner.link
        if link.lost:
            raise PeerLost(link.lost)
        if self.runner.terminated or link.must_stop:
            raise Stop

    def load_task(self, env: RankEnv) -> Task:
        """A ``Task`` of what the script prepared.

        Raises:
            TaskError: the dataset is empty (the user's error: exit 2, one line, as a Task's).
        """
        p = self.prepared
        assert p is not None  # before_build waited for it
        if len(p.dataset) == 0:
            raise TaskError("run.prepare(..., dataset): the dataset is empty (no samples to train)")
        return Task(
            model=lambda: p.model,
            optimizer=lambda model: p.optimizer,  # flattening keeps the Parameter objects: it stays valid
            dataset=p.dataset,
            batch_size=p.batch_size,
            collate_fn=p.collate_fn,
            train_step=_never,
            num_workers=p.num_workers,
            prefetch_factor=p.prefetch_factor,
            pin_memory=p.pin_memory,
            bn_recalibration_batches=p.bn_recalibration_batches,
        )

    def enter_build_phase(self, env: RankEnv) -> None:
        """Entered already, at ``flodl.init()`` (``__init__``): the script has built since."""

    def hello(self, hello: m.RankHello) -> m.RankHello:
        # the intra-op thread count is per thread: the one the build chose (the rank's share of the
        # cores) is set on this thread only; prepare() sets it on the script's thread too
        self.threads = torch.get_num_threads()
        # the script's accumulation, not the Task's (which never accumulates: the script steps)
        return dataclasses.replace(hello, accumulate_grad_batches=self._accumulate)

    def joined(self) -> None:
        joined = self.runner.joined
        if joined is not None:  # the script's batches are its own: re-estimate BatchNorm statistics as a Task's eval rank does
            joined.evaluator.track_norms()
            joined.replica.model.register_forward_pre_hook(self._before_forward)
        self._hand(Item(PREPARED))  # prepare() returns; the script's next call goes on

    def _before_forward(self, model: torch.nn.Module, args: Any) -> None:
        """A forward in eval mode after an epoch's batches (the script scores its model): the BatchNorm
        statistics are re-estimated first, once (``fresh_norms`` armed it). Training's forwards, in
        train mode, pass straight through; a script that scores nothing pays nothing."""
        epoch, self._norms_epoch = self._norms_epoch, -1
        if epoch >= 0 and not model.training and self.runner.joined is not None:
            self.runner.joined.evaluator.refresh_norms(epoch)

    def resume_optimizer(self, replica: Replica, saved: SavedOptimizer, global_step: int) -> None:
        """The optimizer's state and the script's registered objects, from the bundle (or, in a
        joiner, from its donor: handoff.py). The loaded groups' LRs stay as saved: the script's own
        schedulers set them (there is no flodl schedule to re-apply), and the schedulers' restored
        state steps on from them."""
        self.states.resume(replica.load_optimizer(saved))

    def train_state(self, replica: Replica) -> dict[str, Any] | None:
        out = replica.train_state() or {}
        out.update(self.states.saved())
        return out

    def _end_epoch(self, windows: Windows) -> None:
        """Hand the script the end of its current epoch, then send the controller what it reported
        up to then (``EpochEnd``): that epoch's row waits for it (controller/epoch_ends.py).

        Raises:
            UserError: the script's code raised.
        """
        link = self.runner.link
        busy = link.busy
        link.doing("callback")  # the script's code between epochs: watched as epoch_fn is
        self.fresh_norms(windows)
        self._hand(Item(EPOCH_END, epoch=windows.current_epoch))
        self.epoch_ended(windows, busy)

    def epoch_ended(self, windows: Windows, busy: str) -> None:
        """The script's code after its epoch's batches is done: send what it reported (``EpochEnd``),
        and the link is ``busy`` again."""
        link = self.runner.link
        link.send(m.EpochEnd(rank=self.rank, epoch=windows.current_epoch, scalars=scalars.drain()))
        link.doing(busy)

    def fresh_norms(self, windows: Windows) -> None:
        """Before the script's code after an epoch's batches: its first forward in eval mode (the
        script scoring its model) re-estimates the model's BatchNorm statistics from the first
        batches of the epoch's order first, if averages changed the model since they last were
        (norms.py; every rank reads the same batches; ``_before_forward``). A background average
        still in flight moves them by what it brings when it lands, between the next batches,
        whose training moves them too; the window's own average marks them stale again."""
        if windows.current_epoch >= 0:
            self._norms_epoch = windows.current_epoch

    def norms_pass(self) -> None:
        """The next batch is handed out: the epoch's end is over, no eval of it is still to come."""
        self._norms_epoch = -1

    def settled(self) -> None:
        """A consensus bundle (the final one too) and the clean end hold re-estimated statistics, as a
        Task's final checkpoint holds what its eval scored (every rank from the same batches: the
        replicas stay equal)."""
        runner = self.runner
        joined = runner.joined
        if joined is None:
            return
        link = runner.link
        busy = link.busy
        link.doing("eval")  # forward passes, as a Task's eval rank runs them: watched as an eval is
        if joined.windows.current_epoch >= 0:
            joined.evaluator.refresh_norms(joined.windows.current_epoch)
        link.doing(busy)

    def completed(self, windows: Windows) -> int:
        """The run completed and the last average landed: the script's current epoch ends now, on
        the consensus, then every epoch after it that this rank trained no batch of begins and
        ends, up to the run's last (every rank's ``run.epochs()`` yields every epoch), and their
        reports reach their rows. An error there is the script's own (the run trained every
        epoch): its traceback here, and the process exits with 4."""
        try:
            if windows.current_epoch >= 0:
                self._end_epoch(windows)
            while (empty := windows.epoch_before(windows.epochs)) is not None:
                windows.enter_epoch(empty)
                self._hand(Item(EPOCH, epoch=empty))  # the script's run.epochs() yields it; its run.batches() is empty
                self._end_epoch(windows)
        except UserError as exc:
            log.error("rank %d: the script's code after its last batch raised:\n%s", self.rank, user_traceback(exc.original))
            return EXIT_TASK_ERROR
        return EXIT_OK

    def drive_round(self, windows: Windows, steps: Generator[Due, list[StepRecord], None]) -> None:
        """The script's thread runs the round (script_round.py): this thread waits until it ends,
        and raises what the round's loop raised there.

        Raises:
            UserError: the script's code raised.
        """
        outcome = self._hand(Item(ROUND, round=InlineRound(self, windows, steps)))
        if isinstance(outcome, Raised):
            raise outcome.error

    def accumulating(self, replica: Replica) -> bool:
        """Inside the script's accumulation: the window goes on (no average, no quota stop) until
        the script steps its optimizer, as for a Task's ``accumulate_grad_batches``."""
        return self.micro > 0

    # ------------------------------------------------- the script's thread

    def stepped(self, done: Stepped) -> torch.Tensor:
        """The script trained the batch handed out (``run.step``): its loss; counts the accumulation."""
        self.micro += 1
        stepped = done.optimizer_stepped
        if stepped or (stepped is None and self.micro >= self._accumulate):
            self.micro = 0
        self.runner.ctx.probes.reach("batch")  # tests: a death mid-batch (the script's step taken, not yet counted)
        return done.loss

    @property
    def _accumulate(self) -> int:
        return self.prepared.accumulate_grad_batches if self.prepared is not None else 1

    def _hand(self, item: Item) -> Any:
        try:
            return self.bridge.hand(item)
        except ScriptFailed as exc:
            raise UserError("train", exc.reason) from exc.reason
