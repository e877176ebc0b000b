"""Public points where a bench or a test looks into a running controller.

Benches used to subclass ``Controller`` and override its private methods, so
a refactor broke them silently. They pass a ``ControllerHooks`` instead
(``Controller(..., hooks=MyHooks())``): each method is called at one named
point of the run, on the controller's event loop, and does nothing by
default. Keep them cheap; ``handled`` runs once per message on the hot path.
"""

from __future__ import annotations

from ..wire.transport import ControlEndpoint


class ControllerHooks:
    """Override the points you need; the defaults do nothing."""

    def opened(self, endpoint: ControlEndpoint) -> None:
        """The control socket is bound and started, before any peer knows its port."""

    def handled(self, msg: object) -> None:
        """A peer's message was handled (after its handler ran; a frame that was
        dropped, or of a type the controller does not act on, is not reported)."""

    def planned(self, window: int, ranks: int, seconds: float) -> None:
        """Window ``window`` was planned for ``ranks`` ranks, taking ``seconds`` (ElChe and the dispatcher)."""

    def settled(self, window: int, seconds: float) -> None:
        """Every report of ``window`` was accounted (coverage, epochs, ElChe's tuning), taking ``seconds``."""

    def deaths_handled(self, dead: set[int], seconds: float) -> None:
        """Ranks ``dead`` were declared dead and the run went on or stopped, taking ``seconds``."""

    def joiners_admitted(self, ranks: list[int], seconds: float) -> None:
        """Ranks ``ranks`` joined at a window boundary, taking ``seconds``."""
