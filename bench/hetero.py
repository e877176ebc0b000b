"""Unequal ranks: how much of the ideal throughput each mode keeps, and at what accuracy.

    python bench/hetero.py [--quick]

Two CPU ranks (one intra-op thread each) train the same task and sample budget;
rank 1 is made 1x, 2x or 4x slower with flodl's SIMULATED slowdown
(``FLODL_SIMULATE_SLOWDOWN``: it sleeps (f-1) x its compute after each step). The
ideal is the sum of each rank's solo throughput (each measured alone at its
speed). Each mode's training samples/s (eval pauses excluded on both sides:
``train_samples_per_s`` in the summary) is reported as a fraction of that ideal, with its
averaging rounds per epoch and its final eval against a solo run on the same
number of samples.

Goal (issue 3): Cadence and Async >= 90% of ideal at 4:1 (sync DDP sits near
40%), final eval within 1 point of solo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, quick_flag, report  # noqa: E402
from flodl import DdpRunConfig, Trainer  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mixture.py'}:task"
MODES = ("nccl-sync", "nccl-cadence", "nccl-async")


def run(nproc: int, slowdown: str, mode: str, epochs: int) -> dict:
    os.environ["FLODL_SIMULATE_SLOWDOWN"] = slowdown  # ranks inherit it
    try:
        return Trainer.builder(TASK).nproc_per_node(nproc).epochs(epochs).progress(False).config(DdpRunConfig().with_mode(mode)).run()
    finally:
        os.environ.pop("FLODL_SIMULATE_SLOWDOWN", None)


def main() -> None:
    quick = quick_flag(__doc__, "fewer samples and epochs (under two minutes)")
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank: the two ranks run side by side
    os.environ["FLODL_BENCH_SAMPLES"] = "8000" if quick else "16000"
    epochs = 2 if quick else 3
    ratios = (1, 2, 4)
    solo = {f: run(1, f"0:{f}" if f > 1 else "", "nccl-sync", epochs) for f in ratios}
    base = solo[1]
    rows: list[Row] = []
    for f in ratios:
        ideal = solo[1]["train_samples_per_s"] + solo[f]["train_samples_per_s"]
        rows.append(Row(f"{f}:1 solo", "ideal samples/s", ideal, "samples/s"))
        for mode in MODES:
            s = run(2, f"1:{f}" if f > 1 else "", mode, epochs)
            frac = s["train_samples_per_s"] / ideal * 100
            fast_goal = mode != "nccl-sync" and f == 4
            rows.append(Row(f"{f}:1 {mode}", "% of ideal", frac, "%", "≥ 90% at 4:1" if fast_goal else None, frac >= 90 if fast_goal else None))
            rows.append(Row(f"{f}:1 {mode}", "syncs/epoch", s["syncs"] / epochs, "rounds"))
            delta = (s["final_eval"] - base["final_eval"]) * 100
            rows.append(Row(f"{f}:1 {mode}", "eval - solo", delta, "points", "within 1 point", abs(delta) <= 1.0))
    rows.append(Row("solo 1x", "final accuracy", base["final_eval"] * 100, "%"))
    report("hetero", rows, note=f"{os.environ['FLODL_BENCH_SAMPLES']} samples x {epochs} epochs, batch 32 per rank, mixture MLP; slowdown simulated")


if __name__ == "__main__":
    main()
