"""Loggers that are not flodl's own: Weights & Biases, and any a user plugs in.

A logger is an object with ``log(values, step)`` and, if it holds anything
open, ``close()``. ``values`` are the TensorBoard logger's scalars of one
history row (``loss``, ``eval/<metric>``, ``samples``, ``samples_per_s``,
``wall_s``, ``syncs``, ``scalars/<key>``, ``rank<N>/samples_per_s``; a value
the row has not is left out) and ``step`` the row's last epoch counted from 1.
A user's logger is made by a factory named ``module:function`` (``--logger``,
as a task is named), called once on the controller with the run's description
(``run_id``, ``task``, ``config``); ``--wandb-project NAME`` is one such
logger, built in, that logs through ``wandb`` (an optional package) offline
unless ``WANDB_MODE`` says otherwise.

``check`` runs before anything starts: a missing ``wandb`` package or a factory
that cannot be imported is a bad option (exit 2). Once the run is on, a logger
that raises is said once and dropped; training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from ..config import DdpRunConfig
from ..config.env import wandb_mode
from ..errors import ConfigError, TaskError
from ..taskspec import resolve

log = logging.getLogger("flodl.monitor")

WANDB_MISSING = (
    "needs the wandb package, which is not installed here (the controller's Python): pip install wandb "
    "(or flodl[wandb]), or drop wandb_project"
)


def check(config: DdpRunConfig) -> None:
    """Raises: ConfigError naming ``wandb_project`` or ``loggers`` when a logger cannot be made."""
    if config.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_project", WANDB_MISSING)
    for spec in config.loggers:
        _factory(spec)


def _factory(spec: str) -> Any:
    try:
        factory = resolve(spec)
    except (TaskError, ImportError) as exc:
        # named as a task is (taskspec.py), and said of a logger: its factory is no task
        said = (
            str(exc)
            .replace("task module", "module")
            .replace("task spec", "logger")
            .replace("task file", "file")
            .replace("--task", "--logger")
        )
        raise ConfigError("loggers", f"{spec}: {said}") from None
    if not callable(factory):
        raise ConfigError("loggers", f"{spec} is a {type(factory).__name__}, not a factory to call")
    return factory


class Hook:
    """One logger, named for what the console says of it; a failing one is said once and dropped."""

    def __init__(self, name: str, logger: Any) -> None:
        self.name = name
        self.logger: Any = logger

    def log(self, values: dict[str, float], step: int) -> None:
        if self.logger is None:
            return
        try:
            self.logger.log(values, step)
        except Exception as exc:  # noqa: BLE001 - the user's code: said once, training goes on
            log.warning("logger %s stopped: %s: %s", self.name, type(exc).__name__, exc)
            self.logger = None

    def close(self) -> None:
        closing = getattr(self.logger, "close", None)
        if closing is None:
            return
        try:
            closing()
        except Exception as exc:  # noqa: BLE001 - as in log
            log.warning("logger %s did not close cleanly: %s: %s", self.name, type(exc).__name__, exc)


def open_all(config: DdpRunConfig, run_info: dict[str, Any]) -> list[Hook]:
    """Every logger the options ask for, made (blocking: W&B starts a process of its own); one whose
    factory raises is said and left out."""
    makers: list[tuple[str, Any]] = []
    if config.wandb_project:
        project = config.wandb_project
        makers.append((f"wandb ({project})", lambda info: WandbLogger(project, info)))
    makers += [(spec, _factory(spec)) for spec in config.loggers]
    hooks = []
    for name, make in makers:
        try:
            hooks.append(Hook(name, make(dict(run_info))))
        except Exception as exc:  # noqa: BLE001 - the user's factory (or wandb's start): the run goes on without it
            log.warning("logger %s could not start (%s: %s): no %s log", name, type(exc).__name__, exc, name)
    return hooks


class WandbLogger:
    """The run's rows into a Weights & Biases run (``wandb`` imported here only)."""

    def __init__(self, project: str, run_info: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            name=run_info.get("run_id"),
            config=run_info.get("config"),
            notes=run_info.get("task"),
            mode=wandb_mode(),
        )
        self.dir = getattr(self.run, "dir", None)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
