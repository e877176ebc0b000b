"""A script whose ranks print many lines in pieces at the same time (tests/test_rank_output.py)."""

import os
import sys

import torch

import flodl


def main():
    run = flodl.init()
    x = torch.randn(64, 4)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=16)
    for i in range(200):  # a line written in three pieces, on both streams
        print(f"DIST{run.rank}", end="", flush=True)
        print(f" line {i}", end="", flush=True)
        print(" end", flush=True)
        sys.stderr.write(f"ERR{run.rank} {i}\n")
    os.write(1, f"RAW{run.rank}\n".encode())  # below Python: a C library's print
    for _ in run.epochs():
        for xb, yb in run.batches():
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            run.step(loss)


if __name__ == "__main__":
    main()
