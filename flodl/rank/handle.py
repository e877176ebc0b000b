"""``WorkerHandle``: what a user's ``epoch_fn(epoch, worker)`` may see and steer on a rank.

The learning rate a rank uses for every step is

    base_lr[group] × lr_factor × lr_schedule(global_step)

where ``lr_factor = 1 + (W − 1)·lr_scale_ratio`` and ``global_step`` counts the
batches of all ranks (the controller sends it with every plan; the rank adds
its own steps since). ``set_lr`` / ``scale_lr`` change the base,
``set_scheduler`` swaps the schedule; every rank runs ``epoch_fn``, so a change
made there applies to every replica. A task with a torch ``Task.scheduler``
leaves the LR to it: these three refuse (update.py steps it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import TaskError

if TYPE_CHECKING:
    from .windows import Windows


class LrState:
    """The pieces of the learning rate, applied to the optimizer before each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float, schedule: Callable[[int], float] | None) -> None:
        self.optimizer = optimizer
        self.base = [float(g["lr"]) for g in optimizer.param_groups]
        self.factor = factor
        self.schedule = schedule
        self._applied: tuple | None = None
        self.apply(0)

    def apply(self, global_step: int) -> None:
        """Set every group's LR for ``global_step`` (skipped when nothing changed)."""
        if self.schedule is None and self._applied is not None:
            return  # called every step: with no schedule only restore/set_base/set_schedule change it
        mult = float(self.schedule(global_step)) if self.schedule is not None else 1.0
        key = (mult, self.factor, tuple(self.base))
        if key == self._applied:
            return
        for group, base in zip(self.optimizer.param_groups, self.base, strict=False):
            group["lr"] = base * self.factor * mult
        self._applied = key

    def restore(self, saved_base: list[float] | None, global_step: int) -> None:
        """A saved optimizer state was just loaded into the groups, LRs included: those are the saved
        run's *applied* LRs (base x factor x schedule), never a base. The base is the saved run's
        (``saved_base``; a bundle from before it was kept: this task's), applied for ``global_step``.
        (Taking the loaded LRs as the base applied the factor and the schedule twice on resume.)"""
        if saved_base is not None and len(saved_base) == len(self.base):
            self.base = [float(b) for b in saved_base]
        self._applied = None
        self.apply(global_step)

    def set_base(self, base: list[float], global_step: int) -> None:
        """New base LRs, one per group; applied at once for ``global_step``."""
        self.base = base
        self._applied = None
        self.apply(global_step)

    def set_schedule(self, schedule: Callable[[int], float] | None, global_step: int) -> None:
        """A new schedule; applied at once for ``global_step``."""
        self.schedule = schedule
        self._applied = None
        self.apply(global_step)

    @property
    def current(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class WorkerHandle:
    """A rank, as ``epoch_fn`` and ``checkpoint_fn`` see it (read from its window training part)."""

    def __init__(self, windows: Windows) -> None:
        self._windows = windows

    @property
    def rank(self) -> int:
        return self._windows.rank

    @property
    def world_size(self) -> int:
        return self._windows.group.at.world_size

    @property
    def device(self) -> torch.device:
        return self._windows.ctx.device

    @property
    def local_step(self) -> int:
        """Optimizer steps this rank has taken (batches / ``accumulate_grad_batches``)."""
        update = self._windows.replica.update
        return update.steps if update is not None else self._windows.steps.count

    @property
    def global_step(self) -> int:
        """Batches of all ranks before the current plan, plus this rank's since."""
        return self._windows.steps.global_step

    @property
    def current_epoch(self) -> int:
        return self._windows.current_epoch

    @property
    def current_lr(self) -> float:
        return self._windows.replica.lr.current

    @property
    def model(self) -> torch.nn.Module:
        return self._windows.replica.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._windows.replica.optimizer

    def _lr_state(self, what: str) -> LrState:
        update = self._windows.replica.update
        if update is not None and update.schedulers:
            raise TaskError(f"worker.{what}: the task's Task.scheduler sets the LR; change it through the scheduler")
        return self._windows.replica.lr

    def set_lr(self, lr: float) -> None:
        """Set every group's base LR (the factor and schedule still apply on top)."""
        lrs = self._lr_state("set_lr")
        lrs.set_base([float(lr)] * len(lrs.base), self._windows.steps.lr_step)

    def scale_lr(self, factor: float) -> None:
        """Multiply every group's base LR by ``factor``."""
        lrs = self._lr_state("scale_lr")
        lrs.set_base([b * float(factor) for b in lrs.base], self._windows.steps.lr_step)

    def set_scheduler(self, schedule: Callable[[int], float] | None) -> None:
        """Replace the schedule: ``schedule(global_step) -> multiplier`` (None: constant)."""
        self._lr_state("set_scheduler").set_schedule(schedule, self._windows.steps.lr_step)
