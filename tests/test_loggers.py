"""The run's rows in loggers people already read (flodl/monitor/loggers.py): a real run's TensorBoard
event file, read by TensorBoard's own loader, and its CSV, against the run's summary."""

from __future__ import annotations

import csv
import json

import pytest

from flodl.monitor.tfevents import crc32c

from .conftest import task_spec
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C


def test_a_run_writes_tensorboard_events_and_a_csv_of_its_rows(proc_env, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tb, table, path = tmp_path / "tb", tmp_path / "m.csv", tmp_path / "s.json"
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "6", "--no-progress", "--summary-json", str(path)]
    env = {**proc_env, "FLODL_TEST_RECORD_SEEN": "1"}  # a user scalar, reported every step
    run = Run([*args, "--tensorboard-dir", str(tb), "--csv-log", str(table)], env)
    assert run.wait(90) == 0, run.output
    history = json.loads(path.read_text())["history"]
    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "eval/accuracy", "samples_per_s", "scalars/seen", "rank0/samples_per_s", "rank1/samples_per_s"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(h["epoch"] + 1, pytest.approx(h["loss"], rel=1e-6)) for h in history]
    assert [e.value for e in acc.Scalars("eval/accuracy")] == [pytest.approx(h["eval"], rel=1e-6) for h in history]
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["first_epoch"]), int(r["epoch"])) for r in rows] == [(h["first_epoch"] + 1, h["epoch"] + 1) for h in history]
    assert [float(r["samples_per_s"]) for r in rows] == [pytest.approx(h["samples_per_s"], rel=1e-9) for h in history]
    assert all(r["scalars/seen"] for r in rows)  # a scalar first seen in a later row got its column in every row
    assert f"wrote {table}" in run.output


def test_a_logger_that_cannot_write_warns_and_the_run_goes_on(proc_env, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "1", "--epochs", "2", "--no-progress"]
    run = Run([*args, "--tensorboard-dir", str(blocker / "tb"), "--csv-log", str(blocker / "m.csv")], proc_env)
    assert run.wait(90) == 0, run.output
    assert "no TensorBoard log" in run.output and "no CSV log" in run.output
