"""The model x mode benchmark's pieces, cheaply: tasks, data, the DDP script's helpers, the report.

The suite's numbers (``python -m bench.matrix``) are made on purpose, never here; one smoke
(``test_the_suite_runs_end_to_end``: logistic regression, two 4:1 cases, a few steps, into a
temporary folder) keeps it from rotting.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.matrix import (  # noqa: E402
    CASES,
    PLANS,
    RATIO,
    report,
    tasks,
)
from bench.matrix import data as mdata  # noqa: E402

pytestmark = pytest.mark.timeout(300)

NO_SKLEARN = "scikit-learn not installed (pip install 'flodl[examples]')"


def _needs_data(name: str) -> None:
    if tasks.SPECS[name].data == "digits":
        pytest.importorskip("sklearn", reason=NO_SKLEARN)


@pytest.fixture(autouse=True)
def small_budget(monkeypatch, tmp_path):
    monkeypatch.setenv(tasks.SAMPLES_ENV, "64")
    monkeypatch.setenv("FLODL_MATRIX_CACHE", str(tmp_path / "cache"))
    mdata.images.cache_clear()
    yield
    mdata.images.cache_clear()


@pytest.mark.parametrize("name", list(tasks.SPECS))
def test_each_task_builds_and_trains_one_batch(name):
    _needs_data(name)
    start = time.perf_counter()
    task = getattr(tasks, name)()  # the factory flodl imports: bench.matrix.tasks:<name>
    ds = task.build_dataset()
    assert len(ds) == 64
    model = task.model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = task.optimizer(model)
    x, y = default_collate([ds[i] for i in range(task.batch_size)])
    loss = task.loss_fn(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
    assert time.perf_counter() - start < 10.0  # a second or two here; generous for a loaded machine
    # the same initial weights every time (flodl and the DDP script build it the same way)
    again = tasks.make_model(tasks.SPECS[name])
    assert all(torch.equal(a, b) for a, b in zip(before, again.parameters(), strict=False))


@pytest.mark.parametrize("name", ["logreg", "mlp", "char_gru"])
def test_eval_is_an_accuracy(name):
    _needs_data(name)
    task = tasks.task(name)
    value = task.eval_fn(task.model(), torch.device("cpu"))
    assert 0.0 <= value <= 1.0


def test_task_specs_resolve():
    from flodl.taskspec import resolve

    for name in tasks.SPECS:
        assert callable(resolve(f"bench.matrix.tasks:{name}"))


def test_images_are_deterministic_and_cached(tmp_path):
    a = mdata.generate_images(50, seed=1)
    b = mdata.generate_images(50, seed=1)
    c = mdata.generate_images(50, seed=2)
    assert a[0].shape == (50, 3, 32, 32) and a[0].dtype == torch.float32 and a[1].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert int(a[1].min()) >= 0 and int(a[1].max()) < mdata.IMAGE_CLASSES
    first = mdata.images(50, 1)  # generated, then written to the cache
    assert list((tmp_path / "cache").glob("images-*.npz"))
    mdata.images.cache_clear()
    second = mdata.images(50, 1)  # read back
    assert torch.equal(first[0], a[0]) and torch.equal(second[0], a[0]) and torch.equal(second[1], a[1])


def test_text_and_digits_are_deterministic():
    pytest.importorskip("sklearn", reason=NO_SKLEARN)
    assert mdata.corpus() == mdata.corpus()
    x, y, xe, ye = mdata.text()
    assert x.shape[1] == mdata.CONTEXT and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < mdata.VOCAB_SIZE and len(xe) > 0
    ids = mdata.encode("a\n\u2014")
    assert ids.tolist() == [mdata.ALPHABET.index("a"), 0, mdata.UNK_ID]
    d1, d2 = mdata.digits(), tasks.train_data(tasks.SPECS["mlp"], 1500)
    assert torch.equal(d1[0], d2[0]) and len(d1[2]) == 297


def test_plans_name_known_cases():
    for plan in PLANS.values():
        for model, (budget, cases) in plan.items():
            assert model in tasks.SPECS and budget.samples > 0 and budget.epochs > 0
            assert set(cases) <= set(CASES)
    assert len(CASES) == 17 and set(PLANS["quick"]["lenet"][1]) == {c for c in CASES if not CASES[c].script}
    # script mode (issue 18): at least the MLP and ResNet-20 at 4:1 in the full plan
    assert all("script-nccl-cadence-4to1" in PLANS["full"][m][1] for m in ("mlp", "resnet20"))


def test_ddp_paces_with_flodls_own_rule():
    from bench.matrix import ddp
    from flodl.config import env

    # the same functions, not copies: the DDP ranks are paced exactly as flodl's
    assert ddp.paced_step is env.paced_step and ddp.parse_slowdown is env.parse_slowdown and ddp.parse_base_ms is env.parse_base_ms
    ranks = [{"rank": 0, "slowdown": 1.0, "step_ms": 2.0}, {"rank": 1, "slowdown": 4.0, "step_ms": 8.4}]
    assert ddp.measured_ratio(ranks) == pytest.approx(4.2)
    assert ddp.measured_ratio([{"slowdown": 1.0, "step_ms": 2.0}] * 2) is None


def test_a_4to1_plan_gets_its_solo_calibration():
    from bench.matrix.suite import solo_base_ms, with_calibration

    sbs = f"side-by-side-{RATIO}to1"  # the ideal of the flodl 4:1 cases, paced from solo as they are
    assert with_calibration(("nccl-cadence-4to1", "torchrun-ddp-4to1"), False) == ("solo", sbs, "nccl-cadence-4to1", "torchrun-ddp-4to1")
    assert with_calibration(("nccl-cadence-4to1",), True) == (sbs, "nccl-cadence-4to1")  # --base-ms given
    assert with_calibration(("torchrun-ddp-4to1",), False) == ("solo", "torchrun-ddp-4to1")  # no flodl 4:1 case, no ideal
    assert with_calibration(("nccl-cadence", "torchrun-ddp"), False) == ("nccl-cadence", "torchrun-ddp")
    solo = _summary("NcclSync", 4.0, 0.9, ranks=1, case="solo")
    assert solo_base_ms(solo) == pytest.approx(125.0)  # 500 ms over 4 batches
    assert solo_base_ms({"matrix": {"error": "boom"}}) is None


def test_flodl_curve_reads_the_record_log(tmp_path):
    from bench.matrix.suite import flodl_curve

    logs = tmp_path / "logs"
    logs.mkdir()
    recs = [
        {"v": 1, "ts": 1000, "kind": "meta", "run": {}},
        {"v": 1, "ts": 1500, "kind": "node", "path": "root", "tick": 0, "epoch": 0, "metrics": {"loss": 2.0}},
        {"v": 1, "ts": 1600, "kind": "node", "path": "root", "epoch": 0, "epoch_complete": True, "metrics": {"loss": 1.9}},
        {"v": 1, "ts": 2250, "kind": "node", "path": "root", "tick": 3, "epoch": 1, "metrics": {"loss": 1.0}},
    ]
    (logs / "root.log").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert flodl_curve(logs) == [[0.5, 2.0], [1.25, 1.0]]


# ------------------------------------------------------------------ report


def _summary(
    mode: str,
    wall: float,
    ev: float,
    *,
    ranks: int = 2,
    compute_ms: float = 500.0,
    case: str,
    ratio: int = 1,
    seed: int = 0,
    slow_ms: float | None = None,
) -> dict:
    per = {str(r): {"samples": 100, "batches": 4, "compute_ms": compute_ms, "sync_ms": 10.0, "data_ms": 1.0} for r in range(ranks)}
    if slow_ms is not None:
        per["1"]["compute_ms"] = slow_ms
    return {
        "mode": mode,
        "world_size": ranks,
        "epochs": 1,
        "wall_s": wall + 0.1,
        "eval_s": 0.1,
        "samples": 200,
        "train_samples_per_s": 200 / wall,
        "syncs": 4,
        "final_loss": 0.5,
        "final_eval": ev,
        "history": [{"epoch": 0, "loss": 0.5, "eval": ev, "wall_s": wall, "per_rank": per}],
        "matrix": {
            "model": "lenet",
            "title": "LeNet test",
            "case": case,
            "samples": 200,
            "epochs": 1,
            "metric": "accuracy",
            "process_s": wall + 5,
            "ratio": ratio,
            "seed": seed,
            "curve": [[0.1, 2.0], [wall, 0.5]],
        },
    }


@pytest.fixture
def fake_results(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    runs = {
        "solo": [_summary("NcclSync", 4.0, 0.90, ranks=1, case="solo")],
        "nccl-cadence": [_summary("NcclCadence", 2.0, 0.89, case="nccl-cadence")],
        "torchrun-ddp": [_summary("TorchrunDDP", 4.0, 0.88, case="torchrun-ddp")],
        # the ideal in the pair's own conditions: 50 samples/s (below the solo-alone ideal's 62.5)
        f"side-by-side-{RATIO}to1": [_summary("NcclCadence", 4.0, 0.90, case=f"side-by-side-{RATIO}to1", ratio=RATIO, slow_ms=2000.0)],
        # two seeds: evals 87 and 89 (mean 88), train walls 5 and 7 (median 6); rank 1 steps 4x rank 0
        f"nccl-cadence-{RATIO}to1": [
            _summary("NcclCadence", w, ev, case=f"nccl-cadence-{RATIO}to1", ratio=RATIO, seed=k, slow_ms=2000.0)
            for k, (w, ev) in enumerate(((5.0, 0.87), (7.0, 0.89)))
        ],
        f"cpu-async-{RATIO}to1": [_summary("CpuAsync", 8.0, 0.85, case=f"cpu-async-{RATIO}to1", ratio=RATIO, slow_ms=2000.0)],
        f"torchrun-ddp-{RATIO}to1": [_summary("TorchrunDDP", 12.0, 0.875, case=f"torchrun-ddp-{RATIO}to1", ratio=RATIO, slow_ms=2000.0)],
    }
    for case, ss in runs.items():
        for s in ss:
            (res / report.run_file("lenet", case, s["matrix"]["seed"])).write_text(json.dumps(s))
    (res / "lenet__cpu-sync.json").write_text(json.dumps({"matrix": {"model": "lenet", "case": "cpu-sync", "error": "exit 3; boom"}}))
    (res / report.MANIFEST).write_text(
        json.dumps(
            {
                "budget": "quick",
                "machine": "test box",
                "when": "now",
                "elapsed_s": 12.0,
                "seeds": 2,
                "lr_scaling": "linear",
                "covers": "lenet: some cases.",
            }
        )
    )
    return res


def test_report_rows_and_goals(fake_results):
    _, runs = report.load(fake_results)
    assert [s["matrix"]["seed"] for s in runs["lenet"][f"nccl-cadence-{RATIO}to1"]] == [0, 1]
    rows = report.rows(runs)
    by = {(r.case, r.metric): r for r in rows}
    cad = f"lenet NcclCadence {RATIO}:1"
    assert by[(cad, "seeds")].value == 2
    assert by[(cad, "train wall (median)")].value == pytest.approx(6.0)
    assert by[(cad, "command wall (median)")].value == pytest.approx(11.0)
    assert by[(cad, "final eval (mean)")].value == pytest.approx(88.0)
    assert by[(cad, "final eval (min)")].value == pytest.approx(87.0) and by[(cad, "final eval (max)")].value == pytest.approx(89.0)
    assert by[(cad, "measured ratio (slow/fast step)")].value == pytest.approx(4.0)
    # ideal = the side-by-side run's 50/s; the two seeds ran 40/s and 28.6/s, each against seed 0's run
    assert by[(cad, "ideal samples/s (median)")].value == pytest.approx(50.0)
    frac = by[(cad, "of ideal (median)")]
    assert frac.value == pytest.approx((40 + 200 / 7) / 2 / 50.0) and frac.goal == ">= 0.90 of ideal" and frac.met is False
    # solo alone: solo rate (50/s) x (1 + 1/4) = 62.5/s, reported beside it, no goal
    alone = by[(cad, "of ideal, solo alone (median)")]
    assert alone.value == pytest.approx((40 + 200 / 7) / 2 / 62.5) and alone.goal is None
    speed = by[(cad, f"train speed-up vs torchrun DDP {RATIO}:1")]
    assert speed.value == pytest.approx(2.0) and speed.met is True and speed.goal == ">= 1.8x"
    assert by[(cad, f"command speed-up vs torchrun DDP {RATIO}:1")].value == pytest.approx(17.0 / 11.0)
    assert by[(cad, f"eval - torchrun DDP {RATIO}:1 (means)")].met is True
    slow = by[(f"lenet CpuAsync {RATIO}:1", f"train speed-up vs torchrun DDP {RATIO}:1")]
    assert slow.value == pytest.approx(1.5) and slow.met is False
    assert by[(f"lenet CpuAsync {RATIO}:1", f"eval - torchrun DDP {RATIO}:1 (means)")].met is False  # 2.5 points below
    assert by[(f"lenet torchrun DDP {RATIO}:1", "measured ratio (slow/fast step)")].value == pytest.approx(4.0)
    assert by[("lenet NcclCadence", "train speed-up vs torchrun DDP")].value == pytest.approx(2.0)
    assert by[("lenet CpuSync", "failed runs")].met is False
    assert report.idle_shares(runs["lenet"]["nccl-cadence"][0]) == [pytest.approx(0.75), pytest.approx(0.75)]


def test_report_names_the_runs_a_slowed_machine_ran(fake_results, tmp_path):
    """Each run's pace probe: the spread goes into the rows and the text, and a run that read
    over 1.15x the median is named (its ratio was taken on a slower machine)."""
    _, runs = report.load(fake_results)
    assert report.probe_text(runs) == ""  # runs from before the probe: nothing claimed
    probed = sorted(fake_results.glob("lenet__*seed*.json"))
    for i, path in enumerate(probed):
        s = json.loads(path.read_text())
        s["matrix"]["pace_probe_ms"] = 0.60 if "cpu-async" in path.name else 0.30 + 0.01 * (i % 2)
        path.write_text(json.dumps(s))
    _, runs = report.load(fake_results)
    text = report.probe_text(runs)
    assert f"each of the {len(probed)} runs" in text and "0.600" in text
    assert f"1 run(s) read more than 1.15× the median, on a slowed machine: lenet CpuAsync {RATIO}:1 seed 0 (0.600 ms)" in text
    by = {(r.case, r.metric): r.value for r in report.rows(runs)}
    median = by[("machine", "pace probe, median")]
    assert 0.30 <= median <= 0.31 and by[("machine", "pace probe, slowest / median")] == pytest.approx(0.60 / median)
    assert by[("machine", "runs probed > 1.15x median")] == 1
    doc = tmp_path / "bench.md"
    report.main(["--results", str(fake_results), "--doc", str(doc), "--no-plots"])
    assert text in doc.read_text() and "--steady-ms" not in doc.read_text()
    # a suite that waited for its pace, and ran one case again
    manifest = json.loads((fake_results / report.MANIFEST).read_text())
    (fake_results / report.MANIFEST).write_text(json.dumps({**manifest, "steady_ms": 0.5, "steady_reruns": 2}))
    s = json.loads(probed[0].read_text())
    s["matrix"]["pace_reruns"] = 1
    probed[0].write_text(json.dumps(s))
    report.main(["--results", str(fake_results), "--doc", str(doc), "--no-plots"])
    assert "at most 0.500 ms (`--steady-ms`)" in doc.read_text() and "(up to 2 times): 1 rerun(s)." in doc.read_text()


def test_the_pace_probe_times_a_step_and_leaves_the_thread_count_alone():
    import torch

    from bench import pace_probe

    before = torch.get_num_threads()
    ms = pace_probe.probe_ms(steps=20, repeats=2)
    assert 0 < ms < 1000 and torch.get_num_threads() == before
    assert pace_probe.spread([]) is None
    assert pace_probe.spread([1.0, 1.1, 1.0, 2.0]) == {"min": 1.0, "median": 1.05, "max": 2.0, "slow": 1}


def test_a_slow_patch_is_waited_out_until_the_probe_reads_steady_or_patience_ends():
    from bench import pace_probe

    now = [0.0]
    said: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s

    def run(readings: list[float], patience: float) -> tuple[float, float]:
        it = iter(readings)
        return pace_probe.wait_for_pace(0.36, patience, probe=lambda: next(it), sleep=sleep, clock=lambda: now[0], say=said.append)

    assert run([0.30], 600) == (0.30, 0.0) and not said  # steady at once: no wait, nothing said
    now[0] = 0.0
    assert run([0.52, 0.61, 0.33], 600) == (0.33, 40.0)  # two slow probes, 20 s apart, then steady
    assert len(said) == 2 and "probe 0.520 ms > 0.360" in said[0]
    now[0] = 0.0
    assert run([0.52] * 10, 50) == (0.52, 60.0)  # patience spent: goes on at the pace there is


def test_a_run_that_a_slow_patch_overtook_is_run_again():
    """``steady_run``: the probe after a run reading over the limit means a slow patch took part of
    its timing: it is run again, up to ``reruns`` times, and the last is kept with its probes."""
    from bench import pace_probe

    def steady(readings: list[float], limit: float | None, reruns: int = 2) -> tuple[int, dict, list[str]]:
        it, runs, said = iter(readings), [0], []

        def run() -> int:
            runs[0] += 1
            return runs[0]

        def wait(limit_ms: float, patience_s: float, *, probe, say) -> tuple[float, float]:
            return probe(), 5.0  # each wait took 5 s

        result, pace = pace_probe.steady_run(run, limit, 600, reruns=reruns, probe=lambda: next(it), wait=wait, say=said.append)
        return result, pace, said

    result, pace, said = steady([0.30, 0.33], 0.36)  # steady before and after: one run
    assert result == 1 and pace == {"pace_probe_ms": 0.30, "pace_probe_after_ms": 0.33, "pace_waited_s": 5.0, "pace_reruns": 0} and not said
    result, pace, said = steady([0.30, 0.52, 0.31, 0.34], 0.36)  # slowed during the first run: run again
    assert result == 2 and pace == {"pace_probe_ms": 0.31, "pace_probe_after_ms": 0.34, "pace_waited_s": 10.0, "pace_reruns": 1}
    assert len(said) == 1 and "0.520 after > 0.360" in said[0]
    result, pace, said = steady([0.30, 0.50] * 3, 0.36)  # slow after every run: two reruns, the last kept
    assert result == 3 and pace["pace_reruns"] == 2 and pace["pace_probe_after_ms"] == 0.50 and len(said) == 2
    result, pace, said = steady([0.30, 0.90], None)  # no limit: probes recorded, never run again
    assert result == 1 and pace == {"pace_probe_ms": 0.30, "pace_probe_after_ms": 0.90, "pace_waited_s": 0.0, "pace_reruns": 0}


def test_report_writes_only_between_markers(fake_results, tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\nhand-written text\n")
    assert report.main(["--results", str(fake_results), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written text\n")
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert "test box" in text and "| NcclCadence | 1 | 89.00% | 0.5000 | 2.00 s | 7.0 s |" in text
    assert "| NcclCadence 4:1 | 2 | 88.00% (87.00–89.00) |" in text
    assert "2.00× ✔" in text and "1.50× ✘" in text and "failed: exit 3; boom" in text
    assert "linear scaling rule" in text and "predate" not in text and "4.00× / 4.00×" in text
    # again, with text after the section: replaced in place, the rest untouched
    doc.write_text(text + "\n## After\n")
    report.main(["--results", str(fake_results), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"])
    again = doc.read_text()
    assert again.count(report.BEGIN) == 1 and again.endswith("\n## After\n") and again.startswith("# Benchmarks\n")


def test_report_reads_results_from_before_the_seeds(fake_results, tmp_path):
    """Old results: one ``<model>__<case>.json`` each, no seeds in the manifest: seed 0, marked as predating."""
    for path in fake_results.glob("*__seed1.json"):
        path.unlink()
    for path in fake_results.glob("*__seed0.json"):
        path.rename(path.with_name(path.name.replace("__seed0", "")))
    manifest = fake_results / report.MANIFEST
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k not in ("seeds", "lr_scaling")}))
    _, runs = report.load(fake_results)
    assert [s["matrix"]["seed"] for s in runs["lenet"]["solo"]] == [0]
    doc = tmp_path / "bench.md"
    assert report.main(["--results", str(fake_results), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"]) == 0
    assert "predate the issue-22 protocol" in doc.read_text()


def test_report_plots(fake_results, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'flodl[bench]')")
    doc, img = tmp_path / "bench.md", tmp_path / "img"
    assert report.main(["--results", str(fake_results), "--doc", str(doc), "--img", str(img)]) == 0
    png = img / "matrix_lenet.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "img/matrix_lenet.png" in doc.read_text()


def test_report_without_matplotlib_says_so(fake_results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    doc = tmp_path / "bench.md"
    with pytest.raises(SystemExit) as info:
        report.main(["--results", str(fake_results), "--doc", str(doc), "--img", str(tmp_path / "img")])
    assert "pip install" in str(info.value) and "matplotlib" in str(info.value)
    assert not doc.exists()  # nothing written


def test_gpu_report_has_its_own_section_beside_the_cpu_one(fake_results, tmp_path):
    doc = tmp_path / "bench.md"
    args = ["--results", str(fake_results), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"]
    assert report.main(args) == 0 and report.main(["--device", "cuda", *args]) == 0
    text = doc.read_text()
    begin, end = report.markers("matrix_gpu")
    assert text.count(begin) == 1 and text.count(end) == 1 and text.count(report.BEGIN) == 1
    gpu = text.split(begin, 1)[1]
    assert "matrix on GPUs" in gpu and "NCCL" in gpu and "--device cuda" in gpu
    assert "matrix on GPUs" not in text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]


def test_the_gpu_suite_refuses_a_machine_without_two_gpus(capsys):
    import torch

    from bench.matrix import suite

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    with pytest.raises(SystemExit):
        suite.main(["--device", "cuda", "--quick"])
    assert "needs 2 GPUs" in capsys.readouterr().err


@pytest.mark.timeout(120)  # 13-15 s on a quiet 2-core VM (two runs, mostly process start-up); 30 s under heavy load
def test_the_suite_runs_end_to_end(tmp_path, capsys):
    """A flodl 4:1 case and a torchrun DDP 4:1 case, for real, into a temporary folder (never bench/results)."""
    pytest.importorskip("sklearn", reason=NO_SKLEARN)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available: torchrun cannot run here")
    from bench.matrix import suite

    out = tmp_path / "matrix"
    # --base-ms 2: rank 1 steps every 8 ms, far above a logistic regression step even over 4 noisy steps
    code = suite.main(
        [
            "--models",
            "logreg",
            "--cases",
            f"nccl-cadence-{RATIO}to1,script-nccl-cadence-{RATIO}to1,torchrun-ddp-{RATIO}to1",
            "--samples",
            "256",
            "--epochs",
            "1",
            "--seeds",
            "1",
            "--base-ms",
            "2",
            "--results",
            str(out),
            "--timeout",
            "60",
        ]
    )
    assert code == 0, capsys.readouterr().out[-3000:]
    manifest = json.loads((out / report.MANIFEST).read_text())
    assert manifest["seeds"] == 1 and manifest["lr_scaling"] == "linear" and manifest["failed"] == 0
    # the machine's pace, probed before each of the 4 runs (calibrating side-by-side included)
    probe = manifest["pace_probe_ms"]
    assert 0 < probe["min"] <= probe["median"] <= probe["max"] and 0 <= probe["slow"] <= 4
    runs = {}
    for case in (f"nccl-cadence-{RATIO}to1", f"script-nccl-cadence-{RATIO}to1", f"torchrun-ddp-{RATIO}to1"):
        s = json.loads((out / report.run_file("logreg", case, 0)).read_text())
        meta = runs[case] = s["matrix"]
        assert "error" not in meta
        assert 0 < meta["train_s"] < meta["command_s"]  # both times: training alone, and the whole command
        assert meta["base_ms"] == 2.0 and meta["measured_ratio"] > 1.0 and meta["seed"] == 0
        assert "python -m " in meta["command"]
        assert probe["min"] <= max(meta["pace_probe_ms"], meta["pace_probe_after_ms"]) <= probe["max"]
        assert meta["pace_waited_s"] == 0.0  # no --steady-ms: probed, not waited for
    assert runs[f"nccl-cadence-{RATIO}to1"]["command"].startswith(  # the command as one would type it
        f"FLODL_MATRIX_SEED=0 FLODL_SIMULATE_SLOWDOWN=1:{RATIO} FLODL_SIMULATE_BASE_MS=1:2.0000 python -m flodl.controller "
    )
    # one fixed base for every system (--live-pace is opt-in): no board anywhere
    assert all(meta["pace"] == "fixed" and "PACE_FILE" not in meta["command"] for meta in runs.values())
    assert "--pace-file" not in runs[f"torchrun-ddp-{RATIO}to1"]["command"]
    ddp = runs[f"torchrun-ddp-{RATIO}to1"]
    assert ddp["lr_scaling"] == "linear" and ddp["lr_ddp"] == pytest.approx(2 * ddp["lr"])
    # the flodl 4:1 case brought its ideal along: two solo runs side by side, the second paced 4:1
    sbs = json.loads((out / report.run_file("logreg", f"side-by-side-{RATIO}to1", 0)).read_text())
    assert "error" not in sbs["matrix"], sbs["matrix"].get("error")
    both = sbs["side_by_side"]
    assert sbs["train_samples_per_s"] == pytest.approx(both["fast_samples_per_s"] + both["paced_samples_per_s"])
    assert both["paced_samples_per_s"] < both["fast_samples_per_s"] and sbs["matrix"]["measured_ratio"] > 1.0
    assert " & " in sbs["matrix"]["command"] and f"FLODL_SIMULATE_SLOWDOWN=0:{RATIO}" in sbs["matrix"]["command"]
    pair = runs[f"nccl-cadence-{RATIO}to1"]
    assert pair["ideal_samples_per_s"] == pytest.approx(sbs["train_samples_per_s"]) and pair["of_ideal"] > 0
    # script mode: the same run in the user's own loop, its eval the ranks' reports after the last epoch
    script = json.loads((out / report.run_file("logreg", f"script-nccl-cadence-{RATIO}to1", 0)).read_text())
    assert "--script" in script["matrix"]["command"] and script["matrix"]["command"].endswith("-- --model logreg --epochs 1")
    assert 0 < script["final_eval"] <= 1 and script["matrix"]["of_ideal"] > 0
    printed = capsys.readouterr().out
    for metric in (
        "measured ratio (slow/fast step)",
        "command wall (median)",
        "train wall (median)",
        f"command speed-up vs torchrun DDP {RATIO}:1",
        f"train speed-up vs torchrun DDP {RATIO}:1",
    ):
        assert metric in printed
    assert not (out / "matrix.json").exists()


def _suite(
    folder, models: dict[str, list[str]], *, when: str, seeds: int = 2, failed: int = 0, machine: str = "box A", pace: str | None = None
):
    """A finished suite's folder: one run file per (model, case), and its manifest."""
    folder.mkdir()
    for model, cases in models.items():
        for case in cases:
            (folder / report.run_file(model, case, 0)).write_text(json.dumps({"matrix": {"model": model, "case": case, "from": when}}))
    plan = {m: {"samples": 100, "epochs": 2 if when == "new" else 1, "cases": cs} for m, cs in models.items()}
    manifest = {"budget": "full", "device": "cpu", "when": when, "elapsed_s": 3.0, "runs": 9, "failed": failed, "machine": machine}
    manifest |= {"seeds": seeds, "lr_scaling": "linear", "base_ms": None, "covers": f"{when} covers", "plan": plan}
    if pace:  # suites from before the live pace have no such key (they read as "fixed")
        manifest["pace"] = pace
    (folder / report.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_amend_replaces_the_rerun_models_runs_and_says_so(tmp_path):
    from bench.matrix import amend

    into = _suite(tmp_path / "suite", {"logreg": ["solo", "cpu-sync"], "lenet": ["solo"]}, when="old")
    rerun = _suite(tmp_path / "rerun", {"logreg": ["solo", "side-by-side-4to1"]}, when="new", machine="box B")
    manifest = amend.amend(rerun, into, code="abc123")
    files = sorted(p.name for p in into.glob("*__*.json"))
    # logreg's runs are the re-run's (its cpu-sync, not re-run, is gone); lenet's stay
    assert files == ["lenet__solo__seed0.json", "logreg__side-by-side-4to1__seed0.json", "logreg__solo__seed0.json"]
    assert json.loads((into / "logreg__solo__seed0.json").read_text())["matrix"]["from"] == "new"
    assert json.loads((into / "lenet__solo__seed0.json").read_text())["matrix"]["from"] == "old"
    assert manifest["when"] == "old" and manifest["plan"]["logreg"]["epochs"] == 2 and manifest["plan"]["lenet"]["epochs"] == 1
    assert manifest["covers"].startswith("logreg (100 samples × 2 epochs): solo, side-by-side-4to1; lenet (100 samples × 1 epochs)")
    assert manifest["amended"] == [
        {
            "when": "new",
            "commit": "abc123",
            "models": ["logreg"],
            "covers": "new covers",
            "runs": 9,
            "elapsed_s": 3.0,
            "machine": "box B",
            "pace": "fixed",
        }
    ]
    assert json.loads((into / report.MANIFEST).read_text()) == manifest
    # the report states the re-run beside the suite's own date
    doc = tmp_path / "bench.md"
    report.main(["--results", str(into), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"])
    text = doc.read_text()
    assert "Re-run since, replacing those models' runs (`python -m bench.matrix.amend`): new, the code of abc123" in text
    assert "on another machine: box B" in text  # its cells compare with each other, not with the suite's


def test_amend_names_the_code_that_ran_and_the_models_it_added(tmp_path):
    """A re-run's manifest records its checkout's commit: the amend names that, not the checkout
    folding it in; a model the suite never ran is said to be added, not re-run."""
    from bench.matrix import amend

    into = _suite(tmp_path / "suite", {"lenet": ["solo"]}, when="old")
    rerun = _suite(tmp_path / "rerun", {"logreg": ["solo"]}, when="new")
    (rerun / report.MANIFEST).write_text(json.dumps({**json.loads((rerun / report.MANIFEST).read_text()), "commit": "ran1234"}))
    manifest = amend.amend(rerun, into, code="folding+")
    assert manifest["amended"][-1]["commit"] == "ran1234" and manifest["amended"][-1]["added"] == ["logreg"]
    doc = tmp_path / "bench.md"
    report.main(["--results", str(into), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"])
    assert "Run since, adding those models (`python -m bench.matrix.amend`): new, the code of ran1234" in doc.read_text()
    assert amend.commit() != "unknown"  # this checkout is a git repository: suites record where they ran


def test_amend_keeps_the_named_baselines_and_says_so(tmp_path):
    from bench.matrix import amend

    into = _suite(tmp_path / "suite", {"logreg": ["solo", "cpu-async-4to1", "torchrun-ddp-4to1"]}, when="old")
    rerun = _suite(tmp_path / "rerun", {"logreg": ["solo", "cpu-async-4to1"]}, when="new")
    manifest = amend.amend(rerun, into, code="abc123", keep=("torchrun-ddp-4to1",))
    runs = {p.name.split("__")[1]: json.loads(p.read_text())["matrix"]["from"] for p in into.glob("logreg__*.json")}
    assert runs == {"solo": "new", "cpu-async-4to1": "new", "torchrun-ddp-4to1": "old"}
    assert manifest["plan"]["logreg"]["cases"] == ["solo", "cpu-async-4to1", "torchrun-ddp-4to1"]
    assert manifest["amended"][-1]["kept"] == ["torchrun-ddp-4to1"]
    doc = tmp_path / "bench.md"
    report.main(["--results", str(into), "--doc", str(doc), "--img", str(tmp_path / "img"), "--no-plots"])
    assert "Kept from before it (`--keep`: these cases run no flodl code): torchrun-ddp-4to1." in doc.read_text()
    # a case the re-run ran cannot also be kept
    with pytest.raises(SystemExit, match="cannot be kept"):
        amend.amend(rerun, into, code="abc123", keep=("solo",))


def test_amend_mixes_paces_only_where_nothing_is_paced(tmp_path):
    from bench.matrix import amend

    into = _suite(tmp_path / "suite", {"logreg": ["solo", "cpu-async-4to1"], "mlp": ["solo"]}, when="old", pace="live")
    paced = _suite(tmp_path / "paced", {"logreg": ["solo", "cpu-async-4to1"]}, when="new")  # fixed: older
    with pytest.raises(SystemExit, match=re.escape("pace 'fixed' vs 'live'")):
        amend.amend(paced, into, code="x")
    equal = _suite(tmp_path / "equal", {"mlp": ["solo", "cpu-sync"]}, when="new")  # no 4:1 case: no pace to match
    manifest = amend.amend(equal, into, code="x")
    assert manifest["pace"] == "live" and manifest["amended"][-1]["pace"] == "fixed"
    assert json.loads((into / "mlp__cpu-sync__seed0.json").read_text())["matrix"]["from"] == "new"


@pytest.mark.parametrize(
    ("change", "says"),
    [({"seeds": 1}, "seeds 1 vs 2"), ({"failed": 2}, "2 failed run(s)")],
)
def test_amend_refuses_a_rerun_of_another_protocol_or_with_failures(tmp_path, change, says):
    from bench.matrix import amend

    into = _suite(tmp_path / "suite", {"logreg": ["solo"]}, when="old")
    rerun = _suite(tmp_path / "rerun", {"logreg": ["solo"]}, when="new", **change)
    with pytest.raises(SystemExit, match=re.escape(says)):
        amend.amend(rerun, into, code="x")
    assert json.loads((into / "logreg__solo__seed0.json").read_text())["matrix"]["from"] == "old"  # nothing moved
    with pytest.raises(SystemExit, match=r"no suite\.json"):
        amend.amend(tmp_path, into, code="x")


# ------------------------------------------------------------------ time to target (bench/matrix/target.py)


def test_a_goal_allows_half_a_point_and_five_percent_and_mirrors_for_lower_is_better():
    from bench.matrix.reach import Goal

    acc = Goal("accuracy", eval=0.90, loss=0.20)
    assert acc.met(0.8951, 0.21) and acc.met(0.95, 0.10)
    assert not acc.met(0.8949, 0.10)  # more than half a point below
    assert not acc.met(0.95, 0.2101)  # more than 1.05 x the loss
    assert not acc.met(None, 0.1) and not acc.met(float("nan"), 0.1)
    ppl = Goal("val_perplexity", eval=3.0, loss=0.20)  # lower is better: the mirror
    assert not ppl.higher_better and ppl.met(3.0049, 0.2) and not ppl.met(3.0051, 0.2) and ppl.met(1.0, 0.2)
    assert Goal.of({"eval_metric_name": "char_accuracy", "final_eval": 0.5, "final_loss": 1.5}) == Goal("char_accuracy", 0.5, 1.5)
    with pytest.raises(ValueError, match="final_eval"):
        Goal.of({"final_eval": None, "final_loss": 1.0})


def test_first_reach_reads_flodls_rows_their_last_epochs_loss_and_takes_the_evals_out():
    from bench.matrix.reach import Goal, first_reach

    goal = Goal("accuracy", eval=0.95, loss=0.10)
    history = [  # flodl: rows tile the training time; each row's eval came after its close
        {"first_epoch": 0, "epoch": 0, "wall_s": 1.0, "loss": 0.5, "eval": 0.80, "eval_s": 0.3, "epoch_losses": {"0": 0.5}},
        # a group of 3 epochs: its mean loss misses, its last epoch's own (what the eval scored) meets it
        {
            "first_epoch": 1,
            "epoch": 3,
            "wall_s": 2.0,
            "loss": 0.3,
            "eval": 0.96,
            "eval_s": 0.4,
            "epoch_losses": {"1": 0.5, "2": 0.3, "3": 0.1},
        },
        {"first_epoch": 4, "epoch": 4, "wall_s": 1.0, "loss": 0.05, "eval": 0.99, "eval_s": 0.3, "epoch_losses": {"4": 0.05}},
    ]
    reach = first_reach({"history": history}, goal, startup_s=4.0)
    assert reach.reached and reach.row == 1 and reach.epochs == 4
    assert reach.train_s == pytest.approx(3.0 - 0.3)  # the closes add up; the first row's eval is taken out, not its own
    assert reach.command_s == pytest.approx(4.0 + 2.7)
    never = first_reach({"history": history}, Goal("accuracy", eval=0.999, loss=0.01), startup_s=None)
    assert not never.reached and never.epochs == 5 and never.command_s is None
    assert never.train_s == pytest.approx(4.0 - 0.3 - 0.4)  # the whole run, its evals out
    counted = [{**row, "syncs": n} for row, n in zip(history, (3, 5, 2), strict=True)]
    assert first_reach({"history": counted}, goal, None).averages == 8  # the averages of the rows up to the one that met it
    assert first_reach({"history": counted}, Goal("accuracy", eval=0.999, loss=0.01), None).averages == 10


def test_first_reach_reads_the_ddp_scripts_rows_and_script_modes_scalars():
    from bench.matrix.reach import Goal, first_reach

    goal = Goal("accuracy", eval=0.90, loss=0.20)
    ddp = [  # the DDP script says when each row closed (evals before it included) and what its eval took
        {"epoch": 0, "wall_s": 1.0, "closed_s": 1.0, "loss": 0.4, "eval": 0.85, "eval_s": 0.5},
        {"epoch": 1, "wall_s": 1.0, "closed_s": 2.5, "loss": 0.2, "eval": 0.91, "eval_s": 0.5},
    ]
    assert first_reach({"history": ddp}, goal, 1.0).train_s == pytest.approx(2.0)
    assert first_reach({"history": ddp}, goal, 1.0).averages is None  # DDP averages gradients at every step: not counted
    script = [  # script mode: no controller eval; the ranks' metric and eval seconds (a per-epoch mean) as scalars
        {"first_epoch": 0, "epoch": 1, "wall_s": 2.0, "loss": 0.3, "eval": None, "scalars": {"accuracy": 0.8, "eval_s": 0.25}},
        {"first_epoch": 2, "epoch": 2, "wall_s": 1.0, "loss": 0.2, "eval": None, "scalars": {"accuracy": 0.9, "eval_s": 0.25}},
    ]
    reach = first_reach({"history": script}, goal, None)
    assert reach.reached and reach.epochs == 3 and reach.train_s == pytest.approx(3.0 - 2 * 0.25)


def test_the_record_watch_fires_on_the_first_completed_row_that_meets_the_goal(tmp_path):
    """Real records, as flodl's controller writes them (flodl.monitor), read while they are being written."""
    from bench.matrix.reach import Goal, RecordWatch
    from flodl.monitor.record_log import RecordLog
    from flodl.monitor.records import epoch_records, meta_record, node_record, rank_paths
    from flodl.plan.metrics import EpochReport, aggregate

    paths = rank_paths({0: "h", 1: "h"})
    watch = RecordWatch(tmp_path, Goal("accuracy", eval=0.9, loss=0.2))
    assert not watch()  # no log yet

    def epoch(log, e: int, loss: float, ev: float) -> None:
        reports = [EpochReport(r, e, 10, 320, 10 * loss, 100.0, 80.0, 1.0, 5.0, 1, {}) for r in (0, 1)]
        stats = aggregate(e, reports)
        stats.eval_value = ev
        log.write_all(epoch_records(stats, paths, {}, ts_ms=1000 + e))

    with RecordLog(tmp_path) as log:
        log.write(meta_record({}, ts_ms=1000, run={"run_id": "t"}))
        epoch(log, 0, 0.5, 0.95)  # eval met, loss not
        # a sub-epoch tick that would meet it: not a completed row
        log.write(node_record("root", metrics={"loss": 0.01, "eval": 0.99}, work=1, alive=True, ts_ms=1001, tick=1, epoch=1))
        assert not watch()
        epoch(log, 1, 0.21, 0.89)  # loss within 1.05 x, eval more than half a point below
        assert not watch()
        with open(tmp_path / "root.log", "ab") as fh:  # a line still being written waits for the next call
            fh.write(b'{"kind": "node", "epoch_complete": true, "epoch": 2, "metrics": {"loss": 0.1, ')
        assert not watch()
        with open(tmp_path / "root.log", "ab") as fh:
            fh.write(b'"eval": 0.95}}\n')
        assert watch() and watch.fired["epoch"] == 2
        epoch(log, 3, 0.05, 0.99)
        assert watch() and watch.fired["epoch"] == 2  # it stays on the first


def _ttt_run(case: str, seed: int, reached: bool, train_s: float, epochs: int = 10) -> dict:
    reach = {"reached": reached, "epochs": epochs, "train_s": train_s, "command_s": train_s + 5.0, "row": 0}
    goal = {"metric": "accuracy", "eval": 0.9, "loss": 0.2}
    return {"wall_s": train_s, "matrix": {"model": "mlp", "case": case, "seed": seed, "epochs": 30}, "ttt": {"goal": goal, "reach": reach}}


def test_time_to_target_rows_pair_the_seeds_and_rank_a_seed_that_never_reached_last(tmp_path):
    from bench.matrix import target

    runs = {
        "mlp": {
            "torchrun-ddp": [
                _ttt_run("torchrun-ddp", k, True, 5.0) | {"ttt": _ttt_run("", k, True, 5.0)["ttt"] | {"plateau_loss_drop": 0.02}}
                for k in range(3)
            ],
            "torchrun-ddp-4to1": [_ttt_run("torchrun-ddp-4to1", k, True, t) for k, t in enumerate((20.0, 24.0, 30.0))],
            "torchrun-postlocal-4to1": [_ttt_run("torchrun-postlocal-4to1", k, True, 15.0) for k in range(3)],
            # seed 2 never reached within the cap: 12 s is a lower bound
            "nccl-cadence-4to1": [
                _ttt_run("nccl-cadence-4to1", k, r, t) for k, (r, t) in enumerate(((True, 5.0), (True, 8.0), (False, 12.0)))
            ],
            "cpu-async-4to1": [{"matrix": {"model": "mlp", "case": "cpu-async-4to1", "seed": 0, "error": "exit 3; boom"}}],
        }
    }
    rows = {(r.case, r.metric): r for r in target.rows(runs)}
    cad = "mlp NcclCadence 4:1"
    assert rows[(cad, "seeds reached")].value == 2
    # the median time is seed 1's (8 s); the slowest is the seed that never reached, marked as such
    assert rows[(cad, "train_s_to_target (median)")].value == 8.0 and rows[(cad, "train_s_to_target (median)")].unit == "s"
    assert rows[(cad, "train_s_to_target (max)")].value == 12.0 and "not reached" in rows[(cad, "train_s_to_target (max)")].unit
    # speed-ups paired by seed: 20/5 = 4, 24/8 = 3, and seed 2's 30/12 = 2.5 an upper bound, ranked lowest
    speed = rows[(cad, "speedup_train_vs_ddp (median)")]
    assert speed.value == 3.0 and speed.met is True and speed.goal.startswith(">= 2x sooner than torchrun DDP at 4:1")
    assert rows[(cad, "speedup_train_vs_ddp (min)")].value == 2.5 and "upper bound" in rows[(cad, "speedup_train_vs_ddp (min)")].unit
    assert rows[(cad, "speedup_train_vs_postlocal (median)")].value == pytest.approx(15.0 / 8.0)
    assert rows[(cad, "speedup_train_vs_postlocal (median)")].met is True  # >= 1.5x
    assert rows[("all models NcclCadence 4:1", "speedup_train_vs_ddp (median over models)")].met is True  # 3 >= 2.5
    assert rows[("mlp CpuAsync 4:1", "failed runs")].met is False
    assert rows[("mlp target", "target eval (median)")].value == 0.9
    # torchrun's own cells carry no goal; post-local is compared with DDP, not with itself
    assert rows[("mlp torchrun post-local SGD 4:1", "speedup_train_vs_ddp (median)")].goal is None
    assert ("mlp torchrun post-local SGD 4:1", "speedup_train_vs_postlocal (median)") not in rows
    table = target.table(runs)
    assert "| mlp | NcclCadence 4:1 | 2/3 | 8.0 (5.0–>12.0) |" in table and "3.00× (<2.50×–4.00×)" in table
    assert "failed: exit 3; boom" in table


def test_time_to_target_systems_and_plans():
    from bench.matrix import SCRIPT_4TO1, SYSTEMS, system_case, target

    assert SCRIPT_4TO1.id == f"script-nccl-cadence-{RATIO}to1" and SCRIPT_4TO1.script and SCRIPT_4TO1.label.endswith("script mode")
    assert system_case("torchrun-postlocal", 8).id == "torchrun-postlocal-8to1" and system_case("cpu-async", 8).ratio == 8
    with pytest.raises(ValueError, match="unknown system 'gloo'"):
        system_case("gloo", 4)
    assert set(target.FULL_SYSTEMS) <= set(SYSTEMS) and set(target.QUICK_SYSTEMS) <= set(target.FULL_SYSTEMS)
    assert set(target.PLATEAU["full"]) == set(tasks.SPECS)  # every matrix model has a plateau budget
    for model, plateau in target.PLATEAU["full"].items():  # at least the matrix's equal-epoch budget, at the matrix's samples
        assert plateau.budget.samples == PLANS["full"][model][0].samples and plateau.budget.epochs >= PLANS["full"][model][0].epochs


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--models", "vgg"], "--models: unknown model"),
        (["--systems", "horovod"], "--systems: unknown system"),
        (["--ratios", "1"], "--ratios: each must be at least 2"),
        (["--ratios", "four"], "--ratios must be whole numbers"),
        (["--seeds", "0"], "--seeds must be at least 1"),
    ],
)
def test_time_to_target_refuses_bad_arguments_by_name(argv, says, capsys, tmp_path):
    from bench.matrix import target

    with pytest.raises(SystemExit):
        target.main([*argv, "--results", str(tmp_path)])
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_a_resumed_suite_keeps_only_the_runs_that_finished(tmp_path):
    from bench.matrix.suite import _finished_run

    good, failed, torn = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    good.write_text(json.dumps({"final_eval": 0.9, "matrix": {"model": "mlp"}}))
    failed.write_text(json.dumps({"matrix": {"model": "mlp", "error": "timed out"}}))
    torn.write_text('{"matrix": ')
    assert _finished_run(good) == {"final_eval": 0.9, "matrix": {"model": "mlp"}}
    assert _finished_run(failed) is None and _finished_run(torn) is None and _finished_run(tmp_path / "none.json") is None
