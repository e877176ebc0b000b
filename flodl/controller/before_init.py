"""Scripts that failed before ``flodl.init()``: the user's error of the whole run, told once.

A ``--script`` rank that fails before it calls ``flodl.init()`` (a missing data
file, an argparse error) never joined the run: its worker reports the failure
(``RankError`` of stage ``scriptspec.BEFORE_INIT``, the traceback holding the
user's frames only) before the exit itself (``rank/script_start.py``). That is
not a lost rank to go on without: every rank runs the same script with the same
arguments, so the run stops as for a bad option (exit 2).

The ranks start together and usually fail together. The first report waits up
to ``GRACE_S`` for the others (no longer once no rank is left that might still
report: every one either reported or said hello); then each distinct traceback
is printed once, naming the ranks it came from (``on every rank`` when all did).
"""

from __future__ import annotations

from collections.abc import Callable

#: How long the first report waits for other ranks' (ranks start within milliseconds of each other).
GRACE_S = 1.0


class BeforeInit:
    """The failures before ``flodl.init()`` reported so far, by rank, and when the first came."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.failures: dict[int, tuple[str, str]] = {}  # rank -> (error, traceback)
        self.since: float | None = None
        self.done = False  # told: the run stops (a report that comes later changes nothing)

    def note(self, rank: int, error: str, detail: str, now: float) -> None:
        if self.done:
            return
        self.failures[rank] = (error, detail)
        if self.since is None:
            self.since = now

    def due(self, now: float, *, waiting: bool) -> bool:
        """Stop the run now? Once a failure came and either no rank may still report one
        (``waiting`` False) or the grace is over; never again once told."""
        return not self.done and self.since is not None and (not waiting or now - self.since >= self.grace_s)

    def told(self, ranks: list[int], where: Callable[[int], str]) -> tuple[str, str]:
        """``(printed, message)``: each distinct traceback once with the ranks it came from, and
        the run's one-line failure. ``ranks``: every rank of the run; ``where`` names one."""
        self.done = True
        groups: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(self.failures):
            groups.setdefault(self.failures[rank], []).append(rank)
        printed = ""
        for (_, detail), of in groups.items():
            if detail:
                printed += f"--- the script before flodl.init(), {_on(of, ranks, where)} ---\n{detail.rstrip()}\n"
        (error, _), first = next(iter(groups.items()))
        others = f" (and {len(groups) - 1} other failure(s), above)" if len(groups) > 1 else ""
        return printed, f"the script failed before flodl.init() {_on(first, ranks, where)}: {error}{others}"


def _on(failed: list[int], ranks: list[int], where: Callable[[int], str]) -> str:
    """``on every rank (0, 1)``, ``on rank 1 on host h (pid 42)``, ``on ranks 0, 2``."""
    numbers = ", ".join(str(r) for r in failed)
    if len(failed) > 1 and set(failed) >= set(ranks):
        return f"on every rank ({numbers})"
    return f"on {where(failed[0])}" if len(failed) == 1 else f"on ranks {numbers}"
