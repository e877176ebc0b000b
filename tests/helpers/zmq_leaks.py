"""The ZeroMQ leak check: a test must close every socket and terminate every context it created.

Like pyzmq's own test suite, which tracks the contexts and sockets each test makes, but without
asking tests to create them through a helper: ``install()`` hooks pyzmq's ``Context`` once per
session, so every socket made through ``ctx.socket(...)`` (flodl's code, a test's, a monitor
socket) and every ``zmq.Context()`` is recorded in the ``Tracker`` current at that moment.
``tests/conftest.py`` runs each test inside ``tracking()`` and fails the test with ``leaks()``.

What is not a leak:

* the global context (``zmq.Context.instance()``): created lazily by whichever test first needs
  it, it lives as long as the process, by design; only its sockets count;
* pyzmq's own garbage collector (``zmq.utils.garbage.gc``): the first zero-copy send starts it,
  with a context, a PULL socket in its thread and a PUSH socket for the sending thread, all meant
  to live as long as the process;
* shadow contexts (a second handle on a context that someone else owns and terminates);
* anything made before the test started (a session fixture's sockets) or in another process.

The tracker holds strong references, so whether a dropped socket counts does not depend on
when the garbage collector runs: a socket left to ``__del__`` is a leak, every time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from zmq.utils import garbage

_HERE = __file__
_ZMQ_DIR = zmq.__file__.rsplit("/", 1)[0]


def _caller() -> str:
    """``file:line`` of the first frame outside pyzmq and this module: where a socket was made."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_ZMQ_DIR) or frame.f_code.co_filename == _HERE):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class Tracker:
    """The sockets and contexts created while it is current (see ``start``)."""

    def __init__(self) -> None:
        self.sockets: list[tuple[zmq.Socket[Any], str]] = []
        self.contexts: list[tuple[zmq.Context[Any], str]] = []
        self._lock = threading.Lock()

    def add_socket(self, sock: zmq.Socket[Any]) -> None:
        with self._lock:
            self.sockets.append((sock, _caller()))

    def add_context(self, ctx: zmq.Context[Any]) -> None:
        with self._lock:
            self.contexts.append((ctx, _caller()))

    def open_sockets(self) -> list[tuple[zmq.Socket[Any], str]]:
        with self._lock:
            found = list(self.sockets)
        return [(s, where) for s, where in found if not s.closed and not _is_pyzmq_gc(s.context)]

    def live_contexts(self) -> list[tuple[zmq.Context[Any], str]]:
        with self._lock:
            found = list(self.contexts)
        return [(c, where) for c, where in found if not (c.closed or _is_global(c) or _is_pyzmq_gc(c) or getattr(c, "_shadow", False))]

    def leaks(self, grace_s: float = 2.0) -> list[str]:
        """What is still open, one line each; empty if nothing leaked.

        A socket another thread is closing right now (a background loop the test already told to
        stop) gets ``grace_s`` to do so: only what is still open after that counts.
        """
        deadline = time.monotonic() + grace_s
        while (self.open_sockets() or self.live_contexts()) and time.monotonic() < deadline:
            time.sleep(0.02)
        lines = [f"socket {_type_name(s)} left open, created at {where}" for s, where in self.open_sockets()]
        lines += [f"context left un-terminated, created at {where}" for _, where in self.live_contexts()]
        return lines


def _is_global(ctx: zmq.Context[Any]) -> bool:
    return any(getattr(cls, "_instance", None) is ctx for cls in type(ctx).__mro__)


def _is_pyzmq_gc(ctx: zmq.Context[Any]) -> bool:
    return ctx is not None and ctx is garbage.gc._context


def _type_name(sock: zmq.Socket[Any]) -> str:
    try:
        return zmq.SocketType(sock.type).name
    except (ValueError, zmq.ZMQError):
        return "?"


_current: Tracker | None = None
_installed = False


def install() -> None:
    """Hook pyzmq's ``Context`` (once): new sockets and contexts go to the current tracker."""
    global _installed
    if _installed:
        return
    _installed = True
    context_class = zmq.sugar.context.Context
    add_socket, init = context_class._add_socket, context_class.__init__

    def _add_socket(self: Any, socket: Any) -> Any:
        tracker = _current
        if tracker is not None:
            tracker.add_socket(socket)
        return add_socket(self, socket)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        tracker = _current
        if tracker is not None:
            tracker.add_context(self)

    context_class._add_socket = _add_socket
    context_class.__init__ = __init__


@contextmanager
def tracking() -> Iterator[Tracker]:
    """A new tracker, current inside the ``with`` (the one it replaced is current again after)."""
    global _current
    install()
    outer, _current = _current, Tracker()
    try:
        yield _current
    finally:
        _current = outer
