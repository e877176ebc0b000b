"""Every benchmark still runs against the current code (the matrix: tests/test_matrix.py).

Each bench's ``--smoke`` runs its whole path at toy sizes in seconds (the
control plane: a controller, a simulated worker joining and training one window,
round trips to it and to the bare pyzmq echoes; the overhead: one plain loop and
one real flodl run (and once more in script mode, ``--script``, and side by side, ``--concurrent``); step_cost: 200 no-op steps
of the rank's batch loop in process and of a plain loop, twice, and around a real MLP step (``--width``); scale: the real controller driving 16 simulated ranks
through a death and a join, timed at its ``ControllerHooks``; hetero: a solo,
two solo runs side by side (the ideal) and one 2:1 cadence run through the CLI, about 25 s; cpu_avg: one 1 MB averaging
round of 2 rank processes against gloo, on each lane, about 15 s; startup: one
one-epoch run of the README job under flodl and one under torchrun, about 30 s; chaos: one
kill fault in a 2-epoch run, about 10 s; faults: one kill -9 of a rank, about
10 s; heal: a 2 MB model's rank killed and restarted, its state handed over, about 20 s; bn_recal: one round of 4+1 batches of a ResNet-20 on 256 images, about
8 s; data: the RAM cache on 256 samples, about 8 s; loader: 128 samples read by the rank's
threads and by 2 loader workers, about 5 s; network: nccl-cadence at
20 ms in network namespaces, about 17 s, skipped where namespace hosts cannot
be built; wan: GPT-nano unshaped and on a 100 Mbit/50 ms link, about 70 s,
skipped likewise; mixed: a CUDA rank alone and beside a CPU rank, skipped without CUDA,
where ``--smoke`` must fail saying so) and writes its JSON under
``$FLODL_BENCH_RESULTS`` (here a temporary folder), so the committed
``bench/results`` are never touched. The numbers mean nothing at these sizes;
what is tested is that the bench runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.netns import unusable_reason

from .conftest import ROOT

pytestmark = pytest.mark.timeout(60)  # each takes under 10 s here; the margin is for a loaded machine

FIELDS = {"case", "metric", "value", "unit", "goal", "met"}


def run_smoke(script: str, name: str, tmp_path, proc_env, timeout_s: float = 50, extra: tuple[str, ...] = ()) -> dict:
    """``script`` is a file under bench/ or, for a package's bench, ``-m bench.<name>``."""
    committed = ROOT / "bench" / "results" / f"{name}.json"
    before = committed.read_bytes() if committed.exists() else None
    env = dict(proc_env, FLODL_BENCH_RESULTS=str(tmp_path))
    how = script.split() if script.startswith("-m ") else [str(ROOT / "bench" / script)]
    res = subprocess.run([sys.executable, *how, "--smoke", *extra], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(out) >= {"bench", "machine", "when", "rows"}
    assert out["bench"] == name and out["machine"] and out["when"] and out["rows"]
    assert all(set(row) == FIELDS for row in out["rows"])
    for row in out["rows"]:
        assert isinstance(row["case"], str) and isinstance(row["metric"], str) and isinstance(row["unit"], str)
        assert isinstance(row["value"], int | float) and (row["goal"] is None or isinstance(row["goal"], str))
        assert row["met"] in (True, False, None)
    assert (committed.read_bytes() if committed.exists() else None) == before  # the committed numbers are left alone
    return out


def test_control_plane_bench_runs(tmp_path, proc_env):
    out = run_smoke("control_plane.py", "control_plane", tmp_path, proc_env)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("ingest, 4 ranks", "frames/s (median)")]["value"] > 0  # every TimingMsg of the window was counted (asserted inside)
    p50 = rows[("round trip rank→controller→rank", "p50")]
    assert p50["value"] > 0 and p50["goal"].startswith("≤ bare pyzmq + 10 µs") and p50["met"] in (True, False)
    assert rows[("bare pyzmq DEALER→ROUTER echo", "p50")]["value"] > 0


def test_overhead_bench_runs(tmp_path, proc_env):
    out = run_smoke("overhead.py", "overhead", tmp_path, proc_env)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["plain samples/s"] > 0 and values["flodl samples/s"] > 0
    # every pair's ratio is kept, not only the median and the extremes
    assert values["flodl / plain, pair 1 (plain first)"] == values["flodl / plain (median of 1)"]


def test_overhead_bench_takes_the_epochs_it_is_given():
    from bench import overhead

    _, _, _, epochs = overhead.plan(overhead.parse_args(["--steps-ms", "5", "--epochs", "8"]))
    assert epochs == 8
    _, _, _, epochs = overhead.plan(overhead.parse_args(["--steps-ms", "5"]))
    assert epochs == 4  # the plan's own
    with pytest.raises(SystemExit, match="--epochs 0 must be at least 1"):
        overhead.plan(overhead.parse_args(["--steps-ms", "5", "--epochs", "0"]))


def test_overhead_bench_runs_script_mode(tmp_path, proc_env):
    out = run_smoke("overhead.py", "overhead_script", tmp_path, proc_env, extra=("--script",))
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["plain samples/s"] > 0 and values["flodl samples/s"] > 0


def test_overhead_bench_runs_side_by_side(tmp_path, proc_env):
    out = run_smoke("overhead.py", "overhead_concurrent", tmp_path, proc_env, extra=("--concurrent",))
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["plain samples/s"] > 0 and values["flodl samples/s"] > 0
    assert "flodl / plain, pair 1 (flodl on core 0)" in values


def test_the_side_by_side_plain_rate_is_taken_over_flodls_span_only():
    from bench.overhead import rate_between

    stamps = [(10.0, 0), (11.0, 100), (12.0, 300), (13.0, 400)]  # 100, then 200, then 100 samples/s
    assert rate_between(stamps, 11.0, 12.0) == pytest.approx(200.0)
    assert rate_between(stamps, 10.5, 12.5) == pytest.approx((350 - 50) / 2.0)  # between steps: interpolated
    with pytest.raises(ValueError, match="not over flodl's training"):
        rate_between(stamps, 9.0, 12.0)  # the plain loop had not started
    with pytest.raises(ValueError, match="not over flodl's training"):
        rate_between(stamps, 11.0, 13.5)


def test_step_cost_bench_runs(tmp_path, proc_env):
    out = run_smoke("step_cost.py", "step_cost", tmp_path, proc_env)
    values = {r["metric"]: r for r in out["rows"]}
    assert values["plain loop, per step (best)"]["value"] > 0 and values["flodl's rank loop, per step (best)"]["value"] > 0
    assert values["flodl's own cost per step"]["goal"] == "< 20 µs"


def test_step_cost_bench_runs_around_a_real_step(tmp_path, proc_env):
    out = run_smoke("step_cost.py", "step_cost_w64", tmp_path, proc_env, extra=("--width", "64"))
    values = {r["metric"]: r for r in out["rows"]}
    assert out["rows"][0]["case"].startswith("MLP width 64 step")
    assert values["flodl / plain throughput (medians)"]["value"] > 0


def test_avg_stream_bench_runs(tmp_path, proc_env):
    out = run_smoke("avg_stream.py", "avg_stream", tmp_path, proc_env)
    metrics = {r["metric"] for r in out["rows"]}
    assert "background (Cadence, Async): step-stream time per average" in metrics and "blocking (Sync): share of a window" in metrics


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
    # the ideal: two solo runs side by side, the second paced 2:1
    assert values[("2:1 side by side", "ideal samples/s (median)")] == values[("2:1 nccl-cadence", "ideal samples/s (median)")] > 0


@pytest.mark.timeout(180)  # two real one-epoch runs of the README job: flodl's, then torchrun's, every rank importing torch
def test_startup_bench_runs(tmp_path, proc_env):
    out = run_smoke("startup.py", "startup", tmp_path, proc_env, timeout_s=170)
    rows = {r["metric"]: r for r in out["rows"]}
    first, torchrun = rows["flodl: first batch"]["value"], rows["torchrun: first batch"]["value"]
    assert 0 < first < rows["flodl: whole command"]["value"] and 0 < torchrun < rows["torchrun: whole command"]["value"]
    ratio = rows["first batch flodl/torchrun"]
    assert ratio["goal"] == "≤ 1.2× torchrun" and ratio["met"] == (ratio["value"] <= 1.2)
    assert "load average" in out["note"] and "first_batch" in out["note"]


@pytest.mark.timeout(120)  # two rank processes per lane, each importing torch
def test_cpu_avg_bench_runs(tmp_path, proc_env):
    out = run_smoke("cpu_avg.py", "cpu_avg", tmp_path, proc_env, timeout_s=110)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["CPU round (lane)"] > 0 and values["CPU round (wire)"] > 0 and values["gloo all-reduce"] > 0


def test_chaos_bench_runs(tmp_path, proc_env):
    out = run_smoke("chaos.py", "chaos", tmp_path, proc_env)
    rows = {(r["case"], r["metric"]): r["value"] for r in out["rows"]}
    assert rows[("all", "faults")] == 1 and rows[("kill", "faults")] == 1  # the one fault, a kill, was run and reported


def test_faults_bench_runs(tmp_path, proc_env):
    out = run_smoke("faults.py", "faults", tmp_path, proc_env)
    rows = {(r["case"], r["metric"]): r["value"] for r in out["rows"]}
    assert rows[("flodl nccl-cadence kill -9", "death detected")] >= 0  # the kill landed and the controller recorded the death
    assert {r["case"] for r in out["rows"]} == {"flodl nccl-cadence kill -9"}


def test_heal_bench_runs(tmp_path, proc_env):
    out = run_smoke("heal.py", "heal", tmp_path, proc_env)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("nccl-cadence", "state bit-identical")]["met"] is True  # the restarted rank took its donor's state
    assert rows[("nccl-cadence", "back at full size p50")]["value"] > rows[("nccl-cadence", "spawn (ready) p50")]["value"] > 0


def test_bn_recal_bench_runs(tmp_path, proc_env):
    out = run_smoke("bn_recal.py", "bn_recal", tmp_path, proc_env)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert 0 <= values["eval, statistics as averaged"] <= 100 and 0 <= values["eval, statistics re-estimated"] <= 100


def test_data_bench_runs(tmp_path, proc_env):
    out = run_smoke("-m bench.data", "data", tmp_path, proc_env)
    values = {r["metric"]: r["value"] for r in out["rows"]}
    assert values["epoch 1 wall"] > 0 and values["staged per rank"] > 0  # the RAM cache staged the samples


def test_loader_bench_runs(tmp_path, proc_env):
    out = run_smoke("-m bench.loader", "loader", tmp_path, proc_env)
    rates = {r["case"]: r["value"] for r in out["rows"] if r["unit"] == "samples/s"}
    assert set(rates) == {"spin reads, 0 workers", "spin reads, 2 workers"} and min(rates.values()) > 0


@pytest.mark.timeout(120)  # four network namespaces and a relay, then a controller and three workers
@pytest.mark.skipif(unusable_reason(sshd=False) is not None, reason=f"namespace hosts unavailable: {unusable_reason(sshd=False)}")
def test_compress_bench_runs(tmp_path, proc_env):
    out = run_smoke("compress.py", "compress", tmp_path, proc_env, timeout_s=110)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("collective int8", "fewer bytes than none")]["value"] >= 3.5  # the bytes, whatever a toy run learns


def test_fragments_bench_runs(tmp_path, proc_env):
    out = run_smoke("fragments.py", "fragments", tmp_path, proc_env, timeout_s=110)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("collective F=2", "peak vs F=1")]["met"]  # the bytes, whatever a toy run learns


def test_network_bench_runs(tmp_path, proc_env):
    out = run_smoke("-m bench.network", "network", tmp_path, proc_env, timeout_s=110)
    values = {(r["case"], r["metric"]): r["value"] for r in out["rows"]}
    assert values[("20 ms nccl-cadence", "throughput")] > 0


@pytest.mark.timeout(180)  # three namespaces and a relay, then two runs of a controller and two workers (start-up mostly)
@pytest.mark.skipif(unusable_reason(sshd=False) is not None, reason=f"namespace hosts unavailable: {unusable_reason(sshd=False)}")
def test_wan_bench_runs(tmp_path, proc_env):
    out = run_smoke("-m bench.wan", "wan", tmp_path, proc_env, timeout_s=170)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    assert rows[("link 100 Mbit/50 ms", "measured round trip")]["value"] >= 100  # 50 ms each way: the link was shaped
    assert rows[("link 100 Mbit/50 ms", "measured bulk rate")]["value"] <= 110  # and capped
    shaped = "gpt_nano nccl-cadence 100 Mbit/50 ms none"
    assert rows[(shaped, "throughput")]["value"] > 0 and rows[(shaped, "bytes per average")]["value"] > 0
    of_ideal = rows[(shaped, "of ideal")]
    assert of_ideal["goal"] == ">= 0.95 of unshaped" and of_ideal["met"] in (True, False)
    assert (shaped, "to target / unshaped none's") in rows and out["targets"] and out["links"]


@pytest.mark.timeout(120)  # a CUDA run and a mixed CUDA + CPU run
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bench/mixed.py needs a CUDA device")
def test_mixed_bench_runs(tmp_path, proc_env):
    out = run_smoke("mixed.py", "mixed_gpu", tmp_path, proc_env, timeout_s=110)
    values = {(r["case"], r["metric"]): r["value"] for r in out["rows"]}
    assert values[("cuda:0 alone", "samples/s")] > 0 and values[("cuda:0,cpu cpu-cadence", "samples/s")] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: test_mixed_bench_runs runs the smoke")
def test_mixed_bench_smoke_fails_clearly_without_cuda(tmp_path, proc_env):
    env = dict(proc_env, FLODL_BENCH_RESULTS=str(tmp_path))
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mixed.py"), "--smoke"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert res.returncode != 0 and "needs a CUDA device" in res.stderr  # a smoke that cannot run fails, and says why
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(420)  # five real runs (about 2 minutes on the loaded 2-core VM, start-up mostly), every rank importing torch
def test_time_to_target_quick_runs_and_ddp_reaches_its_own_target(tmp_path, proc_env):
    """``python -m bench.matrix.target --quick`` into a temporary folder: the MLP's target from torchrun DDP at 1:1,
    then four systems at 4:1, each stopped once it reached it."""
    pytest.importorskip("sklearn", reason="the MLP trains on scikit-learn's digits")
    committed = ROOT / "bench" / "results" / "time_to_target_quick.json"
    before = committed.read_bytes() if committed.exists() else None
    cmd = [sys.executable, "-m", "bench.matrix.target", "--quick", "--results", str(tmp_path)]
    res = subprocess.run(cmd, env=proc_env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "time_to_target_quick.json").read_text())
    assert set(out) >= {"bench", "machine", "when", "rows"} and out["bench"] == "time_to_target_quick" and out["rows"]
    for row in out["rows"]:
        assert set(row) == FIELDS and isinstance(row["value"], int | float) and row["met"] in (True, False, None)
    rows = {(r["case"], r["metric"]): r for r in out["rows"]}
    for system in ("NcclCadence 4:1", "NcclCadence 4:1, script mode", "torchrun DDP 4:1", "torchrun post-local SGD 4:1"):
        assert (f"mlp {system}", "train_s_to_target (median)") in rows, system
    goal = rows[("mlp NcclCadence 4:1", "speedup_train_vs_ddp (median)")]
    assert goal["goal"].startswith(">= 2x sooner than torchrun DDP at 4:1") and goal["met"] in (True, False)
    runs = tmp_path / "time_to_target_quick"

    def run(case: str) -> dict:
        return json.loads((runs / f"mlp__{case}__seed0.json").read_text())

    # DDP reaches its own target: at 1:1, and at 4:1 on the very same trajectory (pacing only sleeps), in the
    # same epoch, where the script stopped itself
    target, ddp = run("torchrun-ddp"), run("torchrun-ddp-4to1")
    assert target["ttt"]["reach"]["reached"] and target["epochs_completed"] == 30
    reach = ddp["ttt"]["reach"]
    assert reach["reached"] and reach["epochs"] == target["ttt"]["reach"]["epochs"]
    assert ddp["stopped_at_target"] and ddp["epochs_completed"] == reach["epochs"] < ddp["ttt"]["cap_epochs"]
    assert 0 < reach["train_s"] < reach["command_s"] and all("closed_s" in h and "eval_s" in h for h in ddp["history"])
    # flodl's rows say what each eval took (taken out of the training time); a run that reached was stopped before its cap
    cadence = run("nccl-cadence-4to1")
    assert all(h["eval_s"] > 0 for h in cadence["history"] if h["eval"] is not None)
    script = run("script-nccl-cadence-4to1")
    assert script["matrix"]["command"].endswith("--eval-every-epoch") and script["history"][0]["scalars"]["accuracy"] > 0
    for r in (cadence, script):
        if r["ttt"]["reach"]["reached"]:
            assert r["matrix"]["stopped"] and r["epochs_completed"] < r["ttt"]["cap_epochs"]
    assert (committed.read_bytes() if committed.exists() else None) == before  # the committed numbers are left alone
