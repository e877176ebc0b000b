"""The matrix's flodl tasks, one factory per model, and the same pieces for the torchrun script.

    python -m flodl.controller --task bench.matrix.tasks:lenet --nproc-per-node 2 --epochs 2

``SPECS`` names each model's data, optimizer, batch size and eval; ``task(name)``
builds the ``flodl.Task`` and ``bench/matrix/ddp.py`` builds the very same model
(same seed), data, optimizer, loss and eval for torchrun + DDP.

FLODL_MATRIX_SAMPLES  training samples (the first N of the model's training set;
                      default: the model's full-budget size, ``Spec.samples``)
FLODL_MATRIX_SEED     the seed of the initial weights (default 0; the suite's ``--seeds N``
                      runs seeds 0..N-1, and passes the same number as the shuffle seed)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from flodl import Task

from . import data, models

SEED = 0  # the default run seed
SAMPLES_ENV = "FLODL_MATRIX_SAMPLES"
SEED_ENV = "FLODL_MATRIX_SEED"


def sgd(model: nn.Module, lr: float, wd: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)


def adam(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


def _sgd(lr: float, wd: float = 0.0) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return functools.partial(sgd, lr=lr, wd=wd)


def _adam(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return functools.partial(adam, lr=lr)


@dataclass(frozen=True)
class Spec:
    """One model of the matrix and everything it trains on."""

    name: str
    title: str
    data: str  # "digits" | "text" | "images"
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: int
    samples: int  # full-budget training samples (capped by what the data set has)
    eval_samples: int = 0  # held-out samples for "images" (digits and text have fixed splits)
    metric: str = "accuracy"

    @property
    def lm(self) -> bool:
        return self.data == "text"


SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("logreg", "logistic regression (digits)", "digits", models.logreg, _sgd(0.1), 32, 1500),
        Spec("mlp", "MLP 64-256-256-10 (digits)", "digits", models.mlp, _sgd(0.05), 32, 1500),
        Spec("lenet", "LeNet-5 (synthetic 32x32 gratings)", "images", models.lenet, _adam(2e-3), 32, 8192, eval_samples=2000),
        Spec("char_gru", "char-RNN GRU-128 (stdlib source)", "text", models.char_gru, _adam(3e-3), 32, 4096, metric="char_accuracy"),
        Spec("char_lstm", "char-RNN LSTM-128 (stdlib source)", "text", models.char_lstm, _adam(3e-3), 32, 4096, metric="char_accuracy"),
        Spec("gpt_nano", "GPT-nano 2x64, 4 heads (stdlib source)", "text", models.gpt_nano, _adam(3e-3), 32, 4096, metric="char_accuracy"),
        Spec("resnet20", "ResNet-20 (synthetic 32x32 gratings)", "images", models.resnet20, _sgd(0.05, 5e-4), 32, 4096, eval_samples=1000),
    )
}


def samples_for(spec: Spec) -> int:
    return int(os.environ.get(SAMPLES_ENV, spec.samples))


def run_seed() -> int:
    """This run's seed (``FLODL_MATRIX_SEED``, default ``SEED``)."""
    return int(os.environ.get(SEED_ENV, SEED))


def train_data(spec: Spec, samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``samples`` training pairs (all of them if the set is smaller)."""
    n = samples_for(spec) if samples is None else samples
    if spec.data == "digits":
        x, y, _, _ = data.digits()
    elif spec.data == "text":
        x, y, _, _ = data.text()
    else:
        x, y = data.images(max(n, 1), seed=1)
    return x[:n], y[:n]


def eval_data(spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.data == "digits":
        _, _, x, y = data.digits()
        return x, y
    if spec.data == "text":
        _, _, x, y = data.text()
        return x, y
    return data.images(spec.eval_samples, seed=2)


def flush_denormals() -> None:
    """Treat subnormal floats as zero in this process (x86's FTZ/DAZ), as every matrix process does.

    Why: a model trained far past convergence (the MLP's loss ends near 1e-5) drives parts of its
    gradients and momentum buffers below 1.2e-38, where the CPU takes each operation in microcode:
    an in-place multiply-add over 85,000 such floats took 730 us instead of 16 here. Which steps
    hit them depends on the run's trajectory, so the same model stepped 0.53 ms alone and
    0.64-0.67 ms as a pair's fast rank (the 4:1 pair then measured 3.3:1, and the ideal moved with
    it); flushed, 0.45 and 0.46 ms. The DDP script builds its model here too: every case, flodl's
    and torchrun's, runs with it. Values that small carry nothing a model can use."""
    torch.set_flush_denormal(True)


def make_model(spec: Spec, seed: int | None = None) -> nn.Module:
    """The model with the same initial weights in every process of a run (seeded ``seed``, default ``run_seed()``),
    in a process that flushes subnormal floats (``flush_denormals``)."""
    flush_denormals()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run_seed() if seed is None else seed)
        return spec.build()


def loss_fn(spec: Spec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return sequence_cross_entropy if spec.lm else F.cross_entropy


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def evaluate(spec: Spec, model: nn.Module, device: torch.device) -> float:
    """Held-out accuracy (per character for the language models), in [0, 1]."""
    x, y = eval_data(spec)
    was_training = model.training
    model.eval()
    right = 0
    try:
        with torch.no_grad():
            for i in range(0, len(x), 250):
                right += (model(x[i : i + 250].to(device)).argmax(-1).cpu() == y[i : i + 250]).sum().item()
    finally:
        model.train(was_training)
    return right / y.numel()


def task(name: str) -> Task:
    spec = SPECS[name]
    x, y = train_data(spec)
    return Task(
        model=functools.partial(make_model, spec),
        optimizer=spec.optimizer,
        dataset=TensorDataset(x, y),
        batch_size=spec.batch,
        loss_fn=loss_fn(spec),
        eval_fn=functools.partial(evaluate, spec),
        eval_metric=spec.metric,
    )


# one importable factory per model: --task bench.matrix.tasks:<name>
def logreg() -> Task:
    return task("logreg")


def mlp() -> Task:
    return task("mlp")


def lenet() -> Task:
    return task("lenet")


def char_gru() -> Task:
    return task("char_gru")


def char_lstm() -> Task:
    return task("char_lstm")


def gpt_nano() -> Task:
    return task("gpt_nano")


def resnet20() -> Task:
    return task("resnet20")
