"""CPU averaging round vs a gloo all-reduce of the same tensors, and the controller's memory.

    python bench/cpu_avg.py [--quick | --smoke]

For each parameter size (10, 100, 400 MB of float32) and rank count (2, 4),
this process plays the controller (the real ``CpuAveraging`` actor on uvloop)
and spawns the ranks. Each rank holds one flat model of that size and joins a
gloo group built from a TCPStore this process hosts. Between barriers, the
ranks time (a) a gloo all-reduce of the model and (b) one CPU averaging round
end to end: snapshot copy, slices up to the controller, fold, average, slices
back, applied. A round's time is the slowest rank's; the first of each is a
warm-up (connections, the segments' first page faults), reported apart. Every case runs twice:
on the same-host lane (snapshots and averages through shared memory, what
ranks on the controller's host use) and on the wire (``FLODL_SHM=off``: every
byte through the bulk socket, what ranks on other hosts use). A sampler thread
records the controller process's peak memory above its baseline during
rounds: private memory (RSS less shared pages) plus its whole update segment;
the ranks' snapshot segments, which take the place of the snapshot copy a
rank keeps anyway, are theirs.

Goals (issue 4): round time ≤ 1.5× the gloo all-reduce (stretch: faster);
controller memory ≤ 2× one model.

``--smoke`` runs 1 MB x 2 ranks once on each lane (does the bench still run?)
and writes its JSON under ``$FLODL_BENCH_RESULTS`` or a temporary folder.
"""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402
from flodl.averaging.server import CpuAveraging  # noqa: E402
from flodl.controller import run_loop  # noqa: E402

SECRET = b"c" * 32
RUN = "cpu-avg-bench"


class Flat(torch.nn.Module):
    def __init__(self, numel: int, rank: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.full((numel,), float(rank + 1)))


def rank_main(rank: int, world: int, numel: int, store_port: int, bulk_port: int, probe: tuple[str, str], reps: int, out: mp.Queue) -> None:
    from flodl.rank.cpu_average import BulkLink, CpuAverager
    from flodl.rank.flat import FlatModel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world, datetime.timedelta(seconds=120))
    model = Flat(numel, rank)
    flat = FlatModel(model)
    bulk = BulkLink(
        f"tcp://127.0.0.1:{bulk_port}",
        rank=rank,
        secret=SECRET,
        run_id=RUN,
        sender=f"rank{rank}.bench/bulk",
        shm_probe=probe[0],
        shm_nonce=probe[1],
    )
    avg = CpuAverager(flat, bulk, rank=rank, timeout_s=600.0, must_stop=lambda: False)
    barrier = torch.zeros(1)
    gloo, rounds = [], []
    for _ in range(1 + reps):  # the first all-reduce and the first round are warm-ups (connections, page faults)
        group.allreduce([barrier]).wait()
        t0 = time.perf_counter()
        group.allreduce([flat.buckets[0].flat]).wait()
        gloo.append(time.perf_counter() - t0)
    for _ in range(1 + reps):
        group.allreduce([barrier]).wait()
        t0 = time.perf_counter()
        avg.average(1.0, block=True)
        rounds.append(time.perf_counter() - t0)
    group.allreduce([barrier]).wait()
    out.put((rank, gloo, rounds))
    avg.close()
    bulk.close()


class PeakRss(threading.Thread):
    """Samples this process's RSS every few ms while armed."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.peak = 0
        self.armed = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.armed.is_set():
                mem = self.proc.memory_info()
                self.peak = max(self.peak, mem.rss - mem.shared)
            time.sleep(0.005)


def measure(size_mb: int, world: int, reps: int, *, lane: bool) -> dict:
    os.environ["FLODL_SHM"] = "on" if lane else "off"
    numel = size_mb * (1 << 20) // 4
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sampler = PeakRss()
    sampler.start()

    async def main() -> list:
        actor = CpuAveraging(secret=SECRET, run_id=RUN, bind="127.0.0.1", timeout_s=600.0)
        for r in range(world):
            actor.admit(f"rank{r}.bench".encode(), r)
        actor.start()
        task = asyncio.create_task(actor.run())
        mem = psutil.Process().memory_info()
        baseline = mem.rss - mem.shared
        procs = [
            ctx.Process(target=rank_main, args=(r, world, numel, store.port, actor.port, (actor.probe_path, actor.probe_nonce), reps, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        sampler.peak = baseline
        sampler.armed.set()
        results = []
        deadline = time.monotonic() + 600
        while len(results) < world:
            try:
                results.append(out.get_nowait())
            except Exception as exc:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"bench ranks failed (exit codes {dead}) or ran past 600 s") from exc
                await asyncio.sleep(0.05)
        sampler.armed.clear()
        for p in procs:
            await asyncio.to_thread(p.join, 60)
        task.cancel()
        segment = actor.update_seg.size if actor.update_seg is not None else 0
        used_lane = actor.lane_bytes > 0
        actor.close()
        return [*results, baseline, actor.rounds.aborted, segment, used_lane]

    *results, baseline, aborted, segment, used_lane = run_loop(main())
    assert used_lane == lane, "the lane was not taken as asked"
    sampler.stop.set()
    gloo = [max(r[1][i] for r in results) for i in range(1 + reps)]
    rounds = [max(r[2][i] for r in results) for i in range(1 + reps)]
    return {
        "gloo_s": statistics.median(gloo[1:]),
        "round_s": statistics.median(rounds[1:]),
        "first_round_s": rounds[0],
        "peak_mb": (sampler.peak - baseline + segment) / (1 << 20),
        "aborted": aborted,
    }


def main() -> None:
    args = size_parser(__doc__, "one repetition per case", "1 MB x 2 ranks, once").parse_args()
    reps = 1 if args.quick or args.smoke else 3
    sizes, worlds = ((1,), (2,)) if args.smoke else ((10, 100, 400), (2, 4))
    rows: list[Row] = []
    for size in sizes:
        for world in worlds:
            case = f"{size} MB, {world} ranks"
            for lane in (True, False):
                res = measure(size, world, reps, lane=lane)
                assert res["aborted"] == 0
                how = "lane" if lane else "wire"
                ratio = res["round_s"] / res["gloo_s"]
                if lane:
                    rows.append(Row(case, "gloo all-reduce", res["gloo_s"] * 1000, "ms"))
                rows.append(Row(case, f"CPU round ({how})", res["round_s"] * 1000, "ms"))
                rows.append(Row(case, f"first round ({how})", res["first_round_s"] * 1000, "ms"))
                rows.append(Row(case, f"{how} / all-reduce", ratio, "x", "≤ 1.5x", ratio <= 1.5))
                rows.append(
                    Row(case, f"controller peak ({how})", res["peak_mb"] / size, "x model", "≤ 2x model", res["peak_mb"] <= 2 * size)
                )
                print(
                    f"  {case} {how}: gloo {res['gloo_s'] * 1000:.0f} ms, round {res['round_s'] * 1000:.0f} ms, "
                    f"peak +{res['peak_mb']:.0f} MB",
                    flush=True,
                )
    report(
        "cpu_avg",
        rows,
        note=f"median of {reps} repetition(s) after one warm-up; float32 flat models; ranks and controller on this one machine; "
        "lane = same-host shared memory (ranks on the controller's host), wire = the bulk socket (FLODL_SHM=off, ranks on other hosts)",
        results=smoke_results() if args.smoke else None,
    )


if __name__ == "__main__":
    main()
