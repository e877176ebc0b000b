"""The model this rank trains and its optimizer side (``Replica``).

Built at the welcome, once the model's parameters lie in their flat buckets
(the optimizer holds the views, not stale tensors): the task's optimizer (or
several as one), the learning rate's pieces (``LrState``: base x factor x
schedule), the update path when the task asks for more than the plain step
(update.py: accumulation, mixed precision, torch schedulers), gradient
clipping, ``Task.compile``. The plain step is ``train_batch``; its forward and
the hook between backward and the optimizer step serve the update path too.
What a bundle's ``.optim`` file keeps beside the optimizer state, and how a
resume puts it back, are here too (script mode adds its own: seams.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.bundle import SavedOptimizer
from ..errors import TaskError
from ..task import Task
from .compiling import compile_model
from .data import to_device
from .handle import LrState
from .outcomes import UserError
from .update import Update, build_optimizer, needs_update, train_state

if TYPE_CHECKING:
    from .context import JoinedRun, RankContext


class Replica:
    """One replica of the model, and how a batch steps it."""

    def __init__(self, ctx: RankContext, run: JoinedRun, task: Task, model: torch.nn.Module) -> None:
        """The optimizer side of ``model`` (already flat when the run averages).

        Raises:
            UserError: the task's optimizer, scheduler or precision cannot be built (stage ``task``).
        """
        self.ctx = ctx
        self.task = task
        self.model = model
        self.device = ctx.device
        self.max_grad_norm = run.config.max_grad_norm
        self.resident = False  # the batches come out on the device already (``deliver_resident``)
        try:
            # the task's optimizer, or several as one (update.Optimizers)
            self.optimizer, self.optimizers = build_optimizer(task, model)
            # the LR factor goes on before the schedulers are built (they take it as their base)
            # and before a saved state is loaded (whose LRs hold it already)
            self.lr = LrState(self.optimizer, run.config.step_lr_factor(run.welcome.world_size), task.lr_schedule)
            # accumulation, mixed precision, schedulers: None on the plain step
            self.update: Update | None = None
            if needs_update(task):
                self.update = Update(
                    task, self.optimizer, self.optimizers, self.device, self.lr, forward=self.forward, grads_ready=self.grads_ready
                )
        except TaskError as exc:
            raise UserError("task", exc) from exc
        # the model's forward replays CUDA graphs: each step marks its start (compiling.py)
        self.graphed = compile_model(model, task.compile, self.device)  # after flattening: see compiling.py

    def deliver_resident(self, resident: bool) -> None:
        """This window's batches come out on the device already (in memory, placed there): no move."""
        self.resident = resident

    def lr_step(self, global_step: int) -> int:
        """The global step LR schedules see: all ranks' optimizer steps (batches / accumulate_grad_batches)."""
        return global_step // self.task.accumulate_grad_batches

    def accumulating(self) -> bool:
        """Inside a gradient accumulation: no average, no window end, until it is complete (docs/task.md)."""
        return self.update is not None and self.update.pending > 0

    def begin_step(self, global_step: int) -> None:
        """Before a batch: the replayed graphs' step mark, and the plain step's LR."""
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()
        if self.update is None:
            self.lr.apply(global_step)

    def step(self, batch: Any, global_step: int) -> torch.Tensor:
        """One batch: an optimizer step, or part of one when accumulating (update.py); its loss (not synced)."""
        # the plain step: nothing else per step (update.py has the rest)
        return self.train_batch(batch) if self.update is None else self.update.batch(batch, global_step)

    def forward(self, batch: Any) -> torch.Tensor:
        """The batch's loss: the task's ``train_step``, or ``loss_fn(model(x), y)``."""
        task = self.task
        if task.train_step is not None:
            return task.train_step(self.model, batch, self.device)
        assert task.loss_fn is not None  # a Task has exactly one of the two (Task.validate)
        x, y = batch if self.resident else to_device(batch, self.device)
        return task.loss_fn(self.model(x), y)

    def grads_ready(self) -> None:
        """Between backward and the optimizer step: clipping (and the tests' diverging step)."""
        if self.ctx.probes.reach("batch") == "nan":  # tests: a diverging step
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def train_batch(self, batch: Any) -> torch.Tensor:
        """The plain step's own work: forward, backward, optimizer step; returns the loss (not
        synced). Script mode hands this part to the user's loop (script_round.py)."""
        loss = self.forward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.grads_ready()
        self.optimizer.step()
        return loss

    def window_start(self, global_step: int) -> None:
        """A window starts at the run's ``global_step``: "global" schedulers put every rank at the same LR."""
        if self.update is not None:
            self.update.window_start(global_step)

    def window_end(self, global_step: int, *, flush: bool) -> None:
        """Grants that ended inside an accumulation: its step now, before the average (``flush``:
        with no average to end it, a solo rank carries it on)."""
        if self.update is not None:
            self.update.window_end(global_step, flush=flush)

    def report(self, window_scalars: dict[str, list[float]], data: dict[str, int]) -> None:
        """A window's report: what the update path counted (skipped fp16 steps) goes into its scalars and data."""
        if self.update is not None:
            self.update.report(window_scalars, data)

    def finish_accumulation(self, global_step: int) -> None:
        """A solo rank carries an accumulation across windows (no average ends them): a save steps it first."""
        self.window_end(global_step, flush=True)

    def train_state(self) -> dict[str, Any] | None:
        """What the .optim file keeps beside the optimizer state (schedulers, scaler, the optimizers' split)."""
        return train_state(self.optimizers, self.update, lr_base=self.lr.base)

    def load_optimizer(self, saved: SavedOptimizer) -> dict[str, Any]:
        """A saved optimizer state (a bundle's, or a donor's: handoff.py), loaded into the
        optimizer(s); what was kept beside it.

        Raises:
            CheckpointError: it was made for other parameter groups or optimizers.
        """
        return saved.load_into(self.optimizer, fits=[len(o.param_groups) for o in self.optimizers])

    def resume_optimizer(self, saved: SavedOptimizer, global_step: int) -> None:
        """Load a saved optimizer state (a bundle's: required, a fresh optimizer only when asked for;
        or a donor's, handed to a joiner), and its schedulers' and scaler's. The LR: a scheduler's
        state holds it; otherwise the loaded groups' LRs become the base, as before schedulers existed."""
        train_state = self.load_optimizer(saved)
        if self.update is not None:
            self.update.load_state_dict(train_state)
        if self.update is None or not self.update.schedulers:
            self.lr.restore(train_state.get("lr_base"), global_step)
