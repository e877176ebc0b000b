"""Streamed fragments (``--sync-fragments F``): which fragment of the model an average takes.

The parameters are cut into F fragments once, from the model alone (flat.py
``fragment_of``); an average exchanges one of them, in rotation. Every member
of an average must take the same fragment, so the choice is a function of
what every member already agrees on, never of a rank's own history:

* the collective backend: the average's position, ``window << 16 | round``
  (regroup.py; members compare positions to redo an average after a death, so
  a redone average takes the fragment it had);
* the CPU backend: the round number less one (round 0 is the run's first
  broadcast), which every rank counts alike and a joiner is told by the
  controller (``Regroup.first_round``).

Fragment ``k = (counter + base) mod F``. ``base`` is 0 in a fresh run; a
resumed run takes it from its bundle (``NEXT_KEY`` in the ``.optim`` file's
train state: the fragment the saved run would have averaged next), so the
rotation goes on where it stopped. A rank that joins a resumed run reads the
same bundle stem (``take``): if this run has saved over it since, the bundle
names this run (``RUN_KEY``) and its ``BASE_KEY`` is the run's base; else its
``NEXT_KEY`` is. A full average (the run's first broadcast, its last average
at a clean end) takes every fragment.
"""

from __future__ import annotations

from typing import Any

#: The ``.optim`` train-state keys: the fragment the next average takes (a resumed run's first),
#: the base of the run that saved it, and that run's id.
NEXT_KEY, BASE_KEY, RUN_KEY = "sync_fragment_next", "sync_fragment_base", "sync_fragment_run"


class Rotation:
    """The fragment each average takes, and where the rotation stands (for a bundle)."""

    def __init__(self, fragments: int = 1) -> None:
        self.fragments = fragments
        self.base = 0
        self.last: int | None = None  # the fragment the last fragment average took

    @property
    def active(self) -> bool:
        return self.fragments > 1

    def of(self, counter: int) -> int | None:
        """The fragment of the average numbered ``counter`` (None: every fragment; a negative
        counter names no place in the rotation, and averages the whole model)."""
        if not self.active or counter < 0:
            return None
        fragment = (counter + self.base) % self.fragments
        self.last = fragment
        return fragment

    def next(self) -> int:
        """The fragment the next average takes, as a bundle records it."""
        if self.last is None:
            return self.base % self.fragments
        return (self.last + 1) % self.fragments

    def resume_at(self, fragment: int, first_counter: int = 0) -> None:
        """A resumed run: the average numbered ``first_counter`` takes ``fragment``."""
        if self.active:
            self.base = (fragment - first_counter) % self.fragments
            self.last = None

    def state(self, run_id: str) -> dict[str, Any]:
        """What a bundle keeps of the rotation (run ``run_id``'s)."""
        return {NEXT_KEY: self.next(), BASE_KEY: self.base, RUN_KEY: run_id} if self.active else {}

    def take(self, train_state: dict[str, Any], run_id: str) -> None:
        """Go on from a bundle's rotation (``state``'s keys; none: from fragment 0): this run's own
        bundle (a joiner's read of a stem this run saved over) holds the run's base, an earlier
        run's the fragment this run begins with."""
        if not self.active or NEXT_KEY not in train_state:
            return
        if train_state.get(RUN_KEY) == run_id:
            self.base, self.last = int(train_state[BASE_KEY]) % self.fragments, None
        else:
            self.resume_at(int(train_state[NEXT_KEY]))


def position_counter(tag: int) -> int:
    """The collective backend's counter of an average at position ``tag`` (window << 16 | round):
    windows in order, and the rounds of a window (Sync's) in order after its first."""
    return -1 if tag < 0 else (tag >> 16) + (tag & 0xFFFF)
