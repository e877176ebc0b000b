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
from collections.abc import Callable

from ..config.env import PARENT_PID, STORE_BIND, STORE_FILE, child_environ, credentials_env
from ..errors import EXIT_FAILED, EXIT_RANK_LOST, EXIT_SAVED, RunAborted
from ..host.proc import terminate_then_kill
from ..plan.membership import Membership, PeerState, describe_exit
from ..wire import messages as m
from ..wire.codec import Envelope
from .admission import Admission
from .checkpoints import SHUTDOWN_SAVE, Checkpointer
from .console import Console
from .launch import LaunchOptions
from .phase import Phase, RunState
from .plane import ControlPlane
from .saving import CHECKPOINT_WAIT_S, Saving

log = logging.getLogger("flodl.controller")

SHUTDOWN_WAIT_S = 40.0
ABORT_WAIT_S = 10.0


class Teardown:
    """The local worker's life, and the end of every peer's."""

    def __init__(
        self,
        launch: LaunchOptions,
        *,
        members: Membership,
        run: RunState,
        plane: ControlPlane,
        admission: Admission,
        saving: Saving,
        checkpoints: Checkpointer,
        console: Console,
        clock: Callable[[], float],
        secret: bytes,
        run_id: str,
    ) -> None:
        self.launch = launch
        self.members = members
        self.run = run
        self.plane = plane
        self.admission = admission
        self.saving = saving
        self.checkpoints = checkpoints
        self.console = console
        self.clock = clock
        self.secret = secret
        self.run_id = run_id
        self.worker_proc: asyncio.subprocess.Process | None = None
        self.final_digests: dict[int, str] = {}  # rank -> sha256 of its parameters at a clean exit

    async def embedded_worker(self) -> None:
        """Start the local worker and treat its unexpected exit as a failure."""
        cmd = [sys.executable, "-m", "flodl.worker", "--controller", self.plane.address]
        if self.launch.nproc_per_node is not None:
            cmd += ["--nproc", str(self.launch.nproc_per_node)]
        if self.launch.devices:
            cmd += ["--devices", self.launch.devices]
        extra = {**credentials_env(self.secret, self.run_id), PARENT_PID: str(os.getpid())}
        if self.plane.store_file is not None:  # it hosts the run's store (plane.py)
            extra.update({STORE_FILE: str(self.plane.store_file), STORE_BIND: self.launch.bind})
        env = child_environ(extra)
        # its own session: a terminal's Ctrl-C reaches the controller alone, which
        # then stops everyone in order instead of racing the children's deaths
        self.worker_proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
        code = await self.worker_proc.wait()
        if self.run.ended:
            return
        pid = self.worker_proc.pid
        if self._goes_on_without_local_worker(pid, f"went with its worker (pid {pid}), which {describe_exit(code)}"):
            return
        self.run.fail(
            f"the local worker (pid {pid}) {describe_exit(code)} before the run finished", EXIT_RANK_LOST if code else EXIT_FAILED
        )

    def _goes_on_without_local_worker(self, pid: int, why: str) -> bool:
        """The local worker is gone, like any lost host: when other hosts' ranks still train, its
        ranks die ``why`` and the run goes on with the others. Not when the run's store lives in
        that worker's zygote (a collective run started here): no group could form again."""
        local = next((w for w in self.members.workers.values() if w.pid == pid and not w.exited), None)
        if local is None or self.plane.store_file is not None:
            return False
        if not [r for r in self.members.live_ranks() if r.rank not in local.ranks and r.rank not in self.admission.joiners]:
            return False  # nothing else trains (a joiner still starting holds nothing of the run's)
        lost = self.members.worker_lost(local.sender, why)
        log.warning("the local worker (pid %d) is gone; ranks %s with it, the other hosts' ranks go on", pid, lost)
        self.run.changed()
        return True

    async def stop_worker(self) -> None:
        """The local worker, if it outlived the run, is stopped (terminate, then kill)."""
        if self.worker_proc is not None and self.worker_proc.returncode is None:
            await terminate_then_kill([self.worker_proc], 3.0)

    def on_exiting(self, identity: bytes, env: Envelope, msg: m.Exiting) -> None:
        if msg.rank >= 0:
            self.members.rank_left(msg.rank)
            if msg.digest:
                self.final_digests[msg.rank] = msg.digest
        else:
            self.members.worker_gone(env.sender)
        self.run.changed()

    def _broadcast_shutdown(self, msg: m.Shutdown | m.ShutdownWithSave) -> None:
        """To every worker and every rank that ever said hello, dead ones included:
        a rank we gave up on may still be listening and can exit on its own."""
        identities = [w.identity for w in self.members.workers.values() if not w.exited]
        identities += [r.identity for r in self.members.ranks.values() if r.identity and r.state is not PeerState.EXITED]
        self.plane.send_all(msg, identities)

    def _fence_unheard(self) -> None:
        """Ranks that never said hello are still importing torch or building their task: they would
        hear the abort only once done, and their worker would wait its grace period for them. They
        hold nothing (no replica, no bundle): their workers kill them now. After the Shutdown, so a
        worker knows the kill is the run's end, not a death."""
        for worker in self.members.workers.values():
            if worker.exited:
                continue
            for rank in worker.ranks:
                info = self.members.ranks.get(rank)
                if info is not None and not info.identity and info.exit_code is None:
                    self.plane.send(m.Fence(rank=rank, reason="the run stopped before it joined"), worker.identity)

    async def shutdown_peers(self) -> None:
        """Clean end: Shutdown to everyone, then wait (bounded) for them to leave."""
        self.run.to(Phase.SHUTTING_DOWN)
        # a rank still starting (a late worker's, a healing restart) would not hear the Shutdown
        # until it said hello: its worker would wait out its whole grace period for it
        self.admission.drop_all_joiners("the run ended before it joined")
        self._broadcast_shutdown(m.Shutdown(reason="run complete", abort=False))
        await self._wait_peers_gone(SHUTDOWN_WAIT_S)
        self.run.to(Phase.DONE)

    async def abort(self, exc: RunAborted) -> None:
        """Failure: tell everyone to stop now, then wait (bounded) for them to go; a ShutdownWithSave
        that did not complete turns its exit code into a lost rank's."""
        self.run.to(Phase.ABORTING)
        self.run.mark_finished()
        self.console.failed(str(exc))
        stem, writer, tag = self.saving.shutdown_save or ("", -1, "")
        if self.plane.endpoint is not None:
            reason = str(exc)[:500]
            stop = m.ShutdownWithSave(reason, True, stem, writer, tag) if stem else m.Shutdown(reason=reason, abort=True)
            self._broadcast_shutdown(stop)
            self._fence_unheard()
        await self._wait_peers_gone(ABORT_WAIT_S + (CHECKPOINT_WAIT_S if stem else 0.0))
        if stem:
            if self.checkpoints.written and self.checkpoints.written[-1]["version"] == SHUTDOWN_SAVE:
                self.console.line(f"saved the run to the bundle {stem} (sidecar {stem}.meta.json); continue it with --resume-from {stem}")
            else:
                if exc.exit_code == EXIT_SAVED:
                    exc.exit_code = EXIT_RANK_LOST
                self.console.line(
                    f"the save to {stem} did not complete: {'; '.join(self.checkpoints.failed) or 'no answer from rank ' + str(writer)}; "
                    f"{self.checkpoints.newest()}"
                )
        self.run.to(Phase.DONE)

    async def _wait_peers_gone(self, timeout_s: float) -> None:
        def gone() -> bool:
            if self.worker_proc is not None and self.worker_proc.returncode is not None:
                return True  # the local worker is gone, and its ranks died with it (PDEATHSIG)
            # a worker that left stopped its ranks first (or they died with it): no word will come from them
            with_worker = {r for w in self.members.workers.values() if w.exited for r in w.ranks}
            ranks = all(
                r.rank in with_worker or r.state in (PeerState.EXITED, PeerState.DEAD) or r.exit_code is not None
                for r in self.members.ranks.values()
            )
            if self.worker_proc is not None:
                return ranks and self.worker_proc.returncode is not None
            # a worker silent past the heartbeat timeout is a lost host (what stopped the run, often):
            # it will say no goodbye, so waiting for one only adds the whole bound to the run's end
            silent = {w.sender for w in self.members.silent_workers(self.clock())}
            return ranks and all(w.exited or w.sender in silent for w in self.members.workers.values())

        deadline = self.clock() + timeout_s
        while not gone() and self.clock() < deadline:
            await self.run.next_change(0.2)
        if not gone():
            log.warning("peers still running %.0f s after shutdown; stopping the local worker", timeout_s)
