"""A rank's build, before its hello: the task, the model, and the hello that describes them.

Every rank builds alike (the build phase's RNGs: determinism.py), so the
controller can hold each hello against rank 0's: the model's signature, the
dataset's length and digest, the shuffle signature, the versions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from typing import TYPE_CHECKING

import torch
from torch.utils.data import TensorDataset

from .. import __version__
from ..config.env import nccl_errors_raise, omp_threads_set
from ..errors import TaskError
from ..host.cores import format_cores, parse_cores
from ..plan.schedule import shuffle_signature
from ..shards import Shards
from ..task import Task
from ..wire import messages as m
from ..wire.messages import PROTOCOL_VERSION
from ..wire.transport import host_name
from .dataset_digest import dataset_digest
from .outcomes import UserError
from .update import check_precision

if TYPE_CHECKING:
    from .context import RankContext

#: Intra-op threads of a GPU rank: its CPU work is batch gathers and small host ops.
ACCELERATOR_THREADS = 4

log = logging.getLogger("flodl.rank.runner")


def model_signature(model: torch.nn.Module) -> str:
    """Hash of parameter and buffer names, shapes and dtypes (not values)."""
    h = hashlib.sha256()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    return {
        "flodl": __version__,
        "protocol": str(PROTOCOL_VERSION),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
    }


def cpu_threads(cores: int, local_world: int, *, staged: bool, accelerator: bool = False) -> int:
    """Intra-op threads of a rank: its share of the host's cores (a few, for a GPU rank).

    Co-hosted ranks share the cores instead of each grabbing all of them (an
    explicit OMP_NUM_THREADS wins). A rank whose data goes through the staging
    tiers also runs the prefetcher, the parallel readers and the cache warmer:
    it leaves them a core or two, because an OpenMP team that loses a core to
    them waits at every barrier for the descheduled thread (measured on 16
    cores: a warm epoch 15x slower with all 16 threads busy). A GPU rank's host
    work is a batch gather and a few small ops, which an OpenMP team of every
    core only slows down (measured on the H200 host: with 16 threads the gather
    of an in-memory batch took a third of a 1.6 ms step): it takes at most
    ``ACCELERATOR_THREADS``.
    """
    share = max(1, cores // max(1, local_world))
    if accelerator:
        return min(share, ACCELERATOR_THREADS)
    if staged:
        share -= 2 if share >= 8 else 1 if share >= 4 else 0
    return max(1, share)


def build(ctx: RankContext) -> tuple[Task, torch.nn.Module, m.RankHello]:
    """The task (by the seams: imported, or made of what a script prepared), its model on the
    device, and the hello that says them.

    Raises:
        UserError: the task is unusable as written (a spec that names nothing, an empty dataset;
            stage ``task spec``).
    """
    ctx.seams.enter_build_phase(ctx.env)  # before CUDA, and before the task draws any random number
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a collective NCCL gives up on must raise in this rank, not kill it: the
        # survivors of a dead peer rebuild their group and go on (2 = clean up only)
        nccl_errors_raise()
    try:  # a spec that names nothing, or a task whose dataset is unusable (empty): the user's, exit 2
        task = ctx.seams.load_task(ctx.env)
        dataset = task.build_dataset()
        check_precision(task.precision, device)
    except TaskError as exc:
        raise UserError("task spec", exc) from exc
    cores = pin_cores(ctx.env.cpu_set, ctx.rank)
    if not omp_threads_set():
        staged = not isinstance(dataset, TensorDataset)
        if cores:  # this rank's own cores (host/cores.py): every one of them, a GPU rank at most its few
            threads = min(len(cores), ACCELERATOR_THREADS) if device.type != "cpu" else len(cores)
        else:
            threads = cpu_threads(os.cpu_count() or 1, ctx.env.local_world, staged=staged, accelerator=device.type != "cpu")
        torch.set_num_threads(threads)
    model = task.model().to(device)
    hello = m.RankHello(
        rank=ctx.rank,
        host=host_name(),
        pid=os.getpid(),
        device=str(device),
        versions=versions(),
        model_signature=model_signature(model),
        param_count=sum(p.numel() for p in model.parameters()),
        shuffle_signature=shuffle_signature(),
        dataset_len=len(dataset),
        dataset_digest=dataset_digest(dataset),  # its reads leave the RNGs as they were
        has_eval=task.eval_fn is not None,
        eval_metric=task.eval_metric,
        batch_size=task.batch_size,
        grain="shard" if isinstance(dataset, Shards) else "sample",
        accumulate_grad_batches=task.accumulate_grad_batches,
        cores=format_cores(cores),
    )
    return task, model, ctx.seams.hello(hello)


def pin_cores(cpu_set: str, rank: int) -> list[int]:
    """Pin this process to ``cpu_set`` (the worker's layout, host/cores.py); the cores it runs on, or
    [] when it is not pinned (none given, or the host refuses: it runs unpinned then, and says so)."""
    if not cpu_set or not hasattr(os, "sched_setaffinity"):
        return []
    try:
        cores = parse_cores(cpu_set)
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as exc:
        log.warning("rank %d: not pinned to cores %s (%s); sharing the host's cores", rank, cpu_set, exc)
        return []
    return cores
