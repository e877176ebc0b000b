"""The run's rows in loggers people already read: TensorBoard, a CSV file, W&B, and a user's own.

``--tensorboard-dir DIR`` writes a TensorBoard event file (tfevents.py: no
TensorBoard needed to write it) and ``--csv-log FILE`` a CSV table, one row per
row of the run's history (an epoch, or the epochs one average closed): the
loss, the eval, samples/s, seconds, averages, every user scalar, and each
rank's samples/s. The step is the row's last epoch counted from 1, as the
console prints it. Both are written as rows close, so they follow a live run.
``--wandb-project`` and ``--logger`` (hooks.py) get the TensorBoard logger's
scalars; they are made on a thread of their own while the run starts (W&B
starts a process), and rows that close before they are ready wait for them.
A logger that cannot write warns once and stops; training goes on.
"""

from __future__ import annotations

import asyncio
import csv
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import DdpRunConfig
from ..plan.metrics import EpochStats
from .hooks import Hook, open_all
from .tfevents import EventFileWriter

log = logging.getLogger("flodl.monitor")

#: The CSV's first columns; user scalars and per-rank rates follow, in the order they first appear.
CSV_COLUMNS = ("epoch", "first_epoch", "loss", "eval", "samples", "samples_per_s", "wall_s", "syncs")


def row_values(stats: EpochStats) -> dict[str, Any]:
    """A history row as the loggers' flat ``name: value`` (epochs counted from 1)."""
    values: dict[str, Any] = {
        "epoch": stats.epoch + 1,
        "first_epoch": stats.first_epoch + 1,
        "loss": stats.avg_loss,
        "eval": stats.eval_value,
        "samples": stats.samples,
        "samples_per_s": stats.samples_per_s,
        "wall_s": stats.wall_ms / 1000.0,
        "syncs": stats.syncs,
    }
    values.update({f"scalars/{k}": v for k, v in sorted(stats.scalars.items())})
    values.update({f"rank{r}/samples_per_s": p.throughput for r, p in sorted(stats.per_rank.items())})
    return values


class CsvLog:
    """One CSV row per history row; a new column (a scalar first seen later) rewrites the file with it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] = list(CSV_COLUMNS)
        self.rows: list[dict[str, Any]] = []
        self._write_all()

    def add(self, values: dict[str, Any]) -> None:
        self.rows.append(values)
        new = [k for k in values if k not in self.columns]
        if new:
            self.columns += new
            self._write_all()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(_cells(values))

    def _write_all(self) -> None:
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            for row in self.rows:
                writer.writerow(_cells(row))
        os.replace(tmp, self.path)


def _cells(values: dict[str, Any]) -> dict[str, Any]:
    return {k: "" if v is None else v for k, v in values.items()}


def _close_all(hooks: list[Hook]) -> None:
    for hook in hooks:
        hook.close()


def tensorboard_scalars(values: dict[str, Any], metric: str | None) -> dict[str, float]:
    """A row's numbers as TensorBoard tags (and every hook) get them: the eval as ``eval/<metric>``."""
    return {
        (f"eval/{metric or 'value'}" if k == "eval" else k): float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and k not in ("epoch", "first_epoch")
    }


class Loggers:
    """The loggers the run's options ask for (none: nothing happens)."""

    def __init__(self, config: DdpRunConfig) -> None:
        self.config = config
        self.tensorboard: EventFileWriter | None = None
        self.csv: CsvLog | None = None
        self.hooks: list[Hook] = []
        self._opening: asyncio.Task[list[Hook]] | None = None  # the hooks being made (start)
        self._waiting: list[tuple[dict[str, float], int]] = []  # rows closed before they were ready
        if config.tensorboard_dir:
            try:
                self.tensorboard = EventFileWriter(config.tensorboard_dir)
            except OSError as exc:
                log.warning("cannot write TensorBoard events to %s (%s): no TensorBoard log", config.tensorboard_dir, exc)
        if config.csv_log:
            try:
                self.csv = CsvLog(config.csv_log)
            except OSError as exc:
                log.warning("cannot write the CSV log %s (%s): no CSV log", config.csv_log, exc)

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Make the W&B and user loggers on a thread (on the running loop; none asked for: nothing)."""
        if self.config.wandb_project or self.config.loggers:
            self._opening = asyncio.get_running_loop().create_task(asyncio.to_thread(open_all, self.config, dict(run_info)))

    def row(self, stats: EpochStats, metric: str | None) -> None:
        """A history row closed (its eval, if any, in)."""
        values = row_values(stats)
        numbers = tensorboard_scalars(values, metric)
        step = stats.epoch + 1
        if self.tensorboard is not None:
            try:
                self.tensorboard.scalars(numbers, step=step)
            except OSError as exc:
                log.warning("TensorBoard log stopped: %s", exc)
                self.tensorboard = None
        if self.csv is not None:
            try:
                self.csv.add(values)
            except OSError as exc:
                log.warning("CSV log stopped: %s", exc)
                self.csv = None
        self._waiting.append((numbers, step))
        self._flush()

    def _flush(self) -> None:
        """Rows to the hooks, once they are made."""
        if self._opening is not None:
            if not self._opening.done():
                return
            opening, self._opening = self._opening, None
            if opening.exception() is not None:  # open_all says each logger's own failure: a bug of ours, not the run's end
                log.warning("the loggers could not start: %s", opening.exception())
            else:
                self.hooks = opening.result()
        waiting, self._waiting = self._waiting, []
        for numbers, step in waiting:
            for hook in self.hooks:
                hook.log(numbers, step)

    async def close(self) -> list[str]:
        """Close them (the hooks once made and given every row); the paths written."""
        if self._opening is not None:
            await asyncio.wait([self._opening])
        self._flush()
        if self.hooks:
            await asyncio.to_thread(_close_all, self.hooks)
        written = []
        if self.tensorboard is not None:
            self.tensorboard.close()
            written.append(str(self.tensorboard.path))
        if self.csv is not None:
            written.append(str(self.csv.path))
        return written
