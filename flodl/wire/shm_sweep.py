"""Sweeping shared-memory segments whose creator is gone, without importing torch.

flodl's segments are named ``flodl-<run>-<pid>.<n>-<role>`` (shm.py). A
controller or rank killed outright cannot unlink its own; the next CPU
averaging round on the host sweeps them (averaging/server.py), and so
does every worker as it exits (worker.py), which is the moment the run's
controller on that host has gone. A segment of a live process, or of another
user's, is left alone.
"""

from __future__ import annotations

import os
import re

from ..config.env import shm_dir

SHM_DIR = shm_dir()


def sweep_stale() -> int:
    """Remove segments whose creator is gone (a controller or rank killed outright); returns how many."""
    removed = 0
    try:
        names = [p for p in SHM_DIR.iterdir() if p.name.startswith("flodl-")]
    except OSError:
        return 0
    for p in names:
        m = re.match(r"flodl-[A-Za-z0-9_.-]*?-(\d+)\.\d+-(probe|update|r\d+)$", p.name)
        if m is None:
            continue
        if _alive(int(m.group(1))):
            continue  # alive (or another user's): leave it
        try:
            p.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    """Is ``pid`` a running process (or one we may not signal: another user's)? A zombie is not:
    a controller killed outright stays one until its parent reaps it, and the worker sweeps in
    that window (found under load: its probe segment was left behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs here: signal 0 is all we can know
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"  # the state follows the command name's ")"
