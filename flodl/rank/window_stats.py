"""What one window trained: its tally (windows.py), reported in ``WindowDone``.

Its own module so that the window training and the averaging it delegates to
(regroup.py) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan.metrics import EpochCounters
from .flat import Averaged


@dataclass
class RoundStats:
    """What one window trained, in total and per epoch."""

    batches: int = 0
    samples: int = 0
    positions: int = 0  # shards trained whole (a Shards dataset; the window's loop counts them)
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    sync_ms: float = 0.0
    wall_ms: float = 0.0
    paused_ms: float = 0.0  # scoring evals, or waiting for a late peer's last average (not in wall_ms)
    last_average: Averaged | None = None
    regrouped_at: int = -1  # the first averaging round done in a generation that lost a member, if any
    per_epoch: dict[int, EpochCounters] = field(default_factory=dict)

    def add(self, epoch: int, samples: int, loss: float, compute_ms: float, data_ms: float) -> None:
        self.batches += 1
        self.samples += samples
        self.loss_sum += loss
        self.compute_ms += compute_ms
        self.data_ms += data_ms
        counters = self.per_epoch.get(epoch)
        if counters is None:  # not setdefault: it would build a throwaway EpochCounters every step
            counters = self.per_epoch[epoch] = EpochCounters()
        counters.add_batch(samples, loss, compute_ms, data_ms)

    def retime(self, epoch: int, old_ms: float, new_ms: float) -> None:
        """Count a step already added as taking ``new_ms`` of compute instead of ``old_ms``."""
        self.compute_ms += new_ms - old_ms
        if epoch in self.per_epoch:
            self.per_epoch[epoch].compute_ms += new_ms - old_ms

    def averaged(self, result: Averaged) -> None:
        """A round's average is done (or launched): its time counts as sync time."""
        self.sync_ms += result.ms
        self.last_average = result

    def regrouped(self, round_index: int) -> None:
        """Round ``round_index``'s average is done in a new generation that lost a member (it
        failed and is redone there, or the regroup came first): the earliest such round counts."""
        self.regrouped_at = round_index if self.regrouped_at < 0 else min(self.regrouped_at, round_index)

    def finish(self, wall_ms: float) -> None:
        """The window ended after ``wall_ms`` of wall time, pauses included; ``wall_ms`` keeps the
        rest. An eval is a once-an-epoch pause of one rank, not its pace, and neither is its peer's
        wait for that rank's late average: in the wall ElChe reads, the eval rank of a 0.3 s eval in
        a 0.1 s window looked 40x slower than it is (the next windows planned it a quarter of its
        batches while its peer trained for both), and the peer, the window after, as much slower.
        Not counted as averaging either: ElChe's overhead tune would take the wait for the cost of
        averaging and grow the windows to their cap."""
        self.wall_ms = max(0.0, wall_ms - self.paused_ms)
