"""The run context: what every part of the controller shares and none reassigns.

A part is built with one ``RunContext`` and, by name, only the parts it uses
of its own (core.py wires them); what it reads through the context it never
writes there: each shared service changes only through its own methods
(``RunState.to``, ``ControlPlane.send_rank``, ``Membership.apply``...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..monitor.hub import Monitor
from .checkpoints import Checkpointer
from .hooks import ControllerHooks
from .phase import RunState
from .plane import ControlPlane
from .setting import RunSetting
from .startup import Startup


@dataclass(frozen=True)
class RunContext(RunSetting):
    """The setting, plus the run's phase and failure, the sockets, the monitor, the start-up's
    account, the checkpoints' books and the hooks benches look in through."""

    run: RunState
    plane: ControlPlane
    monitor: Monitor
    startup: Startup
    checkpoints: Checkpointer
    hooks: ControllerHooks

    @classmethod
    def on(
        cls,
        setting: RunSetting,
        *,
        run: RunState,
        plane: ControlPlane,
        monitor: Monitor,
        startup: Startup,
        checkpoints: Checkpointer,
        hooks: ControllerHooks,
    ) -> RunContext:
        """The context of the run ``setting`` describes, with its services."""
        given = {f.name: getattr(setting, f.name) for f in fields(RunSetting)}
        return cls(**given, run=run, plane=plane, monitor=monitor, startup=startup, checkpoints=checkpoints, hooks=hooks)
