"""The CLI and TOML faces of the run options in ``run.py``.

One option, one name everywhere: the ``DdpRunConfig`` / ``ElCheConfig`` field
``heartbeat_timeout_secs`` is the flag ``--heartbeat-timeout-secs`` and the
TOML key ``heartbeat_timeout_secs``. ElChe's fields are flat top-level keys
too (``mode = "nccl-sync"``, ``anchor = 10``). A value is taken from the flag
if given, else from the TOML file, else the default.

This module only turns text (flags) and TOML values into typed values; the
range checks live with the fields in ``run.py``, so every entry point
(builders, flags, TOML, ``from_dict``) accepts and rejects the same things.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import ConfigError
from .run import (
    DdpRunConfig,
    ElCheMode,
    EpochCallbackPolicy,
    MaxFailureThreshold,
    Reduction,
    option_fields,
)

# ---------------------------------------------------------------------------
# Value kinds: how one shape of value is written on the command line and in TOML
# ---------------------------------------------------------------------------


def _as_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _as_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _as_ratios(text: str) -> tuple[float, ...]:
    """``"0.7,0.3"`` -> ``(0.7, 0.3)`` (normalisation happens in the config)."""
    return tuple(_as_float(part) for part in text.split(","))


def _as_reduction_pair(text: str) -> tuple[str, Reduction]:
    """``"tokens=sum"`` -> ``("tokens", Reduction.SUM)``."""
    key, sep, reduction = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=REDUCTION like 'tokens=sum', got {text!r}")
    return key.strip(), Reduction.parse(reduction.strip())


def _toml_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _toml_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _toml_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _toml_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _toml_ratios(value: Any) -> tuple[float, ...]:
    """A TOML array of numbers, or the flag's ``"0.7,0.3"`` text."""
    if isinstance(value, str):
        return _as_ratios(value)
    if not isinstance(value, list):
        raise ValueError(f"expected a list of numbers like [0.7, 0.3], got {value!r}")
    return tuple(_toml_float(item) for item in value)


def _toml_reductions(value: Any) -> dict[str, Reduction]:
    """A TOML table ``{ tokens = "sum" }``."""
    if not isinstance(value, Mapping):
        raise ValueError(f'expected a table like {{ tokens = "sum" }}, got {value!r}')
    return {key: Reduction.parse(_toml_str(red)) for key, red in value.items()}


def _toml_specs(value: Any) -> tuple[str, ...]:
    """A TOML array of ``"module:function"`` strings (or one string)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError(f'expected a list like ["mypkg.logs:make"], got {value!r}')
    return tuple(_toml_str(item) for item in items)


def _toml_max_failure(value: Any) -> MaxFailureThreshold:
    """A rank count (``3``) or the text form (``"3"``, ``"20%"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f'expected a rank count like 3 or a percentage like "20%", got {value!r}')
    return MaxFailureThreshold.parse(value)


def _toml_callback_policy(value: Any) -> EpochCallbackPolicy:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f'expected "fastest" or "rank:N", got {value!r}')
    return EpochCallbackPolicy.parse(value)


@dataclass(frozen=True)
class _Kind:
    """How values of one shape are spelled: as flag text and as a TOML value."""

    type_text: str  # for help and docs
    metavar: str | None
    from_text: Callable[[str], Any]
    from_toml: Callable[[Any], Any]


_MODES = ", ".join(mode.value for mode in ElCheMode)

_KINDS: dict[str, _Kind] = {
    "int": _Kind("integer", "N", _as_int, _toml_int),
    "float": _Kind("number", "X", _as_float, _toml_float),
    "bool": _Kind("bool", None, str, _toml_bool),  # from_text unused: bool flags take no value
    "path": _Kind("path", "PATH", str, _toml_str),
    "name": _Kind("name", "NAME", str, _toml_str),
    "loggers": _Kind("module:function, repeatable (TOML: array)", "MODULE:FUNCTION", str, _toml_specs),
    "transform": _Kind("module:function", "MODULE:FUNCTION", str, _toml_str),
    "mode": _Kind(f"one of {_MODES}", "MODE", ElCheMode.parse, lambda v: ElCheMode.parse(_toml_str(v))),
    "guard": _Kind("trend or none", "GUARD", str, _toml_str),
    "theme": _Kind("light, dark or auto", "THEME", str, _toml_str),
    "lr_scale_on": _Kind("steps or average", "WHERE", str, _toml_str),
    "average_weights": _Kind("batches or equal", "WEIGHTS", str, _toml_str),
    "outer": _Kind("none, sgd or nesterov", "OPTIMIZER", str, _toml_str),
    "sync_compression": _Kind("none, bf16 or int8", "KIND", str, _toml_str),
    "max_failure": _Kind("rank count (3) or share (20%)", "N|P%", MaxFailureThreshold.parse, _toml_max_failure),
    "epoch_callback_policy": _Kind("fastest or rank:N", "fastest|rank:N", EpochCallbackPolicy.parse, _toml_callback_policy),
    "ratios": _Kind("comma-separated numbers (TOML: array)", "R,R,...", _as_ratios, _toml_ratios),
    "reductions": _Kind("KEY=mean|sum|max|min|last, repeatable (TOML: table)", "KEY=REDUCTION", _as_reduction_pair, _toml_reductions),
}

# Options whose flag is not simply the kebab-case field name.
_FLAG_OVERRIDES = {"scalar_reductions": "--scalar-reduction", "loggers": "--logger"}  # one per flag, repeatable


# ---------------------------------------------------------------------------
# Option specs: one per flat option
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """Everything the CLI, the TOML reader and the docs need about one option."""

    name: str
    kind: _Kind
    kind_name: str
    help: str
    default_text: str

    @property
    def flag(self) -> str:
        return _FLAG_OVERRIDES.get(self.name, "--" + self.name.replace("_", "-"))

    @property
    def is_switch(self) -> bool:
        """``no_divergence_guard`` already says "no": a plain on-switch, not --x/--no-x."""
        return self.name.startswith("no_")

    @property
    def flag_text(self) -> str:
        if self.kind_name == "bool" and not self.is_switch:
            return f"{self.flag} / --no-{self.flag[2:]}"
        return self.flag


def _default_text(f: dataclasses.Field) -> str:
    if f.metadata["default_text"] is not None:
        return f.metadata["default_text"]
    # MISSING is a sentinel object, not a type mypy can narrow on: say what the factory is.
    default = f.default if f.default is not dataclasses.MISSING else cast(Callable[[], Any], f.default_factory)()
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)


def _specs() -> dict[str, _Spec]:
    return {
        f.name: _Spec(f.name, _KINDS[f.metadata["kind"]], f.metadata["kind"], f.metadata["help"], _default_text(f)) for f in option_fields()
    }


_SPECS = _specs()

#: ``--help``'s groups, in order, and the run options each holds (every option in exactly one).
#: The launch options join them where they belong (flodl/controller/launch.py); "launch" has only those.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "launch": (),
    "modes and cadence": (
        *("mode", "anchor", "min_anchor", "max_anchor", "overhead_target", "max_batch_diff", "max_overshoot"),
        *("divergence_threshold", "no_divergence_guard", "convergence_guard", "partition_ratios", "easgd_alpha"),
        *("meta_controller", "relax_up", "progressive_dispatch", "max_grad_norm", "lr_scale_ratio", "lr_scale_on"),
        *("average_weights", "outer_optimizer", "outer_lr", "outer_momentum", "sync_compression"),
        *("sync_fragments",),
        *("eval_every_epochs", "epoch_callback_policy", "deterministic"),
    ),
    "fault tolerance and checkpoints": (
        *("save_path", "max_failure", "heartbeat_timeout_secs", "snapshot_timeout_secs"),
        *("checkpoint_every", "checkpoint_at_epoch", "resume_from", "resume_weights_only"),
    ),
    "data": (
        *("augment", "epoch_splits", "transform", "vram_pool", "vram_max_usage", "ram_max_usage"),
        *("gpu_ram_share", "sample_cache", "disk_stage_gb", "disk_stage_dir"),
    ),
    "monitoring": (
        *("reports_per_epoch", "scalar_reductions", "record_log_dir", "max_log_size"),
        *("dashboard_html", "dashboard_theme", "timeline", "tensorboard_dir", "csv_log", "wandb_project", "loggers"),
        *("log_dir",),
    ),
}
_GROUP_OF = {name: title for title, names in HELP_GROUPS.items() for name in names}
assert sorted(_GROUP_OF) == sorted(_SPECS), "every run option belongs to exactly one --help group"


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _argparse_type(spec: _Spec) -> Callable[[str], Any]:
    """Wrap a text parser so argparse prints our message, not 'invalid value'."""

    def parse(text: str) -> Any:
        try:
            return spec.kind.from_text(text)
        except (ConfigError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = spec.name
    return parse


def add_run_options(parser: argparse.ArgumentParser, groups: dict[str, Any] | None = None) -> None:
    """Add one flag per run option to ``parser``, each in its ``HELP_GROUPS`` group (taken from
    ``groups`` by title where the caller made it, else added to the parser).

    Every flag defaults to ``argparse.SUPPRESS``: an option the user did not
    give is absent from the namespace, so TOML and defaults can fill it in.
    """
    groups = {} if groups is None else groups
    for spec in _SPECS.values():
        title = _GROUP_OF[spec.name]
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        # argparse %-formats help strings, so a literal % must be doubled.
        values = f" Values: {spec.kind.type_text[len('one of ') :]}." if spec.kind.type_text.startswith("one of ") else ""
        help_text = f"{spec.help}{values} Default: {spec.default_text}.".replace("%", "%%")
        common: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": help_text}
        if spec.kind_name == "bool":
            action = "store_true" if spec.is_switch else argparse.BooleanOptionalAction
            group.add_argument(spec.flag, action=action, **common)
        elif spec.kind_name in ("reductions", "loggers"):
            group.add_argument(spec.flag, action="append", type=_argparse_type(spec), metavar=spec.kind.metavar, **common)
        else:
            group.add_argument(spec.flag, type=_argparse_type(spec), metavar=spec.kind.metavar, **common)


# ---------------------------------------------------------------------------
# TOML
# ---------------------------------------------------------------------------


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; a missing or malformed file is a ConfigError naming it."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("config", f"{path}: not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError("config", f"{path}: cannot be read: {err.strerror or err}") from None


def _from_toml(values: Mapping[str, Any], launch_keys: frozenset[str], source: str) -> dict[str, Any]:
    """Typed run-option values from a TOML table; launch keys are skipped."""
    result: dict[str, Any] = {}
    for key, raw in values.items():
        spec = _SPECS.get(key)
        if spec is None:
            if key in launch_keys:
                continue  # the launcher's business, not a run option
            raise ConfigError(key, f"unknown option {key!r} in {source}")
        try:
            result[key] = spec.kind.from_toml(raw)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(key, f"{err} in {source}") from None
    return result


# ---------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------


def resolve_run_config(
    args: argparse.Namespace,
    toml_values: Mapping[str, Any] | None,
    launch_keys: frozenset[str] = frozenset(),
    *,
    source: str = "config.toml",
) -> DdpRunConfig:
    """The run config from flags (``args``) over TOML values over defaults.

    ``launch_keys`` are TOML keys the caller handles itself (hosts, world
    size, ...); any other key that is not a run option is an error.
    ``scalar_reductions`` merges per metric key (a flag's declaration wins
    over the file's for the same key). Returns a validated config; feature
    gating (``check_available``) is left to the caller.
    """
    values = _from_toml(toml_values or {}, launch_keys, source)
    given = {name: getattr(args, name) for name in _SPECS if hasattr(args, name)}
    if "scalar_reductions" in given:
        # A map option: flags refine the file's declarations instead of dropping them.
        merged = dict(values.get("scalar_reductions", {}))
        merged.update(given.pop("scalar_reductions"))
        values["scalar_reductions"] = merged
    values.update(given)
    config = DdpRunConfig.from_dict(values)
    config.validate()
    return config


# ---------------------------------------------------------------------------
# Documentation
# ---------------------------------------------------------------------------


def option_table() -> list[dict[str, str]]:
    """One row per option (flat order): name, flag, toml_key, type, default, help."""
    return [
        {
            "name": spec.name,
            "flag": spec.flag_text,
            "toml_key": spec.name,
            "type": spec.kind.type_text,
            "default": spec.default_text,
            "help": spec.help,
        }
        for spec in _SPECS.values()
    ]


__all__ = ["HELP_GROUPS", "add_run_options", "load_toml", "option_table", "resolve_run_config"]
