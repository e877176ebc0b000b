"""Driving a ``CadenceLoop`` without ranks: every rank trains its window at a given speed, and the
window's reports are folded in (what the controller does when the real ``WindowDone``s arrive)."""

from __future__ import annotations

from flodl.plan.cadence import CadenceLoop
from flodl.plan.metrics import EpochCounters
from flodl.wire import messages as m


def fold_window(
    loop: CadenceLoop,
    number: int,
    ms_per_batch: dict[int, float],
    dead_batches: dict[int, int] | None = None,
    overhead_ms: dict[int, float] | None = None,
    dropped: dict[int, int] | None = None,
    closed: list | None = None,
) -> dict[int, int]:
    """Each rank trains its grants up to its batch quota (all of them without one) at its
    ms/batch; the reports are folded in. Returns the batches each rank trained. A rank in
    ``dead_batches`` died in the window: it reports nothing, having sent TimingMsgs for that
    many batches. ``overhead_ms``: a rank's own wall per batch outside its compute (bookkeeping).
    ``dropped``: the earlier window whose background average a rank reports it gave up.
    ``closed``: the rows of the epochs the window closed are appended to it."""
    reports, bs = {}, loop.dispatcher.batch_size
    for rank, plan in loop.plans[number].items():
        if dead_batches and rank in dead_batches:
            continue
        batches = -(-plan.samples // bs)
        if plan.quota_batches:
            batches = min(batches, plan.quota_batches)
        consumed = min(plan.samples, batches * bs)
        reports[rank] = m.WindowDone(
            rank=rank,
            window=number,
            batches=batches,
            consumed=consumed,
            loss_sum=batches * 0.5,
            compute_ms=batches * ms_per_batch[rank],
            data_ms=0.0,
            sync_ms=1.0,
            wall_ms=batches * (ms_per_batch[rank] + (overhead_ms or {}).get(rank, 0.0)) + 1.0,  # + the average's 1 ms
            divergence=None,
            pre_norm=None,
            post_norm=None,
            lr=0.1,
            epochs=_rows(plan, consumed, batches, ms_per_batch[rank]),
            scalars={},
            regrouped_at=-1,
            dropped=(dropped or {}).get(rank, -1),
            res={},
            data={},
        )
    rows = loop.on_reports(number, reports, now=float(number + 1), dead_batches=dead_batches)
    if closed is not None:
        closed.extend(rows)
    return {rank: r.batches for rank, r in reports.items()}


def _rows(plan, consumed: int, batches: int, ms: float) -> list[list[float]]:
    """The report's per-epoch rows, as a rank splits them: each epoch its samples, the batches
    shared in proportion (the first epoch touched takes any rounding)."""
    per_epoch: dict[int, int] = {}
    for grant, used in plan.consumed_per_grant(consumed):
        if used:
            per_epoch[grant.epoch] = per_epoch.get(grant.epoch, 0) + used
    if not per_epoch:
        first = min((g.epoch for g in plan.grants), default=0)
        return [EpochCounters(batches, 0, batches * 0.5, batches * ms).row(first)]
    shares = {e: batches * n // consumed for e, n in per_epoch.items()}
    first = min(per_epoch)
    shares[first] += batches - sum(shares.values())
    return [EpochCounters(shares[e], n, shares[e] * 0.5, shares[e] * ms).row(e) for e, n in sorted(per_epoch.items())]
