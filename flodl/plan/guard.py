"""Divergence guard and LR-aware meta-controller: who may change the averaging window.

After each averaging, the runtime measures how far each replica had drifted
from the average (``D_r = ||W_pre,r - W_post|| / ||W_post||``) and feeds the
worst one to a guard. The guard answers with a ``Verdict`` that ElChe obeys
(``ElChe.apply_verdict``): ``Stable`` lets a staged anchor growth through,
``SuppressGrowth`` blocks it, ``NudgeDown(f)`` shrinks the anchor.

Above the guard, the ``MetaController`` watches the learning rate, the anchor
trajectory and the guard's recent verdicts, and shrinks the anchor on a sharp
LR drop or on sustained divergence pressure, which the trend rule alone reacts
to too slowly.

Pure logic: no I/O, no clock. Callers pass the measured numbers in.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..config import ApplyPolicy
from .signals import Phase, Verdict

if TYPE_CHECKING:
    from ..config import ElCheConfig

#: Norms below this are treated as zero (no direction to measure an angle against).
NORM_FLOOR = 1e-10


# ---------------------------------------------------------------------------
# The signal
# ---------------------------------------------------------------------------


def max_relative_delta(divergences: Iterable[float | None]) -> float:
    """The guard's input: the worst rank's relative drift (ranks without a reading skipped; none → 0)."""
    return max((float(d) for d in divergences if d is not None), default=0.0)


def cosine_and_shift(pre_norm: float | None, post_norm: float | None, d: float | None) -> tuple[float | None, float | None]:
    """Angle and magnitude change between a replica and the average, from norms alone.

    With ``|pre - post| = d * |post|`` the law of cosines gives
    ``cos = (|pre|^2 + |post|^2 - (d |post|)^2) / (2 |pre| |post|)``, clamped to
    [-1, 1]. The cosine is 0 for a zero replica and None when the average is
    zero (no direction); the shift is ``|pre| - |post|``. Both are None
    without norms.
    """
    if pre_norm is None or post_norm is None:
        return None, None
    shift = pre_norm - post_norm
    if post_norm < NORM_FLOOR or d is None:
        return None, shift
    if pre_norm < NORM_FLOOR:
        return 0.0, shift
    gap = d * post_norm
    cosine = (pre_norm**2 + post_norm**2 - gap**2) / (2.0 * pre_norm * post_norm)
    return min(max(cosine, -1.0), 1.0), shift


# ---------------------------------------------------------------------------
# Guards
# ---------------------------------------------------------------------------

#: Readings a TrendGuard remembers.
TREND_HISTORY = 5
#: Readings in a row that must rise strictly before the trend guard acts.
TREND_RUN = 3


class TrendGuard:
    """Blocks anchor growth while replica drift is rising above a threshold.

    The 0.5.3 rule: three strictly rising readings whose last one exceeds
    ``threshold`` → SuppressGrowth, else Stable. Under the Sync policy the
    window is a single batch, so the guard always answers Stable (it still
    records the readings, for telemetry).

    Like 0.5.3 it never answers NudgeDown: a trend alone is too noisy to
    shrink the anchor (measured here: a variant that halved the anchor when a
    rising trend ended above twice the threshold did so three times in one
    3-epoch run on noise, and the window oscillated). Shrinking is the
    meta-controller's job, on sustained pressure or an LR cliff.
    """

    def __init__(self, threshold: float = 0.05, *, sync_policy: bool = False) -> None:
        ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        if not ok or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
        self.threshold = float(threshold)
        self.sync_policy = bool(sync_policy)
        self._history: deque[float] = deque(maxlen=TREND_HISTORY)

    @property
    def history(self) -> tuple[float, ...]:
        """The remembered readings, oldest first (at most ``TREND_HISTORY``)."""
        return tuple(self._history)

    def report(self, d: float) -> Verdict:
        """Record one window's worst drift and judge it."""
        self._history.append(float(d))
        if self.sync_policy or not self._rising():
            return Verdict.STABLE
        return Verdict.SUPPRESS_GROWTH if self._history[-1] > self.threshold else Verdict.STABLE

    def _rising(self) -> bool:
        if len(self._history) < TREND_RUN:
            return False
        run = list(self._history)[-TREND_RUN:]
        return all(a < b for a, b in itertools.pairwise(run))

    def reset(self) -> None:
        self._history.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "trend", "history": list(self._history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the readings. The threshold comes from the run's config, not the
        checkpoint, so a resumed run may retune it; a state without history
        (the guard was off before the resume) starts empty."""
        self._history = deque((float(d) for d in state.get("history", ())), maxlen=TREND_HISTORY)

    def __repr__(self) -> str:
        return f"TrendGuard(threshold={self.threshold}, sync_policy={self.sync_policy}, history={self.history})"


class NoGuard:
    """The guard switched off: every window is Stable, and nothing is remembered."""

    threshold = None
    sync_policy = False

    @property
    def history(self) -> tuple[float, ...]:
        return ()

    def report(self, d: float) -> Verdict:
        return Verdict.STABLE

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "none", "history": []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return "NoGuard()"


def make_guard(elche_config: ElCheConfig) -> TrendGuard | NoGuard:
    """The guard a run with ``elche_config`` uses.

    ``no_divergence_guard`` or ``convergence_guard="none"`` switch it off;
    otherwise a TrendGuard with the effective threshold (0.05, or 0.3 with
    EASGD, whose elastic blending tolerates more drift), always Stable
    under the Sync policy.
    """
    if elche_config.no_divergence_guard or elche_config.convergence_guard == "none":
        return NoGuard()
    sync = elche_config.mode.policy is ApplyPolicy.SYNC
    return TrendGuard(elche_config.effective_divergence_threshold, sync_policy=sync)


# ---------------------------------------------------------------------------
# Meta-controller
# ---------------------------------------------------------------------------

LR_WINDOW = 3
ANCHOR_WINDOW = 5
VERDICT_WINDOW = 5
#: A single-cycle LR drop larger than this fraction is a cliff (MultiStepLR's 5x/10x
#: drops are; cosine annealing's per-cycle steps are not).
LR_CLIFF_DROP = 0.3
LR_CLIFF_BASE = 0.5
FACTOR_MIN = 0.1
FACTOR_MAX = 0.95
SETTLED_BAND = 0.10
#: Per phase: how many trailing pressure verdicts trigger the convergence watcher,
#: and its base factor. Later phases react sooner but more gently.
CONVERGENCE_WATCH: Mapping[Phase, tuple[int, float]] = {
    Phase.WARMUP: (5, 0.3),
    Phase.STABLE: (3, 0.5),
    Phase.MATURE: (2, 0.7),
}


def _clamp_factor(f: float) -> float:
    return min(max(f, FACTOR_MIN), FACTOR_MAX)


class MetaController:
    """Shrinks the anchor on a learning-rate cliff or on sustained guard pressure.

    Each averaging cycle, ``observe(lr, anchor, verdict, phase)`` records into
    capped windows and may return ``NudgeDown(f)`` for the caller to apply
    through ``ElChe.apply_verdict`` (which also drops any staged growth).

    - LR-cliff watcher: the last LR fell more than 30 % from the one before →
      base 0.5 (anticipates the drift a sharp drop causes).
    - Convergence watcher: the last K verdicts were all SuppressGrowth or
      NudgeDown (K and base per phase, ``CONVERGENCE_WATCH``).
    - Each base becomes ``clamp(base - (1 - base) * anchor_trend, 0.1, 0.95)``:
      a rising anchor (the auto-tune pushing back) makes it harsher, a
      recovering one gentler. Both firing compound: ``clamp(f1 * f2)``.

    Nothing happens in Probe (no calibration yet, every signal is noise), but
    observations are still recorded. After firing, the verdict window is
    cleared so the same evidence does not fire again on every following cycle;
    the watcher needs K fresh pressure verdicts to act again.
    """

    def __init__(self) -> None:
        self._lrs: deque[float] = deque(maxlen=LR_WINDOW)
        self._anchors: deque[int] = deque(maxlen=ANCHOR_WINDOW)
        self._verdicts: deque[Verdict] = deque(maxlen=VERDICT_WINDOW)

    @property
    def lr_window(self) -> tuple[float, ...]:
        return tuple(self._lrs)

    @property
    def anchor_window(self) -> tuple[int, ...]:
        return tuple(self._anchors)

    @property
    def verdict_window(self) -> tuple[Verdict, ...]:
        return tuple(self._verdicts)

    def observe(self, lr: float | None, anchor: int, verdict: Verdict, phase: Phase) -> Verdict | None:
        """Record one averaging cycle; ``NudgeDown(f)`` when a watcher fires, else None.

        ``lr`` None (not known this cycle) leaves the LR window unchanged.
        """
        phase = Phase(phase)
        if lr is not None:
            self._lrs.append(float(lr))
        self._anchors.append(int(anchor))
        self._verdicts.append(verdict)
        if phase is Phase.PROBE:
            return None
        trend = self.anchor_trend()
        factors = [self._effective(base, trend) for base in self._fired_bases(phase)]
        if not factors:
            return None
        self._verdicts.clear()
        factor = factors[0] if len(factors) == 1 else _clamp_factor(math.prod(factors))
        return Verdict.nudge(factor)

    def _fired_bases(self, phase: Phase) -> list[float]:
        bases = []
        if self._lr_cliff():
            bases.append(LR_CLIFF_BASE)
        watch = CONVERGENCE_WATCH.get(phase)
        if watch is not None and self._sustained_pressure(watch[0]):
            bases.append(watch[1])
        return bases

    def _lr_cliff(self) -> bool:
        if len(self._lrs) < 2:
            return False
        previous, now = self._lrs[-2], self._lrs[-1]
        return previous > 0 and now < previous and (previous - now) / previous > LR_CLIFF_DROP

    def _sustained_pressure(self, k: int) -> bool:
        if len(self._verdicts) < k:
            return False
        return all(v.is_pressure for v in list(self._verdicts)[-k:])

    @staticmethod
    def _effective(base: float, trend: float) -> float:
        return _clamp_factor(base - (1.0 - base) * trend)

    def anchor_trend(self) -> float:
        """``(current - mean) / mean`` over the anchor window (current included); 0 with < 2 samples."""
        if len(self._anchors) < 2:
            return 0.0
        mean = sum(self._anchors) / len(self._anchors)
        return (self._anchors[-1] - mean) / mean if mean > 0 else 0.0

    def is_settled(self) -> bool:
        """The anchor has stopped moving: within 10 % of its recent mean."""
        return abs(self.anchor_trend()) < SETTLED_BAND

    def reset(self) -> None:
        self._lrs.clear()
        self._anchors.clear()
        self._verdicts.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_window": list(self._lrs),
            "anchor_window": list(self._anchors),
            "verdict_window": [v.to_list() for v in self._verdicts],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._lrs = deque((float(x) for x in state["lr_window"]), maxlen=LR_WINDOW)
        self._anchors = deque((int(x) for x in state["anchor_window"]), maxlen=ANCHOR_WINDOW)
        self._verdicts = deque((Verdict.from_list(v) for v in state["verdict_window"]), maxlen=VERDICT_WINDOW)

    def __repr__(self) -> str:
        return f"MetaController(lr={self.lr_window}, anchors={self.anchor_window}, verdicts={len(self._verdicts)})"


def make_meta_controller(elche_config: ElCheConfig) -> MetaController | None:
    """The meta-controller a run uses, or None when ``meta_controller`` is off."""
    return MetaController() if elche_config.meta_controller else None


__all__ = [
    "NoGuard",
    "MetaController",
    "TrendGuard",
    "cosine_and_shift",
    "make_guard",
    "make_meta_controller",
    "max_relative_delta",
]
