"""The zygote: ranks forked from one pre-imported process (host/zygote.py, rank/zygote.py).

A forked rank must look and behave as an exec'd one: its own command line and
environment in /proc, exit statuses as asyncio reports them (negative for a
signal), and no process left when the worker is killed outright. The exec
path stays for FLODL_ZYGOTE=off and whenever the zygote cannot fork.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import psutil
import pytest

from flodl.config.env import child_environ
from flodl.host.zygote import Zygote

from .conftest import PY, task_spec
from .helpers.procs import Run, assert_all_gone, is_rank, runs_module


@pytest.fixture(autouse=True)
def _own_zygote(monkeypatch):
    """These tests are about a worker's own zygote: not the suite's shared server (conftest.py)."""
    monkeypatch.delenv("FLODL_ZYGOTE_SERVER", raising=False)


#: Only a cap: close() returns as soon as the zygote has exited, so a slow machine costs no failure.
CLOSE_GRACE_S = 60.0

#: Writes what a fresh ``python SCRIPT ARGS`` would see, then exits with argv[2] (or waits to be killed).
PROBE = """
import json, os, sys, time
with open(sys.argv[1], "w") as f:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "ppid": os.getppid(), "probe": os.environ.get("PROBE"),
               "path0": sys.path[0], "name": __name__, "torch": "torch" in sys.modules}, f)
if sys.argv[2] == "wait":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


async def _spawn(zygote: Zygote, probe, out, how: str):
    child = await zygote.spawn([PY, str(probe), str(out), how], child_environ({"PROBE": how}))
    assert child is not None, "the zygote declined a fork it can serve"
    return child


async def _seen(out) -> dict:
    """What the probe wrote, once it has (it starts before it writes)."""
    async with asyncio.timeout(60):
        while not out.exists() or not out.read_text():
            await asyncio.sleep(0.02)
    return json.loads(out.read_text())


@pytest.mark.timeout(90)
async def test_a_forked_script_sees_a_fresh_interpreters_world_and_its_exits_are_reported(probe, tmp_path):
    zygote = await Zygote.start(devnull_stdin=True)
    assert zygote is not None
    try:
        done = await _spawn(zygote, probe, tmp_path / "a.json", "3")
        assert await done.wait() == 3
        seen = await _seen(tmp_path / "a.json")
        assert seen == {
            "argv": [str(probe), str(tmp_path / "a.json"), "3"],
            "cwd": os.getcwd(),
            "ppid": zygote.pid,
            "probe": "3",  # the request's environment, not the zygote's
            "path0": str(probe.parent),  # as python SCRIPT puts the script's folder first
            "name": "__main__",
            "torch": True,  # pre-imported: the point of it
        }
        waiting = await _spawn(zygote, probe, tmp_path / "b.json", "wait")
        await _seen(tmp_path / "b.json")
        proc = psutil.Process(waiting.pid)
        assert proc.cmdline() == [PY, str(probe), str(tmp_path / "b.json"), "wait"]  # ps shows the child's own line
        assert proc.environ()["PROBE"] == "wait"  # and /proc its own environment
        waiting.kill()
        assert await waiting.wait() == -signal.SIGKILL  # as asyncio reports a signal
        with pytest.raises(ProcessLookupError):
            waiting.kill()
    finally:
        await zygote.close(CLOSE_GRACE_S)
    assert zygote.proc.returncode == 0


@pytest.mark.timeout(90)
async def test_children_of_a_dead_zygote_are_ended_and_reported_and_later_spawns_exec(probe, tmp_path, caplog):
    zygote = await Zygote.start(devnull_stdin=True)
    assert zygote is not None
    child = await _spawn(zygote, probe, tmp_path / "c.json", "wait")
    await _seen(tmp_path / "c.json")
    process = psutil.Process(child.pid)
    zygote.proc.kill()
    with caplog.at_level(logging.WARNING, logger="flodl.host.zygote"):
        assert await child.wait() == -signal.SIGKILL  # a plain script has no PDEATHSIG: the worker's side killed it
        assert_all_gone([process], timeout=60)
        assert await zygote.spawn([PY, str(probe), str(tmp_path / "d.json"), "0"], {}) is None  # the worker execs it
    assert "the zygote cannot fork ranks (the zygote ended, exit code -9): they start by exec" in caplog.text
    await zygote.close(CLOSE_GRACE_S)


@pytest.mark.timeout(90)
async def test_a_zygote_with_threads_declines_to_fork(probe, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # numpy's BLAS then starts a thread at import
    zygote = await Zygote.start(devnull_stdin=True)
    assert zygote is not None
    try:
        with caplog.at_level(logging.INFO, logger="flodl.host.zygote"):
            assert await zygote.spawn([PY, str(probe), str(tmp_path / "e.json"), "0"], {}) is None
            assert await zygote.spawn([PY, "-X", "dev", str(probe)], {}) is None  # interpreter options: exec
        assert "threads: a fork would lose all but one" in caplog.text
        assert caplog.text.count("cannot fork") == 1  # said once
        assert all(r.levelno == logging.INFO for r in caplog.records)  # a host's fact, not a warning
    finally:
        await zygote.close(CLOSE_GRACE_S)


def _tiny(proc_env, *, epochs: int, **env: str) -> Run:
    # CPU ranks named: on a one-GPU host two ranks would otherwise ask for NCCL on one GPU
    args = ["--task", task_spec("tiny.py"), "--devices", "cpu,cpu", "--epochs", str(epochs), "--heartbeat-timeout-secs", "5"]
    return Run(args, {**proc_env, **env})


@pytest.mark.timeout(120)
def test_ranks_are_the_zygotes_children_and_a_killed_worker_leaves_none_of_them(proc_env):
    run = _tiny(proc_env, epochs=200, FLODL_TEST_STEP_SLEEP="0.02")
    ranks = run.ranks(2)
    run.wait_for_line("epoch 1/200")
    [zygote] = {rank.parent() for rank in ranks}
    assert runs_module(zygote, "flodl.rank.zygote")
    worker = zygote.parent()
    assert runs_module(worker, "flodl.worker")
    for rank in ranks:
        assert rank.cmdline() == [PY, "-m", "flodl.rank"]
        assert rank.environ()["FLODL_PARENT_PID"] == str(zygote.pid)  # the parent it dies with
    assert sorted(rank.environ()["FLODL_RANK"] for rank in ranks) == ["0", "1"]
    # the run's store is the zygote's child too (host/store_server.py): the controller opened none,
    # and so never imported torch (2 s of CPU it used to spend at every start)
    [store] = [p for p in zygote.children() if runs_module(p, "flodl.host.store_server")]
    controller = psutil.Process(run.proc.pid)
    assert not [m.path for m in controller.memory_maps() if "libtorch" in m.path], "the controller loaded torch"
    worker.kill()  # SIGKILL: nothing of the worker runs; PDEATHSIG ends the zygote, then its ranks
    assert run.wait(60) == 3, run.output
    assert_all_gone([zygote, store, *ranks], timeout=60)


@pytest.mark.timeout(120)
def test_with_the_zygote_off_the_worker_execs_its_ranks(proc_env):
    run = _tiny(proc_env, epochs=5, FLODL_ZYGOTE="off", FLODL_TEST_STEP_SLEEP="0.02")
    ranks = run.ranks(2)
    tree = run.tree()
    assert not [p for p in tree if runs_module(p, "flodl.rank.zygote")]
    assert not [p for p in tree if runs_module(p, "flodl.host.store_server")]  # the controller opens the store itself
    assert {runs_module(rank.parent(), "flodl.worker") for rank in ranks} == {True}
    assert all(is_rank(rank) for rank in ranks)
    assert run.wait(90) == 0, run.output


def test_the_zygote_runs_what_python_would_and_leaves_the_rest_to_exec():
    from flodl.rank.zygote import INTERPRETER_PATH, child_sys_path, entry

    assert entry([PY, "-m", "flodl.rank"]) == ("module", "flodl.rank", [])
    assert entry([PY, "train.py", "--lr", "1"]) == ("script", "train.py", ["--lr", "1"])
    for argv in ([PY], [PY, "-X", "dev", "train.py"], ["/other/python", "train.py"]):
        with pytest.raises(ValueError):
            entry(argv)
    # as a fresh interpreter: the first entry, PYTHONPATH's (an empty one is the working directory), its own
    path = child_sys_path("/first", os.pathsep.join(["/a", "", "rel"]))
    assert path == ["/first", "/a", os.getcwd(), os.path.join(os.getcwd(), "rel"), *INTERPRETER_PATH]


#: In a fresh interpreter: the preimport's verdict, then the driver's state before and after torch starts CUDA.
DRIVER_PROBE = """
import json, sys, torch
from flodl.rank import zygote
verdict = zygote.preimport()
before = zygote.cuda_driver_initialised()
after = None
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # torch starts the driver: a fork would be unsafe from here on
    after = zygote.cuda_driver_initialised()
print(json.dumps({"verdict": verdict, "before": before, "after": after}))
"""


@pytest.mark.timeout(120)
def test_a_cuda_build_importing_torch_leaves_the_zygote_free_to_fork(proc_env):
    # a CUDA build maps libcuda.so while importing and starts nothing; the zygote used to read the
    # mapping as a start and refused every GPU host. Here (no GPU) it checks the verdict only; on
    # the GPU machine it also checks that a real start of the driver is still seen.
    import subprocess

    res = subprocess.run([PY, "-c", DRIVER_PROBE], env=proc_env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr[-2000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["verdict"] == "" and seen["before"] is False
    assert seen["after"] in (None, True)
