"""Teardown: the embedded worker's supervision, peers leaving, and stopping every peer in order.

``Teardown`` owns the local worker's process and what peers say as they
leave. A clean end sends ``Shutdown`` and waits (bounded) for every peer to
go; a failure sends ``Shutdown(abort=True)`` (naming the rank that writes
the ShutdownWithSave bundle, if any) and waits for that save too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from ..config.env import PARENT_PID, STORE_BIND, STORE_FILE, child_environ, credentials_env
from ..errors import EXIT_FAILED, EXIT_RANK_LOST, EXIT_SAVED, RunAborted
from ..host.proc import terminate_then_kill
from ..plan.membership import PeerState, describe_exit
from ..wire import messages as m
from ..wire.codec import Envelope
from .admission import Admission
from .checkpoints import SHUTDOWN_SAVE
from .context import RunContext
from .phase import Phase
from .saving import CHECKPOINT_WAIT_S, Saving

log = logging.getLogger("flodl.controller")

SHUTDOWN_WAIT_S = 40.0
ABORT_WAIT_S = 10.0


class Teardown:
    """The local worker's life, and the end of every peer's."""

    def __init__(self, ctx: RunContext, *, admission: Admission, saving: Saving) -> None:
        self.ctx = ctx
        self.admission = admission
        self.saving = saving
        self.worker_proc: asyncio.subprocess.Process | None = None
        self.final_digests: dict[int, str] = {}  # rank -> sha256 of its parameters at a clean exit

    async def embedded_worker(self) -> None:
        """Start the local worker and treat its unexpected exit as a failure."""
        cmd = [sys.executable, "-m", "flodl.worker", "--controller", self.ctx.plane.address]
        if self.ctx.launch.nproc_per_node is not None:
            cmd += ["--nproc", str(self.ctx.launch.nproc_per_node)]
        if self.ctx.launch.devices:
            cmd += ["--devices", self.ctx.launch.devices]
        extra = {**credentials_env(self.ctx.secret, self.ctx.run_id), PARENT_PID: str(os.getpid())}
        if self.ctx.plane.store_file is not None:  # it hosts the run's store (plane.py)
            extra.update({STORE_FILE: str(self.ctx.plane.store_file), STORE_BIND: self.ctx.launch.bind})
        env = child_environ(extra)
        # its own session: a terminal's Ctrl-C reaches the controller alone, which
        # then stops everyone in order instead of racing the children's deaths
        self.worker_proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
        code = await self.worker_proc.wait()
        if self.ctx.run.ended:
            return
        pid = self.worker_proc.pid
        if self._goes_on_without_local_worker(pid, f"went with its worker (pid {pid}), which {describe_exit(code)}"):
            return
        self.ctx.run.fail(
            f"the local worker (pid {pid}) {describe_exit(code)} before the run finished", EXIT_RANK_LOST if code else EXIT_FAILED
        )

    def _goes_on_without_local_worker(self, pid: int, why: str) -> bool:
        """The local worker is gone, like any lost host: when other hosts' ranks still train, its
        ranks die ``why`` and the run goes on with the others. Not when the run's store lives in
        that worker's zygote (a collective run started here): no group could form again."""
        local = next((w for w in self.ctx.members.workers.values() if w.pid == pid and not w.exited), None)
        if local is None or self.ctx.plane.store_file is not None:
            return False
        if not [r for r in self.ctx.members.live_ranks() if r.rank not in local.ranks and r.rank not in self.admission.joiners]:
            return False  # nothing else trains (a joiner still starting holds nothing of the run's)
        lost = self.ctx.members.worker_lost(local.sender, why)
        log.warning("the local worker (pid %d) is gone; ranks %s with it, the other hosts' ranks go on", pid, lost)
        self.ctx.run.changed()
        return True

    async def stop_worker(self) -> None:
        """The local worker, if it outlived the run, is stopped (terminate, then kill)."""
        if self.worker_proc is not None and self.worker_proc.returncode is None:
            await terminate_then_kill([self.worker_proc], 3.0)

    def on_exiting(self, identity: bytes, env: Envelope, msg: m.Exiting) -> None:
        if msg.rank >= 0:
            self.ctx.members.rank_left(msg.rank)
            if msg.digest:
                self.final_digests[msg.rank] = msg.digest
        else:
            self.ctx.members.worker_gone(env.sender)
        self.ctx.run.changed()

    def _broadcast_shutdown(self, msg: m.Shutdown | m.ShutdownWithSave) -> None:
        """To every worker and every rank that ever said hello, dead ones included:
        a rank we gave up on may still be listening and can exit on its own."""
        identities = [w.identity for w in self.ctx.members.workers.values() if not w.exited]
        identities += [r.identity for r in self.ctx.members.ranks.values() if r.identity and r.state is not PeerState.EXITED]
        self.ctx.plane.send_all(msg, identities)

    def _fence_unheard(self) -> None:
        """Ranks that never said hello are still importing torch or building their task: they would
        hear the abort only once done, and their worker would wait its grace period for them. They
        hold nothing (no replica, no bundle): their workers kill them now. After the Shutdown, so a
        worker knows the kill is the run's end, not a death."""
        for worker in self.ctx.members.workers.values():
            if worker.exited:
                continue
            for rank in worker.ranks:
                info = self.ctx.members.ranks.get(rank)
                if info is not None and not info.identity and info.exit_code is None:
                    self.ctx.plane.send(m.Fence(rank=rank, reason="the run stopped before it joined"), worker.identity)

    async def shutdown_peers(self, save: tuple[str, int, str] | None = None) -> None:
        """Clean end: Shutdown to everyone, then wait (bounded) for them to leave; ``save``: the
        final bundle's ``(stem, rank, tag)``, written by that rank on its way out (a ShutdownWithSave
        of a run that did not fail: ``--sync-fragments``, whose last average is the Shutdown's)."""
        self.ctx.run.to(Phase.SHUTTING_DOWN)
        # a rank still starting (a late worker's, a healing restart) would not hear the Shutdown
        # until it said hello: its worker would wait out its whole grace period for it
        self.admission.drop_all_joiners("the run ended before it joined")
        reason = "run complete"
        self._broadcast_shutdown(m.ShutdownWithSave(reason, False, *save) if save else m.Shutdown(reason=reason, abort=False))
        await self._wait_peers_gone(SHUTDOWN_WAIT_S + (CHECKPOINT_WAIT_S if save else 0.0))
        self.ctx.run.to(Phase.DONE)

    async def abort(self, exc: RunAborted) -> None:
        """Failure: tell everyone to stop now, then wait (bounded) for them to go; a ShutdownWithSave
        that did not complete turns its exit code into a lost rank's."""
        self.ctx.run.to(Phase.ABORTING)
        self.ctx.run.mark_finished()
        self.ctx.console.failed(str(exc))
        stem, writer, tag = self.saving.shutdown_save or ("", -1, "")
        if self.ctx.plane.endpoint is not None:
            reason = str(exc)[:500]
            stop = m.ShutdownWithSave(reason, True, stem, writer, tag) if stem else m.Shutdown(reason=reason, abort=True)
            self._broadcast_shutdown(stop)
            self._fence_unheard()
        await self._wait_peers_gone(ABORT_WAIT_S + (CHECKPOINT_WAIT_S if stem else 0.0))
        if stem:
            if self.ctx.checkpoints.written and self.ctx.checkpoints.written[-1]["version"] == SHUTDOWN_SAVE:
                self.ctx.console.line(
                    f"saved the run to the bundle {stem} (sidecar {stem}.meta.json); continue it with --resume-from {stem}"
                )
            else:
                if exc.exit_code == EXIT_SAVED:
                    exc.exit_code = EXIT_RANK_LOST
                self.ctx.console.line(
                    f"the save to {stem} did not complete: {'; '.join(self.ctx.checkpoints.failed) or 'no answer from rank ' + str(writer)}; "
                    f"{self.ctx.checkpoints.newest()}"
                )
        self.ctx.run.to(Phase.DONE)

    async def _wait_peers_gone(self, timeout_s: float) -> None:
        def gone() -> bool:
            if self.worker_proc is not None and self.worker_proc.returncode is not None:
                return True  # the local worker is gone, and its ranks died with it (PDEATHSIG)
            # a worker that left stopped its ranks first (or they died with it): no word will come from them
            with_worker = {r for w in self.ctx.members.workers.values() if w.exited for r in w.ranks}
            ranks = all(
                r.rank in with_worker or r.state in (PeerState.EXITED, PeerState.DEAD) or r.exit_code is not None
                for r in self.ctx.members.ranks.values()
            )
            if self.worker_proc is not None:
                return ranks and self.worker_proc.returncode is not None
            # a worker silent past the heartbeat timeout is a lost host (what stopped the run, often):
            # it will say no goodbye, so waiting for one only adds the whole bound to the run's end
            silent = {w.sender for w in self.ctx.members.silent_workers(self.ctx.clock())}
            return ranks and all(w.exited or w.sender in silent for w in self.ctx.members.workers.values())

        deadline = self.ctx.clock() + timeout_s
        while not gone() and self.ctx.clock() < deadline:
            await self.ctx.run.next_change(0.2)
        if not gone():
            log.warning("peers still running %.0f s after shutdown; stopping the local worker", timeout_s)
