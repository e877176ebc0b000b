"""A script that records what its loop sees of the epochs (tests/test_epoch_events.py).

Each rank writes rank<R>.json to FLODL_TEST_OUT: the epochs ``run.epochs()`` yielded, the batches and samples
it trained in each, the LR a per-epoch scheduler (``StepLR``, stepped once per epoch, as a torchrun
script does) left it at, its own ``--epochs`` (argparse, as a torchrun script takes it) and ``run.num_epochs``.
FLODL_TEST_SAMPLES sets the dataset's size (default 256).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import flodl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    run = flodl.init()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(os.environ.get("FLODL_TEST_SAMPLES", "256")), 8, generator=g)
    y = (x.sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer, torch.utils.data.TensorDataset(x, y), batch_size=16)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
    seen, batches, samples = [], {}, {}
    for epoch in run.epochs():
        seen.append(epoch)
        batches[epoch] = samples[epoch] = 0
        for xb, yb in run.batches():
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
            batches[epoch] += 1
            samples[epoch] += len(xb)
        scheduler.step()
        run.report(epoch_seen=epoch)
    with open(os.path.join(os.environ["FLODL_TEST_OUT"], f"rank{run.rank}.json"), "w") as f:
        lr = optimizer.param_groups[0]["lr"]
        json.dump({"seen": seen, "batches": batches, "samples": samples, "lr": lr, "epochs": args.epochs, "num_epochs": run.num_epochs}, f)


if __name__ == "__main__":
    main()
