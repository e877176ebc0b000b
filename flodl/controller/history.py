"""The summary's history, kept small however long the run: whole at both ends, merged between.

A run's history has a row per epoch (or per group of epochs one average
closed): 1,500 epochs made a 1 MB summary. ``compact`` keeps the first and the
last ``keep_whole`` rows as they are and merges the rows between into at most
``middle_rows`` rows of consecutive epochs each; ``bounded`` picks the largest
of ``LEVELS`` whose JSON (as ``--summary-json`` writes it) fits
``HISTORY_BYTES``, so the summary of a long run stays under 100 KB (each row
holds an entry per rank: with many ranks, fewer rows). A merged row has the shape of a whole one, with ``merged_rows``
(how many rows it stands for) added: its ``first_epoch`` to ``epoch`` cover
its epochs, its counts (samples, batches, wall, syncs, each rank's) are their
sums, its ``loss`` their sample-weighted mean, its ``eval`` the last one scored
in it (at ``eval_epoch``), its ``scalars`` the mean of its rows'; it has no
``epoch_losses`` nor ``epoch_samples`` (each epoch's own). Every epoch's own row
stays in the record stream (``--record-log-dir``, ``python -m
flodl.monitor.reader``), the TensorBoard and CSV logs. Pure logic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: (rows kept whole at each end, merged rows between), largest first: the first that fits is kept.
LEVELS = ((20, 60), (10, 30), (5, 15), (2, 6))
#: The history's share of a summary file, in bytes of its JSON.
HISTORY_BYTES = 64 * 1024

_SUMMED = ("samples", "batches", "wall_s", "syncs")
_RANK_SUMMED = ("samples", "batches", "compute_ms", "data_ms", "sync_ms")


def bounded(rows: Sequence[dict[str, Any]], *, budget: int | None = HISTORY_BYTES) -> list[dict[str, Any]]:
    """``rows`` compacted at the largest of ``LEVELS`` that fits ``budget`` bytes of JSON (the
    smallest when none does); the rows as they are while they fit whole (``budget`` None: always)."""
    if budget is None or _size(rows) <= budget:
        return list(rows)
    for keep_whole, middle_rows in LEVELS:
        out = compact(rows, keep_whole=keep_whole, middle_rows=middle_rows)
        if _size(out) <= budget:
            break
    return out


def _size(rows: Sequence[dict[str, Any]]) -> int:
    """Bytes of ``rows`` in the summary file: JSON with ``indent=2``, each line two spaces deeper there."""
    text = json.dumps(list(rows), indent=2, default=str)
    return len(text) + 2 * text.count("\n")


def compact(rows: Sequence[dict[str, Any]], *, keep_whole: int, middle_rows: int) -> list[dict[str, Any]]:
    """``rows`` (``EpochStats.to_dict()``, in epoch order) with the middle merged, when there are
    more than ``2 * keep_whole + middle_rows`` of them; else the rows as they are.

    Raises:
        ValueError: ``keep_whole`` below 0 or ``middle_rows`` below 1.
    """
    if keep_whole < 0 or middle_rows < 1:
        raise ValueError(f"keep_whole must be >= 0 and middle_rows >= 1, got {keep_whole} and {middle_rows}")
    if len(rows) <= 2 * keep_whole + middle_rows:
        return list(rows)
    head, middle, tail = rows[:keep_whole], rows[keep_whole : len(rows) - keep_whole], rows[len(rows) - keep_whole :]
    # even slices of the middle: the first len % middle_rows of them one row longer
    size, extra = divmod(len(middle), middle_rows)
    merged, start = [], 0
    for i in range(middle_rows):
        end = start + size + (1 if i < extra else 0)
        merged.append(merge(middle[start:end]))
        start = end
    return [*head, *merged, *tail]


def merge(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row standing for consecutive ``rows`` (see the module's docstring)."""
    out: dict[str, Any] = {
        "epoch": rows[-1]["epoch"],
        "first_epoch": rows[0].get("first_epoch", rows[0]["epoch"]),
        "merged_rows": sum(r.get("merged_rows", 1) for r in rows),
    }
    for key in _SUMMED:
        out[key] = sum(r.get(key) or 0 for r in rows)
    out["ahead_samples"] = rows[-1].get("ahead_samples", 0)
    weighed = [(r["loss"], r.get("samples") or 0) for r in rows if r.get("loss") is not None]
    weight = sum(n for _, n in weighed)
    out["loss"] = (sum(v * n for v, n in weighed) / weight if weight else sum(v for v, _ in weighed) / len(weighed)) if weighed else None
    scored = [r for r in rows if r.get("eval") is not None]
    out["eval"] = scored[-1]["eval"] if scored else None
    out["eval_epoch"] = scored[-1].get("eval_epoch", scored[-1]["epoch"]) if scored else None
    eval_times = [r["eval_s"] for r in rows if r.get("eval_s") is not None]
    out["eval_s"] = sum(eval_times) if eval_times else None
    out["samples_per_s"] = out["samples"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
    out["scalars"] = _mean_scalars(rows)
    out["per_rank"] = _merge_ranks(rows, out["samples"])
    return out


def _mean_scalars(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each user scalar's mean over the rows that have it."""
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in (row.get("scalars") or {}).items():
            if value is not None:
                values.setdefault(key, []).append(value)
    return {key: sum(vs) / len(vs) for key, vs in values.items()}


def _merge_ranks(rows: Sequence[dict[str, Any]], samples: int) -> dict[str, dict[str, float]]:
    """Each rank's sums over the rows; its rate from its own wall (samples / rate, per row)."""
    ranks: dict[str, dict[str, float]] = {}
    walls: dict[str, float] = {}
    for row in rows:
        for rank, part in (row.get("per_rank") or {}).items():
            acc = ranks.setdefault(rank, dict.fromkeys(_RANK_SUMMED, 0.0))
            for key in _RANK_SUMMED:
                acc[key] += part.get(key) or 0
            rate = part.get("samples_per_s") or 0.0
            walls[rank] = walls.get(rank, 0.0) + ((part.get("samples") or 0) / rate if rate > 0 else 0.0)
    out = {}
    for rank in sorted(ranks, key=int):
        acc = ranks[rank]
        out[rank] = {
            "samples": int(acc["samples"]),
            "batches": int(acc["batches"]),
            "samples_per_s": acc["samples"] / walls[rank] if walls[rank] > 0 else 0.0,
            "batch_share": acc["samples"] / samples if samples else 0.0,
            "compute_ms": acc["compute_ms"],
            "data_ms": acc["data_ms"],
            "sync_ms": acc["sync_ms"],
        }
    return out


def epochs_of(row: dict[str, Any]) -> list[int]:
    """The epochs a history row covers (a group's row: ``first_epoch`` to ``epoch``)."""
    return list(range(row.get("first_epoch", row["epoch"]), row["epoch"] + 1))


def epoch_samples(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Each epoch's own samples, in epoch order, across a summary's rows (a group's row keeps each
    one's in ``epoch_samples``): what a reader checks coverage by, one entry an epoch.

    Raises:
        ValueError: a merged row (a long run's summary): each epoch's samples are in the record stream.
    """
    merged = [row for row in rows if "merged_rows" in row]
    if merged:
        raise ValueError(
            f"rows of epochs {merged[0]['first_epoch']}-{merged[0]['epoch']} are merged: each epoch's samples are in the record stream"
        )
    return [row.get("epoch_samples", {}).get(str(e), row["samples"]) for row in rows for e in epochs_of(row)]
