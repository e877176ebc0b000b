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
* ideal, per ratio f and seed: two solo runs started together, the second
  paced f:1 as a pair's rank 1 is, their training rates added up (the pair's
  own conditions: each rank beside the other's process, nothing averaged, as
  ``bench.matrix``'s side-by-side case); of ideal = the run's training
  samples/s (eval pauses excluded: ``train_samples_per_s``) over that ideal;
  *of ideal, solo alone* = over solo rate x (1 + 1 / measured ratio);
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
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, RunFailed, controller_command, report, size_parser, smoke_results  # noqa: E402
from bench.matrix.report import measured_ratio, of_ideal, step_ms, train_wall  # noqa: E402
from bench.matrix.suite import SIDE_BY_SIDE_MARGIN, timed_run, timed_runs  # noqa: E402
from flodl.config.env import SIMULATE_BASE_MS, SIMULATE_SLOWDOWN  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mixture.py'}:task"
MODES = ("nccl-sync", "nccl-cadence", "nccl-async")
RATIOS = (1, 2, 4)
GOAL_OF_IDEAL = 0.90
GOAL_EVAL_POINTS = 1.0


def _command(nproc: int, mode: str, epochs: int, samples: int, seed: int, out: Path, factor: float, base_ms: float | None, paced: int):
    """The controller's command and environment for one run (rank ``paced`` slowed ``factor``-fold)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLODL_BENCH_SAMPLES=str(samples), FLODL_BENCH_SEED=str(seed))
    env.pop(SIMULATE_SLOWDOWN, None)
    env.pop(SIMULATE_BASE_MS, None)
    if factor > 1.0:
        env[SIMULATE_SLOWDOWN] = f"{paced}:{factor:g}"
        if base_ms:
            env[SIMULATE_BASE_MS] = f"{paced}:{base_ms:.4f}"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = controller_command(
        TASK, nproc_per_node=nproc, mode=mode, epochs=epochs, seed=seed, summary_json=out, no_progress=True, dashboard_port=-1
    )
    return cmd, env


def _summary(out: Path, what: str) -> dict:
    if not out.exists():
        raise RunFailed(f"{what}: no summary written")
    summary = json.loads(out.read_text())
    if summary.get("exit_reason") != "completed":
        raise RunFailed(f"{what}: exit_reason {summary.get('exit_reason')!r}")
    return summary


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
    """One real run of the controller (rank 1 slowed ``factor``-fold); its summary plus ``command_s`` (process start to exit)."""
    with tempfile.TemporaryDirectory(prefix="flodl-hetero-") as td:
        out = Path(td) / "summary.json"
        cmd, env = _command(nproc, mode, epochs, samples, seed, out, factor, base_ms, paced=1)
        command_s, _ = timed_run(cmd, env, Path(td) / "run.log", timeout)
        summary = _summary(out, f"{mode} x{nproc}")
    summary["command_s"] = command_s
    return summary


def side_by_side(epochs: int, samples: int, seed: int, *, factor: float, base_ms: float, timeout: float = 600.0) -> float:
    """The ideal of an f:1 pair in its own conditions (samples/s): two solo runs started together, the
    second paced ``factor``:1 as a pair's rank 1 is (on fewer epochs, so that it outlasts the first),
    their training rates added up (bench/matrix/suite.py's side-by-side case, for this task)."""
    slow_epochs = max(1, math.ceil(epochs * SIDE_BY_SIDE_MARGIN / factor))
    with tempfile.TemporaryDirectory(prefix="flodl-hetero-") as td:
        fast_out, slow_out = Path(td) / "fast.json", Path(td) / "slow.json"
        fast = _command(1, "nccl-cadence", epochs, samples, seed, fast_out, 1.0, None, paced=0)
        slow = _command(1, "nccl-cadence", slow_epochs, samples, seed, slow_out, factor, base_ms, paced=0)
        timed_runs([(*fast, Path(td) / "fast.log"), (*slow, Path(td) / "slow.log")], timeout)
        return sum(_summary(out, "side by side")["train_samples_per_s"] for out in (fast_out, slow_out))


def rows(solos: list[dict], pairs: dict[tuple[int, str], list[dict]], ideals: dict[int, list[float]] | None = None) -> list[Row]:
    """The results rows from each seed's solo run and the pairs' runs (``(ratio, mode) -> [summary per seed]``,
    in the solos' seed order); ``ideals``: ratio -> each seed's side-by-side ideal (samples/s), which
    *of ideal* divides by where given (else by the solo-alone ideal)."""
    med = statistics.median
    ideals = ideals or {}
    solo_eval = [s["final_eval"] * 100 for s in solos]
    out = [
        Row("solo", "seeds", float(len(solos)), "runs"),
        Row("solo", "step ms (median; the base)", med(step_ms(s)[0] for s in solos), "ms"),
        Row("solo", "train samples/s (median)", med(s["train_samples_per_s"] for s in solos), "samples/s"),
        Row("solo", "train wall (median)", med(train_wall(s) for s in solos), "s"),
        Row("solo", "command wall (median)", med(s["command_s"] for s in solos), "s"),
        Row("solo", "final eval (mean)", statistics.fmean(solo_eval), "%"),
    ]
    for f, got in ideals.items():
        out.append(Row(f"{f}:1 side by side", "ideal samples/s (median)", med(got), "samples/s"))
    for (f, mode), runs in pairs.items():
        case = f"{f}:1 {mode}"
        alone = [v for v in (of_ideal(p, s) for p, s in zip(runs, solos, strict=False)) if v is not None]
        sbs = [(p["train_samples_per_s"] / i, i) for p, i in zip(runs, ideals.get(f, []), strict=False) if i]
        ideal = sbs or alone
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
            if sbs and alone:
                out.append(Row(case, "of ideal, solo alone (median)", med(v[0] for v in alone), "fraction"))
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
    ideals: dict[int, list[float]] = {f: [] for f in sorted({f for f, _ in cases})}
    for seed in range(seeds):
        solo = run(1, "nccl-cadence", epochs, samples, seed)  # the default mode: the best flodl solo is the ideal
        base = step_ms(solo)[0]
        solos.append(solo)
        print(
            f"seed {seed}: solo {solo['train_samples_per_s']:,.0f} samples/s, step {base:.3f} ms (the base), "
            f"command {solo['command_s']:.1f} s",
            flush=True,
        )
        for f, got_ideals in ideals.items():
            got_ideals.append(side_by_side(epochs, samples, seed, factor=f, base_ms=base))
            print(f"seed {seed}: {f}:1 side by side (the ideal): {got_ideals[-1]:,.0f} samples/s", flush=True)
        for (f, mode), runs in pairs.items():
            s = run(2, mode, epochs, samples, seed, factor=f, base_ms=base)
            runs.append(s)
            ratio, alone = measured_ratio(s), of_ideal(s, solo)
            print(
                f"seed {seed}: {f}:1 {mode}: measured ratio {ratio or float('nan'):.2f}, of ideal "
                f"{s['train_samples_per_s'] / ideals[f][-1]:.2f} (solo alone: {alone[0] if alone else float('nan'):.2f}), "
                f"train wall {train_wall(s):.2f} s, command {s['command_s']:.1f} s",
                flush=True,
            )
    note = (
        f"{samples} samples x {epochs} epochs, {seeds} seed(s), batch 32 per rank, mixture MLP, 2 CPU ranks x 1 thread; "
        f"rank 1 paced to f x the solo step time (simulated; measured ratio reported); ideal = two solo runs side by side, "
        f"the second paced f:1, their rates added up (of ideal, solo alone = over solo rate x (1 + 1/measured ratio)), "
        f"solo from the same command and threads; timings medians over seeds, evals means; train wall excludes "
        f"start-up, command wall is process start to exit"
    )
    folder = smoke_results() if args.smoke else args.results
    where = {} if folder is None else {"results": folder}  # bench.common.report's results folder
    report("hetero", rows(solos, pairs, ideals), note=note, **where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
