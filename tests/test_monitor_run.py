"""The monitor on a real run: record stream, reader, live dashboard, archive, timeline, eval cadence."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

from flodl.monitor.reader import epoch_table, load
from flodl.monitor.timeline import validate_chrome_trace

from .conftest import task_spec
from .helpers.browser import chromium, console_errors, needs_chromium
from .helpers.history import epochs
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)

EPOCHS = 4


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """One real 2-rank run with every monitor option on; its summary, output and files."""
    import os

    from .conftest import ROOT

    tmp = tmp_path_factory.mktemp("monitored")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", FLODL_TEST_STEP_SLEEP="0.02", FLODL_TEST_RECORD_SEEN="1")
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "2",
            "--epochs",
            str(EPOCHS),
            "--record-log-dir",
            str(tmp / "logs"),
            "--dashboard-html",
            str(tmp / "dash.html"),
            "--timeline",
            str(tmp / "trace.json"),
            "--reports-per-epoch",
            "4",
            "--eval-every-epochs",
            "2",
            "--scalar-reduction",
            "seen=sum",
            "--summary-json",
            str(tmp / "s.json"),
        ],
        env,
    )
    run.wait_for_line("epoch 1/")
    url = re.search(r"dashboard: (http://\S+)", run.output).group(1)
    with urllib.request.urlopen(url + "paths", timeout=5) as reply:  # served live while it trains
        live_paths = json.loads(reply.read())
    assert run.wait(90) == 0, run.output
    return {"summary": json.loads((tmp / "s.json").read_text()), "output": run.output, "dir": tmp, "live_paths": live_paths}


def test_the_live_dashboard_serves_the_run_while_it_trains(monitored):
    assert "root" in monitored["live_paths"] and "root/rank0" in monitored["live_paths"]


def test_eval_runs_every_n_epochs_and_after_the_last(monitored):
    """--eval-every-epochs 2: epochs 2 and 4 are scored on their own (no window runs past their
    end); a row of epochs one average closed is scored when it holds one of them."""
    history = monitored["summary"]["history"]
    assert epochs(history) == list(range(EPOCHS)) and {1, 3} <= {h["epoch"] for h in history}
    assert [h["eval"] is not None for h in history] == [h["epoch"] in (1, 3) for h in history]
    assert monitored["summary"]["final_eval"] > 0.7


def test_the_reader_reproduces_the_epoch_table(monitored):
    rows = epoch_table(monitored["dir"] / "logs")
    history = monitored["summary"]["history"]
    # as the console numbers them, a row of epochs one average closed as one
    assert [(r["first_epoch"], r["epoch"]) for r in rows] == [(h["first_epoch"] + 1, h["epoch"] + 1) for h in history]
    for row, h in zip(rows, history, strict=True):
        assert row["samples"] == h["samples"] == 512 * (h["epoch"] - h["first_epoch"] + 1)
        assert row["loss"] == pytest.approx(h["loss"], rel=1e-6)
        assert row["eval"] == (pytest.approx(h["eval"]) if h["eval"] is not None else None)
        assert row["syncs"] == h["syncs"]
        assert set(row["ranks"]) == {"rank0", "rank1"}


def test_a_sum_scalar_is_the_total_in_the_summary_and_the_record_stream(monitored):
    """--scalar-reduction seen=sum: each epoch's history row says what its root record says, a count
    (a window's scalars are booked to the last epoch it touched, so the run's total is exact, not each row)."""
    summary = [h["scalars"]["seen"] for h in monitored["summary"]["history"]]
    roots = [r for r in load(monitored["dir"] / "logs")["root"] if r.get("kind") == "node" and r.get("epoch_complete")]
    assert summary == [r["metrics"]["seen"] for r in roots]
    assert sum(summary) == 512.0 * EPOCHS  # a mean would read the batch size, 16


def test_records_carry_sub_epoch_reports_resources_and_the_meta(monitored):
    records = load(monitored["dir"] / "logs")
    root = records["root"]
    assert root[0]["kind"] == "meta" and root[0]["reductions"].get("seen") == "sum"
    assert root[0]["run"]["eval_metric"] == "accuracy" and root[0]["run"]["world_size"] == 2
    ticks = [r for r in root if r.get("kind") == "node" and "tick" in r]
    # a window that trains a whole epoch and into the next reports into the next (windows flow over
    # edges that are not eval edges), so an epoch between evals may have none; the first and last have
    ticked = {r["epoch"] for r in ticks}
    assert ticked <= set(range(EPOCHS)) and {0, EPOCHS - 1} <= ticked and len(ticked) >= EPOCHS - 1
    assert max(sum(1 for r in ticks if r["epoch"] == e) for e in range(EPOCHS)) <= 4  # never more than asked
    leaf = [r for r in records["root/rank0"] if r.get("epoch_complete")][-1]
    assert {"loss", "throughput", "batch_share", "data_starve", "compute_only_ms"} <= set(leaf["metrics"])
    assert 0.0 <= leaf["metrics"]["data_starve"] <= 1.0
    assert {"cpu_util", "rss_bytes"} <= set(leaf["res"])  # the rank's machine, sampled with psutil


def test_the_timeline_is_a_valid_chrome_trace_of_windows_evals_and_epochs(monitored):
    trace = json.loads((monitored["dir"] / "trace.json").read_text())
    assert validate_chrome_trace(trace) == []
    names = {e["name"] for e in trace["traceEvents"]}
    rows = {
        f"epoch {h['epoch'] + 1} done" if h["first_epoch"] == h["epoch"] else f"epochs {h['first_epoch'] + 1}-{h['epoch'] + 1} done"
        for h in monitored["summary"]["history"]
    }
    assert {"average", "eval epoch 2", "eval epoch 4", *rows} <= names
    assert any(n.startswith("window ") for n in names)
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"controller", "rank 0", "rank 1"} <= processes


@needs_chromium
def test_the_archive_draws_the_run_offline(monitored, tmp_path):
    path = monitored["dir"] / "dash.html"
    assert f"wrote {path}" in monitored["output"]
    dom, stderr = asyncio.run(
        chromium(
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            path.as_uri(),
        )
    )
    loss = re.search(r'data-series="loss" data-points="(\d+)"', dom)
    assert loss and int(loss.group(1)) >= len(monitored["summary"]["history"])  # a point a row at least
    assert 'data-series="throughput:rank0"' in dom and 'data-series="throughput:rank1"' in dom
    assert 'data-series="eval"' in dom
    assert "data-errors" not in dom or 'data-errors="0"' in dom
    assert not console_errors(stderr)


def test_eval_every_epochs_0_never_calls_the_eval_function(proc_env, tmp_path):
    """As in the reference, 0 disables evals: an eval_fn that would raise is never called,
    the run completes, and the summary has no eval (neither per epoch nor final)."""
    env = {**proc_env, "FLODL_TEST_EVAL_FAIL": "1"}
    path = tmp_path / "s.json"
    two_epochs = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "2"]
    run = Run([*two_epochs, "--eval-every-epochs", "0", "--summary-json", str(path)], env)
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    assert summary["exit_reason"] == "completed" and summary["epochs_completed"] == 2
    assert summary["final_eval"] is None and summary["eval_metric_name"] is None
    assert epochs(summary["history"]) == [0, 1] and all(h["eval"] is None for h in summary["history"])
    assert "eval failed" not in run.output
