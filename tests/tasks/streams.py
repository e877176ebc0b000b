"""A task and a script that record the random numbers each rank draws (tests/test_streams.py).

Both build their data and model with the global generators, unseeded on purpose (the build phase
seeds them alike on every rank), and draw from every generator at the start of training (each rank
its own stream). Steered by environment variables:

FLODL_TEST_OUT        a directory: each rank writes rank<R>.json there: its draws ("build": in the
                      build phase, script mode only; "train": at the first batch, or after
                      run.prepare() returns), its first dropout mask and its dataset's sum
FLODL_TEST_DATA_RANK  "1": the dataset is drawn from a generator seeded with the rank's number (every
                      rank its own samples, as many: refused at the start)
FLODL_TEST_HOLD_FILE  while this file does not exist, a Task's steps sleep 50 ms (a run long enough for a
                      restarted rank to join)

Run as a script (``--script``) it trains in script mode; ``task`` is the Task.
"""

import json
import os
import random
import time

import numpy
import torch
import torch.nn.functional as F

import flodl

SAMPLES = 256


def draws() -> dict:
    """Four numbers from each global generator."""
    return {"torch": torch.rand(4).tolist(), "numpy": numpy.random.rand(4).tolist(), "random": [random.random() for _ in range(4)]}


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from all three global generators (or, with FLODL_TEST_DATA_RANK, from the rank's number)."""
    if os.environ.get("FLODL_TEST_DATA_RANK"):
        x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(int(os.environ["FLODL_RANK"])))
    else:
        x = torch.randn(SAMPLES, 8) + torch.from_numpy(numpy.random.randn(SAMPLES, 8)).float() + random.random()
    return x, (x.sum(1) > 0).long()


class Recorded(torch.nn.Module):
    """An MLP with dropout that keeps its first training forward's mask."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 2)
        self.mask: list[bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        dropped = F.dropout(torch.ones_like(hidden), 0.5, self.training)
        if self.training and self.mask is None:
            self.mask = (dropped[0] == 0).tolist()
        return self.head(hidden * dropped)


_RECORD: dict = {}


def write(rank: int) -> None:
    out = os.environ.get("FLODL_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(_RECORD, f)


def train_step(model, batch, device):
    if "train" not in _RECORD:
        _RECORD["train"] = draws()  # the first batch: before the forward draws its dropout
    held = os.environ.get("FLODL_TEST_HOLD_FILE")
    if held and not os.path.exists(held):
        time.sleep(0.05)
    x, y = batch
    loss = F.cross_entropy(model(x.to(device)), y.to(device))
    if "mask" not in _RECORD:
        _RECORD["mask"] = model.mask
        write(int(os.environ["FLODL_RANK"]))
    return loss


def task() -> flodl.Task:
    x, y = make_data()
    _RECORD["data"] = float(x.double().sum())
    return flodl.Task(
        model=Recorded,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=16,
        train_step=train_step,
    )


def main() -> None:
    run = flodl.init()
    _RECORD["build"] = draws()
    x, y = make_data()
    _RECORD["data"] = float(x.double().sum())
    model = Recorded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer, torch.utils.data.TensorDataset(x, y), batch_size=16)
    _RECORD["train"] = draws()
    for _ in run.epochs():
        for xb, yb in run.batches():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            run.step(loss)
    _RECORD["mask"] = model.mask
    write(run.rank)


if __name__ == "__main__":
    main()
