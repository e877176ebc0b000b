"""Run options: what a user may tune about *how* a distributed run trains.

``DdpRunConfig`` is the single, immutable description of a run's options; its
``elche`` member (``ElCheConfig``) holds the coordination strategy (mode,
cadence tuning, guards). Both are frozen dataclasses: builders
(``with_<field>``) return a new config, so a config can be shared between
threads, hashed, and shipped to ranks (``to_dict`` / ``from_dict``) without
anyone changing it underneath.

Each field carries its own checker (checks.py) in its metadata. The checker runs at
construction, so a bad value fails at the builder call (or the ``from_dict``
call) that introduced it, naming the field. Checks that relate fields to each
other or to the world size live in ``validate()``, so builders can be chained
in any order.

This module is pure (no I/O, no environment): the CLI and TOML faces of the
same options live in ``options.py``. Which options this version actually
honours is ``AVAILABLE_FIELDS`` / ``AVAILABLE_MODES``; ``check_available``
refuses anything else, so no option is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .checks import (
    _alpha,
    _callback_policy,
    _check_fields,
    _choice,
    _clamped,
    _count,
    _flag,
    _max_failure,
    _mode,
    _multiplicity,
    _non_negative,
    _normalise_fields,
    _option,
    _positive,
    _ratios,
    _reductions,
    _specs,
    _text,
    _transform,
    _within,
)

# the value types (values.py) and the field checkers (checks.py) have
# their own modules; the package (``__init__.py``) re-exports the public names
from .values import (
    CORE_REDUCTIONS,
    ApplyPolicy,
    AverageBackend,
    ElCheMode,
    EpochCallbackPolicy,
    MaxFailureThreshold,
    Reduction,
    _is_int,
)

# Documented fallbacks for options whose ``None`` means "use the built-in value".
DEFAULT_HEARTBEAT_TIMEOUT_SECS = 30
DEFAULT_MAX_LOG_BYTES = 32 * 1024 * 1024
DEFAULT_DIVERGENCE_THRESHOLD = 0.05
EASGD_DIVERGENCE_THRESHOLD = 0.3  # elastic blending tolerates more drift


def _elche(name: str, value: Any) -> ElCheConfig:
    if not isinstance(value, ElCheConfig):
        raise ConfigError(name, f"must be an ElCheConfig, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------
# ElCheConfig
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ElCheConfig:
    """The DDP coordination strategy: mode, cadence tuning and convergence guards.

    ElChe ("elastic cadence") lets the slowest rank anchor each averaging
    window (``anchor`` batches) while faster ranks do proportionally more.
    ``None`` in a field means "the mode's preset / auto"; the ``effective_*``
    properties give the value the runtime will use.
    """

    # The reference default: the slowest rank anchors a wall-time window.
    mode: ElCheMode = _option(
        ElCheMode.NcclCadence,
        check=_mode,
        kind="mode",
        help="When replicas average (sync, cadence, async) x how (nccl: the collective "
        "backend, NCCL on CUDA or gloo; cpu: through the coordinator).",
    )
    anchor: int | None = _option(
        None,
        check=_count(1),
        kind="int",
        default_text="mode preset (1 Sync, 10 otherwise)",
        help="Initial batches per averaging window on the slowest rank.",
    )
    min_anchor: int | None = _option(
        None, check=_count(1), kind="int", default_text="the initial anchor", help="Floor for the anchor auto-tune."
    )
    max_anchor: int = _option(1000, check=_count(1, optional=False), kind="int", help="Ceiling for the anchor auto-tune.")
    overhead_target: float = _option(
        0.05, check=_within(0.01, 0.5), kind="float", help="Target averaging overhead as a fraction of compute time, in [0.01, 0.5]."
    )
    max_batch_diff: int | None = _option(
        None,
        check=_count(0),
        kind="int",
        default_text="unlimited",
        help="Max batch lead of the fastest over the slowest rank (0 = lockstep); once calibrated, also the most one re-plan "
        "moves a rank's count (ElChe's max_count_step).",
    )
    max_overshoot: int | None = _option(
        None,
        check=_count(0),
        kind="int",
        default_text="auto",
        help="Max batches a rank may stream past the planned sync point "
        "(0 = no cross-epoch streaming). Auto: Cadence and Async let epochs flow into each "
        "other with full windows; N: Async tops an epoch's tail window up with at most N batches.",
    )
    divergence_threshold: float | None = _option(
        None,
        check=_positive(),
        kind="float",
        default_text="0.05 (0.3 with easgd_alpha)",
        help="Replica drift above which the guard stops anchor growth.",
    )
    no_divergence_guard: bool = _option(
        False, check=_flag(), kind="bool", help="Disable the divergence guard; cadence follows overhead alone."
    )
    convergence_guard: str | None = _option(
        None, check=_choice("trend", "none"), kind="guard", default_text="auto", help="Convergence guard override: trend or none."
    )
    partition_ratios: tuple[float, ...] | None = _option(
        None,
        check=_ratios,
        kind="ratios",
        default_text="auto (throughput-based)",
        help="Fixed per-rank data shares, normalised to sum 1; one per rank.",
    )
    # The reference presets 0.5 for CpuAsync; that preset belongs with cpu-async
    # when it lands. Until then None (full overwrite) is the only default.
    easgd_alpha: float | None = _option(
        None,
        check=_alpha,
        kind="float",
        default_text="off (full overwrite)",
        help="Elastic averaging weight, in (0, 1]; cpu-* modes only (refused with nccl-*).",
    )
    meta_controller: bool = _option(
        True, check=_flag(), kind="bool", help="LR-aware meta-controller that shrinks the anchor on LR drops and convergence."
    )
    relax_up: bool = _option(False, check=_flag(), kind="bool", help="Grow the anchor by one on each stable convergence verdict.")

    def __post_init__(self) -> None:
        _normalise_fields(self)

    @property
    def effective_anchor(self) -> int:
        """The initial anchor: the explicit one, else the mode preset."""
        return self.anchor if self.anchor is not None else self.mode.preset_anchor

    @property
    def effective_divergence_threshold(self) -> float:
        if self.divergence_threshold is not None:
            return self.divergence_threshold
        return EASGD_DIVERGENCE_THRESHOLD if self.easgd_alpha is not None else DEFAULT_DIVERGENCE_THRESHOLD

    def validate(self) -> None:
        """Per-field checks plus the anchor bounds relating fields to each other."""
        _check_fields(self)
        if self.min_anchor is not None and self.min_anchor > self.max_anchor:
            raise ConfigError("min_anchor", f"must not exceed max_anchor ({self.max_anchor}), got {self.min_anchor}")
        if self.effective_anchor > self.max_anchor:
            origin = "" if self.anchor is not None else f" (the {self.mode.value} preset)"
            raise ConfigError("anchor", f"{self.effective_anchor}{origin} exceeds max_anchor ({self.max_anchor}); lower it")
        if self.easgd_alpha is not None and self.mode.backend is AverageBackend.NCCL:
            # the collective all-reduces in place: every replica becomes the average, there is
            # no coordinator copy to blend towards, so an alpha would be silently ignored
            raise ConfigError(
                "easgd_alpha",
                f"applies only to the cpu averaging backend (cpu-sync, cpu-cadence, cpu-async); mode {self.mode.value} "
                "averages through the collective, which overwrites every replica. Unset easgd_alpha or choose a cpu-* mode",
            )


# ---------------------------------------------------------------------------
# DdpRunConfig
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DdpRunConfig:
    """Every option of a framework-managed DDP run, with the reference defaults.

    ``elche`` is the coordination strategy; every other field is run scope
    (checkpoints, data plane, failure handling, telemetry). Build one with
    ``DdpRunConfig()`` and ``with_<field>`` builders, from the CLI/TOML via
    ``options.resolve_run_config``, or from a rank's welcome via ``from_dict``.
    Call ``validate(world_size)`` once the world size is known and
    ``check_available()`` before starting a run.
    """

    elche: ElCheConfig = _option(
        default_factory=ElCheConfig, check=_elche, kind="elche", help="Coordination strategy (its fields are options of their own)."
    )
    checkpoint_every: int | None = _option(
        None,
        check=_count(1, zero_is_none=True),
        kind="int",
        default_text="off",
        help="Checkpoint every N epochs: the bundle (with save_path) and the task's checkpoint_fn (0 = off).",
    )
    snapshot_timeout_secs: int = _option(
        5, check=_count(1, optional=False), kind="int", help="Seconds to collect CPU-averaging snapshots (cpu backend only)."
    )
    progressive_dispatch: bool | None = _option(
        None,
        check=_flag(optional=True),
        kind="bool",
        default_text="auto (on for Cadence/Async, off for Sync)",
        help="Stream work in small chunks sized to measured throughput.",
    )
    max_grad_norm: float | None = _option(
        None, check=_positive(), kind="float", default_text="off", help="Clip each rank's gradient L2 norm to this before averaging."
    )
    vram_pool: bool = _option(
        True, check=_flag(), kind="bool", help="Keep samples in leftover VRAM so later epochs skip re-uploading them."
    )
    augment: int = _option(1, check=_multiplicity, kind="int", help="Augmentation multiplicity: each sample appears k times per epoch.")
    epoch_splits: int = _option(1, check=_multiplicity, kind="int", help="Slice one data pass into N epochs.")
    transform: Any = _option(
        None, check=_transform, kind="transform", default_text="none", help="Delivery transform applied on each rank, as 'module:function'."
    )
    vram_max_usage: float = _option(
        0.90, check=_clamped(0.50, 0.99), kind="float", help="VRAM share for each rank's data plane, clamped to [0.50, 0.99]."
    )
    ram_max_usage: float = _option(
        0.50,
        check=_clamped(0.0, 0.90),
        kind="float",
        help="Host-RAM share for each rank's staging tiers, clamped to [0, 0.90] (0 = no retention).",
    )
    gpu_ram_share: float | None = _option(
        None,
        check=_positive(),
        kind="float",
        default_text="what the device reports",
        help="Share of host RAM reserved for an integrated GPU (APU only).",
    )
    sample_cache: bool = _option(True, check=_flag(), kind="bool", help="Retain samples in pinned host RAM.")
    disk_stage_gb: int = _option(0, check=_count(0, optional=False), kind="int", help="Local-disk overflow tier per rank, in GB (0 = off).")
    disk_stage_dir: str | None = _option(
        None, check=_text, kind="path", default_text="system temp dir", help="Directory for the disk-stage pack file."
    )
    timeline: str | None = _option(
        None, check=_text, kind="path", default_text="off", help="Write a Chrome-trace JSON timeline of sync/epoch/anchor events here."
    )
    lr_scale_ratio: float = _option(
        1.0, check=_non_negative, kind="float", help="LR scaling with world size: factor = 1 + (W - 1) * ratio."
    )
    lr_scale_on: str = _option(
        "steps",
        check=_choice("steps", "average"),
        kind="lr_scale_on",
        help="Where lr_scale_ratio's factor applies: every local step (steps), or the averaged update "
        "(average: the outer step's rate times the factor, local steps at the optimizer's own rate).",
    )
    average_weights: str = _option(
        "batches",
        check=_choice("batches", "equal"),
        kind="average_weights",
        help="How replicas weigh in an average: by the batches each trained since the last (batches), "
        "or each that trained once (equal: every rank's update counts whole; docs/cadence.md).",
    )
    outer_optimizer: str = _option(
        "none",
        check=_choice("none", "sgd", "nesterov"),
        kind="outer",
        help="An optimizer on the averaged update (the pseudo-gradient anchor - average), both backends: "
        "none (the plain average), sgd, or nesterov (DiLoCo's).",
    )
    outer_lr: float | None = _option(
        None, check=_positive(), kind="float", default_text="auto (1.0; 0.7 for nesterov)", help="The outer optimizer's rate."
    )
    outer_momentum: float | None = _option(
        None,
        check=lambda name, value: None if value is None else _within(0.0, 0.999)(name, value),
        kind="float",
        default_text="auto (0; 0.9 for nesterov)",
        help="The outer optimizer's momentum.",
    )
    sync_compression: str = _option(
        "none",
        check=_choice("none", "bf16", "int8"),
        kind="sync_compression",
        help="What an average sends of the parameters, both backends: the values in full (none), or the change since "
        "the last average in bfloat16 (bf16) or in int8 with a scale per block of 256 (int8), each rank keeping what "
        "compression left out for its next average (docs/compression.md).",
    )
    sync_fragments: int = _option(
        1,
        check=_count(1, optional=False),
        kind="int",
        help="Streamed fragments, both backends: each average exchanges 1/F of the parameters, the fragments in "
        "rotation (contiguous runs of equal length); the run ends on a full average (docs/fragments.md).",
    )
    save_path: str | None = _option(
        None,
        check=_text,
        kind="path",
        default_text="none",
        help="Checkpoint bundle stem (<stem>.meta.json and the .fdl/.optim it names): "
        "final, periodic and save-on-failure bundles (shared storage on multi-host).",
    )
    max_failure: MaxFailureThreshold | None = _option(
        None,
        check=_max_failure,
        kind="max_failure",
        default_text="none (backend limits only)",
        help="Dead ranks that make the run unrecoverable: a count (3) or a share (20%).",
    )
    heartbeat_timeout_secs: int | None = _option(
        None,
        check=_count(1),
        kind="int",
        default_text=f"{DEFAULT_HEARTBEAT_TIMEOUT_SECS}",
        help="Seconds without a heartbeat before a rank is declared dead.",
    )
    epoch_callback_policy: EpochCallbackPolicy = _option(
        EpochCallbackPolicy.FASTEST,
        check=_callback_policy,
        kind="epoch_callback_policy",
        help="Rank that runs per-epoch callbacks: fastest or rank:N.",
    )
    # 0 disables evals as in the seed; unset keeps flodl's default of scoring every epoch
    eval_every_epochs: int | None = _option(
        None,
        check=_count(0),
        kind="int",
        default_text="each average that closes epochs",
        help="Score every N-th epoch on its own, and the last (no window runs past their end); unset: the average that "
        "closes each epoch, one eval for epochs one average closes; 0: no evals at all, not even the final one.",
    )
    reports_per_epoch: int | None = _option(
        None, check=_count(1, zero_is_none=True), kind="int", default_text="off", help="Sub-epoch monitor reports per epoch (0 = off)."
    )
    record_log_dir: str | None = _option(
        None, check=_text, kind="path", default_text="live only", help="Persist the monitor record stream as JSONL under this directory."
    )
    max_log_size: int | None = _option(
        None,
        check=_count(1, zero_is_none=True),
        kind="int",
        default_text=f"{DEFAULT_MAX_LOG_BYTES} (32 MiB)",
        help="Per-node byte cap of the persisted record stream (0 = default).",
    )
    dashboard_html: str | None = _option(
        None, check=_text, kind="path", default_text="live only", help="Write the self-contained dashboard archive here at teardown."
    )
    dashboard_theme: str | None = _option(
        None,
        check=_choice("light", "dark", "auto"),
        kind="theme",
        default_text="reader's preference",
        help="Theme the saved dashboard opens with: light, dark or auto.",
    )
    tensorboard_dir: str | None = _option(
        None,
        check=_text,
        kind="path",
        default_text="off",
        help="Write a TensorBoard event file here: one point per history row (loss, eval, samples/s, scalars, each rank's rate).",
    )
    csv_log: str | None = _option(
        None, check=_text, kind="path", default_text="off", help="Write the history rows to this CSV file as they close."
    )
    log_dir: str | None = _option(
        None,
        check=_text,
        kind="path",
        default_text="off",
        help="Also write each rank's stdout and stderr to <DIR>/<run id>/rank<N>/stdout.log and stderr.log, on the host "
        "it runs on (its worker writes them), as torchrun's --log-dir; the console still shows every line.",
    )
    wandb_project: str | None = _option(
        None,
        check=_text,
        kind="name",
        default_text="off",
        help="Log the history rows to Weights & Biases under this project (the TensorBoard logger's scalars), offline "
        "unless WANDB_MODE says otherwise; needs the wandb package (pip install 'flodl[wandb]').",
    )
    loggers: tuple[str, ...] = _option(
        (),
        check=_specs,
        kind="loggers",
        default_text="none",
        help="A logger of your own: a 'module:function' factory the controller calls once, whose log(values, step) gets "
        "the TensorBoard logger's scalars at every history row (docs/monitor.md, Your own logger); repeatable.",
    )
    scalar_reductions: tuple[tuple[str, Reduction], ...] = _option(
        (),
        check=_reductions,
        kind="reductions",
        default_text="mean for every key",
        help="How a metric key rolls up across ranks (KEY=mean|sum|max|min|last).",
    )
    resume_from: str | None = _option(
        None,
        check=_text,
        kind="path",
        default_text="fresh run",
        help="Bundle stem to continue: trains exactly what it had not trained, loading its model and optimizer on every rank.",
    )
    resume_weights_only: bool = _option(
        False,
        check=_flag(),
        kind="bool",
        help="Resume the bundle's weights with a fresh optimizer, on purpose (a bundle without its .optim is refused otherwise).",
    )
    checkpoint_at_epoch: int | None = _option(
        None,
        check=_count(1),
        kind="int",
        default_text="none",
        help="One-shot checkpoint (with mid-epoch coverage) once the cohort trains epoch E (counted from 1, as the console "
        "does); needs save_path.",
    )
    deterministic: bool = _option(
        False,
        check=_flag(),
        kind="bool",
        help="Reproducible runs: averaging points and grants fixed by batch counts, never by the clock "
        "(equal per-rank quotas, the fast rank waits), torch's deterministic algorithms, evals that leave "
        "the RNGs as they were; nccl-* modes only.",
    )

    def __post_init__(self) -> None:
        _normalise_fields(self)

    @classmethod
    def new(cls) -> DdpRunConfig:
        """A config with every default (same as ``DdpRunConfig()``)."""
        return cls()

    # -- derived values -------------------------------------------------------

    @property
    def effective_heartbeat_timeout_secs(self) -> int:
        if self.heartbeat_timeout_secs is None:
            return DEFAULT_HEARTBEAT_TIMEOUT_SECS
        return self.heartbeat_timeout_secs

    @property
    def effective_max_log_size(self) -> int:
        return DEFAULT_MAX_LOG_BYTES if self.max_log_size is None else self.max_log_size

    @property
    def effective_progressive_dispatch(self) -> bool:
        if self.progressive_dispatch is not None:
            return self.progressive_dispatch
        return self.elche.mode.policy is not ApplyPolicy.SYNC

    def lr_factor(self, world_size: int) -> float:
        """Learning-rate multiplier for ``world_size`` ranks."""
        return 1.0 + (world_size - 1) * self.lr_scale_ratio

    def step_lr_factor(self, world_size: int) -> float:
        """The factor on every local step: ``lr_factor``, unless it goes on the average instead (``lr_scale_on``)."""
        return self.lr_factor(world_size) if self.lr_scale_on == "steps" else 1.0

    @property
    def evals_enabled(self) -> bool:
        """False when ``eval_every_epochs`` is 0: the task's eval function is never called."""
        return self.eval_every_epochs != 0

    @property
    def scalar_reduction_map(self) -> dict[str, Reduction]:
        return dict(self.scalar_reductions)

    def reduction_for(self, key: str) -> Reduction:
        """Core keys keep their fixed reduction; declared keys theirs; anything else Mean."""
        if key in CORE_REDUCTIONS:
            return CORE_REDUCTIONS[key]
        return self.scalar_reduction_map.get(key, Reduction.MEAN)

    # -- validation -----------------------------------------------------------

    def validate(self, world_size: int | None = None) -> None:
        """Check every field, the rules relating fields, and (if given) the world size."""
        _check_fields(self)
        self.elche.validate()
        # every mode dispatches windows from a coverage ledger here, Sync included
        if self.checkpoint_at_epoch is not None and self.save_path is None:
            raise ConfigError("checkpoint_at_epoch", "needs save_path (the bundle stem to write)")
        if self.resume_weights_only and self.resume_from is None:
            raise ConfigError("resume_weights_only", "needs resume_from (the bundle whose weights to load)")
        if self.deterministic and self.elche.mode.backend is AverageBackend.CPU:
            # the coordinator folds snapshot slices in the order they arrive, scaling each at once
            # only when every weight is already known: the rounding, so the result, follows the clock
            raise ConfigError(
                "deterministic",
                f"cannot be combined with mode {self.elche.mode.value}: the cpu averaging backend sums the "
                "replicas in the order they arrive, so its rounding follows timing; use nccl-sync, nccl-cadence or nccl-async",
            )
        if world_size is not None:
            self._validate_world(world_size)

    def _validate_world(self, world_size: int) -> None:
        if not _is_int(world_size) or world_size < 1:
            raise ConfigError("world_size", f"must be an integer >= 1, got {world_size!r}")
        ratios = self.elche.partition_ratios
        if ratios is not None and len(ratios) != world_size:
            raise ConfigError("partition_ratios", f"has {len(ratios)} entries but the world has {world_size} ranks")
        self.epoch_callback_policy.validate(world_size)

    def check_available(self) -> None:
        """Refuse options this version does not implement (see ``check_available``)."""
        check_available(self)

    # -- serialisation ----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON/msgpack-ready dict: run fields and ElChe fields side by side."""
        return {name: _to_plain(name, value) for name, value in _flat_items(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DdpRunConfig:
        """Inverse of ``to_dict``; also accepts a subset (missing keys keep defaults)."""
        run: dict[str, Any] = {}
        elche: dict[str, Any] = {}
        for key, value in values.items():
            if key in ELCHE_FIELDS:
                elche[key] = value
            elif key in RUN_FIELDS:
                run[key] = value
            else:
                raise ConfigError(str(key), f"unknown option {key!r}")
        return cls(elche=ElCheConfig(**elche), **run)

    # -- builders: each returns a new, checked config ---------------------------

    def _replace(self, **changes: Any) -> DdpRunConfig:
        return dataclasses.replace(self, **changes)

    def _replace_elche(self, **changes: Any) -> DdpRunConfig:
        return dataclasses.replace(self, elche=dataclasses.replace(self.elche, **changes))

    def with_elche(self, elche: ElCheConfig) -> DdpRunConfig:
        return self._replace(elche=elche)

    def with_checkpoint_every(self, n: int) -> DdpRunConfig:
        """Checkpoint every ``n`` global epochs; 0 turns it off."""
        return self._replace(checkpoint_every=n)

    def with_snapshot_timeout_secs(self, secs: int) -> DdpRunConfig:
        return self._replace(snapshot_timeout_secs=secs)

    def with_snapshot_timeout(self, secs: int) -> DdpRunConfig:
        """Seed spelling of ``with_snapshot_timeout_secs``."""
        return self.with_snapshot_timeout_secs(secs)

    def with_progressive_dispatch(self, enabled: bool | None) -> DdpRunConfig:
        """True/False forces it; None restores auto."""
        return self._replace(progressive_dispatch=enabled)

    def with_max_grad_norm(self, max_norm: float | None) -> DdpRunConfig:
        return self._replace(max_grad_norm=max_norm)

    def with_vram_pool(self, enabled: bool) -> DdpRunConfig:
        return self._replace(vram_pool=enabled)

    def with_augment(self, k: int) -> DdpRunConfig:
        return self._replace(augment=k)

    def with_epoch_splits(self, n: int) -> DdpRunConfig:
        return self._replace(epoch_splits=n)

    def with_transform(self, transform: str | Callable[..., Any] | None) -> DdpRunConfig:
        return self._replace(transform=transform)

    def with_vram_max_usage(self, max_usage: float) -> DdpRunConfig:
        return self._replace(vram_max_usage=max_usage)

    def with_ram_max_usage(self, max_usage: float) -> DdpRunConfig:
        return self._replace(ram_max_usage=max_usage)

    def with_gpu_ram_share(self, share: float | None) -> DdpRunConfig:
        return self._replace(gpu_ram_share=share)

    def with_sample_cache(self, enabled: bool) -> DdpRunConfig:
        return self._replace(sample_cache=enabled)

    def with_disk_stage_gb(self, gb: int) -> DdpRunConfig:
        return self._replace(disk_stage_gb=gb)

    def with_disk_stage(self, gb: int) -> DdpRunConfig:
        """Seed spelling of ``with_disk_stage_gb``."""
        return self.with_disk_stage_gb(gb)

    def with_disk_stage_dir(self, directory: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(disk_stage_dir=directory)

    def with_timeline(self, path: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(timeline=path)

    def with_lr_scale_ratio(self, ratio: float) -> DdpRunConfig:
        return self._replace(lr_scale_ratio=ratio)

    def with_save_path(self, stem: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(save_path=stem)

    def with_max_failure(self, threshold: MaxFailureThreshold | str | int | None) -> DdpRunConfig:
        """A ``MaxFailureThreshold``, or its text (``"3"``, ``"20%"``), or a rank count."""
        return self._replace(max_failure=threshold)

    def with_heartbeat_timeout_secs(self, secs: int | None) -> DdpRunConfig:
        return self._replace(heartbeat_timeout_secs=secs)

    def with_epoch_callback_policy(self, policy: EpochCallbackPolicy | str) -> DdpRunConfig:
        return self._replace(epoch_callback_policy=policy)

    def with_eval_every_epochs(self, n: int) -> DdpRunConfig:
        return self._replace(eval_every_epochs=n)

    def with_reports_per_epoch(self, n: int) -> DdpRunConfig:
        return self._replace(reports_per_epoch=n)

    def with_lr_scale_on(self, where: str) -> DdpRunConfig:
        return self._replace(lr_scale_on=where)

    def with_average_weights(self, weights: str) -> DdpRunConfig:
        return self._replace(average_weights=weights)

    def with_outer_optimizer(self, kind: str, *, lr: float | None = None, momentum: float | None = None) -> DdpRunConfig:
        return self._replace(outer_optimizer=kind, outer_lr=lr, outer_momentum=momentum)

    def with_outer_lr(self, lr: float | None) -> DdpRunConfig:
        return self._replace(outer_lr=lr)

    def with_outer_momentum(self, momentum: float | None) -> DdpRunConfig:
        return self._replace(outer_momentum=momentum)

    def with_sync_compression(self, kind: str) -> DdpRunConfig:
        """``none``, ``bf16`` or ``int8``: how an average's parameters travel (docs/compression.md)."""
        return self._replace(sync_compression=kind)

    def with_sync_fragments(self, fragments: int) -> DdpRunConfig:
        """How many fragments an average rotates through (1: the whole model each time; docs/fragments.md)."""
        return self._replace(sync_fragments=fragments)

    def with_tensorboard_dir(self, directory: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(tensorboard_dir=directory)

    def with_csv_log(self, path: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(csv_log=path)

    def with_log_dir(self, directory: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(log_dir=directory)

    def with_wandb_project(self, project: str | None) -> DdpRunConfig:
        return self._replace(wandb_project=project)

    def with_loggers(self, specs: Iterable[str]) -> DdpRunConfig:
        """Replace every logger of your own at once (``"module:function"`` factories)."""
        return self._replace(loggers=tuple(specs))

    def with_logger(self, spec: str) -> DdpRunConfig:
        """Add a logger of your own: a ``"module:function"`` factory (docs/monitor.md)."""
        return self._replace(loggers=(*self.loggers, spec))

    def with_record_log_dir(self, directory: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(record_log_dir=directory)

    def with_max_log_size(self, max_bytes: int | None) -> DdpRunConfig:
        return self._replace(max_log_size=max_bytes)

    def with_record_log(self, directory: str | os.PathLike[str], max_bytes: int = 0) -> DdpRunConfig:
        """Persist the record stream under ``directory``; ``max_bytes`` 0 means the 32 MiB default."""
        return self._replace(record_log_dir=directory, max_log_size=max_bytes)

    def with_dashboard_html(self, path: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(dashboard_html=path)

    def with_dashboard_theme(self, theme: str | None) -> DdpRunConfig:
        return self._replace(dashboard_theme=theme)

    def with_scalar_reductions(self, reductions: Mapping[str, Reduction | str]) -> DdpRunConfig:
        """Replace every declaration at once."""
        return self._replace(scalar_reductions=reductions)

    def with_scalar_reduction(self, key: str, reduction: Reduction | str) -> DdpRunConfig:
        """Declare one key's roll-up; a later declaration for the same key wins."""
        return self._replace(scalar_reductions=(*self.scalar_reductions, (key, reduction)))

    def with_resume_from(self, stem: str | os.PathLike[str] | None) -> DdpRunConfig:
        return self._replace(resume_from=stem)

    def with_resume_weights_only(self, enabled: bool = True) -> DdpRunConfig:
        """Load only the bundle's weights on resume; the optimizer starts fresh (its .optim may be missing)."""
        return self._replace(resume_weights_only=enabled)

    def with_checkpoint_at_epoch(self, epoch: int | None) -> DdpRunConfig:
        return self._replace(checkpoint_at_epoch=epoch)

    def with_deterministic(self, enabled: bool = True) -> DdpRunConfig:
        """Bit-reproducible runs (same seed, same machine): batch-count schedule, seeded RNGs."""
        return self._replace(deterministic=enabled)

    # ElChe passthroughs.

    def with_mode(self, mode: ElCheMode | str) -> DdpRunConfig:
        return self._replace_elche(mode=mode)

    def with_policy(self, policy: ApplyPolicy | str) -> DdpRunConfig:
        """Change when averaging fires, keeping the backend."""
        return self.with_mode(ElCheMode.from_parts(policy, self.elche.mode.backend))

    def with_backend(self, backend: AverageBackend | str) -> DdpRunConfig:
        """Change how averaging is done, keeping the policy."""
        return self.with_mode(ElCheMode.from_parts(self.elche.mode.policy, backend))

    def with_anchor(self, anchor: int | None) -> DdpRunConfig:
        return self._replace_elche(anchor=anchor)

    def with_min_anchor(self, min_anchor: int | None) -> DdpRunConfig:
        return self._replace_elche(min_anchor=min_anchor)

    def with_max_anchor(self, max_anchor: int) -> DdpRunConfig:
        return self._replace_elche(max_anchor=max_anchor)

    def with_overhead_target(self, target: float) -> DdpRunConfig:
        return self._replace_elche(overhead_target=target)

    def with_max_batch_diff(self, max_diff: int | None) -> DdpRunConfig:
        return self._replace_elche(max_batch_diff=max_diff)

    def with_max_overshoot(self, max_overshoot: int | None) -> DdpRunConfig:
        return self._replace_elche(max_overshoot=max_overshoot)

    def with_divergence_threshold(self, threshold: float | None) -> DdpRunConfig:
        return self._replace_elche(divergence_threshold=threshold)

    def with_no_divergence_guard(self, disabled: bool = True) -> DdpRunConfig:
        """Disable the divergence guard (pass False to re-enable it)."""
        return self._replace_elche(no_divergence_guard=disabled)

    def with_convergence_guard(self, guard: str | None) -> DdpRunConfig:
        return self._replace_elche(convergence_guard=guard)

    def with_partition_ratios(self, ratios: Iterable[float] | None) -> DdpRunConfig:
        """Fixed per-rank shares (normalised to sum 1); disables auto rebalancing."""
        return self._replace_elche(partition_ratios=ratios)

    def with_easgd_alpha(self, alpha: float | None) -> DdpRunConfig:
        return self._replace_elche(easgd_alpha=alpha)

    def with_meta_controller(self, enabled: bool) -> DdpRunConfig:
        return self._replace_elche(meta_controller=enabled)

    def with_relax_up(self, enabled: bool) -> DdpRunConfig:
        return self._replace_elche(relax_up=enabled)

    def with_elche_relax_up(self, enabled: bool) -> DdpRunConfig:
        """Seed spelling of ``with_relax_up``."""
        return self.with_relax_up(enabled)


# ---------------------------------------------------------------------------
# Flattened view (one name per option) and serialisation helpers
# ---------------------------------------------------------------------------

#: ElCheConfig's fields: options of their own, flattened next to the run fields.
ELCHE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ElCheConfig))
#: DdpRunConfig's own option fields (everything but ``elche``).
RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DdpRunConfig) if f.name != "elche")

# A flat namespace only works while the two sets of names stay disjoint.
assert not set(ELCHE_FIELDS) & set(RUN_FIELDS), "ElCheConfig and DdpRunConfig field names collide"


def option_fields() -> tuple[dataclasses.Field, ...]:
    """Every option's dataclass field, ElChe's in place of ``elche`` (the flat order)."""
    result: list[dataclasses.Field] = []
    for f in dataclasses.fields(DdpRunConfig):
        result.extend(dataclasses.fields(ElCheConfig) if f.name == "elche" else [f])
    return tuple(result)


def _flat_items(config: DdpRunConfig) -> Iterator[tuple[str, Any]]:
    for f in option_fields():
        owner = config.elche if f.name in ELCHE_FIELDS else config
        yield f.name, getattr(owner, f.name)


def _to_plain(name: str, value: Any) -> Any:
    """One option value as JSON-ready data (the text form for structured values)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (enum.Enum, MaxFailureThreshold, EpochCallbackPolicy)):
        return str(value)
    if name == "scalar_reductions":
        return {key: reduction.value for key, reduction in value}
    if name in ("partition_ratios", "loggers"):
        return list(value)
    if name == "transform" and callable(value):
        return _callable_spec(value)
    return value


def _callable_spec(function: Callable[..., Any]) -> str:
    """``module:qualname`` of an importable callable (ranks import it by that name)."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ConfigError(
            "transform",
            f"{function!r} cannot be imported by name (lambda or local function); "
            "define it at module level or pass a 'module:function' string",
        )
    return f"{module}:{qualname}"


# ---------------------------------------------------------------------------
# Feature gating
# ---------------------------------------------------------------------------

#: Options this version honours. Any other option must stay at its default.
#: Widen this as features land (and docs/options.md follows via gen_options.py).
AVAILABLE_FIELDS: frozenset[str] = frozenset(
    {
        "lr_scale_ratio",
        "max_grad_norm",
        "heartbeat_timeout_secs",
        "mode",
        # cadence (ElChe), dispatch and the convergence guard
        "anchor",
        "min_anchor",
        "max_anchor",
        "overhead_target",
        "max_batch_diff",
        "max_overshoot",
        "relax_up",
        "partition_ratios",
        "divergence_threshold",
        "no_divergence_guard",
        "convergence_guard",
        "meta_controller",
        "progressive_dispatch",
        "epoch_callback_policy",
        # the CPU averaging backend
        "snapshot_timeout_secs",
        "easgd_alpha",
        # elastic membership, checkpoints and resume
        "max_failure",
        "save_path",
        "checkpoint_every",
        "checkpoint_at_epoch",
        "resume_from",
        "resume_weights_only",
        # the monitor: record stream, dashboard, timeline
        "eval_every_epochs",
        "reports_per_epoch",
        "record_log_dir",
        "max_log_size",
        "dashboard_html",
        "dashboard_theme",
        "scalar_reductions",
        "timeline",
        "tensorboard_dir",
        "csv_log",
        "wandb_project",
        "loggers",
        "log_dir",
        # combining replicas (docs/cadence.md, "Combining replicas")
        "lr_scale_on",
        "average_weights",
        "outer_optimizer",
        "outer_lr",
        "outer_momentum",
        # compressed syncs (docs/compression.md)
        "sync_compression",
        "sync_fragments",
        # the data plane
        "augment",
        "epoch_splits",
        "transform",
        "vram_pool",
        "vram_max_usage",
        "ram_max_usage",
        "gpu_ram_share",
        "sample_cache",
        "disk_stage_gb",
        "disk_stage_dir",
        # reproducible runs
        "deterministic",
    }
)
#: Modes this version can run: all six.
AVAILABLE_MODES: frozenset[ElCheMode] = frozenset(ElCheMode)

NOT_AVAILABLE = "is not available yet in this version of flodl (planned); leave it at its default"


def check_available(config: DdpRunConfig) -> None:
    """Raise ConfigError for the first option set to something this version cannot do."""
    defaults = dict(_flat_items(DdpRunConfig()))
    for name, value in _flat_items(config):
        if name == "mode" and value not in AVAILABLE_MODES:
            available = ", ".join(sorted(mode.value for mode in AVAILABLE_MODES))
            raise ConfigError("mode", f"{value.value} is not available yet in this version of flodl (planned); available: {available}")
        if name not in AVAILABLE_FIELDS and value != defaults[name]:
            raise ConfigError(name, NOT_AVAILABLE)
