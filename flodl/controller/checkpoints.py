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

The save path is this run's alone: ``claim`` locks ``<stem>.lock`` before
anything starts (a second run on the stem is refused, naming the holder) and
``release`` gives it back at the end. A commit deletes only files of this
run's saves and of the sidecar it replaced; a save that fails has its files
deleted, and every failure says which bundle on disk is the newest valid one
(``newest``), the one ``--resume-from`` would load.

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

from ..checkpoint.files import CheckpointBundle, CheckpointError, data_files, new_tag, read_sidecar, remove_tag
from ..checkpoint.lock import SaveLock, SavePathBusy
from ..checkpoint.meta import write_meta
from ..config import DdpRunConfig
from ..errors import ConfigError
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

    _lock: SaveLock | None = None  # the save path's, from ``claim`` to ``release``
    #: The newest bundle on disk at the stem, the one a resume would load (``newest``); None: none.
    newest_bundle: dict[str, Any] | None = None

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
        self.tags: set[str] = set()  # of every save this run asked for: a commit deletes only their files
        self.unsaved: list[dict[str, Any]] = []  # bundle saves that did not commit, for the summary

    # ---------------------------------------------------------------- whose

    def claim(self, run_id: str) -> None:
        """Lock the save path for this run, before anything starts, and note the bundle already there.

        Raises:
            ConfigError: another run holds it (naming that run), or its folder cannot take the lock file.
        """
        if not self.stem:
            return
        try:
            self._lock = SaveLock.take(self.stem, run_id)
        except SavePathBusy as exc:
            raise ConfigError(
                "save_path",
                f"{exc}. Two runs on one save path would replace and delete each other's bundles: "
                "give this run another --save-path, or wait for that run to end",
            ) from None
        except OSError as exc:
            raise ConfigError("save_path", f"cannot create the lock file {self.stem}.lock ({exc})") from None
        self.newest_bundle = _on_disk(CheckpointBundle.at(self.stem))

    def release(self) -> None:
        """The run is over: the save path is free for another."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def newest(self) -> str:
        """Which bundle on disk a resume would load, in words (for every failed save's message)."""
        last = self.newest_bundle
        if last is None:
            return f"no bundle of {self.stem} is on disk (nothing to resume from)"
        whose = "this run's" if last["this_run"] else f"an earlier run's ({last['run_id'] or 'unknown run'})"
        return (
            f"the newest valid bundle is {self.stem}, {whose} save with {last['epoch']} epoch(s) complete "
            f"(tag {last['tag'] or 'none'}, reason {last['save_reason']}): --resume-from {self.stem} continues from it"
        )

    def final_failure(self) -> str:
        """Why the final bundle is not on disk, and which bundle is."""
        why = next((u["error"] for u in reversed(self.unsaved) if u["reason"] == "final"), "no rank answered")
        return f"the final save to {self.stem} failed ({why}); {self.newest()}"

    def saved(self, reason: str) -> bool:
        """Whether a bundle saved for ``reason`` (``final``) was committed in this run."""
        return any(w["reason"] == reason for w in self.written)

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
        self.tags.add(save.tag)
        return m.SaveCheckpoint(version=self.version, stem=stem, tag=save.tag, reason=reason, epoch=epoch, call_fn=call_fn)

    def request_shutdown_save(self, *, rank: int, reason: str, meta: dict[str, Any]) -> str:
        """ShutdownWithSave: ``rank`` writes when the Shutdown reaches it; returns the files' tag."""
        save = self.pending[SHUTDOWN_SAVE] = PendingSave(SHUTDOWN_SAVE, rank, reason, self.stem, meta, new_tag())
        self.tags.add(save.tag)
        return save.tag

    def on_done(self, msg: m.CheckpointDone) -> bool:
        """A rank finished its part; commit the sidecar. True if a bundle was committed."""
        save = self.pending.pop(msg.version, None)
        if save is None or msg.rank != save.rank:
            return False
        error = msg.error
        if error:
            self.failed.append(error)
        if not save.stem:  # checkpoint_fn alone: no bundle was asked for
            if error:
                self._told_failed(save, msg.rank, error, bundle=False)
            return False
        bundle = CheckpointBundle.at(save.stem)
        if not msg.model_sha256 or not msg.optim_sha256:
            # nothing (complete) to commit: the previous bundle stays the bundle, and what the rank
            # left of this save's files goes (it has answered: it writes no more of them)
            remove_tag(bundle, save.tag)
            self._told_failed(save, msg.rank, error or "the rank reported no checksums", bundle=True)
            return False
        busy = [s.tag for s in self.pending.values() if s.stem == save.stem]
        try:
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
                owned=self.tags,
            )
        except OSError as exc:  # the sidecar could not be written (disk full): the save's files are no bundle
            remove_tag(bundle, save.tag)
            self.failed.append(f"committing {bundle.meta}: {exc}")
            self._told_failed(save, msg.rank, f"committing {bundle.meta}: {type(exc).__name__}: {exc}", bundle=True)
            return False
        if error:  # the files were saved, the task's checkpoint_fn failed
            self._told_failed(save, msg.rank, error, bundle=False)
        self.newest_bundle = {
            "tag": save.tag,
            "epoch": save.meta["epoch"],
            "save_reason": save.reason,
            "run_id": save.meta.get("run_id", ""),
            "this_run": True,
        }
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

    def _told_failed(self, save: PendingSave, rank: int, error: str, *, bundle: bool) -> None:
        """Say a save failed; one whose bundle did not commit also says which bundle is the newest on disk."""
        if not bundle:
            log.warning("checkpoint %s on rank %d failed: %s (training goes on)", save.reason, rank, error)
            self.say(f"checkpoint failed on rank {rank}: {error}")
            return
        self.unsaved.append({"version": save.version, "reason": save.reason, "epoch": save.meta["epoch"], "rank": rank, "error": error})
        log.warning("checkpoint %s on rank %d failed: %s; %s", save.reason, rank, error, self.newest())
        self.say(f"checkpoint failed on rank {rank}: {error}; {self.newest()}")

    def rank_died(self, rank: int) -> list[PendingSave]:
        """Saves that rank will never finish (the caller re-asks another rank)."""
        lost = [s for s in self.pending.values() if s.rank == rank and s.version != SHUTDOWN_SAVE]
        for s in lost:
            del self.pending[s.version]
        return lost

    def waiting(self, version: int) -> bool:
        return version in self.pending


def _on_disk(bundle: CheckpointBundle) -> dict[str, Any] | None:
    """The bundle already at the stem when the run starts (its sidecar, and both files it names
    present), as ``Checkpointer.newest_bundle`` records one; None if there is none or it is torn."""
    try:
        meta = read_sidecar(bundle)
        files = data_files(bundle, meta)
    except CheckpointError:
        return None
    if not all(path.exists() for path, _ in files.values()):
        return None
    model = files["model"][0].name
    tag = model[len(bundle.stem.name) + 1 : -len(".fdl")] if model != bundle.model.name else ""
    return {
        "tag": tag,
        "epoch": meta.get("epoch"),
        "save_reason": meta.get("save_reason"),
        "run_id": meta.get("run_id", ""),
        "this_run": False,
    }
