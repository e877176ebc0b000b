"""The control-plane, overhead, scale, hetero and cpu_avg benchmarks still run against the current code.

Each bench's ``--smoke`` runs its whole path at toy sizes in seconds (the
control plane: a controller, a simulated worker joining and training one window,
round trips to it and to the bare pyzmq echoes; the overhead: one plain loop and
one real flodl run; scale: the real controller driving 16 simulated ranks
through a death and a join, timed at its ``ControllerHooks``; hetero: a solo
and one 2:1 cadence run through the CLI, about 20 s; cpu_avg: one 1 MB averaging
round of 2 rank processes against gloo, on each lane, about 15 s) and writes its
JSON under ``$FLODL_BENCH_RESULTS`` (here a temporary folder), so the
committed ``bench/results`` are never touched. The numbers mean nothing at
these sizes; what is tested is that the bench runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(60)  # each takes under 10 s here; the margin is for a loaded machine

FIELDS = {"case", "metric", "value", "unit", "goal", "met"}


def run_smoke(script: str, name: str, tmp_path, proc_env, timeout_s: float = 50) -> dict:
    committed = ROOT / "bench" / "results" / f"{name}.json"
    before = committed.read_bytes() if committed.exists() else None
    env = dict(proc_env, FLODL_BENCH_RESULTS=str(tmp_path))
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / f"{name}.json").read_text())
    assert out["bench"] == name and out["machine"] and out["when"] and out["rows"]
    assert all(set(row) == FIELDS for row in out["rows"])
    assert (committed.read_bytes() if committed.exists() else None) == before  # the committed numbers are left alone
    return out


def test_control_plane_bench_runs(tmp_path, proc_env):
    out = run_smoke("control_plane.py", "control_plane", tmp_path, proc_env)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("ingest, 4 ranks", "frames/s (median)")]["value"] > 0  # every BatchDone of the window was counted (asserted inside)
    p50 = rows[("round trip rank→controller→rank", "p50")]
    assert p50["value"] > 0 and p50["goal"].startswith("≤ bare pyzmq + 10 µs") and p50["met"] in (True, False)
    assert rows[("bare pyzmq DEALER→ROUTER echo", "p50")]["value"] > 0


def test_overhead_bench_runs(tmp_path, proc_env):
    out = run_smoke("overhead.py", "overhead", tmp_path, proc_env)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["plain samples/s"] > 0 and values["flodl samples/s"] > 0


def test_scale_bench_runs(tmp_path, proc_env):
    out = run_smoke("scale.py", "scale", tmp_path, proc_env)
    values = {r["metric"]: r for r in out["rows"]}
    # every sample once by the controller's ledger; the ranks' own record is reported, not asserted: at this
    # size it lacks some of the killed rank's last batches (the same before the controller took hooks)
    assert values["coverage"]["met"] and values["ranks joined"]["value"] > 0 and values["ranks lost"]["value"] == 1
    assert values["dispatch decisions/s"]["value"] > 0 and values["averaging decisions/s"]["value"] > 0  # the hooks were called
    assert values["frames out/s"]["value"] > 0


@pytest.mark.timeout(120)  # two real runs, each a controller, a worker and its ranks importing torch
def test_hetero_bench_runs(tmp_path, proc_env):
    out = run_smoke("hetero.py", "hetero", tmp_path, proc_env, timeout_s=110)
    values = {(r["case"], r["metric"]): r["value"] for r in out["rows"]}
    assert values[("solo", "train samples/s (median)")] > 0 and values[("2:1 nccl-cadence", "train samples/s (median)")] > 0


@pytest.mark.timeout(120)  # two rank processes per lane, each importing torch
def test_cpu_avg_bench_runs(tmp_path, proc_env):
    out = run_smoke("cpu_avg.py", "cpu_avg", tmp_path, proc_env, timeout_s=110)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["CPU round (lane)"] > 0 and values["CPU round (wire)"] > 0 and values["gloo all-reduce"] > 0
