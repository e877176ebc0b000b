"""flodl's own cost per training step, measured alone: the rank's batch loop around a step that does nothing.

``python bench/step_cost.py [--quick | --smoke] [--device cuda] [--batches N] [--reps R]``

A whole-run comparison (``bench/overhead.py``) sees flodl's per-step work
only as a few percent of a step whose time moves by as much from one process
to the next on a shared machine. Here the user's step is taken out on both
sides, so what is left is exactly what each side adds around it:

* **flodl**: the real rank's batch loop (``Windows.run_rounds``: the grants
  cut into batches, the in-memory gather, the quota, stop, eval and regroup
  checks, the step meter, LR application, progress for liveness, the ~50 ms
  reports and the window's one average), in this process, with its link
  unstarted (frames it sends are signed and queued, never sent) and one rank
  (the average is the identity);
* **plain**: a hand-written loop over the same data (a slice of the epoch's
  shuffle, one gather per tensor, the loss read every 100 steps).

Both "train" an identity model whose loss is a constant tensor on the device
(no backward, no optimizer step): flodl's own lines in a step (the batch
handed to the model, the hook before the optimizer step) are kept. The result is
the per-step difference, microseconds, best of ``--reps`` alternating
repetitions (the least disturbed run of each side: this measures code, not the
machine). Issue 17's goal for it: under 20 µs. On a GPU the meter's events
are recorded and resolved as in training (one group per ~50 ms or 64 steps).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402

GOAL_US = 20.0
BATCH = 64


def _dataset(n: int, device: str) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x.to(device), x[:, 0].gt(0).long().to(device))


def _mlp(width: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The real step's model and optimizer (``--width``): the same initial weights on both sides."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2)
    ).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def plain_us(n: int, device: str, width: int = 0) -> float:
    """Microseconds a step of the hand-written loop around a no-op step (``width``: a real MLP step)."""
    ds = _dataset(n, device)
    x_all, y_all = ds.tensors
    zero = torch.zeros((), device=device)
    model, loss_fn = torch.nn.Identity(), lambda out, y: zero
    opt = None
    if width:
        model, opt = _mlp(width, device)
        loss_fn = torch.nn.functional.cross_entropy
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).to(device)
    steps = 0
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        idx = perm[i : i + BATCH]
        x, y = x_all[idx], y_all[idx]
        loss = loss_fn(model(x), y)  # the user's step: nothing past the call
        if opt is not None:  # a real step
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        steps += 1
        if steps % 100 == 0:
            loss.item()
    loss.item()
    return (time.perf_counter() - start) / steps * 1e6


def flodl_us(n: int, device: str, width: int = 0) -> float:
    """Microseconds a step of the rank's batch loop around a no-op step (one window of ``n`` samples;
    ``width``: around the real MLP step, the rank's own ``Replica.train_batch``)."""
    from flodl.config.env import RankEnv
    from flodl.rank.runner import RankRunner
    from flodl.task import Task
    from flodl.testing.solo import solo_welcome

    env = RankEnv(
        controller="tcp://127.0.0.1:1",
        secret=b"k" * 32,
        run_id="step-cost",
        rank=0,
        device=device,
        task="bench.step_cost:task",
        local_world=1,
        heartbeat_timeout_s=5.0,
        parent_pid=0,
    )
    runner = RankRunner(env)
    try:
        ds = _dataset(n, device)
        zero = torch.zeros((), device=device)
        runner.task = Task(
            model=torch.nn.Identity,
            optimizer=lambda model: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
            dataset=ds,
            batch_size=BATCH,
            loss_fn=lambda out, y: zero,
        )
        if width:
            model, optimizer = _mlp(width, device)
            runner.task = dataclasses.replace(runner.task, optimizer=lambda _: optimizer, loss_fn=torch.nn.functional.cross_entropy)
            runner.model = model
        else:
            runner.model = runner.task.model().to(device)
        runner.join(solo_welcome())  # one rank: the average is the identity
        joined = runner.joined
        assert joined is not None
        replica, windows = joined.replica, joined.windows
        if device == "cuda":
            joined.data.source.place_on(runner.device)  # type: ignore[union-attr]  # as the VRAM pool does after the first step
        # flodl's part of a step kept (the batch to the model, the hook between backward and the
        # optimizer step); the user's model, loss, backward and optimizer step: nothing
        if not width:
            replica.train_batch = lambda batch: (replica.forward(batch), replica.grads_ready())[0]  # type: ignore[method-assign]
        windows.run_rounds([[0, 0, 2 * BATCH]], rounds=1, sync_every=0)  # warm-up: the first step is timed alone
        start = time.perf_counter()
        stats = windows.run_rounds([[1, 0, n]], rounds=1, sync_every=0)
        wall = time.perf_counter() - start
        assert stats.batches == -(-n // BATCH), stats.batches
        return wall / stats.batches * 1e6
    finally:
        runner.link._pipe_out.close(linger=0)
        runner.link._pipe_in.close(linger=0)


def task() -> None:  # the RankEnv names a task; this bench builds its own
    raise RuntimeError("bench.step_cost builds its task in process")


def main(argv: list[str] | None = None) -> Path:
    parser = size_parser(__doc__, "fewer batches and repetitions (under a minute)", "200 batches, 2 repetitions")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batches", type=int, default=None, help="batches a repetition (default 20000, --quick 5000)")
    parser.add_argument("--reps", type=int, default=None, help="alternating repetitions of each side (default 7, --quick 5)")
    parser.add_argument(
        "--width",
        type=int,
        default=0,
        help="a real step instead of the no-op: an MLP 32-W-W-2 trained by SGD on both sides (flodl's own Replica.train_batch); "
        "the result is then also flodl / plain throughput in one process",
    )
    parser.add_argument("--name", default=None, help="results file name (default step_cost, step_cost_gpu on cuda)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    n = BATCH * (args.batches or (200 if args.smoke else 5000 if args.quick else 20000))
    reps = args.reps or (2 if args.smoke else 5 if args.quick else 7)
    plain, flodl = [], []
    for rep in range(reps):
        plain.append(plain_us(n, args.device, args.width))
        flodl.append(flodl_us(n, args.device, args.width))
        print(f"rep {rep + 1}/{reps}: plain {plain[-1]:.1f} µs/step, flodl {flodl[-1]:.1f} µs/step", flush=True)
    cost = min(flodl) - min(plain)
    step = f"MLP width {args.width} step" if args.width else "no-op step"
    case = f"{step}, {args.device}, batch {BATCH}, {n // BATCH} batches"
    rows = [
        Row(case, "plain loop, per step (best)", min(plain), "µs"),
        Row(case, "flodl's rank loop, per step (best)", min(flodl), "µs"),
        Row(case, "flodl's own cost per step", cost, "µs", goal=f"< {GOAL_US:g} µs", met=cost < GOAL_US),
        Row(case, "flodl's own cost per step (medians)", sorted(flodl)[reps // 2] - sorted(plain)[reps // 2], "µs"),
    ]
    if args.width:  # a real step: what that cost is of it
        ratio = 100.0 * sorted(plain)[reps // 2] / sorted(flodl)[reps // 2]
        rows.append(Row(case, "flodl / plain throughput (medians)", ratio, "%", goal=">= 97%", met=ratio >= 97.0))
    note = (
        f"best of {reps} alternating repetitions in one process; "
        + (
            f"a real step on both sides (MLP 32-{args.width}-{args.width}-2, SGD); "
            if args.width
            else "the user's step returns a constant loss on both sides; "
        )
        + "flodl: Windows.run_rounds, one window, one rank, link not started"
    )
    name = args.name or ("step_cost_gpu" if args.device == "cuda" else "step_cost") + (f"_w{args.width}" if args.width else "")
    return report(name, rows, note=note, results=smoke_results() if args.smoke else None)


if __name__ == "__main__":
    main()
