"""ElChe: the cadence balancer that sizes each rank's share of an averaging window.

The slowest rank anchors the window: it does ``anchor`` batches between two
averagings, and every faster rank gets proportionally more batches so that all
ranks reach the averaging point at about the same wall time. After each
window the caller reports what really happened (``report_timing``); ElChe
refines its per-rank speed estimates, re-elects the slow "anchor rank" when the
evidence is strong enough, tunes the anchor against the averaging overhead
and recomputes the per-rank batch counts.

Growth of the anchor is *proposed* by the overhead auto-tune but *committed*
by the divergence guard (``apply_verdict``): a larger window means more replica
drift, so only a guard that judged the last window ``Stable`` may let it grow.

This module is pure logic: no I/O, no clock, no threads. Callers pass the
measured numbers (milliseconds, batch counts) in and read plans back out, so
every decision is reproducible from its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config import ApplyPolicy
from .signals import Phase, Verdict

if TYPE_CHECKING:
    from ..config import ElCheConfig

#: Overhead targets outside this band are clamped (the reference setter's range).
OVERHEAD_TARGET_MIN = 0.01
OVERHEAD_TARGET_MAX = 0.5
#: Error-adaptive EMA: the weight of a new reading is its relative error, in this band.
EMA_ALPHA_MIN = 0.1
EMA_ALPHA_MAX = 0.8
#: Overhead below this fraction of the target lets the anchor shrink by one.
DECREASE_BAND = 0.5
#: A planned count only changes when the new target differs by more than this fraction (the
#: reference's 0.7 value; 10% before). Under Async a count is the window's trigger, so whatever
#: error the dead zone keeps is the fast rank's idle share (or the anchor rank's): 10% cost the
#: recurrent models' CpuAsync cells 0.88-0.89 of ideal.
DEAD_ZONE = 0.05
#: Ranks within this fraction of the slowest are candidates for the anchor role.
COHORT_BAND = 0.15
#: A challenger must be this much slower than the current anchor rank to take over.
DOMINANCE_MARGIN = 0.10
#: No rank is planned more than this many times the anchor's batches.
MAX_SPEED_RATIO = 64.0
#: Two speeds closer than this (ms/batch) count as the same speed.
SAME_SPEED_EPS = 1e-6
#: Consecutive Stable verdicts after which a latched-off growth re-arms.
REARM_AFTER_STABLE = 5
#: A window's fixed cost (the controller planning and settling it, whatever the model's size)
#: is kept to this share of the window's compute: at sub-ms steps it, not the averaging, is
#: what short windows pay (issue 22: ~1 ms a window, ~250 windows where ~110 train 4-5% faster).
FIXED_COST_TARGET = 0.02

#: Float noise tolerated before rounding up (0.4 / 0.1 is 4.000000000000001).
CEIL_SLACK = 1e-9

#: A world of one averages nothing: its windows only pace dispatch, progress and admission, so
#: they are sized by wall time (ms) alone, long enough that a window's fixed cost (its report,
#: the device catching up at its end) is noise, short enough that a joiner waits little.
SOLO_WINDOW_MS = 250.0

#: Calibrations (valid timing reports) at which each phase begins.
PHASE_THRESHOLDS: tuple[tuple[int, Phase], ...] = ((20, Phase.MATURE), (5, Phase.STABLE), (1, Phase.WARMUP))


def phase_for(calibrations: int) -> Phase:
    """The phase reached after ``calibrations`` valid timing reports."""
    for threshold, phase in PHASE_THRESHOLDS:
        if calibrations >= threshold:
            return phase
    return Phase.PROBE


# ---------------------------------------------------------------------------
# Small numeric helpers
# ---------------------------------------------------------------------------


def _round_half_up(x: float) -> int:
    """Round a non-negative number like the reference (Rust ``f64::round``).

    Python's ``round`` is banker's rounding (``round(22.5) == 22``); the golden
    values were produced with half-away-from-zero.
    """
    return math.floor(x + 0.5)


def _ceil(x: float) -> int:
    """``ceil`` that ignores float noise just above an integer."""
    return math.ceil(x - CEIL_SLACK)


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(name: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    checked: int = value
    return checked


def _require_real(name: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def elect_anchor_rank(ms_per_batch: Sequence[float], current: int | None) -> int | None:
    """Which rank anchors the window, given smoothed speeds and the current pick.

    Only the slow cohort (ranks within ``COHORT_BAND`` of the slowest) may
    anchor, so a clearly faster rank never does. Inside the cohort the current
    anchor is sticky: near-identical GPUs would otherwise swap the role on
    noise. A challenger takes over only when it is ``DOMINANCE_MARGIN`` slower;
    without a usable current pick the lowest cohort index wins, so the choice
    is deterministic. ``None`` when no rank has a reading yet.
    """
    slowest = max(ms_per_batch, default=0.0)
    if slowest <= 0:
        return None
    cohort = [r for r, ms in enumerate(ms_per_batch) if ms >= (1.0 - COHORT_BAND) * slowest]
    if current is None or current not in cohort:
        return cohort[0]
    challengers = [r for r in cohort if r != current]
    if not challengers:
        return current
    # Slowest challenger; on equal speeds the lowest index (key ties break on -r).
    top = max(challengers, key=lambda r: (ms_per_batch[r], -r))
    if ms_per_batch[top] / ms_per_batch[current] >= 1.0 + DOMINANCE_MARGIN:
        return top
    return current


def cap_window(counts: Sequence[int], cap: int) -> list[int]:
    """Scale ``counts`` down so they sum to ``cap``; the remainder goes to the largest.

    A window may not ask for more batches than the epoch holds. Each rank keeps
    at least one batch, so a cap below the world size cannot be met (the counts
    are then all 1).
    """
    total = sum(counts)
    if total <= cap:
        return list(counts)
    # Integer arithmetic: an exact floor, no float noise.
    scaled = [max(1, c * cap // total) for c in counts]
    gap = cap - sum(scaled)
    if gap > 0:
        scaled[_largest(scaled)] += gap
    while gap < 0 and max(scaled) > 1:
        # The min-1 floor overshot the cap: take batches back from the largest.
        scaled[_largest(scaled)] -= 1
        gap += 1
    return scaled


def _largest(counts: Sequence[int]) -> int:
    """Index of the largest count (lowest index on ties)."""
    return max(range(len(counts)), key=lambda r: (counts[r], -r))


# ---------------------------------------------------------------------------
# ElChe
# ---------------------------------------------------------------------------


class ElChe:
    """The cadence balancer of one run.

    Public attributes are the state (read them, do not assign them): ``anchor``,
    ``batch_counts`` (planned batches per rank per window), ``ms_per_batch``
    (smoothed, 0 = no reading yet), ``provisional`` (per rank: its speed comes
    only from readings ``report_timing`` was told carry a warm-up), ``calibrated``, ``phase``,
    ``calibration_count``, ``anchor_rank`` (the elected slow rank),
    ``pending_anchor`` (a staged growth proposal), ``growth_latched_off`` and
    ``stable_streak``.

    ``gate_growth=False`` restores the 0.5.3 behaviour where the overhead
    auto-tune grows the anchor at once inside ``report_timing``; with the
    default ``True`` growth waits for a Stable verdict (``apply_verdict``).
    ``sync_policy=True`` (set by ``from_config`` for Sync modes) never grows
    the anchor: Sync means averaging every anchor's worth of batches, and its
    guard is always Stable, so nothing else would stop the window growing.

    Two limits, each with its own name (a run sets both from the one option
    ``max_batch_diff``: ``from_config``):

    * ``max_batch_diff``, a spread cap: the anchor does not relax up past a
      plan whose largest count leads the smallest by more (``_relax_anchor_up``;
      the dispatcher caps the counts it hands out by the same number);
    * ``max_count_step``, a rate limit: once calibrated, one re-plan moves a
      rank's count by at most this many batches (``_limited_step``; the
      reference runtime's use of ``max_batch_diff``), so a speed reading off by
      a hiccup shifts the plan a little, not all the way.
    """

    def __init__(
        self,
        world_size: int,
        *,
        anchor: int = 10,
        min_anchor: int | None = None,
        max_anchor: int = 1000,
        overhead_target: float = 0.05,
        max_batch_diff: int | None = None,
        max_count_step: int | None = None,
        relax_up: bool = False,
        partition_ratios: Sequence[float] | None = None,
        max_total_batches: int | None = None,
        gate_growth: bool = True,
        sync_policy: bool = False,
    ) -> None:
        self.world_size = _require_int("world_size", world_size, 1)
        anchor = _require_int("anchor", anchor, 1)
        self.max_anchor = _require_int("max_anchor", max_anchor, 1)
        self.min_anchor = anchor if min_anchor is None else _require_int("min_anchor", min_anchor, 1)
        if self.min_anchor > self.max_anchor:
            self.min_anchor = self.max_anchor
        # The ceiling is a staleness limit: it binds the starting anchor too.
        self.anchor = min(anchor, self.max_anchor)
        target = _require_real("overhead_target", overhead_target)
        self.overhead_target = _clamp(target, OVERHEAD_TARGET_MIN, OVERHEAD_TARGET_MAX)
        self.max_batch_diff = None if max_batch_diff is None else _require_int("max_batch_diff", max_batch_diff, 0)
        self.max_count_step = None if max_count_step is None else _require_int("max_count_step", max_count_step, 0)
        self.max_total_batches = None if max_total_batches is None else _require_int("max_total_batches", max_total_batches, 1)
        self.relax_up = bool(relax_up)
        self.gate_growth = bool(gate_growth)
        self.sync_policy = bool(sync_policy)
        self.partition_ratios = self._checked_ratios(partition_ratios)

        self.batch_counts: list[int] = [self.anchor] * self.world_size
        self.ms_per_batch: list[float] = [0.0] * self.world_size
        self.provisional: list[bool] = [False] * self.world_size
        self.calibrated = False
        self.phase = Phase.PROBE
        self.calibration_count = 0
        self.anchor_rank: int | None = None
        self.pending_anchor: int | None = None
        self.growth_latched_off = False
        self.stable_streak = 0

        if self.partition_ratios is not None:
            # Fixed ratios name the slow rank up front: the smallest share.
            self.anchor_rank = self._smallest_ratio_rank()
            self.batch_counts = self._ratio_counts(self.anchor)
        self._apply_window_cap()

    def _checked_ratios(self, ratios: Sequence[float] | None) -> tuple[float, ...] | None:
        if ratios is None:
            return None
        values = tuple(ratios)
        if len(values) != self.world_size:
            raise ValueError(f"partition_ratios has {len(values)} entries for a world of {self.world_size} ranks")
        for ratio in values:
            if not _is_real(ratio) or not math.isfinite(ratio) or ratio < 0:
                raise ValueError(f"partition_ratios entries must be finite numbers >= 0, got {ratio!r}")
        if not any(r > 0 for r in values):
            raise ValueError(f"partition_ratios must not all be zero, got {list(values)!r}")
        return tuple(float(r) for r in values)

    @classmethod
    def from_config(cls, elche_config: ElCheConfig, world_size: int, *, max_total_batches: int | None = None) -> ElChe:
        """The balancer a run with ``elche_config`` uses over ``world_size`` ranks. The option
        ``max_batch_diff`` sets both the spread cap and the per-update step (the class says why)."""
        return cls(
            world_size,
            anchor=elche_config.effective_anchor,
            min_anchor=elche_config.min_anchor,
            max_anchor=elche_config.max_anchor,
            overhead_target=elche_config.overhead_target,
            max_batch_diff=elche_config.max_batch_diff,
            max_count_step=elche_config.max_batch_diff,
            relax_up=elche_config.relax_up,
            partition_ratios=elche_config.partition_ratios,
            max_total_batches=max_total_batches,
            sync_policy=elche_config.mode.policy is ApplyPolicy.SYNC,
        )

    # -- read-only views ------------------------------------------------------

    def batches(self, rank: int) -> int:
        """Planned batches for ``rank`` in the next window."""
        return self.batch_counts[rank]

    def total_batches(self) -> int:
        return sum(self.batch_counts)

    def shares(self) -> list[float]:
        """Each rank's fraction of the window's batches (sums to 1)."""
        total = self.total_batches()
        return [c / total for c in self.batch_counts]

    def has_speed_hint(self) -> bool:
        """Whether the plan is already uneven (a hint, ratios or measurements shaped it)."""
        return len(set(self.batch_counts)) > 1

    def anchor_wall_ms(self) -> float:
        """Intended wall time of one window: ``anchor`` batches on the anchor rank; 0 before timing."""
        if not self.calibrated:
            return 0.0
        return self.anchor * self._slow_ms()

    def _slow_ms(self) -> float:
        """Smoothed ms/batch of the anchor rank (the slowest reading without one)."""
        if self.anchor_rank is not None and self.ms_per_batch[self.anchor_rank] > 0:
            return self.ms_per_batch[self.anchor_rank]
        return max(self.ms_per_batch)

    # -- hints -----------------------------------------------------------------

    def with_speed_hint(self, slow_rank: int, ratio: float) -> ElChe:
        """Shape the first window before any timing: ``slow_rank`` is ``ratio`` times slower.

        The slow rank gets ``anchor`` batches, every other rank
        ``round(anchor * ratio)``. Returns ``self`` for chaining. The hint does
        not pin the anchor rank: the first timing report elects from
        measurements, so a wrong hint corrects itself after one window. Fixed
        ``partition_ratios`` take precedence over a hint.
        """
        _require_int("slow_rank", slow_rank, 0)
        if slow_rank >= self.world_size:
            raise ValueError(f"slow_rank {slow_rank} does not exist in a world of {self.world_size} ranks")
        if self.partition_ratios is not None:
            return self
        ratio = _clamp(_require_real("ratio", ratio), 1.0, MAX_SPEED_RATIO)
        fast = max(1, _round_half_up(self.anchor * ratio))
        self.batch_counts = [self.anchor if r == slow_rank else fast for r in range(self.world_size)]
        self._apply_window_cap()
        return self

    # -- timing ----------------------------------------------------------------

    def report_timing(
        self,
        wall_ms: Sequence[float],
        batches: Sequence[int],
        sync_ms: float,
        provisional: Sequence[bool] | None = None,
        fixed_ms: float = 0.0,
    ) -> None:
        """Learn from one finished window and plan the next.

        ``wall_ms[r]`` is rank r's compute wall time over the window and
        ``batches[r]`` the batches it *actually* ran (not the plan: a fast rank
        that over-ran would otherwise look slower than it is). ``sync_ms`` is
        the averaging cost; 0 means "not measured" and disables the anchor
        auto-tune. ``provisional[r]``: rank r's reading carries its warm-up
        (a cold-start probe, a joiner's first window); it plans the next
        window, and the rank's next settled reading replaces it rather than
        blending with it. ``fixed_ms``: what the window cost whatever the
        model's size (the controller planning and settling it; 0: not
        measured), held to ``FIXED_COST_TARGET`` of the compute as ``sync_ms``
        is to ``overhead_target``. A report with no usable reading changes nothing.
        """
        if len(wall_ms) != self.world_size or len(batches) != self.world_size:
            raise ValueError(
                f"report_timing needs one entry per rank ({self.world_size}), got {len(wall_ms)} wall times and {len(batches)} batch counts"
            )
        if provisional is not None and len(provisional) != self.world_size:
            raise ValueError(f"report_timing needs one provisional flag per rank ({self.world_size}), got {len(provisional)}")
        self._update_speeds(wall_ms, batches, provisional or [False] * self.world_size)
        if not self._elect():
            return
        anchor_changed = self._solo_anchor() if self._solo else self._auto_tune(max(wall_ms), sync_ms, fixed_ms)
        self._recompute_counts(force=anchor_changed)
        self.calibrated = True
        self.calibration_count += 1
        self._advance_phase()

    def _update_speeds(self, wall_ms: Sequence[float], batches: Sequence[int], provisional: Sequence[bool]) -> None:
        """Error-adaptive EMA of ms/batch per rank; the first reading is taken raw.

        The weight of a new reading is its relative error (clamped), so a real
        speed change (thermal throttling) is tracked within a window or two
        while small jitter barely moves the estimate. A rank whose speed so far
        is provisional takes its first settled reading raw too: a probe's warm-up
        (a fast CPU rank's read ~30% slow) would otherwise fade over many windows,
        and under Async the fast rank trains that much less all the while. A
        provisional reading never moves a settled speed.
        """
        for rank, (wall, n) in enumerate(zip(wall_ms, batches, strict=False)):
            if not (n > 0 and wall > 0 and math.isfinite(wall)):
                continue
            reading = wall / n
            previous = self.ms_per_batch[rank]
            if provisional[rank]:
                if previous <= 0 or self.provisional[rank]:
                    self.ms_per_batch[rank] = reading
                    self.provisional[rank] = True
                continue
            if self.provisional[rank]:
                self.ms_per_batch[rank] = reading
                self.provisional[rank] = False
            elif self.calibrated and previous > 0:
                alpha = _clamp(abs(reading - previous) / previous, EMA_ALPHA_MIN, EMA_ALPHA_MAX)
                self.ms_per_batch[rank] = alpha * reading + (1.0 - alpha) * previous
            else:
                self.ms_per_batch[rank] = reading

    def _elect(self) -> bool:
        """Update ``anchor_rank`` if allowed; True when there is valid timing to plan from.

        Election runs when there is no anchor rank yet, or from Stable on (the
        phase as it stood before this report). Through Warmup the first pick is
        held so cold-start noise (kernel JIT, allocator warm-up) cannot flip the
        role back and forth.
        """
        if self.partition_ratios is not None:
            # Counts come from the ratios; the anchor rank stays the smallest share.
            return max(self.ms_per_batch) > 0
        current = self.anchor_rank
        stale = current is None or self.ms_per_batch[current] <= 0
        if stale or self.phase >= Phase.STABLE:
            elected = elect_anchor_rank(self.ms_per_batch, current)
            if elected is not None:
                self.anchor_rank = elected
        return self.anchor_rank is not None and self.ms_per_batch[self.anchor_rank] > 0

    @property
    def _solo(self) -> bool:
        """One rank, nothing to average against: no drift to bound, no averaging cost to weigh."""
        return self.world_size == 1 and not self.sync_policy and self.partition_ratios is None

    def _solo_anchor(self) -> bool:
        """A world of one: the anchor that makes a window ``SOLO_WINDOW_MS`` long (within
        ``min_anchor``..``max_anchor``; the window cap still applies). True if it changed now.
        Outside the dead zone only, so timing jitter does not re-plan every window."""
        wanted = int(_clamp(_ceil(SOLO_WINDOW_MS / self.ms_per_batch[0]), self.min_anchor, self.max_anchor))
        if abs(wanted - self.anchor) <= DEAD_ZONE * self.anchor:
            return False
        self.anchor = wanted
        self.pending_anchor = None
        return True

    def _auto_tune(self, compute_ms: float, sync_ms: float, fixed_ms: float = 0.0) -> bool:
        """Anchor auto-tune against the averaging overhead; True if the anchor changed now.

        Overhead is ``sync_ms`` over the longest compute wall, against
        ``overhead_target``, and ``fixed_ms`` over it against
        ``FIXED_COST_TARGET``; the one further over its target rules. Above
        target the anchor should grow in proportion (one step, not a crawl);
        far below it shrinks by one per window, so a single cheap sync cannot
        collapse it.
        """
        if not (compute_ms > 0 and (sync_ms > 0 or fixed_ms > 0)):
            return False
        # the fixed cost in the averaging overhead's terms: as far over (or under) its target
        overhead = max(sync_ms, max(0.0, fixed_ms) * self.overhead_target / FIXED_COST_TARGET) / compute_ms
        if overhead > self.overhead_target:
            wanted = _ceil(self.anchor * overhead / self.overhead_target)
            return self._propose_growth(int(_clamp(wanted, self.min_anchor, self.max_anchor)))
        # The evidence for a staged growth is gone once overhead is back on target.
        self.pending_anchor = None
        if overhead < DECREASE_BAND * self.overhead_target and self.anchor > self.min_anchor:
            # Shrinking is never gated: a smaller window only reduces drift.
            self.anchor -= 1
            return True
        return False

    def _propose_growth(self, proposal: int) -> bool:
        """Stage (or, ungated, apply) a larger anchor; True if the anchor changed now."""
        if proposal <= self.anchor or not self._growth_allowed():
            return False
        if not self.gate_growth:
            self.anchor = proposal
            return True
        self.pending_anchor = proposal
        return False

    def _growth_allowed(self) -> bool:
        """Growth is off while latched by the guard, or when the epoch already caps the window
        (a larger anchor could not lengthen the window, only desynchronise the wall-time trigger),
        and always under the Sync policy."""
        if self.growth_latched_off or self.sync_policy:
            return False
        return self.max_total_batches is None or self.total_batches() < self.max_total_batches

    def _advance_phase(self) -> None:
        reached = phase_for(self.calibration_count)
        if reached > self.phase:  # monotonic: a restored later phase is never undone
            self.phase = reached

    # -- batch counts ------------------------------------------------------------

    def _target_count(self, rank: int, slow_ms: float) -> int:
        """Batches for ``rank`` so it spends the anchor rank's window wall time."""
        ms = self.ms_per_batch[rank]
        if ms <= 0 or rank == self.anchor_rank or abs(ms - slow_ms) < SAME_SPEED_EPS:
            return self.anchor
        # A rank slower than the anchor rank gets fewer than ``anchor`` (ratio < 1).
        ratio = min(slow_ms / ms, MAX_SPEED_RATIO)
        return max(1, _round_half_up(self.anchor * ratio))

    def _recompute_counts(self, *, force: bool = False) -> None:
        """Re-plan every rank's batches from the smoothed speeds.

        The dead zone keeps a count unless its target moved by more than 5 %,
        so timing jitter does not re-plan every window; ``force`` (the anchor
        itself just changed, a decision rather than noise) bypasses it. Once
        calibrated, ``max_count_step`` caps how far one update moves a count.
        """
        if self.partition_ratios is not None:
            self.batch_counts = self._ratio_counts(self.anchor)
            self._apply_window_cap()
            return
        slow_ms = self._slow_ms()
        if slow_ms <= 0:
            return
        for rank in range(self.world_size):
            target = self._target_count(rank, slow_ms)
            current = self.batch_counts[rank]
            if self.calibrated and not force and abs(target - current) <= DEAD_ZONE * current:
                continue
            self.batch_counts[rank] = self._limited_step(current, target)
        self._apply_window_cap()

    def _limited_step(self, current: int, target: int) -> int:
        """Move from ``current`` toward ``target`` by at most ``max_count_step`` (once calibrated)."""
        step = self.max_count_step
        if step is None or not self.calibrated:
            return target
        if target > current:
            return min(current + step, target)
        return max(current - step, target, 1)

    def _apply_window_cap(self) -> None:
        if self.max_total_batches is not None:
            self.batch_counts = cap_window(self.batch_counts, self.max_total_batches)

    def _smallest_ratio_rank(self) -> int:
        assert self.partition_ratios is not None
        smallest = min(r for r in self.partition_ratios if r > 0)
        return self.partition_ratios.index(smallest)

    def _ratio_counts(self, anchor: int) -> list[int]:
        """Counts fixed by ``partition_ratios``: the smallest share does ``anchor`` batches.

        User ratios are not capped at ``MAX_SPEED_RATIO``: they are an explicit
        choice, not a measurement. A zero share still gets one batch per window.
        """
        assert self.partition_ratios is not None
        slow = self._smallest_ratio_rank()
        base = self.partition_ratios[slow]
        return [anchor if r == slow else max(1, _round_half_up(anchor * ratio / base)) for r, ratio in enumerate(self.partition_ratios)]

    def _projected_counts(self, anchor: int) -> list[int]:
        """The counts a given anchor would produce (no dead zone, no per-update cap)."""
        if self.partition_ratios is not None:
            return self._ratio_counts(anchor)
        slow_ms = self._slow_ms()
        if not self.calibrated or slow_ms <= 0:
            return [max(1, _round_half_up(c * anchor / self.anchor)) for c in self.batch_counts]
        saved = self.anchor
        self.anchor = anchor
        try:
            return [self._target_count(r, slow_ms) for r in range(self.world_size)]
        finally:
            self.anchor = saved

    def _set_anchor(self, anchor: int) -> None:
        """Adopt a new anchor and re-plan the counts to match it."""
        if anchor == self.anchor:
            return
        if self.partition_ratios is None and not self.calibrated:
            # No timing yet: keep the plan's shape (a speed hint) at the new scale,
            # so the anchor rank's count always says what the anchor says.
            rescaled = self._projected_counts(anchor)
            self.anchor = anchor
            self.batch_counts = rescaled
            self._apply_window_cap()
            return
        self.anchor = anchor
        self._recompute_counts(force=True)

    def clamp_total(self, max_total: int) -> list[int]:
        """The current counts scaled down to at most ``max_total`` batches (state unchanged).

        Proportional floors (at least 1 each), then +1 to ranks in index order
        until the sum is exactly ``max_total``. For epoch tails.
        """
        _require_int("max_total", max_total, 0)
        total = self.total_batches()
        if total <= max_total:
            return list(self.batch_counts)
        clamped = [max(1, c * max_total // total) for c in self.batch_counts]
        remainder = max(0, max_total - sum(clamped))
        for rank in range(len(clamped)):
            if remainder == 0:
                break
            clamped[rank] += 1
            remainder -= 1
        return clamped

    # -- guard authority ---------------------------------------------------------

    def nudge_anchor_down(self, factor: float) -> None:
        """Shrink the anchor to ``ceil(anchor * factor)`` (factor clamped to [0.1, 1]).

        Never increases it, floors at 1 and bypasses ``min_anchor``: drift
        between replicas is a stronger signal than the overhead floor, and the
        auto-tune grows the anchor back once drift subsides.
        """
        factor = _clamp(_require_real("factor", factor), 0.1, 1.0)
        self._set_anchor(min(self.anchor, max(1, _ceil(self.anchor * factor))))

    def apply_verdict(self, verdict: Verdict) -> None:
        """Act on the divergence guard's verdict for the last window.

        Stable commits a staged growth (or, with ``relax_up``, grows by one);
        SuppressGrowth drops it and latches growth off until
        ``REARM_AFTER_STABLE`` consecutive Stable verdicts; NudgeDown drops it
        and shrinks the anchor. A dropped proposal is what keeps a later Stable
        from undoing a nudge.
        """
        kind = verdict.kind
        if kind == "stable":
            self._on_stable()
        elif kind == "suppress_growth":
            self.pending_anchor = None
            self.growth_latched_off = True
            self.stable_streak = 0
        elif kind == "nudge_down":
            if verdict.factor is None:
                raise ValueError("a nudge_down verdict needs a factor")
            self.pending_anchor = None
            self.stable_streak = 0
            self.nudge_anchor_down(verdict.factor)
        else:
            raise ValueError(f"unknown verdict kind {kind!r}")

    def _on_stable(self) -> None:
        self.stable_streak += 1
        if self.growth_latched_off and self.stable_streak >= REARM_AFTER_STABLE:
            self.growth_latched_off = False
        if not self._growth_allowed():
            self.pending_anchor = None
            return
        if self.pending_anchor is not None:
            proposal = min(self.pending_anchor, self.max_anchor)
            self.pending_anchor = None
            if proposal > self.anchor:
                self._set_anchor(proposal)
            return
        if self.relax_up:
            self._relax_anchor_up()

    def _relax_anchor_up(self) -> None:
        """Grow by one toward ``max_anchor`` unless the projected count spread would
        exceed ``max_batch_diff`` (a larger anchor stretches the fast ranks' lead)."""
        if self.anchor >= self.max_anchor:
            return
        grown = self.anchor + 1
        if self.max_batch_diff is not None:
            projected = self._projected_counts(grown)
            if max(projected) - min(projected) > self.max_batch_diff:
                return
        self._set_anchor(grown)

    # -- checkpoints -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The balancer's learned state, JSON-serialisable (checkpointed for resume)."""
        return {
            "world_size": self.world_size,
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "ms_per_batch": list(self.ms_per_batch),
            "provisional": list(self.provisional),
            "batch_counts": list(self.batch_counts),
            "phase": self.phase.value,
            "calibration_count": self.calibration_count,
            "calibrated": self.calibrated,
            "pending_anchor": self.pending_anchor,
            "growth_latched_off": self.growth_latched_off,
            "stable_streak": self.stable_streak,
            "min_anchor": self.min_anchor,
            "max_anchor": self.max_anchor,
            "overhead_target": self.overhead_target,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output; the world size must match this balancer's."""
        counts = list(state["batch_counts"])
        ms = [float(m) for m in state["ms_per_batch"]]
        world = state.get("world_size", len(counts))
        if world != self.world_size or len(counts) != self.world_size or len(ms) != self.world_size:
            raise ValueError(
                f"ElChe state is for a world of {world} ranks, this run has {self.world_size}; "
                "a cadence state cannot be resumed across a world-size change"
            )
        anchor_rank = state["anchor_rank"]
        if anchor_rank is not None and not 0 <= _require_int("anchor_rank", anchor_rank, 0) < self.world_size:
            raise ValueError(f"anchor_rank {anchor_rank} does not exist in a world of {self.world_size} ranks")
        pending = state["pending_anchor"]
        self.anchor = _require_int("anchor", state["anchor"], 1)
        self.anchor_rank = anchor_rank
        self.ms_per_batch = ms
        provisional = [bool(p) for p in state.get("provisional", [False] * self.world_size)]  # absent in older bundles
        if len(provisional) != self.world_size:
            raise ValueError(f"ElChe state has {len(provisional)} provisional flags for a world of {self.world_size} ranks")
        self.provisional = provisional
        self.batch_counts = [_require_int("batch_counts entry", c, 1) for c in counts]
        self.phase = Phase(state["phase"])
        self.calibration_count = _require_int("calibration_count", state["calibration_count"], 0)
        self.calibrated = bool(state["calibrated"])
        self.pending_anchor = None if pending is None else _require_int("pending_anchor", pending, 1)
        self.growth_latched_off = bool(state["growth_latched_off"])
        self.stable_streak = _require_int("stable_streak", state["stable_streak"], 0)
        self.min_anchor = _require_int("min_anchor", state["min_anchor"], 1)
        self.max_anchor = _require_int("max_anchor", state["max_anchor"], 1)
        target = _require_real("overhead_target", state["overhead_target"])
        self.overhead_target = _clamp(target, OVERHEAD_TARGET_MIN, OVERHEAD_TARGET_MAX)

    def __repr__(self) -> str:
        return (
            f"ElChe(world_size={self.world_size}, anchor={self.anchor}, counts={self.batch_counts}, "
            f"phase={self.phase.value}, anchor_rank={self.anchor_rank})"
        )


__all__ = [
    "COHORT_BAND",
    "DEAD_ZONE",
    "DOMINANCE_MARGIN",
    "MAX_SPEED_RATIO",
    "REARM_AFTER_STABLE",
    "ElChe",
    "cap_window",
    "elect_anchor_rank",
    "phase_for",
]
