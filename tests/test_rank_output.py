"""A rank's printed lines come out whole and named (flodl/rank/output.py), as torchrun --tee's do."""

from __future__ import annotations

import re

import pytest

from .conftest import TASKS
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)


def test_every_line_a_rank_prints_is_whole_and_names_its_rank(proc_env):
    args = ["--script", str(TASKS / "chatty_script.py"), "--nproc-per-node", "2", "--epochs", "1", "--no-progress"]
    run = Run(args, proc_env)
    assert run.wait(90) == 0, run.output
    lines = [line for line in run.lines if "DIST" in line or "ERR" in line]
    assert len(lines) == 2 * 2 * 200, run.output[-3000:]  # every line of both ranks, none merged with another
    for line in lines:
        m = re.fullmatch(r"\[rank (\d)\] (?:DIST(\d) line \d+ end|ERR(\d) \d+)", line)
        assert m is not None and m.group(1) == (m.group(2) or m.group(3)), line


def test_the_prefix_can_be_turned_off(proc_env):
    args = ["--script", str(TASKS / "chatty_script.py"), "--nproc-per-node", "1", "--epochs", "1", "--no-progress"]
    run = Run(args, {**proc_env, "FLODL_RANK_PREFIX": "off"})
    assert run.wait(90) == 0, run.output
    assert "DIST0 line 0 end" in run.lines and not any(line.startswith("[rank 0] DIST") for line in run.lines)
