"""examples/migrate/ddp_train.py ported to flodl's script mode (docs/migrating.md shows the diff).

    python -m flodl.controller --script examples/migrate/flodl_script.py --nproc-per-node 2 --lr-scale-ratio 0 -- --epochs 10

The run trains the script's own --epochs (flodl reads it after --: given once, as to torchrun).
Save and resume are flodl's (--save-path / --resume-from: the model, the optimizer, the
registered scheduler and exact coverage).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from digits import _splits, build_model, evaluate

import flodl

ACCUM = 2  # batches per optimizer step


def main() -> None:
    parser = argparse.ArgumentParser(description="digits CNN, DDP")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    run = flodl.init()
    rank, device = run.rank, run.device
    x_train, y_train, _, _ = _splits()
    dataset = TensorDataset(x_train, y_train)
    model = build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = run.prepare(model, optimizer, dataset, batch_size=args.batch_size)
    steps_per_epoch = -(-len(dataset) // (args.batch_size * run.world_size))  # len(loader) of one rank
    scheduler = CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch // ACCUM)
    run.register_state("scheduler", scheduler)  # in the bundle; a resumed run continues the cosine

    for epoch in run.epochs():
        model.train()
        for i, (x, y) in enumerate(run.batches()):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(x.to(device)), y.to(device)) / ACCUM
            loss.backward()
            if (i + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
            run.step(loss, optimizer_stepped=(i + 1) % ACCUM == 0)  # no average inside an accumulation
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss.item() * ACCUM:.4f}, lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

    if rank == 0:
        print(f"eval accuracy {evaluate(model, device):.4f}", flush=True)


if __name__ == "__main__":
    main()
