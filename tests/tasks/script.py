"""A tiny training script for script-mode process tests (tests/test_script_mode.py), steered by
environment variables:

FLODL_TEST_STEP_SLEEP   seconds to sleep in every step (make a run long enough to hurt)
FLODL_TEST_HOLD_FILE    while this file does not exist, steps sleep FLODL_TEST_HOLD_SLEEP instead
FLODL_TEST_FAIL_AT      raise RuntimeError at this local step (a broken loop)
FLODL_TEST_OUT          a directory: each rank writes rank<R>.json there at the end (torchrun's
                        variables, the epochs and batches it trained, its final weights' sum, and
                        "driver_turns": how often the rank's thread took a turn from the loop)
FLODL_TEST_NO_INIT      never call flodl.init()
FLODL_TEST_HANG_AT      "rank:step": that rank's loop blocks for good at that step (a script stuck in its own code)
FLODL_TEST_MISUSE       "step": call run.step before any batch; "skip": a loop that never calls run.step (misuse,
                        refused with one clear error)
FLODL_TEST_NUM_WORKERS  run.prepare(..., num_workers=N) over loaded.py's logged dataset (reads and
                        trained indices logged to FLODL_TEST_LOG_DIR)
FLODL_TEST_EMPTY        prepare() an empty dataset (refused as the user's error, exit 2)
FLODL_TEST_ACCUM        "N0,N1,...[:declared|:explicit]": rank R steps its optimizer once every N<R> batches
                        (declared: it tells prepare(); explicit: each run.step says whether it stepped);
                        rank<R>.json then counts "accum_breaks", accumulations whose parameters changed
                        between their micro-batches
FLODL_TEST_STATE        register a LambdaLR (halves the LR at every epoch's end) and a counter of epoch ends
                        with run.register_state; rank<R>.json then holds their final "lr" and "counter"
FLODL_TEST_EARLY        "[rank:]missing" or "[rank:]argparse": fail before flodl.init() (on that rank only), as a
                        script whose data file is missing, or whose required argument is not given, does
FLODL_TEST_IDIOMS       a torchrun script's idioms: peek at each epoch's first batch (next(iter(...))) before the
                        loop, len(run.batches()), torch.distributed as libraries see it; rank<R>.json then holds
                        "idioms": what each showed
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # run as the script (its folder on sys.path), or imported by the tests (tests.tasks.script)
    from loaded import LoggedDataset, log_line
except ImportError:
    from tests.tasks.loaded import LoggedDataset, log_line

import flodl


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x.sum(1) > 0).long()


class Counter:
    """A script's own state: how many epochs' end-of-epoch code ran."""

    def __init__(self):
        self.ends = 0

    def state_dict(self):
        return {"ends": self.ends}

    def load_state_dict(self, state):
        self.ends = state["ends"]


def main():
    if os.environ.get("FLODL_TEST_NO_INIT"):
        return
    if os.environ.get("FLODL_TEST_EARLY"):
        _fail_before_init(os.environ["FLODL_TEST_EARLY"])
    turns = _count_driver_turns()
    run = flodl.init()
    torch.manual_seed(run.rank)  # the replicas start unlike: prepare() makes them rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(0 if os.environ.get("FLODL_TEST_EMPTY") else 512, 0)
    accums, _, declared = os.environ.get("FLODL_TEST_ACCUM", "1").partition(":")
    accum = [int(n) for n in accums.split(",")][run.rank % len(accums.split(","))]
    workers = os.environ.get("FLODL_TEST_NUM_WORKERS")
    dataset = LoggedDataset(512) if workers else torch.utils.data.TensorDataset(x, y)
    model, optimizer = run.prepare(
        model,
        optimizer,
        dataset,
        batch_size=16,
        num_workers=int(workers or 0),
        accumulate_grad_batches=accum if declared == "declared" else 1,
    )
    counter, scheduler = Counter(), None
    if os.environ.get("FLODL_TEST_STATE"):
        # after prepare: from the scaled LR. LambdaLR sets base x 0.5**steps: a fresh one on a
        # resumed run would halve the restored LR again from step 0
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5**e)
        run.register_state("lr_scheduler", scheduler)
        run.register_state("counter", counter)
    if os.environ.get("FLODL_TEST_MISUSE") == "step":
        run.step(torch.tensor(0.0))
    if os.environ.get("FLODL_TEST_MISUSE") == "skip":
        for _ in run.epochs():
            for _ in run.batches():  # never steps: the second batch is refused, naming this line
                pass
    idioms = {"len": len(run.batches()), "dist": _distributed()} if os.environ.get("FLODL_TEST_IDIOMS") else None
    fail_at = int(os.environ.get("FLODL_TEST_FAIL_AT", "0") or 0)
    hang_rank, _, hang_step = os.environ.get("FLODL_TEST_HANG_AT", "-1:0").partition(":")
    pause = float(os.environ.get("FLODL_TEST_STEP_SLEEP", "0") or 0)
    steps, epochs, breaks, start = 0, [], 0, None
    for epoch in run.epochs():
        epochs.append(epoch)
        peeked = None
        if idioms is not None:  # the DDP tutorial's len(next(iter(loader))[0]) and len(loader), before the loop
            peeked = next(iter(run.batches()), None)
            idioms.setdefault("peeked", []).append(None if peeked is None else len(peeked[0]))
            idioms.setdefault("lens", []).append(len(run.batches()))
        for batch in run.batches():
            xb, yb = batch[0], batch[1]
            if peeked is not None:  # the loop's first batch is the one peeked at
                idioms.setdefault("first_is_peeked", []).append(torch.equal(xb, peeked[0]))
                peeked = None
            if workers:
                log_line("trained", " ".join(map(str, batch[2].tolist())))
            steps += 1
            if steps == fail_at:
                raise RuntimeError(f"injected failure at step {steps}")
            if run.rank == int(hang_rank) and steps == int(hang_step):
                threading.Event().wait()
            held = os.environ.get("FLODL_TEST_HOLD_FILE")
            time.sleep(float(os.environ.get("FLODL_TEST_HOLD_SLEEP", "0.1")) if held and not os.path.exists(held) else pause)
            if accum == 1:
                loss = F.cross_entropy(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                run.step(loss)
                continue
            params = [p.detach().clone() for p in model.parameters()]
            if start is None:
                start = params  # the accumulation's weights: no average may change them before its step
            elif any(not torch.equal(a, b) for a, b in zip(start, params, strict=True)):
                breaks += 1
                start = params
            loss = F.cross_entropy(model(xb), yb)
            (loss / accum).backward()
            stepped = steps % accum == 0
            if stepped:
                optimizer.step()
                optimizer.zero_grad()
                start = None
            run.step(loss, optimizer_stepped=stepped if declared == "explicit" else None)
        with torch.no_grad():  # after the epoch's batches: lands in this epoch's row
            run.report(accuracy=(model(x).argmax(1) == y).float().mean().item(), epoch_seen=epoch)
        counter.ends += 1
        if scheduler is not None:
            scheduler.step()
    out = os.environ.get("FLODL_TEST_OUT")
    if out:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        record = {"env": {k: os.environ.get(k) for k in names}, "epochs": epochs, "steps": steps, "world_size": run.world_size}
        record.update(lr=optimizer.param_groups[0]["lr"], counter=counter.ends, accum_breaks=breaks, driver_turns=turns[0])
        record["weights"] = float(sum(p.detach().double().sum() for p in model.parameters()))
        record["idioms"] = idioms
        with open(os.path.join(out, f"rank{run.rank}.json"), "w") as f:
            json.dump(record, f)


def _fail_before_init(how: str) -> None:
    """FLODL_TEST_EARLY: what a script does wrong before flodl.init(), on every rank or on one."""
    only, _, what = how.rpartition(":")
    if only and os.environ["RANK"] != only:
        return
    if what == "argparse":
        parser = argparse.ArgumentParser()
        parser.add_argument("--data", required=True)
        parser.parse_args()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "no-such-data.csv")) as f:
        f.read()


def _distributed() -> dict:
    """torch.distributed as a library sees it in a script rank, and what a leftover init_process_group() gets."""
    seen = {"initialized": dist.is_initialized(), "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")]}
    seen["sync_bn"] = list(torch.nn.SyncBatchNorm(2).train()(torch.randn(4, 2)).shape)  # no group: it normalises locally
    try:
        dist.init_process_group("gloo")
    except Exception as exc:
        seen["init_error"] = f"{type(exc).__name__}: {exc}"
    return seen


def _count_driver_turns() -> list[int]:
    """Count the rank thread's turns (``Bridge.hand``): a one-element list, counted up as they come."""
    from flodl.rank.bridge import Bridge

    turns, hand = [0], Bridge.hand

    def counted(self, item):
        turns[0] += 1
        return hand(self, item)

    Bridge.hand = counted
    return turns


if __name__ == "__main__":
    main()
