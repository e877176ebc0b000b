"""The counters every staging tier keeps (VRAM pool, RAM cache, disk stage).

Its own module so that staging.py and disk_stage.py both use it without
importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """Counters of one tier; ``bytes`` is what it holds now."""

    hits: int = 0
    misses: int = 0
    items: int = 0
    bytes: int = 0
    puts_refused: int = 0

    def record(self, hit: bool) -> None:
        """One lookup: a hit or a miss."""
        if hit:
            self.hits += 1
        else:
            self.misses += 1

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}
