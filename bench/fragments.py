"""Streamed fragments: the bytes one average sends at its peak and the quality a run reaches, F = 1, 2, 4.

    python bench/fragments.py [--quick | --smoke] [--seeds N]

Two ranks train ``bench/tasks/mlp.py`` (``task_with_eval``) with ``--sync-fragments 1``, ``2``
and ``4``, on each backend, run as bench/compress.py runs them (the collective:
``nccl-cadence --deterministic``, gloo here; the CPU backend: ``cpu-sync`` with every snapshot on
the socket), so that a seed's runs differ by the fragments alone. Per backend and F, the mean
over the seeds of: the most bytes one average sent, summed over the ranks (the summary's
``sync_bytes.peak_per_average``: what a window's exchange puts on the links at once), that
peak against F=1's, the mean bytes per average, the final training loss, the final eval (the
eval rank's replica, scored before the run's end) and the **model's eval**: the final bundle
(the consensus the run ends on: with fragments written after the last, full average) scored
here on the same held-out samples; each against F=1's. The run's last average comes after the
last report and is in no byte count.

Goals (issue 51): the peak bytes in flight per window divided by F (here: at most 1/F of F=1's
and 2% over, for the weight slots and the buffers every average carries), the model's eval
within 0.5 points and the final loss within 2% of F=1's. ``--quick``: fewer samples and epochs, one seed;
``--smoke``: one small run each of F=1 and F=2 on the collective backend, into a temporary folder.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402
from bench.compress import BACKENDS, note, run, sweep  # noqa: E402

COUNTS = (1, 2, 4)

METRICS = {
    "peak": lambda s: s["sync_bytes"]["peak_per_average"] or 0.0,
    "bytes": lambda s: s["sync_bytes"]["per_average"] or 0.0,
    "loss": lambda s: s["final_loss"],
    "eval": lambda s: s["final_eval"] or 0.0,
    "model": lambda s: s["model_eval"],
}


def model_eval(stem: Path, width: int) -> float:
    """The final bundle's accuracy on the task's held-out samples (bench/tasks/mlp.py ``evaluate``)."""
    from bench.tasks import mlp
    from flodl.checkpoint.bundle import load_model

    os.environ["FLODL_BENCH_WIDTH"] = str(width)  # the model's size, as the run's ranks read it
    model = mlp.make_model()
    load_model(model, stem)
    with torch.no_grad():
        return mlp.evaluate(model.eval(), torch.device("cpu"))


def fragmented(backend: str, f: int, seed: int, *, epochs: int, width: int, samples: int) -> dict:
    """One run with ``--sync-fragments f``: its summary, with its final bundle's eval (``model_eval``)."""
    with tempfile.TemporaryDirectory(prefix="flodl-fragments-") as where:
        stem = Path(where) / "final"
        extra = ("--sync-fragments", str(f), "--save-path", str(stem))
        summary = run(backend, "none", seed, epochs=epochs, width=width, samples=samples, extra=extra)
        summary["model_eval"] = model_eval(stem, width)
    return summary


def rows_for(backend: str, runs: dict[int, list[dict]]) -> list[Row]:
    """The table's rows of one backend: each F's means over the seeds, against F=1's."""
    mean = {f: {m: statistics.mean(get(s) for s in runs[f]) for m, get in METRICS.items()} for f in runs}
    base = mean[1]
    rows = []
    for f, got in mean.items():
        case = f"{backend} F={f}"
        share = got["peak"] / base["peak"] if base["peak"] else 0.0
        loss = 100.0 * (got["loss"] - base["loss"]) / base["loss"] if base["loss"] else 0.0
        points = 100.0 * (got["eval"] - base["eval"])
        model_points = 100.0 * (got["model"] - base["model"])
        split = f > 1
        rows += [
            Row(case, "peak bytes per average", got["peak"], "B"),
            Row(case, "peak vs F=1", share, "x", f"<= 1/{f} (+2%)" if split else None, share <= 1.02 / f if split else None),
            Row(case, "bytes per average", got["bytes"], "B"),
            Row(case, "final loss", got["loss"], ""),
            Row(case, "loss vs F=1", loss, "%", "within 2%" if split else None, abs(loss) <= 2.0 if split else None),
            Row(case, "final eval", got["eval"], "accuracy"),
            Row(case, "eval vs F=1", points, "points"),
            Row(case, "model's eval", got["model"], "accuracy"),
            Row(
                case,
                "model's eval vs F=1",
                model_points,
                "points",
                "within 0.5 points" if split else None,
                abs(model_points) <= 0.5 if split else None,
            ),
        ]
    return rows


def main() -> None:
    parser = size_parser(__doc__, "fewer samples and epochs, one seed", "one seed, F=1 and F=2, the collective backend")
    parser.add_argument("--seeds", type=int, default=None, help="runs per case (default 3; 1 with --quick or --smoke)")
    args = parser.parse_args()
    epochs, samples, width = (1, 2048, 64) if args.smoke else (3, 8192, 256) if args.quick else (6, 32768, 512)
    seeds = args.seeds or (1 if args.smoke or args.quick else 3)
    counts = (1, 2) if args.smoke else COUNTS
    backends = ("collective",) if args.smoke else tuple(BACKENDS)

    def said(summary: dict) -> str:
        return f"model's eval {summary['model_eval']:.4f}, peak {summary['sync_bytes']['peak_per_average']:,.0f} B per average"

    rows = sweep(
        backends, counts, seeds, lambda b, f, seed: fragmented(b, f, seed, epochs=epochs, width=width, samples=samples), rows_for, said
    )
    report("fragments", rows, note=note(width, samples, epochs, seeds), results=smoke_results() if args.smoke else None)


if __name__ == "__main__":
    main()
