"""Loader-worker benchmark: a rank's data path over a dataset whose ``__getitem__`` costs ~1 ms,
read by the rank's own threads (``num_workers=0``) or by worker processes (``Task.num_workers``).

It drives the rank's data path in process, as a rank's window does (``BatchSource`` with the
staging tiers off, as ``--no-sample-cache`` leaves them, so every pass reads every sample; the
batches taken through the ``Prefetcher``), and reports samples per second over one pass, after
a first pass that starts the workers. No training, no controller: what is measured is how fast
batches can arrive. The read either spins (CPU-bound Python that holds the GIL: decoding,
augmentation, what workers are for) or sleeps (I/O, which the rank's 8 reader threads already
overlap).

    python -m bench.loader                      # 2048 samples of 1 ms (spin), batch 32, 0 vs 2 workers
    python -m bench.loader --read sleep         # the same with a read that sleeps
    python -m bench.loader --workers 0 1 2 4 --samples 4096
"""

from __future__ import annotations

import argparse
import time

import torch

from flodl.rank.data import BatchSource
from flodl.rank.loader import WorkerReads
from flodl.rank.prefetch import Prefetcher
from flodl.rank.staging import TieredSamples


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048, help="dataset size: samples per pass")
    parser.add_argument("--item-ms", type=float, default=1.0, help="milliseconds one __getitem__ takes")
    parser.add_argument("--read", choices=("spin", "sleep"), default="spin", help="spin: CPU-bound, holds the GIL; sleep: I/O-like")
    parser.add_argument("--batch", type=int, default=32, help="samples per batch")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values to compare")
    args = parser.parse_args(argv)
    rates = {w: samples_per_s(w, samples=args.samples, item_ms=args.item_ms, read=args.read, batch=args.batch) for w in args.workers}
    base = rates[args.workers[0]]
    for workers, rate in rates.items():
        print(
            f"num_workers={workers}: {rate:,.1f} samples/s ({rate / base:.3f}x), {args.item_ms:g} ms {args.read} reads, batch {args.batch}"
        )


if __name__ == "__main__":
    main()
