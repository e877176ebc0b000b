"""A CUDA rank plus CPU ranks on the CPU averaging backend vs the CUDA rank alone.

    python bench/mixed.py [--quick | --smoke]

The same task (``bench/tasks/mlp.py``: an MLP on synthetic data, width set so
a CPU rank is far slower than the GPU) trains for the same number of epochs
(a) on ``cuda:0`` alone and (b) on ``cuda:0`` with CPU ranks beside it
(``cpu-cadence`` and ``cpu-async``): ElChe gives every rank the share its speed
earns, and the CPU ranks average through the same-host lane. Reported: training
throughput (samples/s of the run's training wall time), final loss, and the
share of samples the CPU ranks trained. Needs a CUDA device; without one it
says so and writes nothing (with ``--smoke`` it also exits 1: a smoke that
cannot run must fail).

``--smoke``: ``cuda:0`` alone and ``cuda:0,cpu`` in ``cpu-cadence``, 1 epoch of
2,048 samples at width 256, results in a temporary folder (does the bench still run?).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, cuda_or_stop, report, run_controller, size_parser, smoke_results  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mlp.py'}:task"


def run(devices: str, mode: str | None, epochs: int, width: int, samples: int) -> dict:
    args = ["--task", TASK, "--devices", devices, "--epochs", str(epochs), "--dashboard-port", "-1", *(["--mode", mode] if mode else [])]
    env = {
        **os.environ,
        "FLODL_BENCH_WIDTH": str(width),
        "FLODL_BENCH_SAMPLES": str(samples),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return run_controller(args, env=env, timeout_s=900)


def main() -> None:
    args = size_parser(__doc__, "fewer samples and epochs", "cuda:0 alone and beside one CPU rank, 1 epoch of 2,048 samples").parse_args()

    if not cuda_or_stop("bench/mixed.py", smoke=args.smoke):
        return
    epochs, samples, width = (1, 2048, 256) if args.smoke else (3, 32768, 1024) if args.quick else (6, 65536, 1024)
    groups = ("cuda:0,cpu",) if args.smoke else ("cuda:0,cpu,cpu", "cuda:0,cpu,cpu,cpu,cpu")
    modes = ("cpu-cadence",) if args.smoke else ("cpu-cadence", "cpu-async")
    rows: list[Row] = []
    alone = run("cuda:0", None, epochs, width, samples)
    base = alone["samples_per_s"]
    rows.append(Row("cuda:0 alone", "samples/s", base, "samples/s"))
    rows.append(Row("cuda:0 alone", "final loss", alone["final_loss"], ""))
    for devices in groups:
        for mode in modes:
            s = run(devices, mode, epochs, width, samples)
            case = f"{devices} {mode}"
            rate = s["samples_per_s"]
            cpu_share = sum(r["samples"] for r in s["per_rank"] if r["device"] == "cpu") / max(1, sum(r["samples"] for r in s["per_rank"]))
            rows.append(Row(case, "samples/s", rate, "samples/s"))
            rows.append(Row(case, "vs cuda:0 alone", rate / base, "x"))
            rows.append(Row(case, "CPU ranks' share", cpu_share * 100, "%"))
            rows.append(Row(case, "final loss", s["final_loss"], ""))
            rows.append(Row(case, "averaging round p50", s["averaging"]["round_ms_p50"] or 0.0, "ms"))
    report(
        "mixed_gpu",
        rows,
        note=f"bench/tasks/mlp.py width {width}, {samples} samples, {epochs} epochs; training wall time",
        results=smoke_results() if args.smoke else None,
    )


if __name__ == "__main__":
    main()
