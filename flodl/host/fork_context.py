"""What a process forked by a zygote takes from the zygote rather than from its worker.

A forked rank lives in the zygote's network, mount and PID namespaces and keeps
what its interpreter read once at start (``PYTHON*`` settings, the thread pools'
sizes). The zygote server reports both with its ready line (rank/zygote.py), and a
worker uses a server only where they are its own (host/zygote.py). Here, so both
sides read them alike and the worker's side imports nothing of the rank's.
"""

from __future__ import annotations

import contextlib
import os

#: Environment a fresh interpreter (and torch's import) reads once, at its start: a server's children
#: have the server's, so a worker whose own differ does not use it. ``PYTHONUNBUFFERED`` is followed
#: (rank/zygote.py ``reopen_stdio``); ``PYTHONPATH`` is the child's own (``child_sys_path``).
STARTUP_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def startup_settings(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that take effect at an interpreter's start (``STARTUP_NAMES``, ``PYTHON*``)."""
    return {k: v for k, v in env.items() if k in STARTUP_NAMES or (k.startswith("PYTHON") and k not in ("PYTHONPATH", "PYTHONUNBUFFERED"))}


def namespaces() -> dict[str, str]:
    """This process's network, mount and PID namespaces (a forked rank lives in them)."""
    found = {}
    for kind in ("net", "mnt", "pid"):
        with contextlib.suppress(OSError):
            found[kind] = os.readlink(f"/proc/self/ns/{kind}")
    return found
