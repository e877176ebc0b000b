"""A rank's step reports, added up: one ``TimingMsg`` for ~50 ms of steps instead of one per step.

The controller reads these reports for its progress lines, per-rank rates, the run's first
batch, a calibration window's counts and (Sync) which of a dead rank's rounds are in the
consensus; none of that needs a frame per step. A frame per step cost the training thread a
message, an encode and a signature, and the controller a verify, a decode and a handler, every
step: at sub-millisecond steps a large part of what flodl adds to each one. What a window
trained is reported once per window (``WindowDone``) as before.

The rules that keep the counts exact: a report holds steps of one epoch only (the controller
counts an epoch's samples from them); in a calibration window (``probing``) every step goes out
at once (the controller's probe waits on the counts); and a round's last step is held back
until its average was taken, then sent with the average's time, so that what a report counts
after a Sync round's average is in that average.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..wire import messages as m
from .step_meter import StepRecord

#: A report goes out once its first step is this old (the link's own flush interval).
REPORT_INTERVAL_S = 0.05


class StepReports:
    """Steps trained and not reported yet, added up; ``take`` makes them one ``TimingMsg``."""

    __slots__ = ("rank", "clock", "batches", "epoch", "step", "samples", "loss_sum", "compute_ms", "data_ms", "opened")

    def __init__(self, rank: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank = rank
        self.clock = clock
        self.batches = 0
        self.epoch = -1
        self.step = 0
        self.samples = 0
        self.loss_sum = 0.0
        self.compute_ms = 0.0
        self.data_ms = 0.0
        self.opened = 0.0

    def fits(self, rec: StepRecord) -> bool:
        """``rec`` may join the steps held (none held, or all of its epoch)."""
        return not self.batches or rec.epoch == self.epoch

    def add(self, rec: StepRecord) -> None:
        """Hold ``rec`` (of the held steps' epoch: ``fits``)."""
        if not self.batches:
            self.epoch = rec.epoch
            self.opened = self.clock()
        self.batches += 1
        self.step = rec.step
        self.samples += rec.samples
        self.loss_sum += rec.loss
        self.compute_ms += rec.compute_ms
        self.data_ms += rec.data_ms

    def due(self) -> bool:
        """The oldest step held has waited ``REPORT_INTERVAL_S``."""
        return self.batches > 0 and self.clock() - self.opened >= REPORT_INTERVAL_S

    def take(self, sync_ms: float = 0.0) -> m.TimingMsg | None:
        """The steps held as one report (None if none), and hold nothing."""
        if not self.batches:
            return None
        report = m.TimingMsg(
            self.rank,
            self.epoch,
            self.step,
            self.samples,
            self.loss_sum / self.batches,
            self.compute_ms,
            self.data_ms,
            sync_ms,
            self.batches,
        )
        self.batches = self.samples = 0
        self.loss_sum = self.compute_ms = self.data_ms = 0.0
        return report
