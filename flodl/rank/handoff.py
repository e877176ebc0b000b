"""A joiner's state from a live peer, the donor: its optimizer's, in memory (``StateHandoff``).

A rank that joins a running world (a restart in a dead rank's place, a grown
host) takes the consensus parameters from its peers. With them it takes its
donor's state: the optimizer's (momentum buffers, Adam's moments and step
counts, keyed by parameter index, so it maps onto the joiner's own optimizer of
the same model), the LR schedulers', the GradScaler's and, in script mode, the
objects the script registered (``run.register_state``). That is exactly what a
bundle's ``.optim`` file holds (checkpoint/bundle.py ``optimizer_payload``),
as bytes in memory, never on disk, loaded the way a resume loads a bundle
(``Seams.resume_optimizer``). So the joiner's first step on a batch is the one
its donor would take on it.

The bytes go the way the parameters go: on the collective backend from the
member that broadcast them, straight to each joiner through the group
(regroup.py ``_hand_over``); on the CPU backend through the controller's bulk
plane, with the donor's snapshot of the round the joiner adopts
(state_lane.py), the outer optimizer's state with them (on the collective
backend the consensus broadcast carries that to every member already).

Not handed: the random streams (every rank draws its own, derived from the run
seed and its rank number: determinism.py; a joiner that copied its donor's would
draw the same dropout masks and augmentations as the donor from then on) and the
data position (the controller grants every window's samples: the joiner trains
what its windows grant).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import safetensors_io
from ..checkpoint.bundle import CheckpointError, SavedOptimizer, optimizer_payload
from .outer import OuterStep

if TYPE_CHECKING:
    from .context import RankContext
    from .replica import Replica

log = logging.getLogger(__name__)

#: Where a joiner's state came from, in errors.
ORIGIN = "the donor's optimizer state"
#: ``train_state``'s key for the outer optimizer's count of averages stepped (beside its tensors).
OUTER_STEPS = "outer_steps"


def kept_beside(ctx: RankContext, replica: Replica, outer: OuterStep | None) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """What an ``.optim`` file (a bundle's, or a donor's state) keeps beside the optimizer's state:
    the ``train_state`` JSON (schedulers, scaler, the script's registered objects; the outer
    optimizer's step count) and the outer optimizer's tensors (its anchor and momentum)."""
    train_state = ctx.seams.train_state(replica)
    if outer is None:
        return train_state, {}
    return {**(train_state or {}), OUTER_STEPS: outer.steps}, outer.tensors()


class StateHandoff:
    """This rank's state as a donor gives it (``dump``), and a donor's taken as a joiner (``load``)."""

    def __init__(self, ctx: RankContext, replica: Replica, global_step: Callable[[], int], outer: Callable[[], OuterStep | None]) -> None:
        self.ctx = ctx
        self.replica = replica
        self.global_step = global_step  # the run's global step as this rank knows it (the LR schedule's)
        self.outer = outer  # the outer optimizer (regroup.py), when the run has one

    def dump(self, *, outer: bool) -> bytearray:
        """The state's bytes (an ``.optim`` file's), the outer optimizer's with them when ``outer``.

        Raises:
            TypeError: the script's registered state or a scheduler's is not JSON.
        """
        train_state, extra = kept_beside(self.ctx, self.replica, self.outer() if outer else None)
        tensors, metadata = optimizer_payload(self.replica.optimizer, train_state, extra)
        self.ctx.probes.observe("handoff.sent", lambda: _observed(tensors, train_state))
        return safetensors_io.dumps(tensors, metadata)

    def load(self, state: bytearray | memoryview) -> bool:
        """Take a donor's state (``dump``'s bytes); True when the outer optimizer's came with it and
        was taken. A state that does not load is logged, and this rank trains with a fresh optimizer
        (it holds the consensus parameters either way)."""
        try:
            tensors, metadata = safetensors_io.loads(state, ORIGIN)  # views of ``state``: no copy
            saved = SavedOptimizer(tensors, metadata, ORIGIN, check_finite=False)  # a live donor's (bundle.py says why)
            self.ctx.seams.resume_optimizer(self.replica, saved, self.global_step())
            step = self.outer()
            took_outer = bool(saved.outer) and step is not None
            if step is not None and saved.outer:
                step.load_tensors(saved.outer)
                step.steps = int(saved.train_state.get(OUTER_STEPS, step.steps))
        except (CheckpointError, ValueError) as exc:  # CorruptFile is a ValueError
            log.warning("rank %d: %s does not load here (%s); training with a fresh optimizer", self.ctx.rank, ORIGIN, exc)
            return False
        log.info("rank %d: took %s (%.1f MB)", self.ctx.rank, ORIGIN, len(state) / 2**20)
        self.ctx.probes.observe("handoff.taken", lambda: self.held(outer=took_outer))
        return took_outer

    def held(self, *, outer: bool) -> dict[str, torch.Tensor]:
        """The state this rank holds now, as ``dump`` names it, its ``train_state`` as JSON bytes (for the probes)."""
        train_state, extra = kept_beside(self.ctx, self.replica, self.outer() if outer else None)
        return _observed(optimizer_payload(self.replica.optimizer, None, extra)[0], train_state)


def _observed(tensors: dict[str, torch.Tensor], train_state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """A state as the probes write it: its tensors, and what is kept beside them as JSON bytes (``train_state``)."""
    text = json.dumps(train_state or {}, sort_keys=True).encode()
    return {**tensors, "train_state": torch.frombuffer(bytearray(text), dtype=torch.uint8)}
