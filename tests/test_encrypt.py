"""``--encrypt``: the control and bulk planes under ZeroMQ CURVE, keys derived from the run secret.

The wire test watches the loopback interface with a raw packet socket (root
only; skipped otherwise) while a real run trains: without ``--encrypt`` the
sniffer reads flodl frames off the wire, with it not one.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import zmq

from flodl.errors import EXIT_CONTROLLER_LOST
from flodl.wire import curve

from .conftest import PY, ROOT, task_spec
from .helpers.procs import PICK_PORT, Run, reserved_port

pytestmark = pytest.mark.timeout(120)


def test_the_servers_key_comes_from_the_secret():
    try:
        curve.enable(b"a" * 32)
        first = curve._server_public
        curve.enable(b"a" * 32)
        assert curve._server_public == first  # every holder of the secret derives the same key
        curve.enable(b"b" * 32)
        assert curve._server_public != first
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            curve.client(sock)
            assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        finally:
            sock.close()
    finally:
        curve.disable()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        curve.client(sock)  # off: untouched
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        sock.close()


def _sniffer_or_skip(port: int):
    if os.geteuid() != 0:
        pytest.skip("needs root (a raw packet socket on the loopback interface)")
    from .sniff import Sniffer

    sniffer = Sniffer("lo", port)
    sniffer.start()
    return sniffer


def _train(proc_env, tmp_path, port: int, *extra: str) -> dict:
    path = tmp_path / f"s{port}.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--epochs",
            "2",
            "--nproc-per-node",
            "2",
            "--mode",
            "cpu-cadence",
            "--port",
            str(port),
            "--dashboard-port",
            "-1",
            "--summary-json",
            str(path),
            *extra,
        ],
        proc_env,
    )
    assert run.wait(90) == 0, run.output
    return json.loads(path.read_text())


def _sniffed_run(proc_env, tmp_path, *extra: str) -> tuple[dict, list[bytes]]:
    port = reserved_port()  # not PICK_PORT: the sniffer must watch the port before the first frame
    sniffer = _sniffer_or_skip(port)
    try:
        summary = _train(proc_env, tmp_path, port, *extra)
    finally:
        sniffer.stop()
    assert summary["exit_reason"] == "completed" and summary["averaging"]["rounds"] > 0
    return summary, sniffer.snapshot()


def test_an_encrypted_run_trains_and_shows_nothing_on_the_wire(proc_env, tmp_path):
    _, plain = _sniffed_run(proc_env, tmp_path)
    if not plain:
        pytest.skip("the raw socket sees no loopback traffic here (a sandbox): nothing to compare against")
    assert len(plain) > 10  # without --encrypt, frames are read straight off the wire
    _, encrypted = _sniffed_run(proc_env, tmp_path, "--encrypt")
    assert encrypted == []  # with it, not one


def test_a_worker_without_encrypt_cannot_join_an_encrypted_controller(proc_env):
    env = {**proc_env, "FLODL_RUN_SECRET": os.urandom(32).hex(), "FLODL_RUN_ID": "enc-run"}
    ctl = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--workers",
            "1",
            *PICK_PORT,
            "--encrypt",
            "--join-timeout-secs",
            "8",
            "--dashboard-port",
            "-1",
        ],
        env,
    )
    try:
        port = ctl.control_port()
        worker = subprocess.run(
            [PY, "-m", "flodl.worker", "--controller", f"tcp://127.0.0.1:{port}", "--devices", "cpu", "--join-timeout-secs", "3"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert worker.returncode == EXIT_CONTROLLER_LOST, worker.stderr
        assert "if it runs with --encrypt, so must this worker" in worker.stderr
        assert ctl.wait(60) != 0  # nobody it could hear ever joined
    finally:
        ctl.kill()
