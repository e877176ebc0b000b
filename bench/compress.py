"""Compressed syncs: the bytes an average sends and the quality a run reaches, none vs bf16 vs int8.

    python bench/compress.py [--quick | --smoke] [--seeds N]

Two ranks train ``bench/tasks/mlp.py`` (``task_with_eval``: an MLP on a learnable synthetic
problem, accuracy on held-out samples) with ``--sync-compression none``, ``bf16`` and ``int8``,
on each backend: the collective (``nccl-cadence --deterministic``: gloo here, windows of a fixed
batch count, every average blocking) and the CPU backend (``cpu-sync`` with ``FLODL_SHM=off``:
an average after every batch, every snapshot and average on the socket, as across hosts). Both
are chosen so that a seed's runs differ by the compression alone: ``cpu-cadence`` windows follow
the measured pace (on this task they grow to a whole epoch), and its runs of one seed differ by
more than compression does (final loss 0.24-0.30 uncompressed). Per backend and
compression, the mean over the seeds of: the bytes one average sends, summed over the ranks
(the summary's ``sync_bytes.per_average``: payload bytes, the collective's by a ring's count);
how many times fewer than none; the final training loss and its difference from none's; the
final eval and its difference from none's in points; the training rate; and the milliseconds a
rank spends per average (``sync_ms`` over its averages: waiting for its peer included).

Goals (issue 51), for int8: >= 3.5x fewer bytes per average than none, eval within 0.5
points and final loss within 2% over the seeds. ``--quick``: fewer samples and epochs;
``--smoke``: one seed, one small run of none and int8 on the collective backend, into a
temporary folder.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, run_controller, size_parser, smoke_results  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'mlp.py'}:task_with_eval"
KINDS = ("none", "bf16", "int8")
C = TypeVar("C")  # a bench's case (a compression, a fragment count)
#: backend -> (its flags, its environment)
BACKENDS: dict[str, tuple[list[str], dict[str, str]]] = {
    "collective": (["--mode", "nccl-cadence", "--deterministic"], {}),
    "cpu": (["--mode", "cpu-sync"], {"FLODL_SHM": "off"}),
}


def run(backend: str, kind: str, seed: int, *, epochs: int, width: int, samples: int, extra: tuple[str, ...] = ()) -> dict:
    """One run of ``backend`` with compression ``kind`` (``extra``: more flags, bench/fragments.py's)."""
    flags, env = BACKENDS[backend]
    args = ["--task", TASK, "--nproc-per-node", "2", "--epochs", str(epochs), "--seed", str(seed), "--dashboard-port", "-1"]
    args += ["--no-progress", "--sync-compression", kind, *flags, *extra]
    env = {
        **os.environ,
        **env,
        "FLODL_BENCH_WIDTH": str(width),
        "FLODL_BENCH_SAMPLES": str(samples),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return run_controller(args, env=env, timeout_s=900)


def ms_per_average(summary: dict) -> float:
    """A rank's averaging milliseconds per average, the mean over the ranks."""
    rows = [r for r in summary["per_rank"] if r.get("sync_averages")]
    return statistics.mean(r["sync_ms"] / r["sync_averages"] for r in rows) if rows else 0.0


def rows_for(backend: str, runs: dict[str, list[dict]]) -> list[Row]:
    """The table's rows of one backend: each compression's means over the seeds, against none's."""
    mean = {k: {m: statistics.mean(f(s) for s in runs[k]) for m, f in METRICS.items()} for k in runs}
    base = mean["none"]
    rows = []
    for kind, got in mean.items():
        case = f"{backend} {kind}"
        int8 = kind == "int8"
        fewer = base["bytes"] / got["bytes"] if got["bytes"] else 0.0
        loss = 100.0 * (got["loss"] - base["loss"]) / base["loss"] if base["loss"] else 0.0
        points = 100.0 * (got["eval"] - base["eval"])
        rows += [
            Row(case, "bytes per average", got["bytes"], "B"),
            Row(case, "fewer bytes than none", fewer, "x", ">= 3.5x" if int8 else None, fewer >= 3.5 if int8 else None),
            Row(case, "final loss", got["loss"], ""),
            Row(case, "loss vs none", loss, "%", "within 2%" if int8 else None, abs(loss) <= 2.0 if int8 else None),
            Row(case, "final eval", got["eval"], "accuracy"),
            Row(case, "eval vs none", points, "points", "within 0.5 points" if int8 else None, abs(points) <= 0.5 if int8 else None),
            Row(case, "train samples/s", got["rate"], "samples/s"),
            Row(case, "ms per average", got["ms"], "ms"),
        ]
    return rows


METRICS = {
    "bytes": lambda s: s["sync_bytes"]["per_average"] or 0.0,
    "loss": lambda s: s["final_loss"],
    "eval": lambda s: s["final_eval"] or 0.0,
    "rate": lambda s: s["train_samples_per_s"],
    "ms": ms_per_average,
}


def main() -> None:
    parser = size_parser(__doc__, "fewer samples and epochs", "one seed, none and int8, the collective backend")
    parser.add_argument("--seeds", type=int, default=None, help="runs per case (default 3; 1 with --smoke)")
    args = parser.parse_args()
    epochs, samples, width = (1, 2048, 64) if args.smoke else (3, 8192, 256) if args.quick else (6, 32768, 512)
    seeds = args.seeds or (1 if args.smoke else 3)
    kinds = ("none", "int8") if args.smoke else KINDS
    backends = ("collective",) if args.smoke else tuple(BACKENDS)

    def one(backend: str, kind: str, seed: int) -> dict:
        return run(backend, kind, seed, epochs=epochs, width=width, samples=samples)

    rows = sweep(backends, kinds, seeds, one, rows_for, lambda s: f"{s['sync_bytes']['per_average']:,.0f} B per average")
    report("compress", rows, note=note(width, samples, epochs, seeds), results=smoke_results() if args.smoke else None)


def sweep(
    backends: Sequence[str],
    cases: Sequence[C],
    seeds: int,
    one: Callable[[str, C, int], dict],
    rows_for: Callable[[str, dict], list[Row]],
    said: Callable[[dict], str],
) -> list[Row]:
    """Every case of every backend, each seed in turn (``one(backend, case, seed)``: a run's
    summary, printed as its loss, eval and ``said(summary)``), into each backend's rows
    (``rows_for(backend, {case: summaries})``)."""
    rows: list[Row] = []
    for backend in backends:
        runs: dict[C, list[dict]] = {case: [] for case in cases}
        for seed in range(seeds):
            for case in cases:
                summary = one(backend, case, seed)
                runs[case].append(summary)
                print(f"  {backend} {case} seed {seed}: loss {summary['final_loss']:.4f} eval {summary['final_eval']:.4f} {said(summary)}")
        rows += rows_for(backend, runs)
    return rows


def note(width: int, samples: int, epochs: int, seeds: int) -> str:
    """The table's note: the task, its size, how the backends ran (bench/fragments.py's too)."""
    return (
        f"bench/tasks/mlp.py task_with_eval, width {width}, {samples} samples, {epochs} epochs, 2 ranks, "
        f"means over {seeds} seed(s); collective: nccl-cadence --deterministic (gloo); cpu: cpu-sync, FLODL_SHM=off; "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )


if __name__ == "__main__":
    main()
