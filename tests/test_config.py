"""Run options: defaults, builders, validation, gating, serialisation, CLI/TOML, docs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import tomllib
from pathlib import Path

import pytest

from flodl.config import (
    AVAILABLE_FIELDS,
    AVAILABLE_MODES,
    ELCHE_FIELDS,
    RUN_FIELDS,
    ApplyPolicy,
    AverageBackend,
    DdpRunConfig,
    ElCheConfig,
    ElCheMode,
    EpochCallbackPolicy,
    MaxFailureThreshold,
    Reduction,
    check_available,
)
from flodl.config.options import add_run_options, load_toml, option_table, resolve_run_config
from flodl.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]


def module_level_transform(batch, keys):  # referenced by name in to_dict tests
    return batch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test")
    add_run_options(p)
    return p


def cli(*argv: str, toml: dict | None = None, launch_keys: frozenset[str] = frozenset()) -> DdpRunConfig:
    return resolve_run_config(parser().parse_args(list(argv)), toml, launch_keys)


# ---------------------------------------------------------------------------
# Defaults (the seed's values)
# ---------------------------------------------------------------------------

SEED_DEFAULTS = {
    # ElCheConfig
    "mode": ElCheMode.NcclCadence,
    "anchor": None,
    "min_anchor": None,
    "max_anchor": 1000,
    "overhead_target": 0.05,
    "max_batch_diff": None,
    "max_overshoot": None,
    "divergence_threshold": None,
    "no_divergence_guard": False,
    "convergence_guard": None,
    "partition_ratios": None,
    "easgd_alpha": None,
    "meta_controller": True,
    "relax_up": False,
    # DdpRunConfig
    "checkpoint_every": None,
    "snapshot_timeout_secs": 5,
    "progressive_dispatch": None,
    "max_grad_norm": None,
    "vram_pool": True,
    "augment": 1,
    "epoch_splits": 1,
    "transform": None,
    "vram_max_usage": 0.90,
    "ram_max_usage": 0.50,
    "gpu_ram_share": None,
    "sample_cache": True,
    "disk_stage_gb": 0,
    "disk_stage_dir": None,
    "timeline": None,
    "lr_scale_ratio": 1.0,
    "save_path": None,
    "max_failure": None,
    "heartbeat_timeout_secs": None,
    "epoch_callback_policy": EpochCallbackPolicy.FASTEST,
    "eval_every_epochs": None,
    "reports_per_epoch": None,
    "record_log_dir": None,
    "max_log_size": None,
    "dashboard_html": None,
    "dashboard_theme": None,
    "scalar_reductions": (),
    "resume_from": None,
    "resume_weights_only": False,
    "checkpoint_at_epoch": None,
    "deterministic": False,
    "tensorboard_dir": None,
    "csv_log": None,
    "wandb_project": None,
    "log_dir": None,
    "loggers": (),
    "lr_scale_on": "steps",
    "average_weights": "batches",
    "outer_optimizer": "none",
    "outer_lr": None,
    "outer_momentum": None,
    "sync_compression": "none",
    "sync_fragments": 1,
}


def value_of(config: DdpRunConfig, name: str):
    return getattr(config.elche if name in ELCHE_FIELDS else config, name)


def test_defaults_equal_the_seed():
    config = DdpRunConfig()
    assert set(SEED_DEFAULTS) == set(ELCHE_FIELDS) | set(RUN_FIELDS)
    for name, expected in SEED_DEFAULTS.items():
        assert value_of(config, name) == expected, name
    assert DdpRunConfig.new() == config
    config.validate()
    config.validate(world_size=4)


def test_effective_values_of_the_defaults():
    config = DdpRunConfig()
    assert config.effective_heartbeat_timeout_secs == 30
    assert config.effective_max_log_size == 32 * 1024 * 1024
    assert config.effective_progressive_dispatch is True  # NcclCadence
    assert config.elche.effective_anchor == 10
    assert config.with_mode("nccl-sync").effective_progressive_dispatch is False
    assert config.with_mode("nccl-sync").elche.effective_anchor == 1
    assert config.elche.effective_divergence_threshold == 0.05
    assert config.with_mode("cpu-cadence").elche.effective_anchor == 10
    assert config.with_mode("cpu-cadence").effective_progressive_dispatch is True
    assert config.with_easgd_alpha(0.5).elche.effective_divergence_threshold == 0.3
    assert config.with_divergence_threshold(0.2).with_easgd_alpha(0.5).elche.effective_divergence_threshold == 0.2
    assert config.lr_factor(4) == 4.0
    assert config.with_lr_scale_ratio(0.5).lr_factor(3) == 2.0


def test_config_is_frozen_and_hashable():
    config = DdpRunConfig().with_scalar_reduction("tokens", "sum").with_partition_ratios([1, 1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.augment = 3  # type: ignore[misc]
    assert hash(config) == hash(DdpRunConfig.from_dict(config.to_dict()))


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------

BUILDERS = [
    # (builder, args, field, expected value)
    ("with_checkpoint_every", (3,), "checkpoint_every", 3),
    ("with_snapshot_timeout_secs", (9,), "snapshot_timeout_secs", 9),
    ("with_snapshot_timeout", (7,), "snapshot_timeout_secs", 7),
    ("with_progressive_dispatch", (True,), "progressive_dispatch", True),
    ("with_max_grad_norm", (1.5,), "max_grad_norm", 1.5),
    ("with_vram_pool", (False,), "vram_pool", False),
    ("with_augment", (4,), "augment", 4),
    ("with_epoch_splits", (8,), "epoch_splits", 8),
    ("with_transform", ("pkg.aug:flip",), "transform", "pkg.aug:flip"),
    ("with_vram_max_usage", (0.8,), "vram_max_usage", 0.8),
    ("with_ram_max_usage", (0.25,), "ram_max_usage", 0.25),
    ("with_gpu_ram_share", (1.2,), "gpu_ram_share", 1.2),
    ("with_sample_cache", (False,), "sample_cache", False),
    ("with_disk_stage_gb", (16,), "disk_stage_gb", 16),
    ("with_disk_stage", (32,), "disk_stage_gb", 32),
    ("with_disk_stage_dir", (Path("/scratch"),), "disk_stage_dir", "/scratch"),
    ("with_timeline", ("trace.json",), "timeline", "trace.json"),
    ("with_lr_scale_ratio", (0.5,), "lr_scale_ratio", 0.5),
    ("with_save_path", ("ckpt/run",), "save_path", "ckpt/run"),
    ("with_max_failure", (MaxFailureThreshold.absolute(2),), "max_failure", MaxFailureThreshold.absolute(2)),
    ("with_max_failure", ("20%",), "max_failure", MaxFailureThreshold.percent(0.2)),
    ("with_heartbeat_timeout_secs", (60,), "heartbeat_timeout_secs", 60),
    ("with_epoch_callback_policy", (EpochCallbackPolicy.on_rank(1),), "epoch_callback_policy", EpochCallbackPolicy.on_rank(1)),
    ("with_epoch_callback_policy", ("rank:2",), "epoch_callback_policy", EpochCallbackPolicy.on_rank(2)),
    ("with_eval_every_epochs", (2,), "eval_every_epochs", 2),
    ("with_reports_per_epoch", (10,), "reports_per_epoch", 10),
    ("with_record_log_dir", ("logs",), "record_log_dir", "logs"),
    ("with_max_log_size", (1024,), "max_log_size", 1024),
    ("with_dashboard_html", ("dash.html",), "dashboard_html", "dash.html"),
    ("with_tensorboard_dir", ("run/tb",), "tensorboard_dir", "run/tb"),
    ("with_lr_scale_on", ("average",), "lr_scale_on", "average"),
    ("with_average_weights", ("equal",), "average_weights", "equal"),
    ("with_outer_optimizer", ("sgd",), "outer_optimizer", "sgd"),
    ("with_outer_lr", (0.5,), "outer_lr", 0.5),
    ("with_outer_momentum", (0.9,), "outer_momentum", 0.9),
    ("with_sync_compression", ("int8",), "sync_compression", "int8"),
    ("with_sync_fragments", (4,), "sync_fragments", 4),
    ("with_csv_log", ("run/metrics.csv",), "csv_log", "run/metrics.csv"),
    ("with_wandb_project", ("proj",), "wandb_project", "proj"),
    ("with_log_dir", ("run/logs",), "log_dir", "run/logs"),
    ("with_loggers", (["a.b:make", "c.py:f"],), "loggers", ("a.b:make", "c.py:f")),
    ("with_logger", ("a.b:make",), "loggers", ("a.b:make",)),
    ("with_dashboard_theme", ("light",), "dashboard_theme", "light"),
    ("with_scalar_reductions", ({"tokens": "sum"},), "scalar_reductions", (("tokens", Reduction.SUM),)),
    ("with_resume_from", ("ckpt/run",), "resume_from", "ckpt/run"),
    ("with_resume_weights_only", (), "resume_weights_only", True),
    ("with_deterministic", (), "deterministic", True),
    ("with_checkpoint_at_epoch", (3,), "checkpoint_at_epoch", 3),
    # ElChe passthroughs
    ("with_mode", (ElCheMode.CpuAsync,), "mode", ElCheMode.CpuAsync),
    ("with_mode", ("cpu_cadence",), "mode", ElCheMode.CpuCadence),
    ("with_policy", (ApplyPolicy.SYNC,), "mode", ElCheMode.NcclSync),
    ("with_backend", ("cpu",), "mode", ElCheMode.CpuCadence),
    ("with_anchor", (5,), "anchor", 5),
    ("with_min_anchor", (2,), "min_anchor", 2),
    ("with_max_anchor", (50,), "max_anchor", 50),
    ("with_overhead_target", (0.1,), "overhead_target", 0.1),
    ("with_max_batch_diff", (0,), "max_batch_diff", 0),
    ("with_max_overshoot", (3,), "max_overshoot", 3),
    ("with_divergence_threshold", (0.1,), "divergence_threshold", 0.1),
    ("with_no_divergence_guard", (), "no_divergence_guard", True),
    ("with_convergence_guard", ("none",), "convergence_guard", "none"),
    ("with_partition_ratios", ([0.7, 0.3],), "partition_ratios", (0.7, 0.3)),
    ("with_easgd_alpha", (0.5,), "easgd_alpha", 0.5),
    ("with_meta_controller", (False,), "meta_controller", False),
    ("with_relax_up", (True,), "relax_up", True),
    ("with_elche_relax_up", (True,), "relax_up", True),
]


@pytest.mark.parametrize(("builder", "args", "name", "expected"), BUILDERS, ids=lambda v: str(v)[:30])
def test_builder_sets_its_field_and_returns_a_new_config(builder, args, name, expected):
    original = DdpRunConfig()
    built = getattr(original, builder)(*args)
    assert built is not original
    assert value_of(built, name) == expected
    assert original == DdpRunConfig()  # the original is untouched
    others = {n for n in SEED_DEFAULTS if n != name}
    assert all(value_of(built, n) == SEED_DEFAULTS[n] for n in others)


def test_every_option_has_a_with_builder_and_a_builder_test():
    tested = {name for _, _, name, _ in BUILDERS}
    for name in SEED_DEFAULTS:
        assert callable(getattr(DdpRunConfig, f"with_{name}", None)), f"with_{name} missing"
        assert name in tested, f"no builder test for {name}"
    assert callable(DdpRunConfig.with_elche)


def test_builder_special_rules():
    config = DdpRunConfig()
    assert config.with_record_log("logs", 0).max_log_size is None  # 0 => 32 MiB default
    assert config.with_record_log("logs", 0).effective_max_log_size == 32 * 1024 * 1024
    logged = config.with_record_log("logs", 4096)
    assert (logged.record_log_dir, logged.max_log_size) == ("logs", 4096)
    repeated = (
        config.with_scalar_reduction("tokens", Reduction.SUM)
        .with_scalar_reduction("peak_mem", "max")
        .with_scalar_reduction("tokens", "last")
    )  # later wins
    assert repeated.scalar_reduction_map == {"tokens": Reduction.LAST, "peak_mem": Reduction.MAX}
    assert repeated.reduction_for("tokens") is Reduction.LAST
    assert repeated.reduction_for("loss") is Reduction.MEAN
    assert repeated.reduction_for("throughput") is Reduction.SUM
    assert repeated.reduction_for("anything") is Reduction.MEAN
    assert config.with_partition_ratios([3, 1]).elche.partition_ratios == (0.75, 0.25)
    assert config.with_no_divergence_guard().with_no_divergence_guard(False).elche.no_divergence_guard is False
    cadence = config.with_policy("cadence").with_backend("cpu")
    assert cadence.elche.mode is ElCheMode.CpuCadence
    assert cadence.with_policy("async").elche.mode is ElCheMode.CpuAsync


@pytest.mark.parametrize("name", ["checkpoint_every", "reports_per_epoch", "max_log_size"])
def test_zero_means_off(name):
    assert value_of(getattr(DdpRunConfig(), f"with_{name}")(0), name) is None


def test_eval_every_epochs_0_disables_evals_as_in_the_seed():
    """0 stays 0 (no evals at all); unset keeps scoring every epoch."""
    off = DdpRunConfig().with_eval_every_epochs(0)
    assert off.eval_every_epochs == 0 and not off.evals_enabled
    assert DdpRunConfig().evals_enabled and DdpRunConfig().with_eval_every_epochs(3).evals_enabled
    assert DdpRunConfig.from_dict(off.to_dict()).eval_every_epochs == 0  # the ranks' copy says the same


def test_seed_clamps():
    config = DdpRunConfig()
    assert config.with_vram_max_usage(0.1).vram_max_usage == 0.50
    assert config.with_vram_max_usage(1.0).vram_max_usage == 0.99
    assert config.with_ram_max_usage(0.95).ram_max_usage == 0.90
    assert config.with_ram_max_usage(-0.5).ram_max_usage == 0.0
    assert config.with_augment(0).augment == 1
    assert config.with_epoch_splits(0).epoch_splits == 1


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

BAD_VALUES = [
    ("max_grad_norm", -1.0),
    ("max_grad_norm", 0),
    ("max_grad_norm", math.nan),
    ("max_grad_norm", math.inf),
    ("max_grad_norm", "1.0"),
    ("lr_scale_ratio", -0.5),
    ("lr_scale_ratio", math.nan),
    ("heartbeat_timeout_secs", 0),
    ("heartbeat_timeout_secs", -5),
    ("heartbeat_timeout_secs", 2.5),
    ("heartbeat_timeout_secs", True),
    ("snapshot_timeout_secs", 0),
    ("checkpoint_every", -1),
    ("checkpoint_every", 1.0),
    ("augment", -1),
    ("epoch_splits", "2"),
    ("vram_pool", 1),
    ("sample_cache", "yes"),
    ("progressive_dispatch", "auto"),
    ("vram_max_usage", math.nan),
    ("ram_max_usage", "half"),
    ("gpu_ram_share", 0.0),
    ("disk_stage_gb", -1),
    ("disk_stage_dir", ""),
    ("timeline", 42),
    ("save_path", "   "),
    ("transform", "no_colon"),
    ("transform", 3),
    ("max_failure", "-1"),
    ("max_failure", "150%"),
    ("max_failure", "many"),
    ("max_failure", 2.5),
    ("epoch_callback_policy", "slowest"),
    ("epoch_callback_policy", -1),
    ("eval_every_epochs", -2),
    ("max_log_size", -1),
    ("dashboard_theme", "neon"),
    ("scalar_reductions", {"tokens": "median"}),
    ("scalar_reductions", {"loss": "sum"}),  # core key
    ("scalar_reductions", {"": "sum"}),
    ("scalar_reductions", "tokens=sum"),
    ("checkpoint_at_epoch", -1),
    ("checkpoint_at_epoch", 0),  # epochs count from 1, as the console prints them
    ("mode", "nccl-turbo"),
    ("mode", 3),
    ("anchor", 0),
    ("min_anchor", -1),
    ("max_anchor", 0),
    ("overhead_target", 0.005),
    ("overhead_target", 0.6),
    ("max_batch_diff", -1),
    ("max_overshoot", 1.5),
    ("divergence_threshold", 0.0),
    ("no_divergence_guard", "true"),
    ("convergence_guard", "msf"),
    ("partition_ratios", []),
    ("partition_ratios", [0, 0]),
    ("partition_ratios", [0.5, -0.5]),
    ("partition_ratios", [0.5, math.nan]),
    ("partition_ratios", "0.5,0.5"),
    ("easgd_alpha", 0.0),
    ("easgd_alpha", 1.5),
    ("meta_controller", None),
    ("relax_up", 0),
    ("sync_compression", "fp8"),
    ("sync_compression", 8),
    ("sync_fragments", 0),
    ("sync_fragments", 1.5),
]


@pytest.mark.parametrize(("name", "bad"), BAD_VALUES, ids=lambda v: repr(v)[:20])
def test_bad_value_is_rejected_naming_the_field(name, bad):
    with pytest.raises(ConfigError) as from_dict_err:
        DdpRunConfig.from_dict({name: bad})
    assert from_dict_err.value.field == name
    assert str(from_dict_err.value).startswith(f"{name}: ")
    with pytest.raises(ConfigError) as builder_err:  # builders fail at the call, too
        getattr(DdpRunConfig(), f"with_{name}")(bad)
    assert builder_err.value.field == name


def test_error_message_is_readable():
    with pytest.raises(ConfigError, match=r"^max_grad_norm: must be a positive finite number, got -1.0$"):
        DdpRunConfig().with_max_grad_norm(-1.0)
    with pytest.raises(ConfigError, match=r"easgd_alpha: must be a number in \(0, 1\], got 2"):
        DdpRunConfig().with_easgd_alpha(2)


def test_validate_catches_values_smuggled_past_construction():
    config = DdpRunConfig()
    object.__setattr__(config, "max_grad_norm", -3.0)
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert err.value.field == "max_grad_norm"


@pytest.mark.parametrize(
    ("config", "world_size", "field"),
    [
        (DdpRunConfig().with_partition_ratios([0.5, 0.5]), 3, "partition_ratios"),
        (DdpRunConfig().with_epoch_callback_policy("rank:4"), 4, "epoch_callback_policy"),
        (DdpRunConfig().with_min_anchor(20).with_max_anchor(10), None, "min_anchor"),
        (DdpRunConfig().with_anchor(20).with_max_anchor(10), None, "anchor"),
        (DdpRunConfig().with_mode("cpu-cadence").with_max_anchor(5), None, "anchor"),  # preset 10
        (DdpRunConfig().with_mode("nccl-cadence").with_checkpoint_at_epoch(2), None, "checkpoint_at_epoch"),
        (DdpRunConfig().with_resume_weights_only(), None, "resume_weights_only"),  # weights of which bundle?
        (DdpRunConfig().with_mode("cpu-sync").with_deterministic(), None, "deterministic"),  # arrival-order sums
        (DdpRunConfig(), 0, "world_size"),
    ],
)
def test_validate_cross_field_and_world_rules(config, world_size, field):
    with pytest.raises(ConfigError) as err:
        config.validate(world_size)
    assert err.value.field == field


def test_validate_accepts_consistent_world():
    config = DdpRunConfig().with_partition_ratios([2, 1, 1]).with_epoch_callback_policy("rank:2")
    config.validate(world_size=3)
    config.validate()  # world-size rules only apply when the size is known
    ok = DdpRunConfig().with_mode("cpu-cadence").with_checkpoint_at_epoch(1).with_save_path("ckpt")
    ok.validate(world_size=2)
    # builders may be chained in any order; bounds are checked by validate()
    DdpRunConfig().with_min_anchor(2000).with_max_anchor(3000).validate()


# ---------------------------------------------------------------------------
# ElCheMode
# ---------------------------------------------------------------------------

ALL_PARTS = [(policy, backend) for policy in ApplyPolicy for backend in AverageBackend]


@pytest.mark.parametrize("mode", list(ElCheMode))
def test_mode_split_from_parts_round_trip(mode):
    policy, backend = mode.split()
    assert (mode.policy, mode.backend) == (policy, backend)
    assert ElCheMode.from_parts(policy, backend) is mode
    assert ElCheMode.from_parts(policy.value, backend.value) is mode


def test_from_parts_covers_all_six_pairs():
    assert len({ElCheMode.from_parts(p, b) for p, b in ALL_PARTS}) == 6
    assert ElCheMode.from_parts("cadence", "nccl") is ElCheMode.NcclCadence
    assert ElCheMode.from_parts(ApplyPolicy.ASYNC, AverageBackend.CPU) is ElCheMode.CpuAsync


@pytest.mark.parametrize("mode", list(ElCheMode))
def test_mode_parse_spellings(mode):
    snake = mode.value.replace("-", "_")
    for spelling in (mode.name, mode.value, snake, snake.replace("_", ""), mode.name.upper(), mode.value.upper(), f"  {mode.value} "):
        assert ElCheMode.parse(spelling) is mode, spelling
    assert str(mode) == mode.value


def test_mode_parse_error_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        ElCheMode.parse("nccl-turbo")
    assert err.value.field == "mode"
    assert "NcclSync" in str(err.value) and "cpu-async" in str(err.value)
    with pytest.raises(ConfigError) as err:
        ElCheMode.from_parts("eventually", "nccl")
    assert err.value.field == "policy"


def test_reduction_parse():
    assert Reduction.parse("SUM") is Reduction.SUM
    assert [r.value for r in Reduction] == ["mean", "sum", "max", "min", "last"]
    with pytest.raises(ConfigError):
        Reduction.parse("median")


# ---------------------------------------------------------------------------
# MaxFailureThreshold / EpochCallbackPolicy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "limit"), [(10, 2), (11, 3), (5, 1), (32, 7)])
def test_max_failure_percent_golden_limits(world, limit):
    assert MaxFailureThreshold.percent(0.2).limit_for(world) == limit


def test_max_failure_limits_edges():
    assert MaxFailureThreshold.percent(0).limit_for(8) == 0  # any death triggers
    assert MaxFailureThreshold.percent(1).limit_for(8) == 8  # only all-dead
    assert MaxFailureThreshold.absolute(5).limit_for(3) == 5  # may exceed the world
    assert MaxFailureThreshold.absolute(0).limit_for(3) == 0
    # 0.3 * 10 is 3.0000000000000004 in binary; "30% of 10" must still be 3.
    assert MaxFailureThreshold.parse("30%").limit_for(10) == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", MaxFailureThreshold.absolute(3)),
        ("0", MaxFailureThreshold.absolute(0)),
        ("20%", MaxFailureThreshold.percent(0.2)),
        ("12.5%", MaxFailureThreshold.percent(0.125)),
        ("0%", MaxFailureThreshold.percent(0.0)),
        ("100%", MaxFailureThreshold.percent(1.0)),
    ],
)
def test_max_failure_parse_and_str_round_trip(text, expected):
    assert MaxFailureThreshold.parse(text) == expected
    assert str(expected) == text
    assert MaxFailureThreshold.parse(str(expected)) == expected


@pytest.mark.parametrize("p", [0.2, 1 / 3, 0.123456789012345, 1e-20, 0.07])
def test_max_failure_percent_str_round_trips_exactly(p):
    threshold = MaxFailureThreshold.percent(p)
    assert MaxFailureThreshold.parse(str(threshold)).value == p


@pytest.mark.parametrize(
    "bad",
    [
        lambda: MaxFailureThreshold.absolute(-1),
        lambda: MaxFailureThreshold.percent(1.5),
        lambda: MaxFailureThreshold.percent(math.nan),
        lambda: MaxFailureThreshold.absolute(2.0),
        lambda: MaxFailureThreshold.parse("3.5"),
        lambda: MaxFailureThreshold.parse("nan%"),
    ],
)
def test_max_failure_invalid(bad):
    with pytest.raises(ConfigError) as err:
        bad()
    assert err.value.field == "max_failure"


def test_epoch_callback_policy():
    assert EpochCallbackPolicy.parse("fastest") == EpochCallbackPolicy.FASTEST
    assert EpochCallbackPolicy.parse("FASTEST").is_fastest
    assert EpochCallbackPolicy.parse("rank:2") == EpochCallbackPolicy.on_rank(2)
    assert EpochCallbackPolicy.parse("2") == EpochCallbackPolicy.on_rank(2)
    for policy in (EpochCallbackPolicy.FASTEST, EpochCallbackPolicy.on_rank(0), EpochCallbackPolicy.on_rank(7)):
        assert EpochCallbackPolicy.parse(str(policy)) == policy
    assert str(EpochCallbackPolicy.on_rank(3)) == "rank:3"
    EpochCallbackPolicy.on_rank(3).validate(4)
    EpochCallbackPolicy.FASTEST.validate(1)
    with pytest.raises(ConfigError, match="epoch_callback_policy"):
        EpochCallbackPolicy.on_rank(4).validate(4)
    for bad in ("slowest", "rank:", "rank:-1", ""):
        with pytest.raises(ConfigError):
            EpochCallbackPolicy.parse(bad)


# ---------------------------------------------------------------------------
# to_dict / from_dict
# ---------------------------------------------------------------------------


def everything_set() -> DdpRunConfig:
    """A config with every option away from its default."""
    return (
        DdpRunConfig()
        .with_mode("cpu-async")
        .with_anchor(4)
        .with_min_anchor(2)
        .with_max_anchor(64)
        .with_overhead_target(0.1)
        .with_max_batch_diff(3)
        .with_max_overshoot(5)
        .with_divergence_threshold(0.2)
        .with_no_divergence_guard()
        .with_convergence_guard("trend")
        .with_partition_ratios([1, 2])
        .with_easgd_alpha(0.5)
        .with_meta_controller(False)
        .with_relax_up(True)
        .with_checkpoint_every(2)
        .with_snapshot_timeout(9)
        .with_progressive_dispatch(False)
        .with_max_grad_norm(1.0)
        .with_vram_pool(False)
        .with_augment(2)
        .with_epoch_splits(4)
        .with_transform("pkg.aug:flip")
        .with_vram_max_usage(0.7)
        .with_ram_max_usage(0.3)
        .with_gpu_ram_share(1.1)
        .with_sample_cache(False)
        .with_disk_stage(8)
        .with_disk_stage_dir("/scratch")
        .with_timeline("trace.json")
        .with_lr_scale_ratio(0.5)
        .with_save_path("ckpt/run")
        .with_max_failure("20%")
        .with_heartbeat_timeout_secs(60)
        .with_epoch_callback_policy("rank:1")
        .with_eval_every_epochs(3)
        .with_reports_per_epoch(4)
        .with_record_log("logs", 4096)
        .with_dashboard_html("dash.html")
        .with_dashboard_theme("dark")
        .with_scalar_reduction("tokens", "sum")
        .with_scalar_reduction("peak_mem", "max")
        .with_resume_from("ckpt/old")
        .with_resume_weights_only()
        .with_checkpoint_at_epoch(5)
        .with_tensorboard_dir("run/tb")
        .with_csv_log("run/metrics.csv")
        .with_wandb_project("proj")
        .with_log_dir("run/ranks")
        .with_logger("mypkg.logs:make")
        .with_lr_scale_on("average")
        .with_average_weights("equal")
        .with_outer_optimizer("nesterov", lr=0.5, momentum=0.8)
        .with_sync_compression("int8")
        .with_sync_fragments(2)
    )


def test_everything_set_really_sets_everything():
    config, default = everything_set(), DdpRunConfig()
    # deterministic refuses the cpu-* mode set there (test_validate_cross_field_and_world_rules)
    for name in set(SEED_DEFAULTS) - {"deterministic"}:
        assert value_of(config, name) != value_of(default, name), name
    config.validate(world_size=2)


@pytest.mark.parametrize(
    "config", [DdpRunConfig(), everything_set(), DdpRunConfig().with_deterministic()], ids=["defaults", "everything", "deterministic"]
)
def test_to_dict_from_dict_round_trip_is_exact(config):
    plain = config.to_dict()
    assert set(plain) == set(SEED_DEFAULTS)  # flat: ElChe fields at top level
    assert json.loads(json.dumps(plain)) == plain  # JSON-serialisable as is
    assert DdpRunConfig.from_dict(plain) == config
    assert DdpRunConfig.from_dict(json.loads(json.dumps(plain))) == config


def test_to_dict_text_forms():
    plain = everything_set().to_dict()
    assert plain["mode"] == "cpu-async"
    assert plain["max_failure"] == "20%"
    assert plain["epoch_callback_policy"] == "rank:1"
    assert plain["scalar_reductions"] == {"peak_mem": "max", "tokens": "sum"}
    assert plain["partition_ratios"] == [1 / 3, 2 / 3]


def test_from_dict_unknown_key_is_named():
    with pytest.raises(ConfigError) as err:
        DdpRunConfig.from_dict({"max_grad_norm": 1.0, "max_grad_nrom": 2.0})
    assert err.value.field == "max_grad_nrom"
    with pytest.raises(ConfigError):
        DdpRunConfig.from_dict({"elche": {}})  # the flat form only


def test_callable_transform_serialises_as_its_import_name():
    config = DdpRunConfig().with_transform(module_level_transform)
    assert config.to_dict()["transform"] == f"{__name__}:module_level_transform"
    with pytest.raises(ConfigError) as err:
        DdpRunConfig().with_transform(lambda batch, keys: batch).to_dict()
    assert err.value.field == "transform"


# ---------------------------------------------------------------------------
# Feature gating
# ---------------------------------------------------------------------------


def test_available_sets():
    assert {"lr_scale_ratio", "max_grad_norm", "heartbeat_timeout_secs", "mode", "anchor", "progressive_dispatch"} <= AVAILABLE_FIELDS
    assert {"easgd_alpha", "save_path", "checkpoint_every", "resume_from", "timeline", "vram_pool"} <= AVAILABLE_FIELDS
    assert set(ElCheMode) == AVAILABLE_MODES


def test_check_available_passes_for_defaults_and_available_fields():
    DdpRunConfig().check_available()
    config = DdpRunConfig().with_lr_scale_ratio(0.5).with_max_grad_norm(1.0).with_heartbeat_timeout_secs(60).with_mode("nccl-sync")
    config.check_available()
    check_available(config)


def test_every_option_of_the_seed_list_is_available():
    """Every DdpRunConfig / ElCheConfig field works in this version: none is refused as planned."""
    names = {f.name for f in dataclasses.fields(ElCheConfig)} | {f.name for f in dataclasses.fields(DdpRunConfig)} - {"elche"}
    assert names <= AVAILABLE_FIELDS
    everything_set().check_available()


# ---------------------------------------------------------------------------
# CLI and TOML
# ---------------------------------------------------------------------------


def test_every_option_has_a_flag():
    actions = {action.dest: action for action in parser()._actions}
    names = [f.name for f in dataclasses.fields(ElCheConfig)]
    names += [f.name for f in dataclasses.fields(DdpRunConfig) if f.name != "elche"]
    for name in names:
        assert name in actions, f"no flag for {name}"
        assert actions[name].default is argparse.SUPPRESS
        assert actions[name].help
    assert [row["name"] for row in option_table()] == names
    for row in option_table():
        assert row["toml_key"] == row["name"]
        assert set(row) == {"name", "flag", "toml_key", "type", "default", "help"}


def test_flag_names_are_kebab_case_field_names():
    flags = {a.dest: a.option_strings for a in parser()._actions}
    assert flags["heartbeat_timeout_secs"] == ["--heartbeat-timeout-secs"]
    assert flags["vram_pool"] == ["--vram-pool", "--no-vram-pool"]
    assert flags["no_divergence_guard"] == ["--no-divergence-guard"]
    assert flags["scalar_reductions"] == ["--scalar-reduction"]
    assert flags["record_log_dir"] == ["--record-log-dir"]
    assert flags["loggers"] == ["--logger"]
    assert flags["wandb_project"] == ["--wandb-project"]
    assert flags["max_log_size"] == ["--max-log-size"]


def test_loggers_are_repeatable_flags_or_a_toml_array_and_flags_win():
    assert cli("--logger", "a.b:make", "--logger", "c.py:f").loggers == ("a.b:make", "c.py:f")
    assert cli(toml={"loggers": ["a.b:make"], "wandb_project": "proj"}).loggers == ("a.b:make",)
    assert cli("--logger", "x:y", toml={"loggers": ["a.b:make"]}).loggers == ("x:y",)
    with pytest.raises(ConfigError, match="loggers: each must be a 'module:function'"):
        cli("--logger", "nocolon")
    with pytest.raises(ConfigError, match="loggers"):
        cli(toml={"loggers": [3]})


def test_no_flags_gives_the_defaults():
    assert cli() == DdpRunConfig()
    assert vars(parser().parse_args([])) == {}


def test_cli_parse_to_config():
    config = cli(
        "--mode",
        "NcclCadence",
        "--anchor",
        "4",
        "--max-failure",
        "20%",
        "--epoch-callback-policy",
        "rank:1",
        "--partition-ratios",
        "0.7,0.3",
        "--scalar-reduction",
        "tokens=sum",
        "--scalar-reduction",
        "peak=max",
        "--no-vram-pool",
        "--no-divergence-guard",
        "--max-grad-norm",
        "1.5",
        "--heartbeat-timeout-secs",
        "45",
        "--record-log-dir",
        "logs",
        "--max-log-size",
        "2048",
        "--progressive-dispatch",
        "--relax-up",
        "--checkpoint-every",
        "0",
    )
    assert config.elche.mode is ElCheMode.NcclCadence
    assert config.elche.anchor == 4
    assert config.max_failure == MaxFailureThreshold.percent(0.2)
    assert config.epoch_callback_policy == EpochCallbackPolicy.on_rank(1)
    assert config.elche.partition_ratios == (0.7, 0.3)
    assert config.scalar_reduction_map == {"tokens": Reduction.SUM, "peak": Reduction.MAX}
    assert config.vram_pool is False
    assert config.elche.no_divergence_guard is True
    assert config.max_grad_norm == 1.5
    assert config.heartbeat_timeout_secs == 45
    assert (config.record_log_dir, config.max_log_size) == ("logs", 2048)
    assert config.progressive_dispatch is True
    assert config.elche.relax_up is True
    assert config.checkpoint_every is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-failure", "lots"],
        ["--anchor", "ten"],
        ["--mode", "turbo"],
        ["--scalar-reduction", "tokens"],
        ["--partition-ratios", "0.5,x"],
    ],
)
def test_bad_flag_text_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_sync_compression_from_the_flag_and_toml_and_its_bad_value_named(tmp_path):
    assert cli("--sync-compression", "bf16").sync_compression == "bf16"
    path = tmp_path / "run.toml"
    path.write_text('sync_compression = "int8"\n')
    assert resolve_run_config(parser().parse_args([]), load_toml(path)).sync_compression == "int8"
    with pytest.raises(ConfigError, match=r"^sync_compression: must be one of none, bf16, int8, got 'fp8'$"):
        cli("--sync-compression", "fp8")


def test_out_of_range_flag_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        cli("--max-grad-norm", "-1")
    assert err.value.field == "max_grad_norm"


def test_toml_to_config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'mode = "nccl_sync"\nanchor = 3\nmax_grad_norm = 2\nmax_failure = "25%"\n'
        'epoch_callback_policy = "rank:0"\npartition_ratios = [1, 1]\nvram_pool = false\n'
        'scalar_reductions = { tokens = "sum" }\nhosts = ["a", "b"]\n'
    )
    config = cli(toml=load_toml(path), launch_keys=frozenset({"hosts"}))
    assert config.elche.mode is ElCheMode.NcclSync
    assert config.elche.anchor == 3
    assert config.max_grad_norm == 2.0
    assert config.max_failure == MaxFailureThreshold.percent(0.25)
    assert config.epoch_callback_policy == EpochCallbackPolicy.on_rank(0)
    assert config.elche.partition_ratios == (0.5, 0.5)
    assert config.vram_pool is False
    assert config.scalar_reduction_map == {"tokens": Reduction.SUM}


def test_toml_accepts_every_option_in_its_to_dict_form():
    toml = {k: v for k, v in everything_set().to_dict().items() if v is not None}
    assert cli(toml=toml) == everything_set()


def test_flag_beats_toml_beats_default():
    toml = {"max_grad_norm": 1.0, "heartbeat_timeout_secs": 60, "scalar_reductions": {"tokens": "sum", "peak": "max"}}
    config = cli("--max-grad-norm", "0.5", "--scalar-reduction", "tokens=last", toml=toml)
    assert config.max_grad_norm == 0.5  # flag
    assert config.heartbeat_timeout_secs == 60  # TOML
    assert config.lr_scale_ratio == 1.0  # default
    assert config.scalar_reduction_map == {"tokens": Reduction.LAST, "peak": Reduction.MAX}  # merged per key
    assert cli("--vram-pool", toml={"vram_pool": False}).vram_pool is True


def test_unknown_toml_key_is_named():
    with pytest.raises(ConfigError) as err:
        cli(toml={"max_grad_norm": 1.0, "foo": 1})
    assert err.value.field == "foo"
    assert "unknown option 'foo' in config.toml" in str(err.value)
    cli(toml={"foo": 1}, launch_keys=frozenset({"foo"}))  # a launcher key is fine


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("anchor", "3"),
        ("anchor", 3.0),
        ("vram_pool", "false"),
        ("max_grad_norm", "1.0"),
        ("mode", 1),
        ("partition_ratios", [0.5, "x"]),
        ("scalar_reductions", ["tokens=sum"]),
        ("max_failure", 0.2),
        ("epoch_callback_policy", True),
        ("max_grad_norm", -1.0),
    ],
)
def test_toml_values_are_type_checked(key, value):
    with pytest.raises(ConfigError) as err:
        cli(toml={key: value})
    assert err.value.field == key


def test_load_toml_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as err:
        load_toml(missing)
    assert err.value.field == "config" and "missing.toml" in str(err.value)
    broken = tmp_path / "broken.toml"
    broken.write_text("max_grad_norm = = 1\n")
    with pytest.raises(ConfigError) as err:
        load_toml(broken)
    assert err.value.field == "config" and "broken.toml" in str(err.value)


# ---------------------------------------------------------------------------
# Docs
# ---------------------------------------------------------------------------


def load_gen_options():
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "docs" / "gen_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_options_table_is_up_to_date():
    gen = load_gen_options()
    committed = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert gen.render_document(committed) == committed, "run: python docs/gen_options.py"
    for name in SEED_DEFAULTS:
        assert f"| `{name}` |" in committed


def test_docs_toml_example_resolves():
    text = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    config = cli("--max-grad-norm", "0.5", toml=tomllib.loads(block))
    assert config.max_grad_norm == 0.5 and config.heartbeat_timeout_secs == 60
    config.check_available()  # the example only uses available options


@pytest.mark.parametrize("mode", ["nccl-sync", "nccl-cadence", "nccl-async"])
def test_easgd_alpha_is_refused_with_the_collective_modes(mode):
    """The collective overwrites every replica with the average: an alpha there would be ignored."""
    with pytest.raises(ConfigError) as err:
        cli("--mode", mode, "--easgd-alpha", "0.5")
    assert err.value.field == "easgd_alpha" and mode in str(err.value) and "cpu-" in str(err.value)


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-cadence", "cpu-async"])
def test_easgd_alpha_is_taken_by_the_cpu_modes(mode):
    assert cli("--mode", mode, "--easgd-alpha", "0.5").elche.easgd_alpha == 0.5
