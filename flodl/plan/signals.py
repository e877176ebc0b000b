"""What ElChe and the divergence guard say to each other: the balancer's phase and the guard's verdict.

``ElChe`` (elche.py) moves through the phases and obeys verdicts; the guard and the
meta-controller (guard.py) hand out verdicts and read the phase. Both types live here so
neither module imports the other. Pure values: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar


class Phase(str, Enum):
    """Lifecycle of the balancer, ordered: Probe < Warmup < Stable < Mature.

    The phase only moves forward. It is a str enum so it serialises as its
    value; the comparison operators follow the lifecycle order, not the text.
    """

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    def __str__(self) -> str:
        return self.value

    @property
    def order(self) -> int:
        return _PHASE_ORDER[self]

    def __lt__(self, other: object) -> bool:
        return self.order < Phase(other).order

    def __le__(self, other: object) -> bool:
        return self.order <= Phase(other).order

    def __gt__(self, other: object) -> bool:
        return self.order > Phase(other).order

    def __ge__(self, other: object) -> bool:
        return self.order >= Phase(other).order


_PHASE_ORDER = {Phase.PROBE: 0, Phase.WARMUP: 1, Phase.STABLE: 2, Phase.MATURE: 3}


STABLE = "stable"
SUPPRESS_GROWTH = "suppress_growth"
NUDGE_DOWN = "nudge_down"
VERDICT_KINDS = (STABLE, SUPPRESS_GROWTH, NUDGE_DOWN)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A guard's judgement of the last window: ``stable``, ``suppress_growth`` or ``nudge_down``.

    Use the constants ``Verdict.STABLE`` / ``Verdict.SUPPRESS_GROWTH`` and
    ``Verdict.nudge(f)``; ``factor`` is set only for ``nudge_down`` (the anchor
    becomes ``ceil(anchor * f)``).
    """

    kind: str
    factor: float | None = None

    STABLE: ClassVar[Verdict]
    SUPPRESS_GROWTH: ClassVar[Verdict]

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(f"verdict kind must be one of {', '.join(VERDICT_KINDS)}, got {self.kind!r}")
        if self.kind == NUDGE_DOWN:
            factor = self.factor
            if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0:
                raise ValueError(f"a nudge_down verdict needs a positive finite factor, got {factor!r}")
            object.__setattr__(self, "factor", float(factor))
        elif self.factor is not None:
            raise ValueError(f"only nudge_down carries a factor, got {self.kind} with {self.factor!r}")

    @classmethod
    def nudge(cls, factor: float) -> Verdict:
        return cls(NUDGE_DOWN, factor)

    @property
    def is_stable(self) -> bool:
        return self.kind == STABLE

    @property
    def is_pressure(self) -> bool:
        """SuppressGrowth or NudgeDown: the guard saw drift it did not like."""
        return self.kind != STABLE

    def to_list(self) -> list[Any]:
        """``[kind, factor]``: the JSON form used in checkpoints."""
        return [self.kind, self.factor]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> Verdict:
        kind, factor = data
        return cls(kind, factor)

    def __str__(self) -> str:
        return f"{self.kind}({self.factor})" if self.factor is not None else self.kind


Verdict.STABLE = Verdict(STABLE)
Verdict.SUPPRESS_GROWTH = Verdict(SUPPRESS_GROWTH)


__all__ = ["NUDGE_DOWN", "STABLE", "SUPPRESS_GROWTH", "VERDICT_KINDS", "Phase", "Verdict"]
