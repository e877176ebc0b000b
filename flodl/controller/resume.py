"""Resuming: the bundle's sidecar a run continues from, and the trajectory it takes up.

``Resume`` reads the sidecar before anything starts (``resume_from``), gives
every rank the saved run's shuffle seed, and restores the cadence loop so
only what the bundle had not trained is planned.
"""

from __future__ import annotations

import logging

from ..checkpoint.meta import progress_text, read_meta
from ..errors import EXIT_CONFIG, RunAborted
from ..plan.cadence import CadenceLoop
from ..plan.schedule import Schedule
from ..wire import messages as m
from .context import RunContext

log = logging.getLogger("flodl.controller")


class Resume:
    """The sidecar of ``resume_from`` (None without one) and what it restores."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.meta: dict | None = None

    def load(self) -> None:
        """Read the sidecar, if the run resumes.

        Raises:
            CheckpointError: it cannot be read, or does not match the bundle.
        """
        if self.ctx.config.resume_from:
            self.meta = read_meta(self.ctx.config.resume_from, weights_only=self.ctx.config.resume_weights_only)

    def seed(self) -> int:
        """A resumed run keeps the saved run's shuffle, whatever --seed says."""
        return int(self.meta["coverage"]["seed"]) if self.meta is not None else self.ctx.launch.seed

    def first_epoch(self) -> int:
        """The epoch the run trains first: 0, or the bundle's lowest epoch with positions left."""
        if self.meta is None:
            return 0
        cov = self.meta["coverage"]
        open_epochs = [int(item["epoch"]) for item in cov["open"] if item["uncovered"]]
        return min(open_epochs, default=int(cov["next_epoch"]))

    def apply(self, loop: CadenceLoop, info: m.RankHello, schedule: Schedule, total_epochs: int) -> None:
        """Continue the bundle's trajectory: only what it had not trained is planned.

        Raises:
            RunAborted: the bundle was saved by another task or schedule.
        """
        meta = self.meta
        assert meta is not None  # the conductor applies a resume only when load() read a sidecar
        cov = meta["coverage"]
        for field_name, mine in (("dataset_len", info.dataset_len), ("batch_size", info.batch_size), ("grain", info.grain)):
            if str(cov.get(field_name, "sample")) != str(mine):
                raise RunAborted(
                    f"resume_from {self.ctx.config.resume_from}: the bundle was saved with {field_name} "
                    f"{cov.get(field_name, 'sample')}, this task has {mine}; resume the same task",
                    EXIT_CONFIG,
                )
        if int(cov["epochs"]) != total_epochs:
            log.warning("resume: the bundle planned %s epochs, this run %d", cov["epochs"], total_epochs)
        loop.restore(meta)
        self.ctx.checkpoints.remind_shared_storage({w.host for w in self.ctx.members.workers.values()})
        for field_name, mine in (("augment", self.ctx.config.augment), ("epoch_splits", self.ctx.config.epoch_splits)):
            if int(cov.get(field_name, 1)) != mine:
                raise RunAborted(
                    f"resume_from {self.ctx.config.resume_from}: the bundle was saved with {field_name} "
                    f"{cov.get(field_name, 1)}, this run has {mine}; resume with the same schedule",
                    EXIT_CONFIG,
                )
        left = sum(s for item in cov["open"] for _, s in item["uncovered"])
        left += sum(schedule.epoch_len(e) for e in range(int(cov["next_epoch"]), total_epochs))
        self.ctx.console.line(
            f"resuming {self.ctx.config.resume_from}: {progress_text(int(meta['epoch']), total_epochs)}, global step {meta['global_step']}, "
            f"{left:,} samples left to train ({meta['save_reason']})"
        )
