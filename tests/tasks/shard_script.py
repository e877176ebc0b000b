"""A script-mode loop over streamed shards (flodl.Shards) for tests/test_shards.py; the shards and
records are tests/tasks/shards.py's (FLODL_TEST_SHARDS, FLODL_TEST_OUT, FLODL_TEST_BAD)."""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import flodl

sys.path.insert(0, os.path.dirname(__file__))
from shards import open_shard


def main():
    run = flodl.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    files = sorted(str(p) for p in Path(os.environ["FLODL_TEST_SHARDS"]).glob("shard-*.pt"))
    data = flodl.Shards([] if os.environ.get("FLODL_TEST_BAD") == "empty" else files, open_shard=open_shard)
    model, optimizer = run.prepare(model, optimizer, data, batch_size=8)
    out = os.environ["FLODL_TEST_OUT"]
    for epoch in run.epochs():
        for x, y, shard, sample in run.batches():
            with open(os.path.join(out, f"seen-{os.getpid()}.txt"), "a") as f:
                f.write("".join(f"{epoch} {int(s)} {int(k)}\n" for s, k in zip(shard, sample, strict=True)))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)


if __name__ == "__main__":
    main()
