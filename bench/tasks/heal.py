"""The healing benchmark's workload (bench/heal.py): an MLP of about 100 MB of parameters, Adam.

``FLODL_BENCH_HEAL_WIDTH`` sets the hidden width (4096 by default: 2048 -> 4096 -> 4096 -> 2,
25.2 M float32 parameters, 100.7 MB; Adam's state twice that). Until the file
``FLODL_BENCH_HEAL_RELEASE`` exists every step trains the whole model; once it exists
(the benchmark saw the healed rank take its state) a step trains the last layer's bias
alone, whose gradient is the only one (Adam skips parameters without one), so the run
ends soon without the benchmark waiting out its epochs.
"""

import os

import torch
import torch.nn.functional as F

from flodl import Task

INPUT = 2048
SAMPLES = 1024
BATCH = 8


def width() -> int:
    return int(os.environ.get("FLODL_BENCH_HEAL_WIDTH", "4096"))


def make_model():
    torch.manual_seed(0)
    w = width()
    return torch.nn.Sequential(torch.nn.Linear(INPUT, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 2))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model, batch, device):
    release = os.environ.get("FLODL_BENCH_HEAL_RELEASE")
    if release and os.path.exists(release):
        return (model[-1].bias ** 2).sum()  # released: a cheap step, so the run ends soon
    x, y = batch
    return F.cross_entropy(model(x.to(device)), y.to(device))


def task():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, INPUT, generator=g)
    y = (x[:, : INPUT // 2].sum(1) > x[:, INPUT // 2 :].sum(1)).long()
    data = torch.utils.data.TensorDataset(x, y)
    return Task(model=make_model, optimizer=make_optimizer, dataset=data, batch_size=BATCH, train_step=train_step)  # no eval: timing only
