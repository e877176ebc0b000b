"""Reading a run summary's history, whose rows are an epoch each or a group of epochs one average
closed (``first_epoch`` to ``epoch``: docs/cadence.md, *Epoch tails*); a long run's middle rows
are merged (``merged_rows``: flodl/controller/history.py) and keep no epoch's own samples."""

from __future__ import annotations


def epochs_of(row: dict) -> list[int]:
    """The epochs a history row covers."""
    return list(range(row.get("first_epoch", row["epoch"]), row["epoch"] + 1))


def epoch_samples(history: list[dict]) -> list[int]:
    """Each epoch's own samples, in epoch order, across the rows (a group's row keeps each one's).

    Raises:
        ValueError: a merged row (a long run's summary): read the record stream for every epoch.
    """
    merged = [row for row in history if "merged_rows" in row]
    if merged:
        raise ValueError(
            f"rows of epochs {merged[0]['first_epoch']}-{merged[0]['epoch']} are merged: each epoch's samples are in the record stream"
        )
    return [row["epoch_samples"][str(e)] for row in history for e in epochs_of(row)]


def epochs(history: list[dict]) -> list[int]:
    """Every epoch the rows cover, in order."""
    return [e for row in history for e in epochs_of(row)]
