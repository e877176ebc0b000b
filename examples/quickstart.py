"""The smallest flodl task: a 3-class problem on synthetic data.

    python -m flodl.controller --task examples/quickstart.py:task --nproc-per-node 2 --epochs 3

Every rank calls ``task()`` itself, so everything that must agree across ranks
(the dataset) is built deterministically; the model's initial weights need not
be: flodl copies rank 0's to every rank before training.
"""

import torch
import torch.nn.functional as F

from flodl import Task


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def accuracy(model: torch.nn.Module, device: torch.device) -> float:
    x, y = make_data(1024, seed=1)  # a held-out draw
    return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


def task() -> Task:
    x, y = make_data(4096, seed=0)
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=64,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_metric="accuracy",
    )
