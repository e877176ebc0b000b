"""Per-epoch metrics: a rank's per-epoch counters, and folding the ranks' reports into one row.

Pure logic. ``EpochCounters`` is the one record of what a rank did in an
epoch: the rank fills it batch by batch, ``WindowDone.epochs`` carries it as
rows, the controller sums it per rank until the epoch closes. Loss is
batch-weighted across ranks; user scalars (sum, count pairs) are averaged per
rank, then batch-weighted across the ranks that recorded them, unless the run
declares another reduction for the key (``scalar_reductions``: then they fold
exactly as the record stream's tree does, a ``sum`` key to its total); an epoch's wall
time is its slowest rank's. Golden values from the reference runtime are in
``tests/test_pure.py`` (``test_epoch_aggregation_golden``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..config.values import Reduction


@dataclass
class EpochCounters:
    """One rank's running totals for one epoch (or the part of it a window trained).

    On the wire (``WindowDone.epochs``, ``list<list<float>>``) one epoch is the
    row ``[epoch, batches, samples, loss_sum, compute_ms, data_ms]``: ``row`` and
    ``from_row`` are the only code that knows the order. ``sync_ms`` is not in
    it: a window reports its averaging time once (``WindowDone.sync_ms``), and
    the controller books it to the window's last epoch.
    """

    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    sync_ms: float = 0.0

    def add_batch(self, samples: int, loss: float, compute_ms: float, data_ms: float) -> None:
        self.batches += 1
        self.samples += samples
        self.loss_sum += loss
        self.compute_ms += compute_ms
        self.data_ms += data_ms

    def add(self, other: EpochCounters) -> None:
        self.batches += other.batches
        self.samples += other.samples
        self.loss_sum += other.loss_sum
        self.compute_ms += other.compute_ms
        self.data_ms += other.data_ms
        self.sync_ms += other.sync_ms

    def row(self, epoch: int) -> list[float]:
        """This epoch's wire row (floats, as the schema says)."""
        return [float(epoch), float(self.batches), float(self.samples), float(self.loss_sum), float(self.compute_ms), float(self.data_ms)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> tuple[int, EpochCounters]:
        """``(epoch, counters)`` from a wire row."""
        epoch, batches, samples, loss_sum, compute_ms, data_ms = row
        return int(epoch), cls(int(batches), int(samples), loss_sum, compute_ms, data_ms)


def epoch_rows(per_epoch: Mapping[int, EpochCounters]) -> list[list[float]]:
    """``WindowDone.epochs``: one row per epoch, in epoch order."""
    return [counters.row(epoch) for epoch, counters in sorted(per_epoch.items())]


@dataclass
class EpochReport:
    """One rank's totals for (part of) one epoch, as the windows reported them."""

    rank: int
    epoch: int
    batches: int
    samples: int
    loss_sum: float
    wall_ms: float
    compute_ms: float
    data_ms: float
    sync_ms: float
    syncs: int
    scalars: dict[str, list[float]]


@dataclass
class RankEpoch:
    """One rank's share of one epoch."""

    rank: int
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    wall_ms: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    sync_ms: float = 0.0
    syncs: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)

    def add(self, report: EpochReport) -> None:
        """Fold in one plan's report (a rank may send several per epoch)."""
        self.batches += report.batches
        self.samples += report.samples
        self.loss_sum += report.loss_sum
        self.wall_ms += report.wall_ms  # plans of one epoch run back to back: time adds up
        self.compute_ms += report.compute_ms
        self.data_ms += report.data_ms
        self.sync_ms += report.sync_ms
        self.syncs += report.syncs
        for key, (total, count) in report.scalars.items():
            acc = self.scalars.setdefault(key, [0.0, 0.0])
            acc[0] += total
            acc[1] += count

    @property
    def throughput(self) -> float:
        """Samples per second over this rank's wall time in the epoch."""
        return self.samples * 1000.0 / self.wall_ms if self.wall_ms > 0 else 0.0


@dataclass
class EpochStats:
    """The aggregated row of one epoch."""

    epoch: int
    avg_loss: float | None
    batches: int
    samples: int
    wall_ms: float
    syncs: int
    per_rank: dict[int, RankEpoch]
    scalars: dict[str, float]
    eval_value: float | None = None
    eval_ms: float | None = None  # how long that eval took (the eval rank's own clock): time-to-quality readers take it out
    # one average that closed several epochs closes them as one row: ``first_epoch`` to ``epoch``
    # (plan/cadence.py ``_close_all``), each one's own loss in ``epoch_losses``
    first_epoch: int = -1
    epoch_losses: dict[int, float | None] = field(default_factory=dict)
    epoch_samples: dict[int, int] = field(default_factory=dict)  # each epoch's own samples (coverage)
    # positions of later epochs that the average closing this row holds too (0: it closed on the edge)
    ahead_samples: int = 0

    def __post_init__(self) -> None:
        if self.first_epoch < 0:
            self.first_epoch = self.epoch

    @property
    def epochs(self) -> range:
        """The epochs this row covers (one, or the group one average closed)."""
        return range(self.first_epoch, self.epoch + 1)

    @cached_property  # read once per rank (to_dict, the monitor's epoch records): recomputing it each time was O(ranks²)
    def batch_share(self) -> dict[int, float]:
        """Each rank's fraction of the epoch's samples."""
        return {r: (p.samples / self.samples if self.samples else 0.0) for r, p in self.per_rank.items()}

    @property
    def samples_per_s(self) -> float:
        return self.samples * 1000.0 / self.wall_ms if self.wall_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "first_epoch": self.first_epoch,
            "epoch_losses": {str(e): loss for e, loss in sorted(self.epoch_losses.items())},
            "epoch_samples": {str(e): n for e, n in sorted(self.epoch_samples.items())} or {str(self.epoch): self.samples},
            "ahead_samples": self.ahead_samples,
            "loss": self.avg_loss,
            "eval": self.eval_value,
            "eval_s": None if self.eval_ms is None else self.eval_ms / 1000.0,
            "samples": self.samples,
            "batches": self.batches,
            "wall_s": self.wall_ms / 1000.0,
            "samples_per_s": self.samples_per_s,
            "syncs": self.syncs,
            "scalars": self.scalars,
            "per_rank": {
                str(r): {
                    "samples": p.samples,
                    "batches": p.batches,
                    "samples_per_s": p.throughput,
                    "batch_share": self.batch_share[r],
                    "compute_ms": p.compute_ms,
                    "data_ms": p.data_ms,
                    "sync_ms": p.sync_ms,
                }
                for r, p in sorted(self.per_rank.items())
            },
        }


def rank_scalar(total: float, count: float, reduction: Reduction) -> float:
    """One rank's value of a user scalar over an epoch: its total for a count
    declared ``sum`` (tokens seen), else its mean. The record stream's leaves hold the same."""
    return total if reduction is Reduction.SUM else total / count


def _fold_scalar(key: str, per_rank: Mapping[int, RankEpoch], reduction: Reduction) -> float | None:
    """``key`` across the ranks that recorded it, as the record stream rolls it up
    (weights: samples); the default Mean stays the reference's batch-weighted mean."""
    recorded = [(p, p.scalars[key]) for p in per_rank.values() if p.scalars.get(key, (0.0, 0.0))[1] > 0 and p.batches > 0]
    if reduction is not Reduction.MEAN:
        return reduction.fold([(rank_scalar(total, count, reduction), float(p.samples)) for p, (total, count) in recorded])
    den = sum(p.batches for p, _ in recorded)
    return sum(total / count * p.batches for p, (total, count) in recorded) / den if den > 0 else None


def aggregate(epoch: int, reports: Iterable[EpochReport], reductions: Mapping[str, Reduction] | None = None) -> EpochStats:
    """Fold every report of ``epoch`` into an ``EpochStats``; ``reductions`` are the run's
    ``scalar_reductions`` (undeclared keys: Mean)."""
    per_rank: dict[int, RankEpoch] = {}
    for report in reports:
        per_rank.setdefault(report.rank, RankEpoch(report.rank)).add(report)
    batches = sum(p.batches for p in per_rank.values())
    loss_sum = sum(p.loss_sum for p in per_rank.values())
    return EpochStats(
        epoch=epoch,
        avg_loss=loss_sum / batches if batches else None,
        batches=batches,
        samples=sum(p.samples for p in per_rank.values()),
        wall_ms=max((p.wall_ms for p in per_rank.values()), default=0.0),
        # every rank joins every round of a plan, so one rank's count is the plan's
        syncs=max((p.syncs for p in per_rank.values()), default=0),
        per_rank=per_rank,
        scalars=fold_scalars(per_rank, reductions),
    )


def fold_scalars(per_rank: Mapping[int, RankEpoch], reductions: Mapping[str, Reduction] | None = None) -> dict[str, float]:
    """Every user scalar of an epoch across its ranks (``_fold_scalar``), by key."""
    scalars: dict[str, float] = {}
    for key in sorted({k for p in per_rank.values() for k in p.scalars}):
        value = _fold_scalar(key, per_rank, (reductions or {}).get(key, Reduction.MEAN))
        if value is not None:
            scalars[key] = value
    return scalars


def add_scalars(
    stats: EpochStats, rank: int, scalars: Mapping[str, Sequence[float]], reductions: Mapping[str, Reduction] | None = None
) -> None:
    """Fold ``rank``'s ``[sum, count]`` pairs into a closed epoch's row, as if its windows had
    brought them (script mode's end-of-epoch reports, which come after the epoch closed)."""
    part = stats.per_rank.get(rank)
    if part is None:
        return  # it trained nothing of this epoch: its values have no weight in the row
    for key, (total, count) in scalars.items():
        acc = part.scalars.setdefault(key, [0.0, 0.0])
        acc[0] += total
        acc[1] += count
    stats.scalars = fold_scalars(stats.per_rank, reductions)
