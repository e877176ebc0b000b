"""What a rank asks of its averager, whichever backend it is.

A rank averages through one of two backends: ``CollectiveAverager``
(collective.py: torch.distributed, in-process groups the survivors rebuild)
or ``CpuAverager`` (cpu_average.py: snapshots to the controller, averages
back). The training loop talks to either through ``Averager``; what only one
backend has (a group to rebuild, a redo, a first round to start at) is
reached after narrowing with ``isinstance`` (regroup.py, evaluation.py).
"""

from __future__ import annotations

from typing import Protocol

from .flat import Averaged, WireTally


class Averager(Protocol):
    """The averaging calls the rank makes on either backend."""

    #: A joiner without the consensus yet: it trains nothing until an average hands it one.
    adopting: bool

    @property
    def wire(self) -> WireTally:
        """What its averages put on the network (bytes sent and received, averages)."""
        ...

    def average(self, weight: float, *, measure: bool = False, block: bool = True, tag: int = -1, final: bool = False) -> Averaged:
        """Average this replica with the others (``weight``: batches trained since the last;
        ``final``: the run's last, of every fragment, with ``--sync-fragments``)."""
        ...

    def broadcast_from(self, root: int = 0) -> None:
        """Start every replica from ``root``'s values."""
        ...

    def poll(self) -> object:
        """Land what has arrived of an average in flight; never blocks."""
        ...
