"""Real processes under test: a process with its output captured line by line, a ``python -m
flodl.controller`` run that binds a port of its own choosing and says which, and the check that a
run left no process behind."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time

import psutil

from ..conftest import PY, ROOT

#: Controller flags: bind the control socket to a port the kernel picks (0) and log it at INFO
#: (``controller listening on tcp://HOST:PORT``), which ``Proc.control_port`` reads back. Choosing a
#: free port here and passing it would race: on a busy machine another process can take it first.
PICK_PORT = ["--port", "0", "--log-level", "INFO"]
_LISTENING = re.compile(r"controller listening on tcp://\S+:(\d+)")


def reserved_port(host: str = "127.0.0.1") -> int:
    """A port for a process to bind that must be known before it starts (a packet sniffer has to
    watch it from the first frame), held against other processes' picks for a minute.

    Only where ``PICK_PORT`` cannot serve: the port is left in TIME_WAIT (this side's accepted
    connection, closed first), so the kernel hands it to no one else's ``bind(port 0)`` or outgoing
    connection, while ZeroMQ's listener, which sets SO_REUSEADDR, may still bind it (the trick of
    the ephemeral-port-reserve package). Only a process binding that very port can still take it.
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(1)
        addr = listener.getsockname()
        with socket.socket() as client:
            client.connect(addr)
            accepted, _ = listener.accept()
            accepted.close()  # closed first: its end of the connection waits in TIME_WAIT
        return addr[1]


class Proc:
    """A process under test with its output (stdout and stderr) captured line by line."""

    def __init__(self, argv: list[str], env: dict, cwd=ROOT, *, stdin=None) -> None:
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 60) -> None:
        """Wait for a line holding ``needle``. An epoch's line, ``"epoch N/"`` (or ``"epoch N/E"``), is
        waited for as the run having closed epoch N: its own line, or a group's that covers it or a
        later epoch ("epochs 3-5/8": one average closed them, docs/cadence.md)."""
        deadline = time.monotonic() + timeout
        epoch = _EPOCH_NEEDLE.fullmatch(needle)
        while not (any(needle in line for line in self.lines) or (epoch is not None and self.closed(int(epoch.group(1))))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {needle!r}; output:\n{self.output}")
            time.sleep(0.05)

    def closed(self, epoch: int) -> bool:
        """Has the run printed the line of epoch ``epoch`` (1-based), or of a later one?"""
        return any(int(m.group(2) or m.group(1)) >= epoch for line in self.lines if (m := _EPOCH_LINE.search(line)))

    def control_port(self, timeout: float = 60) -> int:
        """The port a controller started with ``PICK_PORT`` bound, once it listens."""
        self.wait_for_line("controller listening on", timeout)
        return next(int(m.group(1)) for line in self.lines if (m := _LISTENING.search(line)))

    def wait(self, timeout: float = 60) -> int:
        """The exit code; a process still running after ``timeout`` is killed and the test fails."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s; output:\n{self.output}") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


#: An epoch's line, or a group's: "epoch 4/8  loss ..." or "epochs 3-5/8  loss ...".
_EPOCH_LINE = re.compile(r"(?:^|\] )epochs? (\d+)(?:-(\d+))?/\d+ ")  # a launcher prefixes "[controller] "
#: A needle that asks for an epoch's line: "epoch 4/" or "epoch 4/8".
_EPOCH_NEEDLE = re.compile(r"epoch (\d+)/\d*")


class Run(Proc):
    """A controller CLI process (``python -m flodl.controller ARGS``)."""

    def __init__(self, args: list[str], env: dict, cwd=ROOT) -> None:
        super().__init__([PY, "-m", "flodl.controller", *args], env, cwd)

    def tree(self) -> list[psutil.Process]:
        """The run's processes: the controller's descendants, and the ranks (and their children)
        that the test process's zygote server forked for this run's workers."""
        try:
            own = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return own + served(own)

    def ranks(self, count: int, timeout: float = 60) -> list[psutil.Process]:
        """Rank processes (python -m flodl.rank) once ``count`` of them exist."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in self.tree() if is_rank(p)]
            if len(found) >= count:
                return sorted(found, key=lambda p: p.pid)
            time.sleep(0.05)
        raise AssertionError(f"only found {len(found)} ranks; output:\n{self.output}")


def served(procs: list[psutil.Process], runs: set[str] | None = None) -> list[psutil.Process]:
    """The processes the zygote server (tests/conftest.py) forked for the runs of ``procs`` (the
    server's children with one of their ``FLODL_RUN_ID``s, or one of ``runs``), and their descendants."""
    from .. import conftest

    if not conftest.ZYGOTE_SERVER_PID:
        return []
    runs = (runs or set()) | {run_id for p in procs if (run_id := _run_id(p))}
    try:
        forked = psutil.Process(conftest.ZYGOTE_SERVER_PID).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in forked:
        if _run_id(child) in runs:
            found.append(child)
            with contextlib.suppress(psutil.Error):
                found.extend(child.children(recursive=True))
    return found


def _run_id(proc: psutil.Process) -> str:
    try:
        return proc.environ().get("FLODL_RUN_ID", "")
    except psutil.Error:
        return ""


def runs_module(proc: psutil.Process, module: str) -> bool:
    try:
        return module in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def is_rank(proc: psutil.Process) -> bool:
    """A ``python -m flodl.rank`` (a forked one shows that line too), not the worker's zygote."""
    return runs_module(proc, "flodl.rank") and not runs_module(proc, "flodl.rank.zygote")


def _running(proc: psutil.Process) -> bool:
    """Exists and is not a zombie (an exited child whose parent has not reaped it yet)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(procs: list[psutil.Process], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    left = [(p.pid, " ".join(p.cmdline())) for p in alive if _running(p)]
    for p in alive:
        p.kill()
    assert not left, f"processes left behind: {left}"


def _of_run(proc: psutil.Process, run_id: str) -> bool:
    return _run_id(proc) == run_id


def assert_run_gone(run_id: str, timeout: float = 10) -> None:
    """No process of the run ``run_id`` (its ``FLODL_RUN_ID``, which a forked rank shows too) is left
    anywhere on this machine: catches what a scan of the tree at one moment could miss (a rank that
    failed before the scan, one reparented to init)."""
    assert_all_gone([p for p in psutil.process_iter() if _of_run(p, run_id)], timeout)
