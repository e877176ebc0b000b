"""Reading a run summary's history, whose rows are an epoch each or a group of epochs one average
closed (``first_epoch`` to ``epoch``: docs/cadence.md, *Epoch tails*); a long run's middle rows
are merged (``merged_rows``: flodl/controller/history.py) and keep no epoch's own samples."""

from __future__ import annotations

from flodl.controller.history import epoch_samples, epochs_of

__all__ = ["epoch_samples", "epochs", "epochs_of"]


def epochs(history: list[dict]) -> list[int]:
    """Every epoch the rows cover, in order."""
    return [e for row in history for e in epochs_of(row)]
