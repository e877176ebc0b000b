"""A rank's printed output, one whole line at a time and each line named: ``[rank 1] ...``.

Every rank writes to the terminal the run was started from (its worker's
stdout and stderr). Python's own buffering lets two ranks' prints interleave
mid-line (``DISTDIST 0 ...``) and nothing says which rank said what. A rank
therefore wraps ``sys.stdout`` and ``sys.stderr`` at its start: text is held
until a line is whole, then written with the rank's prefix in one ``write``
(one line of a pipe or terminal is written whole when it is under the pipe's
atomic size), as torchrun's ``--tee`` prefixes each rank's lines. What a
process writes below Python (a C library's own prints) goes out as it is.
``FLODL_RANK_PREFIX=off`` leaves the streams alone.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

from ..config.env import rank_prefix

#: Set to "off" to leave a rank's output as its code writes it.


class LinePrefixed(io.TextIOBase):
    """A text stream writing whole lines, each prefixed, to ``raw``; a partial line waits for its end."""

    def __init__(self, raw: TextIO, prefix: str) -> None:
        self.raw = raw
        self.prefix = prefix
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self.raw.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.raw.flush()
        return len(text)

    def flush(self) -> None:
        """Partial lines stay held (a progress line written bit by bit); whole ones are out already."""
        self.raw.flush()

    def close(self) -> None:
        """The process ends: a last partial line goes out, prefixed."""
        if self._partial:
            self.raw.write(f"{self.prefix}{self._partial}\n")
            self._partial = ""
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def isatty(self) -> bool:
        return self.raw.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # the wrapped stream's
        return getattr(self.raw, "encoding", "utf-8")


def prefix_output(rank: int) -> bool:
    """Wrap this process's ``sys.stdout`` and ``sys.stderr`` with ``[rank N] `` (unless turned
    off); True when they are wrapped."""
    if not rank_prefix():
        return False
    prefix = f"[rank {rank}] "
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, LinePrefixed):
            setattr(sys, name, LinePrefixed(stream, prefix))
    import atexit

    atexit.register(_close_all)
    return True


def _close_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, LinePrefixed):
            stream.close()
