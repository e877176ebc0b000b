"""A save path belongs to one run, and a save never lies about what is on disk.

Two controllers on one ``--save-path``: the second is refused at the door (exit 2, naming the run
that holds the stem), the first keeps a whole bundle, and a resume from that stem onto it works
once the first is done. A disk that fills mid-run: every failed save deletes what it wrote, says
which bundle on disk is the newest valid one, and a failed final save ends the run with exit 10
(``completed_unsaved``), not "done". Underneath: the lock (``flodl/checkpoint/lock.py``), temporary
names of a writer's own, and commits that delete only their own run's files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from flodl.checkpoint.atomic_file import write_atomic
from flodl.checkpoint.bundle import read_meta
from flodl.checkpoint.lock import SaveLock, SavePathBusy
from flodl.config import DdpRunConfig
from flodl.controller.checkpoints import Checkpointer
from flodl.errors import EXIT_UNSAVED
from flodl.rank.saving import checkpoint, emergency_save

from .conftest import ROOT, task_spec
from .helpers.procs import Proc, Run

pytestmark = pytest.mark.timeout(120)

META = {"epoch": 1, "global_step": 5, "world_at_save": 1, "coverage": {}, "run_id": "r"}


def _net_and_opt():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    return net, opt


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# ------------------------------------------------------------------ the lock


def test_a_held_save_path_is_refused_naming_its_holder_and_a_dead_holders_lock_is_no_obstacle(tmp_path):
    """A process holds the stem (as a controller does); another asking for it is told who (run id,
    pid, host). Killed with SIGKILL, the holder leaves no lock behind: the next run takes the stem."""
    stem = tmp_path / "ck" / "run"
    code = f"import sys, time; from flodl.checkpoint.lock import SaveLock; SaveLock.take({str(stem)!r}, 'run-a'); print('held', flush=True); time.sleep(60)"
    holder = Proc([sys.executable, "-c", code], {**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        holder.wait_for_line("held", timeout=60)
        with pytest.raises(SavePathBusy) as busy:
            SaveLock.take(stem, "run-b")
        assert f"run run-a, pid {holder.proc.pid} on host {socket.gethostname()}" in str(busy.value)
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.wait(10)
        lock = SaveLock.take(stem, "run-b")  # the kernel dropped the dead holder's lock
    finally:
        holder.kill()
    with pytest.raises(SavePathBusy, match="run run-b"):  # held by this process now: a second open is refused too
        SaveLock.take(stem, "run-c")
    lock.release()
    assert not (tmp_path / "ck" / "run.lock").exists()
    SaveLock.take(stem, "run-c").release()


def test_a_checkpointer_claims_its_save_path_and_says_which_bundle_is_on_disk(tmp_path):
    stem = tmp_path / "run"
    first = Checkpointer(DdpRunConfig().with_save_path(str(stem)), say=lambda line: None)
    first.claim("run-a")
    assert first.newest() == f"no bundle of {stem} is on disk (nothing to resume from)"
    net, opt = _net_and_opt()
    msg = first.request(rank=0, reason="checkpoint", epoch=1, meta=META, call_fn=False)
    assert first.on_done(
        checkpoint(rank=0, model=net, optimizer=opt, stem=msg.stem, tag=msg.tag, version=msg.version, call_fn=None, handle=None)
    )
    assert f"this run's save with 1 epoch(s) complete (tag {msg.tag}, reason checkpoint)" in first.newest()
    second = Checkpointer(DdpRunConfig().with_save_path(str(stem)), say=lambda line: None)
    with pytest.raises(ValueError, match=r"save_path: .*run run-a, pid \d+ on host .*give this run another --save-path"):
        second.claim("run-b")
    first.release()
    second.claim("run-b")  # free once the first is done: the resume case
    assert f"an earlier run's (r) save with 1 epoch(s) complete (tag {msg.tag}" in second.newest()
    second.release()


# ------------------------------------------------------- writes and deletions


def test_a_failed_write_leaves_no_temporary_and_writers_never_share_one(tmp_path):
    target = tmp_path / "f.bin"
    with pytest.raises(TypeError):
        write_atomic(target, [b"half", "not bytes"])  # type: ignore[list-item]
    assert _names(tmp_path) == set()  # it was f.bin.tmp, left forever
    # writers of one path at once: each through its own temporary, so each rename is whole
    blobs = [bytes([i]) * (1 << 20) for i in range(4)]
    errors: list[BaseException] = []

    def write(blob: bytes) -> None:
        try:
            for _ in range(10):
                write_atomic(target, [blob])
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(blob,)) for blob in blobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors  # a shared f.bin.tmp: one writer's rename took the other's file away
    assert target.read_bytes() in blobs and _names(tmp_path) == {"f.bin"}


def test_a_commit_never_deletes_another_runs_files(tmp_path):
    """Two runs' checkpointers on one stem (as without the lock): run B's commit deletes only B's
    superseded files and the files of the sidecar it replaced, never run A's save in flight."""
    stem = tmp_path / "run"
    net, opt = _net_and_opt()
    a, b = (Checkpointer(DdpRunConfig().with_save_path(str(stem)), say=lambda line: None) for _ in range(2))

    def write(ck: Checkpointer):
        msg = ck.request(rank=0, reason="checkpoint", epoch=1, meta=META, call_fn=False)
        done = checkpoint(rank=0, model=net, optimizer=opt, stem=msg.stem, tag=msg.tag, version=msg.version, call_fn=None, handle=None)
        return done, {f"run.{msg.tag}.fdl", f"run.{msg.tag}.optim"}

    b_first, b_files = write(b)
    assert b.on_done(b_first)
    a_in_flight, a_files = write(a)  # written, not committed yet
    assert b.on_done(write(b)[0])  # replaces b's first sidecar: its files go, a's stay (before: a's went too)
    assert a_files <= _names(tmp_path) and not b_files & _names(tmp_path)
    assert a.on_done(a_in_flight)  # a's files are whole: its commit is a bundle
    read_meta(stem)


def test_a_failed_save_deletes_the_file_whose_partner_failed(tmp_path):
    """The model file written, the optimizer file failed (its state is not JSON): the model file is
    no bundle. An emergency save deletes it itself; a consensus save's is deleted by the controller."""
    net, opt = _net_and_opt()
    bad_state = {"scheduler": object()}  # a scheduler holding a function: flodl saves no pickle
    emergency_save(
        model=net,
        optimizer=opt,
        stem=str(tmp_path / "lost"),
        rank=0,
        reason="controller_lost",
        why="t",
        epoch=0,
        global_step=1,
        train_state=bad_state,
    )
    assert _names(tmp_path) == set()  # was: lost.rank0.<tag>.fdl with no optimizer file, no sidecar
    said: list[str] = []
    ck = Checkpointer(DdpRunConfig().with_save_path(str(tmp_path / "run")), say=said.append)
    msg = ck.request(rank=0, reason="checkpoint", epoch=1, meta=META, call_fn=False)
    done = checkpoint(
        rank=0, model=net, optimizer=opt, stem=msg.stem, tag=msg.tag, version=msg.version, call_fn=None, handle=None, train_state=bad_state
    )
    assert done.error and (tmp_path / f"run.{msg.tag}.fdl").exists()  # the rank leaves it: the controller knows the save failed
    assert not ck.on_done(done)
    assert _names(tmp_path) == set()
    assert said and said[-1].endswith(f"no bundle of {tmp_path / 'run'} is on disk (nothing to resume from)"), said
    assert [u["reason"] for u in ck.unsaved] == ["checkpoint"]


# ---------------------------------------------------------- real processes


def _run(env: dict, tmp_path: Path, *args: str, epochs: int, name: str) -> tuple[Run, Path]:
    path = tmp_path / name
    argv = ["--task", task_spec("tiny.py", "momentum_task"), "--nproc-per-node", "2", "--epochs", str(epochs)]
    argv += ["--heartbeat-timeout-secs", "4", "--dashboard-port", "-1", "--summary-json", str(path), *args]
    return Run(argv, env), path


@pytest.mark.timeout(240)
def test_two_runs_on_one_save_path_the_second_is_refused_and_the_first_keeps_its_bundle(proc_env, tmp_path):
    """Before: both ran, tore each other's bundle (a sidecar naming a file the other had deleted),
    raised in the handler and both exited 0 claiming the final bundle."""
    stem = tmp_path / "ck" / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.05"}  # ~0.8 s an epoch: the first still runs when the second starts
    first, first_path = _run(env, tmp_path, "--save-path", str(stem), "--checkpoint-every", "2", epochs=12, name="a.json")
    try:
        first.wait_for_line("checkpoint (checkpoint)", timeout=120)
        second, second_path = _run(env, tmp_path, "--save-path", str(stem), "--checkpoint-every", "2", epochs=12, name="b.json")
        assert second.wait(60) == 2, second.output
        assert first.proc.poll() is None, first.output  # refused while the first still ran
        assert first.wait(120) == 0, first.output
    finally:
        first.kill()
    a, b = json.loads(first_path.read_text()), json.loads(second_path.read_text())
    holder = f"run {a['run_id']}, pid {first.proc.pid} on host {socket.gethostname()}"
    assert f"flodl: run stopped: save_path: {stem} is the save path of another run that is still going ({holder}" in second.output
    assert b["exit_code"] == 2 and b["world_size"] == 0 and b["samples"] == 0  # refused before any worker started
    meta = read_meta(stem)  # whole: the sidecar names files that are there, with their checksums
    assert meta["save_reason"] == "final" and meta["run_id"] == a["run_id"]
    assert a["checkpoints"][-1]["reason"] == "final" and a["exit_code"] == 0 and a["handler_errors"] == 0
    assert sorted(_names(stem.parent)) == sorted(["run.meta.json", meta["model_file"], meta["optim_file"]])  # no lock, no temporaries
    # the common resume: from the stem, onto the stem
    third, third_path = _run(proc_env, tmp_path, "--resume-from", str(stem), "--save-path", str(stem), epochs=14, name="c.json")
    assert third.wait(120) == 0, third.output
    again = read_meta(stem)
    assert again["save_reason"] == "final" and again["epoch"] == 14 and again["run_id"] == json.loads(third_path.read_text())["run_id"]
    assert sorted(_names(stem.parent)) == sorted(
        ["run.meta.json", again["model_file"], again["optim_file"]]
    )  # the resumed bundle's files went


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: a disk that really fills (``No space left on device``), unmounted afterwards."""
    folder = tmp_path / "disk"
    folder.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def _fill(folder: Path) -> None:
    """Take every free byte of the disk, as another process's files would."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.timeout(240)
def test_a_full_disk_ends_the_run_unsaved_naming_the_bundle_on_disk_and_leaves_no_partial_file(proc_env, tmp_path, small_disk):
    """Before: each failed save warned, the final save failed too, and the run printed "done",
    exit 0, exit_reason completed, naming no bundle, with partial files left (a .fdl whose .optim
    failed, an .optim.tmp, empty .fdl.tmp files)."""
    stem = small_disk / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.02"}
    run, path = _run(env, tmp_path, "--save-path", str(stem), "--checkpoint-every", "1", epochs=6, name="s.json")
    try:
        run.wait_for_line("checkpoint (checkpoint)", timeout=120)
        _fill(small_disk)
        code = run.wait(120)
    finally:
        run.kill()
    summary = json.loads(path.read_text())
    assert code == EXIT_UNSAVED == 10, run.output
    assert summary["exit_reason"] == "completed_unsaved" and summary["exit_code"] == 10
    meta = read_meta(stem)  # the bundle on disk is whole, and it is the one every message names
    newest = summary["newest_bundle"]
    assert newest["tag"] in meta["model_file"] and newest["epoch"] == meta["epoch"] < 6 and newest["this_run"]
    named = f"the newest valid bundle is {stem}, this run's save with {meta['epoch']} epoch(s) complete (tag {newest['tag']}, reason checkpoint)"
    assert "the final save FAILED" in run.output and f"flodl: the final save to {stem} failed (" in run.output, run.output
    assert f"{named}: --resume-from {stem} continues from it" in run.output.splitlines()[-1] or named in run.output, run.output
    failures = [line for line in run.output.splitlines() if "checkpoint failed on rank" in line]
    assert failures and all(named in line for line in failures), failures  # each failed save said which bundle is valid
    assert "No space left on device" in failures[-1]
    assert [u["reason"] for u in summary["checkpoints_unsaved"]][-1] == "final"
    # nothing half-written: the sidecar, the two files it names, the filler; no temporaries, no orphan
    assert _names(small_disk) == {"run.meta.json", meta["model_file"], meta["optim_file"], "filler"}, _names(small_disk)
