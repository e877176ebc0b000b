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

A server (``--serve PATH``, named to workers by ``FLODL_ZYGOTE_SERVER``) is
the same loop for every worker of the host that connects: it imports once for
many runs (a test suite, a sweep of short runs). A worker hands it its stdin,
stdout and stderr with its hello (``SCM_RIGHTS``), so its ranks' output goes
where a rank of its own zygote's would; the server answers ``{"ready": PID,
"namespaces": ..., "uid": ...}`` and the worker uses it only from the same
namespaces and user (host/zygote.py). A session's end (its worker finished
or was killed) SIGTERMs the children it still has, as their PDEATHSIG would.

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
import ctypes
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ..config import env as flodl_env
from ..host import proctitle
from ..host.fork_context import namespaces, startup_settings
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
    if torch.cuda.is_initialized() or cuda_driver_initialised():
        return "CUDA was initialised while importing"
    return ""


#: what the CUDA driver answers a call that needs ``cuInit`` before it was made
CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether this process has started the CUDA driver (``cuInit``): a fork after it is unsafe.

    Having the driver library mapped is not that: a CUDA build of torch loads ``libcuda.so`` while
    importing (``torch._preload_cuda_deps``) without starting it, and the zygote refused every GPU
    host when it took the mapping for a start. ``cuCtxGetCurrent`` answers
    ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` ran, and starts nothing itself."""
    if "libcuda.so" not in Path("/proc/self/maps").read_text():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # mapped already: this only looks it up
    except OSError:
        return True  # mapped under a name we cannot open: assume the worst, fork nothing
    context = ctypes.c_void_p()
    return int(driver.cuCtxGetCurrent(ctypes.byref(context))) != CUDA_ERROR_NOT_INITIALIZED


#: How long a server lets a closed session's children go on SIGTERM before it SIGKILLs them.
ORPHAN_KILL_S = 10.0


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Session:
    """One worker's connection: its socket, the bytes not read as a line yet, the stdio it handed
    over (a server's sessions: the forked ranks write where the worker's output goes), its children."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.stdio: list[int] = []  # stdin, stdout, stderr for its children (empty: the zygote's own)
        self.children: set[int] = set()

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def take_stdio(self, fds: list[int]) -> None:
        for fd in self.stdio:
            os.close(fd)
        self.stdio = list(fds[:3])
        for fd in fds[3:]:  # more than asked for: not ours to keep
            os.close(fd)

    def close(self) -> None:
        self.take_stdio([])
        self.sock.close()


class Zygote:
    """The fork server's loop: requests in, forks and exit codes out.

    A worker's own zygote (``--fd``) serves the one socket it was started with and
    exits when that closes: its children then get their PDEATHSIG. A server
    (``--serve PATH``) accepts any number of workers of this host on a Unix
    socket, each a session with its own stdio and children; a session that
    closes (its worker finished or was killed) has its children SIGTERMed, as
    the PDEATHSIG would, and SIGKILLed ``ORPHAN_KILL_S`` later if still there.
    """

    def __init__(self, sock: socket.socket | None = None, listener: socket.socket | None = None) -> None:
        self.listener = listener
        self.sessions: dict[int, Session] = {}  # socket fd -> session
        self.owner: dict[int, Session] = {}  # child pid -> the session that asked for it
        self.doomed: dict[int, float] = {}  # child pid -> when it is SIGKILLed (its session closed)
        self.wake_r, self.wake_w = os.pipe()
        self.unsafe = ""
        self.first: Session | None = None
        if sock is not None:
            self.first = self.sessions[sock.fileno()] = Session(sock)

    def serve(self) -> int:
        """Until the worker closes the socket (a server: until SIGTERM or its parent's end)."""
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)  # a SIGCHLD wakes the select below
        signal.signal(signal.SIGCHLD, lambda *_: None)
        if self.first is not None:
            self.first.send({"ready": os.getpid()})
        while True:
            watched = [self.wake_r, *self.sessions]
            if self.listener is not None:
                watched.append(self.listener.fileno())
            ready, _, _ = select.select(watched, [], [], self._until_kill())
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            self.reap()
            self._kill_overdue()
            if self.listener is not None and self.listener.fileno() in ready:
                self._accept()
            for fd in ready:
                session = self.sessions.get(fd)
                if session is not None and not self._read(session):
                    self._drop(session)
                    if self.listener is None:
                        return 0  # the worker is done; children still alive get their PDEATHSIG

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        session = self.sessions[sock.fileno()] = Session(sock)
        try:  # what the worker checks: its ranks would live in this zygote's namespaces and settings, not its own
            session.send({"ready": os.getpid(), "namespaces": namespaces(), "uid": os.getuid(), "startup": startup_settings(INHERITED)})
        except OSError:
            self._drop(session)

    def _read(self, session: Session) -> bool:
        """Take what ``session`` sent (and the stdio it passed); False at its end."""
        try:
            data, fds, _, _ = socket.recv_fds(session.sock, 65536, 3)
        except OSError:
            return False
        if fds:
            session.take_stdio(fds)
        if not data:
            return False
        session.buf += data
        while b"\n" in session.buf:
            line, session.buf = session.buf.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError:
                return False  # not a worker speaking this protocol: the session ends
            if "argv" not in request:
                continue  # a server's hello: it carried the stdio
            reply = self.spawn(request, session)
            try:
                session.send(reply)
            except OSError:
                return False
        return True

    def _drop(self, session: Session) -> None:
        """A session ended: its socket and stdio closed; a server SIGTERMs its children still alive."""
        self.sessions.pop(session.sock.fileno(), None)
        session.close()
        if self.listener is None:
            return
        deadline = time.monotonic() + ORPHAN_KILL_S
        for pid in session.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            self.doomed[pid] = deadline

    def _until_kill(self) -> float | None:
        return max(0.0, min(self.doomed.values()) - time.monotonic()) if self.doomed else None

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for pid, deadline in list(self.doomed.items()):
            if deadline <= now:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                del self.doomed[pid]

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.doomed.pop(pid, None)
            session = self.owner.pop(pid, None)
            if session is None:
                continue
            session.children.discard(pid)
            if session.sock.fileno() >= 0:
                with contextlib.suppress(OSError):
                    session.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def kill_all(self) -> None:
        """A server stopping: every child it forked goes with it."""
        for pid in list(self.owner):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def spawn(self, request: dict[str, Any], session: Session) -> dict[str, Any]:
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
                code = self.become(request, target, session)
            except BaseException:  # noqa: BLE001 - before the entry point ran (a cwd gone): say why
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the zygote's loop
        self.owner[pid] = session
        session.children.add(pid)
        return {"pid": pid}

    def become(self, request: dict[str, Any], target: tuple[str, str, list[str]], session: Session) -> int:
        """In the child: turn into the requested rank, run it, and return its exit code."""
        signal.set_wakeup_fd(-1)
        for sig, handler in (
            (signal.SIGCHLD, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
            (signal.SIGTERM, signal.SIG_DFL),
        ):
            signal.signal(sig, handler)
        stdio, session.stdio = session.stdio, []
        for other in self.sessions.values():  # no other worker's socket or output held open by this child
            other.close()
        if self.listener is not None:
            self.listener.close()
        for target_fd, fd in zip((0, 1, 2), stdio, strict=False):
            os.dup2(fd, target_fd)
        for fd in stdio:
            if fd > 2:
                os.close(fd)
        piped = pipe_stdio(request.get("stdio") or {})
        if stdio or piped:
            reopen_stdio(bool(request["env"].get("PYTHONUNBUFFERED")))
        os.close(self.wake_r)
        os.close(self.wake_w)
        os.chdir(request.get("cwd") or os.getcwd())
        flodl_env.replace_environ(request["env"])
        reseed()
        kind, what, args = target
        proctitle.show(request["argv"], request["env"], INHERITED)
        return run(kind, what, args)


def pipe_stdio(paths: dict[str, str]) -> bool:
    """The rank's stdout and stderr onto the named pipes its worker made (``--log-dir``:
    host/rank_logs.py), before its first line; False when it has none."""
    for target_fd, name in ((1, "stdout"), (2, "stderr")):
        if paths.get(name):
            fd = os.open(paths[name], os.O_WRONLY)  # the worker holds the read end: no wait
            os.dup2(fd, target_fd)
            os.close(fd)
    return bool(paths)


def reopen_stdio(unbuffered: bool) -> None:
    """``sys.stdout``/``sys.stderr`` anew on the worker's descriptors, buffered as a fresh interpreter
    with the request's ``PYTHONUNBUFFERED`` would buffer them (the server's were set up for its own)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        line = fd == 2 or raw.isatty()  # stderr is always line-buffered; stdout when it is a terminal
        binary = raw if unbuffered else io.BufferedWriter(raw)
        new = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, line_buffering=line, write_through=unbuffered)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


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
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--fd", type=int, help="the socket to the worker")
    how.add_argument("--serve", metavar="PATH", help="serve the workers of this host on a Unix socket at PATH (FLODL_ZYGOTE_SERVER)")
    p.add_argument("--title-room", default="", help="padding: room in the command line for a child's")
    args = p.parse_args(argv)
    if args.fd is not None or flodl_env.parent_pid():  # a server started by hand outlives its shell
        die_with_parent(flodl_env.parent_pid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the worker drives the stop
    pythonpath = flodl_env.pythonpath()
    count = len(pythonpath.split(os.pathsep)) if pythonpath else 0
    INTERPRETER_PATH[:] = sys.path[1 + count :]
    INHERITED.update(flodl_env.environ_copy())
    if args.fd is not None:
        zygote = Zygote(socket.socket(fileno=args.fd))
        zygote.unsafe = preimport()
        try:
            return zygote.serve()
        except (BrokenPipeError, ConnectionResetError):
            return 0  # the worker went away
    return serve_at(args.serve)


def serve_at(path: str) -> int:
    """``--serve``: import, then listen at ``path`` (only this user may connect) until SIGTERM."""
    unsafe = preimport()
    if unsafe:
        print(f"flodl zygote: cannot serve: {unsafe}", file=sys.stderr)
        return 1
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    zygote = Zygote(listener=listener)

    def stop(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"ready {os.getpid()} {path}", flush=True)  # whoever started it waits for this line
    try:
        return zygote.serve()
    finally:
        zygote.kill_all()
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
