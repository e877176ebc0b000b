"""What a background average costs the step stream (issue 17, item 5).

    python bench/avg_stream.py [--quick | --smoke] [--device cuda]

A window's end average in Cadence and Async runs in the background: the rank
copies its values into a send buffer, the all-reduce runs on the collective's
own stream (NCCL's; gloo's threads on a CPU) while the rank trains on, and the
result lands between two steps as ``local ← (local − snapshot) + average``
(flodl/rank/collective.py). The copy and the landing run on the step stream;
this bench measures what they cost it, with flodl's own ``CollectiveAverager``
on the matrix's ResNet-20 and GPT-nano: the step stream's time from before a
launch to after its landing (CUDA events on the stream: the copy into the send
buffer, the wait for the collective's event, the landing arithmetic), and the
host's time in the two calls; against a training step's time, and as a share
of a window of ``WINDOW`` steps. A blocking average (Sync's) is measured the
same way, for reference. On a CPU (gloo, the smoke) the times are the host's.

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
from collections.abc import Callable
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


class StreamClock:
    """Times a block on the device's current stream (CUDA events) and on the host."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self, block: Callable[[], object], reps: int) -> tuple[float, float]:
        """(median stream ms, median host ms) of ``block`` over ``reps`` runs, each alone on the stream."""
        stream_ms, host_ms = [], []
        for _ in range(reps):
            sync(self.device)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            block()
            host = (time.perf_counter() - t0) * 1000.0
            if self.cuda:
                end.record()
                end.synchronize()
                stream_ms.append(start.elapsed_time(end))
            else:
                stream_ms.append(host)
            host_ms.append(host)
        return statistics.median(stream_ms), statistics.median(host_ms)


def measure(name: str, device: torch.device, group: dist.ProcessGroup, reps: int) -> dict[str, tuple[float, float]]:
    """Stream and host ms of a training step, of a background average (launch + landing) and of a blocking one."""
    task = tasks.task(name)
    x_all, y_all = (t.to(device) for t in task.dataset.tensors)
    model = task.model().to(device)
    averager = CollectiveAverager(FlatModel(model), group)  # flattened before the optimizer, as the rank does
    opt = task.optimizer(model)
    idx = torch.arange(task.batch_size, device=device)

    def step() -> None:
        loss = task.loss_fn(model(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def background() -> None:
        averager.average(float(WINDOW), block=False)
        averager.settle()  # its landing (the collective is long done: one member)

    clock = StreamClock(device)
    for _ in range(5):  # warm-up: kernels, allocator, the averager's buffers
        step()
        background()
    return {
        "step": clock(step, reps),
        "background (Cadence, Async)": clock(background, reps),
        "blocking (Sync)": clock(lambda: averager.average(float(WINDOW), block=True), reps),
    }


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
    models, reps = ("resnet20", "gpt_nano"), 50
    if args.quick:
        reps = 20
    if args.smoke:
        models, reps = ("logreg",), 3  # the smallest model: does the path run?
    group, store = one_member_group(device)
    rows: list[Row] = []
    for name in models:
        times = measure(name, device, group, reps)
        step_ms = times["step"][0]
        case = f"{name}, {step_ms:.2f} ms step, average every {WINDOW}"
        for label in ("background (Cadence, Async)", "blocking (Sync)"):
            stream_ms, host_ms = times[label]
            rows.append(Row(case, f"{label}: step-stream time per average", stream_ms * 1000.0, "µs"))
            rows.append(Row(case, f"{label}: host time per average", host_ms * 1000.0, "µs"))
            rows.append(Row(case, f"{label}: share of a window", stream_ms / (WINDOW * step_ms) * 100.0, "%"))
        print(
            f"{name}: step {step_ms:.3f} ms; "
            + "; ".join(f"{k} {v[0] * 1000:.0f} µs stream, {v[1] * 1000:.0f} µs host" for k, v in times.items() if k != "step")
        )
    del store
    note = (
        f"median of {reps} timings each; flodl's CollectiveAverager in a one-member "
        f"{'NCCL' if device.type == 'cuda' else 'gloo'} group on {device}: the copy and landing on the step stream, "
        "not the all-reduce across devices"
    )
    return report(
        "avg_stream_gpu" if device.type == "cuda" else "avg_stream", rows, note=note, results=smoke_results() if args.smoke else None
    )


if __name__ == "__main__":
    main()
