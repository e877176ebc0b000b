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
) -> dict[int, int]:
    """Each rank trains its grants up to its batch quota (all of them without one) at its
    ms/batch; the reports are folded in. Returns the batches each rank trained. A rank in
    ``dead_batches`` died in the window: it reports nothing, having sent TimingMsgs for that
    many batches. ``overhead_ms``: a rank's own wall per batch outside its compute (bookkeeping)."""
    reports, bs = {}, loop.dispatcher.batch_size
    for rank, plan in loop.plans[number].items():
        if dead_batches and rank in dead_batches:
            continue
        batches = -(-plan.samples // bs)
        if plan.quota_batches:
            batches = min(batches, plan.quota_batches)
        consumed = min(plan.samples, batches * bs)
        epochs = sorted({g.epoch for g in plan.grants})
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
            epochs=[EpochCounters(batches, consumed, batches * 0.5, batches * ms_per_batch[rank]).row(e) for e in epochs[:1]],
            scalars={},
            regrouped_at=-1,
            res={},
            data={},
        )
    loop.on_reports(number, reports, now=float(number + 1), dead_batches=dead_batches)
    return {rank: r.batches for rank, r in reports.items()}
