"""Where a rank stands in its group: a value, replaced whole by its one owner (regroup.py ``Group``).

Everything else reads it: the window's report (``dropped_window``), a failed
rank's error (``generation``), the evaluator (``world_size``: did an average
change the model?), the user's ``worker.world_size``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupPosition:
    """A rank's membership generation, its group, and where its averages stand."""

    generation: int = 0  # the membership generation this rank is in
    world_size: int = 1  # members of that generation
    peers: frozenset[int] = frozenset()  # the ranks of this rank's process group (did one leave?)
    position: int = 0  # the next average's place in the run: window << 16 | round (members compare them)
    redoing: bool = False  # an average failed and is to be redone in the next generation
    skip_redo: bool = False  # ... unless the other survivors completed it
    bg_redo: bool = False  # a background average was dropped: the survivors' group repeats it
    # the window whose background average was dropped since the last report (-1: none): the next
    # report says so, and the controller learns whether a dead peer's last window is in a replica
    dropped_window: int = -1
