"""Configuration: the run options, their CLI/TOML faces, the deadlines they imply, and the environment.

* ``run``       ``DdpRunConfig`` / ``ElCheConfig``: what a user may tune (re-exported here)
* ``values``    the small value types of options: modes, policies, reductions, thresholds
* ``checks``    field checkers, and the dataclass field that carries one
* ``options``   the CLI and TOML faces of the options
* ``deadlines`` every timeout derived from ``heartbeat_timeout_secs`` / ``snapshot_timeout_secs``
* ``env``       every ``FLODL_*`` variable and its parser: the one module that reads the process environment

All torch-free: the controller and the worker import them before they know whether torch is needed.
"""

from .run import (
    AVAILABLE_FIELDS,
    AVAILABLE_MODES,
    CORE_REDUCTIONS,
    DEFAULT_HEARTBEAT_TIMEOUT_SECS,
    DEFAULT_MAX_LOG_BYTES,
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
    option_fields,
)

__all__ = [
    "AVAILABLE_FIELDS",
    "AVAILABLE_MODES",
    "CORE_REDUCTIONS",
    "DEFAULT_HEARTBEAT_TIMEOUT_SECS",
    "DEFAULT_MAX_LOG_BYTES",
    "ELCHE_FIELDS",
    "RUN_FIELDS",
    "ApplyPolicy",
    "AverageBackend",
    "DdpRunConfig",
    "ElCheConfig",
    "ElCheMode",
    "EpochCallbackPolicy",
    "MaxFailureThreshold",
    "Reduction",
    "check_available",
    "option_fields",
]
