"""The averager a rank joins the run with: its backend's, set up from the welcome (regroup.py ``Group.join``).

CPU backend: a bulk link to this host's relay when the worker runs one, else to
the controller, and the ``CpuAverager`` over it. Collective backend: the run's
first process group, which a rank dying while it forms leaves unformed (the
survivors' Regroup then builds theirs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..wire.quant import codec
from .collective import Superseded, build_group
from .cpu_average import BulkLink, CpuAverager
from .flat import FlatModel
from .outcomes import is_collective_error

if TYPE_CHECKING:
    from ..config.deadlines import Deadlines
    from ..wire import messages as m
    from .context import JoinedRun, RankContext

log = logging.getLogger("flodl.rank.runner")


def cpu_averager(ctx: RankContext, run: JoinedRun, flat: FlatModel) -> CpuAverager:
    """The CPU backend's averager: snapshots go to this host's relay when the worker runs one,
    else to the controller. Its socket and shared-memory segment close with the rank."""
    welcome, deadlines = run.welcome, run.deadlines
    addr, probe, nonce = f"tcp://{welcome.store_host}:{welcome.bulk_port}", welcome.shm_probe, welcome.shm_nonce
    if ctx.env.relay_addr:
        addr, probe, nonce = [*ctx.env.relay_addr.split(" "), "", ""][:3]
    bulk = BulkLink(
        addr,
        rank=ctx.rank,
        secret=ctx.env.secret,
        run_id=ctx.env.run_id,
        sender=f"{ctx.link.sender}/bulk",
        send_timeout_s=deadlines.snapshot_wait_s,
        shm_probe=probe,
        shm_nonce=nonce,
    )
    ctx.closing.callback(bulk.close)
    cpu = CpuAverager(
        flat,
        bulk,
        rank=ctx.rank,
        alpha=run.config.elche.easgd_alpha or 1.0,
        timeout_s=deadlines.snapshot_wait_s,
        must_stop=ctx.must_stop,
        adopting=welcome.late,
        compression=codec(run.config.sync_compression),
    )
    ctx.closing.callback(cpu.close)  # its shared-memory segment's name
    if ctx.probes.armed("slice"):  # tests: a death halfway through a snapshot
        # ZeroMQ sends from its own I/O thread and has no flush: the slice is given a moment to leave
        cpu.first_slice_out = lambda: ctx.probes.reach("slice", before=lambda: time.sleep(0.2))
    return cpu


def first_group(
    ctx: RankContext,
    welcome: m.RankWelcome,
    deadlines: Deadlines,
    announced_after: Callable[[int], bool],
    report_failure: Callable[[RuntimeError, int], None],
) -> torch.distributed.ProcessGroup | None:
    """The run's first process group, or None when a rank died while it formed: the
    controller then regroups the survivors, naming whose parameters all take (``sync_from``)."""
    try:
        return build_group(
            store_host=welcome.store_host,
            store_port=welcome.store_port,
            prefix=welcome.store_prefix,
            rank=ctx.rank,
            world_size=welcome.world_size,
            device=ctx.device,
            timeout_s=deadlines.collective_timeout_s,
            gather_s=deadlines.group_gather_s,
            give_up=lambda: ctx.must_stop() or announced_after(welcome.generation),
        )
    except Superseded:
        if ctx.must_stop():
            raise
    except RuntimeError as exc:
        if not is_collective_error(exc):
            raise
        log.warning("rank %d: the first group did not form (%s); waiting for the survivors' group", ctx.rank, exc)
        report_failure(exc, welcome.generation)
    return None
