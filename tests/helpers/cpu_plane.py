"""The CPU averaging plane in one process: a controller-side ``CpuAveraging``, ranks' averagers, raw frames."""

from __future__ import annotations

import asyncio

import torch
import zmq

from flodl.averaging.server import CpuAveraging
from flodl.rank.cpu_average import BulkLink, CpuAverager
from flodl.rank.flat import FlatModel
from flodl.wire import messages as m
from flodl.wire.bulk import SLICE_BYTES
from flodl.wire.codec import FrameWriter

SECRET = b"b" * 32


RUN = "bulk-run"


class Big(torch.nn.Module):
    """Parameters larger than one slice, plus a floating and an integer buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(SLICE_BYTES // 4 + 1000, generator=g))
        self.v = torch.nn.Parameter(torch.randn(7, generator=g))
        self.register_buffer("stat", torch.randn(5, generator=g))
        self.register_buffer("count", torch.tensor(seed))


def values(model):
    return [t.detach().double().clone() for t in (model.w, model.v, model.stat)]


def rank_side(ctl: CpuAveraging, rank: int, model: torch.nn.Module, *, timeout_s: float = 10.0, lane: bool = False) -> CpuAverager:
    identity = f"rank{rank}.t".encode()
    ctl.admit(identity, rank)
    probe = dict(shm_probe=ctl.probe_path, shm_nonce=ctl.probe_nonce) if lane else {}
    bulk = BulkLink(f"tcp://127.0.0.1:{ctl.port}", rank=rank, secret=SECRET, run_id=RUN, sender=f"rank{rank}.t/bulk", **probe)
    assert bulk.lane == lane
    return CpuAverager(FlatModel(model), bulk, rank=rank, timeout_s=timeout_s, must_stop=lambda: False)


def dies_after_first_slice(averager: CpuAverager) -> list[int]:
    """Make a rank on the wire send only the first slice of its snapshots, as one killed right after it;
    returns the buckets of every slice it was asked to send."""
    sent: list[int] = []
    whole = averager.bulk.send

    def first_slice_only(header: m.Snapshot, piece: torch.Tensor) -> None:
        if not sent:
            whole(header, piece)
        sent.append(header.bucket)

    averager.bulk.send = first_slice_only  # type: ignore[method-assign]
    return sent


async def controller(timeout_s: float = 5.0) -> tuple[CpuAveraging, asyncio.Task]:
    ctl = CpuAveraging(secret=SECRET, run_id=RUN, bind="127.0.0.1", timeout_s=timeout_s)
    ctl.start()
    return ctl, asyncio.create_task(ctl.run())


async def stop(ctl, task, averagers=()):
    task.cancel()
    for a in averagers:
        a.bulk.close()
    ctl.close()


def send_raw(port: int, identity: bytes, header: m.Snapshot, payload: bytes) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([FrameWriter(SECRET, RUN, identity.decode()).encode(header), payload])
    sock.close()


def snapshot_header(**over) -> m.Snapshot:
    """A one-bucket snapshot header of rank 0, round 0 (4 float32 values, no lane), with ``over`` changed."""
    fields = (
        dict(
            rank=0,
            round=0,
            weight=1.0,
            groups=["p"],
            dtypes=["float32"],
            numels=[4],
            bucket=0,
            start=0,
            count=4,
            shm="",
            shm_offset=0,
            ranks=1,
            folded=[],
        )
        | over
    )
    return m.Snapshot(**fields)
