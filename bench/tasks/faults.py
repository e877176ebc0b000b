"""The fault benchmark's workload, shared by the flodl run and the torchrun run.

A small MLP on a generated two-class problem, with a fixed sleep per step
(``FLODL_BENCH_STEP_SLEEP``, default 5 ms) so the runs last long enough to kill
a rank in the middle and every batch costs about the same on both runtimes.
"""

import os
import time

import torch
import torch.nn.functional as F

from flodl import Task

SAMPLES = 4096  # FLODL_BENCH_FAULTS_SAMPLES overrides it for the flodl run (bench/faults.py --smoke)
BATCH = 16


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def data(n=SAMPLES, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()


def step_sleep():
    return float(os.environ.get("FLODL_BENCH_STEP_SLEEP", "0.005"))


def train_step(model, batch, device):
    time.sleep(step_sleep())
    x, y = batch
    return F.cross_entropy(model(x.to(device)), y.to(device))


def evaluate(model, device):
    x, y = data(1024, 1)
    return (model(x).argmax(1) == y).float().mean().item()


def task():
    x, y = data(int(os.environ.get("FLODL_BENCH_FAULTS_SAMPLES", SAMPLES)))
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        train_step=train_step,
        eval_fn=evaluate,
        eval_metric="accuracy",
    )
