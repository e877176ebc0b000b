"""Saving: checkpoints asked of a rank, ShutdownWithSave, and Ctrl-C.

``Saving`` asks the elected rank for each checkpoint with the trajectory
captured now (the bookkeeping of requests and versions is ``Checkpointer``'s,
checkpoints.py): the rank writes the bundle, the controller the sidecar (the
trajectory: coverage, ElChe state, steps) a run resumes from.
"""

from __future__ import annotations

import signal

from .. import __version__
from ..checkpoint.meta import progress_text
from ..errors import EXIT_INTERRUPTED, EXIT_SAVED
from ..wire import messages as m
from ..wire.codec import Envelope
from .context import RunContext
from .phase import Phase
from .training import Training

CHECKPOINT_WAIT_S = 120.0  # a rank writing a large model to slow storage


class Saving:
    """Checkpoints and saves on the way out; owns which save a shutdown waits for."""

    def __init__(self, ctx: RunContext, *, training: Training) -> None:
        self.ctx = ctx
        self.training = training
        self.shutdown_save: tuple[str, int, str] | None = None  # ShutdownWithSave: (stem, writer rank, file tag)

    def _trajectory(self) -> dict:
        """Where the run stands now, for a sidecar; coverage first, before parameters move on."""
        loop = self.training.loop
        return {
            "epoch": loop.lowest_open_epoch,
            "global_step": loop.global_step,
            "sync_round": loop.syncs,
            "world_at_save": len(self.ctx.members.live_ranks()),
            "mode": self.ctx.config.elche.mode.name,
            "run_id": self.ctx.run_id,
            "flodl_version": __version__,
            "param_count": self.training.task.param_count,
            "elche_state": loop.elche.state_dict(),
            "coverage": loop.coverage(),
        }

    def _remind_shared_storage(self) -> None:
        self.ctx.checkpoints.remind_shared_storage({w.host for w in self.ctx.members.workers.values()})

    def checkpoint_now(self, reason: str, *, call_fn: bool, files: bool = True) -> int:
        """Ask the elected rank for a checkpoint; returns its version."""
        self._remind_shared_storage()
        rank = self.training.eval_rank()
        epoch = self.training.loop.lowest_open_epoch
        msg = self.ctx.checkpoints.request(rank=rank, reason=reason, epoch=epoch, meta=self._trajectory(), call_fn=call_fn, files=files)
        self.ctx.plane.send_rank(rank, msg)
        return msg.version

    async def checkpoint(self, reason: str, *, call_fn: bool, wait: bool = False) -> None:
        version = self.checkpoint_now(reason, call_fn=call_fn)
        if wait:
            await self.ctx.run.until(lambda: not self.ctx.checkpoints.waiting(version), CHECKPOINT_WAIT_S, "the checkpoint to be written")

    def on_checkpoint_done(self, identity: bytes, env: Envelope, msg: m.CheckpointDone) -> None:
        if self.ctx.checkpoints.on_done(msg):
            last = self.ctx.checkpoints.written[-1]
            where = progress_text(last["epoch"], self.training.total_epochs)
            self.ctx.console.line(f"checkpoint ({last['reason']}): {where} -> {last['stem']}")
            now = self.ctx.clock()
            self.ctx.monitor.span(
                "checkpoint", start_s=now - msg.elapsed_ms / 1000.0, end_s=now, rank=msg.rank, args={"reason": last["reason"]}
            )
            self.ctx.monitor.event(
                "checkpoint", f"checkpoint ({last['reason']}): {where}, written by rank {msg.rank}", rank=msg.rank, now_s=now
            )
        self.ctx.run.changed()

    def save_and_stop(self, message: str, reason: str, code: int = EXIT_SAVED) -> None:
        """ShutdownWithSave: the run stops here; a survivor writes the bundle on its way out."""
        self._remind_shared_storage()
        rank = self.training.eval_rank()
        tag = self.ctx.checkpoints.request_shutdown_save(rank=rank, reason=reason, meta=self._trajectory())
        self.shutdown_save = (self.ctx.checkpoints.stem, rank, tag)
        self.ctx.run.fail(message, code)

    def final_on_shutdown(self) -> tuple[str, int, str]:
        """The final bundle, written by the elected rank on its way out, after the clean end's full
        average (``--sync-fragments``: docs/fragments.md); ``(stem, rank, tag)`` for the Shutdown."""
        self._remind_shared_storage()
        rank = self.training.eval_rank()
        tag = self.ctx.checkpoints.request_shutdown_save(rank=rank, reason="final", meta=self._trajectory())
        return self.ctx.checkpoints.stem, rank, tag

    def on_signal(self, sig: int) -> None:
        """Ctrl-C / SIGTERM: stop, keeping the work where there is some; the message says which
        (an interrupt is the user's choice, told as information, not an error)."""
        message = f"interrupted by {signal.Signals(sig).name}"
        if self.ctx.run.failure is not None:
            return  # already stopping: the first reason stands
        if self.ctx.checkpoints.stem and self.ctx.run.phase is Phase.TRAINING and self.training.cadence is not None:
            # Ctrl-C keeps the work: resume later
            self.save_and_stop(f"{message}; saving the run to {self.ctx.checkpoints.stem}", "interrupted", EXIT_INTERRUPTED)
        elif self.ctx.checkpoints.stem:
            self.ctx.run.fail(f"{message} before training began; nothing was saved", EXIT_INTERRUPTED)
        else:
            self.ctx.run.fail(f"{message}; nothing was saved (no --save-path)", EXIT_INTERRUPTED)
