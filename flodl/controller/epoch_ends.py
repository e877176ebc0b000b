"""Script mode's epoch ends: an epoch's row waits for what each script reported after its batches.

A script's code after ``for batch in run.batches()`` (an eval, ``run.report``)
runs when its rank begins its next epoch, or when the run completes: often
after the controller closed the epoch, whose row would then miss the values.
Each script rank says when that code has run (``EpochEnd``, with what it
reported); ``EpochEnds`` keeps the values of epochs not closed yet, folds them
into a closed epoch's row, and says when a row is complete: every live rank
that trained in the epoch has ended it. The controller prints and records a
row only then (``Training.flush_epoch_lines``), as it waits for an eval.

Pure bookkeeping: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..config.values import Reduction
from ..plan.metrics import EpochStats, add_scalars
from ..wire import messages as m


class EpochEnds:
    """Which ranks' scripts ended each epoch, and what they reported then."""

    def __init__(self, reductions: Mapping[str, Reduction] | None = None) -> None:
        self.reductions = reductions
        self.ended: dict[int, set[int]] = {}  # epoch -> ranks whose script ended it
        self.pending: dict[int, dict[int, dict[str, list[float]]]] = {}  # epoch (not closed) -> rank -> [sum, count]

    def note(self, msg: m.EpochEnd, closed: EpochStats | None) -> None:
        """``msg.rank``'s script ended ``msg.epoch``; ``closed``: that epoch's row, if it is closed."""
        self.ended.setdefault(msg.epoch, set()).add(msg.rank)
        if closed is not None:
            add_scalars(closed, msg.rank, msg.scalars, self.reductions)
            return
        mine = self.pending.setdefault(msg.epoch, {}).setdefault(msg.rank, {})
        for key, (total, count) in msg.scalars.items():
            acc = mine.setdefault(key, [0.0, 0.0])
            acc[0] += total
            acc[1] += count

    def close(self, stats: EpochStats) -> None:
        """The row closed (an epoch, or a group one average closed): the values its scripts
        reported before that go into it."""
        for epoch in stats.epochs:
            for rank, scalars in self.pending.pop(epoch, {}).items():
                add_scalars(stats, rank, scalars, self.reductions)

    def complete(self, stats: EpochStats, live: Collection[int]) -> bool:
        """Has every live rank that trained in the row ended its last epoch? (A dead one never
        will; a rank ends its epochs in order, so the last one's end says the others' came.)"""
        trained = {rank for rank, part in stats.per_rank.items() if part.batches > 0 and rank in live}
        return trained <= self.ended.get(stats.epoch, set())
