"""``record_scalar``: user metrics recorded inside a training step.

A rank keeps a ``(sum, count)`` pair per key and ships the pairs with each
plan's ``EpochDone``; the controller averages per rank, then weights ranks by
their batches (``metrics.aggregate``). Calling it outside a rank (in a plain
script) just accumulates and is harmless.
"""

from __future__ import annotations

import math
import threading

_lock = threading.Lock()
_acc: dict[str, list[float]] = {}


def record_scalar(key: str, value: float) -> None:
    """Record one observation of a user metric (e.g. accuracy of this batch).

    Raises:
        TypeError: key is not a string or value is not a real number.
    """
    if not isinstance(key, str) or not key:
        raise TypeError("record_scalar key must be a non-empty string")
    value = float(value)
    if math.isnan(value):
        return  # a NaN would poison the epoch's mean; the loss already reports divergence
    with _lock:
        acc = _acc.setdefault(key, [0.0, 0.0])
        acc[0] += value
        acc[1] += 1.0


def drain() -> dict[str, list[float]]:
    """Take every ``[sum, count]`` recorded since the last drain."""
    global _acc
    with _lock:
        out, _acc = _acc, {}
    return out
