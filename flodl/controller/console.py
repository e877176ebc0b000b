"""What the controller prints: a header, live progress, one line per epoch, the end.

On a terminal the progress line rewrites itself in place a few times a
second; anywhere else (a log file, CI) it degrades to a plain line every few
seconds, so logs stay readable. Start-up lines (startup.py) say what the run
does before its first batch: one line per phase, counts within a phase
rewritten in place on a terminal only. ``quiet`` (``--no-progress``) drops
both; epoch lines and the final line always print. Time is injected so tests
need not sleep.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..plan.metrics import EpochStats

#: Past this many ranks the progress line summarises their rates instead of listing each.
LIST_RANKS_UP_TO = 8


def _per_rank(ranks: dict[int, float]) -> str:
    """Each rank's samples/s, or, for many ranks, the slowest, the median and the fastest."""
    if len(ranks) <= LIST_RANKS_UP_TO:
        return "  [" + " ".join(f"r{r} {v:,.0f}/s" for r, v in ranks.items()) + "]"
    order = sorted(ranks, key=ranks.__getitem__)
    lo, mid, hi = order[0], order[len(order) // 2], order[-1]
    return f"  [{len(ranks)} ranks: slowest r{lo} {ranks[lo]:,.0f}/s, median {ranks[mid]:,.0f}/s, fastest r{hi} {ranks[hi]:,.0f}/s]"


def _fmt_rate(samples_per_s: float) -> str:
    return f"{samples_per_s:,.0f} samples/s"


class Console:
    """Human-readable run output on one stream."""

    def __init__(
        self, out: TextIO | None = None, *, live: bool | None = None, quiet: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.quiet = quiet  # no progress line, no start-up lines
        self.clock = clock
        self.interval_s = 0.25 if self.live else 5.0
        self._last = 0.0
        self._dirty = False  # a live line is on screen and must be cleared first

    def _write(self, text: str) -> None:
        if self._dirty:
            self.out.write("\r\033[K")
            self._dirty = False
        self.out.write(text + "\n")
        self.out.flush()

    def line(self, text: str) -> None:
        self._write(text)

    @classmethod
    def for_progress(cls, progress: bool | None) -> Console:
        """The console of the ``progress`` option: None follows the terminal, True forces the
        live line, False (``--no-progress``) prints neither progress nor start-up lines."""
        return cls(live=progress, quiet=progress is False)

    def startup(self, text: str, *, done: bool) -> None:
        """A start-up line: ``done`` ends a phase (always a line); a count within one is shown
        on a terminal only, rewritten in place."""
        if self.quiet:
            return
        if done:
            self._write(text)
        elif self.live:
            self.out.write("\r\033[K" + text)
            self.out.flush()
            self._dirty = True

    def header(
        self,
        *,
        run_id: str,
        mode: str,
        task: str,
        ranks: list[str],
        dataset_len: int,
        batch_size: int,
        epochs: int,
        grain: str = "sample",
        lr_factor: float = 1.0,
        lr_scale_ratio: float = 0.0,
        lr_scale_on: str = "steps",
        averaging: str | None = None,
    ) -> None:
        self._write(f"flodl run {run_id} | mode {mode} | task {task}")
        self._write(f"  {len(ranks)} rank(s): {', '.join(ranks)}")
        self._write(f"  {dataset_len} {grain}s, batch {batch_size} per rank, {epochs} epoch(s)")
        if lr_factor != 1.0:  # flodl changes the user's learning rate: never silently (docs/cadence.md)
            where = "on every rank" if lr_scale_on == "steps" else "on the averaged update (--lr-scale-on average)"
            self._write(
                f"  learning rate x{lr_factor:g} {where}: your optimizer's rate times 1 + ({len(ranks)} - 1) x "
                f"--lr-scale-ratio {lr_scale_ratio:g} (--lr-scale-ratio 0 keeps it as written)"
            )
        if averaging:
            self._write(f"  {averaging}")
        self._last = self.clock()  # the first progress line comes one interval in

    def due(self) -> bool:
        """Whether a progress line would print now (callers skip building one otherwise)."""
        return not self.quiet and self.clock() - self._last >= self.interval_s

    def progress(
        self, *, epoch: int, epochs: int, done: int, total: int, rate: float, loss: float | None, ranks: dict[int, float] | None = None
    ) -> None:
        """Show progress within an epoch (throttled); ``ranks`` adds each rank's samples/s. A
        ``total`` of 0 is unknown (streamed shards): samples so far, no share nor eta."""
        now = self.clock()
        if self.quiet or now - self._last < self.interval_s:
            return
        self._last = now
        pct = 100.0 * done / total if total else 0.0
        left = (total - done) / rate if rate > 0 else 0.0
        loss_text = f"  loss {loss:.4f}" if loss is not None else ""
        per_rank = _per_rank(ranks) if ranks and len(ranks) > 1 else ""
        text = f"epoch {epoch + 1}/{epochs}  {pct:5.1f}%  {done}/{total}  {_fmt_rate(rate)}  eta {left:4.0f} s{loss_text}{per_rank}"
        if not total:
            text = f"epoch {epoch + 1}/{epochs}  {done} samples  {_fmt_rate(rate)}{loss_text}{per_rank}"
        if self.live:
            self.out.write("\r\033[K" + text)
            self.out.flush()
            self._dirty = True
        elif done < total or not total:
            self._write(text)

    def epoch(self, stats: EpochStats, epochs: int, metric: str | None, *, next_len: int = 0) -> None:
        """An epoch's line, or one line for the epochs one average closed ("epochs 3-5/5"): their
        loss, the eval of that average (after the last of them), their samples/s and seconds.
        ``next_len``: the next epoch's size, to say how much of it the scored model had trained too
        (``stats.ahead_samples``: none when the closing window ended on the edge)."""
        loss = f"loss {stats.avg_loss:.4f}" if stats.avg_loss is not None else "loss -"
        ev = ""
        if metric and stats.eval_value is not None:
            ev = f"  {metric} {stats.eval_value:.4f}"
            if stats.first_epoch != stats.epoch or stats.ahead_samples:
                ev += f" (after epoch {stats.epoch + 1}{_ahead(stats.ahead_samples, next_len, stats.epoch + 2)})"
        which = f"epoch {stats.epoch + 1}" if stats.first_epoch == stats.epoch else f"epochs {stats.first_epoch + 1}-{stats.epoch + 1}"
        self._write(f"{which}/{epochs}  {loss}{ev}  {_fmt_rate(stats.samples_per_s)}  {stats.wall_ms / 1000:.1f} s")

    def done(self, summary: dict) -> None:
        startup = f" (start-up {summary['startup_s']:.1f} s)" if summary.get("startup_s") is not None else ""
        parts = [f"done in {summary['wall_s']:.1f} s{startup}"]
        if summary.get("final_eval") is not None:
            parts.append(f"final {summary['eval_metric_name']} {summary['final_eval']:.4f}")
        if summary.get("final_loss") is not None:
            parts.append(f"final loss {summary['final_loss']:.4f}")
        parts.append(_fmt_rate(summary["samples_per_s"]))
        unsaved = (
            "; the final save FAILED (the next line says which bundle is on disk)"
            if summary.get("exit_reason") == "completed_unsaved"
            else ""
        )
        self._write(": ".join(parts[:2]) + (", " + ", ".join(parts[2:]) if len(parts) > 2 else "") + unsaved)

    def failed(self, message: str) -> None:
        self._write(f"flodl: run stopped: {message}")


def _ahead(samples: int, next_len: int, next_epoch: int) -> str:
    """ " + N% of epoch E": what the scored model trained of the next epoch too ("" when nothing)."""
    if samples <= 0:
        return ""
    share = f"{100.0 * samples / next_len:.0f}%" if next_len > 0 else f"{samples} samples"
    return f" + {share} of epoch {next_epoch}"
