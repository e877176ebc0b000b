"""When a joined rank writes its replica (``Saves``): a consensus checkpoint, a save at a stop, an emergency.

The runner decides when (a ``SaveCheckpoint`` between windows, a
``ShutdownWithSave`` that elects this rank, the controller lost or SIGTERM);
saving.py writes the files. A rank writes at most one bundle on its way out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..wire import messages as m
from .handoff import kept_beside
from .saving import checkpoint, emergency_save

if TYPE_CHECKING:
    from .context import JoinedRun, RankContext
    from .regroup import Group
    from .windows import Windows


class Saves:
    """A joined rank's bundles: what goes in them (the replica, the seams' train state) and when."""

    def __init__(self, ctx: RankContext, run: JoinedRun, group: Group, windows: Windows) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.save_path = run.config.save_path
        self.group = group
        self.windows = windows
        self.replica = windows.replica
        self.saved_on_shutdown = False  # the one bundle a rank writes on its way out is written

    def finish_accumulation(self) -> None:
        """A solo rank carries an accumulation across windows (no average ends them): a save steps it first."""
        self.replica.finish_accumulation(self.windows.steps.global_step)

    def checkpoint(self, cmd: m.SaveCheckpoint) -> None:
        """Write this rank's part of a consensus checkpoint between windows and say so."""
        self.link.doing("save")
        self.finish_accumulation()
        self.group.settle_background()  # the consensus includes the last window's average
        self.ctx.seams.settled()
        done = checkpoint(
            rank=self.ctx.rank,
            model=self.replica.model,
            optimizer=self.replica.optimizer,
            stem=cmd.stem,
            tag=cmd.tag,
            version=cmd.version,
            call_fn=self.replica.task.checkpoint_fn if cmd.call_fn else None,
            handle=self.windows.handle,
            **self._kept(),
        )
        self.ctx.probes.reach("save")  # tests: the files are written, the controller has not committed them
        self.link.send(done)

    def on_shutdown(self, cmd: m.Shutdown | m.ShutdownWithSave) -> None:
        """ShutdownWithSave: the elected survivor writes the model and optimizer files."""
        if not isinstance(cmd, m.ShutdownWithSave) or cmd.save_rank != self.ctx.rank or self.saved_on_shutdown:
            return
        self.saved_on_shutdown = True
        with self.link.saving():  # the link must not hard-exit us mid-write
            self.link.send(
                checkpoint(
                    rank=self.ctx.rank,
                    model=self.replica.model,
                    optimizer=self.replica.optimizer,
                    stem=cmd.save_stem,
                    tag=cmd.save_tag,
                    version=-1,
                    call_fn=None,
                    handle=self.windows.handle,
                    **self._kept(),
                )
            )

    def emergency(self, reason: str, why: str) -> None:
        """No controller to coordinate a consensus bundle: keep this replica (with save_path)."""
        if not self.save_path or self.saved_on_shutdown:
            return
        self.saved_on_shutdown = True
        self.link.hold_exit()  # never released: the process exits once the replica is written
        emergency_save(
            model=self.replica.model,
            optimizer=self.replica.optimizer,
            stem=self.save_path,
            rank=self.ctx.rank,
            reason=reason,
            why=why,
            epoch=max(0, self.windows.current_epoch),
            global_step=self.windows.steps.global_step,
            **self._kept(),
        )

    def _kept(self) -> dict[str, Any]:
        """What the ``.optim`` file keeps beside the optimizer's state: ``train_state`` (schedulers,
        scaler, the script's registered objects; where ``--sync-fragments``' rotation stands) and the
        outer optimizer's state (``outer``)."""
        train_state, outer = kept_beside(self.ctx, self.replica, self.group.outer())
        fragments = self.group.fragment_state()  # where the rotation stands: a resume goes on from there
        if fragments:
            train_state = {**(train_state or {}), **fragments}
        return {"train_state": train_state, "outer": outer}
