"""The run summary: what ``--summary-json`` writes and ``Trainer.run()`` returns.

``summarize`` only reads: each part of the controller owns what it reports.
"""

from __future__ import annotations

import time

from ..config.env import summary_history_bytes
from ..plan.cadence import CadenceLoop
from ..plan.membership import PeerState
from ..wire import messages as m
from .admission import Admission
from .context import RunContext
from .history import HISTORY_BYTES, bounded
from .liveness import Liveness
from .teardown import Teardown
from .training import Training


def _coverage(info: m.RankHello | None, cadence: CadenceLoop | None) -> dict | None:
    """The ledger's grain (a sample, or a shard of a ``Shards`` dataset) and, for shards, what it
    settled: each shard of a completed epoch trained whole, once, or given back whole. One
    exception is counted, not hidden: a rank that died after its window's last average but
    before its report had its shards averaged in, and they are trained again (``maybe_repeated``;
    docs/data.md says what neither grain can see)."""
    if info is None or cadence is None:
        return None
    out: dict = {"grain": info.grain, "positions_per_epoch": cadence.schedule.epoch_len(0)}
    if info.grain == "shard":
        out["guarantee"] = "exactly-once" if cadence.maybe_repeated == 0 else "at-least-once"
        out["maybe_repeated"] = cadence.maybe_repeated
    return out


def sync_bytes(config_kind: str, per_rank: dict[int, dict[str, int]]) -> dict:
    """What the run's averages put on the network (docs/compression.md): each rank's bytes sent and
    received and its averages, as its last report counted them (a collective's by a ring's count),
    the consensus broadcasts apart (``broadcast``: the start, joins), and ``per_average``: the
    bytes every rank sends for one average, summed over the ranks; ``peak_per_average``: the most
    one average sent, summed likewise."""
    ranks = {r: row for r, row in per_rank.items() if row.get("sync_averages")}
    return {
        "compression": config_kind,
        "sent": sum(row.get("sync_sent_bytes", 0) for row in ranks.values()),
        "received": sum(row.get("sync_recv_bytes", 0) for row in ranks.values()),
        "broadcast": sum(row.get("sync_broadcast_bytes", 0) for row in ranks.values()),
        "per_average": sum(row.get("sync_sent_bytes", 0) / row["sync_averages"] for row in ranks.values()) if ranks else None,
        # the most one average sent, summed over the ranks (``--sync-fragments``: a fragment's; docs/fragments.md)
        "peak_per_average": sum(row.get("sync_peak_bytes", 0) for row in ranks.values()) if ranks else None,
    }


def summarize(
    exit_reason: str, exit_code: int, ctx: RunContext, *, admission: Admission, training: Training, liveness: Liveness, teardown: Teardown
) -> dict:
    """One dict that says what the run did (now the end, if the run has not marked one)."""
    run, members, plane, config = ctx.run, ctx.members, ctx.plane, ctx.config
    now = ctx.clock()
    wall = max(0.0, (run.finished_at or now) - run.started_at)
    unix_now = time.time()  # the run's clock is monotonic: its marks in Unix time, for other processes' logs
    trained_from = unix_now - (now - run.started_at)
    history = training.history
    samples = sum(s.samples for s in history)
    per_rank: dict[int, dict] = {}
    for rank, info in sorted(members.ranks.items()):
        per_rank[rank] = {
            "rank": rank,
            "host": info.host,
            "device": info.device,
            "pid": info.pid,
            # the cores it was pinned to (GPU and CPU ranks sharing a host: host/cores.py), "" when unpinned
            "cores": hello.cores if (hello := admission.hellos.get(rank)) is not None else "",
            "samples": 0,
            "batches": 0,
            "sync_ms": 0.0,
        }
    for stats in history:
        for rank, part in stats.per_rank.items():
            row = per_rank.setdefault(rank, {"rank": rank, "samples": 0, "batches": 0, "sync_ms": 0.0})
            row["samples"] += part.samples
            row["batches"] += part.batches
            row["sync_ms"] += part.sync_ms
    for rank, wire in training.sync_bytes.items():
        if wire.get("sync_averages"):
            row = per_rank.setdefault(rank, {"rank": rank, "samples": 0, "batches": 0, "sync_ms": 0.0})
            row.update(wire, sync_bytes_per_average=wire.get("sync_sent_bytes", 0) / wire["sync_averages"])
    last = history[-1] if history else None
    task_info = admission.task_info
    evals = training.evals
    final_eval = evals.get(training.total_epochs - 1)
    eval_s = sum(e.elapsed_ms for e in evals.values()) / 1000.0
    train_wall = max(1e-9, wall - eval_s)
    cadence = training.cadence
    goodput = training.goodput_summary(run.finished_at or now, samples)
    return {
        "run_id": ctx.run_id,
        "mode": config.elche.mode.name,
        "world_size": members.world_size,
        "epochs": training.total_epochs,
        "epochs_completed": sum(len(s.epochs) for s in history),
        "wall_s": wall,
        # the span wall_s measures, in Unix time (to line up with other processes' logs or metrics)
        "trained_unix": [trained_from, trained_from + wall],
        # from the process start (the CLI) or the controller's construction to the first batch trained
        "startup_s": ctx.startup.startup_s,
        "startup": ctx.startup.summary(),
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        # evals pause training on every rank; without them, what training alone sustained
        "eval_s": eval_s,
        "train_samples_per_s": samples / train_wall if samples else 0.0,
        "samples": samples,
        "per_rank": list(per_rank.values()),
        # a window that straddles two epochs counts in both epochs' rows, once here
        "syncs": cadence.syncs if cadence else 0,
        "sync_bytes": sync_bytes(config.sync_compression, training.sync_bytes),
        # the last epoch's own loss (a row that groups epochs one average closed keeps each one's)
        "final_loss": last.epoch_losses.get(last.epoch, last.avg_loss) if last else None,
        "final_eval": final_eval.value if final_eval else None,
        "eval_metric_name": task_info.eval_metric if training.evals_on and task_info is not None else None,
        # whole at both ends, the middle merged: a long run's summary stays small (history.py)
        "history": bounded([s.to_dict() for s in history], budget=summary_history_bytes(HISTORY_BYTES)),
        "history_rows": len(history),
        "deaths": [
            {"rank": r.rank, "host": r.host, "pid": r.pid, "reason": r.death} for r in members.ranks.values() if r.state is PeerState.DEAD
        ],
        "recoveries": liveness.recoveries,
        "restarts": liveness.restarts,
        "joins": admission.joins,
        "checkpoints": ctx.checkpoints.written,
        # bundle saves that did not commit (disk full, a rank's error), and the bundle on disk a resume loads
        "checkpoints_unsaved": ctx.checkpoints.unsaved,
        "newest_bundle": {"stem": ctx.checkpoints.stem, **ctx.checkpoints.newest_bundle} if ctx.checkpoints.newest_bundle else None,
        # samples that count / what the world's full capacity could have trained in the training time, and
        # each fault's lost work and recovery (plan/goodput.py; docs/fault-tolerance.md, *Goodput*)
        "goodput": goodput["goodput"] if goodput else None,
        "goodput_detail": {k: v for k, v in goodput.items() if k != "faults"} if goodput else None,
        "faults": goodput["faults"] if goodput else [],
        "regranted_samples": cadence.regranted if cadence else 0,
        # a dead rank's last window whose average no survivor kept, found after its epoch had closed:
        # trained again (within regranted_samples), but that epoch's eval went without them
        "late_samples": cadence.late if cadence else 0,
        "coverage": _coverage(task_info, cadence),
        "data": {str(r): row for r, row in sorted(training.data_stats.items())},
        "resumed_from": config.resume_from and str(config.resume_from),
        "final_digests": {str(r): d for r, d in sorted(teardown.final_digests.items())},
        "generation": members.generation,
        "exit_reason": exit_reason,
        "exit_code": exit_code,
        "dropped_frames": dict(plane.endpoint.drops) if plane.endpoint else {},
        # message handlers that raised (a flodl bug; logged with its traceback): run_controller reports them
        "handler_errors": (plane.endpoint.io.handler_errors if plane.endpoint else 0)
        + (plane.averaging.io.handler_errors if plane.averaging else 0),
        "config": config.to_dict(),
        "cadence": cadence.telemetry() if cadence else None,
        "averaging": plane.averaging.telemetry() if plane.averaging else None,
    }
