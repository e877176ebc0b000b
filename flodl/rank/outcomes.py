"""How a rank's work ends early, and which errors are whose.

``Stop`` unwinds the rank from wherever it trains to its exit path;
``UserError`` carries a failure of the user's own code with the stage it
happened in; ``is_collective_error`` tells torch's collective failures (a
peer gone: recoverable) from errors in the user's training step.
"""

from __future__ import annotations


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


def is_collective_error(exc: RuntimeError) -> bool:
    """Does torch's error text say a collective failed (a peer gone, a timeout), not the user's code?"""
    text = str(exc).lower()
    return any(k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))
