"""examples/migrate/ddp_train.py as a flodl ``Task`` (docs/migrating.md compares the three).

    python -m flodl.controller --task examples/migrate/flodl_task.py:task --nproc-per-node 2 --epochs 10 --lr-scale-ratio 0

The loop is flodl's: the task names the model, optimizer, data and loss, and the
features the script writes by hand are fields (docs/task.md): the cosine schedule
(``scheduler``, stepped on the run's global optimizer step and saved in the
bundle), gradient accumulation (``accumulate_grad_batches``: an average never
falls inside one) and bf16 autocast (``precision``). Save and resume are
``--save-path`` / ``--resume-from``; the eval runs on one rank after each epoch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from digits import _splits, build_model, evaluate

from flodl import Task

EPOCHS = 10  # the cosine spans this many epochs: train with --epochs 10
LR = 1e-2
BATCH_SIZE = 32  # per rank
ACCUM = 2


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def cosine(optimizer: torch.optim.Optimizer) -> CosineAnnealingLR:
    """Over the run's global optimizer steps (all ranks together), as a single process would count them."""
    steps_per_epoch = -(-len(_splits()[0]) // BATCH_SIZE) // ACCUM
    return CosineAnnealingLR(optimizer, T_max=EPOCHS * steps_per_epoch)


def task() -> Task:
    x_train, y_train, _, _ = _splits()
    return Task(
        model=build_model,
        optimizer=make_optimizer,
        dataset=TensorDataset(x_train, y_train),
        batch_size=BATCH_SIZE,
        loss_fn=F.cross_entropy,
        eval_fn=evaluate,
        eval_metric="accuracy",
        scheduler=cosine,
        accumulate_grad_batches=ACCUM,
        precision="bf16-mixed" if torch.cuda.is_available() else "32",
    )
