"""A message handler that raises: the socket survives it, and the bug shows (log, tally, summary, strict exit)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq

from flodl.controller import report_handler_errors
from flodl.errors import EXIT_FAILED
from flodl.wire import transport

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def tally(monkeypatch):
    """A fresh process tally, so the deliberate errors here do not fail the test (conftest checks the real one)."""
    fresh = transport.HandlerErrors()
    monkeypatch.setattr(transport, "HANDLER_ERRORS", fresh)
    return fresh


def test_a_raising_handler_is_counted_logged_and_the_socket_goes_on(tally, caplog):
    ctx = zmq.Context.instance()
    seen = []

    def handler(parts):
        if parts[0] == b"boom":
            raise KeyError("a bug")
        seen.append(parts[0])

    async def main():
        rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        rx.setsockopt(zmq.LINGER, 0)
        tx.setsockopt(zmq.LINGER, 0)
        port = rx.bind_to_random_port("tcp://127.0.0.1")
        tx.connect(f"tcp://127.0.0.1:{port}")
        io = transport.AsyncSocket(rx, handler, name="test-socket")
        io.start()
        try:
            tx.send(b"boom")
            tx.send(b"fine")
            for _ in range(500):
                if seen:
                    break
                await asyncio.sleep(0.01)
            return io.handler_errors
        finally:
            io.close()
            tx.close(linger=0)

    with caplog.at_level(logging.ERROR, logger="flodl.wire.transport"):
        errors = asyncio.run(main())
    assert seen == [b"fine"] and errors == 1  # the next message is handled
    assert tally.count == 1 and tally.first == ["test-socket: KeyError: 'a bug'"]
    assert "test-socket: handler failed" in caplog.text and "KeyError" in caplog.text  # with its traceback


def test_the_tally_keeps_the_first_few_and_counts_all():
    tally = transport.HandlerErrors()
    for i in range(tally.KEEP + 5):
        tally.record("s", ValueError(i))
    assert tally.count == tally.KEEP + 5 and len(tally.first) == tally.KEEP and tally.first[0] == "s: ValueError: 0"


def test_a_controller_with_handler_errors_says_so_and_fails_under_strict(monkeypatch, caplog):
    monkeypatch.setenv("FLODL_STRICT", "1")
    summary = {"exit_code": 0, "exit_reason": "completed", "handler_errors": 2}
    with caplog.at_level(logging.ERROR, logger="flodl.controller"):
        report_handler_errors(summary)
    assert "2 message handler error(s)" in caplog.text
    assert summary["exit_code"] == EXIT_FAILED and "FLODL_STRICT" in summary["failure"]
    monkeypatch.setenv("FLODL_STRICT", "0")
    summary = {"exit_code": 0, "handler_errors": 2}
    report_handler_errors(summary)
    assert summary["exit_code"] == 0  # users: said, not fatal
    failed = {"exit_code": 3, "handler_errors": 1, "failure": "rank 1 died"}
    monkeypatch.setenv("FLODL_STRICT", "1")
    report_handler_errors(failed)
    assert failed["exit_code"] == 3 and failed["failure"] == "rank 1 died"  # the first failure stands


async def test_a_controller_handler_bug_shows_in_the_run_summary(tally, quiet_console):
    """The run goes on past the bad message (as in production) and its summary counts it."""
    from flodl.config import DdpRunConfig
    from flodl.controller import Controller, LaunchOptions
    from flodl.testing.sim import SimRankSpec, SimWorker
    from flodl.wire import messages as m

    secret, run_id = b"s" * 32, "handler-run"
    launch = LaunchOptions(task="sim:task", epochs=1, workers=1, progress=False, join_timeout_secs=20.0)
    ctl = Controller(launch, DdpRunConfig().with_mode("nccl-sync"), secret=secret, run_id=run_id, console=quiet_console)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    handle, broken = ctl.endpoint.on_message, []

    def buggy(identity, env):  # the first heartbeat hits a bug; every other message is handled
        if isinstance(env.msg, m.Heartbeat) and not broken:
            broken.append(env.msg)
            raise RuntimeError("a handler bug")
        handle(identity, env)

    ctl.endpoint.on_message = buggy
    sim = SimWorker(f"tcp://127.0.0.1:{ctl.port}", secret, run_id, [SimRankSpec(), SimRankSpec()], dataset_len=200, batch_size=10)
    worker = asyncio.create_task(sim.run())
    summary = await run
    await asyncio.wait([worker], timeout=10)
    worker.cancel()
    assert broken and summary["exit_reason"] == "completed"
    assert summary["handler_errors"] == 1 and tally.count == 1 and "RuntimeError: a handler bug" in tally.first[0]
