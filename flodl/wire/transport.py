"""ZeroMQ sockets on the asyncio loop: the control plane's plumbing.

``AsyncSocket`` puts one plain (non-asyncio) ZeroMQ socket on the running
event loop through its file descriptor and drains it with non-blocking reads.
That is several times cheaper per message than awaiting ``zmq.asyncio``
futures, which is what lets one controller ingest tens of thousands of
frames per second on a small machine. ``ControlEndpoint`` adds the codec:
every frame in is authenticated and decoded (bad ones dropped and counted by
its ``FrameReader``), every frame out is signed and numbered.

Sends never block: a peer that is gone or too slow (its high-water mark
reached) costs a counted drop, never a stalled event loop. A message handler
that raises costs that message, never the socket: it is logged and counted
(``HandlerErrors``), and the run summary and the tests make it seen.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from . import curve
from .codec import DEFAULT_MAX_FRAME, Envelope, FrameReader, FrameWriter, route_name
from .messages import Ping, Pong

log = logging.getLogger(__name__)

# pyzmq's compiled socket methods, called without the Python layer pyzmq puts over them
# (``send_multipart`` type-checks and loops in Python, ``getsockopt(EVENTS)`` returns an enum
# that ``& zmq.POLLIN`` combines in Python): on a round trip every one of these calls runs
# right after a wake-up, where that layer costs more than the call itself.
_send: Callable[..., Any]
_recv: Callable[..., Any]
_get: Callable[..., Any]
try:
    from zmq.backend import Socket as _Compiled

    _send, _recv, _get = _Compiled.send, _Compiled.recv, _Compiled.get
except (ImportError, AttributeError):  # another backend: the public methods
    _send, _recv, _get = zmq.Socket.send, zmq.Socket.recv, zmq.Socket.get
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)


#: Messages handled per loop callback before yielding to other tasks.
DRAIN_BATCH = 256
#: ZeroMQ-level pings on the controller's ROUTER: a dead connection is closed after the timeout,
#: freeing its routing id for the peer's reconnect (application heartbeats judge liveness).
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000
#: ``ZMQ_MAXMSGSIZE`` of control sockets: a little over the codec's frame limit. libzmq reads a
#: message part's size before its bytes and closes a connection announcing more, so a stranger's
#: 200 MB frame costs the receiver nothing (the codec would only drop it once it was all in memory).
CONTROL_MAX_MSG_BYTES = DEFAULT_MAX_FRAME + 4096


class HandlerErrors:
    """Every exception a message handler raised in this process (``AsyncSocket`` survives them).

    A socket goes on after a handler bug (one message lost is better than a
    dead control plane), so the bug must show elsewhere: each one is logged
    with its traceback here; a controller puts its count in the run summary
    (``handler_errors``) and, under ``FLODL_STRICT`` (the test suite sets it
    for every process), fails the run at its end; a worker fails its exit;
    and tests/conftest.py fails any test during which this tally grew.
    """

    KEEP = 20  # the first few are enough to find the bug; the count says how many more

    def __init__(self) -> None:
        self.count = 0
        self.first: list[str] = []  # "where: Type: message" of the first KEEP

    def record(self, where: str, exc: BaseException) -> None:
        self.count += 1
        if len(self.first) < self.KEEP:
            self.first.append(f"{where}: {type(exc).__name__}: {exc}")


#: This process's tally (one per process: sockets come and go, a bug in any of them counts).
HANDLER_ERRORS = HandlerErrors()


class AsyncSocket:
    """One ZeroMQ socket driven by the event loop (edge-triggered FD, drained fully).

    ZeroMQ's FD signals *changes*, not levels: after every receive or send the
    socket may hold messages without the FD firing again, so every operation
    re-checks ``EVENTS`` and schedules a drain when input is pending.
    """

    def __init__(self, sock: zmq.Socket[Any], on_parts: Callable[[list[bytes]], None], *, name: str = "") -> None:
        self.sock = sock
        self.on_parts = on_parts
        self.name = name or getattr(on_parts, "__qualname__", "socket")  # names the socket in handler errors
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.send_drops: Counter[str] = Counter()
        self.handler_errors = 0
        self.paused = False  # a consumer that cannot keep up stops the reads (back-pressure)
        self._drain_scheduled = False
        self._draining = False  # inside _drain, which reads on until EAGAIN: a send need not re-check EVENTS

    def start(self) -> None:
        """Start draining on the running loop (call from inside it)."""
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self._fd(), self._on_fd)
        self._schedule_drain()

    def _fd(self) -> int:
        fd = self.sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)  # an int option
        return fd

    def _on_fd(self) -> None:
        # drain right here rather than one loop iteration later: it is the
        # latency of every round trip through the controller
        if not self._drain_scheduled:
            self._drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self.closed:
            self._drain_scheduled = True
            assert self.loop is not None  # start() came first
            self.loop.call_soon(self._drain)

    def read_pending(self) -> None:
        """Hand every message the socket holds to the handler now, not at the loop's next turn
        (an actor that must see what arrived before an event it is about to act on)."""
        self._drain()

    def resume(self) -> None:
        """Read again after ``paused`` (what arrived meanwhile waits in the socket)."""
        self.paused = False
        self._schedule_drain()

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.closed:
            return
        sock, on_parts = self.sock, self.on_parts
        self._draining = True
        try:
            for _ in range(DRAIN_BATCH):
                if self.paused:
                    return
                try:  # recv_multipart, without its Python layer
                    parts = [_recv(sock, _NOBLOCK)]
                    while _get(sock, _RCVMORE):
                        parts.append(_recv(sock, _NOBLOCK))
                except zmq.Again:
                    return
                except zmq.ZMQError:
                    if self.closed:
                        return
                    raise
                try:
                    on_parts(parts)
                except Exception as exc:  # a handler bug must not stop the socket: logged, counted, surfaced (HandlerErrors)
                    self.handler_errors += 1
                    HANDLER_ERRORS.record(self.name, exc)
                    log.exception("%s: handler failed on an incoming message", self.name)
                if self.closed:
                    return
        finally:
            self._draining = False
        self._schedule_drain()  # more may be queued: come back after other tasks ran

    def send(self, parts: list[Any], *, copy: bool = True) -> bool:
        """Queue a multipart message without blocking; False if it was dropped.

        ``copy=False`` sends buffers without copying them (bulk tensors): the
        caller must leave them untouched until ZeroMQ is done with them.
        """
        if self.closed:
            self.send_drops["closed"] += 1
            return False
        sock = self.sock
        try:
            if copy and len(parts) == 2 and type(parts[0]) is bytes and type(parts[1]) is bytes:  # a ROUTER's frame
                _send(sock, parts[0], _MORE)
                _send(sock, parts[1], _NOBLOCK)
            elif copy and len(parts) == 1 and type(parts[0]) is bytes:  # a DEALER's
                _send(sock, parts[0], _NOBLOCK)
            else:
                sock.send_multipart(parts, zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            self.send_drops["full"] += 1
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: ROUTER_MANDATORY and the peer is gone
            self.send_drops[exc.strerror] += 1
            return False
        finally:
            # a send may take the FD's edge for input that came meanwhile: look, unless a drain is
            # running (a handler's reply), which reads on until EAGAIN anyway
            if not self._draining and not self.closed and _get(sock, _EVENTS) & _POLLIN:
                self._schedule_drain()

    def close(self) -> None:
        """Stop draining and close with linger 0. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.loop is not None:
            try:
                self.loop.remove_reader(self._fd())
            except Exception:  # the loop may already be closed at interpreter teardown
                pass
        self.sock.close(linger=0)


class ControlEndpoint:
    """A signed, authenticated control-plane socket (ROUTER or DEALER).

    ``on_message(identity, envelope)`` is called for every accepted frame;
    ``identity`` is the ZeroMQ routing id of the sending peer on a ROUTER and
    ``b""`` on a DEALER. With ``answer_pings`` (the controller's ROUTER), an
    accepted ``Ping`` is answered with its ``Pong`` right here, from inside the
    reader the moment it accepted the frame (``FrameReader.answer``), before
    the Ping and its envelope are built and ``on_message`` sees them: a round
    trip waits on no object and no dispatch. Only an accepted one: a frame the
    reader drops (forged, replayed, malformed, reflected...) is never answered.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        secret: bytes,
        run_id: str,
        sender: str,
        on_message: Callable[[bytes, Envelope], None],
        max_frame: int = DEFAULT_MAX_FRAME,
        answer_pings: bool = False,
    ) -> None:
        self.router = sock.type == zmq.ROUTER
        self.reader = FrameReader(secret, run_id, max_frame=max_frame, name=sender, own=sender)  # our own frames reflected: dropped
        self.writer = FrameWriter(secret, run_id, sender)
        self.on_message = on_message
        self.io = AsyncSocket(sock, self._on_parts, name=sender)
        if answer_pings:
            # the reader calls it as soon as it accepted a Ping, before the Ping and its envelope are built
            self._pong = self.writer.encoder(Pong)
            self.reader.answer(Ping, self._answer_ping)

    @property
    def drops(self) -> Counter[str]:
        return self.reader.drops

    def start(self) -> None:
        self.io.start()

    def _on_parts(self, parts: list[bytes]) -> None:
        if self.router:
            if len(parts) != 2:
                self.reader.drops["malformed"] += 1
                return
            identity, frame = parts
        else:
            if len(parts) != 1:
                self.reader.drops["malformed"] += 1
                return
            identity, frame = b"", parts[0]
        env = self.reader.read(frame, identity if self.router else "controller")  # the route is named only if a drop is logged
        if env is None:
            return
        self.on_message(identity, env)

    def _answer_ping(self, peer: bytes | str, nonce: int, sent_at: float) -> None:
        """An accepted Ping's Pong (``peer``: its route on a ROUTER), straight from its fields."""
        pong = self._pong(nonce, sent_at)
        if self.router:
            assert type(peer) is bytes  # the route, as ``_on_parts`` passes it
            self.io.send([peer, pong])
        else:
            self.io.send([pong])

    def send(self, msg: Any, identity: bytes = b"") -> bool:
        """Sign and queue one message (to ``identity`` on a ROUTER)."""
        frame = self.writer.encode(msg)
        return self.io.send([identity, frame] if self.router else [frame])

    def send_frame(self, frame: bytes, identity: bytes = b"") -> bool:
        """Queue an already-encoded frame (broadcasts encode once)."""
        return self.io.send([identity, frame] if self.router else [frame])

    def close(self) -> None:
        self.io.close()


def make_router(ctx: zmq.Context[Any], bind: str, port: int) -> tuple[zmq.Socket[Any], int]:
    """A ROUTER bound to ``tcp://bind:port`` (port 0 picks a free one); returns it and its port.

    ``ROUTER_MANDATORY`` turns sends to unknown or gone peers into counted
    errors instead of silent loss. Routing ids are not authenticated, so
    nothing is decided on them: flodl's peers let this socket assign one per
    connection (never seen on the wire), and the controller binds a peer's
    route to the sender name of its signed, fresh frames (``Routes``). A
    connection claiming an id in use is refused (no ``ROUTER_HANDOVER``).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_MSG_BYTES)
    curve.server(sock)  # encrypted when the run asks for it (--encrypt)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{bind}")
    else:
        sock.bind(f"tcp://{bind}:{port}")
    return sock, port


def make_dealer(ctx: zmq.Context[Any], addr: str) -> zmq.Socket[Any]:
    """A DEALER connected to ``addr``; the controller's ROUTER gives each of its connections a routing id.

    Connecting never blocks: ZeroMQ retries in the background and delivers
    queued frames once the controller is up, so start order does not matter.
    A reconnect (after a reset) is a new connection with a new routing id;
    the controller moves the peer's route there on its next signed frame.
    """
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_MSG_BYTES)
    curve.client(sock)
    sock.connect(addr)
    return sock


def peer_name(route: bytes) -> str:
    """How logs name the connection a frame came on: ``conn:<hex>`` for an id the ROUTER assigned,
    else the id its peer chose (escaped when logged)."""
    return route_name(route)


def route_moves(known: bytes | None, route: bytes, env: Envelope) -> bool:
    """Does a bound sender's route (``known``) move to the connection ``env`` came on (``route``)?
    Only for an authenticated frame newer than anything accepted from that sender."""
    return bool(known) and known != route and env.newest


class Routes:
    """Which connection (routing id) reaches each sender: bound by signed frames, never by ids.

    A sender's route is set by its first authenticated frame (the caller
    decides which: a hello) and moves to another connection only on a frame
    that is authenticated and the newest ever accepted from that sender
    (``Envelope.newest``): a reconnect after a reset moves it, a replay or a
    stranger's connection never does.
    """

    def __init__(self) -> None:
        self._by_sender: dict[str, bytes] = {}
        self.moves = 0

    def get(self, sender: str) -> bytes | None:
        return self._by_sender.get(sender)

    def bind(self, sender: str, route: bytes) -> None:
        self._by_sender[sender] = route

    def follow(self, env: Envelope, route: bytes) -> bool:
        """Move a bound sender's route to ``route`` if ``env`` allows it; True if it moved."""
        if not route_moves(self._by_sender.get(env.sender), route, env):
            return False
        self._by_sender[env.sender] = route
        self.moves += 1
        return True

    def forget(self, sender: str) -> None:
        self._by_sender.pop(sender, None)


def host_name() -> str:
    """This host's name as peers report it."""
    return socket.gethostname()
