"""Compressed snapshots on the CPU backend, rank side (``--sync-compression bf16|int8``).

Each parameter bucket goes to the controller as its delta from the **anchor**
(the consensus every rank holds: the plain average the last round left, before
any outer step, which the controller keeps a copy of too), plus the residual
compression left out of the rank's last snapshot (error feedback), encoded
slice by slice (wire/quant.py). Floating buffers (BatchNorm statistics) go
whole, as without compression; integer buffers never travel.

An averaged slice comes back either compressed (the averaged delta: the anchor
plus it is the new consensus, the same bits on every rank) or whole (a round a
joiner takes part in, or the run's first broadcast: the values themselves).
Either way it becomes the slice's anchor, and the residual of what this rank
sent of that slice is kept: a slice whose average never comes (an aborted
round) leaves the old residual, its content still in the rank's values.

The anchor must be the same on every rank when a snapshot is taken, so with
compression a rank sends a round only once its previous one has landed (one
round in flight, as on the collective backend).
"""

from __future__ import annotations

import torch

from ..wire.bulk import dtype_name
from ..wire.quant import BY_WIRE_NAME, Codec, compress
from .flat import PARAMS, Bucket


class SnapshotDeltas:
    """A rank's anchors and residuals, per parameter bucket, for compressed snapshots."""

    def __init__(self, codec: Codec, buckets: list[Bucket]) -> None:
        self.codec = codec
        self.params = [b.group == PARAMS for b in buckets]
        self.numels = [b.numel for b in buckets]
        self.anchor: dict[int, torch.Tensor] = {}  # bucket -> float32, on the bucket's device
        self.residual: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}  # bucket -> the residual of the round in flight, kept slice by slice
        self.pending_round = -1

    def dtypes(self, buckets: list[Bucket], *, whole: bool) -> list[str]:
        """The snapshot's layout: parameter buckets by their encoding, unless sent ``whole`` (a broadcast)."""
        return [dtype_name(b.flat.dtype) if whole or not p else self.codec.wire_name for b, p in zip(buckets, self.params, strict=True)]

    def encode(self, round_: int, index: int, values: torch.Tensor, start: int, weight: float) -> torch.Tensor:
        """One slice (``values``, at ``start`` of bucket ``index``) as its compressed delta, on the CPU.

        A rank without an anchor (a joiner adopting: weight 0, its values count
        for nothing) sends zeros.
        """
        anchor = self.anchor.get(index)
        count = values.numel()
        if anchor is None:
            return self.codec.encode(torch.zeros(count))
        seg = slice(start, start + count)
        residual = self.residual.get(index)
        with torch.no_grad():
            payload, new = compress(self.codec, values.float() - anchor[seg], residual[seg] if residual is not None else None)
            if weight > 0:  # a weight-0 snapshot counts for nothing: its residual stays to go with the next
                if self.pending_round != round_:
                    self.pending, self.pending_round = {}, round_
                self.pending.setdefault(index, torch.zeros_like(anchor))[seg].copy_(new)
        return payload.cpu()

    def values(self, index: int, start: int, count: int, name: str, piece: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """An averaged slice as the consensus' values (float32, a tensor of its own on ``device``):
        decoded and added to the anchor, or whole as it came. None: it is a delta and this rank
        has no anchor to add it to (it waits for a whole one)."""
        codec = BY_WIRE_NAME.get(name)
        if codec is None:
            return piece.to(device=device, dtype=torch.float32, copy=True)
        anchor = self.anchor.get(index)
        if anchor is None:
            return None
        with torch.no_grad():
            # anchor + decoded delta: one rounding, the same bits on every rank (and the controller)
            return codec.decode(piece.to(device), count).add_(anchor[start : start + count])

    def landed(self, round_: int, index: int, start: int, consensus: torch.Tensor) -> None:
        """A slice of round ``round_``'s consensus landed: it is the anchor, and what this rank sent of it counted."""
        seg = slice(start, start + consensus.numel())
        with torch.no_grad():
            anchor = self.anchor.get(index)
            if anchor is None:
                anchor = self.anchor[index] = torch.zeros(self.numels[index], device=consensus.device)
            anchor[seg].copy_(consensus)
            new = self.pending.get(index) if self.pending_round == round_ else None
            if new is not None:
                self.residual.setdefault(index, torch.zeros_like(anchor))[seg].copy_(new[seg])
