"""A round's batch loop state, and the batch it hands out to train (``Windows.round_steps``, windows.py).

The loop between two averages is a generator: it runs the checks and the
bookkeeping between batches and yields each batch to train as a ``Due``. A
``Task`` rank steps each one on its own thread; a script rank hands the whole
round to the script's thread, which steps them in the user's loop
(script_round.py). ``RoundLoop`` holds what the loop carries from one batch,
and one round, to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .averager import Averager
from .step_meter import StepRecord
from .window_stats import RoundStats


@dataclass(slots=True)  # made every step: a frozen dataclass costs 5x to build
class Due:
    """A batch to train now: its epoch, the batch, its samples and how long it took to fetch."""

    epoch: int
    batch: Any
    samples: int
    data_ms: float


@dataclass
class RoundLoop:
    """A window's batch loop across its rounds: its stop rules, and where it stands."""

    stats: RoundStats
    batches: Any  # the window's (epoch, picks, batch) stream
    averager: Averager
    start: float  # the window's start (perf_counter)
    sync_every: int  # batches (or shards) per round; 0: the round runs to the quota
    quota_batches: int
    target_ms: float  # the time quota, less what the last window ran past its own
    quota_ms: float
    window: int | None
    sharded: bool  # a Shards dataset: stops, averages and quotas count whole shards
    exhausted: bool = False  # no more batches in this window
    whole: bool = True  # no shard is part-trained: the window may stop here
    stepped: int = 0  # batches trained in this round
    shards: int = 0  # shards ended in this round
    last: StepRecord | None = None  # the round's last step, held back until its average (``Windows.report``)
