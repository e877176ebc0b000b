"""A task over streamed shards (flodl.Shards) for tests/test_shards.py, steered by environment variables:

FLODL_TEST_SHARDS       a directory of shard files (``write_shards``): one .pt file per shard
FLODL_TEST_OUT          a directory: each rank appends "epoch shard sample" per trained sample to
                        seen-<pid>.txt (flushed every step, so a killed rank's lines are kept)
FLODL_TEST_STEP_SLEEP   seconds to sleep in every training step
FLODL_TEST_BAD          "empty": no shards at all; "opener": open_shard returns a number
"""

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flodl import Shards, Task

_EPOCH = {"now": -1}


def shard_sizes(count: int) -> list[int]:
    """Unlike sizes, most not a multiple of the batch size (8): batches end at shard ends."""
    return [5 + (i * 7) % 13 for i in range(count)]


def write_shards(folder: Path, count: int) -> list[int]:
    """``count`` shard files of (x, y) samples; returns their sizes."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = shard_sizes(count)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(sizes):
        x = torch.randn(n, 8, generator=g)
        torch.save({"x": x, "y": (x.sum(1) > 0).long()}, folder / f"shard-{i:03d}.pt")
    return sizes


def open_shard(path):
    """A generator: nothing is read until the rank streams the shard."""
    data = torch.load(path)
    name = int(Path(path).stem.split("-")[1])
    for k, (x, y) in enumerate(zip(data["x"], data["y"], strict=True)):
        yield x, y, name, k


def _record(batch):
    out = os.environ.get("FLODL_TEST_OUT")
    if not out:
        return
    _, _, shard, sample = batch
    lines = "".join(f"{_EPOCH['now']} {int(s)} {int(k)}\n" for s, k in zip(shard, sample, strict=True))
    with open(os.path.join(out, f"seen-{os.getpid()}.txt"), "a") as f:
        f.write(lines)


def train_step(model, batch, device):
    _record(batch)
    time.sleep(float(os.environ.get("FLODL_TEST_STEP_SLEEP", "0") or 0))
    x, y = batch[0].to(device), batch[1].to(device)
    return F.cross_entropy(model(x), y)


def on_epoch(epoch, worker):
    _EPOCH["now"] = epoch


def task():
    bad = os.environ.get("FLODL_TEST_BAD", "")
    folder = Path(os.environ["FLODL_TEST_SHARDS"])
    files = sorted(str(p) for p in folder.glob("shard-*.pt"))
    opener = (lambda path: 42) if bad == "opener" else open_shard
    data = Shards([] if bad == "empty" else files, open_shard=opener)
    return Task(
        model=lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=data,
        batch_size=8,
        train_step=train_step,
        epoch_fn=on_epoch,
    )
