"""The live dashboard and its archive: feed, raw HTTP, SSE, and a real headless Chromium.

Tiers: pure `Feed` checks; loopback HTTP/SSE against the real server on a
random port in the test's event loop; and Debian's `chromium` loading the
archive (``--dump-dom``) and the live page. The live page holds an
EventSource open forever, and headless Chromium never lets virtual time run
out while a fetch is pending, so ``--virtual-time-budget --dump-dom`` hangs
on it; the live page is driven instead over ``--remote-debugging-pipe``
(the DevTools protocol, NUL-separated JSON on fds 3 and 4, stdlib only),
which also lets the test publish a record and watch the page redraw.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from flodl.monitor.archive import archive_html, write_archive
from flodl.monitor.dashboard import DashboardServer
from flodl.monitor.feed import Feed
from flodl.monitor.page import THEME_LINE, render_page

from .helpers.browser import CHROMIUM, chromium, console_errors, needs_chromium

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000_000
EPOCHS, TICKS, RANKS, LOST_AT = 4, 3, 2, 2
HOSTILE = "</script><script>window.pwned=1</script><!--"


# ---------------------------------------------------------------- a synthetic run


def node(t: int, path: str, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"v": 1, "ts": t, "sev": "info", "path": path, "kind": "node", "metrics": metrics, "work": 1.0, "alive": True, **extra}


def event(t: int, cls: str, path: str, detail: str, sev: str = "info") -> dict[str, Any]:
    return {"v": 1, "ts": t, "sev": sev, "path": path, "kind": "event", "class": cls, "detail": detail, "count": 1}


def rank_record(t: int, e: int, k: int, r: int) -> dict[str, Any]:
    if r == 1 and e >= LOST_AT:  # dead ranks still appear, alive:false, metrics absent
        return node(t, f"root/rank{r}", {}, tick=k, epoch=e, alive=False, device=r)
    res = {"gpu_util": 60.0 + 5 * r, "vram_alloc": (2 + r) * 2**30, "vram_total": 8 * 2**30, "cpu_util": 35.0, "rss_bytes": 3 * 2**30}
    metrics = {
        "loss": 2.0 / (e + 1 + k / TICKS),
        "throughput": 900.0 + 300 * r,
        "batch_share": 0.4 + 0.2 * r,
        "data_starve": 0.01 * r,
        "compute_only_ms": 40.0,
    }
    return node(t, f"root/rank{r}", metrics, tick=k, epoch=e, device=r, res=res)


def run_records() -> list[dict[str, Any]]:
    """Meta, then EPOCHS epochs of TICKS sub-epoch windows for root and RANKS ranks; rank1 dies."""
    meta = {
        "v": 1,
        "ts": T0,
        "kind": "meta",
        "reductions": {"loss": "mean", "anchor": "last"},
        "run": {
            "run_id": "test-run",
            "mode": "cadence",
            "task": "examples/digits.py:task",
            "world_size": RANKS,
            "epochs": EPOCHS,
            "dataset_len": 1797,
            "batch_size": 32,
            "eval_metric": "accuracy",
        },
    }
    out, t = [meta], T0
    for e in range(EPOCHS):
        for k in range(1, TICKS + 1):
            t += 1000
            out += [rank_record(t, e, k, r) for r in range(RANKS)]
            out.append(
                node(
                    t,
                    "root",
                    {"loss": 2.0 / (e + 1 + k / TICKS), "throughput": 2100.0, "batch_share": 1.0},
                    tick=k,
                    epoch=e,
                    children=RANKS,
                )
            )
        t += 10  # as the hub does: anchor and syncs ride on the epoch records only
        out.append(
            node(
                t,
                "root",
                {"loss": 2.0 / (e + 1), "eval": 0.6 + 0.1 * e, "throughput": 2000.0, "anchor": 4 + e, "syncs": 3 * e + 2},
                epoch=e,
                epoch_complete=True,
                children=RANKS,
            )
        )
        if e == LOST_AT - 1:
            out.append(event(t + 5, "rank_lost", "root/rank1", "heartbeat timeout " + HOSTILE, "critical"))
            out.append(event(t + 6, "checkpoint", "root", "saved epoch 2"))
    return out


def publish_run(feed: Feed) -> int:
    records = run_records()
    for rec in records:
        feed.publish(rec)
    return len(records)


# ---------------------------------------------------------------- DOM helpers


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.items: list[tuple[str, dict[str, str | None]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.items.append((tag, dict(attrs)))

    def find(self, tag: str, **want: str) -> list[dict[str, str | None]]:
        want = {k.replace("_", "-"): v for k, v in want.items()}
        return [a for t, a in self.items if t == tag and all(a.get(k) == v for k, v in want.items())]

    def series(self) -> dict[str, int]:
        """data-series name -> data-points, for every drawn series."""
        return {a["data-series"]: int(a["data-points"] or 0) for t, a in self.items if t == "path" and a.get("data-series")}

    def body(self) -> dict[str, str | None]:
        return self.find("body")[0]


def assert_run_drawn(dom: str) -> Elements:
    """The DOM shows the synthetic run: curves, per-rank series, the event, no JS error."""
    el = Elements(dom)
    body, series = el.body(), el.series()
    assert body.get("data-errors") in (None, "0"), body.get("data-last-error")
    assert series.get("loss", 0) >= EPOCHS and series.get("eval", 0) >= EPOCHS
    assert series.get("loss-window", 0) >= EPOCHS * TICKS
    assert series["throughput:rank0"] == EPOCHS * TICKS and series["throughput:rank1"] == LOST_AT * TICKS
    assert series["anchor"] == series["syncs"] == EPOCHS and series["throughput:total"] == EPOCHS * TICKS
    assert {
        "batch_share:rank0",
        "batch_share:rank1",
        "data_starve:rank1",
        "gpu_util:rank0",
        "vram:rank1",
        "cpu_util:rank0",
        "rss:rank0",
    } <= series.keys()
    assert el.find("li", data_class="rank_lost", data_sev="critical")
    assert el.find("li", data_class="checkpoint")
    assert el.find("tr", data_path="root/rank1", data_alive="false")
    assert el.find("tr", data_path="root/rank0", data_alive="true")
    for chart in ("loss", "eval", "throughput", "batch-share", "sync", "starve", "gpu", "vram", "cpu", "rss"):
        assert el.find("div", id=f"chart-{chart}"), chart
    return el


# ---------------------------------------------------------------- raw HTTP helpers


async def http(port: int, raw: bytes, *, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw``, read to EOF; (status, headers, body)."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw)
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


async def get(port: int, target: str) -> tuple[int, Any]:
    status, headers, body = await http(port, f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    if headers.get("Content-Type") == "application/json":
        return status, json.loads(body)
    return status, body


class Sse:
    """A raw server-sent-events client for /events."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Sse:
        async with asyncio.timeout(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        return cls(reader, writer)

    async def next(self, *, timeout_s: float = 5.0) -> str:
        """The next SSE block (``data: ...`` or a ``: comment``), without the blank line."""
        async with asyncio.timeout(timeout_s):
            while True:
                block = (await self.reader.readuntil(b"\n\n")).decode().strip("\n")
                if not block.startswith("retry:"):
                    return block

    async def record(self, *, timeout_s: float = 5.0) -> dict[str, Any]:
        block = await self.next(timeout_s=timeout_s)
        assert block.startswith("data: "), block
        return json.loads(block[len("data: ") :])

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------- fixtures


@pytest.fixture
async def served():
    """A real server on a random loopback port with the synthetic run published."""
    feed = Feed()
    count = publish_run(feed)
    server = DashboardServer(feed, request_timeout_s=0.5, keepalive_s=0.3)
    port = await server.start()
    try:
        yield server, feed, port, count
    finally:
        await server.close()


# ---------------------------------------------------------------- pure feed


def test_feed_keeps_meta_first_and_publish_order():
    feed = Feed()
    feed.publish(node(2, "root", {"loss": 1.0}))
    feed.publish(event(3, "sync", "root", "s"))
    feed.publish({"v": 1, "ts": 1, "kind": "meta", "reductions": {}})
    feed.publish(node(4, "root/rank0", {"loss": 1.0}))
    snap = feed.snapshot()
    assert [r["kind"] for r in snap] == ["meta", "node", "event", "node"]
    assert [r["ts"] for r in snap[1:]] == [2, 3, 4]
    assert feed.paths() == ["root", "root/rank0"] and feed.children("root") == ["root/rank0"]


def test_feed_rings_are_bounded_and_paths_sort_naturally():
    feed = Feed(records_per_path=3, max_events=2)
    for i in range(10):
        feed.publish(node(i, f"root/rank{i % 2 * 10 + 2}", {"loss": float(i)}))
        feed.publish(event(i, "sync", "root", str(i)))
    assert feed.paths() == ["root/rank2", "root/rank12"]
    assert [r["ts"] for r in feed.history("root/rank2", 99)] == [4, 6, 8]
    assert [r["detail"] for r in feed.events()] == ["8", "9"]
    assert len(feed.snapshot()) == 3 + 3 + 2


def test_slow_subscriber_is_dropped_not_waited_for():
    feed = Feed(subscriber_queue=2)
    replay, sub = feed.open_stream()
    assert replay == []
    for i in range(5):  # the publisher never blocks on a full queue
        feed.publish(node(i, "root", {}))
    assert sub.dropped and feed.subscriber_count == 0 and feed.dropped_subscribers == 1
    assert sub.get_nowait() is None


def test_non_finite_values_become_null():
    feed = Feed()
    feed.publish(node(1, "root", {"loss": math.nan, "eval": math.inf, "ok": 1.5}))
    assert json.loads(feed.snapshot_lines()[0])["metrics"] == {"loss": None, "eval": None, "ok": 1.5}
    with pytest.raises(TypeError):
        feed.publish(["not", "a", "record"])  # type: ignore[arg-type]


def test_odd_scalar_types_do_not_fail_the_publisher():
    class Scalar:  # like a numpy/torch scalar: not JSON, but has __float__
        def __init__(self, v: float) -> None:
            self.v = v

        def __float__(self) -> float:
            return self.v

    feed = Feed()
    feed.publish(node(1, "root", {"lr": Scalar(0.5), "bad": Scalar(math.nan), "tag": object}))
    metrics = json.loads(feed.snapshot_lines()[0])["metrics"]
    assert metrics["lr"] == 0.5 and metrics["bad"] is None and "object" in metrics["tag"]


# ---------------------------------------------------------------- raw HTTP


async def test_json_reads(served):
    server, feed, port, _ = served
    assert server.host == "127.0.0.1"
    assert await get(port, "/paths") == (200, ["root", "root/rank0", "root/rank1"])
    status, body = await get(port, "/node?path=root")
    assert status == 200 and body["node"]["epoch_complete"] is True
    assert [c["path"] for c in body["children"]] == ["root/rank0", "root/rank1"]
    status, body = await get(port, "/history?path=root/rank0&n=3")
    assert status == 200 and [r["tick"] for r in body] == [1, 2, 3] and body == feed.history("root/rank0", 3)
    assert (await get(port, "/node?path=root/nope"))[0] == 404
    assert (await get(port, "/node"))[0] == 400
    assert (await get(port, "/history?path=root&n=many"))[0] == 400


async def test_page_404_405_and_bad_requests(served):
    _, _, port, _ = served
    status, headers, body = await http(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert body.decode().count(THEME_LINE) == 1 and b'id="flodl-data"' not in body
    assert (await get(port, "/nope"))[0] == 404
    status, headers, _ = await http(port, b"POST /paths HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 405 and headers["Allow"] == "GET"
    assert (await http(port, b"\x16\x03\x01\x00garbage\r\n\r\n"))[0] == 400
    assert (await http(port, b"GET nothing-slash HTTP/1.1\r\n\r\n"))[0] == 400
    assert (await http(port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n"))[0] == 400
    assert (await get(port, "/paths"))[0] == 200  # and the server is still up


async def test_slowloris_is_closed_by_the_deadline(served):
    server, _, port, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never sends the blank line
    started = time.monotonic()
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # the server hung up without answering
    assert server.request_timeout_s * 0.8 <= time.monotonic() - started < 4
    writer.close()


# ---------------------------------------------------------------- SSE


async def test_sse_replays_meta_first_then_streams(served):
    _, feed, port, count = served
    sse = await Sse.open(port)
    try:
        replay = [await sse.record() for _ in range(count)]
        assert replay[0]["kind"] == "meta" and replay == feed.snapshot()
        feed.publish(node(T0 + 99_000, "root", {"loss": 0.1}, epoch=EPOCHS, epoch_complete=True))
        assert (await sse.record())["ts"] == T0 + 99_000
        assert await sse.next() == ": keep-alive"  # keepalive_s=0.3 in this fixture
    finally:
        sse.close()


async def test_close_ends_open_streams(served):
    server, feed, port, count = served
    sse = await Sse.open(port)
    for _ in range(count):
        await sse.record()
    await server.close()
    async with asyncio.timeout(3):
        assert await sse.reader.read() == b""
    assert feed.subscriber_count == 0
    sse.close()


# ---------------------------------------------------------------- archive


def embedded_records(html: str) -> list[dict[str, Any]]:
    block = re.search(r'<script type="application/json" id="flodl-data">(.*?)</script>', html, re.S)
    assert block is not None
    return json.loads(block.group(1))["records"]


def test_archive_embeds_escaped_snapshot_and_pins_theme(tmp_path):
    feed = Feed()
    publish_run(feed)
    path = write_archive(tmp_path / "out" / "dash.html", feed, theme="dark")
    html = path.read_text()
    assert embedded_records(html) == feed.snapshot()
    assert HOSTILE not in html and html.count("</script>") == render_page().count("</script>") + 1
    assert [line for line in html.splitlines() if "const ARCHIVE_THEME=" in line] == ['const ARCHIVE_THEME="dark";']
    assert os.listdir(tmp_path / "out") == ["dash.html"]  # no temporary file left behind
    assert embedded_records(archive_html(feed.snapshot())) == feed.snapshot()  # a snapshot works too


@pytest.mark.parametrize("bad", ["blue", "", "Dark", 1])
def test_archive_rejects_unknown_theme(tmp_path, bad):
    with pytest.raises(ValueError, match="dashboard_theme"):
        write_archive(tmp_path / "dash.html", Feed(), theme=bad)
    assert not (tmp_path / "dash.html").exists()
    for ok in (None, "light", "dark", "auto"):
        assert render_page(theme=ok).count("const ARCHIVE_THEME=") == 1


# ---------------------------------------------------------------- headless Chromium


@needs_chromium
@pytest.mark.parametrize("theme", [None, "dark"])
async def test_archive_draws_in_chromium(tmp_path, theme):
    feed = Feed()
    publish_run(feed)
    path = write_archive(tmp_path / "dash.html", feed, theme=theme)
    dom, stderr = await chromium(
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        path.as_uri(),
    )
    el = assert_run_drawn(dom)
    assert el.body()["data-mode"] == "archive"
    assert len(el.find("script")) == 3  # the hostile event detail did not break out of the data block
    assert not console_errors(stderr), console_errors(stderr)


@needs_chromium
async def test_window_ticks_numbered_across_the_run_still_plot_inside_their_epoch(tmp_path):
    """Ticks may be per-epoch (1..R) or a run-wide window number: both plot the same."""
    paths = {}
    for name, renumber in (("local", lambda e, k: k), ("global", lambda e, k: 17 + e * TICKS + k)):
        feed = Feed()
        for rec in run_records():
            feed.publish({**rec, "tick": renumber(rec["epoch"], rec["tick"])} if "tick" in rec else rec)
        paths[name] = write_archive(tmp_path / f"{name}.html", feed)
    d = {}
    for name, path in paths.items():
        dom, _ = await chromium(f"--user-data-dir={tmp_path / name}", "--virtual-time-budget=5000", "--dump-dom", path.as_uri())
        d[name] = [a["d"] for t, a in Elements(dom).items if t == "path" and a.get("data-series") == "loss-window"]
    assert d["local"] and d["local"] == d["global"]
    xs = [float(x) for x in re.findall(r"[ML]([\d.]+),", d["local"][0])]
    assert len(set(xs)) == EPOCHS * TICKS and xs == sorted(xs)  # one step per window, none piled at an epoch end


@needs_chromium
async def test_archive_with_host_tier_draws_per_rank_series(tmp_path):
    """Cohorts over several hosts add a host tier: ranks are leaves, host nodes are not ranks."""
    feed = Feed()
    for rec in run_records():
        if rec.get("path", "").startswith("root/rank"):
            rank = rec["path"].rsplit("rank", 1)[1]
            rec = {**rec, "path": f"root/node-{rank}.example.org/rank{rank}"}
            feed.publish({**rec, "path": rec["path"].rsplit("/", 1)[0], "children": 1})  # the host's own row
        feed.publish(rec)
    path = write_archive(tmp_path / "dash.html", feed)
    dom, stderr = await chromium(
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        path.as_uri(),
    )
    el = Elements(dom)
    assert el.body().get("data-errors") in (None, "0"), el.body().get("data-last-error")
    throughput = {k for k in el.series() if k.startswith("throughput:")}
    assert throughput == {"throughput:node-0.example.org/rank0", "throughput:node-1.example.org/rank1", "throughput:total"}
    assert len(el.find("tr")) == 1 + RANKS  # header row + one row per rank, no host rows
    assert not console_errors(stderr), console_errors(stderr)


class PipeBrowser:
    """Headless Chromium driven over --remote-debugging-pipe: CDP as NUL-separated JSON on fds 3/4."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)

    async def start(self, profile: Path, log: Path) -> None:
        to_r, self._to_w = os.pipe()
        from_r, from_w = os.pipe()
        # bash maps our pipe ends onto the fds 3 and 4 Chromium expects (dash only takes fds 0-9).
        script = f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}'
        self._log = open(log, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "about:blank",
            pass_fds=(to_r, from_w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_r)
        os.close(from_w)
        self._reader = asyncio.StreamReader(limit=64 * 2**20)
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self._reader), os.fdopen(from_r, "rb"))
        self._pump = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            msg = json.loads((await self._reader.readuntil(b"\0"))[:-1])
            fut = self._waiting.pop(msg.get("id", -1), None)
            if fut is None:
                self.events.append(msg)
            elif not fut.done():
                fut.set_result(msg)

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None, timeout_s: float = 10.0
    ) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut = self._waiting[msg_id] = asyncio.get_running_loop().create_future()
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")  # small writes to a pipe: never block
        async with asyncio.timeout(timeout_s):
            reply = await fut
        assert "error" not in reply, reply
        return reply["result"]

    async def open_page(self, url: str) -> str:
        target = await self.call("Target.createTarget", {"url": "about:blank"})
        session = (await self.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}))["sessionId"]
        await self.call("Runtime.enable", session=session)  # from here on, console errors are reported
        await self.call("Page.navigate", {"url": url}, session=session)
        return session

    async def js(self, session: str, expression: str) -> Any:
        reply = await self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        return reply["result"].get("value")

    async def wait_for(self, session: str, expression: str, *, timeout_s: float = 15.0) -> Any:
        async with asyncio.timeout(timeout_s):
            while not (value := await self.js(session, expression)):
                await asyncio.sleep(0.1)
        return value

    def js_errors(self) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
            or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error")
        ]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call("Browser.close", timeout_s=3)
        try:
            async with asyncio.timeout(5):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._pump
        os.close(self._to_w)
        self._log.close()


@pytest.fixture
async def browser(tmp_path):
    b = PipeBrowser()
    await b.start(tmp_path / "profile", tmp_path / "chromium.log")
    try:
        yield b
    finally:
        await b.close()
        errors = console_errors((tmp_path / "chromium.log").read_text(errors="replace"))
        assert not errors, errors


@needs_chromium
async def test_live_page_draws_and_follows_the_stream(served, browser):
    server, feed, port, count = served
    session = await browser.open_page(server.url)
    await browser.wait_for(session, f"+document.body.dataset.records >= {count} && document.body.dataset.rendered")
    await browser.wait_for(session, "document.getElementById('status').dataset.state === 'live'")
    dom = await browser.js(session, "document.documentElement.outerHTML")
    assert Elements(dom).body()["data-mode"] == "live"
    assert_run_drawn(dom)

    feed.publish(node(T0 + 99_000, "root", {"loss": 0.2, "eval": 0.95}, epoch=EPOCHS, epoch_complete=True))
    feed.publish(event(T0 + 99_001, "rank_joined", "root/rank2", "joined at epoch 5"))
    await browser.wait_for(
        session,
        f"document.querySelector('[data-series=\"loss\"]').dataset.points == {EPOCHS + 1}"
        " && !!document.querySelector('#events li[data-class=\"rank_joined\"]')",
    )

    await browser.js(session, "document.getElementById('theme-toggle').click()")
    assert await browser.js(session, "document.documentElement.dataset.theme") in ("light", "dark")
    assert await browser.js(session, "document.body.dataset.errors || '0'") == "0"
    assert not browser.js_errors(), browser.js_errors()
