"""The worker's side of the zygote (``rank/zygote.py``): start it, ask it for ranks, learn their exits.

``Zygote.start`` launches ``python -m flodl.rank.zygote`` with one end of a
socket pair; it imports torch and flodl's rank modules while the worker waits
for its welcome. ``spawn`` hands it a rank's argv and environment and returns a
``ForkedChild``: a process handle with what the worker uses of asyncio's
(``pid``, ``returncode``, ``wait``, ``send_signal``, ``terminate``, ``kill``),
completed when the zygote reports the child's exit status. It returns None when
the zygote cannot fork (it died, has threads, touched CUDA, or the command is
not one it runs): the worker then starts that rank by exec, as without a zygote.

A zygote that dies with children leaves them to their PDEATHSIG; their handles
complete once each process is gone (``-SIGKILL``: the status died with the zygote).

``Zygote.connect`` uses a zygote server instead (``FLODL_ZYGOTE_SERVER``, started
with ``server_command``): one process for every worker of the host, already
imported, so a worker's ranks start without any import of their own. It hands
the server its stdio and checks the server's user and namespaces first (a
worker in another network namespace, a test's separate host, starts its own).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from ..config.env import PARENT_PID, ZYGOTE_ROOM, ZYGOTE_SERVER, child_environ, environ_copy
from .fork_context import namespaces, startup_settings

log = logging.getLogger(__name__)

#: Bytes of the zygote's command line and environment that a forked rank's own may take in /proc.
TITLE_ROOM, ENVIRON_ROOM = 400, 8192
#: How long a worker waits to reach a zygote server and hear it ready.
CONNECT_TIMEOUT_S = 10.0
#: How long a child the zygote left behind may take to go before its handle completes anyway.
ORPHAN_WAIT_S = 30.0


class ForkedChild:
    """A rank forked by the zygote: asyncio's process handle, as far as the worker uses it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Raises ProcessLookupError once the process has ended (as asyncio's does)."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()


class Zygote:
    """One worker's fork server: a process, the socket to it, and the children it reported."""

    def __init__(
        self, proc: asyncio.subprocess.Process | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int = 0
    ) -> None:
        self.proc = proc  # None: a server's session (``connect``), not a process of ours
        self.pid = proc.pid if proc is not None else pid
        self._reader = reader
        self._writer = writer
        self._replies: collections.deque[asyncio.Future[ForkedChild | None]] = collections.deque()
        self._children: dict[int, ForkedChild] = {}
        self._gone = False
        self._ready = proc is None  # imported and serving: it reads the socket, so end-of-file ends it
        self._said_why = False
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    @classmethod
    async def start(cls, *, devnull_stdin: bool) -> Zygote | None:
        """Launch the zygote (None, logged, if it cannot be). Its stdin is what the ranks get.
        Linux only (it counts its threads and rewrites its command line in /proc); None elsewhere."""
        if not sys.platform.startswith("linux"):
            return None
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "flodl.rank.zygote",
                "--fd",
                str(theirs.fileno()),
                # room where a forked rank writes its command line and environment (host/proctitle.py)
                "--title-room",
                " " * TITLE_ROOM,
                env=child_environ({PARENT_PID: str(os.getpid()), ZYGOTE_ROOM: " " * ENVIRON_ROOM}),
                stdin=asyncio.subprocess.DEVNULL if devnull_stdin else None,
                pass_fds=(theirs.fileno(),),
            )
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except OSError as exc:
            ours.close()
            log.warning("could not start the zygote (%s): ranks start by exec", exc)
            return None
        finally:
            theirs.close()
        return cls(proc, reader, writer)

    @classmethod
    async def connect(cls, path: str, *, devnull_stdin: bool) -> Zygote | None:
        """A session with the zygote server at ``path`` (``FLODL_ZYGOTE_SERVER``): its ranks are
        forked already imported, with this worker's stdio. None (logged) when there is none to
        reach, or it would fork ranks into other namespaces or as another user: the worker then
        starts a zygote of its own."""
        if not sys.platform.startswith("linux"):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        stdin = os.open(os.devnull, os.O_RDONLY) if devnull_stdin else 0
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, path)
                socket.send_fds(sock, [b'{"hello": 1}\n'], [stdin, 1, 2])  # a few bytes into an empty buffer
                reader, writer = await asyncio.open_unix_connection(sock=sock)
                ready = json.loads(await reader.readline() or b"{}")
        except (OSError, TimeoutError, ValueError) as exc:
            sock.close()
            log.info("zygote server %s not usable (%s): this worker starts its own", path, exc or type(exc).__name__)
            return None
        finally:
            if stdin != 0:
                os.close(stdin)
        mismatch = _mismatch(ready)
        if mismatch:
            writer.close()
            log.info("zygote server %s not used (%s): this worker starts its own", path, mismatch)
            return None
        log.info("ranks fork from the zygote server %s (pid %d)", path, ready["ready"])
        return cls(None, reader, writer, pid=int(ready["ready"]))

    async def spawn(self, argv: list[str], env: dict[str, str], stdio: dict[str, str] | None = None) -> ForkedChild | None:
        """Fork a rank running ``argv`` with ``env`` (``stdio``: the named pipes its stdout and stderr
        go to, host/rank_logs.py); None (said once) when the worker must exec it."""
        if self._gone:
            return None
        reply: asyncio.Future[ForkedChild | None] = asyncio.get_running_loop().create_future()
        self._replies.append(reply)
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), **({"stdio": stdio} if stdio else {})}
        self._writer.write(json.dumps(request).encode() + b"\n")
        return await asyncio.shield(reply)  # a cancelled spawn must not shift the replies that follow

    async def _listen(self) -> None:
        """Read the zygote's lines until it closes; then settle what it can no longer answer."""
        try:
            while line := await self._reader.readline():
                self._on_line(json.loads(line))
        except (OSError, ValueError) as exc:
            log.warning("the zygote's socket failed: %s", exc)
        if not self._gone:  # not closed by us: it died
            self._gone = True
            ended = f"exit code {await self.proc.wait()}" if self.proc is not None else "the server closed our session"
            self._why(f"the zygote ended, {ended}", logging.WARNING)
        while self._replies:
            _settle(self._replies.popleft(), None)
        await asyncio.gather(*(self._orphaned(child) for child in self._children.values() if child.returncode is None))

    def _on_line(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self._ready = True
        elif "exit" in msg:
            child = self._children.pop(msg["exit"], None)
            if child is not None:
                child.ended(int(msg["code"]))
        elif "pid" in msg:
            child = self._children[msg["pid"]] = ForkedChild(int(msg["pid"]))
            _settle(self._replies.popleft(), child)
        elif "error" in msg:
            # a decline is a fact of the host (CUDA's driver loaded by torch's imports on a GPU
            # host, a library's thread), not a fault: the exec path is the same rank, only slower to start
            self._why(msg["error"], logging.INFO)
            _settle(self._replies.popleft(), None)

    def _why(self, reason: str, level: int) -> None:
        if not self._said_why:
            self._said_why = True
            log.log(level, "the zygote cannot fork ranks (%s): they start by exec", reason)

    async def _orphaned(self, child: ForkedChild) -> None:
        """A child whose zygote died: it gets its PDEATHSIG; make sure it goes, and say so once gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        await _until_ended(child.pid, ORPHAN_WAIT_S)
        child.ended(-signal.SIGKILL)

    async def close(self, grace_s: float) -> None:
        """Close the socket (a serving zygote exits on end-of-file; one still importing is
        SIGTERMed: a refused worker must not wait for torch's import); SIGKILL it after ``grace_s``."""
        self._gone = True
        self._writer.close()
        if self.proc is None:  # a server's session: it ends ours (and SIGTERMs what we left) on end-of-file
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(self._listener)
            except TimeoutError:
                self._listener.cancel()
            return
        if not self._ready:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
        try:
            async with asyncio.timeout(grace_s):
                await self.proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        await self._listener


def _mismatch(ready: dict[str, Any]) -> str:
    """Why a server's ranks would not be this worker's (another user, other namespaces); "" if they would."""
    if "ready" not in ready:
        return "no ready line"
    if ready.get("uid") != os.getuid():
        return f"it runs as uid {ready.get('uid')}"
    theirs, ours = ready.get("namespaces", {}), namespaces()
    different = [kind for kind in ours if theirs.get(kind) != ours[kind]]
    if different:
        return f"other {', '.join(different)} namespaces"
    theirs, ours = ready.get("startup", {}), startup_settings(environ_copy())
    different = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
    return f"other interpreter settings ({', '.join(different)})" if different else ""


def server_command(path: str, parent: int = 0) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start a zygote server at ``path`` (with the padding
    its forked ranks rewrite their ``/proc`` command line and environment into); ``parent``: a
    process it must not outlive."""
    argv = [sys.executable, "-m", "flodl.rank.zygote", "--serve", path, "--title-room", " " * TITLE_ROOM]
    extra = {ZYGOTE_ROOM: " " * ENVIRON_ROOM, **({PARENT_PID: str(parent)} if parent else {})}
    env = child_environ(extra)
    env.pop(ZYGOTE_SERVER, None)
    return argv, env


def _settle(reply: asyncio.Future[ForkedChild | None], child: ForkedChild | None) -> None:
    if not reply.done():
        reply.set_result(child)


async def _until_ended(pid: int, timeout_s: float) -> None:
    """Until process ``pid`` has ended (its pidfd is readable), at most ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return  # already gone (or no pidfd here)
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    loop.add_reader(fd, ended.set)
    try:
        async with asyncio.timeout(timeout_s):
            await ended.wait()
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)
        os.close(fd)
