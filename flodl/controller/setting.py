"""The run's setting: what one run was launched with and is, before any part of the controller exists.

``RunSetting`` is frozen: none of its fields is ever reassigned (the
``Membership`` it holds changes inside, through its own methods). The control
plane is built from it; every other part gets the wider ``RunContext``
(context.py), which adds the shared services built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import DdpRunConfig
from ..config.deadlines import Deadlines
from ..plan.membership import Membership
from .console import Console
from .launch import LaunchOptions


@dataclass(frozen=True)
class RunSetting:
    """The launch options, the config and its deadlines, the run's identity, its clock, console and roster."""

    launch: LaunchOptions
    config: DdpRunConfig
    deadlines: Deadlines
    run_id: str
    secret: bytes  # signs every frame; handed to the local worker, never printed
    clock: Callable[[], float]
    console: Console
    members: Membership
