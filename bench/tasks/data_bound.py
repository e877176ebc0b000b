"""Benchmark task: a dataset whose ``__getitem__`` costs about a millisecond.

Like a sample read from a file and decoded: the staging tiers' case. The
model is the bench MLP, so a warm epoch is compute-bound.

FLODL_BENCH_ITEM_MS   cost of one ``__getitem__`` in ms (default 1.0)
FLODL_BENCH_SAMPLES   dataset size (default 4096)
FLODL_BENCH_WIDTH     the MLP's hidden width (default 512)
"""

import os
import time

import torch
import torch.nn.functional as F

from flodl import Task

from .mlp import BATCH, IN, OUT, make_model, make_optimizer


class SlowReads(torch.utils.data.Dataset):
    """Synthetic samples behind a fixed per-read cost (sleep: I/O releases the GIL)."""

    def __init__(self) -> None:
        n = int(os.environ.get("FLODL_BENCH_SAMPLES", "4096"))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, IN, generator=g)
        self.y = self.x[:, :OUT].argmax(1)
        self.cost_s = float(os.environ.get("FLODL_BENCH_ITEM_MS", "1.0")) / 1000.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        time.sleep(self.cost_s)
        return self.x[i].clone(), self.y[i]


def task() -> Task:
    os.environ.setdefault("FLODL_BENCH_WIDTH", "512")
    return Task(model=make_model, optimizer=make_optimizer, dataset=SlowReads(), batch_size=BATCH, loss_fn=F.cross_entropy)
