"""Simulated workers and ranks that speak the real protocol, on one event loop.

For loopback tests and control-plane benchmarks: a ``SimWorker`` says hello
like ``flodl.worker`` and, once welcomed, starts one ``SimRank`` task per
device instead of a process. A ``SimRank`` opens its own DEALER, joins,
"trains" each slice it is granted by sending the same frames a real rank
sends (``TimingMsg`` per batch, ``WindowDone`` per window) after an optional
per-batch delay, answers evals, and leaves on ``Shutdown``. No torch, no
collective: what is under test is the controller.

Faults are explicit knobs: ``die_at_batch`` (the rank's socket closes and the
worker reports it killed), ``silent_at_batch`` (it stops sending anything,
heartbeats included). Speeds: ``batch_ms`` x ``slowdown``, optionally drawn
afresh for every batch (``jitter``). For runs at scale (hundreds of ranks in
one process) call ``allow_peers`` before the first socket, and pass
``record=True`` to keep the positions each rank trained (``trained``), so a
caller can check coverage from the ranks' side too.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from dataclasses import dataclass
from typing import Any

import zmq

from .. import __version__
from ..plan.metrics import EpochCounters, epoch_rows
from ..wire import messages as m
from ..wire.codec import Envelope
from ..wire.messages import PROTOCOL_VERSION
from ..wire.transport import ControlEndpoint, make_dealer

VERSIONS = {"flodl": __version__, "protocol": str(PROTOCOL_VERSION)}


@dataclass
class SimRankSpec:
    """How one simulated rank behaves."""

    batch_ms: float = 0.0
    die_at_batch: int | None = None
    silent_at_batch: int | None = None
    eval_value: float = 0.5
    slowdown: float = 1.0  # simulated: this rank's batches take slowdown x batch_ms
    hello_delay_s: float = 0.0  # simulated: building the task takes this long before the hello
    jitter: float = 0.0  # simulated: each batch takes batch_ms x slowdown x uniform(1 - jitter, 1 + jitter)
    seed: int = 0  # the jitter's random stream


def allow_peers(count: int) -> None:
    """Let this process hold ``count`` simulated peers (one DEALER each).

    ZeroMQ's context caps sockets at 1023 by default and each DEALER holds
    about two file descriptors (its mailbox and its TCP connection): raise
    both. Call it before the process creates its first ZeroMQ socket (the cap
    is fixed when the shared context starts).
    """
    want = 2 * count + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    ctx: zmq.Context[Any] = zmq.Context.instance()
    if ctx.get(zmq.MAX_SOCKETS) < count + 64:
        ctx.set(zmq.MAX_SOCKETS, count + 64)


class _Peer:
    """A DEALER on the loop with a queue of incoming messages."""

    def __init__(self, addr: str, sender: str, secret: bytes, run_id: str) -> None:
        self.sender = sender
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.silent = False
        self.end_window = -1
        self.sent = 0
        self.endpoint = ControlEndpoint(
            make_dealer(zmq.Context.instance(), addr), secret=secret, run_id=run_id, sender=sender, on_message=self._on_message
        )
        self.endpoint.start()

    def _on_message(self, identity: bytes, env: Envelope) -> None:
        if isinstance(env.msg, m.EndWindow):
            self.end_window = max(self.end_window, env.msg.window)
        elif not isinstance(env.msg, m.Heartbeat):
            self.inbox.put_nowait(env.msg)

    def send(self, msg: Any) -> None:
        if not self.silent:
            self.endpoint.send(msg)
            self.sent += 1

    async def expect(self, *kinds: type, timeout_s: float = 30.0) -> Any:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await self.inbox.get()
                if isinstance(msg, kinds):
                    return msg

    async def beat(self) -> None:
        while True:
            self.send(m.Heartbeat(step=0, sent_at=time.time(), busy="", busy_s=0.0, step_ms=0.0, averaged=-1))
            await asyncio.sleep(1.0)

    def close(self) -> None:
        self.endpoint.close()


def window_batches(window: m.Window, batch_size: int, batch_ms: float) -> list[tuple[int, int]]:
    """(epoch, samples) of each batch a simulated rank trains in a window, as a real one would."""
    out: list[tuple[int, int]] = []
    pending, epoch_of = 0, None
    for epoch, _, size in window.grants:
        if epoch_of is not None and epoch != epoch_of and pending:
            out.append((epoch_of, pending))
            pending = 0
        epoch_of = epoch
        while size:
            take = min(batch_size - pending, size)
            pending += take
            size -= take
            if pending == batch_size:
                out.append((epoch, pending))
                pending = 0
    if pending:
        assert epoch_of is not None  # pending samples are of the last grant's epoch
        out.append((epoch_of, pending))
    limit = len(out)
    if window.quota_batches:
        limit = min(limit, window.quota_batches)
    if window.quota_ms and batch_ms > 0:
        limit = min(limit, max(1, int(-(-window.quota_ms // batch_ms))))
    return out[:limit]


class SimWorker:
    """A worker whose ranks are tasks on this loop; ``await run()`` until Shutdown."""

    def __init__(
        self,
        addr: str,
        secret: bytes,
        run_id: str,
        specs: list[SimRankSpec],
        *,
        dataset_len: int = 1000,
        batch_size: int = 10,
        host: str = "sim",
        record: bool = False,
        training: asyncio.Event | None = None,
    ) -> None:
        self.addr, self.secret, self.run_id = addr, secret, run_id
        self.specs = specs
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.host = host
        self.sender = f"worker.{host}.{os.getpid()}.{id(self)}"
        self.outcomes: dict[int, str] = {}
        # the global rank of each spec, from the welcome (ranks[i] runs specs[i]): the controller numbers
        # workers in the order their hellos reach it, which ZeroMQ does not keep across connections
        self.ranks: list[int] = []
        self.batches_sent = 0
        self.frames_sent = 0  # every frame its ranks sent (batches, windows, hellos, heartbeats ...)
        # rank -> (epoch, start, size) of every position it trained and reported (``record``)
        self.trained: dict[int, list[tuple[int, int, int]]] | None = {} if record else None
        self.training = training  # set once one of its ranks receives its first Window

    async def run(self) -> None:
        peer = _Peer(self.addr, self.sender, self.secret, self.run_id)
        try:
            async with asyncio.TaskGroup() as tg:
                beat = tg.create_task(peer.beat())
                peer.send(m.WorkerHello(host=self.host, pid=os.getpid(), devices=["cpu"] * len(self.specs), versions=VERSIONS))
                welcome = await peer.expect(m.WorkerWelcome, m.Reject, m.Shutdown, m.ShutdownWithSave)
                if not isinstance(welcome, m.WorkerWelcome):
                    peer.send(m.Exiting(rank=-1, reason="refused" if isinstance(welcome, m.Reject) else "shutdown", digest=""))
                    await asyncio.sleep(0.05)
                    beat.cancel()
                    return
                self.ranks = list(welcome.ranks)
                ranks = [
                    tg.create_task(self._rank(peer, rank, spec, welcome)) for rank, spec in zip(welcome.ranks, self.specs, strict=False)
                ]
                await peer.expect(m.Shutdown, m.ShutdownWithSave, timeout_s=3600)
                await asyncio.wait(ranks, timeout=5)
                for rank, outcome in self.outcomes.items():
                    if outcome == "silent":  # a real worker kills a hung rank and reports it
                        peer.send(m.RankExited(rank=rank, pid=os.getpid(), code=-9))
                peer.send(m.Exiting(rank=-1, reason="shutdown", digest=""))
                await asyncio.sleep(0.05)
                beat.cancel()
        finally:
            self.frames_sent += peer.sent
            peer.close()

    async def _rank(self, worker: _Peer, rank: int, spec: SimRankSpec, welcome: m.WorkerWelcome) -> None:
        peer = _Peer(self.addr, f"rank{rank}.sim{id(self)}", self.secret, self.run_id)
        beat = asyncio.create_task(peer.beat())
        try:
            self.outcomes[rank] = await self._rank_life(worker, peer, rank, spec)
        finally:
            beat.cancel()
            self.frames_sent += peer.sent
            peer.close()

    async def _rank_life(self, worker: _Peer, peer: _Peer, rank: int, spec: SimRankSpec) -> str:
        await asyncio.sleep(spec.hello_delay_s)
        peer.send(
            m.RankHello(
                rank=rank,
                host=self.host,
                pid=os.getpid(),
                device="cpu",
                versions=VERSIONS,
                model_signature="sim",
                param_count=1,
                shuffle_signature="sim",
                dataset_len=self.dataset_len,
                dataset_digest="sim",
                has_eval=True,
                eval_metric="sim_metric",
                batch_size=self.batch_size,
                grain="sample",
                accumulate_grad_batches=1,
                cores="",
            )
        )
        welcome = await peer.expect(m.RankWelcome, m.Reject, m.Shutdown, m.ShutdownWithSave)
        if not isinstance(welcome, m.RankWelcome):
            return "refused"
        peer.send(m.RankReady(rank=rank, generation=welcome.generation, init_ms=0.0))
        step = 0
        rng = random.Random(spec.seed)
        while True:
            cmd = await peer.expect(m.Window, m.RunEval, m.Shutdown, m.ShutdownWithSave, timeout_s=3600)
            if isinstance(cmd, (m.Shutdown, m.ShutdownWithSave)):
                peer.send(m.Exiting(rank=rank, reason=cmd.reason, digest=""))
                await asyncio.sleep(0.05)
                return "aborted" if cmd.abort else "completed"
            if isinstance(cmd, m.RunEval):
                peer.send(m.EvalResult(rank=rank, epoch=cmd.epoch, final=cmd.final, value=spec.eval_value, elapsed_ms=0.0, error=None))
                continue
            if isinstance(cmd, m.Window):
                if self.training is not None:
                    self.training.set()
                step = await self._window(peer, rank, spec, cmd, step, rng)
                if step == -2:
                    return "silent"
                if step < 0:
                    worker.send(m.RankExited(rank=rank, pid=os.getpid(), code=-9))
                    return "died"
                continue

    async def _window(self, peer: _Peer, rank: int, spec: SimRankSpec, cmd: m.Window, step: int, rng: random.Random) -> int:
        """Train a window's grants like a real rank would (simulated time); -1 if it died, -2 if it hung."""
        base_ms = spec.batch_ms * spec.slowdown
        if spec.jitter:
            batches = window_batches(cmd, self.batch_size, 0.0)  # the time quota is applied below, batch by batch
            durations = [base_ms * rng.uniform(1.0 - spec.jitter, 1.0 + spec.jitter) for _ in batches]
            if cmd.quota_ms:
                spent, limit = 0.0, len(batches)
                for i, ms in enumerate(durations):
                    spent += ms
                    if spent >= cmd.quota_ms:  # a real rank stops at the first batch boundary past the quota
                        limit = i + 1
                        break
                batches, durations = batches[:limit], durations[:limit]
        else:
            batches = window_batches(cmd, self.batch_size, base_ms)
            durations = [base_ms] * len(batches)
        per_epoch: dict[int, EpochCounters] = {}
        trained = []
        outcome = None
        for (epoch, samples), ms in zip(batches, durations, strict=False):
            if peer.end_window >= cmd.window:
                break
            step += 1
            if spec.die_at_batch is not None and step >= spec.die_at_batch:
                outcome = -1
                break
            if spec.silent_at_batch is not None and step >= spec.silent_at_batch:
                peer.silent = True
                outcome = -2
                break
            if ms:
                await asyncio.sleep(ms / 1000.0)
            trained.append((epoch, samples))
            per_epoch.setdefault(epoch, EpochCounters()).add_batch(samples, 1.0 / step, ms, 0.0)
            peer.send(m.TimingMsg(rank, epoch, step, samples, 1.0 / step, ms, 0.0, 0.0, 1))
            self.batches_sent += 1
        if self.trained is not None and outcome is None:
            # only a reported window's work reaches the window's average: what a rank trained in
            # the window it died in is lost with its replica (and granted again to the survivors)
            self._record(rank, cmd, sum(s for _, s in trained))
        if outcome == -2:
            await peer.expect(m.Shutdown, m.ShutdownWithSave, timeout_s=3600)  # a hung rank: it hears, never answers
            return -2
        if outcome is not None:
            return outcome
        peer.send(
            m.WindowDone(
                rank=rank,
                window=cmd.window,
                batches=len(trained),
                consumed=sum(s for _, s in trained),
                loss_sum=sum(c.loss_sum for c in per_epoch.values()),
                compute_ms=sum(c.compute_ms for c in per_epoch.values()),
                data_ms=0.0,
                sync_ms=0.1,
                wall_ms=sum(c.compute_ms for c in per_epoch.values()) + 0.1,
                divergence=0.01 if cmd.measure_divergence else None,
                pre_norm=None,
                post_norm=None,
                lr=0.1,
                epochs=epoch_rows(per_epoch),
                scalars={},
                regrouped_at=-1,
                dropped=-1,
                res={},
                data={},
            )
        )
        return step

    def _record(self, rank: int, cmd: m.Window, consumed: int) -> None:
        """The positions trained: the first ``consumed`` of the window's grants, in order."""
        assert self.trained is not None  # only called with record=True
        out = self.trained.setdefault(rank, [])
        for epoch, start, size in cmd.grants:
            used = min(size, consumed)
            if used > 0:
                out.append((int(epoch), int(start), used))
            consumed -= used
