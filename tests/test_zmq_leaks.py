"""The ZeroMQ leak check (tests/helpers/zmq_leaks.py) catches what it must and nothing else."""

from __future__ import annotations

import os
import subprocess
import textwrap

import zmq

from .conftest import PY, ROOT
from .helpers import zmq_leaks


def test_a_socket_left_open_is_a_leak_and_a_closed_one_is_not():
    with zmq_leaks.tracking() as tracker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
    leaks = tracker.leaks(grace_s=0)
    assert len(leaks) == 1 and "DEALER" in leaks[0] and f"{__file__}:" in leaks[0], leaks
    sock.close(linger=0)
    assert tracker.leaks(grace_s=0) == []


def test_a_dropped_socket_is_a_leak_whenever_the_garbage_collector_runs():
    with zmq_leaks.tracking() as tracker:
        zmq.Context.instance().socket(zmq.PAIR)  # never closed: left to __del__
    assert len(tracker.leaks(grace_s=0)) == 1
    tracker.sockets[0][0].close(linger=0)
    assert tracker.leaks(grace_s=0) == []


def test_a_context_left_unterminated_is_a_leak_the_global_one_is_not():
    saved = zmq.Context._instance, zmq.Context._instance_pid
    zmq.Context._instance = None  # as before the first test that needs it: created lazily, here
    try:
        with zmq_leaks.tracking() as tracker:
            fresh = zmq.Context.instance()
            own = zmq.Context()
            zmq.Context(shadow=own.underlying)  # a second handle: its owner terminates it
        leaks = tracker.leaks(grace_s=0)
        assert len(leaks) == 1 and "context" in leaks[0] and f"{__file__}:" in leaks[0], leaks
        own.term()
        assert tracker.leaks(grace_s=0) == []
        fresh.term()
    finally:
        zmq.Context._instance, zmq.Context._instance_pid = saved


def test_a_socket_another_thread_is_closing_gets_its_grace():
    import threading

    with zmq_leaks.tracking() as tracker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
    closer = threading.Timer(0.2, sock.close, kwargs={"linger": 0})
    closer.start()
    try:
        assert tracker.leaks(grace_s=5) == []
    finally:
        closer.join()


def test_the_fixture_fails_a_leaking_test_and_passes_a_clean_one(tmp_path):
    """tests/conftest.py's fixture, in a pytest run of its own."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import _no_leaked_zmq  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import zmq

            def test_leaks():
                zmq.Context.instance().socket(zmq.ROUTER).bind("inproc://leaked")

            def test_closes():
                sock = zmq.Context.instance().socket(zmq.ROUTER)
                sock.close(linger=0)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "2 passed, 1 error" in res.stdout, res.stdout  # the leak fails test_leaks at its teardown
    assert "ZeroMQ leak(s) in this test" in res.stdout and "socket ROUTER left open" in res.stdout, res.stdout
