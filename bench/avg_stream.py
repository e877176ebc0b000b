"""What a background average costs the step stream (issue 17, item 5).

    python bench/avg_stream.py [--quick | --smoke] [--device cuda]

A window's end average in Cadence and Async runs in the background: the rank
copies its values into a send buffer, the all-reduce runs on the collective's
own stream (NCCL's; gloo's threads on a CPU) while the rank trains on, and the
result lands between two steps as ``local ← (local − snapshot) + average``
(flodl/rank/collective.py). The copy and the landing run on the step stream;
this bench measures what they cost it, with flodl's own ``CollectiveAverager``
on the matrix's ResNet-20 and GPT-nano, in one process: a training loop with
no average against the same loop launching one every ``WINDOW`` steps and
landing it at the first step after it completed. The cost per average is the
difference in wall time over the number of averages; it is also given as a
share of a window of ``WINDOW`` steps. A blocking average (Sync's) is
measured the same way, for reference.

The group here has one member (one GPU is lent: NCCL refuses two ranks on one
GPU), so the all-reduce moves nothing across devices: what is measured is the
step stream's share of an average, not the link's. On several GPUs NCCL's
kernels also take SMs while they run; that part needs ``nvidia-h200-x2``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402
from bench.matrix import tasks  # noqa: E402
from flodl.rank.collective import CollectiveAverager, build_group  # noqa: E402
from flodl.rank.flat import FlatModel  # noqa: E402

#: Steps per window: an average is launched after each.
WINDOW = 50


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(name: str, device: torch.device, steps: int, group: dist.ProcessGroup | None, *, block: bool = False) -> float:
    """Wall seconds of ``steps`` training steps of model ``name``, averaging in ``group`` every ``WINDOW`` steps when given one."""
    task = tasks.task(name)
    x_all, y_all = (t.to(device) for t in task.dataset.tensors)
    model = task.model().to(device)
    # flattened before the optimizer exists, as the rank does: it must hold the views
    averager = CollectiveAverager(FlatModel(model), group) if group is not None else None
    opt = task.optimizer(model)
    gen = torch.Generator().manual_seed(0)
    bs, n = task.batch_size, len(x_all)
    for warm in (True, False):
        sync(device)
        start = time.perf_counter()
        for step in range(WINDOW if warm else steps):
            if averager is not None:
                averager.poll()  # a finished background average lands here, between steps
            idx = torch.randint(0, n, (bs,), generator=gen).to(device, non_blocking=True)
            loss = task.loss_fn(model(x_all[idx]), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if averager is not None and (step + 1) % WINDOW == 0:
                averager.average(float(WINDOW), block=block)
        if averager is not None:
            averager.settle()
        float(loss.detach())  # the device is done
    return time.perf_counter() - start


def one_member_group(device: torch.device) -> tuple[dist.ProcessGroup, dist.TCPStore]:
    """A process group of this process alone, through a store of its own (kept alive by the caller)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return build_group(
        store_host="127.0.0.1", store_port=store.port, prefix="avg_stream/", rank=0, world_size=1, device=device, timeout_s=60.0
    ), store


def main(argv: list[str] | None = None) -> Path:
    parser = size_parser(__doc__, "300 steps, 3 repetitions per model", "a few steps of one model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("FLODL_MATRIX_SAMPLES", "4096")
    models, steps, reps = (("resnet20", "gpt_nano"), 1000, 5)
    if args.quick:
        steps, reps = 300, 3
    if args.smoke:
        models, steps, reps = ("logreg",), 2 * WINDOW, 1  # the smallest model: does the path run?
    group, store = one_member_group(device)
    rows: list[Row] = []
    for name in models:
        plain, background, blocking = [], [], []
        for _ in range(reps):  # alternating, so drift hits every variant
            plain.append(train(name, device, steps, None))
            background.append(train(name, device, steps, group))
            blocking.append(train(name, device, steps, group, block=True))
        averages = steps // WINDOW
        base = statistics.median(plain)
        step_ms = base / steps * 1000.0
        for label, walls in (("background (Cadence, Async)", background), ("blocking (Sync)", blocking)):
            cost_ms = (statistics.median(walls) - base) / averages * 1000.0
            case = f"{name}, {step_ms:.2f} ms step, average every {WINDOW}"
            rows.append(Row(case, f"{label}: step-stream cost per average", cost_ms * 1000.0, "µs"))
            rows.append(Row(case, f"{label}: share of a window", cost_ms / (WINDOW * step_ms) * 100.0, "%"))
        print(f"{name}: plain {base:.3f} s, background {statistics.median(background):.3f} s, blocking {statistics.median(blocking):.3f} s")
    del store
    note = (
        f"{steps} steps per run, median of {reps} alternating runs; flodl's CollectiveAverager in a one-member "
        f"{'NCCL' if device.type == 'cuda' else 'gloo'} group on {device}: the copy and landing on the step stream, "
        "not the all-reduce across devices"
    )
    return report(
        "avg_stream_gpu" if device.type == "cuda" else "avg_stream", rows, note=note, results=smoke_results() if args.smoke else None
    )


if __name__ == "__main__":
    main()
