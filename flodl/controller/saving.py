"""Saving: checkpoints, ShutdownWithSave, and resuming a saved run.

A mixin of ``Controller`` (core.py), which holds all the state these methods
read and write; the bookkeeping of requests and versions is ``Checkpointer``'s
(checkpoints.py). The elected rank writes the bundle, the controller the
sidecar (the trajectory: coverage, ElChe state, steps) it resumes from.
"""

from __future__ import annotations

import logging
import signal

from .. import __version__
from ..errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_SAVED, RunAborted
from ..protocol import messages as m
from ..protocol.codec import Envelope
from .cadence import CadenceLoop

log = logging.getLogger("flodl.controller")

CHECKPOINT_WAIT_S = 120.0  # a rank writing a large model to slow storage


class Saving:
    """Checkpoints, saves on shutdown, resume."""

    def _seed(self) -> int:
        """A resumed run keeps the saved run's shuffle, whatever --seed says."""
        return int(self.resume_meta["coverage"]["seed"]) if self.resume_meta is not None else self.launch.seed

    def _resume(self, loop: CadenceLoop) -> None:
        """Continue the bundle's trajectory: only what it had not trained is planned."""
        meta, info = self.resume_meta, self.task_info
        cov = meta["coverage"]
        for field_name, mine in (("dataset_len", info.dataset_len), ("batch_size", info.batch_size)):
            if int(cov[field_name]) != mine:
                raise RunAborted(f"resume_from {self.config.resume_from}: the bundle was saved with {field_name} "
                                 f"{cov[field_name]}, this task has {mine}; resume the same task", EXIT_CONFIG)
        if int(cov["epochs"]) != self.total_epochs:
            log.warning("resume: the bundle planned %s epochs, this run %d", cov["epochs"], self.total_epochs)
        loop.restore(meta)
        self._remind_shared_storage()
        self.global_step = loop.global_step
        for field_name, mine in (("augment", self.config.augment), ("epoch_splits", self.config.epoch_splits)):
            if int(cov.get(field_name, 1)) != mine:
                raise RunAborted(f"resume_from {self.config.resume_from}: the bundle was saved with {field_name} "
                                 f"{cov.get(field_name, 1)}, this run has {mine}; resume with the same schedule", EXIT_CONFIG)
        left = sum(s for item in cov["open"] for _, s in item["uncovered"])
        left += sum(self.schedule.epoch_len(e) for e in range(int(cov["next_epoch"]), self.total_epochs))
        self.console.line(f"resuming {self.config.resume_from}: epoch {meta['epoch']}, global step {meta['global_step']}, "
                          f"{left:,} samples left to train ({meta['save_reason']})")

    def _trajectory(self) -> dict:
        """Where the run stands now, for a sidecar; coverage first, before parameters move on."""
        loop = self.cadence
        return {
            "epoch": loop.lowest_open_epoch, "global_step": loop.global_step, "sync_round": loop.syncs,
            "world_at_save": len(self.members.live_ranks()), "mode": self.config.elche.mode.name,
            "run_id": self.run_id, "flodl_version": __version__, "param_count": self.task_info.param_count,
            "elche_state": loop.elche.state_dict(), "coverage": loop.coverage(),
        }

    def _remind_shared_storage(self) -> None:
        hosts = {w.host for w in self.members.workers.values()}
        if len(hosts) > 1 and not self._storage_reminded:
            self._storage_reminded = True
            self.console.line(f"note: the bundle {self.checkpoints.stem or self.config.resume_from} is written by a rank on its "
                              "host and the sidecar by the controller on this one: it must be on storage every host sees")

    def _checkpoint_now(self, reason: str, *, call_fn: bool, files: bool = True) -> int:
        """Ask the elected rank for a checkpoint; returns its version."""
        self._remind_shared_storage()
        rank = self._eval_rank()
        epoch = self.cadence.lowest_open_epoch
        msg = self.checkpoints.request(rank=rank, reason=reason, epoch=epoch, meta=self._trajectory(), call_fn=call_fn, files=files)
        self._send_rank(rank, msg)
        return msg.version

    async def _checkpoint(self, reason: str, *, call_fn: bool, wait: bool = False) -> None:
        version = self._checkpoint_now(reason, call_fn=call_fn)
        if wait:
            await self._until(lambda: not self.checkpoints.waiting(version), CHECKPOINT_WAIT_S, "the checkpoint to be written")

    def _h_checkpoint_done(self, identity: bytes, env: Envelope, msg: m.CheckpointDone) -> None:
        if self.checkpoints.on_done(msg):
            last = self.checkpoints.written[-1]
            self.console.line(f"checkpoint ({last['reason']}) at epoch {last['epoch']} -> {last['stem']}")
            now = self.clock()
            self.monitor.span("checkpoint", start_s=now - msg.elapsed_ms / 1000.0, end_s=now, rank=msg.rank, args={"reason": last["reason"]})
            self.monitor.event("checkpoint", f"checkpoint ({last['reason']}) at epoch {last['epoch']} written by rank {msg.rank}", rank=msg.rank, now_s=now)
        self._changed.set()

    def _save_and_stop(self, message: str, reason: str, code: int = EXIT_SAVED) -> None:
        """ShutdownWithSave: the run stops here; a survivor writes the bundle on its way out."""
        self._remind_shared_storage()
        rank = self._eval_rank()
        tag = self.checkpoints.request_shutdown_save(rank=rank, reason=reason, meta=self._trajectory())
        self.shutdown_save = (self.checkpoints.stem, rank, tag)
        self._fail(message, code)

    def _on_signal(self, sig: int) -> None:
        message = f"interrupted by {signal.Signals(sig).name}"
        if self.checkpoints.stem and self.phase == "training" and self.cadence is not None and self.failure is None:
            self._save_and_stop(message, "interrupted", EXIT_INTERRUPTED)  # Ctrl-C keeps the work: resume later
        else:
            self._fail(message, EXIT_INTERRUPTED)
