"""Benchmark task: a 10-class Gaussian mixture an MLP can learn, with a held-out split.

FLODL_BENCH_SAMPLES  training samples (default 16000)
FLODL_BENCH_WIDTH    hidden width (default 768: about 2.7 ms a step on one core of the dev VM)
FLODL_BENCH_SEED     seed of the initial weights (default 0; the data and the held-out split stay fixed)

Deterministic everywhere: every rank (and the solo baseline) builds the same data.
"""

import os

import torch
import torch.nn.functional as F

from flodl import Task

DIM, CLASSES, BATCH = 32, 10, 32


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)  # the mixture itself is fixed
    centers = torch.randn(CLASSES, DIM, generator=g) * 0.45
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centers[y] + torch.randn(n, DIM, generator=g)
    return x, y


def make_model() -> torch.nn.Module:
    w = int(os.environ.get("FLODL_BENCH_WIDTH", "768"))
    torch.manual_seed(int(os.environ.get("FLODL_BENCH_SEED", "0")))  # the same initial weights in every run of a seed
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, CLASSES)
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


_TEST = None


def accuracy(model: torch.nn.Module, device: torch.device) -> float:
    global _TEST
    if _TEST is None:
        _TEST = _data(16000, seed=2)  # large enough that sampling noise is ~0.35 points
    x, y = _TEST
    return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


def task() -> Task:
    x, y = _data(int(os.environ.get("FLODL_BENCH_SAMPLES", "16000")), seed=1)
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_metric="accuracy",
    )
