"""Which epochs share an eval: one average that closed several short epochs is scored once.

Windows span several epochs where epochs are too short to average each on its own (ElChe's
overhead auto-tune, ``plan/cadence.py``). Every epoch closed by one window's average would
score the same model; the first of them asks the eval rank, the rest take its answer.
"""

from __future__ import annotations


class SharedEvals:
    """The evals asked per window, and the epochs waiting on each."""

    def __init__(self) -> None:
        self._asked_for_window: dict[int, int] = {}  # window -> the epoch whose eval scores its average
        self._sharers: dict[int, list[int]] = {}  # that epoch -> later epochs the same average closed

    def ask(self, epoch: int, window: int, *, final: bool) -> int | None:
        """``epoch`` wants the eval of ``window``'s average (-1: the model as it stands). Returns
        the earlier epoch whose eval it shares, or None when it must be asked for itself. The
        run's final epoch is always scored on its own: its eval is the run's result."""
        first = self._asked_for_window.get(window) if window >= 0 else None
        if first is not None and not final:
            self._sharers.setdefault(first, []).append(epoch)
            return first
        if window >= 0:
            self._asked_for_window[window] = epoch
        return None

    def answered_by(self, epoch: int) -> list[int]:
        """The epochs whose eval ``epoch``'s answer is: itself and those sharing it."""
        return [epoch, *self._sharers.get(epoch, ())]

    def sharing(self) -> set[int]:
        """Epochs that take another's answer (never asked again on their own)."""
        return {e for sharers in self._sharers.values() for e in sharers}
