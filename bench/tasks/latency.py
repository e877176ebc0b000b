"""The network benchmark's workload: a fixed step time and a model too small to need bandwidth.

``bench/tasks/faults.py``'s MLP (1,218 parameters) and step, batch 16, every
step sleeping ``FLODL_BENCH_STEP_SLEEP`` seconds in place of compute, on
``FLODL_BENCH_SAMPLES`` generated samples (default 9600: 200 batches per rank
per epoch on three ranks). What the network costs a run of it is latency:
an average moves under 5 KB.
"""

import os

import torch

from bench.tasks.faults import BATCH, data, evaluate, make_model, make_optimizer, train_step
from flodl import Task


def samples() -> int:
    return int(os.environ.get("FLODL_BENCH_SAMPLES", "9600"))


def task():
    x, y = data(samples(), 0)
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        train_step=train_step,
        eval_fn=evaluate,
        eval_metric="accuracy",
    )
