"""Streaming shards: train on a list of files instead of an indexable dataset (docs/data.md).

    python -m flodl.controller --task examples/shards.py:task --nproc-per-node 2 --epochs 3

``task()`` writes 16 shard files of unequal sizes (a few hundred samples each)
to ``$FLODL_EXAMPLE_SHARDS`` (default: a folder in the system temp dir) the
first time, then hands flodl their paths as a ``flodl.Shards``. The controller
grants shards, not sample indices: each rank opens the shards it is granted with
``open_shard``, streams their samples into batches of 64 and trains. Every shard
is trained once per epoch, whatever ranks die or join, and a resumed run trains
the shards its bundle had not.
"""

import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from flodl import Shards, Task

SHARDS = 16


def shard_folder() -> Path:
    return Path(os.environ.get("FLODL_EXAMPLE_SHARDS", Path(tempfile.gettempdir()) / "flodl-example-shards"))


def make_samples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-class problem: the class is how many of the first two features are positive."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def write_shards(folder: Path) -> list[str]:
    """The shard files, written once. Every rank may call this at the same time: each file's
    bytes depend only on its number, and it appears whole (written aside, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(SHARDS):
        path = folder / f"train-{i:03d}.pt"
        if not path.exists():
            x, y = make_samples(200 + 37 * i % 150, seed=100 + i)
            aside = folder / f".train-{i:03d}.{os.getpid()}.pt"
            torch.save({"x": x, "y": y}, aside)
            os.replace(aside, path)
        paths.append(str(path))
    return paths


def open_shard(path: str):
    """One shard's samples, read when the rank gets to it."""
    data = torch.load(path)
    yield from zip(data["x"], data["y"], strict=True)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def accuracy(model: torch.nn.Module, device: torch.device) -> float:
    x, y = make_samples(1024, seed=1)  # a held-out draw
    with torch.no_grad():
        return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


def task() -> Task:
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=Shards(write_shards(shard_folder()), open_shard=open_shard),
        batch_size=64,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_metric="accuracy",
    )
