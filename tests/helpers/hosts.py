"""Runs across network-namespace hosts (tests/netns.py, bench/netns.py): the launcher on them, and what must be gone after."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from ..conftest import PY
from ..netns import Cluster
from .procs import Proc


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def launch_on_hosts(
    cluster: Cluster,
    tmp_path: Path,
    proc_env: dict,
    *,
    step_sleep: str,
    epochs: int,
    extra: list[str] = (),
    launcher_extra: list[str] = (),
    hold: Path | None = None,
    **hostfile,
) -> Proc:
    """``python -m flodl.launcher`` on the cluster's hosts; ``extra`` goes to the controller, ``launcher_extra`` to the launcher,
    ``hostfile`` to ``Cluster.hostfile`` (``devices``, ``hosts``: only the first that many, ...).

    ``hold``: until that file exists, every step sleeps 0.2 s (the namespaces share this file
    system), so the run outlasts whatever the test does meanwhile, however loaded the machine."""
    env = {"FLODL_TEST_STEP_SLEEP": step_sleep}
    if hold is not None:
        env |= {"FLODL_TEST_HOLD_FILE": str(hold), "FLODL_TEST_HOLD_SLEEP": "0.2"}
    path = cluster.hostfile(tmp_path / "hosts.toml", env=env, **hostfile)
    args = [
        "--hostfile",
        str(path),
        "--advertise",
        cluster.gateway,
        "--grace-secs",
        "3",
        *launcher_extra,
        "--",
        "--task",
        "tests/tasks/tiny.py:task",
        "--epochs",
        str(epochs),
        "--dashboard-port",
        "-1",
        "--summary-json",
        str(tmp_path / "summary.json"),
        *extra,
    ]
    return Proc([PY, "-m", "flodl.launcher", *args], proc_env)


def assert_no_flodl_left(cluster: Cluster, timeout: float) -> None:
    left = lambda: [p for h in cluster.hosts for p in h.flodl_procs()]  # noqa: E731
    try:
        wait_until(lambda: not left(), timeout, "flodl processes in the namespaces to exit")
    except AssertionError:
        raise AssertionError(f"left behind: {left()}") from None


def parent_pid(p: psutil.Process) -> int:
    try:
        return p.ppid()
    except psutil.Error:
        return -1
