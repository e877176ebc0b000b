"""Who is in the run, who is alive, and what to do about those who are not.

Pure logic: no sockets, no event loop, time passed in. The controller feeds
it facts (a frame arrived, a worker reported an exit, a peer said goodbye)
through its methods, never by editing the registry itself. Judging is in two
steps: ``assess(now)`` is pure and returns a ``Verdict`` (who is to be
declared dead and why, which silent workers to give up), and ``apply(verdict)``
is the only thing that carries one out. The verdict's reason string goes
straight into the log, so a membership decision is always explained; and a
verdict can be asked for just to explain a timeout, changing nothing. Tests
drive it with a fake clock instead of sleeping.

A rank is alive while it makes progress, not merely while it beats: given
``ProgressLimits``, ``assess`` applies progress.py's deadlines to what the
heartbeats say.

The generation (bumped on every change of the world: deaths, joiners, a
collective rebuilt) has one writer, ``new_generation(reason)``.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from .progress import WAITED_BUSY, Progress, ProgressLimits, silence_limit, stalled, waits

if TYPE_CHECKING:
    from ..config import DdpRunConfig

log = logging.getLogger(__name__)


class PeerState(str, Enum):
    JOINING = "joining"  # hello received, not yet ready to train
    READY = "ready"  # in the collective, trains when told
    EXITED = "exited"  # left cleanly (sent Exiting): silence is not death
    DEAD = "dead"  # exited unexpectedly or went silent


@dataclass
class RankInfo:
    """What the controller knows of one rank."""

    rank: int
    host: str = "?"
    pid: int = 0
    device: str = "?"
    identity: bytes = b""  # the route (ZeroMQ routing id) its frames come on; follows its signed frames
    sender: str = ""  # the sender name of its hello: every frame of the rank is signed under it
    state: PeerState = PeerState.JOINING
    last_seen: float = 0.0
    exit_code: int | None = None
    death: str | None = None
    progress: Progress = field(default_factory=Progress)  # its training thread, as its last heartbeat said
    averaged: int = -1  # the generation of its last completed average, as its heartbeats say
    last_window: int = -1  # the last Window sent to it: the next one names it as ``after``
    restart: bool = False  # started by its worker in a dead rank's place (healing), not at the worker's welcome

    def where(self) -> str:
        """``rank 1 on host h (pid 42)`` — how every message names a rank."""
        return f"rank {self.rank} on host {self.host} (pid {self.pid})" if self.pid else f"rank {self.rank} on host {self.host}"


@dataclass
class WorkerInfo:
    """What the controller knows of one worker (one per host)."""

    sender: str
    identity: bytes
    host: str
    pid: int
    devices: list[str]
    ranks: list[int] = field(default_factory=list)
    last_seen: float = 0.0
    exited: bool = False


@dataclass(frozen=True)
class Verdict:
    """The outcome of one membership assessment: what ``Membership.apply`` would do.

    Making one changes nothing, so a verdict may also be asked for only to
    explain a timeout.
    """

    deaths: tuple[tuple[int, str], ...]  # (rank, why) of each rank to declare dead, in rank order
    reason: str
    retired_workers: tuple[str, ...] = ()  # senders of silent workers to give up (their ranks all dead)

    @property
    def dead(self) -> tuple[int, ...]:
        return tuple(rank for rank, _ in self.deaths)

    @property
    def healthy(self) -> bool:
        return not self.deaths


def describe_exit(code: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class Membership:
    """Registry of workers and ranks with liveness bookkeeping: the one owner of both
    and of the generation (others read them, and tell it facts through its methods)."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._generation = 0
        self.workers: dict[str, WorkerInfo] = {}
        self.ranks: dict[int, RankInfo] = {}
        self.by_identity: dict[bytes, RankInfo] = {}  # routing id -> rank, for O(1) liveness
        self.by_sender: dict[str, RankInfo] = {}  # the sender name of a rank's hello -> the rank (its route follows its frames)

    # ---------------------------------------------------------------- facts

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        info.last_seen = now
        self.workers[info.sender] = info

    def expect_rank(self, rank: int, host: str, device: str, now: float) -> RankInfo:
        """A worker was told to spawn ``rank``; silence counts from now."""
        info = self.ranks[rank] = RankInfo(rank=rank, host=host, device=device, last_seen=now)
        return info

    def assign_ranks(self, worker: WorkerInfo, first: int, now: float) -> list[int]:
        """``worker`` runs ranks ``first``, ``first + 1``, ... (one per device): expect them."""
        worker.ranks = list(range(first, first + len(worker.devices)))
        for rank, device in zip(worker.ranks, worker.devices, strict=False):
            self.expect_rank(rank, worker.host, device, now)
        return worker.ranks

    def expect_restart(self, worker: WorkerInfo, rank: int, device: str, now: float) -> RankInfo:
        """``worker`` was told to start ``rank`` in a dead rank's place: one more of its ranks."""
        worker.ranks.append(rank)
        info = self.expect_rank(rank, worker.host, device, now)
        info.restart = True
        return info

    def rank_said_hello(self, rank: int, identity: bytes, sender: str, host: str, pid: int, device: str) -> RankInfo:
        """The rank's hello was accepted: its frames come on ``identity``, signed as ``sender``."""
        info = self.ranks[rank]
        info.identity, info.sender, info.host, info.pid, info.device = identity, sender, host, pid, device
        self.by_identity[identity] = info
        self.by_sender[sender] = info
        return info

    def rank_ready(self, rank: int) -> None:
        """The rank joined the collective: it trains when told."""
        self.ranks[rank].state = PeerState.READY

    def route_moved(self, peer: WorkerInfo | RankInfo, identity: bytes) -> None:
        """A known peer's newest frame came on another connection: its route follows it there."""
        if isinstance(peer, RankInfo):
            self.by_identity.pop(peer.identity, None)
            self.by_identity[identity] = peer
        peer.identity = identity

    def seen_worker(self, sender: str, now: float) -> None:
        worker = self.workers.get(sender)
        if worker is not None:
            worker.last_seen = now

    def seen_rank(self, rank: int, now: float) -> None:
        info = self.ranks.get(rank)
        if info is not None:
            info.last_seen = now

    def seen_route(self, identity: bytes, now: float) -> None:
        """A frame that names no rank came on a rank's route: the rank is alive."""
        info = self.by_identity.get(identity)
        if info is not None:
            info.last_seen = now

    def excuse_silence_before_hello(self, now: float) -> None:
        """A rank that never said hello is judged by the join timeout, not by heartbeats:
        its silence starts counting only once it has said hello."""
        for info in self.ranks.values():
            if not info.identity and info.death is None:
                info.last_seen = now

    def heard_progress(self, info: RankInfo, busy: str, busy_s: float, step_ms: float, averaged: int, now: float) -> None:
        """A rank's heartbeat: what its training thread does and since when it made no progress."""
        info.progress = Progress(busy=busy, busy_s=busy_s, step_ms=step_ms, at=now)
        info.averaged = max(info.averaged, averaged)

    def rank_exited(self, rank: int, code: int, pid: int = 0) -> RankInfo | None:
        """The worker reaped the rank's process (the fast death path); ``assess`` then declares
        it dead unless it said goodbye. ``pid`` fills in one never learnt (it died before its hello)."""
        info = self.ranks.get(rank)
        if info is None:
            return None
        info.exit_code = code
        unheard = info.pid == 0  # it never said hello
        if unheard:
            info.pid = pid
        if info.state is not PeerState.EXITED and info.death is None:
            info.death = describe_exit(code)
            if unheard and code == 0:  # only a --script ends well without a word: it never joined
                info.death += " before its hello (does the --script call flodl.init()?)"
        return info

    def rank_left(self, rank: int, code: int | None = None) -> None:
        """The rank said goodbye (Exiting), or exited after it was told to go (its exit
        ``code``): it is done, not dead."""
        info = self.ranks.get(rank)
        if info is None:
            return
        if code is not None:
            info.exit_code = code
        if info.state is not PeerState.DEAD:
            info.state = PeerState.EXITED
            info.death = None

    def worker_gone(self, sender: str) -> None:
        """The worker said goodbye (Exiting), or a verdict gave it up: nothing more is sent to it."""
        worker = self.workers.get(sender)
        if worker is not None:
            worker.exited = True

    def worker_lost(self, sender: str, why: str) -> list[int]:
        """The worker's process is known gone (the controller's own child exited): its live
        ranks die with it, for ``why``, and nothing more is sent to it. Returns those ranks;
        ``assess`` declares them dead."""
        worker = self.workers.get(sender)
        if worker is None:
            return []
        self.worker_gone(sender)
        lost = []
        for rank in worker.ranks:
            info = self.ranks.get(rank)
            if info is not None and info.state not in (PeerState.EXITED, PeerState.DEAD) and info.death is None:
                info.death = why
                lost.append(rank)
        return lost

    def forget_rank(self, rank: int) -> RankInfo | None:
        """Take a rank that never joined (a dropped joiner) off the books; returns what was known of it."""
        info = self.ranks.pop(rank, None)
        if info is not None:
            self.by_identity.pop(info.identity, None)
            self.by_sender.pop(info.sender, None)
        return info

    # -------------------------------------------------------------- verdict

    def assess(self, now: float, limits: ProgressLimits | None = None, *, waited: bool = True) -> Verdict:
        """Who is to be declared dead, and why; which silent workers to give up. Pure: changes nothing.

        A live rank is dead when it exited uncleanly, when its training thread is past its
        progress deadline (given ``limits``), or when it sent nothing for the heartbeat
        timeout; a rank its peers wait for, sooner (progress.py ``silence_limit``; ``waited``
        False: never sooner, for a judge that cannot trust its own clock's last moments). The reason names each, e.g. ``rank 1 on host h (pid 42) was killed by
        SIGKILL``; without deaths it counts the ranks ready. Workers are given up only in a
        verdict without deaths: the controller handles its ranks' deaths first (fencing and
        restarting them through that worker).
        """
        live = sorted(self.live_ranks(), key=lambda r: r.rank)
        waiting = {info.rank for info in live if waited and info.state is PeerState.READY and waits(info.progress, now)}
        deaths = tuple(
            (info.rank, why) for info in live if (why := self._death_of(info, now, limits, waited=self._waited(info, waiting))) is not None
        )
        if deaths:
            return Verdict(deaths, "; ".join(f"{self.ranks[rank].where()} {why}" for rank, why in deaths))
        alive = sum(1 for r in self.ranks.values() if r.state is PeerState.READY)
        return Verdict((), f"[{alive}/{len(self.ranks)} ranks ready]", self._workers_to_retire(now))

    @staticmethod
    def _waited(info: RankInfo, waiting: set[int]) -> bool:
        """Do ``info``'s peers wait for it: another rank in the collective idle or in an average
        (``waiting``), while it is in the collective too and its last word was training or averaging
        (progress.py: an eval, a save, a callback or a build keeps its own deadline)?"""
        return info.state is PeerState.READY and info.progress.busy in WAITED_BUSY and bool(waiting - {info.rank})

    def _death_of(self, info: RankInfo, now: float, limits: ProgressLimits | None, *, waited: bool = False) -> str | None:
        """Why the live rank ``info`` is dead, or None: a reported death first, then a stall, then silence
        (before its hello: its worker's, which starts it; its own is excused). ``waited``: its peers wait
        for it, so a shorter stall or silence will do (progress.py ``silence_limit``)."""
        if info.death is not None:
            return info.death
        if info.restart and info.state is PeerState.JOINING and not info.identity:
            return self._unstarted_death(info, now)
        why = stalled(info.progress, now, limits) if limits is not None else None
        if why is not None:
            return why
        silent_s = now - info.last_seen
        limit = silence_limit(self.heartbeat_timeout_s, waited=waited)
        if silent_s > limit:
            if limit < self.heartbeat_timeout_s:
                return f"sent nothing for {silent_s:.1f} s while its peers waited for it (deadline {limit:g} s; heartbeat timeout {self.heartbeat_timeout_s:g} s)"
            return f"sent nothing for {silent_s:.1f} s (heartbeat timeout {self.heartbeat_timeout_s:g} s)"
        return None

    def _unstarted_death(self, info: RankInfo, now: float) -> str | None:
        """A restart that never said hello is dead once the worker that was to start it is gone or silent
        past the timeout (a host lost right after it was told to restart a rank there): else it waited
        out the join timeout, and every joiner numbered above it with it (joiners join in rank order).
        Only a restart: a worker's own first ranks (and a late worker's) start while it may be busy
        importing torch for its relay, silent a while; a worker asked for a restart was training."""
        worker = next((w for w in self.workers.values() if info.rank in w.ranks), None)
        if worker is None:
            return None
        silent_s = now - worker.last_seen
        if worker.exited or silent_s > self.heartbeat_timeout_s:
            return f"never started: its worker on host {worker.host} (pid {worker.pid}) is gone (silent for {silent_s:.1f} s)"
        return None

    def _workers_to_retire(self, now: float) -> tuple[str, ...]:
        """Silent workers whose ranks are all dead (a worker with a rank not dead waits:
        its ranks are judged on their own heartbeats)."""
        return tuple(
            w.sender for w in self.silent_workers(now) if all(r.state is PeerState.DEAD for r in self.ranks.values() if r.rank in w.ranks)
        )

    def apply(self, verdict: Verdict) -> None:
        """Carry out ``verdict``: the only place ranks are declared dead and workers given up.

        However many ranks died, the world changed once: the generation goes up once. A
        rank that died or left since the verdict was made is skipped, so applying a verdict
        again changes nothing.
        """
        declared = [rank for rank, why in verdict.deaths if self._declare_dead(rank, why)]
        for sender in verdict.retired_workers:
            self.worker_gone(sender)
        if declared:
            self.new_generation(verdict.reason)

    def _declare_dead(self, rank: int, why: str) -> bool:
        """Mark a live rank DEAD for ``why``; False if it is gone, dead or left already."""
        info = self.ranks.get(rank)
        if info is None or info.state in (PeerState.EXITED, PeerState.DEAD):
            return False
        info.state, info.death = PeerState.DEAD, why
        return True

    def new_generation(self, reason: str) -> int:
        """The world changed (deaths, joiners, a collective rebuilt) for ``reason``: the only
        writer of the generation."""
        self._generation += 1
        log.debug("membership generation %d: %s", self._generation, reason)
        return self._generation

    def silent_workers(self, now: float) -> list[WorkerInfo]:
        """Workers silent past the timeout (their ranks will be judged on their own)."""
        return [w for w in self.workers.values() if not w.exited and now - w.last_seen > self.heartbeat_timeout_s]

    # --------------------------------------------------------------- views

    @property
    def generation(self) -> int:
        """Bumps on every change of the world; written only by ``new_generation``."""
        return self._generation

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_in(self, state: PeerState) -> bool:
        return bool(self.ranks) and all(r.state is state for r in self.ranks.values())

    def live_ranks(self) -> list[RankInfo]:
        return [r for r in self.ranks.values() if r.state not in (PeerState.DEAD, PeerState.EXITED)]


def unrecoverable(config: DdpRunConfig, world_size: int, dead: int, survivors: int) -> tuple[str, str] | None:
    """``(save_reason, why)`` if the run cannot go on without its dead ranks, else None.

    In order: the user's ``max_failure`` limit; a rank left at all (either
    backend goes on with one). ``save_reason`` is the code a checkpoint
    sidecar records.
    """
    limit = config.max_failure.limit_for(world_size) if config.max_failure is not None else None
    if limit is not None and dead >= limit:
        return "max_failure_exceeded", f"{dead} of {world_size} ranks lost reaches max_failure {config.max_failure} (limit {limit})"
    # one collective rank trains alone (its averages are the identity) and the run grows again
    # when a worker joins or a restart comes back: losing one of two ranks is no reason to stop
    if survivors < 1:
        return "all_ranks_lost", "every rank is lost"
    return None


#: Healing's back-off: a slot's restart waits BASE × 2^(k-1) seconds (none for k = 0), at most MAX,
#: where k counts the restarts in a row whose rank died within QUICK of its start (a crash loop: a task
#: that cannot build, a device that fails its first steps); a rank that lived longer than that is a new
#: fault, restarted at once (a second of back-off there was a second of the world short of a rank, for
#: nothing: most of a healed kill's time back at full size).
RESTART_BACKOFF_BASE_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_QUICK_S = 10.0


def restart_delay(used: int, max_restarts: int, quick: int | None = None) -> float | None:
    """Seconds to wait before restarting a slot that has been restarted ``used`` times, or None when
    its ``max_restarts`` are spent (the run then goes on without it). ``quick``: how many of those
    restarts in a row died within ``RESTART_QUICK_S`` of their start (None: all of them, the back-off
    of every restart before)."""
    if used >= max_restarts:
        return None
    loop = used if quick is None else min(used, quick)
    if loop == 0:
        return 0.0  # a new fault, not a crash loop: nothing to wait for
    backoff: float = RESTART_BACKOFF_BASE_S * 2 ** (loop - 1)
    return min(RESTART_BACKOFF_MAX_S, backoff)


def quick_deaths(streak: int, lived_s: float) -> int:
    """The crash-loop count after a slot's rank died having lived ``lived_s`` since its start:
    one more in the row if it died within ``RESTART_QUICK_S``, else none (``restart_delay``'s ``quick``)."""
    return streak + 1 if lived_s < RESTART_QUICK_S else 0
