"""Where a script's rank differs from a ``Task``'s: the hooks the rank's parts call (``Seams``).

A rank is the same from hello to exit whichever way the user wrote their
training (windows, averages, regroups, saves, liveness). What differs is named
here, and nowhere else: ``Seams`` is the ``Task`` rank's way at each point;
script mode's ``ScriptRank`` (script_rank.py) fills them for a script that runs
its own loop. The parts call these hooks; neither side reaches into the
other's state.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_OK, EXIT_TASK_ERROR
from ..taskspec import load_task
from .determinism import enter_build_phase
from .outcomes import UserError, user_traceback

if TYPE_CHECKING:
    from ..checkpoint.bundle import SavedOptimizer
    from ..config.env import RankEnv
    from ..task import Task
    from ..wire import messages as m
    from .replica import Replica
    from .round_loop import Due
    from .runner import RankRunner
    from .step_meter import StepRecord
    from .windows import Windows

log = logging.getLogger("flodl.rank.runner")


class Seams:
    """A ``Task`` rank's way at each point a script rank goes its own (script_rank.py)."""

    # ------------------------------------------------------------- lifecycle

    def trap_signals(self, on_sigterm: Callable[[int, Any], None]) -> None:
        """SIGTERM ends the rank at its next batch (script mode traps it in the script's main thread)."""
        signal.signal(signal.SIGTERM, on_sigterm)

    def before_build(self, runner: RankRunner) -> int | None:
        """Before the rank builds its task: None to go on, else the rank's exit code (script mode
        waits here for the script's ``run.prepare``)."""
        return None

    def enter_build_phase(self, env: RankEnv) -> None:
        """The build phase's RNGs, the same on every rank (determinism.py); script mode enters it
        at ``flodl.init()``, before the script builds its model and data."""
        enter_build_phase(env)

    def load_task(self, env: RankEnv) -> Task:
        """The user's task, imported by its spec (script mode: made of what the script prepared)."""
        return load_task(env.task)

    def hello(self, hello: m.RankHello) -> m.RankHello:
        """The hello this rank says, as the build made it."""
        return hello

    def joined(self) -> None:
        """The rank joined and is ready to train (script mode: ``run.prepare`` returns)."""

    def settled(self) -> None:
        """The last average landed before a consensus bundle or a clean end (script mode re-estimates
        the BatchNorm statistics there: the bundle, and the script's last epoch's end, hold fresh ones)."""

    def completed(self, windows: Windows) -> int:
        """The run completed (a clean Shutdown, the last average landed): the exit code. The
        epochs this rank trained no batch of after its last one begin here (their ``epoch_fn``
        runs), so every rank reaches the run's last epoch."""
        try:
            windows.enter_last_epoch()
        except UserError as exc:
            log.error("rank %d: epoch_fn raised after the last batch:\n%s", windows.rank, user_traceback(exc.original))
            return EXIT_TASK_ERROR
        return EXIT_OK

    # -------------------------------------------------------------- training

    def drive_round(self, windows: Windows, steps: Generator[Due, list[StepRecord], None]) -> None:
        """Train one round's batches (``Windows.drive``: each one stepped here; script mode hands
        the round to the script's thread, script_round.py)."""
        windows.drive(steps)

    def accumulating(self, replica: Replica) -> bool:
        """Inside a gradient accumulation: no average, no window end, until it is complete."""
        return replica.accumulating()

    # --------------------------------------------------------------- bundles

    def train_state(self, replica: Replica) -> dict[str, Any] | None:
        """What a bundle's ``.optim`` file keeps beside the optimizer state."""
        return replica.train_state()

    def resume_optimizer(self, replica: Replica, saved: SavedOptimizer, global_step: int) -> None:
        """Put a saved optimizer state back (a bundle's on resume, a donor's in a joiner: handoff.py),
        with its schedulers, scaler and the LR's base."""
        replica.resume_optimizer(saved, global_step)
