"""The controller's side of checkpoints: when they are due, who writes, and the sidecar.

A consensus checkpoint is a coverage snapshot taken *now* plus the elected
rank's model and optimizer files, written when that rank next stands between
windows (so its parameters hold at least everything the snapshot calls
trained: a resume may train a few samples twice, never lose one). The
controller picks each save's file tag (``<stem>.<tag>.fdl/.optim``), so it
knows the names without reading the rank's storage; when the rank's
``CheckpointDone`` brings their sha256 it writes ``<stem>.meta.json`` last, as
the commit marker, then deletes the files of older saves (not those of saves
still being written).

Triggers: ``checkpoint_every`` (every k closed epochs; files if ``save_path``,
the task's ``checkpoint_fn`` either way), ``checkpoint_at_epoch`` (one-shot,
the first settled window once epoch e is being trained: coverage mid-epoch),
the final bundle at a clean end, and ShutdownWithSave when the run cannot go on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..checkpoint.files import CheckpointBundle, new_tag
from ..checkpoint.meta import write_meta
from ..config import DdpRunConfig
from ..wire import messages as m

log = logging.getLogger("flodl.controller")

SHUTDOWN_SAVE = -1  # CheckpointDone.version of a ShutdownWithSave


@dataclass
class PendingSave:
    """A checkpoint asked of a rank, with the trajectory captured when it was asked."""

    version: int
    rank: int
    reason: str
    stem: str
    meta: dict[str, Any]
    tag: str  # the data files' name part: <stem>.<tag>.fdl and .optim


class Checkpointer:
    """Decides when checkpoints are due and commits their sidecars."""

    def __init__(self, config: DdpRunConfig, *, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say
        self.stem = os.fspath(config.save_path) if config.save_path else ""
        self.version = 0
        self.pending: dict[int, PendingSave] = {}
        self.at_epoch_armed = config.checkpoint_at_epoch is not None
        self.written: list[dict[str, Any]] = []  # for the summary
        self.failed: list[str] = []
        self._storage_reminded = False

    def remind_shared_storage(self, hosts: set[str]) -> None:
        """Once a run, when its workers span hosts: say where the bundle must live."""
        if len(hosts) > 1 and not self._storage_reminded:
            self._storage_reminded = True
            self.say(
                f"note: the bundle {self.stem or self.config.resume_from} is written by a rank on its "
                "host and the sidecar by the controller on this one: it must be on storage every host sees"
            )

    # ---------------------------------------------------------------- when

    def every_due(self, closed_epoch: int) -> bool:
        k = self.config.checkpoint_every
        if not k:
            return False
        return (closed_epoch + 1) % k == 0

    def at_epoch_due(self, reached_epoch: int) -> bool:
        """One-shot: the cohort trains ``checkpoint_at_epoch`` (or later) now. ``reached_epoch`` is
        the 0-based index; the option counts as the console does (epoch 1 is the first)."""
        at = self.config.checkpoint_at_epoch  # set whenever armed
        if self.at_epoch_armed and at is not None and reached_epoch + 1 >= at:
            self.at_epoch_armed = False
            return True
        return False

    # ---------------------------------------------------------------- what

    def request(self, *, rank: int, reason: str, epoch: int, meta: dict[str, Any], call_fn: bool, files: bool = True) -> m.SaveCheckpoint:
        """Register a checkpoint and return the message for ``rank``."""
        self.version += 1
        stem = self.stem if files else ""
        save = self.pending[self.version] = PendingSave(self.version, rank, reason, stem, meta, new_tag())
        return m.SaveCheckpoint(version=self.version, stem=stem, tag=save.tag, reason=reason, epoch=epoch, call_fn=call_fn)

    def request_shutdown_save(self, *, rank: int, reason: str, meta: dict[str, Any]) -> str:
        """ShutdownWithSave: ``rank`` writes when the Shutdown reaches it; returns the files' tag."""
        save = self.pending[SHUTDOWN_SAVE] = PendingSave(SHUTDOWN_SAVE, rank, reason, self.stem, meta, new_tag())
        return save.tag

    def on_done(self, msg: m.CheckpointDone) -> bool:
        """A rank finished its part; commit the sidecar. True if a bundle was committed."""
        save = self.pending.pop(msg.version, None)
        if save is None or msg.rank != save.rank:
            return False
        if msg.error:
            self.failed.append(msg.error)
            log.warning("checkpoint %s on rank %d failed: %s (training goes on)", save.reason, msg.rank, msg.error)
            self.say(f"checkpoint failed on rank {msg.rank}: {msg.error}")
        if not save.stem or not msg.model_sha256 or not msg.optim_sha256:
            return False  # nothing (complete) to commit: the previous bundle stays the bundle
        bundle = CheckpointBundle.at(save.stem)
        busy = [s.tag for s in self.pending.values() if s.stem == save.stem]
        write_meta(
            bundle,
            {
                **save.meta,
                "save_reason": save.reason,
                "written_by_rank": msg.rank,
                "model_file": bundle.data_file(save.tag, ".fdl").name,
                "model_sha256": msg.model_sha256,
                "optim_file": bundle.data_file(save.tag, ".optim").name,
                "optim_sha256": msg.optim_sha256,
            },
            busy=busy,
        )
        self.written.append(
            {
                "version": save.version,
                "reason": save.reason,
                "epoch": save.meta["epoch"],
                "stem": str(bundle.stem),
                "ms": round(msg.elapsed_ms, 1),
            }
        )
        return True

    def rank_died(self, rank: int) -> list[PendingSave]:
        """Saves that rank will never finish (the caller re-asks another rank)."""
        lost = [s for s in self.pending.values() if s.rank == rank and s.version != SHUTDOWN_SAVE]
        for s in lost:
            del self.pending[s.version]
        return lost

    def waiting(self, version: int) -> bool:
        return version in self.pending
