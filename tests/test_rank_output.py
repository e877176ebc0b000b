"""A rank's printed lines come out whole and named (flodl/rank/output.py), as torchrun --tee's do,
and with --log-dir in files of its own as well (flodl/host/rank_logs.py), as torchrun --log-dir's."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from flodl.config.joinfile import read_join_file
from flodl.errors import EXIT_OK

from .conftest import PY, TASKS, task_spec
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


def rank_files(log_dir, run_id: str, rank: int) -> tuple[list[str], list[str]]:
    folder = log_dir / run_id / f"rank{rank}"
    return (folder / "stdout.log").read_text().splitlines(), (folder / "stderr.log").read_text().splitlines()


@pytest.mark.parametrize("zygote", ["on", "off"])  # ranks forked by the zygote, or exec'd
def test_log_dir_keeps_each_script_ranks_streams_in_files_of_its_own(proc_env, tmp_path, zygote):
    logs, summary = tmp_path / "logs", tmp_path / "s.json"
    args = ["--script", str(TASKS / "chatty_script.py"), "--nproc-per-node", "2", "--epochs", "1", "--no-progress"]
    run = Run([*args, "--log-dir", str(logs), "--summary-json", str(summary)], {**proc_env, "FLODL_ZYGOTE": zygote})
    assert run.wait(90) == 0, run.output
    run_id = json.loads(summary.read_text())["run_id"]
    for rank in (0, 1):
        out, err = rank_files(logs, run_id, rank)
        # every line, whole, without the console's "[rank N] " (the file names the rank), and what
        # the process wrote below Python too
        assert [line for line in out if line.startswith("DIST")] == [f"DIST{rank} line {i} end" for i in range(200)]
        assert f"RAW{rank}" in out
        assert [line for line in err if line.startswith("ERR")] == [f"ERR{rank} {i}" for i in range(200)]
    # the console is as without --log-dir
    assert sum("DIST" in line or "ERR" in line for line in run.lines) == 2 * 2 * 200
    assert "[rank 1] DIST1 line 199 end" in run.lines and "RAW0" in run.output


def test_a_hand_started_worker_writes_its_ranks_logs_on_its_own_host(proc_env, tmp_path):
    """--workers 1: the worker (its working directory standing for another host) writes its ranks'
    files under the relative --log-dir there; the controller's host gets none. Task mode."""
    ctl_dir, host_dir, join = tmp_path / "controller", tmp_path / "host", tmp_path / "join.json"
    ctl_dir.mkdir()
    host_dir.mkdir()
    env = {k: v for k, v in proc_env.items() if k not in ("FLODL_RUN_SECRET", "FLODL_RUN_ID")}
    args = ["--task", task_spec("tiny.py"), "--workers", "1", "--join-file", str(join), "--epochs", "1", "--no-progress"]
    ctl = Run([*args, "--dashboard-port", "-1", "--log-dir", "logs"], env, cwd=ctl_dir)
    try:
        ctl.wait_for_line("waiting for 1 worker(s)")
        run_id = read_join_file(str(join)).run_id
        worker = [PY, "-m", "flodl.worker", "--join-file", str(join), "--devices", "cpu,cpu"]
        done = subprocess.run(worker, env={**env, "FLODL_TEST_SAY": "1"}, cwd=host_dir, capture_output=True, text=True, timeout=90)
        assert done.returncode == EXIT_OK, done.stderr
        assert ctl.wait(60) == EXIT_OK, ctl.output
    finally:
        ctl.kill()
    for rank in (0, 1):
        out, err = rank_files(host_dir / "logs", run_id, rank)
        assert f"SAY rank {rank}" in out and f"RAW rank {rank}" in err
        assert f"[rank {rank}] SAY rank {rank}" in done.stdout  # the worker's console, as without --log-dir
    assert not (ctl_dir / "logs").exists()


def test_a_log_dir_that_cannot_be_made_is_said_and_the_ranks_write_to_the_console(proc_env, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "1", "--epochs", "1", "--no-progress", "--log-dir", str(blocker / "logs")]
    run = Run(args, {**proc_env, "FLODL_TEST_SAY": "1"})
    assert run.wait(90) == 0, run.output
    assert "cannot write rank logs under" in run.output and "SAY rank 0" in run.output
