"""Per-rank log files (``--log-dir``): each rank's stdout and stderr, as its worker's console shows them, in files.

With ``log_dir`` set, a worker gives each rank it starts a named pipe (a FIFO in
a folder of its own) for its stdout and one for its stderr, instead of its own
terminal, and copies every line that comes through to two places: where the
rank's output went before (the worker's stdout or stderr: the console is
unchanged) and ``<log_dir>/<run id>/rank<N>/stdout.log`` or ``stderr.log`` on
this host. Everything the process writes is caught, Python's prints and a C
library's alike, from its first byte to its last (a crash's traceback too). The
files hold the lines without the console's ``[rank N] `` (the file names the
rank). A rank number is never reused (a restarted rank is a new number), so a
file is one process's output; torchrun's ``attempt_K`` level has no use here.

The rank opens its end by path: the zygote's child does so before the rank's
first line (``rank/zygote.py``), an exec'd rank gets it as its descriptors.
The worker holds a write end of its own until the rank is reaped, so the copy
sees the end of the output only once the rank and anything it started that
still holds the pipe have gone. A folder that cannot be made is said once; the
rank then writes to the console as without ``--log-dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
#: How long a worker that stops waits for its ranks' last lines (a rank's child may hold a pipe open).
DRAIN_S = 3.0


def rank_dir(log_dir: str | os.PathLike[str], run_id: str, rank: int) -> Path:
    """Where rank ``rank``'s files go: ``<log_dir>/<run id>/rank<N>``."""
    return Path(log_dir) / run_id / f"rank{rank}"


class _Copy(asyncio.Protocol):
    """One stream of one rank: whole lines to the console (as written) and to the file (unnamed)."""

    def __init__(self, console: BinaryIO, file: BinaryIO, prefix: bytes) -> None:
        self.console, self.file, self.prefix = console, file, prefix
        self.partial = b""
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if lines:
            self._write(lines)

    def _write(self, lines: list[bytes]) -> None:
        text = b"".join(line + b"\n" for line in lines)
        with contextlib.suppress(OSError):  # a console gone (its terminal closed): the file still gets it
            self.console.write(text)  # one write: a line is not cut by another rank's
            self.console.flush()
        with contextlib.suppress(OSError):
            self.file.write(b"".join(line.removeprefix(self.prefix) + b"\n" for line in lines))
            self.file.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.partial:  # a last line without its newline
            self._write([self.partial])
            self.partial = b""
        with contextlib.suppress(OSError):
            self.file.close()
        if not self.ended.done():
            self.ended.set_result(None)


def _same(copy: _Copy) -> _Copy:
    return copy


class RankLog:
    """One rank's two pipes, their copies, and the worker's own write ends (``keep``)."""

    def __init__(
        self, rank: int, fifos: dict[str, str], keep: dict[str, int], copies: list[_Copy], transports: list[asyncio.ReadTransport]
    ) -> None:
        self.rank = rank
        self.fifos = fifos  # stream -> the FIFO's path (the zygote's child opens it)
        self.keep = keep  # stream -> the worker's write end (an exec'd rank's descriptor too)
        self.copies = copies
        self.transports = transports

    def release(self) -> None:
        """The rank was reaped: let go of the worker's write ends, so the copies see the output end."""
        for fd in self.keep.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.keep = {}

    async def drained(self, timeout_s: float) -> None:
        """Until both copies ended (at most ``timeout_s``; then they are cut)."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(c.ended for c in self.copies))
        except TimeoutError:
            log.warning("rank %d: its output pipe is still held open (a process it started?): its log stops here", self.rank)
        for transport in self.transports:
            transport.close()


class RankLogs:
    """A worker's rank logs under ``<log_dir>/<run id>``; ``open`` one per rank it starts."""

    def __init__(self, log_dir: str, run_id: str) -> None:
        self.log_dir, self.run_id = log_dir, run_id
        self.fifo_dir = tempfile.mkdtemp(prefix="flodl-ranklog-")
        self.logs: dict[int, RankLog] = {}
        self._said = False

    async def open(self, rank: int) -> RankLog | None:
        """Rank ``rank``'s pipes and files, their copies running; None (said once) when its folder
        cannot be made: the rank then writes to the console alone."""
        folder = rank_dir(self.log_dir, self.run_id, rank)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            files = {s: open(folder / f"{s}.log", "ab") for s in STREAMS}
        except OSError as exc:
            if not self._said:
                self._said = True
                log.warning("cannot write rank logs under %s (%s): ranks write to the console only", self.log_dir, exc)
            return None
        loop = asyncio.get_running_loop()
        fifos: dict[str, str] = {}
        keep: dict[str, int] = {}
        copies: list[_Copy] = []
        transports: list[asyncio.ReadTransport] = []
        for stream, console in (("stdout", sys.stdout.buffer), ("stderr", sys.stderr.buffer)):
            fifo = fifos[stream] = os.path.join(self.fifo_dir, f"rank{rank}.{stream}")
            os.mkfifo(fifo, 0o600)
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opens at once, with no writer yet
            keep[stream] = os.open(fifo, os.O_WRONLY)  # a reader is there: no wait
            copy = _Copy(console, files[stream], f"[rank {rank}] ".encode())
            transport, _ = await loop.connect_read_pipe(functools.partial(_same, copy), os.fdopen(reader, "rb", buffering=0))
            copies.append(copy)
            transports.append(transport)
        self.logs[rank] = entry = RankLog(rank, fifos, keep, copies, transports)
        return entry

    def reaped(self, rank: int) -> None:
        """Rank ``rank``'s process has ended."""
        entry = self.logs.get(rank)
        if entry is not None:
            entry.release()

    async def close(self, timeout_s: float = DRAIN_S) -> None:
        """Every rank's last lines in (at most ``timeout_s``), the pipes gone."""
        for entry in self.logs.values():
            entry.release()
        await asyncio.gather(*(entry.drained(timeout_s) for entry in self.logs.values()))
        for entry in self.logs.values():
            for fifo in entry.fifos.values():
                with contextlib.suppress(OSError):
                    os.unlink(fifo)
        with contextlib.suppress(OSError):
            os.rmdir(self.fifo_dir)
