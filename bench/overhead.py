"""Runtime overhead: one rank under flodl vs the same training in a plain PyTorch loop.

    python bench/overhead.py [--quick]

Same model, data, batch size, optimizer, shuffle and thread count; the plain
loop indexes the same in-memory tensors. flodl's throughput is its own
training wall time (first batch to last, as the run summary reports it), so
process start-up is not counted against either side. Cases are sized so one
step takes about 5 ms and about 20 ms on the machine at hand.

Goal (issue 2): ≥ 97% of plain throughput for a step of 5 ms or more.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import Row, quick_flag, report  # noqa: E402
from bench.tasks import mlp  # noqa: E402
from flodl import Trainer  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mlp.py'}:task"


def plain_loop(epochs: int) -> tuple[float, float]:
    """Samples/s and mean step ms of the plain loop."""
    task = mlp.task()
    ds = task.dataset
    x_all, y_all = ds.tensors
    model = task.model()
    opt = task.optimizer(model)
    n, bs = len(ds), task.batch_size
    steps = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(42 + epoch))
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            loss = task.loss_fn(model(x_all[idx]), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            float(loss.detach())
            steps += 1
    wall = time.perf_counter() - start
    return n * epochs / wall, wall / steps * 1000


def flodl_run(epochs: int) -> float:
    summary = Trainer.builder(TASK).nproc_per_node(1).epochs(epochs).progress(False).run()
    return summary["samples_per_s"]


def step_width(target_ms: float) -> int:
    """The hidden width whose plain step takes about ``target_ms``."""
    os.environ["FLODL_BENCH_SAMPLES"] = "2048"
    best = None
    for w in (256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072):
        os.environ["FLODL_BENCH_WIDTH"] = str(w)
        _, ms = plain_loop(1)
        best = w
        if ms >= target_ms:
            break
    return best


def main() -> None:
    quick = quick_flag(__doc__, "one repetition, fewer samples")
    # one intra-op thread on both sides: on a small shared machine a second
    # thread makes every step hostage to whatever else runs, drowning the signal
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    reps = 2 if quick else 5
    rows: list[Row] = []
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, line_buffering=True)
    for label, target in (("~5 ms step", 5.0), ("~20 ms step", 20.0)):
        width = step_width(target)
        os.environ["FLODL_BENCH_WIDTH"] = str(width)
        os.environ["FLODL_BENCH_SAMPLES"] = str(8192 if quick else 16384)
        epochs = 2
        plain, flo, step_ms = [], [], []
        for _ in range(reps):  # alternate, so drift in the machine hits both sides
            rate, ms = plain_loop(epochs)
            plain.append(rate)
            step_ms.append(ms)
            flo.append(flodl_run(epochs))
        p, f = statistics.median(plain), statistics.median(flo)
        ratio = f / p
        case = f"{label} (width {width}, {statistics.median(step_ms):.1f} ms)"
        rows.append(Row(case, "plain samples/s", p, "samples/s"))
        rows.append(Row(case, "flodl samples/s", f, "samples/s"))
        rows.append(Row(case, "flodl / plain", ratio * 100, "%", "≥ 97%", ratio >= 0.97))
    report("overhead", rows, note=f"median of {reps} alternating repetitions; 1 CPU rank, 1 intra-op thread on both sides (OMP_NUM_THREADS=1)")


if __name__ == "__main__":
    main()
