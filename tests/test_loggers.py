"""The run's rows in loggers people already read (flodl/monitor/loggers.py): a real run's TensorBoard
event file, read by TensorBoard's own loader, and its CSV, against the run's summary."""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import struct
import subprocess

import pytest

from flodl.errors import EXIT_CONFIG
from flodl.monitor.tfevents import crc32c

from .conftest import PY, ROOT, task_spec
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


def tiny_run(tmp_path, *extra: str) -> list[str]:
    return [
        "--task",
        task_spec("tiny.py"),
        "--nproc-per-node",
        "2",
        "--epochs",
        "4",
        "--no-progress",
        "--summary-json",
        str(tmp_path / "s.json"),
        *extra,
    ]


def test_a_logger_of_your_own_gets_every_row_as_tensorboard_does_and_a_broken_one_is_dropped(proc_env, tmp_path):
    logger = str(ROOT / "tests" / "tasks" / "logger.py")
    args = tiny_run(tmp_path, "--logger", f"{logger}:make", "--logger", f"{logger}:broken")
    run = Run(args, {**proc_env, "FLODL_TEST_OUT": str(tmp_path)})
    assert run.wait(90) == 0, run.output
    summary = json.loads((tmp_path / "s.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "logger.jsonl").read_text().splitlines()]
    assert lines[0]["run"]["run_id"] == summary["run_id"] and lines[0]["run"]["config"]["loggers"] == [f"{logger}:make", f"{logger}:broken"]
    assert lines[-1] == {"closed": True}
    rows = lines[1:-1]
    assert [r["step"] for r in rows] == [h["epoch"] + 1 for h in summary["history"]]
    assert [r["values"]["loss"] for r in rows] == [pytest.approx(h["loss"]) for h in summary["history"]]
    assert [r["values"]["eval/accuracy"] for r in rows] == [pytest.approx(h["eval"]) for h in summary["history"]]
    assert {"samples_per_s", "syncs", "rank0/samples_per_s", "rank1/samples_per_s"} <= set(rows[0]["values"])
    assert run.output.count("this logger's service is down") == 1, run.output  # said once, and the run went on


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--logger", "no_such_module:make"], "loggers: no_such_module:make: cannot import"),
        (["--logger", "tests/tasks/logger.py:nothing"], "loggers: tests/tasks/logger.py:nothing: "),
        (["--logger", "nocolon"], "loggers: each must be a 'module:function'"),
    ],
)
def test_a_logger_that_cannot_be_made_is_a_bad_option(proc_env, tmp_path, args, says):
    done = subprocess.run(
        [PY, "-m", "flodl.controller", *tiny_run(tmp_path, *args)], env=proc_env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_CONFIG and says in done.stdout + done.stderr, done.stdout + done.stderr
    assert "start-up" not in done.stdout  # refused before any rank started


def test_wandb_asked_for_without_the_package_is_a_bad_option(proc_env, tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("the wandb package is installed here: its absence cannot be seen")
    done = subprocess.run(
        [PY, "-m", "flodl.controller", *tiny_run(tmp_path, "--wandb-project", "p")],
        env=proc_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode == EXIT_CONFIG and "wandb_project: needs the wandb package" in said and "pip install wandb" in said, said
    assert "start-up" not in done.stdout


def wandb_history(path: str) -> list[dict]:
    """The history records of a W&B run file (``run-*.wandb``: a LevelDB-style log of protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, pos, block, partial = open(path, "rb").read(), [], 7, 32768, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(partial)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


@pytest.mark.timeout(150)
def test_wandb_logs_the_rows_offline(proc_env, tmp_path):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("needs the wandb package (pip install wandb: the optional extra flodl[wandb])")
    env = {**proc_env, "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)  # offline unless the user says otherwise
    run = Run(tiny_run(tmp_path, "--wandb-project", "flodl-test"), env)
    assert run.wait(120) == 0, run.output
    summary = json.loads((tmp_path / "s.json").read_text())
    [path] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = wandb_history(path)
    assert [r["_step"] for r in rows] == [h["epoch"] + 1 for h in summary["history"]]
    assert [r["loss"] for r in rows] == [pytest.approx(h["loss"]) for h in summary["history"]]
    assert [r["eval/accuracy"] for r in rows] == [pytest.approx(h["eval"]) for h in summary["history"]]
