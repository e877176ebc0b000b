"""Benchmark task: an MLP on synthetic data whose step time is set by its width.

FLODL_BENCH_WIDTH    hidden width (default 1024); the step time grows with it
FLODL_BENCH_SAMPLES  dataset size (default 16384)

``task`` trains only; ``task_with_eval`` also scores accuracy on 4096 held-out samples of the
same problem (the label is the largest of the first ten inputs), for time-to-target benches.
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


def make_data(n: int | None = None, seed: int = 0) -> torch.utils.data.TensorDataset:
    n = int(os.environ.get("FLODL_BENCH_SAMPLES", "16384")) if n is None else n
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :OUT].argmax(1)))


_HELD_OUT: dict[str, torch.Tensor] = {}


def evaluate(model: torch.nn.Module, device: torch.device) -> float:
    """Accuracy on 4096 held-out samples (another seed of the same problem)."""
    if "x" not in _HELD_OUT:
        x, y = make_data(4096, seed=1).tensors
        _HELD_OUT.update(x=x.to(device), y=y.to(device))
    return (model(_HELD_OUT["x"]).argmax(1) == _HELD_OUT["y"]).float().mean().item()


def task() -> Task:
    return Task(model=make_model, optimizer=make_optimizer, dataset=make_data(), batch_size=BATCH, loss_fn=F.cross_entropy)


def task_with_eval() -> Task:
    t = task()
    t.eval_fn, t.eval_metric = evaluate, "accuracy"
    return t
