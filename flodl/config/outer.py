"""The outer optimizer's settings, read from a run's options (torch-free: the controller reads them too).

The step itself is rank/outer.py's (``OuterStep``); docs/cadence.md, *Combining replicas*, says what
each setting does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The outer optimizers ``outer_optimizer`` names.
KINDS = ("none", "sgd", "nesterov")
#: DiLoCo's outer Nesterov (arXiv 2311.08105): rate 0.7, momentum 0.9, unless set.
NESTEROV_LR, NESTEROV_MOMENTUM = 0.7, 0.9


@dataclass(frozen=True)
class OuterConfig:
    """What the outer step does: ``kind``, its rate ``lr``, its momentum, and the run's LR factor
    ``1 + (R - 1) * lr_scale_ratio`` on it when ``on_average`` (R: the ranks in the average)."""

    kind: str = "none"
    lr: float = 1.0
    momentum: float = 0.0
    lr_scale_ratio: float = 0.0
    on_average: bool = False

    @classmethod
    def of(cls, config: Any) -> OuterConfig:
        """The outer step a run's options ask for (``outer_optimizer``, ``outer_lr``,
        ``outer_momentum``, ``lr_scale_on``, ``lr_scale_ratio``)."""
        kind = config.outer_optimizer or "none"
        lr = config.outer_lr if config.outer_lr is not None else (NESTEROV_LR if kind == "nesterov" else 1.0)
        momentum = config.outer_momentum if config.outer_momentum is not None else (NESTEROV_MOMENTUM if kind == "nesterov" else 0.0)
        return cls(kind, lr, momentum, config.lr_scale_ratio, config.lr_scale_on == "average")

    @property
    def active(self) -> bool:
        """Does the step ever change the average (the plain average with no factor: no)?"""
        return self.kind != "none" or self.lr != 1.0 or (self.on_average and self.lr_scale_ratio > 0)

    def rate(self, ranks: int) -> float:
        """The outer rate for an average of ``ranks`` ranks."""
        factor = 1.0 + (max(1, ranks) - 1) * self.lr_scale_ratio if self.on_average else 1.0
        return self.lr * factor
