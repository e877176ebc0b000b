"""A forked process's own command line and environment in ``/proc``, as setproctitle does.

A rank forked by the zygote (``rank/zygote.py``) would show the zygote's
``/proc/PID/cmdline`` and ``/proc/PID/environ``: ``ps`` would list every rank
as ``python -m flodl.rank.zygote``, and whatever reads a rank's ``FLODL_RANK``
there (psutil, an operator) would not find it. The kernel shows the memory
areas the process started with, so the child writes over them in place:

* the command line area, the whole of it: the kernel reads an area that does
  not end in NUL up to its first NUL (setproctitle's convention), so the line
  is the arguments joined by spaces, truncated to the zygote's (which the
  worker pads with ``--title-room``);
* in the environment area only the value of ``FLODL_ZYGOTE_ROOM``, blanks the
  worker gave the zygote last: it becomes the variables the child's environment
  adds to or changes from the zygote's, which readers of ``/proc`` take over
  the earlier ones of the same name. The other variables' bytes stay where
  they are: a library that kept a pointer libc handed it to one still reads it.

Linux only; elsewhere nothing is shown differently.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from ..config.env import ZYGOTE_ROOM


def _areas() -> tuple[int, int, int, int] | None:
    """``arg_start, arg_end, env_start, env_end`` of this process (fields 48-51 of /proc/self/stat)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end, env_start, env_end = (int(f) for f in fields[45:49])
    except (OSError, ValueError):
        return None
    return start, end, env_start, env_end


def show(argv: list[str], env: dict[str, str], inherited: dict[str, str]) -> None:
    """Make ``/proc`` show ``argv`` and ``env`` (``inherited``: the environment this process started with)."""
    areas = _areas()
    if areas is None:
        return
    start, end, env_start, env_end = areas
    room = end - start
    line = " ".join(argv).encode()[: room - 2] + b"\0"
    ctypes.memmove(start, line.ljust(room - 1, b"\0") + b" ", room)  # not NUL-ended: read up to the first NUL
    area = ctypes.string_at(env_start, env_end - env_start)
    key = ZYGOTE_ROOM.encode() + b"="
    at = area.find(b"\0" + key)
    if at < 0:
        return
    value = at + 1 + len(key)
    size = area.index(b"\0", value) - value
    changed = [k for k in sorted(env, key=lambda k: not k.startswith("FLODL_")) if inherited.get(k) != env[k]]  # flodl's first
    block = b"\0"  # ends FLODL_ZYGOTE_ROOM's own (now empty) value
    for name in changed:
        item = f"{name}={env[name]}".encode() + b"\0"
        if len(block) + len(item) <= size:
            block += item
    ctypes.memmove(env_start + value, block.ljust(size, b"\0"), size)
