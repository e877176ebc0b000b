"""Start-up (issue 19): one line per phase from launch to the first batch, its seconds in the final
line and the summary, none of it under ``--no-progress``."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
import time

import pytest

from flodl.config import DdpRunConfig
from flodl.controller import Controller, LaunchOptions
from flodl.controller.console import Console
from flodl.controller.startup import Startup, process_started_unix
from flodl.testing.sim import SimRankSpec, SimWorker

from .conftest import FakeClock

SECRET = b"s" * 32
_PHASES = ["worker up on", "ranks built their task 2/2", "process group formed, 2 ranks", "first batch trained"]


def _phases(startup: Startup, clock: FakeClock) -> None:
    """A two-rank start on one worker, two seconds a phase."""
    startup.worker_up(1, 1)
    startup.workers_up(["h"], 2)
    clock.advance(2.0)
    startup.rank_built(1, 2)
    startup.rank_built(2, 2)
    startup.ranks_built(2, 2, params=40_000, samples=1500)
    clock.advance(2.0)
    startup.group_formed(2, collective=True)
    clock.advance(2.0)
    startup.first_batch()
    startup.first_batch()  # a phase ends once


def test_a_log_gets_one_line_per_phase_counted_from_the_start():
    out, wall = io.StringIO(), FakeClock(100.0)
    startup = Startup(Console(out=out, live=False), started_unix=99.5, wall=wall)
    _phases(startup, wall)
    lines = out.getvalue().splitlines()
    assert lines == [
        "start-up  0.5 s: worker up on h: 2 rank(s) starting (importing torch, building the task)",
        "start-up  2.5 s: ranks built their task 2/2 (40,000 parameters, 1,500 samples)",
        "start-up  4.5 s: process group formed, 2 ranks hold rank 0's parameters",
        "start-up  6.5 s: first batch trained",
    ]
    assert startup.startup_s == 6.5
    assert startup.summary() == {
        "started_unix": 99.5,
        "workers_up_s": 0.5,
        "ranks_built_s": 2.5,
        "group_formed_s": 4.5,
        "first_batch_s": 6.5,
    }


def test_a_terminal_also_sees_the_counts_rewritten_in_place():
    out, wall = io.StringIO(), FakeClock(0.0)
    startup = Startup(Console(out=out, live=True), started_unix=0.0, wall=wall)
    startup.worker_up(1, 3)
    startup.worker_up(2, 3)
    startup.worker_up(3, 3)  # the last one ends the phase: the conductor's workers_up says so
    startup.workers_up([f"host{i}" for i in range(6)], 6)
    startup.rank_built(1, 6)
    text = out.getvalue()
    assert "\r\033[Kstart-up  0.0 s: workers up 1/3\r\033[Kstart-up  0.0 s: workers up 2/3\r\033[K" in text
    assert "workers up 3/3" not in text  # not counted, ended
    assert "6 workers up on 6 hosts: 6 rank(s) starting" in text  # past four hosts, counted, not named
    assert text.endswith("\r\033[Kstart-up  0.0 s: ranks built their task 1/6")


def test_no_progress_silences_start_up_and_progress_but_not_epochs_or_the_end(clock):
    out = io.StringIO()
    console = Console.for_progress(False)
    console.out, console.clock = out, clock
    wall = FakeClock(0.0)
    startup = Startup(console, wall=wall)
    _phases(startup, wall)
    clock.advance(10.0)
    assert not console.due()
    console.progress(epoch=0, epochs=1, done=5, total=10, rate=5.0, loss=None)
    console.done({"wall_s": 2.0, "startup_s": 7.31, "samples_per_s": 10.0, "final_eval": None, "final_loss": None})
    assert out.getvalue() == "done in 2.0 s (start-up 7.3 s): 10 samples/s\n"
    assert Console.for_progress(None).quiet is False and Console.for_progress(True).live is True


@pytest.mark.timeout(60)
def test_the_process_start_is_read_from_the_kernel():
    """A child's start is after the moment it was launched and before it answered (to a 10 ms tick)."""
    before = time.time()
    code = "from flodl.controller.startup import process_started_unix as p; print(p(), flush=True)"
    started = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    after = time.time()
    assert before - 0.02 <= started <= after
    mine = process_started_unix()
    assert mine is not None and mine < before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("progress", [None, False])
async def test_a_run_says_each_phase_once_in_order_and_sums_it_up(progress):
    """A controller and a simulated worker of two ranks over real sockets: the phases in order, the
    start-up in the last line and the summary; ``--no-progress`` prints none of the phases."""
    out = io.StringIO()
    console = Console.for_progress(progress)
    console.out, console.live = out, False
    launch = LaunchOptions(task="sim:task", epochs=1, workers=1, progress=progress, join_timeout_secs=20.0)
    started = time.time() - 1.0  # as if the process started a second ago
    ctl = Controller(
        launch, DdpRunConfig().with_mode("nccl-cadence"), secret=SECRET, run_id="startup-run", console=console, started_unix=started
    )
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    sim = SimWorker(f"tcp://127.0.0.1:{ctl.port}", SECRET, "startup-run", [SimRankSpec(), SimRankSpec()], dataset_len=200, batch_size=10)
    worker = asyncio.create_task(sim.run())
    summary = await run
    await asyncio.wait_for(worker, 10)
    lines = out.getvalue().splitlines()
    marks = summary["startup"]
    assert marks["started_unix"] == started
    spans = [marks[k] for k in ("workers_up_s", "ranks_built_s", "group_formed_s", "first_batch_s")]
    assert spans[0] >= 1.0 and spans == sorted(spans) and summary["startup_s"] == spans[-1]
    assert re.fullmatch(rf"done in \d+\.\d s \(start-up {summary['startup_s']:.1f} s\): .*", lines[-1]), lines
    said = [i for phase in _PHASES for i, line in enumerate(lines) if line.startswith("start-up") and phase in line]
    if progress is False:
        assert said == [] and not any(line.startswith("start-up") for line in lines), lines
    else:
        assert len(said) == len(_PHASES) and said == sorted(said), lines
        header = next(i for i, line in enumerate(lines) if line.startswith("flodl run"))
        assert said[-2] < header < said[-1]  # the group forms before training begins, its first batch after


_EXIT_WHILE_STORE_OPENS = """
import threading, sys
import torch.distributed as dist
from flodl.controller import exit_process
from flodl.controller.plane import STORE_THREAD
threading.Thread(target=lambda: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False),
                 name=STORE_THREAD, daemon=True).start()
print("leaving", flush=False)
exit_process(3)
"""


@pytest.mark.timeout(120)
def test_a_run_that_ends_while_its_store_is_still_opening_exits_with_its_own_code():
    """A run stopped in its first second (a rank lost while the rest build) can leave the store
    thread inside torch's TCPStore constructor; finalising the interpreter under it aborted the
    controller (exit -6, "terminate called without an active exception"; every try here aborts
    without exit_process's care). The run's own exit code and its last output still come out."""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_STORE_OPENS], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (3, "leaving\n"), done.stderr
