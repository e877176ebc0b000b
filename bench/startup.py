"""Start-up: the README's main job under flodl vs the same training under torchrun + DDP.

    python bench/startup.py [--quick | --smoke] [--pairs N] [--epochs N]

flodl runs the README's command, ``python -m flodl.controller --task
examples/digits.py:task --nproc-per-node 2 --epochs 5``; torchrun runs
``python -m torch.distributed.run --nproc-per-node 2 bench/startup_ddp.py``,
a plain DDP script (gloo) with the same data, model, optimizer, batch size
per rank and epochs. Both are timed from the moment the bench starts the
command: to the first batch trained (flodl: the summary's ``startup``, whose
``first_batch_s`` counts from the controller's process start; torchrun: the
first ``FIRST_BATCH`` time a rank prints after its first optimizer step)
and to the command's exit.

Each repetition is a pair run back to back, who goes first alternating, so a
machine whose load drifts hurts both sides alike; the table gives the
medians over the pairs (5; 3 with ``--quick``) and the median of the
per-pair ratios of the first batch (the note lists every pair's), and the note the load average before and after and flodl's start-up phases
(median seconds from the process start). Goal (issue 19): flodl's time to
the first batch ≤ 1.2× torchrun's.

``--smoke`` runs one pair of one epoch and writes its JSON under
``$FLODL_BENCH_RESULTS`` or a temporary folder, never ``bench/results``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, size_parser, smoke_results, start_controller  # noqa: E402

GOAL = "≤ 1.2× torchrun"
PHASES = ("workers_up_s", "ranks_built_s", "group_formed_s", "first_batch_s")


def flodl_run(epochs: int, tmp: Path) -> tuple[float, float, dict]:
    """(seconds to the first batch, seconds to the exit, the summary's ``startup``) of one flodl run."""
    run = start_controller(
        ["--task", "examples/digits.py:task", "--nproc-per-node", "2", "--epochs", str(epochs)], workdir=tmp, name="flodl"
    )
    startup = run.finish(600)["startup"]
    return startup["started_unix"] + startup["first_batch_s"] - run.started, run.wall_s, startup


def torchrun_run(epochs: int) -> tuple[float, float]:
    """(seconds to the first batch, seconds to the exit) of one torchrun run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "bench" / "startup_ddp.py"), str(epochs)]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    whole = time.time() - t0
    if res.returncode != 0:
        raise RuntimeError(f"torchrun exited {res.returncode}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    firsts = [float(t) for t in re.findall(r"FIRST_BATCH (\d+\.\d{6})", res.stdout)]
    if not firsts:
        raise RuntimeError(f"torchrun printed no FIRST_BATCH:\n{res.stdout[-2000:]}")
    return min(firsts) - t0, whole


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = size_parser(__doc__, "3 pairs", "one pair of one epoch")
    parser.add_argument("--pairs", type=int, help="pairs to run (default 5; --quick 3)")
    parser.add_argument("--epochs", type=int, help="epochs of each run (default 5, the README's; --smoke 1)")
    args = parser.parse_args()
    pairs = args.pairs or (1 if args.smoke else 3 if args.quick else 5)
    epochs = args.epochs or (1 if args.smoke else 5)
    load_before = load()
    flodl: list[tuple[float, float]] = []
    torchrun: list[tuple[float, float]] = []
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    with tempfile.TemporaryDirectory(prefix="flodl-startup-") as tmp:
        for i in range(pairs):
            for side in ("flodl", "torchrun") if i % 2 == 0 else ("torchrun", "flodl"):
                if side == "flodl":
                    first, whole, startup = flodl_run(epochs, Path(tmp))
                    flodl.append((first, whole))
                    for p in PHASES:
                        phases[p].append(startup.get(p, float("nan")))
                else:
                    torchrun.append(torchrun_run(epochs))
                print(f"pair {i + 1}/{pairs} {side}: first batch {(flodl if side == 'flodl' else torchrun)[-1][0]:.2f} s", flush=True)
    med = statistics.median
    f_first, t_first = med(r[0] for r in flodl), med(r[0] for r in torchrun)
    f_whole, t_whole = med(r[1] for r in flodl), med(r[1] for r in torchrun)
    # per pair, as bench/overhead.py: a load that drifts over the run moves both sides of a pair alike
    ratios = [f[0] / t[0] for f, t in zip(flodl, torchrun, strict=True)]
    ratio = med(ratios)
    case = f"README job, 2 CPU ranks, {epochs} epoch(s), median of {pairs}"
    rows = [
        Row(case, "flodl: first batch", f_first, "s"),
        Row(case, "torchrun: first batch", t_first, "s"),
        Row(case, "first batch flodl/torchrun", ratio, "x", GOAL, ratio <= 1.2),  # the median pair's
        Row(case, "flodl: whole command", f_whole, "s"),
        Row(case, "torchrun: whole command", t_whole, "s"),
        Row(case, "whole flodl/torchrun", f_whole / t_whole, "x"),
    ]
    spans = ", ".join(f"{p.removesuffix('_s')} {med(v):.2f} s" for p, v in phases.items())
    note = (
        f"load average (1, 5, 15 min) {load_before} before, {load()} after, on {os.cpu_count()} cores; "
        f"flodl's start-up from its process start (medians): {spans}; "
        f"first batch per run, flodl {[round(r[0], 2) for r in flodl]}, torchrun {[round(r[0], 2) for r in torchrun]}, "
        f"flodl/torchrun per pair {[round(r, 2) for r in ratios]}"
    )
    report("startup", rows, note=note, results=smoke_results() if args.smoke else None)


if __name__ == "__main__":
    main()
