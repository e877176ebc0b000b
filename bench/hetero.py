"""Unequal ranks: how much of the ideal throughput each mode keeps, and at what accuracy.

    python bench/hetero.py [--quick | --smoke] [--seeds N] [--results DIR]

Two CPU ranks (one intra-op thread each) train the same task (the Gaussian
mixture MLP of ``bench/tasks/mixture.py``) and sample budget; rank 1 is made
1x, 2x or 4x slower with flodl's SIMULATED slowdown, *paced*
(``FLODL_SIMULATE_SLOWDOWN=1:f`` with ``FLODL_SIMULATE_BASE_MS``: its step
period is f x the base step time; ``flodl.config.env.paced_step``). Every run is the
real command, ``python -m flodl.controller ... --summary-json``, timed around
the subprocess.

Per seed (``--seeds``: the initial weights, ``FLODL_BENCH_SEED``, and the
shuffle seed), a ``solo`` calibration run comes first: one rank, no slowdown,
the same threads and process launch. Its mean step time is the base the slow
rank is paced against, and its training samples/s is the solo rate. Then, for
each ratio and mode:

* measured ratio: rank 1's mean step time over rank 0's in that run (sleep
  included), from the summary's per-rank compute;
* ideal = solo rate x (1 + 1 / measured ratio); of ideal = the run's training
  samples/s (eval pauses excluded: ``train_samples_per_s``) over that ideal;
* train wall (``wall_s - eval_s``, start-up excluded) and command wall (process
  start to exit);
* syncs per epoch, and the final eval against the same seed's solo run.

Timings are medians over the seeds; evals the mean, with the lowest and highest.

Options: ``--quick`` (8,000 samples x 2 epochs, 1 seed; about 2 minutes here),
``--smoke`` (a solo and one 2:1 cadence run of 512 samples, 1 epoch: does the
bench still run? its JSON goes to ``$FLODL_BENCH_RESULTS`` or a temporary
folder), ``--seeds N`` (default 3; 1 with ``--quick`` or ``--smoke``),
``--results DIR`` (where ``hetero.json`` goes; default ``bench/results``, the
committed numbers: anywhere else for a trial run).

Goal (issue 3, issue 22): Cadence and Async >= 0.90 of ideal at 4:1 (sync DDP
sits near 40%), final eval within 1 point of solo.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402
from bench.matrix.report import measured_ratio, of_ideal, step_ms, train_wall  # noqa: E402
from bench.matrix.suite import RunFailed, timed_run  # noqa: E402
from flodl.config.env import SIMULATE_BASE_MS, SIMULATE_SLOWDOWN  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mixture.py'}:task"
MODES = ("nccl-sync", "nccl-cadence", "nccl-async")
RATIOS = (1, 2, 4)
GOAL_OF_IDEAL = 0.90
GOAL_EVAL_POINTS = 1.0


def run(
    nproc: int,
    mode: str,
    epochs: int,
    samples: int,
    seed: int,
    *,
    factor: float = 1.0,
    base_ms: float | None = None,
    timeout: float = 600.0,
) -> dict:
    """One real run of the controller; its summary plus ``command_s`` (process start to exit)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLODL_BENCH_SAMPLES=str(samples), FLODL_BENCH_SEED=str(seed))
    env.pop(SIMULATE_SLOWDOWN, None)
    env.pop(SIMULATE_BASE_MS, None)
    if factor > 1.0:
        env[SIMULATE_SLOWDOWN] = f"1:{factor:g}"
        if base_ms:
            env[SIMULATE_BASE_MS] = f"1:{base_ms:.4f}"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="flodl-hetero-") as td:
        out = Path(td) / "summary.json"
        cmd = [
            sys.executable,
            "-m",
            "flodl.controller",
            "--task",
            TASK,
            "--nproc-per-node",
            str(nproc),
            "--mode",
            mode,
            "--epochs",
            str(epochs),
            "--seed",
            str(seed),
            "--summary-json",
            str(out),
            "--no-progress",
            "--dashboard-port",
            "-1",
        ]
        command_s, _ = timed_run(cmd, env, Path(td) / "run.log", timeout)
        if not out.exists():
            raise RunFailed(f"{mode} x{nproc}: no summary written")
        summary = json.loads(out.read_text())
    if summary.get("exit_reason") != "completed":
        raise RunFailed(f"{mode} x{nproc}: exit_reason {summary.get('exit_reason')!r}")
    summary["command_s"] = command_s
    return summary


def rows(solos: list[dict], pairs: dict[tuple[int, str], list[dict]]) -> list[Row]:
    """The results rows from each seed's solo run and the pairs' runs (``(ratio, mode) -> [summary per seed]``,
    in the solos' seed order)."""
    med = statistics.median
    solo_eval = [s["final_eval"] * 100 for s in solos]
    out = [
        Row("solo", "seeds", float(len(solos)), "runs"),
        Row("solo", "step ms (median; the base)", med(step_ms(s)[0] for s in solos), "ms"),
        Row("solo", "train samples/s (median)", med(s["train_samples_per_s"] for s in solos), "samples/s"),
        Row("solo", "train wall (median)", med(train_wall(s) for s in solos), "s"),
        Row("solo", "command wall (median)", med(s["command_s"] for s in solos), "s"),
        Row("solo", "final eval (mean)", statistics.fmean(solo_eval), "%"),
    ]
    for (f, mode), runs in pairs.items():
        case = f"{f}:1 {mode}"
        ideal = [v for v in (of_ideal(p, s) for p, s in zip(runs, solos, strict=False)) if v is not None]
        goal = mode != "nccl-sync" and f == 4
        if ideal:
            frac = med(v[0] for v in ideal)
            out += [
                Row(case, "measured ratio (slow/fast step)", med(measured_ratio(p) for p in runs), "x"),
                Row(case, "ideal samples/s (median)", med(v[1] for v in ideal), "samples/s"),
                Row(
                    case,
                    "of ideal (median)",
                    frac,
                    "fraction",
                    f">= {GOAL_OF_IDEAL:.2f} of ideal" if goal else None,
                    frac >= GOAL_OF_IDEAL if goal else None,
                ),
            ]
        evals = [p["final_eval"] * 100 for p in runs]
        delta = statistics.fmean(evals) - statistics.fmean(solo_eval)
        out += [
            Row(case, "train samples/s (median)", med(p["train_samples_per_s"] for p in runs), "samples/s"),
            Row(case, "train wall (median)", med(train_wall(p) for p in runs), "s"),
            Row(case, "command wall (median)", med(p["command_s"] for p in runs), "s"),
            Row(case, "syncs/epoch (median)", med(p["syncs"] / p["epochs"] for p in runs), "rounds"),
            Row(case, "eval - solo (means)", delta, "points", f"within {GOAL_EVAL_POINTS:g} point", abs(delta) <= GOAL_EVAL_POINTS),
            Row(case, "final eval (min)", min(evals), "%"),
            Row(case, "final eval (max)", max(evals), "%"),
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = size_parser(__doc__, "8,000 samples x 2 epochs, 1 seed (about 2 minutes here)", "a solo and one 2:1 cadence run of 512 samples")
    ap.add_argument("--seeds", type=int, default=None, help="runs per case, seeds 0..N-1 (default 3; 1 with --quick)")
    ap.add_argument("--results", type=Path, default=None, help="where hetero.json goes (default bench/results)")
    args = ap.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick or args.smoke else 3)
    samples, epochs = (512, 1) if args.smoke else (8000, 2) if args.quick else (16000, 3)
    cases = [(2, "nccl-cadence")] if args.smoke else [(f, m) for f in RATIOS for m in MODES]
    solos: list[dict] = []
    pairs: dict[tuple[int, str], list[dict]] = {case: [] for case in cases}
    for seed in range(seeds):
        solo = run(1, "nccl-cadence", epochs, samples, seed)  # the default mode: the best flodl solo is the ideal
        base = step_ms(solo)[0]
        solos.append(solo)
        print(
            f"seed {seed}: solo {solo['train_samples_per_s']:,.0f} samples/s, step {base:.3f} ms (the base), "
            f"command {solo['command_s']:.1f} s",
            flush=True,
        )
        for (f, mode), runs in pairs.items():
            s = run(2, mode, epochs, samples, seed, factor=f, base_ms=base)
            runs.append(s)
            got, ratio = of_ideal(s, solo), measured_ratio(s)
            print(
                f"seed {seed}: {f}:1 {mode}: measured ratio {ratio or float('nan'):.2f}, of ideal "
                f"{got[0] if got else float('nan'):.2f}, train wall {train_wall(s):.2f} s, command {s['command_s']:.1f} s",
                flush=True,
            )
    note = (
        f"{samples} samples x {epochs} epochs, {seeds} seed(s), batch 32 per rank, mixture MLP, 2 CPU ranks x 1 thread; "
        f"rank 1 paced to f x the solo step time (simulated; measured ratio reported); ideal = solo rate x (1 + 1/measured "
        f"ratio), solo from the same command and threads; timings medians over seeds, evals means; train wall excludes "
        f"start-up, command wall is process start to exit"
    )
    folder = smoke_results() if args.smoke else args.results
    where = {} if folder is None else {"results": folder}  # bench.common.report's results folder
    report("hetero", rows(solos, pairs), note=note, **where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
