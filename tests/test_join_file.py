"""``--join-file``: a controller awaiting workers started by hand writes the run's credentials to a
0600 file, and ``python -m flodl.worker --join-file PATH`` joins with them; without a join file or
the run's variables the controller refuses, rather than make a secret no worker could know."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from flodl.config.joinfile import JoinInfo, read_join_file
from flodl.errors import EXIT_CONFIG, EXIT_CONTROLLER_LOST, EXIT_OK, ConfigError

from .conftest import PY, ROOT, task_spec
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(proc_env):
    """No run credentials in the environment: the join file is the only way in."""
    return {k: v for k, v in proc_env.items() if k not in ("FLODL_RUN_SECRET", "FLODL_RUN_ID")}


def worker(env: dict, join_file, *extra: str) -> subprocess.CompletedProcess:
    argv = [PY, "-m", "flodl.worker", "--join-file", str(join_file), "--devices", "cpu", *extra]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)


def test_a_hand_started_worker_joins_through_the_join_file(env, tmp_path):
    path = tmp_path / "run" / "join.json"
    ctl = Run(["--task", task_spec("tiny.py"), "--workers", "1", "--join-file", str(path), "--dashboard-port", "-1"], env)
    try:
        ctl.wait_for_line("waiting for 1 worker(s)")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        info = read_join_file(str(path))
        assert f"run {info.run_id}, secret from join file {path}" in ctl.output
        assert info.secret.hex() not in ctl.output  # said where it is, never what it is

        # another run's secret: never answered, and the worker says what to check
        wrong = tmp_path / "wrong.json"
        JoinInfo(info.run_id, os.urandom(32), info.controller).write(str(wrong))
        refused = worker(env, wrong, "--join-timeout-secs", "2")
        assert refused.returncode == EXIT_CONTROLLER_LOST, refused.stderr
        assert "another run's secret or id" in refused.stderr

        # a copy others can read: refused before it connects
        loose = tmp_path / "loose.json"
        loose.write_text(path.read_text())
        loose.chmod(0o644)
        refused = worker(env, loose)
        assert refused.returncode == EXIT_CONFIG and f"chmod 600 {loose}" in refused.stderr

        joined = worker(env, path)
        assert joined.returncode == EXIT_OK, joined.stderr
        assert ctl.wait(90) == EXIT_OK, ctl.output
        assert "done in" in ctl.output
        assert not path.exists()  # the run is over: its secret is not left lying around
    finally:
        ctl.kill()


def test_external_workers_without_the_runs_secret_are_refused(env):
    ctl = Run(["--task", task_spec("tiny.py"), "--workers", "1", "--dashboard-port", "-1"], env)
    assert ctl.wait(60) == EXIT_CONFIG
    assert "FLODL_RUN_SECRET" in ctl.output and "--join-file PATH" in ctl.output


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("not json", "not JSON"),
        ({"secret": "ab" * 32, "controller": "tcp://h:1"}, "'run_id' is missing"),
        ({"run_id": "r", "secret": "zz", "controller": "tcp://h:1"}, "'secret' must be hex"),
        ({"run_id": "r", "secret": "ab" * 32, "controller": "h:1"}, "'controller' must be tcp://HOST:PORT"),
    ],
)
def test_a_malformed_join_file_names_what_is_wrong(tmp_path, body, says):
    path = tmp_path / "join.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="join_file: .*" + says.replace("(", r"\(")) as exc:
        read_join_file(str(path))
    assert "ab" * 32 not in str(exc.value)


def test_the_join_file_is_documented_where_its_option_is_listed():
    from flodl.controller.launch import build_parser

    assert "--join-file PATH" in build_parser().format_help()
    for doc in ("README.md", "docs/options.md", "docs/multihost.md"):
        assert "--join-file" in (ROOT / doc).read_text(), doc


def test_the_trainer_refuses_external_workers_without_the_runs_secret(monkeypatch):
    from flodl import Trainer

    monkeypatch.delenv("FLODL_RUN_SECRET", raising=False)
    monkeypatch.delenv("FLODL_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match="workers: workers started by hand need this run's secret"):
        Trainer.builder(task_spec("tiny.py")).workers(1).run()
