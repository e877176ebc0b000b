"""The README's main job as a plain torchrun + DistributedDataParallel script (gloo).

The start-up benchmark (``bench/startup.py``) times it against flodl's
``python -m flodl.controller --task examples/digits.py:task --nproc-per-node 2
--epochs 5``: the same data, model, optimizer, batch size per rank and
epochs, written as one writes DDP by hand (a ``DistributedSampler``, an eval
of the test split on rank 0 after each epoch, as flodl's eval rank does).
Each rank prints ``FIRST_BATCH <unix time>`` once its first optimizer step is
done, and rank 0 ``FINAL <accuracy>`` at the end.

    python -m torch.distributed.run --nproc-per-node 2 bench/startup_ddp.py [EPOCHS]
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]  # digits.py, and the flodl it imports its Task from
import digits  # noqa: E402  (the README job's task file: its data, model and optimizer)


def main() -> None:
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    x_train, y_train, _, _ = digits._splits()
    data = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(data, shuffle=True, seed=digits.SEED)
    loader = DataLoader(data, batch_size=digits.BATCH_SIZE, sampler=sampler)
    model = DistributedDataParallel(digits.build_model())
    optimizer = digits.build_optimizer(model)
    first = True
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if first:  # one write: the two ranks share the pipe, and print() writes the line and its end apart
                sys.stdout.write(f"FIRST_BATCH {time.time():.6f}\n")
                sys.stdout.flush()
                first = False
        if rank == 0:
            accuracy = digits.evaluate(model.module, torch.device("cpu"))
            print(f"epoch {epoch + 1}/{epochs} loss {loss.item():.4f} accuracy {accuracy:.4f}", flush=True)
    if rank == 0:
        print(f"FINAL {accuracy:.4f}", flush=True)
    dist.barrier()  # rank 1 tearing gloo down while rank 0 still evaluates aborts it (SIGABRT), now and then
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
