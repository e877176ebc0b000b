"""Field checkers for run options, and the dataclass field that carries one.

Each checker takes (field name, value) and returns the normalised value or
raises ``ConfigError`` naming the field; ``run.py`` attaches one to every
field with ``_option`` and runs them at construction and in ``validate()``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field
from typing import Any

from ..errors import ConfigError
from .values import (
    CORE_REDUCTIONS,
    ElCheMode,
    EpochCallbackPolicy,
    MaxFailureThreshold,
    Reduction,
    _is_int,
    _is_real,
)

Check = Callable[[str, Any], Any]


def _count(minimum: int = 0, *, optional: bool = True, zero_is_none: bool = False) -> Check:
    """A whole number >= ``minimum``; ``zero_is_none`` maps 0 to "off" (None)."""

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if zero_is_none and value == 0 and _is_int(value):
            return None
        if not _is_int(value) or value < minimum:
            raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
        return value

    return check


def _multiplicity(name: str, value: Any) -> int:
    """A count that is at least 1; 0 is lifted to 1 like the reference setter does."""
    if not _is_int(value) or value < 0:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
    return max(value, 1)


def _real(name: str, value: Any, what: str) -> float:
    if not _is_real(value) or not math.isfinite(value):
        raise ConfigError(name, f"must be {what}, got {value!r}")
    return float(value)


def _positive(*, optional: bool = True) -> Check:
    def check(name: str, value: Any) -> float | None:
        if value is None and optional:
            return None
        number = _real(name, value, "a positive finite number")
        if number <= 0:
            raise ConfigError(name, f"must be a positive finite number, got {value!r}")
        return number

    return check


def _non_negative(name: str, value: Any) -> float:
    number = _real(name, value, "a finite number >= 0")
    if number < 0:
        raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")
    return number


def _within(low: float, high: float) -> Check:
    """A finite number in ``[low, high]``; anything else is an error."""

    def check(name: str, value: Any) -> float:
        number = _real(name, value, f"a number in [{low}, {high}]")
        if not low <= number <= high:
            raise ConfigError(name, f"must be a number in [{low}, {high}], got {value!r}")
        return number

    return check


def _clamped(low: float, high: float) -> Check:
    """A finite number, clamped into ``[low, high]`` (the reference runtime's behaviour)."""

    def check(name: str, value: Any) -> float:
        return min(max(_real(name, value, f"a number (clamped to [{low}, {high}])"), low), high)

    return check


def _alpha(name: str, value: Any) -> float | None:
    if value is None:
        return None
    number = _real(name, value, "a number in (0, 1]")
    if not 0.0 < number <= 1.0:
        raise ConfigError(name, f"must be a number in (0, 1], got {value!r}")
    return number


def _flag(*, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> bool | None:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be true or false, got {value!r}")
        return value

    return check


def _text(name: str, value: Any) -> str | None:
    """An optional non-empty string; paths (``os.PathLike``) are stored as strings."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    return value


def _choice(*choices: str) -> Check:
    def check(name: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or value.strip().lower() not in choices:
            raise ConfigError(name, f"must be one of {', '.join(choices)}, got {value!r}")
        return value.strip().lower()

    return check


def _mode(name: str, value: Any) -> ElCheMode:
    return ElCheMode.parse(value, field_name=name)


def _max_failure(name: str, value: Any) -> MaxFailureThreshold | None:
    return None if value is None else MaxFailureThreshold.parse(value)


def _callback_policy(name: str, value: Any) -> EpochCallbackPolicy:
    return EpochCallbackPolicy.parse(value)


def _transform(name: str, value: Any) -> Any:
    """None, an importable ``"module:function"`` spec, or a callable."""
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        module, sep, function = value.partition(":")
        if sep and module.strip() and function.strip():
            return value
    raise ConfigError(name, f"must be a 'module:function' string or a callable, got {value!r}")


def _specs(name: str, value: Any) -> tuple[str, ...]:
    """``"module:function"`` specs (one, or a list of them), each importable by name, in order."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, bytes):
        raise ConfigError(name, f"must be a list of 'module:function' specs, got {value!r}")
    specs = tuple(items)
    for spec in specs:
        module, sep, function = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        if not (sep and module.strip() and function.strip()):
            raise ConfigError(name, f"each must be a 'module:function' (or 'path/to/file.py:function') string, got {spec!r}")
    return specs


def _ratios(name: str, value: Any) -> tuple[float, ...] | None:
    """Per-rank shares, normalised to sum to 1 (left alone when they already do,
    so normalising is idempotent and ``from_dict(to_dict())`` is exact)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(name, f"must be a list of numbers like [0.7, 0.3], got {value!r}")
    ratios = tuple(value)
    if not ratios:
        raise ConfigError(name, "must not be empty")
    for ratio in ratios:
        if not _is_real(ratio) or not math.isfinite(ratio) or ratio < 0:
            raise ConfigError(name, f"every ratio must be a finite number >= 0, got {ratio!r}")
    total = math.fsum(ratios)
    if total <= 0:
        raise ConfigError(name, f"ratios must not all be zero, got {list(ratios)!r}")
    if abs(total - 1.0) > 1e-9:
        return tuple(float(r) / total for r in ratios)
    return tuple(float(r) for r in ratios)


def _reductions(name: str, value: Any) -> tuple[tuple[str, Reduction], ...]:
    """A key -> Reduction map, stored as key-sorted pairs so the config stays hashable
    and two equal maps compare equal whatever order they were declared in."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = list(value)
    else:
        raise ConfigError(name, f"must map metric keys to reductions, got {value!r}")
    declared: dict[str, Reduction] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(name, f"expected (key, reduction) pairs, got {item!r}")
        key, reduction = item
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(name, f"metric key must be a non-empty string, got {key!r}")
        if key in CORE_REDUCTIONS:
            # The reference silently keeps the core roll-up; we say so instead.
            raise ConfigError(name, f"{key!r} is a core metric (always {CORE_REDUCTIONS[key].value}); its reduction cannot be changed")
        declared[key] = Reduction.parse(reduction, field_name=name)  # later declaration wins
    return tuple(sorted(declared.items()))


def _option(
    default: Any = dataclasses.MISSING,
    *,
    check: Check,
    kind: str,
    help: str,
    default_text: str | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that knows how to check itself and how to describe itself.

    ``kind`` names the value's shape ("int", "float", "bool", "text", "path",
    "mode", ...), which ``options.py`` maps to a CLI/TOML parser; ``help`` and
    ``default_text`` feed the CLI help and docs/options.md.
    """
    meta = {"check": check, "kind": kind, "help": help, "default_text": default_text}
    return field(default=default, default_factory=default_factory, metadata=meta)


def _normalise_fields(obj: Any) -> None:
    """Run every field's checker and store its normalised value (frozen-safe)."""
    for f in dataclasses.fields(obj):
        value = f.metadata["check"](f.name, getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def _check_fields(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        f.metadata["check"](f.name, getattr(obj, f.name))
