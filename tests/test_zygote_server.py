"""The zygote server (``python -m flodl.rank.zygote --serve PATH``, ``FLODL_ZYGOTE_SERVER``).

One pre-imported process forks the ranks of every worker of the host that
connects. What a worker's own zygote gives by being its child must hold here
too: a rank's output goes where its worker's goes (the stdio travels with the
hello), a worker that ends (or is killed) takes its ranks with it, and one
session's children hold nothing of another's. A worker that cannot use the
server (another user, other namespaces, no server) starts its own zygote.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess

import psutil
import pytest

from flodl.host.fork_context import namespaces, startup_settings
from flodl.host.zygote import Zygote, _mismatch, server_command

from .conftest import PY, ROOT, task_spec
from .helpers.procs import Proc, Run, assert_all_gone, is_rank, runs_module

CLOSE_GRACE_S = 60.0

#: A worker's side in a process of its own: connect, fork CHILD (which prints, then waits), say its pid.
CLIENT = """
import asyncio, sys
from flodl.config.env import child_environ
from flodl.host.zygote import Zygote

async def main():
    zygote = await Zygote.connect(sys.argv[1], devnull_stdin=True)
    assert zygote is not None, "not connected"
    child = await zygote.spawn([sys.executable, sys.argv[2]], child_environ({}))
    print("child", child.pid, flush=True)
    await child.wait()

asyncio.run(main())
"""

#: The forked child: one line to each of its stdout and stderr, then it waits to be ended.
CHILD = """
import sys, time
print("out from the child", flush=True)
print("err from the child", file=sys.stderr, flush=True)
time.sleep(600)
"""


@pytest.fixture
def server(tmp_path):
    """A server of this test's own (not the suite's): its path, once it serves."""
    path = str(tmp_path / "z.sock")
    argv, env = server_command(path, parent=os.getpid())
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("ready"), "the server did not start"
    yield path, proc
    proc.terminate()
    assert proc.wait(30) == 0  # SIGTERM: a clean stop, its children killed on the way


@pytest.mark.timeout(120)
def test_a_workers_ranks_write_to_its_output_and_go_when_it_is_killed(server, tmp_path):
    path, proc = server
    (tmp_path / "client.py").write_text(CLIENT)
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    client = Proc([PY, str(tmp_path / "client.py"), path, str(tmp_path / "child.py")], env)
    client.wait_for_line("err from the child")  # stderr: the worker's, handed over with the hello
    client.wait_for_line("out from the child")
    pid = int(next(line.split()[1] for line in client.lines if line.startswith("child ")))
    child = psutil.Process(pid)
    assert child.ppid() == proc.pid  # forked by the server, not by the client
    client.kill()  # SIGKILL: the session's end is the server's only sign
    assert_all_gone([child], timeout=60)


@pytest.mark.timeout(120)
async def test_a_session_closes_at_once_while_another_sessions_child_runs(server, tmp_path):
    path, _ = server
    (tmp_path / "child.py").write_text(CHILD)
    first = await Zygote.connect(path, devnull_stdin=True)
    second = await Zygote.connect(path, devnull_stdin=True)
    assert first is not None and second is not None
    child = await first.spawn([PY, str(tmp_path / "child.py")], dict(os.environ))
    assert child is not None
    # forked while the second session was open: had it kept a copy of the server's end of that
    # socket, the second worker's close would wait out its grace for an end-of-file never coming
    await second.close(CLOSE_GRACE_S)
    assert second._listener.done() and not second._listener.cancelled()
    assert psutil.Process(child.pid).is_running()  # the first session's child lives on
    await first.close(CLOSE_GRACE_S)
    assert await asyncio.wait_for(child.wait(), 60) == -signal.SIGKILL  # the worker's side ends what it left


def test_a_server_is_used_only_from_its_user_and_namespaces():
    ours = {"ready": 1, "namespaces": namespaces(), "uid": os.getuid(), "startup": startup_settings(dict(os.environ))}
    assert _mismatch(ours) == ""
    assert _mismatch({}) == "no ready line"
    assert _mismatch({**ours, "uid": os.getuid() + 1}) == f"it runs as uid {os.getuid() + 1}"
    assert _mismatch({**ours, "namespaces": {**ours["namespaces"], "net": "net:[1]"}}) == "other net namespaces"
    # torch's threads and the interpreter's PYTHON* settings are fixed at its start: the server's would be the ranks'
    threads = {**ours, "startup": {**ours["startup"], "OMP_NUM_THREADS": "7"}}
    assert _mismatch(threads) == "other interpreter settings (OMP_NUM_THREADS)"
    assert startup_settings({"PYTHONPATH": "/x", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0", "HOME": "/"}) == {"PYTHONHASHSEED": "0"}


@pytest.mark.timeout(60)
async def test_without_a_server_there_is_no_session(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="flodl.host.zygote"):
        assert await Zygote.connect(str(tmp_path / "none.sock"), devnull_stdin=True) is None
    assert "not usable" in caplog.text


@pytest.mark.timeout(120)
def test_a_run_forks_its_ranks_from_the_server_and_a_killed_worker_leaves_none(server, proc_env):
    path, proc = server
    # CPU ranks named: on a one-GPU host two ranks would otherwise ask for NCCL on one GPU
    args = ["--task", task_spec("tiny.py"), "--devices", "cpu,cpu", "--epochs", "200", "--heartbeat-timeout-secs", "5"]
    run = Run(args, {**proc_env, "FLODL_ZYGOTE_SERVER": path, "FLODL_TEST_STEP_SLEEP": "0.02"})
    run.wait_for_line("epoch 1/200")
    ranks = [p for p in psutil.Process(proc.pid).children() if is_rank(p)]
    assert len(ranks) == 2 and sorted(r.environ()["FLODL_RANK"] for r in ranks) == ["0", "1"]
    assert not [p for p in psutil.Process(run.proc.pid).children(recursive=True) if runs_module(p, "flodl.rank.zygote")]
    [worker] = [p for p in psutil.Process(run.proc.pid).children(recursive=True) if runs_module(p, "flodl.worker")]
    worker.kill()
    assert run.wait(60) == 3, run.output
    assert_all_gone(ranks, timeout=60)
