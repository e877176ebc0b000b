"""Compressed averages on the collective backend (``--sync-compression bf16|int8``).

Every member holds the same **anchor**: the consensus the last average left
(``Deltas``). What travels is each rank's change since then, compressed
(wire/quant.py), plus the residual compression left out of its last
contribution (error feedback). One parameter bucket's average is an
``Exchange`` in up to three collectives:

1. **all-to-all**: the rank's delta, cut in W equal chunks, goes chunk ``j`` to
   member ``j``, each chunk compressed and headed by the rank's weight and a
   digest of its anchor;
2. **all-gather**: each member decodes the W contributions to its chunk, takes
   their weighted mean (in rank order), compresses it (keeping its own residual
   of that, the chunk's owner's error feedback) and every member gathers every
   chunk: the average's delta, the same bytes everywhere;
3. **broadcast**, only when the digests disagree (a joiner adopting, a member
   that lost an average the others took, no anchor yet): the lowest member with
   an anchor sends the resulting values whole, so every replica ends equal.

Each member sends about ``2 (W-1)/W`` of the compressed bytes, as a ring
all-reduce does of the full ones: int8 sends about a quarter of float32 at any
W. The result ``anchor + decoded delta`` is two exactly rounded operations on
the same bits everywhere, so the replicas are bit-identical after an average.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..wire.quant import BLOCK, Codec, compress
from .flat import PARAMS, Bucket

log = logging.getLogger("flodl.rank.runner")

#: The digest a member with no anchor sends (real digests are never negative): it forces the broadcast.
NO_ANCHOR = -1
#: Phase 1's header: the rank's weight (float32) and its anchor's digest (int32).
HEADER = 8


def _aligned(n: int) -> int:
    """``n`` bytes rounded up to a multiple of 4: every part of a buffer starts float-aligned."""
    return (n + 3) // 4 * 4


def digest(anchor: torch.Tensor) -> int:
    """A digest of an anchor's bits: integer arithmetic, the same on every device."""
    return int(anchor.view(torch.int32).sum(dtype=torch.int64).item()) & 0x7FFFFFFF


class Deltas:
    """What a rank keeps to compress its averages: per parameter bucket the anchor (float32), its
    residual, and the residual of the chunk it reduces (reset with the group: chunks move)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.anchor: dict[int, torch.Tensor] = {}
        self.residual: dict[int, torch.Tensor] = {}
        self.owned: dict[int, torch.Tensor] = {}

    def compressed(self, bucket: Bucket) -> bool:
        """Does ``bucket`` travel compressed? Parameters do; floating buffers (BatchNorm statistics) go whole."""
        return bucket.group == PARAMS

    def rebase(self, buckets: list[Bucket]) -> None:
        """Every replica holds these values now (a broadcast): they are the anchor; residuals start over."""
        with torch.no_grad():
            for index, bucket in enumerate(buckets):
                if self.compressed(bucket):
                    self.anchor[index] = bucket.values.detach().float().clone()
                    self.residual.pop(index, None)
        self.owned.clear()

    def regrouped(self) -> None:
        """A new group: each member reduces another chunk, so the owners' residuals start over."""
        self.owned.clear()

    def landed(self, index: int, average: torch.Tensor, exchange: Exchange) -> None:
        """``average`` (the bucket's values every member now holds) landed: it is the anchor; the
        residuals of what this exchange sent are kept."""
        with torch.no_grad():
            anchor = self.anchor.get(index)
            if anchor is None:
                self.anchor[index] = average.detach().float().clone()
            else:
                anchor.copy_(average)
        if exchange.weight > 0:
            self.residual[index] = exchange.new_residual
        if exchange.new_owned is not None:
            self.owned[index] = exchange.new_owned


class Exchange:
    """One parameter bucket's compressed average over a group, a collective per phase (module docstring).

    ``works`` are the collectives in flight; once they completed, ``advance``
    starts the next phase, or returns True: the values are then in ``out``
    (the bucket's dtype) and the weights' sum in ``total``.
    """

    def __init__(
        self, group: dist.ProcessGroup, deltas: Deltas, index: int, values: torch.Tensor, weight: float, out: torch.Tensor
    ) -> None:
        self.group, self.codec, self.out, self.weight = group, deltas.codec, out, weight
        self.world, self.rank = group.size(), group.rank()
        self.n = values.numel()
        self.chunk = -(-self.n // self.world)
        if self.chunk > 16 * BLOCK:  # whole blocks decode as one view (a model's worth of padding is < 1%)
            self.chunk = -(-self.chunk // BLOCK) * BLOCK
        self.part1 = _aligned(HEADER + self.codec.nbytes(self.chunk))
        self.part2 = _aligned(self.codec.nbytes(self.chunk))
        self.anchor = deltas.anchor.get(index)
        self.owned = deltas.owned.get(index)
        self.total = 0.0
        self.broadcast_root = -1
        self.new_owned: torch.Tensor | None = None
        # bytes this member sends (a ring's count for the gather): both phases, counted at the start;
        # ``extra``: the broadcast's, when there is one
        self.sent = (self.world - 1) * (self.part1 + self.part2)
        self.extra = 0
        self.works: list[Any] = []
        self._phase = 1
        device = values.device
        with torch.no_grad():
            delta = torch.zeros(self.world * self.chunk, dtype=torch.float32, device=device)
            if self.anchor is not None:
                torch.sub(values.float(), self.anchor, out=delta[: self.n])
            residual = deltas.residual.get(index)
            self.send = torch.empty(self.world * self.part1, dtype=torch.uint8, device=device)
            # the residual of what this rank sends, kept if the average lands (``Deltas.landed``)
            self.new_residual = torch.empty_like(delta)
            mark = torch.tensor([float(weight)], dtype=torch.float32).view(torch.uint8)
            tag = torch.tensor([digest(self.anchor) if self.anchor is not None else NO_ANCHOR], dtype=torch.int32).view(torch.uint8)
            for j in range(self.world):
                part = self.send[j * self.part1 : (j + 1) * self.part1]
                piece = delta[j * self.chunk : (j + 1) * self.chunk]
                body, self.new_residual[j * self.chunk : (j + 1) * self.chunk] = compress(
                    self.codec, piece, residual[j * self.chunk : (j + 1) * self.chunk] if residual is not None else None
                )
                part[:4].copy_(mark)
                part[4:HEADER].copy_(tag)
                part[HEADER : HEADER + body.numel()].copy_(body)
            self.recv = torch.empty_like(self.send)
        self.works = [group.alltoall_base(self.recv, self.send, [], [], dist.AllToAllOptions())]

    def advance(self) -> bool:
        """The phase in flight completed: start the next one; True once the average is in ``out``."""
        for work in self.works:
            work.wait()  # completed: raises its error; on NCCL, orders this stream after it
        with torch.no_grad():
            if self._phase == 1:
                self._reduce_chunk()
                return False
            if self._phase == 2:
                self._decode_average()
                if self.broadcast_root < 0:
                    return True
                opts = dist.BroadcastOptions()
                opts.rootRank = self.broadcast_root
                self.works, self._phase = [self.group.broadcast([self.out], opts)], 3
                self.extra += self.out.numel() * self.out.element_size()
                return False
        return True

    def _reduce_chunk(self) -> None:
        """Phase 1 is in: this member's chunk of every contribution, averaged, compressed, gathered."""
        parts = self.recv.view(self.world, self.part1)
        weights = parts[:, :4].contiguous().view(torch.float32).reshape(-1).tolist()
        digests = parts[:, 4:HEADER].contiguous().view(torch.int32).reshape(-1).tolist()
        self.total = float(sum(weights))
        mean = torch.zeros(self.chunk, dtype=torch.float32, device=self.recv.device)
        if self.total > 0:
            for k, w in enumerate(weights):  # in rank order: the owner's sum, gathered by all, is the one average
                if w:
                    mean.add_(self.codec.decode(parts[k, HEADER:], self.chunk).mul_(w))
            mean.div_(self.total)
        body, owned = compress(self.codec, mean, self.owned)
        if self.total > 0:
            self.new_owned = owned
        anchored = [k for k, d in enumerate(digests) if d != NO_ANCHOR]
        if len(set(digests)) > 1 or len(anchored) < self.world:
            self.broadcast_root = anchored[0] if anchored else 0
            # a member without an anchor (a joiner, one that lost an average) is expected; anchors
            # that differ are not (the broadcast mends them all the same)
            (log.info if len({digests[k] for k in anchored}) <= 1 else log.warning)(
                "compressed average: member(s) %s hold no anchor or another one; the values go out whole from member %d",
                [k for k, d in enumerate(digests) if d != digests[self.broadcast_root]],
                self.broadcast_root,
            )
        self.gathered = torch.empty(self.world * self.part2, dtype=torch.uint8, device=self.recv.device)
        mine = torch.zeros(self.part2, dtype=torch.uint8, device=self.recv.device)
        mine[: body.numel()].copy_(body)
        self.works, self._phase = [self.group._allgather_base(self.gathered, mine, dist.distributed_c10d.AllgatherOptions())], 2

    def _decode_average(self) -> None:
        """Phase 2 is in: the average is the anchor plus every chunk's decoded mean."""
        parts = self.gathered.view(self.world, self.part2)
        delta = torch.cat([self.codec.decode(parts[k], self.chunk) for k in range(self.world)])[: self.n]
        if self.anchor is not None:
            delta.add_(self.anchor)  # anchor + delta: one rounding, the same bits on every member
        self.out.copy_(delta)
