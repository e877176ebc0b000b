"""Scale by simulation: the real controller driving 1,000 simulated ranks.

    python bench/scale.py [--quick | --smoke]

The real ``Controller`` (NcclCadence: the controller plans every window and
decides when the ranks average; the ranks' collective is what the simulation
leaves out) runs alone in one process on uvloop. A second process holds every
simulated worker and rank of ``flodl.testing.sim`` on one event loop, each rank with
its own DEALER socket speaking the real protocol: hello, ready, one signed
``TimingMsg`` per batch, a ``WindowDone`` per window, heartbeats, exits. The
ranks have random speeds (a per-rank slowdown of 1-3x, and every batch drawn
+-25% around it); some die at random batches (their worker reports them
killed), one hangs (found by the heartbeat timeout), and new workers arrive
while the run trains (admitted at a window boundary). Cases: 100 and 1,000
ranks, 8 ranks per simulated worker.

Measured in the controller's process alone: dispatch decisions/s (rank
plans, each rank's grants and quota for a window, made per second of the
controller's time spent planning windows), averaging decisions/s (windows
settled, i.e. the coverage ledger, ElChe's timing and the guard's verdict
that close one averaging window, per second of the time spent settling),
the time one death or join takes (out of the plans, ElChe resized, a Regroup
to every member), the window turnaround (the last report of a window in, to
the next window planned), frames in and out per second, event-loop lag,
process CPU time (every thread: the loop, ZeroMQ's I/O thread, the
TCPStore) and peak RSS. Windows are kept short on purpose (anchor 2, at most
4 batches of the slowest rank): more decisions per run, and the turnaround
weighs. At the end: coverage must be exact, every sample of every epoch
trained once despite the deaths and joins, by the controller's ledger (the
summary's ``history[].samples``) and by the ranks' own record of the
positions they trained.

Goals: none given beyond "the evidence for runs larger than these machines";
coverage must be exact.

``--smoke`` runs one toy case (16 ranks, a death and a join, no hang: the
heartbeat timeout alone would take longer) in seconds and writes its JSON
under ``$FLODL_BENCH_RESULTS`` or a temporary folder, never ``bench/results``.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Row, report, size_parser, smoke_results

SECRET = bytes.fromhex(os.environ.setdefault("FLODL_BENCH_SECRET", os.urandom(32).hex()))  # children inherit it
RUN = "scale-run"
RANKS_PER_WORKER = 8
BATCH = 8
HEARTBEAT_S = 6
ANCHOR, MAX_ANCHOR = 2, 4  # short windows on purpose: many decisions per run, and the turnaround weighs
LAG_TICK_S = 0.05


def scenario(
    ranks: int,
    *,
    batches_per_rank: int,
    epochs: int,
    deaths: int,
    hangs: int,
    joins: int,
    base_ms: float,
    seed: int,
    join_after_s: tuple[float, float] = (1.0, 4.0),
    faults_by: float = 0.85,
) -> dict:
    """Everything random about one case, drawn up front (both processes read it). A death or hang
    lands at a random batch before ``faults_by`` of the batches the rank would train in the run."""
    rng = random.Random(seed)
    slowdowns = [rng.uniform(1.0, 3.0) for _ in range(ranks)]
    speed = [1.0 / s for s in slowdowns]
    mean_speed = sum(speed) / ranks
    per_epoch = batches_per_rank  # per rank at the mean speed
    faults: dict[int, tuple[str, int]] = {}
    for i, rank in enumerate(rng.sample(range(ranks), deaths + hangs)):
        expected = epochs * per_epoch * speed[rank] / mean_speed  # batches this rank would train in the run
        at = rng.randint(2, max(3, int(faults_by * expected)))
        faults[rank] = ("die" if i < deaths else "hang", at)
    specs = [
        {
            "batch_ms": base_ms,
            "slowdown": slowdowns[r],
            "jitter": 0.25,
            "seed": seed * 100_003 + r,
            "die_at_batch": faults[r][1] if faults.get(r, ("", 0))[0] == "die" else None,
            "silent_at_batch": faults[r][1] if faults.get(r, ("", 0))[0] == "hang" else None,
        }
        for r in range(ranks)
    ]
    late = [
        {"batch_ms": base_ms, "slowdown": rng.uniform(1.0, 3.0), "jitter": 0.25, "seed": seed * 7 + 10_000_000 + i}
        for i in range(joins * RANKS_PER_WORKER)
    ]
    return {
        "ranks": ranks,
        "epochs": epochs,
        "dataset_len": ranks * batches_per_rank * BATCH,
        "specs": specs,
        "late": late,
        "join_after_s": sorted(rng.uniform(*join_after_s) for _ in range(joins)),
        "deaths": deaths,
        "hangs": hangs,
        "joins": joins,
    }


# ====================================================================== controller process


def controller_main(case: dict, out: mp.Queue) -> None:
    """Run the real controller for ``case``; put its port, then its measurements, on ``out``."""
    from flodl.config import DdpRunConfig
    from flodl.controller import Controller, ControllerHooks, LaunchOptions, run_loop
    from flodl.controller.console import Console
    from flodl.wire import messages as m

    timing = {"plan_s": [], "plans": 0, "settle_s": [], "turnaround_s": [], "membership_s": []}
    last_input: dict[int, float] = {}  # window -> when its last report (or a death while it flew) arrived

    class Timing(ControllerHooks):
        """The controller's decisions, timed at its public hooks; frames out counted at its socket."""

        frames_out = 0

        def opened(self, endpoint) -> None:
            io_ = endpoint.io
            send = io_.send

            def counting(parts, **kw):
                self.frames_out += 1
                return send(parts, **kw)

            io_.send = counting

        def handled(self, msg) -> None:
            if type(msg) is m.WindowDone:
                last_input[msg.window] = time.perf_counter()

        def planned(self, window: int, ranks: int, seconds: float) -> None:
            t1 = time.perf_counter()
            timing["plan_s"].append(seconds)
            timing["plans"] += ranks
            prev = window - 1  # the window whose reports this plan waited for (two fly at once)
            if prev in last_input:
                timing["turnaround_s"].append(t1 - last_input.pop(prev))
                timing.setdefault("turn_by_window", []).append(
                    (prev, round(1000 * seconds, 1), round(1000 * timing["turnaround_s"][-1], 1))
                )

        def settled(self, window: int, seconds: float) -> None:
            timing["settle_s"].append(seconds)

        def deaths_handled(self, dead: set[int], seconds: float) -> None:
            timing["membership_s"].append(seconds)
            if ctl.cadence is not None and ctl.cadence.window - 1 in last_input:
                last_input[ctl.cadence.window - 1] = time.perf_counter()

        def joiners_admitted(self, ranks: list[int], seconds: float) -> None:
            timing["membership_s"].append(seconds)

    config = (
        DdpRunConfig().with_mode("nccl-cadence").with_heartbeat_timeout_secs(HEARTBEAT_S).with_anchor(ANCHOR).with_max_anchor(MAX_ANCHOR)
    )
    workers = -(-case["ranks"] // RANKS_PER_WORKER)
    launch = LaunchOptions(task="sim:task", epochs=case["epochs"], workers=workers, progress=False, join_timeout_secs=120.0)
    console_out = io.StringIO()
    hooks = Timing()
    ctl = Controller(launch, config, secret=SECRET, run_id=RUN, console=Console(out=console_out, live=False), hooks=hooks)
    lags: list[float] = []
    spikes: list[tuple[float, str, int]] = []  # (lag ms, phase, window) of the worst stalls

    async def lag_probe() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            lags.append(time.perf_counter() - t0 - LAG_TICK_S)
            if lags[-1] > 0.1:
                spikes.append((round(lags[-1] * 1000), ctl.phase, ctl.cadence.window if ctl.cadence else -1))

    async def main() -> dict:
        run = asyncio.create_task(ctl.run())
        await ctl.ready.wait()
        rss0 = _status_kib("VmRSS")
        out.put(ctl.port)
        probe = asyncio.create_task(lag_probe())
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            summary = await run
            error = None
        except Exception as exc:  # RunAborted: the summary still says what was done
            summary, error = getattr(exc, "summary", None) or {}, f"{type(exc).__name__}: {exc}"
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        probe.cancel()
        return {"summary": summary, "error": error, "cpu_s": cpu, "wall_s": wall, "rss0_kib": rss0}

    result = run_loop(main())
    summary = result["summary"]
    lags.sort()
    out.put(
        {
            **{k: v for k, v in result.items() if k != "summary"},
            "exit_reason": summary.get("exit_reason"),
            "history": [h["samples"] for h in summary.get("history", [])],
            "epochs_completed": summary.get("epochs_completed"),
            "deaths": len(summary.get("deaths", [])),
            "death_reasons": sorted({d["reason"].split(" (")[0][:40] for d in summary.get("deaths", [])}),
            "joined": sum(len(j["ranks"]) for j in summary.get("joins", [])),
            "world": summary.get("world_size"),
            "syncs": summary.get("syncs"),
            "windows": (summary.get("cadence") or {}).get("windows"),
            "regranted": summary.get("regranted_samples"),
            "train_wall_s": summary.get("wall_s"),
            "frames_in": ctl.endpoint.reader.accepted,
            "frames_out": hooks.frames_out,
            "dropped": summary.get("dropped_frames"),
            "peak_rss_kib": _status_kib("VmHWM"),
            "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1000 if lags else 0.0,
            "lag_max_ms": lags[-1] * 1000 if lags else 0.0,
            "lag_spikes": sorted(spikes, reverse=True)[:5],
            "timing": timing,
            "console_tail": console_out.getvalue().splitlines()[-8:],
        }
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ====================================================================== simulation process


def sim_main(case: dict, addr: str, out: mp.Queue) -> None:
    """Every simulated worker and rank of ``case`` on one uvloop; their record on ``out``."""
    from flodl.controller import run_loop
    from flodl.testing import sim

    sim.allow_peers(case["ranks"] + len(case["late"]) + 2 * (case["ranks"] // RANKS_PER_WORKER + 8))
    specs = [sim.SimRankSpec(**s) for s in case["specs"]]
    late = [sim.SimRankSpec(**s) for s in case["late"]]
    cpu0 = time.process_time()

    async def main() -> list:
        training = asyncio.Event()
        kw = {"dataset_len": case["dataset_len"], "batch_size": BATCH, "record": True}
        workers = [
            sim.SimWorker(
                addr, SECRET, RUN, specs[i : i + RANKS_PER_WORKER], host=f"node{i // RANKS_PER_WORKER:04d}", training=training, **kw
            )
            for i in range(0, len(specs), RANKS_PER_WORKER)
        ]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        await training.wait()
        t0 = time.monotonic()
        for j, after in enumerate(case["join_after_s"]):
            await asyncio.sleep(max(0.0, t0 + after - time.monotonic()))
            w = sim.SimWorker(addr, SECRET, RUN, late[j * RANKS_PER_WORKER : (j + 1) * RANKS_PER_WORKER], host=f"late{j:02d}", **kw)
            workers.append(w)
            tasks.append(asyncio.create_task(w.run()))
        await asyncio.wait(tasks, timeout=900)
        return workers

    workers = run_loop(main())
    trained: dict[int, list] = {}
    outcomes: dict[str, int] = {}
    for w in workers:
        for rank, ranges in (w.trained or {}).items():
            trained.setdefault(rank, []).extend(ranges)
        for outcome in w.outcomes.values():
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    out.put(
        {
            "cpu_s": time.process_time() - cpu0,
            "frames_sent": sum(w.frames_sent for w in workers),
            "batches": sum(w.batches_sent for w in workers),
            "outcomes": outcomes,
            "coverage": rank_side_coverage(trained, case["dataset_len"], case["epochs"]),
        }
    )


def rank_side_coverage(trained: dict[int, list], dataset_len: int, epochs: int) -> dict:
    """From the ranks' own record: positions trained twice, and never, per epoch."""
    twice = missed = 0
    for epoch in range(epochs):
        ranges = sorted((s, z) for ranks in trained.values() for e, s, z in ranks if e == epoch)
        at = 0  # every position below is covered
        for start, size in ranges:
            if start > at:
                missed += start - at
            twice += max(0, min(at, start + size) - start)
            at = max(at, start + size)
        missed += max(0, dataset_len - at)
    return {"twice": twice, "missed": missed}


# ====================================================================== driver


def measure(case: dict) -> dict:
    spawn = mp.get_context("spawn")
    q_ctl, q_sim = spawn.Queue(), spawn.Queue()
    ctl = spawn.Process(target=controller_main, args=(case, q_ctl))
    ctl.start()
    port = _get(q_ctl, ctl, 120)
    sim_proc = spawn.Process(target=sim_main, args=(case, f"tcp://127.0.0.1:{port}", q_sim))
    sim_proc.start()
    try:
        res = _get(q_ctl, ctl, 900)
        sim_res = _get(q_sim, sim_proc, 120)
    finally:
        for proc in (ctl, sim_proc):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return {**res, "sim": sim_res}


def _get(q: mp.Queue, proc, timeout_s: float):
    """The next item ``proc`` puts on ``q``; fails fast if ``proc`` died first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before reporting") from None
    raise TimeoutError(f"{proc.name} reported nothing in {timeout_s:g} s")


def rows_for(label: str, case: dict, r: dict) -> list[Row]:
    t = r["timing"]
    exact = (
        r["exit_reason"] == "completed"
        and r["epochs_completed"] == case["epochs"]
        and r["history"] == [case["dataset_len"]] * case["epochs"]
    )
    cov = r["sim"]["coverage"]
    plan_s, settle_s = sum(t["plan_s"]), sum(t["settle_s"])
    turn = sorted(t["turnaround_s"]) or [0.0]
    wall = r["wall_s"]
    rows = [
        Row(label, "ranks at start", case["ranks"], "ranks"),
        Row(label, "ranks lost", r["deaths"], "ranks"),
        Row(label, "ranks joined", r["joined"], "ranks"),
        Row(label, "run wall", wall, "s"),
        Row(label, "windows (averages)", r["windows"] or 0, "windows"),
        Row(label, "dispatch decisions/s", t["plans"] / plan_s if plan_s else 0.0, "plans/s"),
        Row(label, "dispatch per window", 1000 * statistics.median(t["plan_s"]) if t["plan_s"] else 0.0, "ms (p50)"),
        Row(label, "averaging decisions/s", len(t["settle_s"]) / settle_s if settle_s else 0.0, "windows/s"),
        Row(label, "averaging per window", 1000 * statistics.median(t["settle_s"]) if t["settle_s"] else 0.0, "ms (p50)"),
        Row(label, "per death or join", 1000 * statistics.median(t["membership_s"]) if t["membership_s"] else 0.0, "ms (p50)"),
        Row(label, "window turnaround p50", 1000 * turn[len(turn) // 2], "ms"),
        Row(label, "window turnaround max", 1000 * turn[-1], "ms"),
        Row(label, "frames in/s", r["frames_in"] / wall, "frames/s"),
        Row(label, "frames out/s", r["frames_out"] / wall, "frames/s"),
        Row(label, "controller CPU", r["cpu_s"], "s"),
        Row(label, "controller CPU share", 100 * r["cpu_s"] / wall, "% of 1 core"),
        Row(label, "CPU per frame in", 1e6 * r["cpu_s"] / max(1, r["frames_in"]), "µs"),
        Row(label, "event-loop lag p99", r["lag_p99_ms"], "ms"),
        Row(label, "peak RSS", r["peak_rss_kib"] / 1024, "MiB"),
        Row(label, "RSS growth in run", (r["peak_rss_kib"] - r["rss0_kib"]) / 1024, "MiB"),
        Row(label, "coverage", 1.0 if exact else 0.0, "exact", "exact", exact),
        Row(
            label, "ranks' record", 1.0 if cov["twice"] == cov["missed"] == 0 else 0.0, "exact", "exact", cov["twice"] == cov["missed"] == 0
        ),
    ]
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = size_parser(__doc__, "fewer batches and epochs (under two minutes)", "one toy case")
    args = parser.parse_args(argv)
    quick = args.quick
    if args.smoke:
        cases = [
            (
                "16 ranks",
                # the death within the first 40% of the victim's batches: on a loaded machine the joiner's
                # share can leave a rank short of a later batch, and the smoke checks the death was handled
                scenario(
                    16,
                    batches_per_rank=30,
                    epochs=2,
                    deaths=1,
                    hangs=0,
                    joins=1,
                    base_ms=20,
                    seed=3,
                    join_after_s=(0.3, 0.6),
                    faults_by=0.4,
                ),
            )
        ]
    elif quick:
        cases = [
            ("100 ranks", scenario(100, batches_per_rank=40, epochs=3, deaths=3, hangs=1, joins=1, base_ms=100, seed=1)),
            ("1000 ranks", scenario(1000, batches_per_rank=40, epochs=3, deaths=20, hangs=1, joins=2, base_ms=100, seed=2)),
        ]
    else:
        cases = [
            ("100 ranks", scenario(100, batches_per_rank=60, epochs=6, deaths=5, hangs=1, joins=2, base_ms=100, seed=1)),
            ("1000 ranks", scenario(1000, batches_per_rank=60, epochs=6, deaths=40, hangs=1, joins=4, base_ms=100, seed=2)),
        ]
    rows: list[Row] = []
    notes = []
    for label, case in cases:
        t0 = time.monotonic()
        res = measure(case)
        sim_res = res["sim"]
        print(
            f"{label}: {res['exit_reason']} in {time.monotonic() - t0:.0f} s; history {res['history']}; "
            f"lost {res['deaths']} {res['death_reasons']}; joined {res['joined']}; rank outcomes {sim_res['outcomes']}; "
            f"ranks' record {sim_res['coverage']}; sim process CPU {sim_res['cpu_s']:.0f} s; drops {res['dropped']}; "
            f"worst loop stalls (ms, phase, window) {res['lag_spikes']}",
            flush=True,
        )
        if res["error"]:
            print("  " + res["error"][:400])
            print("  " + "\n  ".join(res["console_tail"]))
        rows += rows_for(label, case, res)
        notes.append(
            f"{label}: {case['dataset_len']:,} samples x {case['epochs']} epochs, batch {BATCH}, "
            f"{sim_res['batches']:,} batches, sim process {100 * sim_res['cpu_s'] / res['wall_s']:.0f}% of a core"
        )
    mode = "smoke" if args.smoke else "quick" if quick else "full"
    return report("scale", rows, note="; ".join(notes) + f"; {mode} mode", results=smoke_results() if args.smoke else None)


if __name__ == "__main__":
    main()
