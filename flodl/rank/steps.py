"""A rank's steps, one batch each (``Steps``): counted, timed, paced when simulating, told to the link.

Each step's record (step_meter.py: on a GPU, known a few steps late) goes to the
window's tally and the controller's reports (windows.py); its end is progress
for the controller's liveness. ``global_step`` is the run's batch count: all
ranks' batches before the current plan (each ``Window`` carries it), plus this
rank's since.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from .step_meter import StepMeter, StepRecord

if TYPE_CHECKING:
    from .context import RankContext
    from .data_path import DataPath
    from .replica import Replica


class Steps:
    """The rank's step count, the run's global step, and each step's measure."""

    def __init__(self, ctx: RankContext, replica: Replica, data: DataPath | None) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.replica = replica
        self.data = data  # None: no data path (a bare step, as a test runs one)
        self.count = 0  # steps this rank trained
        self.global_step = 0
        # an open-ended (calibration) window: the controller ends it once every rank has timed a
        # few batches, so those reports go out at once, each step measured on its own
        self.probing = False
        # a simulated slowdown paces every step, so each is measured on its own, even on a GPU
        self.meter = StepMeter(ctx.device, per_step=True if ctx.probes.paced_alone else None)

    def window_start(self, global_step: int, *, probing: bool) -> None:
        """A window starts at the run's ``global_step`` (``probing``: open-ended, a calibration)."""
        self.global_step = global_step
        self.probing = probing

    @property
    def lr_step(self) -> int:
        """The global step LR schedules see (optimizer steps of all ranks)."""
        return self.replica.lr_step(self.global_step)

    def step(self, batch: Any, *, epoch: int, samples: int, data_ms: float) -> list[StepRecord]:
        """One batch: an optimizer step, or part of one when accumulating (update.py). Returns the
        step records now known (step_meter.py: on a GPU, earlier steps', once the device has run
        them; nothing here waits for it)."""
        t0 = self.begin()
        loss = self.replica.step(batch, self.global_step)
        return self.ended(t0, loss, epoch=epoch, samples=samples, data_ms=data_ms)

    def begin(self) -> float:
        """A step's start: its clock (returned), and the replica's (the plain step's LR)."""
        t0 = self.meter.begin()
        self.replica.begin_step(self.global_step)
        return t0

    def ended(self, t0: float, loss: torch.Tensor, *, epoch: int, samples: int, data_ms: float) -> list[StepRecord]:
        """A step's end (``loss`` computed, the optimizer stepped): count and time it, pace it when
        simulating, and tell the link it progressed; the step records now known."""
        self.count += 1
        records = self.meter.measured(
            t0, loss, epoch=epoch, step=self.count, samples=samples, data_ms=data_ms, close=self.count == 1 or self.probing
        )  # the warm-up step is timed alone, and a probe's steps each
        probes = self.ctx.probes
        if probes.paces:  # SIMULATION (FLODL_SIMULATE_*): a slower device, re-timed with its sleep
            records = [probes.pace(rec, t0) for rec in records]
        if self.count == 1 and self.data is not None:
            self.data.open_vram_pool()
        self.global_step += 1
        # progress for the controller's liveness; the first step (warm-up) sets no pace
        now = time.perf_counter()
        for rec in records:
            self.link.progressed(now, rec.compute_ms if rec.step > 1 else 0.0, step=self.count)
        if not records:
            self.link.progressed(now, None, step=self.count)
        return records
