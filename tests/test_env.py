"""flodl.config.env: every FLODL_* variable's parser, and the spawn environment's round trip."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from flodl.config import env

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(env, "_warned", set())


@pytest.mark.parametrize(
    "text, on", [("1", True), ("ON", True), ("yes", True), ("true", True), ("0", False), ("off", False), ("No", False), ("false", False)]
)
def test_switches_share_one_vocabulary(monkeypatch, text, on):
    for name, read in ((env.ENCRYPT, env.encryption_requested), (env.SHM, env.shm_lane_allowed)):
        monkeypatch.setenv(name, text)
        assert read() is on
    monkeypatch.setenv(env.VRAM_POOL, text)
    assert env.vram_pool_disabled() is not on


def test_unset_switches_take_their_defaults(monkeypatch):
    for name in (env.ENCRYPT, env.SHM, env.VRAM_POOL, env.BULK_RELAY):
        monkeypatch.delenv(name, raising=False)
    assert not env.encryption_requested() and env.shm_lane_allowed() and not env.vram_pool_disabled()
    assert env.bulk_relay_setting() == "on"


def test_an_unknown_switch_value_keeps_the_default_and_warns_once(monkeypatch, caplog):
    monkeypatch.setenv(env.SHM, "of")
    with caplog.at_level(logging.WARNING, logger="flodl.config.env"):
        assert env.shm_lane_allowed() and env.shm_lane_allowed()
    assert [r.getMessage() for r in caplog.records] == ["FLODL_SHM='of' is neither on nor off: using its default (on)"]


@pytest.mark.parametrize(
    "text, setting", [("off", "off"), ("0", "off"), ("no", "off"), ("always", "always"), ("Always", "always"), ("on", "on"), ("", "on")]
)
def test_bulk_relay_is_the_users_switch(monkeypatch, text, setting):
    monkeypatch.setenv(env.BULK_RELAY, text)
    assert env.bulk_relay_setting() == setting


def _rank_env(**fields) -> env.RankEnv:
    base = {"controller": "tcp://h:1", "secret": b"s" * 16, "run_id": "r", "rank": 0, "device": "cpu", "task": "t:task"}
    return env.RankEnv(**{**base, "local_world": 1, "heartbeat_timeout_s": 3.0, "parent_pid": 7, **fields})


def test_the_relay_address_has_its_own_name(monkeypatch):
    """A worker tells its ranks the relay's address under FLODL_RELAY_ADDR; FLODL_BULK_RELAY in a
    rank's environment is the user's switch, inherited, and never read as an address."""
    rank_env = _rank_env(relay_addr="tcp://127.0.0.1:9 /p n")
    spawned = rank_env.to_env()
    assert spawned[env.RELAY_ADDR] == "tcp://127.0.0.1:9 /p n" and env.BULK_RELAY not in spawned
    for key, value in {**spawned, env.BULK_RELAY: "off"}.items():
        monkeypatch.setenv(key, value)
    assert env.RankEnv.from_environ() == rank_env


def test_a_rank_is_told_the_run_seed_and_whether_the_run_is_deterministic(monkeypatch):
    """Every run's seed reaches its ranks (their random streams derive from it); whether the run is
    deterministic travels beside it, not as a seed of -1."""
    rank_env = _rank_env(seed=7)
    for deterministic in (False, True):
        spawned = dataclasses.replace(rank_env, deterministic=deterministic).to_env()
        assert spawned[env.SEED] == "7" and spawned[env.DETERMINISTIC] == ("1" if deterministic else "0")
        for key, value in spawned.items():
            monkeypatch.setenv(key, value)
        assert env.RankEnv.from_environ() == dataclasses.replace(rank_env, deterministic=deterministic)


def test_bulk_slice_bytes(monkeypatch):
    monkeypatch.delenv(env.BULK_SLICE_BYTES, raising=False)
    assert env.bulk_slice_bytes() == 8 << 20
    monkeypatch.setenv(env.BULK_SLICE_BYTES, "4096")
    assert env.bulk_slice_bytes() == 4096
    for bad in ("0", "-1", "8M"):
        monkeypatch.setenv(env.BULK_SLICE_BYTES, bad)
        with pytest.raises(ValueError, match="FLODL_BULK_SLICE_BYTES"):
            env.bulk_slice_bytes()


def test_paths_pids_and_other_programs_variables(monkeypatch, tmp_path):
    monkeypatch.delenv(env.SHM_DIR, raising=False)
    assert env.shm_dir() == Path("/dev/shm")
    monkeypatch.setenv(env.SHM_DIR, str(tmp_path))
    assert env.shm_dir() == tmp_path
    monkeypatch.delenv(env.PARENT_PID, raising=False)
    assert env.parent_pid() == 0
    monkeypatch.setenv(env.PARENT_PID, "123")
    assert env.parent_pid() == 123
    monkeypatch.setenv(env.CUDA_VISIBLE_DEVICES, "1,0")
    assert env.cuda_visible_devices() == "1,0"
    monkeypatch.delenv(env.CUDA_VISIBLE_DEVICES)
    assert env.cuda_visible_devices() is None
    monkeypatch.setenv(env.OMP_NUM_THREADS, "")
    assert not env.omp_threads_set()
    monkeypatch.setenv(env.OMP_NUM_THREADS, "2")
    assert env.omp_threads_set()
    monkeypatch.setenv(env.INJECT_FAULT, "1:average:5")
    assert env.injected_faults() == "1:average:5"


def test_encryption_and_nccl_settings_reach_children(monkeypatch):
    # set, then delete: monkeypatch only puts back what it changed, and request_encryption()
    # writes os.environ itself; a leaked FLODL_ENCRYPT would encrypt every later test's run
    for name in (env.ENCRYPT, env.TORCH_NCCL_ASYNC_ERROR_HANDLING):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    env.request_encryption()
    env.nccl_errors_raise()
    child = env.child_environ({})
    assert child[env.ENCRYPT] == "1" and child[env.TORCH_NCCL_ASYNC_ERROR_HANDLING] == "2"
    monkeypatch.setenv(env.TORCH_NCCL_ASYNC_ERROR_HANDLING, "1")
    env.nccl_errors_raise()  # the user's choice stands
    assert env.child_environ({})[env.TORCH_NCCL_ASYNC_ERROR_HANDLING] == "1"


def test_env_is_the_only_module_that_reads_the_environment():
    root = Path(env.__file__).parent.parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "os.environ" in p.read_text() or "getenv" in p.read_text())
    assert readers == ["config/env.py"]


def test_the_summary_history_cap_can_be_lifted(monkeypatch):
    from flodl.controller.history import bounded

    rows = [{"epoch": e, "first_epoch": e, "samples": 8, "loss": 1.0, "note": "x" * 200} for e in range(400)]
    monkeypatch.setenv(env.SUMMARY_HISTORY_BYTES, "0")
    assert env.summary_history_bytes(1024) is None and bounded(rows, budget=None) == rows  # every row whole
    monkeypatch.setenv(env.SUMMARY_HISTORY_BYTES, "4096")
    assert env.summary_history_bytes(1024) == 4096
    monkeypatch.setenv(env.SUMMARY_HISTORY_BYTES, "lots")
    assert env.summary_history_bytes(1024) == 1024
    assert len(bounded(rows, budget=1024)) < len(rows)
