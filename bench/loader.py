"""Loader-worker benchmark: a rank's data path over a dataset whose ``__getitem__`` costs ~1 ms,
read by the rank's own threads (``num_workers=0``) or by worker processes (``Task.num_workers``).

It drives the rank's data path in process, as a rank's window does (``BatchSource`` with the
staging tiers off, as ``--no-sample-cache`` leaves them, so every pass reads every sample; the
batches taken through the ``Prefetcher``), and reports samples per second over one pass, after
a first pass that starts the workers: the median of alternating pairs of runs, and the
spread of their ratios. No training, no controller: what is measured is how fast
batches can arrive. The read either spins (CPU-bound Python that holds the GIL: decoding,
augmentation, what workers are for) or sleeps (I/O, which the rank's 8 reader threads already
overlap).

    python -m bench.loader                      # 2048 samples of 1 ms, spin and sleep, 0 vs 2 workers
    python -m bench.loader --quick              # 1024 samples
    python -m bench.loader --workers 0 1 2 4    # other worker counts
    python -m bench.loader --smoke              # 128 samples of 0.1 ms, spin only: does the bench still run?
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.common import Row, report, size_parser, smoke_results
from flodl.rank.data import BatchSource
from flodl.rank.loader import WorkerReads
from flodl.rank.prefetch import Prefetcher
from flodl.rank.staging import TieredSamples

BATCH = 32


class CostlyReads(torch.utils.data.Dataset):
    """``(x, y)`` samples that each take ``item_ms`` to read: spinning (holds the GIL) or sleeping."""

    def __init__(self, n: int, item_ms: float, read: str) -> None:
        self.n, self.item_s, self.spin = n, item_ms / 1000.0, read == "spin"
        self.x = torch.randn(n, 64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.spin:
            end = time.perf_counter() + self.item_s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(self.item_s)
        return self.x[i].clone(), i % 10


def samples_per_s(workers: int, *, samples: int, item_ms: float, read: str, batch: int) -> float:
    """Samples per second over the second pass of one window per pass (the first starts the workers)."""
    dataset = CostlyReads(samples, item_ms, read)
    source = BatchSource(dataset, batch, seed=0)
    source.stage(TieredSamples(dataset.__getitem__, vram=None, ram=None, disk=None))
    if workers:
        source.read_with(WorkerReads(dataset, workers=workers, prefetch_factor=None, seed=0), pin=False)
    try:
        for epoch in (0, 1):
            start = time.perf_counter()
            made = source.loaded_batches([[epoch, 0, samples]]) if workers else source.window_batches([[epoch, 0, samples]])
            prefetch = Prefetcher(made, depth=4)
            got = sum(len(picks) for _, picks, _ in prefetch)
            prefetch.close()
            assert got == samples, f"{got} of {samples} samples"
        return samples / (time.perf_counter() - start)
    finally:
        if source.workers is not None:
            source.workers.close()


def main() -> None:
    parser = size_parser(__doc__, "1024 samples a pass", "128 samples of 0.1 ms, spin only")
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each worker count per read kind")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values to compare (the first is the baseline)")
    args = parser.parse_args()
    samples, item_ms = (128, 0.1) if args.smoke else (1024, 1.0) if args.quick else (2048, 1.0)
    rows: list[Row] = []
    for read in ("spin",) if args.smoke else ("spin", "sleep"):
        # alternating pairs, medians: the load on a shared machine drifts between cases
        runs: dict[int, list[float]] = {w: [] for w in args.workers}
        for _ in range(1 if args.smoke else args.pairs):
            for workers in args.workers:
                runs[workers].append(samples_per_s(workers, samples=samples, item_ms=item_ms, read=read, batch=BATCH))
        base = runs[args.workers[0]]
        for workers, rates in runs.items():
            rows.append(Row(f"{read} reads, {workers} workers", "samples/s (median)", statistics.median(rates), "samples/s"))
            if workers != args.workers[0]:
                ratios = [rate / first for rate, first in zip(rates, base, strict=True)]
                rows.append(Row(f"{read} reads, {workers} workers", f"vs {args.workers[0]}, median pair", statistics.median(ratios), "x"))
                rows.append(Row(f"{read} reads, {workers} workers", "lowest pair", min(ratios), "x"))
                rows.append(Row(f"{read} reads, {workers} workers", "highest pair", max(ratios), "x"))
    report(
        "loader",
        rows,
        note=f"{samples} samples a pass, {item_ms:g} ms per read (spin: CPU-bound, holds the GIL; sleep: I/O-like), "
        f"batch {BATCH}, staging tiers off; the second pass of each run, {args.pairs} alternating pairs; load average {os.getloadavg()[0]:.1f} at the end",
        results=smoke_results() if args.smoke else None,
    )


if __name__ == "__main__":
    main()
