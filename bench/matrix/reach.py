"""When a run reaches a quality: the target, its tolerance, and reading it off a run as it goes and after.

The time-to-target bench (``bench/matrix/target.py``) sets a ``Goal`` per model
and seed from torchrun DDP's final eval and training loss, and every other run
trains until it meets both:

* eval >= target eval - ``EVAL_TOLERANCE`` (0.005: half a point of accuracy),
  the mirror (eval <= target + tolerance) for a metric where lower is better
  (``higher_is_better``);
* training loss <= ``LOSS_FACTOR`` x the target loss (1.05).

A *row* is one line of a run's summary history: one epoch, or (flodl, epochs
flowing) the group of epochs one average closed (``first_epoch`` .. ``epoch``).
A row's eval scores the model at its last epoch's end, and its training loss
here is that epoch's own (``epoch_losses``), the figure DDP's per-epoch row
holds; script mode has no controller eval, its ranks report the metric as a
scalar (``bench/matrix/script.py --eval-every-epoch``).

``RecordWatch`` reads the same while a flodl run trains, from the root node's
record log (``--record-log-dir``), so the bench can stop the run once it is
there. A record carries the group's mean loss, not its last epoch's: never
below the last epoch's while the loss falls, so the watch fires at the row the
summary names or a little later, and the summary decides the figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

EVAL_TOLERANCE = 0.005  # half a point of an accuracy in [0, 1]
LOSS_FACTOR = 1.05
#: metric names (any part of them) whose lower values are better
LOWER_IS_BETTER = ("loss", "perplexity", "error", "mse", "mae", "rmse")


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is the better one (accuracies are; losses, errors are not)."""
    name = metric.lower()
    return not any(word in name for word in LOWER_IS_BETTER)


@dataclass(frozen=True)
class Goal:
    """The quality a run must reach: a baseline's final eval and training loss, with the tolerances."""

    metric: str
    eval: float
    loss: float

    @property
    def higher_better(self) -> bool:
        return higher_is_better(self.metric)

    def eval_met(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.higher_better:
            return value >= self.eval - EVAL_TOLERANCE
        return value <= self.eval + EVAL_TOLERANCE

    def loss_met(self, value: float | None) -> bool:
        return value is not None and math.isfinite(value) and value <= LOSS_FACTOR * self.loss

    def met(self, eval_value: float | None, loss: float | None) -> bool:
        return self.eval_met(eval_value) and self.loss_met(loss)

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "eval": self.eval,
            "loss": self.loss,
            "eval_threshold": self.eval - EVAL_TOLERANCE if self.higher_better else self.eval + EVAL_TOLERANCE,
            "loss_threshold": LOSS_FACTOR * self.loss,
            "higher_is_better": self.higher_better,
        }

    @classmethod
    def of(cls, summary: dict) -> Goal:
        """The goal a finished baseline run sets: its final eval and final training loss."""
        metric = summary.get("eval_metric_name") or "accuracy"
        ev, loss = summary.get("final_eval"), summary.get("final_loss")
        if ev is None or loss is None:
            raise ValueError(f"the baseline run has no final eval or loss (final_eval={ev!r}, final_loss={loss!r})")
        return cls(metric, float(ev), float(loss))


# ------------------------------------------------------------ summary rows


def row_eval(row: dict, metric: str) -> float | None:
    """A history row's eval: the controller's (Task), else the metric the script ranks reported."""
    if row.get("eval") is not None:
        return row["eval"]
    value = (row.get("scalars") or {}).get(metric)
    return None if value is None else float(value)


def row_loss(row: dict) -> float | None:
    """A history row's training loss: its last epoch's own (a group row keeps each epoch's), else the row's."""
    own = (row.get("epoch_losses") or {}).get(str(row.get("epoch")))
    return own if own is not None else row.get("loss")


def row_eval_s(row: dict) -> float:
    """Seconds the row's eval took: the controller's (flodl's ``eval_s``), the DDP script's, or the
    script-mode ranks' (their ``eval_s`` scalar, a per-epoch mean: times the row's epochs)."""
    if row.get("eval_s") is not None:
        return float(row["eval_s"])
    scalar = (row.get("scalars") or {}).get("eval_s")
    if scalar is None:
        return 0.0
    first = row.get("first_epoch", row.get("epoch", 0))
    return float(scalar) * (int(row.get("epoch", 0)) - int(first) + 1)


def row_closed_s(history: list[dict]) -> list[float]:
    """Seconds from the start of training to each row's close, evals included: the DDP script says
    (``closed_s``); flodl's rows never overlap and their walls add up (plan/cadence.py ``_close_all``)."""
    if history and all("closed_s" in h for h in history):
        return [float(h["closed_s"]) for h in history]
    out, total = [], 0.0
    for h in history:
        total += float(h.get("wall_s") or 0.0)
        out.append(total)
    return out


@dataclass(frozen=True)
class Reach:
    """Where a run first met its goal (``reached`` False: it never did; the times are then the whole run's)."""

    reached: bool
    epochs: int  # epochs trained when it was met (the row's last epoch + 1), or all the run trained
    train_s: float  # training seconds to it: from the first batch, evals taken out
    command_s: float | None  # from the process start: start-up + train_s (None where the start is unknown)
    row: int | None = None  # its history row
    averages: int | None = None  # replica averages up to it (flodl's rows count them; None for a DDP script's)

    def to_dict(self) -> dict:
        return {
            "reached": self.reached,
            "epochs": self.epochs,
            "train_s": self.train_s,
            "command_s": self.command_s,
            "row": self.row,
            "averages": self.averages,
        }


def first_reach(summary: dict, goal: Goal, startup_s: float | None) -> Reach:
    """Read a run's history for the first row that meets ``goal``.

    ``startup_s``: seconds from the process start to the start of training (the suite's launch
    to flodl's ``trained_unix[0]``, or to the DDP script's ``start_unix``).
    Training time to row k = its close minus the evals of the rows before it (row k's own eval
    comes after its close)."""
    history = summary.get("history") or []
    closed = row_closed_s(history)
    evals_before = train_s = 0.0
    counted = any("syncs" in row for row in history)  # flodl's rows say how many averages closed in them
    averages = 0
    for k, row in enumerate(history):
        train_s = max(0.0, closed[k] - evals_before)
        averages += int(row.get("syncs") or 0)
        if goal.met(row_eval(row, goal.metric), row_loss(row)):
            command_s = None if startup_s is None else startup_s + train_s
            return Reach(True, int(row.get("epoch", k)) + 1, train_s, command_s, k, averages if counted else None)
        evals_before += row_eval_s(row)
    epochs = int(history[-1].get("epoch", len(history) - 1)) + 1 if history else 0
    return Reach(False, epochs, train_s, None if startup_s is None else startup_s + train_s, None, averages if counted else None)


# ------------------------------------------------------------ a run as it goes


class RecordWatch:
    """Tails a flodl run's root record log (``<dir>/root.log``) and says when a completed row met the goal.

    Call it (no arguments) as often as you like: it reads only what was appended since
    (whole lines: a line still being written waits for the next call), and stays True once
    it fired. The root log rotates at 16 MiB by default; a shorter file than last time is read
    from its start."""

    def __init__(self, log_dir: Path, goal: Goal) -> None:
        self.path = Path(log_dir) / "root.log"
        self.goal = goal
        self.offset = 0
        self.fired: dict | None = None  # the record that met the goal

    def __call__(self) -> bool:
        if self.fired is not None:
            return True
        try:
            size = self.path.stat().st_size
            if size < self.offset:  # rotated: the active segment started again
                self.offset = 0
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") != "node" or not rec.get("epoch_complete"):
                continue
            metrics = rec.get("metrics") or {}
            value = metrics.get("eval", metrics.get(self.goal.metric))
            if self.goal.met(value, metrics.get("loss")):
                self.fired = rec
                return True
        return False
