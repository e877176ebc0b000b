"""The strict handoff between a script's own loop and the rank runner driving it.

In script mode two threads share one process: the script's main thread (the
user's loop) and the driver thread (the ``RankRunner``). They take turns, like
coroutines: exactly one of them runs at a time, so torch state (the model, the
optimizer, the flat buckets) is never touched by both at once. Each side hands
the other something and waits for its turn to come back:

* the driver ``hand``s the main thread an ``Item`` (a round of its batch
  loop, an epoch's end, "prepared") and waits for the main thread's next
  ``call``, whose payload (how the round ended) it returns;
* the main thread ``call``s the driver with a payload and waits for the next
  item.

Before ``prepare()`` both run (the driver only connects; the script builds its
model and data): the driver waits in ``first`` for the first call. When the
driver ends, ``finish`` hands the main thread an ``end`` item for good. When
the script's code fails (or returns early), ``fail`` wakes the driver wherever
it waits, with the reason, and the driver reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Item kinds the driver hands the main thread.
BATCH, EPOCH_END, PREPARED, END = "batch", "epoch_end", "prepared", "end"
#: An epoch begins in which this rank trains no batch (its end follows at once): every rank
#: sees every epoch. An epoch with batches begins with its first ``BATCH``.
EPOCH = "epoch"
#: The driver hands the main thread a round of its batch loop to run there (script_round.py).
ROUND = "round"


@dataclass(slots=True)  # one a batch: a frozen dataclass costs several times as much to build
class Item:
    """What the main thread gets: ``kind``, the epoch it belongs to, a batch, an exit code, a round."""

    kind: str
    epoch: int = -1
    batch: Any = None
    code: int = 0
    round: Any = None  # ROUND: the ``InlineRound`` the main thread runs


class ScriptFailed(Exception):
    """The script's own code raised (or returned before the run ended): the driver reports ``reason``."""

    def __init__(self, reason: BaseException) -> None:
        super().__init__(f"{type(reason).__name__}: {reason}")
        self.reason = reason


class Bridge:
    """One turn at a time between the main thread and the driver thread."""

    #: How often a waiting driver looks at ``check`` (the controller lost, SIGTERM) before ``prepare``.
    POLL_S = 0.5

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._driver_turn = False
        self._to_main: Item | None = None
        self._to_driver: Any = None
        self._failure: BaseException | None = None
        self.ended: Item | None = None  # the driver finished: its exit code

    # ------------------------------------------------------------ main thread

    def call(self, payload: Any) -> Item:
        """Give the driver its turn with ``payload``; the item it hands back (``end`` once it finished)."""
        with self._cond:
            if self.ended is not None:
                return self.ended
            self._to_driver, self._driver_turn = payload, True
            self._cond.notify_all()
            while self._driver_turn and self.ended is None:
                self._cond.wait()
            item, self._to_main = self._to_main, None
            return item if item is not None else self.ended  # type: ignore[return-value]  # one of them is set

    def fail(self, reason: BaseException) -> None:
        """The script's code failed: wake the driver, wherever it waits, to report ``reason``."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._driver_turn = True
            self._cond.notify_all()

    def wait_ended(self, timeout_s: float) -> Item | None:
        """Wait (bounded) for the driver to finish; its ``end`` item, or None."""
        with self._cond:
            self._cond.wait_for(lambda: self.ended is not None, timeout_s)
            return self.ended

    # ---------------------------------------------------------- driver thread

    def first(self, check: Callable[[], None]) -> Any:
        """The main thread's first payload (``prepare``'s); ``check()`` runs every ``POLL_S`` and may raise.

        Raises:
            ScriptFailed: the script failed before it prepared.
        """
        with self._cond:
            while not self._driver_turn:
                self._cond.wait(self.POLL_S)
                if not self._driver_turn:
                    check()
            return self._take()

    def hand(self, item: Item) -> Any:
        """Hand ``item`` to the main thread and wait for its next call; that call's payload.

        Raises:
            ScriptFailed: the script's code failed meanwhile.
        """
        with self._cond:
            self._to_main, self._driver_turn = item, False
            self._cond.notify_all()
            while not self._driver_turn:
                self._cond.wait()
            return self._take()

    def finish(self, code: int) -> None:
        """The driver is done (its saves written, its link closed): the main thread gets ``end`` from now on."""
        with self._cond:
            self.ended = Item(END, code=code)
            self._to_main, self._driver_turn = None, False
            self._cond.notify_all()

    def _take(self) -> Any:
        if self._failure is not None:
            raise ScriptFailed(self._failure)
        payload, self._to_driver = self._to_driver, None
        return payload
