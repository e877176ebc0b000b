"""``Trainer.builder(task)...run()``: the CLI's run, from Python.

The builder collects the same launch options as ``python -m flodl.controller``
and a ``DdpRunConfig``, then runs a controller in this process (which starts
a local worker and its ranks, as the CLI does) and returns the run summary.
The task is passed as its factory function or a ``module:function`` spec:
ranks import it by name, they never receive pickled code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .config import DdpRunConfig
from .config.env import read_run_credentials
from .controller import Controller, LaunchOptions, check_external_credentials, run_controller
from .controller.console import Console
from .errors import ConfigError
from .taskspec import spec_of

STORE_WAIT_S = 60.0  # a store still opening when a run ends: torch's import on a loaded machine


class TrainerBuilder:
    """Fluent, validated description of one run. Every setter returns the builder."""

    def __init__(self, task: Callable[[], Any] | str) -> None:
        self._launch = LaunchOptions(task=spec_of(task))
        self._config = DdpRunConfig()

    def _set(self, **changes: Any) -> TrainerBuilder:
        self._launch = dataclasses.replace(self._launch, **changes)
        return self

    def epochs(self, n: int) -> TrainerBuilder:
        return self._set(epochs=n)

    def nproc_per_node(self, n: int) -> TrainerBuilder:
        return self._set(nproc_per_node=n)

    def devices(self, devices: str | list[str]) -> TrainerBuilder:
        return self._set(devices=devices if isinstance(devices, str) else ",".join(devices))

    def workers(self, n: int, *, bind: str = "127.0.0.1", port: int = 0) -> TrainerBuilder:
        """Wait for ``n`` external ``flodl.worker`` processes instead of starting one."""
        return self._set(workers=n, bind=bind, port=port)

    def join_file(self, path: str) -> TrainerBuilder:
        """Write the run's join file (0600) for workers started with ``python -m flodl.worker --join-file PATH``."""
        return self._set(join_file=path)

    def seed(self, seed: int) -> TrainerBuilder:
        return self._set(seed=seed)

    def summary_json(self, path: str) -> TrainerBuilder:
        return self._set(summary_json=path)

    def progress(self, enabled: bool) -> TrainerBuilder:
        return self._set(progress=enabled)

    def join_timeout_secs(self, secs: float) -> TrainerBuilder:
        return self._set(join_timeout_secs=secs)

    def eval_timeout_secs(self, secs: float) -> TrainerBuilder:
        """How long an eval, a user callback or a checkpoint write may run before its rank is hung."""
        return self._set(eval_timeout_secs=secs)

    def step_timeout_secs(self, secs: float | None) -> TrainerBuilder:
        """How long one training step may take before its rank is hung (None: derived)."""
        return self._set(step_timeout_secs=secs)

    def max_restarts(self, n: int) -> TrainerBuilder:
        """Healing: restart a dead rank up to ``n`` times (it rejoins at a window boundary)."""
        return self._set(max_restarts=n)

    def config(self, config: DdpRunConfig) -> TrainerBuilder:
        """The run options (``DdpRunConfig().with_...``)."""
        if not isinstance(config, DdpRunConfig):
            raise ConfigError("config", f"expected a DdpRunConfig, got {type(config).__name__}")
        self._config = config
        return self

    def build(self) -> tuple[LaunchOptions, DdpRunConfig]:
        """Validate everything without running.

        Raises:
            ConfigError: an option is invalid or not available in this version.
        """
        self._launch.validate()
        self._config.validate()
        self._config.check_available()
        self._config.to_dict()  # what travels to the ranks: a transform must be importable by name
        return self._launch, self._config

    def run(self) -> dict:
        """Train and return the run summary.

        Raises:
            ConfigError: before anything starts, for bad options.
            RunAborted: the run failed; ``.summary`` holds what was done.
        """
        launch, config = self.build()
        secret, run_id = read_run_credentials()  # as the CLI: a launcher's or the user's, else made here
        check_external_credentials(launch, secret, run_id)
        try:
            return run_controller(Controller(launch, config, secret=secret, run_id=run_id, console=Console.for_progress(launch.progress)))
        finally:
            # the caller's process lives on and may end at once: not while the store thread is
            # inside torch's TCPStore constructor (flodl.controller.exit_process says why)
            from .controller.plane import wait_store_opened

            wait_store_opened(STORE_WAIT_S)


class Trainer:
    """Entry point of the Python API: ``Trainer.builder(task)``."""

    @staticmethod
    def builder(task: Callable[[], Any] | str) -> TrainerBuilder:
        return TrainerBuilder(task)
