"""The live dashboard: a small read-only HTTP/1.1 server over a `Feed`.

`dashboard.py` serves the page (`page.py`), a server-sent-events stream of
the record feed with late-join replay, and three JSON reads. Stdlib only
(`asyncio.start_server`), one request per connection (`Connection: close`),
loopback by default. Every read and write has a deadline: a client that
never finishes its request, or stops reading its stream, is closed; a
malformed request gets 400 and never takes the server down.

    GET /                      the dashboard HTML
    GET /events                SSE: the snapshot (meta first), then new records
    GET /paths                 JSON list of node paths
    GET /node?path=P           {"path", "node": latest of P, "children": [latest of each child]}
    GET /history?path=P&n=N    JSON list of the last N records of P
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .feed import Feed, Subscription, encode_record
from .page import render_page

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 5.0  # to receive the request line and headers
DEFAULT_WRITE_TIMEOUT_S = 10.0  # for the client to take each chunk we send
DEFAULT_KEEPALIVE_S = 15.0  # SSE comment interval, so proxies and dead peers show up
DEFAULT_HISTORY_N = 100

_MAX_LINE_BYTES = 8 * 1024
_MAX_HEADERS = 64
_SSE_CHUNK_BYTES = 64 * 1024

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}


class BadRequest(Exception):
    """The client sent something that is not a well-formed HTTP/1.x request (their fault)."""


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """Parse one request head; None when the client closed before sending one.

    Raises:
        BadRequest: malformed request line, oversized line, too many headers.
    """
    line = await _read_line(reader)
    if not line:
        return None
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise BadRequest(f"bad request line {line[:80]!r}")
    for _ in range(_MAX_HEADERS + 1):
        if not await _read_line(reader):  # headers are not needed: skip to the blank line
            url = urlsplit(parts[1])
            return Request(parts[0], url.path, parse_qs(url.query))
    raise BadRequest("too many headers")


async def _read_line(reader: asyncio.StreamReader) -> str:
    try:
        raw = await reader.readline()
    except ValueError as exc:  # over the stream limit (LimitOverrunError surfaces as ValueError)
        raise BadRequest("line too long") from exc
    if raw and not raw.endswith(b"\n"):
        raise BadRequest("truncated request")
    return raw.decode("latin-1").rstrip("\r\n")


@dataclass(slots=True)
class _Client:
    """One open connection: its writer and, while streaming, its subscription."""

    writer: asyncio.StreamWriter
    sub: Subscription | None = None


class DashboardServer:
    """Serve the live dashboard for ``feed`` on ``host:port`` (port 0: pick a free one).

    Use as ``port = await server.start()`` ... ``await server.close()``, or
    ``async with DashboardServer(feed) as server:``. The feed must be
    published to on the same event loop.
    """

    def __init__(
        self,
        feed: Feed,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        theme: str | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
    ) -> None:
        self.feed = feed
        self.host = host
        self.port = port
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.keepalive_s = keepalive_s
        self._page = render_page(theme=theme).encode()  # validates theme early
        self._server: asyncio.Server | None = None
        self._clients: dict[asyncio.Task[Any], _Client] = {}

    async def __aenter__(self) -> DashboardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        self._server = await asyncio.start_server(self._serve_client, self.host, self.port, limit=_MAX_LINE_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("dashboard: http://%s:%d/", self.host, self.port)
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    async def close(self, *, timeout_s: float = 2.0) -> None:
        """Stop accepting, close every client connection, wait for their handlers."""
        if self._server is None:
            return
        self._server.close()
        # Python 3.11's Server.close() leaves accepted connections open. Abort
        # them and end their subscriptions: every handler then wakes up (EOF,
        # a failed drain, or None from its stream) and returns on its own.
        # Cancelling instead would make asyncio's stream callback log noise.
        for client in list(self._clients.values()):
            client.writer.transport.abort()
            if client.sub is not None:
                self.feed.unsubscribe(client.sub)
        if self._clients:
            _, stuck = await asyncio.wait(list(self._clients), timeout=timeout_s)
            for task in stuck:  # last resort: a handler that did not notice
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=timeout_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._server.wait_closed()
        self._server = None

    # -- one connection -----------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients[task] = _Client(writer)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the peer went away or stalled: nothing to answer
        except Exception:  # a bug of ours must not take the server down
            log.exception("dashboard: request handler failed")
            with contextlib.suppress(Exception):
                await self._respond(writer, 500, b"internal error\n", "text/plain")
        finally:
            self._clients.pop(task, None)
            await self._finish(writer)

    async def _finish(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        try:
            async with asyncio.timeout(1.0):
                await writer.wait_closed()
        except (TimeoutError, ConnectionError):
            writer.transport.abort()  # a peer that won't take the tail is not waited for
        except asyncio.CancelledError:
            writer.transport.abort()
            raise

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.request_timeout_s):
                request = await read_request(reader)
        except BadRequest as exc:
            await self._respond(writer, 400, f"{exc}\n".encode(), "text/plain")
            return
        except TimeoutError:
            log.debug("dashboard: closing a client that sent no request in %.1f s", self.request_timeout_s)
            return
        if request is not None:
            await self._route(request, writer)

    async def _route(self, req: Request, writer: asyncio.StreamWriter) -> None:
        if req.method != "GET":
            await self._respond(writer, 405, b"read-only: GET only\n", "text/plain", extra="Allow: GET\r\n")
        elif req.path == "/":
            await self._respond(writer, 200, self._page, "text/html; charset=utf-8")
        elif req.path == "/events":
            await self._stream(writer)
        elif req.path == "/paths":
            await self._json(writer, 200, self.feed.paths())
        elif req.path == "/node":
            await self._node(req, writer)
        elif req.path == "/history":
            await self._history(req, writer)
        else:
            await self._respond(writer, 404, b"not found\n", "text/plain")

    # -- JSON reads ---------------------------------------------------------

    async def _node(self, req: Request, writer: asyncio.StreamWriter) -> None:
        path = _one(req.query, "path")
        if path is None:
            await self._json(writer, 400, {"error": "path=P is required"})
        elif (node := self.feed.latest(path)) is None:
            await self._json(writer, 404, {"error": f"unknown path {path!r}"})
        else:
            children = [self.feed.latest(c) for c in self.feed.children(path)]
            await self._json(writer, 200, {"path": path, "node": node, "children": children})

    async def _history(self, req: Request, writer: asyncio.StreamWriter) -> None:
        path, n_text = _one(req.query, "path"), _one(req.query, "n")
        n = _int(n_text) if n_text is not None else DEFAULT_HISTORY_N
        if path is None or n is None or n < 0:
            await self._json(writer, 400, {"error": "path=P is required and n=N a count"})
        elif self.feed.latest(path) is None:
            await self._json(writer, 404, {"error": f"unknown path {path!r}"})
        else:
            await self._json(writer, 200, self.feed.history(path, n))

    # -- SSE ----------------------------------------------------------------

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            "Connection: close\r\nX-Accel-Buffering: no\r\n\r\nretry: 2000\n\n"
        )
        replay, sub = self.feed.open_stream()
        client = self._clients.get(asyncio.current_task())  # type: ignore[arg-type]
        if client is not None:
            client.sub = sub  # so close() can end the stream
        try:
            await self._send(writer, head.encode())
            await self._send_events(writer, replay)
            while (lines := await self._next_batch(sub)) is not None:
                if lines:
                    await self._send_events(writer, lines)
                else:
                    await self._send(writer, b": keep-alive\n\n")
        finally:
            self.feed.unsubscribe(sub)

    async def _next_batch(self, sub: Subscription) -> list[str] | None:
        """Queued lines ([] after a quiet keep-alive interval); None when the feed ended."""
        try:
            async with asyncio.timeout(self.keepalive_s):
                line = await sub.get()
        except TimeoutError:
            return []
        if line is None:
            return None
        lines = [line]
        while (more := sub.get_nowait()) is not None:  # drain what piled up: one write
            lines.append(more)
        return lines

    async def _send_events(self, writer: asyncio.StreamWriter, lines: list[str]) -> None:
        chunk: list[str] = []
        size = 0
        for line in lines:
            chunk.append(f"data: {line}\n\n")
            size += len(line) + 8
            if size >= _SSE_CHUNK_BYTES:
                await self._send(writer, "".join(chunk).encode())
                chunk, size = [], 0
        if chunk:
            await self._send(writer, "".join(chunk).encode())

    # -- plain responses ----------------------------------------------------

    async def _json(self, writer: asyncio.StreamWriter, status: int, body: Any) -> None:
        await self._respond(writer, status, encode_record(body).encode(), "application/json")

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str, *, extra: str = "") -> None:
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n{extra}"
            "Connection: close\r\n\r\n"
        )
        await self._send(writer, head.encode() + body)

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.write_timeout_s):
            await writer.drain()


def _one(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
