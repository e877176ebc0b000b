"""The fault benchmark's workload under torchrun + DistributedDataParallel (gloo).

The usual elastic pattern: a checkpoint at every epoch end, and on a restart
every worker loads it and starts that epoch over. Each batch is logged to
``FAULTS_EVENTS`` (JSONL: wall time, rank, restart count, epoch, step) so the
benchmark can tell when training stopped, when it ran again, and which work
was thrown away.

    torchrun --nproc-per-node 3 --max-restarts 3 bench/tasks/faults_ddp.py EPOCHS
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.tasks.faults import BATCH, data, make_model, make_optimizer, step_sleep


def main() -> None:
    epochs = int(sys.argv[1])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # a key prefix per restart: with plain init_process_group("gloo") the restarted
    # world reads the dead world's addresses from the agent's store and never connects
    # (pytorch/pytorch#167288); this gives torchrun its best chance
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart{restart}", store), rank=rank, world_size=world)
    ckpt = os.environ["FAULTS_CKPT"]
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(model)
    start_epoch = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start_epoch = state["epoch"]
    x, y = data()
    events = open(os.environ["FAULTS_EVENTS"], "a", buffering=1)
    for epoch in range(start_epoch, epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        mine = perm[rank::world]
        for step in range(len(mine) // BATCH):
            idx = mine[step * BATCH : (step + 1) * BATCH]
            time.sleep(step_sleep())
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            events.write(
                json.dumps({"t": time.time(), "rank": rank, "restart": restart, "epoch": epoch, "step": step, "samples": len(idx)}) + "\n"
            )
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "epoch": epoch + 1}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
