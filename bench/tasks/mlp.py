"""Benchmark task: an MLP on synthetic data whose step time is set by its width.

FLODL_BENCH_WIDTH    hidden width (default 1024); the step time grows with it
FLODL_BENCH_SAMPLES  dataset size (default 16384)
"""

import os

import torch
import torch.nn.functional as F

from flodl import Task

IN, OUT, BATCH = 256, 10, 64


def width() -> int:
    return int(os.environ.get("FLODL_BENCH_WIDTH", "1024"))


def make_model() -> torch.nn.Module:
    w = width()
    return torch.nn.Sequential(torch.nn.Linear(IN, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, OUT))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_data() -> torch.utils.data.TensorDataset:
    n = int(os.environ.get("FLODL_BENCH_SAMPLES", "16384"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, IN, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :OUT].argmax(1)))


def task() -> Task:
    return Task(model=make_model, optimizer=make_optimizer, dataset=make_data(), batch_size=BATCH, loss_fn=F.cross_entropy)
