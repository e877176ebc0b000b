"""Teardown: the embedded worker's supervision, and stopping every peer in order.

A mixin of ``Controller`` (core.py), which holds all the state these methods
read and write. A clean end sends ``Shutdown`` and waits (bounded) for every
peer to go; a failure sends ``Shutdown(abort=True)`` (naming the rank that
writes the ShutdownWithSave bundle, if any) and waits for that save too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from ..env import PARENT_PID, child_environ, credentials_env
from ..errors import EXIT_FAILED, EXIT_RANK_LOST, EXIT_SAVED, RunAborted
from ..membership import PeerState, describe_exit
from ..protocol import messages as m
from .checkpoints import SHUTDOWN_SAVE
from .saving import CHECKPOINT_WAIT_S

log = logging.getLogger("flodl.controller")

SHUTDOWN_WAIT_S = 40.0
ABORT_WAIT_S = 10.0


class Teardown:
    """The local worker's life, and the end of every peer's."""

    async def _embedded_worker(self) -> None:
        """Start the local worker and treat its unexpected exit as a failure."""
        cmd = [sys.executable, "-m", "flodl.worker", "--controller", self.address]
        if self.launch.nproc_per_node is not None:
            cmd += ["--nproc", str(self.launch.nproc_per_node)]
        if self.launch.devices:
            cmd += ["--devices", self.launch.devices]
        env = child_environ({**credentials_env(self.secret, self.run_id), PARENT_PID: str(os.getpid())})
        # its own session: a terminal's Ctrl-C reaches the controller alone, which
        # then stops everyone in order instead of racing the children's deaths
        self.worker_proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
        code = await self.worker_proc.wait()
        if self.phase not in ("shutting down", "aborting", "done"):
            self._fail(f"the local worker (pid {self.worker_proc.pid}) {describe_exit(code)} before the run finished", EXIT_RANK_LOST if code else EXIT_FAILED)

    def _broadcast_shutdown(self, msg: m.Shutdown) -> None:
        """To every worker and every rank that ever said hello, dead ones included:
        a rank we gave up on may still be listening and can exit on its own."""
        frame = self.endpoint.writer.encode(msg)
        identities = [w.identity for w in self.members.workers.values() if not w.exited]
        identities += [r.identity for r in self.members.ranks.values() if r.identity and r.state is not PeerState.EXITED]
        for identity in identities:
            self.endpoint.send_frame(frame, identity)

    async def _shutdown_peers(self) -> None:
        """Clean end: Shutdown to everyone, then wait (bounded) for them to leave."""
        self.phase = "shutting down"
        for rank in list(self.joiners):
            # a rank still starting (a late worker's, a healing restart) would not hear the Shutdown
            # until it said hello: its worker would wait out its whole grace period for it
            self._drop_joiner(rank, "the run ended before it joined")
        self._broadcast_shutdown(m.Shutdown(reason="run complete", abort=False, save_stem="", save_rank=-1, save_tag=""))
        await self._wait_peers_gone(SHUTDOWN_WAIT_S)
        self.phase = "done"

    async def _abort(self, exc: RunAborted) -> None:
        """Failure: tell everyone to stop now, then wait (bounded) for them to go."""
        self.phase = "aborting"
        self.finished_at = self.finished_at or self.clock()
        self.console.failed(str(exc))
        stem, writer, tag = self.shutdown_save or ("", -1, "")
        if self.endpoint is not None:
            self._broadcast_shutdown(m.Shutdown(reason=str(exc)[:500], abort=True, save_stem=stem, save_rank=writer, save_tag=tag))
        await self._wait_peers_gone(ABORT_WAIT_S + (CHECKPOINT_WAIT_S if stem else 0.0))
        if stem:
            if self.checkpoints.written and self.checkpoints.written[-1]["version"] == SHUTDOWN_SAVE:
                self.console.line(f"saved the run to the bundle {stem} (sidecar {stem}.meta.json); continue it with --resume-from {stem}")
            else:
                if exc.exit_code == EXIT_SAVED:
                    exc.exit_code = EXIT_RANK_LOST
                self.console.line(f"the save to {stem} did not complete: {'; '.join(self.checkpoints.failed) or 'no answer from rank ' + str(writer)}")
        exc.summary = self.summary(str(exc), exc.exit_code)
        self.phase = "done"

    async def _wait_peers_gone(self, timeout_s: float) -> None:
        def gone() -> bool:
            if self.worker_proc is not None and self.worker_proc.returncode is not None:
                return True  # the local worker is gone, and its ranks died with it (PDEATHSIG)
            # a worker that left stopped its ranks first (or they died with it): no word will come from them
            with_worker = {r for w in self.members.workers.values() if w.exited for r in w.ranks}
            ranks = all(r.rank in with_worker or r.state in (PeerState.EXITED, PeerState.DEAD) or r.exit_code is not None
                        for r in self.members.ranks.values())
            if self.worker_proc is not None:
                return ranks and self.worker_proc.returncode is not None
            return ranks and all(w.exited for w in self.members.workers.values())

        deadline = self.clock() + timeout_s
        while not gone() and self.clock() < deadline:
            await self._next_change(0.2)
        if not gone():
            log.warning("peers still running %.0f s after shutdown; stopping the local worker", timeout_s)
