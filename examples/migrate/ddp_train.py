"""A torchrun DDP training script, as one writes it: the starting point of docs/migrating.md.

    python -m torch.distributed.run --nproc-per-node 2 examples/migrate/ddp_train.py --epochs 10

The digits CNN of examples/digits.py, AdamW with a cosine schedule, bf16 autocast
on CUDA, gradient accumulation over 2 batches, an eval at the end, and
save/resume of the model, optimizer and scheduler (--save / --resume).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from digits import _splits, build_model, evaluate

ACCUM = 2  # batches per optimizer step


def main() -> None:
    parser = argparse.ArgumentParser(description="digits CNN, DDP")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--save", help="write model, optimizer and scheduler here at the end")
    parser.add_argument("--resume", help="continue from a --save file")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    x_train, y_train, _, _ = _splits()
    dataset = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DDP(build_model().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader) // ACCUM)
    start = 0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["epoch"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(loader):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(x.to(device)), y.to(device)) / ACCUM
            loss.backward()
            if (i + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss.item() * ACCUM:.4f}, lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

    if rank == 0:
        print(f"eval accuracy {evaluate(model.module, device):.4f}", flush=True)
        if args.save:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": args.epochs}
            torch.save({**state, "scheduler": scheduler.state_dict()}, args.save)
    dist.barrier()  # the ranks leave together (one leaving while rank 0 saves can abort in torch's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
