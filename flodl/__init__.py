"""flodl: train one PyTorch model across unlike GPUs and hosts that may fail.

Every rank runs its own training loop (Local SGD); an asyncio controller
decides when replicas are averaged, which samples each rank trains, and what
happens when a rank dies. Start with ``Task`` and ``Trainer.builder``, or
``python -m flodl.controller --task file.py:task --nproc-per-node 2``; or keep
your own loop: ``flodl.init()`` in a script run with ``--script train.py``.
"""

__version__ = "0.1.0"

from .config import (
    ApplyPolicy,
    AverageBackend,
    DdpRunConfig,
    ElCheConfig,
    ElCheMode,
    EpochCallbackPolicy,
    MaxFailureThreshold,
    Reduction,
)
from .errors import ConfigError, FlodlError, RunAborted, TaskError

#: Names imported on first use: they bring torch, which the worker and the
#: controller's CLI do not need to start (about a second per process).
_LAZY = {"Shards": ".shards", "Task": ".task", "Trainer": ".trainer", "record_scalar": ".scalars", "init": ".script"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flodl' has no attribute {name!r}")


__all__ = [
    "ApplyPolicy",
    "AverageBackend",
    "ConfigError",
    "DdpRunConfig",
    "ElCheConfig",
    "ElCheMode",
    "EpochCallbackPolicy",
    "FlodlError",
    "MaxFailureThreshold",
    "Reduction",
    "RunAborted",
    "Shards",
    "Task",
    "TaskError",
    "Trainer",
    "__version__",
    "init",
    "record_scalar",
]
