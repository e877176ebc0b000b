"""Liveness as progress: a rank whose training thread gets nowhere is hung, heartbeats or not.

A rank's heartbeats come from its link thread, which keeps beating while the
training thread is blocked in user code (a deadlocked data read, a step that
never returns, a kernel that never ends). So every rank heartbeat also says
what the training thread is doing (``busy``) and for how long it has made no
progress in it (``busy_s``: since it last finished a step, an average or an
eval); the controller compares that with a deadline for the activity.

Pure logic: no clock of its own (``now`` is passed in), no I/O. The deadlines
(docs/fault-tolerance.md, "Liveness"):

============  ======================================================================
activity      deadline
============  ======================================================================
``step``      ``heartbeat + 3 × the rank's slowest recent step`` (its first step:
              ``first_step_s``, which carries compilation and warm-up);
              ``step_timeout_secs`` replaces both when set
``average``   ``heartbeat + first_step_s``: a backstop only (a peer's first step or
              a collective's own timeout ends such a wait long before)
``eval``      ``eval_timeout_secs`` (also user callbacks and checkpoint writes)
``build``     ``first_step_s`` (building the task, joining the first group)
``idle``      none: waiting for the controller's next command is not a hang
============  ======================================================================

A rank its peers are **waiting for** (another live rank sits idle or in an
average, while this one's last word was a step or an average) has less
slack: the silence that makes it dead (membership.py) shrinks to
``WAITED_SHARE`` of the heartbeat timeout, never below ``WAITED_MIN_S``
(docs/fault-tolerance.md, *Liveness*): a stopped rank or a lost host then
stalls the world for half as long. A rank that beats on keeps its
deadlines whole (a stuck step too): it may be a survivor blocked in a collective
with a lost host, and a slow rank still beats (its link thread is not its
training thread).
"""

from __future__ import annotations

from dataclasses import dataclass

#: What a rank's training thread may be doing, as its heartbeats say.
BUSY = ("build", "step", "average", "eval", "callback", "save", "idle")
#: A step deadline is this many of the rank's slowest recent steps past the heartbeat timeout.
STEP_FACTOR = 3.0
#: A rank its peers wait for: the share of the heartbeat timeout its silence (or its step's slack) may last ...
WAITED_SHARE = 0.5
#: ... and never less than this: three of its beats missed in a row (ranks beat every 0.5 s: rank/link.py).
WAITED_MIN_S = 1.5
#: What a rank's last word may be for its peers' wait to shorten its deadlines: training or averaging
#: (an eval, a save, a callback or a build has deadlines of its own, and may hold its beats up).
WAITED_BUSY = ("step", "average", "idle")

_WHAT = {
    "build": "building its task",
    "step": "a training step",
    "average": "an average",
    "eval": "an eval",
    "callback": "a user callback",
    "save": "a checkpoint write",
}


def silence_limit(heartbeat_timeout_s: float, *, waited: bool) -> float:
    """Seconds of silence after which a rank is dead: the heartbeat timeout, or (``waited``: its peers
    wait for it) ``WAITED_SHARE`` of it, at least ``WAITED_MIN_S`` (never more than the timeout)."""
    if not waited:
        return heartbeat_timeout_s
    return min(heartbeat_timeout_s, max(WAITED_MIN_S, WAITED_SHARE * heartbeat_timeout_s))


def waits(progress: Progress, now: float) -> bool:
    """Does a rank's last heartbeat (a fresh one) say it waits: idle for the next command, or in an average?"""
    return progress.busy in ("idle", "average") and now - progress.at <= SILENT_AFTER_S


@dataclass(frozen=True)
class ProgressLimits:
    """The numbers the deadlines derive from (seconds)."""

    heartbeat_timeout_s: float
    first_step_s: float  # join timeout: a first step may compile, a build may load data
    eval_s: float  # evals, user callbacks, checkpoint writes
    step_s: float | None = None  # the user's override for every step (long steps)

    def deadline(self, busy: str, step_ms: float) -> float | None:
        """Seconds without progress after which a rank doing ``busy`` is hung (None: never). A step's
        keeps the whole heartbeat timeout, its peers waiting or not: a rank that beats on but makes
        no progress may be a survivor blocked in a collective with a lost host."""
        if busy == "step":
            if self.step_s is not None:
                return self.step_s
            if step_ms <= 0:
                return self.first_step_s
            return self.heartbeat_timeout_s + STEP_FACTOR * step_ms / 1000.0
        if busy == "average":
            return self.heartbeat_timeout_s + self.first_step_s
        if busy in ("eval", "callback", "save"):
            return self.eval_s
        if busy == "build":
            return self.first_step_s
        return None  # idle, or a peer that reports no activity


@dataclass(frozen=True)
class Progress:
    """What a rank's last heartbeat said of its training thread, and when it arrived."""

    busy: str = ""
    busy_s: float = 0.0
    step_ms: float = 0.0
    at: float = 0.0  # controller clock when the heartbeat arrived


#: A rank's heartbeat comes every half second (rank/link.py); after this long without one it is silent, not stuck.
SILENT_AFTER_S = 2.0


def stalled(progress: Progress, now: float, limits: ProgressLimits) -> str | None:
    """Why the rank is hung (for the log and the summary), or None while it makes progress.

    The stall is what the heartbeat reported plus the time since it arrived:
    a rank whose heartbeats stop altogether is the silence check's.
    """
    limit = limits.deadline(progress.busy, progress.step_ms)
    if limit is None:
        return None
    # extrapolated only while heartbeats are due: a rank silent for longer (SIGSTOP, a cut link)
    # is not known to be stuck, and the silence check names what really happened
    stuck = progress.busy_s + min(max(0.0, now - progress.at), SILENT_AFTER_S)
    if stuck <= limit:
        return None
    basis = _basis(progress, limits)
    return f"made no progress in {_WHAT[progress.busy]} for {stuck:.1f} s (deadline {limit:.1f} s: {basis})"


def _basis(progress: Progress, limits: ProgressLimits) -> str:
    """How the deadline was derived, so the user knows which option to raise."""
    if progress.busy == "step":
        if limits.step_s is not None:
            return "step_timeout_secs"
        if progress.step_ms <= 0:
            return "its first step, join_timeout_secs"
        return f"heartbeat timeout {limits.heartbeat_timeout_s:g} s + {STEP_FACTOR:g} × its {progress.step_ms / 1000.0:.2f} s step; raise with --step-timeout-secs"
    if progress.busy == "average":
        return "heartbeat timeout + join_timeout_secs"
    if progress.busy == "build":
        return "join_timeout_secs"
    return "eval_timeout_secs"
