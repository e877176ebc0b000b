"""How a rank's work ends early, and which errors are whose.

``Stop`` unwinds the rank from wherever it trains to its exit path;
``UserError`` carries a failure of the user's own code with the stage it
happened in; ``is_collective_error`` tells torch's collective failures (a
peer gone: recoverable) from errors in the user's training step.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

_FLODL_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


class Stop(Exception):
    """The rank's work ends here: the controller is gone, ordered an abort, or we got SIGTERM."""


class UserError(Exception):
    """A user callback raised; carries where, for the report."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.stage = stage
        self.original = exc


class NonFiniteLoss(ArithmeticError):
    """The loss turned NaN or infinite: this replica must not be averaged into the others."""

    def __init__(self, value: float, epoch: int, step: int) -> None:
        super().__init__(
            f"the loss became {value} at epoch {epoch + 1}, step {step} of this rank; "
            "its replica was not averaged into the others and nothing was saved over the last bundle "
            "(lower the learning rate, or clip gradients with --max-grad-norm)"
        )


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (and of its chained causes) without flodl's own frames, nor
    Python's frozen machinery (``runpy`` running a script, ``importlib`` importing a task): the
    user sees where their code raised, not the runner that called it. Where no frame is the
    user's (a flodl bug), the whole traceback."""
    report = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    te: traceback.TracebackException | None = report
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        theirs = [frame for frame in te.stack if not (frame.filename or "").startswith((_FLODL_DIR, "<frozen "))]
        if theirs:
            te.stack[:] = theirs
        te = te.__cause__ or te.__context__
    return "".join(report.format())


def is_collective_error(exc: RuntimeError) -> bool:
    """Does torch's error text say a collective failed (a peer gone, a timeout), not the user's code?"""
    text = str(exc).lower()
    return any(k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))
