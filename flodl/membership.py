"""Who is in the run, who is alive, and what to do about those who are not.

Pure logic: no sockets, no event loop, time passed in. The controller feeds
it facts (a frame arrived, a worker reported an exit, a peer said goodbye)
and asks ``assess(now)`` for a verdict; the verdict carries a reason string
that goes straight into the log, so a membership decision is always
explained. Tests drive it with a fake clock instead of sleeping.

A rank is alive while it makes progress, not merely while it beats:
``note_stalls`` applies progress.py's deadlines to what the heartbeats say.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import Enum

from .progress import Progress, ProgressLimits, stalled


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
    """The outcome of one membership assessment."""

    dead: tuple[int, ...]
    reason: str

    @property
    def healthy(self) -> bool:
        return not self.dead


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
    """Registry of workers and ranks with liveness bookkeeping."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.generation = 0
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

    def seen_worker(self, sender: str, now: float) -> None:
        worker = self.workers.get(sender)
        if worker is not None:
            worker.last_seen = now

    def seen_rank(self, rank: int, now: float) -> None:
        info = self.ranks.get(rank)
        if info is not None:
            info.last_seen = now

    def heard_progress(self, info: RankInfo, busy: str, busy_s: float, step_ms: float, averaged: int, now: float) -> None:
        """A rank's heartbeat: what its training thread does and since when it made no progress."""
        info.progress = Progress(busy=busy, busy_s=busy_s, step_ms=step_ms, at=now)
        info.averaged = max(info.averaged, averaged)

    def note_stalls(self, now: float, limits: ProgressLimits) -> None:
        """Mark as dying every live rank whose training thread is past its deadline
        (``assess`` then declares it dead, with that reason)."""
        for info in self.ranks.values():
            if info.death is None and info.state not in (PeerState.EXITED, PeerState.DEAD):
                why = stalled(info.progress, now, limits)
                if why is not None:
                    info.death = why

    def rank_exited(self, rank: int, code: int) -> RankInfo | None:
        """The worker reaped the rank's process (the fast death path)."""
        info = self.ranks.get(rank)
        if info is None:
            return None
        info.exit_code = code
        if info.state is not PeerState.EXITED and info.death is None:
            info.death = describe_exit(code)
        return info

    def rank_left(self, rank: int) -> None:
        """The rank said goodbye (Exiting): it is done, not dead."""
        info = self.ranks.get(rank)
        if info is not None and info.state is not PeerState.DEAD:
            info.state = PeerState.EXITED
            info.death = None

    # -------------------------------------------------------------- verdict

    def assess(self, now: float) -> Verdict:
        """Declare dead every rank that exited uncleanly or fell silent.

        Pure apart from marking those ranks DEAD; returns the newly dead and
        a reason naming each, e.g. ``rank 1 on host h (pid 42) was killed by
        SIGKILL``.
        """
        newly, reasons = [], []
        for rank in sorted(self.ranks):
            info = self.ranks[rank]
            if info.state in (PeerState.EXITED, PeerState.DEAD):
                continue
            if info.death is None and now - info.last_seen > self.heartbeat_timeout_s:
                info.death = f"sent nothing for {now - info.last_seen:.1f} s (heartbeat timeout {self.heartbeat_timeout_s:g} s)"
            if info.death is not None:
                info.state = PeerState.DEAD
                newly.append(rank)
                reasons.append(f"{info.where()} {info.death}")
        if newly:
            self.new_generation()
        alive = sum(1 for r in self.ranks.values() if r.state is PeerState.READY)
        reason = "; ".join(reasons) if reasons else f"[{alive}/{len(self.ranks)} ranks ready]"
        return Verdict(tuple(newly), reason)

    def new_generation(self) -> int:
        """The world changed (deaths, joiners, a collective rebuilt): the only writer of ``generation``."""
        self.generation += 1
        return self.generation

    def silent_workers(self, now: float) -> list[WorkerInfo]:
        """Workers silent past the timeout (their ranks will be judged on their own)."""
        return [w for w in self.workers.values() if not w.exited and now - w.last_seen > self.heartbeat_timeout_s]

    # --------------------------------------------------------------- views

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_in(self, state: PeerState) -> bool:
        return bool(self.ranks) and all(r.state is state for r in self.ranks.values())

    def live_ranks(self) -> list[RankInfo]:
        return [r for r in self.ranks.values() if r.state not in (PeerState.DEAD, PeerState.EXITED)]


def unrecoverable(config, world_size: int, dead: int, survivors: int) -> tuple[str, str] | None:
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


#: Healing's back-off: the n-th restart of a slot waits BASE × 2^(n-1) seconds, at most MAX.
RESTART_BACKOFF_BASE_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def restart_delay(used: int, max_restarts: int) -> float | None:
    """Seconds to wait before restarting a slot that has been restarted ``used`` times, or
    None when its ``max_restarts`` are spent (the run then goes on without it)."""
    if used >= max_restarts:
        return None
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_BASE_S * 2**used)
