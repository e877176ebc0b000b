"""Script mode: your own training loop, run by flodl on every rank (docs/script-mode.md).

    python -m flodl.controller --script examples/script_mode.py --nproc-per-node 2 --epochs 2
    python -m flodl.controller --script examples/script_mode.py --epochs 3 -- --lr 0.001

The digits CNN of examples/digits.py, trained in an ordinary PyTorch loop: the
script builds its model, optimizer and data as it likes; five calls are flodl's
(``init``, ``prepare``, ``epochs``, ``batches``, ``step``) and one optional
(``report``). Every rank runs this file; flodl grants each its batches, averages
the replicas and survives a rank's death. Arguments after ``--`` are the script's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits import BATCH_SIZE, LEARNING_RATE, _splits, build_model, evaluate  # the neighbour file
from torch.utils.data import TensorDataset

import flodl


def main() -> None:
    parser = argparse.ArgumentParser(description="digits CNN, trained in script mode")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="Adam learning rate")
    args = parser.parse_args()

    run = flodl.init()  # this rank joins the run (outside one: a line on stderr, exit 2)
    x_train, y_train, _, _ = _splits()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # on run.device, rank 0's weights everywhere; the same objects come back
    model, optimizer = run.prepare(model, optimizer, TensorDataset(x_train, y_train), batch_size=BATCH_SIZE)

    for epoch in run.epochs():
        model.train()
        for x, y in run.batches():  # this rank's granted batches, on run.device
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
        accuracy = evaluate(model, run.device)  # this replica's, before the epoch's last average
        run.report(accuracy=accuracy)
        print(f"rank {run.rank}: epoch {epoch + 1} done, replica accuracy {accuracy:.3f} (world of {run.world_size})", flush=True)


if __name__ == "__main__":
    main()
