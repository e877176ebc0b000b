"""A matrix model under torchrun: DistributedDataParallel, or PyTorch's post-local SGD.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/matrix/ddp.py \\
        --model lenet --algo ddp --epochs 3 --samples 8192 --slowdown 1:4 --base-ms 1:6.1 --out run.json

The model, initial weights, data, batch size per rank, optimizer, loss and eval
are ``bench.matrix.tasks``' (exactly what the flodl task trains). gloo backend,
one intra-op thread per rank; ``--device cuda``: NCCL, one GPU per rank
(``LOCAL_RANK``), the training set copied to the GPU once (as flodl's VRAM pool
holds it). Each epoch every rank trains its half of a seeded
permutation of the training set (``perm[rank::world]``, like DistributedSampler).

``--algo ddp``        plain DDP: gradients all-reduced every step.
``--algo postlocal``  post-local SGD as PyTorch ships it: DDP with the
                      ``post_localSGD_hook`` (gradients all-reduced for the first
                      ``--warmup`` steps, then not at all:
                      ``post_local_gradient_allreduce=False``, since on one host the
                      default intra-node subgroup would be the whole world, i.e. DDP),
                      and a ``PeriodicModelAverager`` averaging the parameters every
                      ``--period`` steps after the optimizer step (which is what
                      ``PostLocalSGDOptimizer.step`` does; called directly so its time
                      is measured apart from compute).

``--lr-scaling linear|none`` (default ``linear``): the baseline at its best
reasonable setting. DDP averages the gradients of world x batch samples, so at
the task's LR it takes 1/world of Local SGD's optimizer steps per sample; the
linear scaling rule (Goyal et al. 2017) multiplies the LR by the world size.
``--algo ddp`` trains at LR x world throughout (none of the matrix's models has
an LR schedule, so there is no schedule warm-up to keep); ``--algo postlocal``
uses LR x world in its DDP warm-up phase and the task's per-rank LR in its
local phase (per-rank batches, like flodl). ``none``: the task's LR everywhere.

``--seed S`` (default ``FLODL_MATRIX_SEED``, else 0): the initial weights'
seed; epoch e's permutation is seeded S + e.

``--slowdown R:F`` makes rank R F times slower exactly as flodl's
``FLODL_SIMULATE_SLOWDOWN`` does (``flodl.config.env.paced_step``, the same function;
flodl/rank/runner.py ``_step``), from the second step on (the first is set-up
and warm-up). ``--base-ms`` (``ms`` or ``R:ms``, the syntax of
``FLODL_SIMULATE_BASE_MS``; the suite passes the solo case's step time) paces
it: the rank sleeps ``max(0, F x base - compute)`` after the step, so its step
period is F x base. ``--pace-file PATH`` (``FLODL_SIMULATE_PACE_FILE``'s board,
``flodl.testing.pace_board``, the suite passes a fresh one per run) makes the
base live: the ranks at full speed post their step time there and the slowed
rank paces against it (within 1.5x of ``--base-ms``: flodl.config.env.live_base_ms);
``--base-ms`` stands until the first post. The suite passes it only with
``--live-pace``: DDP's fast step holds DDP's own overhead and, with BatchNorm,
a wait for the slow rank (the buffer broadcast), so a live base would make
torchrun's slow device slower than flodl's. Without ``--base-ms`` it sleeps (F - 1) x its compute,
which overshoots (compute right after a sleep is slower). The step time a rank
reports is its compute plus the time it really slept. flodl times forward +
backward + optimizer step, with no communication inside; here the backward also
waits for DDP's gradient all-reduce, so the compute time is the step's wall
time minus that wait (from the moment DDP's comm hook is handed the last
gradient bucket to the end of ``backward()``), and the averaging of post-local
SGD is outside it too (the sleep comes before it, as a slow device's compute
would). On CUDA those host timestamps say nothing (kernels run after they are
launched): CUDA events in the compute stream (start, last gradient ready,
backward done, optimizer step done; read after the loss read, so nothing extra
blocks) give the compute and the all-reduce wait.

The clock runs from a barrier after set-up to the end of the final eval, like
flodl's ``wall_s`` (from dispatch start to the final eval); ``eval_s`` is the
time spent in evals (rank 0 scores after each epoch while the others wait).
Rank 0 writes a summary shaped like flodl's (``mode``, ``wall_s``, ``eval_s``,
``train_samples_per_s``, ``final_loss``, ``final_eval``, ``syncs``,
``per_rank`` with each rank's ``step_ms``, ``history``) plus ``curve``:
[seconds, mean loss] points, ``measured_ratio`` (the slowed rank's mean step
time over the fastest other rank's; None with no slowdown) and ``config``
(``lr_scaling``, ``lr``, ``lr_ddp``: the LR of the all-reduce steps). Each
history row also holds ``closed_s`` (seconds from the start to the end of the
epoch's training, the evals before it included) and ``eval_s`` (its eval's);
``start_unix`` is the start in Unix time (the suite's launch to it: start-up).

``--target-eval E --target-loss L`` (the time-to-target bench,
``bench/matrix/target.py``): stop after the first epoch whose eval and mean
training loss meet them (``bench.matrix.reach.Goal``: eval within 0.005, loss
within 1.05 x); the summary then says ``stopped_at_target`` and its
``epochs_completed``.
"""

# no ``from __future__ import annotations``: DDP checks at run time that a comm
# hook's bucket annotation is the class dist.GradBucket, not a string
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.matrix import tasks
from bench.matrix.reach import Goal
from flodl.config.env import live_base_ms, paced_step, pacing_late_ms, parse_base_ms, parse_slowdown
from flodl.testing.pace_board import PaceBoard

CURVE_POINTS_PER_EPOCH = 8


class Timing:
    """The state of ``timed_hook``: the wrapped hook, its state, and when it last got the last bucket
    (a host timestamp on CPU; on CUDA an event in the compute stream, after the last gradient's kernels)."""

    def __init__(self, hook, state, cuda: bool = False) -> None:
        self.hook, self.state, self.last_ready = hook, state, 0.0
        self.ready_event = torch.cuda.Event(enable_timing=True) if cuda else None


def timed_hook(timing: Timing, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook wrapping another, noting when the step's last gradient bucket is handed over."""
    if bucket.is_last():
        timing.last_ready = time.perf_counter()
        if timing.ready_event is not None:
            timing.ready_event.record()
    return timing.hook(timing.state, bucket)


class CudaStepTimer:
    """A step's GPU compute from events, never blocking: start, the last gradient ready
    (``Timing.ready_event``), backward done (the stream has waited for the all-reduce
    by then), optimizer step done; compute = the two spans that are not the wait."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.start, self.backward, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(3))

    def compute_and_wait_s(self) -> tuple[float, float]:
        """Call once the step's results were read (the loss value: the events are done)."""
        ready = self.timing.ready_event
        wait = ready.elapsed_time(self.backward) / 1000.0
        return (self.start.elapsed_time(ready) + self.backward.elapsed_time(self.end)) / 1000.0, max(0.0, wait)


def scale_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    for group in opt.param_groups:
        group["lr"] *= factor


def measured_ratio(ranks: list[dict]) -> float | None:
    """The slowed rank's mean step time over the fastest other rank's (None without a slowed rank)."""
    slowed = [r for r in ranks if r.get("slowdown", 1.0) > 1.0 and r.get("step_ms")]
    others = [r["step_ms"] for r in ranks if r.get("slowdown", 1.0) <= 1.0 and r.get("step_ms")]
    if not slowed or not others:
        return None
    return max(r["step_ms"] for r in slowed) / min(others)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(tasks.SPECS))
    ap.add_argument("--algo", choices=("ddp", "postlocal"), default="ddp")
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--slowdown", default="", help="R:F: rank R simulated F times slower (FLODL_SIMULATE_SLOWDOWN's syntax)")
    ap.add_argument(
        "--base-ms", default="", help="ms or R:ms: the step time a slowed rank is paced against (FLODL_SIMULATE_BASE_MS's syntax)"
    )
    ap.add_argument(
        "--pace-file", default="", help="the live base: full-speed ranks post their step time here, a slowed rank paces against it"
    )
    ap.add_argument(
        "--lr-scaling",
        choices=("linear", "none"),
        default="linear",
        help="linear: LR x world size for the all-reduced (DDP) steps; none: the task's LR",
    )
    ap.add_argument("--seed", type=int, default=None, help="initial weights and permutation seed (default FLODL_MATRIX_SEED, else 0)")
    ap.add_argument("--period", type=int, default=4, help="post-local SGD: steps between model averages")
    ap.add_argument(
        "--warmup", type=int, default=None, help="post-local SGD: DDP steps before local SGD (default: 10%% of an epoch's steps)"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--target-eval", type=float, default=None, help="stop after the first epoch that meets this eval and --target-loss")
    ap.add_argument("--target-loss", type=float, default=None, help="stop after the first epoch that meets this loss and --target-eval")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if (args.target_eval is None) != (args.target_loss is None):
        ap.error("--target-eval and --target-loss go together (the time-to-target bench passes both)")

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    spec = tasks.SPECS[args.model]
    goal = None if args.target_eval is None else Goal(spec.metric, args.target_eval, args.target_loss)
    seed = tasks.run_seed() if args.seed is None else args.seed
    slow = parse_slowdown(args.slowdown, rank, "--slowdown")
    base_ms = parse_base_ms(args.base_ms, rank, "--base-ms")
    late_ms = 0.0  # how far behind its paced schedule this rank is (pacing_late_ms)
    board = PaceBoard(args.pace_file) if args.pace_file else None
    x, y = tasks.train_data(spec, args.samples)
    x, y = x.to(device), y.to(device)
    n = len(x) - len(x) % world  # equal shares: DDP needs the same step count on every rank
    model = tasks.make_model(spec, seed).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = spec.optimizer(model)
    lr = opt.param_groups[0]["lr"]
    lr_factor = float(world) if args.lr_scaling == "linear" else 1.0
    loss_fn = tasks.loss_fn(spec)
    steps_per_epoch = -(-(n // world) // spec.batch)
    averager = None
    scaled_steps = None  # how many steps train at lr x lr_factor (None: all of them)
    if args.algo == "ddp":
        timed = Timing(default_hooks.allreduce_hook, None, cuda)
    else:
        warmup = args.warmup if args.warmup is not None else max(1, steps_per_epoch // 10)
        timed = Timing(
            post_localSGD_hook,
            PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False),
            cuda,
        )
        averager = PeriodicModelAverager(period=args.period, warmup_steps=warmup)
        scaled_steps = warmup  # the DDP warm-up; the local phase trains per-rank batches at the task's LR
    scale_lr(opt, lr_factor)
    ddp.register_comm_hook(timed, timed_hook)
    chunk = max(1, steps_per_epoch // CURVE_POINTS_PER_EPOCH)
    timer = CudaStepTimer(timed) if cuda else None

    dist.barrier()
    start = time.perf_counter()
    start_unix = time.time()  # the suite's launch to here: this run's start-up
    stopped = False
    eval_s, history, curve, evals = 0.0, [], [], []
    compute_total = sync_total = 0.0
    batches = samples = averages = 0
    first_compute = 0.0
    for epoch in range(args.epochs):
        e_start = time.perf_counter()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))[:n]
        mine = perm[rank::world].to(device)
        e_loss = e_count = 0.0
        e_compute = e_sync = 0.0
        c_loss, c_n = 0.0, 0
        for step in range(steps_per_epoch):
            if batches == scaled_steps and lr_factor != 1.0:
                scale_lr(opt, 1.0 / lr_factor)  # post-local SGD: its local phase at the per-rank LR
            idx = mine[step * spec.batch : (step + 1) * spec.batch]
            xb, yb = x[idx], y[idx]
            t0 = time.perf_counter()
            if timer:
                timer.start.record()
            loss = loss_fn(ddp(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t_bwd = time.perf_counter()
            wait = t_bwd - timed.last_ready if t0 < timed.last_ready < t_bwd else 0.0
            if timer:
                timer.backward.record()
            opt.step()
            if timer:
                timer.end.record()
            value = float(loss.detach())
            if timer:  # host timestamps are only launch times on CUDA: the events tell
                compute, wait = timer.compute_and_wait_s()
            else:
                compute = time.perf_counter() - t0 - wait
            sync = wait
            if slow > 1.0 and batches > 0:  # the simulated slower device: flodl's rule (not the first step)
                live_ms = live_base_ms(board.base_ms() if board else None, base_ms)
                pause_ms, _ = paced_step(compute * 1000.0, slow, live_ms, late_ms)
                if pause_ms > 0.0:
                    t_sleep = time.perf_counter()
                    time.sleep(pause_ms / 1000.0)
                    compute += time.perf_counter() - t_sleep
                late_ms = pacing_late_ms(late_ms, compute * 1000.0, slow, live_ms)
            elif board is not None and batches > 0:  # a full-speed rank posts the pace the slowed one follows
                board.publish(compute * 1000.0)
            if averager is not None:
                t_avg = time.perf_counter()
                before = averager.step
                averager.average_parameters(model.parameters())
                if cuda:
                    torch.cuda.synchronize(device)  # so its time is counted here, not in the next step's compute
                if before >= averager.warmup_steps and (before - averager.warmup_steps) % averager.period == 0:
                    averages += 1
                sync += time.perf_counter() - t_avg
            if batches == 0:
                first_compute = compute
            elif batches == 1 and step == 1:
                # the process's first step carries lazy set-up and warm-up, no device's pace: timed as the
                # second one, as flodl does (stats.retime in flodl/rank/runner.py)
                e_compute += compute - first_compute
            e_compute += compute
            e_sync += sync
            e_loss += value * len(idx)
            e_count += len(idx)
            c_loss += value
            c_n += 1
            batches += 1
            samples += len(idx)
            if c_n == chunk or step == steps_per_epoch - 1:
                curve.append((time.perf_counter() - start, c_loss / c_n))
                c_loss, c_n = 0.0, 0
        compute_total += e_compute
        sync_total += e_sync
        t_train_end = time.perf_counter()
        totals = torch.tensor([e_loss, e_count], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        value = None
        t_eval = time.perf_counter()
        if rank == 0:
            value = tasks.evaluate(spec, model, device)
        # rank 0 says whether this epoch met the goal (a barrier too: the others wait for its eval)
        verdict = [goal is not None and rank == 0 and goal.met(value, totals[0].item() / totals[1].item())]
        dist.broadcast_object_list(verdict, src=0)
        stopped = bool(verdict[0])
        this_eval_s = time.perf_counter() - t_eval
        eval_s += this_eval_s
        per = [None] * world
        dist.all_gather_object(
            per,
            {"compute_ms": e_compute * 1000, "sync_ms": e_sync * 1000, "data_ms": 0.0, "batches": steps_per_epoch, "samples": len(mine)},
        )
        history.append(
            {
                "epoch": epoch,
                "loss": totals[0].item() / totals[1].item(),
                "eval": value,
                "samples": int(totals[1].item()),
                "wall_s": t_train_end - e_start,
                "closed_s": t_train_end - start,  # since the start, the evals before it included
                "eval_s": this_eval_s,
                "per_rank": {str(r): p for r, p in enumerate(per)},
            }
        )
        evals.append(value)
        if stopped:
            break
    wall = time.perf_counter() - start
    curves = [None] * world
    dist.all_gather_object(curves, curve)
    ranks = [None] * world
    dist.all_gather_object(
        ranks,
        {
            "rank": rank,
            "samples": samples,
            "batches": batches,
            "compute_ms": compute_total * 1000,
            "step_ms": compute_total * 1000 / max(1, batches),
            "sync_ms": sync_total * 1000,
            "slowdown": slow,
            "base_ms": base_ms,
        },
    )
    if rank == 0:
        # merge the ranks' curves point by point (same step counts on every rank): mean time, mean loss
        merged = [(sum(c[i][0] for c in curves) / world, sum(c[i][1] for c in curves) / world) for i in range(min(map(len, curves)))]
        total = sum(h["samples"] for h in history)
        syncs = batches if args.algo == "ddp" else min(batches, averager.warmup_steps) + averages
        summary = {
            "mode": "TorchrunDDP" if args.algo == "ddp" else "TorchrunPostLocalSGD",
            "world_size": world,
            "epochs": args.epochs,
            "epochs_completed": len(history),
            "start_unix": start_unix,
            "stopped_at_target": stopped,
            "wall_s": wall,
            "samples_per_s": total / wall,
            "eval_s": eval_s,
            "train_samples_per_s": total / max(1e-9, wall - eval_s),
            "samples": total,
            "per_rank": ranks,
            "syncs": syncs,
            "final_loss": history[-1]["loss"],
            "final_eval": evals[-1],
            "eval_metric_name": spec.metric,
            "history": history,
            "curve": merged,
            "measured_ratio": measured_ratio(ranks),
            "config": {
                "algo": args.algo,
                "period": args.period if averager else None,
                "warmup": averager.warmup_steps if averager else None,
                "slowdown": args.slowdown,
                "base_ms": args.base_ms,
                "seed": seed,
                "lr_scaling": args.lr_scaling,
                "lr": lr,
                "lr_ddp": lr * lr_factor,
                "samples": n,
                "batch_size": spec.batch,
            },
        }
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    dist.barrier()
    # Leave without tearing the process group down: with torch 2.13 and gloo, about one run in
    # eight aborted in that teardown ("terminate called without an active exception", SIGABRT)
    # after all the work was done, and torchrun then reports the whole run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
