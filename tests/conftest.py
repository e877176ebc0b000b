"""Shared fixtures: fast configs, loopback controllers, process-tree hygiene."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "tasks"


class FakeClock:
    """A monotonic clock tests move by hand instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def quiet_console():
    from flodl.controller.console import Console

    return Console(out=io.StringIO(), live=False)


def task_spec(name: str, func: str = "task") -> str:
    """Spec of a task file under tests/tasks/."""
    return f"{TASKS / name}:{func}"


@pytest.fixture
def proc_env(tmp_path):
    """Environment for real-process tests: the repo importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PY = sys.executable
