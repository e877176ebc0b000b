"""A CUDA rank plus CPU ranks against the CUDA rank alone, in time to the CUDA rank's own quality.

    python bench/mixed_target.py [--quick | --smoke] [--seeds N]

The target is what ``cuda:0`` alone reaches: its final eval and training loss after ``EPOCHS``
epochs of ``bench/tasks/mlp.py`` (``task_with_eval``: an MLP on a learnable synthetic problem,
accuracy on held-out samples, an eval after every epoch). Then ``cuda:0`` with one and with three
CPU ranks beside it (``cpu-cadence``: the CPU averaging backend, the same-host lane) trains up
to twice as many epochs, under each way of combining replicas (docs/cadence.md, *Combining
replicas*): the default (batch weights, the LR factor on every step), ``--lr-scale-ratio 0``,
and ``--average-weights equal --lr-scale-on average``. Reported per run: train time to the
target (bench/matrix/reach.py: eval within 0.5 point, loss within 5%, evals left out), against
the CUDA rank alone's; the CUDA rank's own rate (samples/s in its epochs) against alone; and
where its cores were (GPU and CPU ranks share the host: host/cores.py pins them).

Goals (issue 49): with one CPU rank the target >= 1.2x sooner than alone; with three never
slower; the CUDA rank keeps >= 95% of its alone rate. Needs a CUDA device: without one it says
so and writes nothing (``--smoke`` then exits 1). ``--smoke``: 2 epochs, 4,096 samples, one CPU
rank, one way, into a temporary folder.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, cuda_or_stop, report, run_controller, size_parser, smoke_results  # noqa: E402
from bench.matrix.reach import Goal, first_reach  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mlp.py'}:task_with_eval"
#: how replicas are combined in the mixed runs: name -> extra flags
WAYS = {
    "default": [],
    "ratio 0": ["--lr-scale-ratio", "0"],
    "equal, factor on the average": ["--average-weights", "equal", "--lr-scale-on", "average"],
}


def run(devices: str, epochs: int, width: int, samples: int, seed: int, extra: list[str]) -> dict:
    args = ["--task", TASK, "--devices", devices, "--epochs", str(epochs), "--seed", str(seed), "--dashboard-port", "-1"]
    args += ["--eval-every-epochs", "1", "--no-progress", *extra]
    if devices != "cuda:0":
        args += ["--mode", "cpu-cadence"]
    env = {
        **os.environ,
        "FLODL_BENCH_WIDTH": str(width),
        "FLODL_BENCH_SAMPLES": str(samples),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return run_controller(args, env=env, timeout_s=900)


def gpu_rate(summary: dict) -> float:
    """The CUDA rank's (rank 0's) own rate: the median over its rows of its samples per second."""
    rates = [h["per_rank"]["0"]["samples_per_s"] for h in summary["history"] if "0" in h.get("per_rank", {})]
    return statistics.median(rates) if rates else 0.0


def main() -> None:
    parser = size_parser(__doc__, "fewer samples and epochs, 1 seed", "2 epochs of 4,096 samples, one CPU rank")
    parser.add_argument("--seeds", type=int, default=None, help="runs per case (default 2; 1 with --quick or --smoke)")
    args = parser.parse_args()

    if not cuda_or_stop("bench/mixed_target.py", smoke=args.smoke):
        return
    epochs, samples, width = (2, 4096, 256) if args.smoke else (6, 32768, 1024) if args.quick else (8, 65536, 1024)
    seeds = args.seeds or (1 if args.quick or args.smoke else 2)
    mixes = ("cuda:0,cpu",) if args.smoke else ("cuda:0,cpu", "cuda:0,cpu,cpu,cpu")
    ways = {"default": []} if args.smoke else WAYS
    rows: list[Row] = []
    for seed in range(seeds):
        alone = run("cuda:0", epochs, width, samples, seed, [])
        goal = Goal.of(alone)  # the CUDA rank alone's final eval and loss
        base = first_reach(alone, goal, alone.get("startup_s"))
        base_rate = gpu_rate(alone)
        case = f"seed {seed} cuda:0 alone"
        rows.append(Row(case, "train s to target", base.train_s or 0.0, "s"))
        rows.append(Row(case, "final eval", alone["final_eval"] or 0.0, ""))
        rows.append(Row(case, "cuda:0 samples/s", base_rate, "samples/s"))
        for devices in mixes:
            cpus = devices.count("cpu")
            for way, extra in ways.items():
                mixed = run(devices, 2 * epochs, width, samples, seed, extra)
                reach = first_reach(mixed, goal, mixed.get("startup_s"))
                case = f"seed {seed} cuda:0+{cpus}cpu {way}"
                if reach.train_s is None or not base.train_s:
                    rows.append(Row(case, "sooner than alone", 0.0, "x", _goal(cpus), False))
                else:
                    speedup = base.train_s / reach.train_s
                    rows.append(Row(case, "sooner than alone", speedup, "x", _goal(cpus), speedup >= (1.2 if cpus == 1 else 1.0)))
                rate = gpu_rate(mixed) / base_rate if base_rate else 0.0
                rows.append(Row(case, "cuda:0 rate vs alone", rate, "x", ">= 0.95 of its alone rate", rate >= 0.95))
                rows.append(Row(case, "final eval", mixed["final_eval"] or 0.0, ""))
                cores = " ".join(f"{r['device']}[{r.get('cores') or 'shared'}]" for r in mixed.get("per_rank", []))
                print(f"  {case}: ranks {cores}")
    if not args.smoke and os.environ.get("FLODL_CPU_PINNING", "on") != "off":
        # the same three-CPU-rank run unpinned (the CUDA rank shares every core): what pinning is for
        os.environ["FLODL_CPU_PINNING"] = "off"
        loose = run("cuda:0,cpu,cpu,cpu", 2 * epochs, width, samples, 0, [])
        os.environ.pop("FLODL_CPU_PINNING")
        rows.append(
            Row("seed 0 cuda:0+3cpu default, unpinned", "cuda:0 rate vs alone", gpu_rate(loose) / base_rate if base_rate else 0.0, "x")
        )
    report(
        "mixed_target",
        rows,
        note=f"bench/tasks/mlp.py task_with_eval, width {width}, {samples} samples; target: cuda:0 alone after {epochs} epochs; "
        "mixed runs capped at twice that; cpu-cadence",
        results=smoke_results() if args.smoke else None,
    )


def _goal(cpus: int) -> str:
    return ">= 1.2x sooner with one CPU rank" if cpus == 1 else "never slower with three CPU ranks"


if __name__ == "__main__":
    main()
