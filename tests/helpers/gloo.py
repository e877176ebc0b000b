"""Real gloo ranks for a test: ``world`` spawned processes around one TCPStore.

Each runs ``target(rank, world, port, *args, out)`` and puts one result, its rank first, on
``out``; the results come back in rank order. A rank still alive after its join is killed, so
a failing test leaves no process behind.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def gloo_ranks(target: Callable[..., None], world: int, *args: Any, result_timeout: float = 50, store_timeout: float = 20) -> list:
    """Start ``world`` ranks of ``target`` and return their results, sorted by rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=store_timeout))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, store.port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((out.get(timeout=result_timeout) for _ in procs), key=lambda got: got[0])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
