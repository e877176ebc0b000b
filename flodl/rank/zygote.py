"""``python -m flodl.rank.zygote``: one per worker; imports torch once and forks the host's ranks.

Every rank process pays seconds of CPU for its imports (torch, ``torch._dynamo``,
which the first optimizer pulls in, and flodl's rank modules); on a small host
running several ranks that is most of a run's start-up, and a restarted rank
pays it again. The worker starts this process as it says hello; it imports
all that once, and then forks a rank per request, already imported.

Protocol (JSON lines on the socket the worker passes as ``--fd``; the worker's
side is ``host/zygote.py``): the zygote says ``{"ready": PID}`` once imported;
each request ``{"argv": [...], "env": {...}, "cwd": DIR}`` is answered in order
by ``{"pid": N}`` or ``{"error": REASON}`` (the worker then starts that rank
by exec); and ``{"exit": PID, "code": C}`` reports a child's end as asyncio
would (negative: killed by that signal).

What keeps a fork the same as a fresh ``python -m flodl.rank`` (or ``python
SCRIPT ARGS``): the zygote starts no thread (it checks ``/proc/self/task``
before each fork and declines with threads), no event loop, no ZeroMQ context,
and never touches CUDA (it declines if the driver got loaded). The child takes
the request's environment, working directory, ``sys.argv`` and ``sys.path``,
default signal handlers, its own command line and environment in ``/proc``
(``host/proctitle.py``), and leaves with
``os._exit`` after the interpreter's exit functions, never returning into this
loop. It dies with the zygote, which dies with its worker (PDEATHSIG at each
link), so a worker killed outright leaves no rank behind.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from ..config import env as flodl_env
from ..host import proctitle
from ..host.proc import die_with_parent


def preimport() -> str:
    """Import what every rank imports; returns why forking is unsafe ("" when it is safe)."""
    flodl_env.zygote_environ()
    import torch

    from .. import script  # noqa: F401 - script mode's flodl.init()
    from . import runner  # noqa: F401 - the rank's modules (link, collective, data, ...)

    # the first optimizer imports torch._dynamo (a second of CPU): build a throwaway one, no RNG used
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    gc.collect()
    gc.freeze()  # what is imported now stays shared with the children (no refcount-driven copies by gc)
    if torch.cuda.is_initialized() or "libcuda.so" in Path("/proc/self/maps").read_text():
        return "CUDA was initialised while importing"
    return ""


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Zygote:
    """The fork server's loop: requests in, forks and exit codes out, on one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()
        self.buf = b""
        self.unsafe = ""

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def serve(self) -> int:
        """Until the worker closes the socket (or dies: the PDEATHSIG ends this process)."""
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)  # a SIGCHLD wakes the select below
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.send({"ready": os.getpid()})
        while True:
            ready, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            self.reap()
            if self.sock.fileno() in ready:
                data = self.sock.recv(65536)
                if not data:
                    return 0  # the worker is done; children still alive get their PDEATHSIG
                self.buf += data
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    self.send(self.spawn(json.loads(line)))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def spawn(self, request: dict[str, Any]) -> dict[str, Any]:
        """Fork one child for ``request``; ``{"pid": N}``, or ``{"error": why}`` when it cannot."""
        try:
            target = entry(request["argv"])
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"not a command the zygote runs: {exc}"}
        if self.unsafe:
            return {"error": self.unsafe}
        if (count := threads()) > 1:
            return {"error": f"the zygote has {count} threads: a fork would lose all but one"}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self.become(request, target)
            except BaseException:  # noqa: BLE001 - before the entry point ran (a cwd gone): say why
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the zygote's loop
        return {"pid": pid}

    def become(self, request: dict[str, Any], target: tuple[str, str, list[str]]) -> int:
        """In the child: turn into the requested rank, run it, and return its exit code."""
        signal.set_wakeup_fd(-1)
        for sig, handler in (
            (signal.SIGCHLD, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
            (signal.SIGTERM, signal.SIG_DFL),
        ):
            signal.signal(sig, handler)
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        os.chdir(request.get("cwd") or os.getcwd())
        flodl_env.replace_environ(request["env"])
        reseed()
        kind, what, args = target
        proctitle.show(request["argv"], request["env"], INHERITED)
        return run(kind, what, args)


def entry(argv: list[str]) -> tuple[str, str, list[str]]:
    """``("module", NAME, ARGS)`` for ``python -m NAME ARGS``, ``("script", PATH, ARGS)`` for
    ``python PATH ARGS``; the interpreter must be this one and take no options of its own.

    Raises:
        ValueError: anything else (the worker then execs it).
    """
    if not argv or argv[0] != sys.executable:
        raise ValueError(f"another interpreter than {sys.executable}")
    if len(argv) >= 3 and argv[1] == "-m":
        return "module", argv[2], argv[3:]
    if len(argv) >= 2 and not argv[1].startswith("-"):
        return "script", argv[1], argv[2:]
    raise ValueError(f"interpreter options {argv[1:2]}")


def reseed() -> None:
    """Fresh RNG state where a fresh interpreter would have one. ``random`` reseeds itself after a
    fork; numpy's global generator, seeded from the OS when the zygote imported numpy, does not.
    torch's default generator starts from the same fixed seed in every fresh process, as here."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def child_sys_path(first: str, pythonpath: str) -> list[str]:
    """``sys.path`` as a fresh interpreter would build it: its first entry (the working directory
    for ``-m``, the script's folder for a script), then ``PYTHONPATH``, then the interpreter's own."""
    entries = [str(Path(p or ".").resolve()) for p in pythonpath.split(os.pathsep)] if pythonpath else []
    return [first, *entries, *INTERPRETER_PATH]


#: The environment the zygote started with (what ``/proc`` shows of it).
INHERITED: dict[str, str] = {}

#: ``sys.path`` past the zygote's first entry and its ``PYTHONPATH`` entries: the interpreter's own.
INTERPRETER_PATH: list[str] = []


def run(kind: str, what: str, args: list[str]) -> int:
    """Run the rank's entry point as ``python -m`` or ``python SCRIPT`` would; its exit code."""
    code = 0
    try:
        if kind == "module":
            sys.argv = [what, *args]  # run_module puts the module's file first
            sys.path[:] = child_sys_path(os.getcwd(), flodl_env.pythonpath())
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [what, *args]
            sys.path[:] = child_sys_path(str(Path(what).resolve().parent), flodl_env.pythonpath())
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - as the interpreter would: sys.excepthook (a script's flodl.init() sets one), exit 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


def exit_code(exc: SystemExit) -> int:
    """What the interpreter exits with for ``sys.exit(arg)``: None 0, an int itself, else printed and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flodl.rank.zygote", description="Fork a worker's ranks (started by flodl.worker).")
    p.add_argument("--fd", type=int, required=True, help="the socket to the worker")
    p.add_argument("--title-room", default="", help="padding: room in the command line for a child's")
    args = p.parse_args(argv)
    die_with_parent(flodl_env.parent_pid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the worker drives the stop
    sock = socket.socket(fileno=args.fd)
    zygote = Zygote(sock)
    pythonpath = flodl_env.pythonpath()
    count = len(pythonpath.split(os.pathsep)) if pythonpath else 0
    INTERPRETER_PATH[:] = sys.path[1 + count :]
    INHERITED.update(flodl_env.environ_copy())
    zygote.unsafe = preimport()
    try:
        return zygote.serve()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the worker went away


if __name__ == "__main__":
    sys.exit(main())
