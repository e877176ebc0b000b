"""Shared fixtures: fast configs, loopback controllers, process-tree hygiene."""

from __future__ import annotations

import io
import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "tasks"

# A flodl bug the run survives (a message handler that raised: flodl.wire.transport.HandlerErrors) must
# fail the test that met it. Every process a test starts inherits this: a controller then fails
# its run, a worker its exit. In this process, ``_no_handler_errors`` below checks the tally.
os.environ["FLODL_STRICT"] = "1"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): how many test workers run files in parallel.

    Most of the suite's time is real processes that wait (heartbeat deadlines, sshd, a Slurm,
    a browser), so two workers overlap those waits even on two cores (the suite: 27 minutes in
    one process, 16 in two, on the 2-core CI machine); the heavy files each start 3-6
    processes, so beyond one worker per two cores they would only compete for CPU.
    ``FLODL_TEST_WORKERS`` overrides (``-n 0`` runs in this process)."""
    wanted = os.environ.get("FLODL_TEST_WORKERS")
    if wanted:
        return int(wanted)
    return max(2, min(8, (os.cpu_count() or 2) // 2))


class FakeClock:
    """A monotonic clock tests move by hand instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


#: The zygote server this test process's runs fork their ranks from (``_zygote_server``); 0: none.
ZYGOTE_SERVER_PID = 0


@pytest.fixture(scope="session", autouse=True)
def _zygote_server(tmp_path_factory):
    """One zygote server per test process (``FLODL_ZYGOTE_SERVER``): every worker the tests start on
    this host forks its ranks from it, already imported, instead of importing torch in a zygote of
    its own (about 2.3 s of CPU a run; half the suite's CPU was those imports). Workers in another
    network namespace (the multi-host tests' hosts) still start their own, and tests of the
    per-worker zygote take the variable away. ``FLODL_TEST_ZYGOTE_SERVER=off`` runs without it."""
    global ZYGOTE_SERVER_PID
    if os.environ.get("FLODL_TEST_ZYGOTE_SERVER", "on") == "off" or not sys.platform.startswith("linux"):
        yield
        return
    import subprocess

    from flodl.host.zygote import server_command

    path = str(tmp_path_factory.mktemp("zygote") / "zygote.sock")
    argv, env = server_command(path, parent=os.getpid())
    server = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline() if server.stdout else ""  # after its imports: a few seconds, or its death
    if not line.startswith("ready"):
        # a host where it cannot serve (a GPU host whose imports initialise CUDA: forking then is unsafe,
        # and the server says so on stderr) runs the suite as users' workers would there: without it
        server.kill()
        warnings.warn(f"the zygote server did not start (exit {server.wait(10)}): tests run without it", stacklevel=1)
        yield
        return
    os.environ["FLODL_ZYGOTE_SERVER"] = path
    ZYGOTE_SERVER_PID = server.pid
    try:
        yield
    finally:
        os.environ.pop("FLODL_ZYGOTE_SERVER", None)
        ZYGOTE_SERVER_PID = 0
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


@pytest.fixture(autouse=True)
def _no_leaked_environment():
    """Fail a test that leaves a FLODL_* or TORCH_* variable changed: every later test's processes
    inherit it (a leaked FLODL_ENCRYPT once made another test's fuzzer talk to an encrypted run)."""

    def ours():
        return {k: v for k, v in os.environ.items() if k.startswith(("FLODL_", "TORCH_"))}

    before = ours()
    yield
    after = ours()
    assert after == before, f"the test changed the environment: {sorted(set(before.items()) ^ set(after.items()))}"


@pytest.fixture(autouse=True)
def _no_handler_errors():
    """Fail a test during which a message handler of this process raised (the socket survived it)."""
    transport = sys.modules.get("flodl.wire.transport")
    before = transport.HANDLER_ERRORS.count if transport else 0
    yield
    transport = sys.modules.get("flodl.wire.transport")  # a test may have imported it
    if transport and transport.HANDLER_ERRORS.count > before:
        errors = transport.HANDLER_ERRORS
        pytest.fail(
            f"{errors.count - before} message handler error(s) during this test (a flodl bug; tracebacks in the "
            f"log): {errors.first[before] if before < len(errors.first) else ''}",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _no_leaked_zmq():
    """Fail a test that leaves a ZeroMQ socket open or a context un-terminated that it created
    (tests/helpers/zmq_leaks.py says what counts). What leaked is left as it is: closing a socket
    another thread may be using would crash the process."""
    from .helpers import zmq_leaks

    with zmq_leaks.tracking() as tracker:
        yield
    leaks = tracker.leaks()
    if leaks:
        pytest.fail(f"{len(leaks)} ZeroMQ leak(s) in this test:\n  " + "\n  ".join(leaks), pytrace=False)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def quiet_console():
    from flodl.controller.console import Console

    return Console(out=io.StringIO(), live=False)


def task_spec(name: str, func: str = "task") -> str:
    """Spec of a task file under tests/tasks/."""
    return f"{TASKS / name}:{func}"


def process_env() -> dict:
    """Environment for real-process tests: the repo importable, output unbuffered (for fixtures
    wider than one test, which cannot take ``proc_env``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def proc_env(tmp_path):
    """Environment for real-process tests: the repo importable, output unbuffered."""
    return process_env()


PY = sys.executable
