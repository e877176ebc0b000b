"""Data-plane benchmark: a dataset whose reads cost ~1 ms, with each staging tier on and off.

For each case a real run (controller, worker, ranks) trains ``bench.tasks.data_bound``
(a ``__getitem__`` that sleeps ``FLODL_BENCH_ITEM_MS``, 1 ms by default; the bench MLP) and reports, from its
summary and record stream:

* epoch 1 wall time (every sample read from the dataset) and the warm epochs'
  (the mean of the last two), and their ratio (goal: cached epochs >= 5x faster);
* data starvation once warm: the share of step time a rank waited for data in the
  last epoch (goal: < 5%);
* memory: bytes staged per rank and the rank process's peak RSS.

Cases: tiers off (``--no-sample-cache``), the RAM cache (default), the disk stage
alone (``--ram-max-usage 0 --disk-stage-gb 1``), the RAM cache on 2 ranks (each
rank warms on the samples it trains, so it takes a few epochs), and, on a CUDA
machine, the VRAM pool against the pinned RAM cache (``FLODL_VRAM_POOL=off``).

    python -m bench.data            # 4096 samples, 6 epochs
    python -m bench.data --quick    # 2048 samples, 4 epochs (under 2 minutes here)
    python -m bench.data --smoke    # the RAM cache alone, 256 samples, 2 epochs, MLP width 64;
                                    # results in a temporary folder (does the bench still run?)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import Row, report, run_controller, size_parser, smoke_results

ROOT = Path(__file__).resolve().parent.parent
SPEEDUP_GOAL, STARVE_GOAL = 5.0, 0.05


def run_case(flags: list[str], *, ranks: int, devices: str | None, samples: int, epochs: int, env: dict[str, str]) -> dict:
    """One real run; returns its summary plus the peak RSS of its ranks (from the record stream)."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        where = ["--devices", devices or ",".join(["cpu"] * ranks)]  # CPU ranks unless a case names a GPU
        args = ["--task", "bench.tasks.data_bound:task", *where, "--epochs", str(epochs), "--dashboard-port", "-1"]
        args += ["--record-log-dir", str(logs), "--disk-stage-dir", tmp, *flags]
        full_env = {**os.environ, "FLODL_BENCH_SAMPLES": str(samples), **env}
        summary = run_controller(args, workdir=Path(tmp), env=full_env, timeout_s=600)
        from flodl.monitor.reader import load

        # leaf records are the ranks' own (a lone rank's leaf is the root itself)
        leaves = [rec.get("res", {}) for recs in load(logs).values() for rec in recs if rec.get("kind") == "node" and "children" not in rec]
        summary["peak_rank_rss"] = max((r.get("rss_bytes", 0) for r in leaves), default=0)
        summary["peak_vram_share"] = max((r.get("vram_alloc_max", 0) / r["vram_total"] for r in leaves if r.get("vram_total")), default=0.0)
        return summary


def rows_for(case: str, summary: dict, uncached_warm: float | None) -> list[Row]:
    history = summary["history"]
    first = history[0]["wall_s"]
    warm = sum(h["wall_s"] for h in history[-2:]) / len(history[-2:])
    last = history[-1]["per_rank"].values()
    starve = sum(r["data_ms"] / max(1e-9, r["data_ms"] + r["compute_ms"]) for r in last) / len(last)
    staged = max((sum(v for k, v in row.items() if k.endswith("_bytes")) for row in summary["data"].values()), default=0)
    speedup = first / warm if warm > 0 else 0.0
    cached = not case.endswith("tiers off")
    out = [
        Row(case, "epoch 1 wall", first, "s"),
        Row(case, "warm epoch wall", warm, "s"),
        Row(case, "warm speedup", speedup, "x", f">= {SPEEDUP_GOAL:g}x" if cached else None, speedup >= SPEEDUP_GOAL if cached else None),
        Row(
            case,
            "data_starve warm",
            starve * 100,
            "%",
            f"< {STARVE_GOAL:.0%}" if cached else None,
            starve < STARVE_GOAL if cached else None,
        ),
    ]
    if cached and uncached_warm:
        # the same later epoch with the tiers off (that case's first epoch is no slower than its last)
        versus = uncached_warm / warm if warm > 0 else 0.0
        out.append(Row(case, "warm vs tiers off", versus, "x", f">= {SPEEDUP_GOAL:g}x", versus >= SPEEDUP_GOAL))
    return [*out, Row(case, "staged per rank", staged / 2**20, "MiB"), Row(case, "peak rank RSS", summary["peak_rank_rss"] / 2**20, "MiB")]


def main() -> None:
    args = size_parser(__doc__, "2048 samples, 4 epochs (under 2 minutes here)", "the RAM cache alone, 256 samples, 2 epochs").parse_args()
    samples, epochs = (256, 2) if args.smoke else (2048, 4) if args.quick else (4096, 6)
    width = "64" if args.smoke else "512"
    cases = [
        ("tiers off", ["--no-sample-cache"], 1, None, {}),
        ("ram cache", [], 1, None, {}),
        ("disk stage", ["--ram-max-usage", "0", "--disk-stage-gb", "1"], 1, None, {}),
        ("ram cache, 2 ranks", [], 2, None, {}),
    ]
    if args.smoke:
        cases = [("ram cache", [], 1, None, {"FLODL_BENCH_WIDTH": width})]
    import torch

    if torch.cuda.is_available() and not args.smoke:
        cases += [
            ("cuda: tiers off", ["--no-sample-cache", "--no-vram-pool"], 1, "cuda:0", {}),
            ("cuda: pinned ram cache", [], 1, "cuda:0", {"FLODL_VRAM_POOL": "off"}),
            ("cuda: vram pool", [], 1, "cuda:0", {}),
        ]
    rows: list[Row] = []
    uncached: dict[str, float] = {}  # device -> the tiers-off case's warm epoch (one rank)
    for case, flags, ranks, devices, env in cases:
        print(f"running {case} ...", flush=True)
        summary = run_case(flags, ranks=ranks, devices=devices, samples=samples, epochs=epochs, env=env)
        rows += rows_for(case, summary, uncached.get(devices or "cpu") if ranks == 1 else None)
        if "--no-sample-cache" in flags:
            uncached[devices or "cpu"] = next(r.value for r in reversed(rows) if r.metric == "warm epoch wall")
        if case.startswith("cuda"):
            vram = max((row.get("vram_bytes", 0) for row in summary["data"].values()), default=0)
            rows.append(Row(case, "vram pool held", vram / 2**20, "MiB"))
            share = summary["peak_vram_share"]
            rows.append(Row(case, "peak VRAM used", share * 100, "% of GPU", "<= vram_max_usage 90%", share <= 0.90))
    report(
        "data",
        rows,
        note=f"{samples} samples, ~1 ms per read, {epochs} epochs, batch 64, MLP width {width}; "
        "warm = mean of the last two epochs; data_starve = data wait / (data wait + compute), last epoch",
        results=smoke_results() if args.smoke else None,
    )


if __name__ == "__main__":
    main()
