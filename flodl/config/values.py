"""The small value types of run options: modes, policies, reductions, thresholds.

Text enums parse every documented spelling (``nccl-cadence``, ``NcclCadence``,
``NCCL_CADENCE``) and name the field on a bad one; ``MaxFailureThreshold``
and ``EpochCallbackPolicy`` are tiny frozen values with their own parsers.
Pure, like ``run.py`` which builds on them.
"""

from __future__ import annotations

import decimal
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError

SYNC_PRESET_ANCHOR = 1
CADENCE_PRESET_ANCHOR = 10


# ---------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------


def _squash(text: str) -> str:
    """Spelling-insensitive key: ``"Nccl-Sync"`` and ``"nccl_sync"`` both give ``"ncclsync"``."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


class _TextEnum(str, enum.Enum):
    """A str-valued enum whose text form is its value and that parses leniently."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, text: Any, *, field_name: str | None = None) -> Any:
        """Return the member named or valued ``text`` (case, ``-`` and ``_`` ignored)."""
        if isinstance(text, cls):
            return text
        name = field_name or _snake(cls.__name__)
        if isinstance(text, str):
            key = _squash(text)
            for member in cls:
                if key in (_squash(member.name), _squash(member.value)):
                    return member
        raise ConfigError(name, f"unknown value {text!r}; valid values: {cls.spellings()}")

    @classmethod
    def spellings(cls) -> str:
        """The valid values for messages, e.g. ``nccl-sync (NcclSync), cpu-sync (CpuSync)``."""
        return ", ".join(m.value if m.name.lower() == m.value else f"{m.value} ({m.name})" for m in cls)


def _snake(camel: str) -> str:
    """``ApplyPolicy`` -> ``apply_policy`` (used to name the option in parse errors)."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel).lstrip("_")


class ApplyPolicy(_TextEnum):
    """WHEN replicas are averaged: every step, every ``anchor`` batches, or free-running."""

    SYNC = "sync"
    CADENCE = "cadence"
    ASYNC = "async"


class AverageBackend(_TextEnum):
    """HOW replicas are averaged.

    ``NCCL`` is the collective backend: an in-place all-reduce of the
    parameters (NCCL on CUDA ranks, gloo otherwise). ``CPU`` sends snapshots
    to the coordinator, which averages them and pushes the result back.
    """

    NCCL = "nccl"
    CPU = "cpu"


class ElCheMode(_TextEnum):
    """One name for an (ApplyPolicy, AverageBackend) pair.

    "Nccl" is the collective backend (NCCL on CUDA ranks, gloo otherwise);
    "Cpu" is coordinator-side averaging. ``NcclAsync`` exists so every pair
    has a name (``from_parts``/``split`` are exact inverses), although the
    reference runtime dropped it in 0.6; ``AVAILABLE_MODES`` says which modes
    this version can run.
    """

    NcclSync = "nccl-sync"
    NcclCadence = "nccl-cadence"
    NcclAsync = "nccl-async"
    CpuSync = "cpu-sync"
    CpuCadence = "cpu-cadence"
    CpuAsync = "cpu-async"

    @classmethod
    def parse(cls, text: Any, *, field_name: str | None = "mode") -> ElCheMode:
        """Accept ``NcclSync``, ``nccl-sync``, ``nccl_sync``, ``ncclsync`` (any case)."""
        return super().parse(text, field_name=field_name)

    @classmethod
    def from_parts(cls, policy: ApplyPolicy | str, backend: AverageBackend | str) -> ElCheMode:
        """The mode for ``(policy, backend)``; the inverse of ``split``."""
        pair = (
            ApplyPolicy.parse(policy, field_name="policy"),
            AverageBackend.parse(backend, field_name="backend"),
        )
        return _MODE_BY_PARTS[pair]

    # Shadows ``str.split`` on purpose (a mode is a str enum); nothing splits a mode as text.
    def split(self) -> tuple[ApplyPolicy, AverageBackend]:  # type: ignore[override]
        """``(policy, backend)`` of this mode."""
        return _PARTS_BY_MODE[self]

    @property
    def policy(self) -> ApplyPolicy:
        return self.split()[0]

    @property
    def backend(self) -> AverageBackend:
        return self.split()[1]

    @property
    def preset_anchor(self) -> int:
        """Initial anchor when none is given: 1 for Sync (every batch), 10 otherwise."""
        return SYNC_PRESET_ANCHOR if self.policy is ApplyPolicy.SYNC else CADENCE_PRESET_ANCHOR


_PARTS_BY_MODE: dict[ElCheMode, tuple[ApplyPolicy, AverageBackend]] = {
    ElCheMode.NcclSync: (ApplyPolicy.SYNC, AverageBackend.NCCL),
    ElCheMode.NcclCadence: (ApplyPolicy.CADENCE, AverageBackend.NCCL),
    ElCheMode.NcclAsync: (ApplyPolicy.ASYNC, AverageBackend.NCCL),
    ElCheMode.CpuSync: (ApplyPolicy.SYNC, AverageBackend.CPU),
    ElCheMode.CpuCadence: (ApplyPolicy.CADENCE, AverageBackend.CPU),
    ElCheMode.CpuAsync: (ApplyPolicy.ASYNC, AverageBackend.CPU),
}
_MODE_BY_PARTS = {parts: mode for mode, parts in _PARTS_BY_MODE.items()}


class Reduction(_TextEnum):
    """How one metric key rolls up across ranks in the record tree."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    LAST = "last"

    @classmethod
    def parse(cls, text: Any, *, field_name: str | None = "scalar_reductions") -> Reduction:
        return super().parse(text, field_name=field_name)

    def fold(self, contribs: Sequence[tuple[float, float]]) -> float | None:
        """Fold ``(value, work)`` pairs of the children that reported a key.

        ``None`` (absent) when nobody reported it, or for Mean when the summed work
        is not positive: a zero-work child realized nothing and weighs nothing.
        Last takes the highest-work child (ties: the later one in child order),
        since children of one node have no time order between them. The record
        tree and the run summary's epoch rows both fold with this.
        """
        if not contribs:
            return None
        values = [v for v, _ in contribs]
        if self is Reduction.SUM:
            return math.fsum(values)
        if self is Reduction.MAX:
            return max(values)
        if self is Reduction.MIN:
            return min(values)
        if self is Reduction.LAST:
            best_value, best_work = contribs[0]
            for value, work in contribs[1:]:
                if work >= best_work:
                    best_value, best_work = value, work
            return best_value
        wsum = math.fsum(w for _, w in contribs)
        return math.fsum(v * w for v, w in contribs) / wsum if wsum > 0 else None


#: Keys whose roll-up is fixed by the runtime; user declarations cannot change them.
CORE_REDUCTIONS: Mapping[str, Reduction] = {
    "loss": Reduction.MEAN,
    "throughput": Reduction.SUM,
    "batch_share": Reduction.SUM,
    "data_starve": Reduction.MAX,
    "compute_only_ms": Reduction.MAX,
}


# ---------------------------------------------------------------------------
# Small value types
# ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class MaxFailureThreshold:
    """How many dead ranks make a cluster run unrecoverable.

    ``absolute(n)``: the run stops once ``n`` ranks have died (``n`` may
    exceed the world size, meaning "never by count"). ``percent(p)``: the
    limit is ``ceil(p * world_size)``, so ``percent(0)`` stops at the first
    death and ``percent(1)`` only when every rank is dead. Text form: ``"3"``
    or ``"20%"``.
    """

    kind: str  # "absolute" | "percent"
    value: int | float

    def __post_init__(self) -> None:
        if self.kind == "absolute":
            if not _is_int(self.value) or self.value < 0:
                raise ConfigError("max_failure", f"must be a whole number of ranks >= 0, got {self.value!r}")
        elif self.kind == "percent":
            ok = _is_real(self.value) and math.isfinite(self.value) and 0.0 <= self.value <= 1.0
            if not ok:
                raise ConfigError("max_failure", f"percent must be a fraction in [0, 1], got {self.value!r}")
            object.__setattr__(self, "value", float(self.value))
        else:
            raise ConfigError("max_failure", f"kind must be 'absolute' or 'percent', got {self.kind!r}")

    @classmethod
    def absolute(cls, n: int) -> MaxFailureThreshold:
        return cls("absolute", n)

    @classmethod
    def percent(cls, p: float) -> MaxFailureThreshold:
        """``p`` is a fraction: ``percent(0.2)`` is 20 %."""
        return cls("percent", p)

    def limit_for(self, world_size: int) -> int:
        """Dead-rank count at which the run is declared unrecoverable."""
        if self.kind == "absolute":
            return int(self.value)
        exact = min(max(self.value, 0.0), 1.0) * world_size
        # Round away float noise first: 0.3 * 10 is 3.0000000000000004 in binary,
        # and "30% of 10 ranks" must mean 3, not 4.
        return math.ceil(round(exact, 9))

    @classmethod
    def parse(cls, text: Any) -> MaxFailureThreshold:
        """``"3"`` -> absolute(3); ``"20%"`` -> percent(0.2)."""
        if isinstance(text, MaxFailureThreshold):
            return text
        if _is_int(text):
            return cls.absolute(text)
        if not isinstance(text, str):
            raise ConfigError("max_failure", f"expected a rank count like '3' or a percentage like '20%', got {text!r}")
        body = text.strip()
        try:
            if body.endswith("%"):
                # Decimal keeps "12.5%" -> 0.125 exact, so str() round-trips bit for bit.
                fraction = decimal.Decimal(body[:-1].strip()) / 100
                if not fraction.is_finite():
                    raise decimal.InvalidOperation
                return cls.percent(float(fraction))
            return cls.absolute(int(body))
        except (ValueError, decimal.InvalidOperation):
            raise ConfigError("max_failure", f"expected a rank count like '3' or a percentage like '20%', got {text!r}") from None

    def __str__(self) -> str:
        if self.kind == "absolute":
            return str(self.value)
        # repr() is the shortest decimal that reads back as this float; scaling it
        # by 100 in decimal is exact, so parse(str(x)) == x.
        percent = decimal.Decimal(repr(self.value)) * 100
        return f"{percent.normalize():f}%"


@dataclass(frozen=True, slots=True)
class EpochCallbackPolicy:
    """Which rank runs the user's per-epoch callbacks (epoch, checkpoint, eval).

    ``EpochCallbackPolicy.FASTEST`` (the default, ``rank is None``) elects the
    live rank with the lowest smoothed ms/batch; ``EpochCallbackPolicy.on_rank(n)``
    pins global rank ``n``. Text form: ``"fastest"`` or ``"rank:N"``.
    """

    rank: int | None = None

    FASTEST: ClassVar[EpochCallbackPolicy]

    def __post_init__(self) -> None:
        if self.rank is not None and (not _is_int(self.rank) or self.rank < 0):
            raise ConfigError("epoch_callback_policy", f"rank must be an integer >= 0, got {self.rank!r}")

    @classmethod
    def on_rank(cls, n: int) -> EpochCallbackPolicy:
        return cls(rank=n)

    @property
    def is_fastest(self) -> bool:
        return self.rank is None

    @classmethod
    def parse(cls, text: Any) -> EpochCallbackPolicy:
        """``"fastest"``, ``"rank:2"`` or ``"2"`` (case-insensitive)."""
        if isinstance(text, EpochCallbackPolicy):
            return text
        if _is_int(text):
            return cls.on_rank(text)
        body = text.strip().lower() if isinstance(text, str) else None
        if body == "fastest":
            return cls.FASTEST
        if body is not None:
            digits = body.removeprefix("rank:").strip()
            if digits.isdecimal():
                return cls.on_rank(int(digits))
        raise ConfigError("epoch_callback_policy", f"expected 'fastest' or 'rank:N', got {text!r}")

    def validate(self, world_size: int) -> None:
        """A pinned rank must exist in a world of ``world_size`` ranks."""
        if self.rank is not None and self.rank >= world_size:
            raise ConfigError(
                "epoch_callback_policy",
                f"rank {self.rank} does not exist in a world of {world_size} ranks (valid: 0..{world_size - 1})",
            )

    def __str__(self) -> str:
        return "fastest" if self.rank is None else f"rank:{self.rank}"


EpochCallbackPolicy.FASTEST = EpochCallbackPolicy()
