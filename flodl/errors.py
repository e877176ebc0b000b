"""flodl's error taxonomy: each class says whose fault a failure is.

Catch narrowly. A ``ProtocolError`` is a peer's bug (or an attacker) and is
never allowed to crash an actor; a ``ConfigError`` is the user's and is
raised before anything starts; ``PeerLost`` and ``RunAborted`` are the
cluster's and end the run with a message naming the rank and host.
"""

from __future__ import annotations


class FlodlError(Exception):
    """Base class of every error flodl raises on purpose."""


class ConfigError(FlodlError, ValueError):
    """A run option is invalid; the message names the option.

    Raised at build/parse time, before any process starts, so a typo costs
    seconds, not a cluster allocation.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TaskError(FlodlError, ValueError):
    """The user's ``Task`` (or its import spec) cannot be used.

    Raised on the rank that builds it; the controller reports it with the
    rank and host so the user sees it once, not once per rank.
    """


class ProtocolError(FlodlError):
    """A frame is malformed, unauthenticated, or of an unknown kind/version.

    Carries ``reason`` (one of ``protocol.codec.DROP_REASONS``); receivers
    count and drop such frames and never change state because of them.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DeadlineExceeded(FlodlError, TimeoutError):
    """A network wait ran past its deadline (the peer may still be alive)."""


class PeerLost(FlodlError):
    """A peer stopped answering: its heartbeats lapsed or its process exited."""


class RunAborted(FlodlError):
    """The run was stopped before completion; ``exit_code`` says why.

    The controller's CLI exits with ``exit_code``; ``Trainer.run()`` raises
    this with the same message the CLI prints.
    """

    def __init__(self, message: str, exit_code: int, summary: dict | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.summary = summary or {}


class ClosedError(FlodlError):
    """An endpoint was used after we closed it ourselves (a local bug, not a peer's)."""


# Process exit codes, one per way a run can end, so scripts can tell them apart.
EXIT_OK = 0
EXIT_FAILED = 1  # an unexpected error (a bug); the traceback is printed
EXIT_CONFIG = 2  # bad options or task spec, nothing was started
EXIT_RANK_LOST = 3  # a rank died or went silent and the run was stopped
EXIT_TASK_ERROR = 4  # the user's task raised on a rank
EXIT_CONTROLLER_LOST = 5  # a worker or rank lost the controller
EXIT_SAVED = 6  # the run could not go on (ranks lost); a bundle was saved: continue with --resume-from
EXIT_LAUNCH_FAILED = 7  # the ssh launcher could not start the run (controller or a host failed at start)
EXIT_NONFINITE = 8  # a rank's loss turned NaN or infinite; nothing was averaged or saved from it
EXIT_EVALS_FAILED = 9  # training completed, but every eval raised: nothing says how well it went
EXIT_UNSAVED = 10  # training completed, but the final save failed: the bundle on disk is an older one (or none)
EXIT_INTERRUPTED = 130  # SIGINT / SIGTERM
