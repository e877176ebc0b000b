"""The run summary: what ``--summary-json`` writes and ``Trainer.run()`` returns.

A mixin of ``Controller`` (core.py), which holds the state it reads.
"""

from __future__ import annotations

from ..membership import PeerState


class RunSummary:
    """One dict that says what the run did."""

    def summary(self, exit_reason: str, exit_code: int) -> dict:
        """The run summary (also ``--summary-json`` and ``Trainer.run()``'s result)."""
        wall = max(0.0, (self.finished_at or self.clock()) - self.started_at)
        samples = sum(s.samples for s in self.history)
        per_rank: dict[int, dict] = {}
        for rank, info in sorted(self.members.ranks.items()):
            per_rank[rank] = {"rank": rank, "host": info.host, "device": info.device, "pid": info.pid, "samples": 0, "batches": 0, "sync_ms": 0.0}
        for stats in self.history:
            for rank, part in stats.per_rank.items():
                row = per_rank.setdefault(rank, {"rank": rank, "samples": 0, "batches": 0, "sync_ms": 0.0})
                row["samples"] += part.samples
                row["batches"] += part.batches
                row["sync_ms"] += part.sync_ms
        last = self.history[-1] if self.history else None
        has_eval = self.task_info is not None and self.task_info.has_eval
        final_eval = self.evals.get(self.total_epochs - 1)
        eval_s = sum(e.elapsed_ms for e in self.evals.values()) / 1000.0
        train_wall = max(1e-9, wall - eval_s)
        return {
            "run_id": self.run_id,
            "mode": self.config.elche.mode.name,
            "world_size": self.members.world_size,
            "epochs": self.total_epochs,
            "epochs_completed": len(self.history),
            "wall_s": wall,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            # evals pause training on every rank; without them, what training alone sustained
            "eval_s": eval_s,
            "train_samples_per_s": samples / train_wall if samples else 0.0,
            "samples": samples,
            "per_rank": list(per_rank.values()),
            # a window that straddles two epochs counts in both epochs' rows, once here
            "syncs": self.cadence.syncs if self.cadence else 0,
            "final_loss": last.avg_loss if last else None,
            "final_eval": final_eval.value if final_eval else None,
            "eval_metric_name": self.task_info.eval_metric if has_eval else None,
            "history": [s.to_dict() for s in self.history],
            "deaths": [
                {"rank": r.rank, "host": r.host, "pid": r.pid, "reason": r.death}
                for r in self.members.ranks.values()
                if r.state is PeerState.DEAD
            ],
            "recoveries": self.recoveries,
            "restarts": self.restarts,
            "joins": self.joins,
            "checkpoints": self.checkpoints.written,
            "regranted_samples": self.cadence.regranted if self.cadence else 0,
            "data": {str(r): row for r, row in sorted(self.data_stats.items())},
            "resumed_from": self.config.resume_from and str(self.config.resume_from),
            "final_digests": {str(r): d for r, d in sorted(self.final_digests.items())},
            "generation": self.members.generation,
            "exit_reason": exit_reason,
            "exit_code": exit_code,
            "dropped_frames": dict(self.endpoint.drops) if self.endpoint else {},
            # message handlers that raised (a flodl bug; logged with its traceback): run_controller reports them
            "handler_errors": (self.endpoint.io.handler_errors if self.endpoint else 0)
            + (self.averaging.io.handler_errors if self.averaging else 0),
            "config": self.config.to_dict(),
            "cadence": self.cadence.telemetry() if self.cadence else None,
            "averaging": self.averaging.telemetry() if self.averaging else None,
        }
