"""Compressed averages on the CPU backend, the averaging ends' side (``--sync-compression``).

With compression on, a rank sends its parameter buckets as compressed deltas
from the **consensus** every rank holds (the plain average the last round left,
before any outer step), the bulk layout naming the encoding (bulk.py). The round
core decodes and averages them as it does values (rounds.py ``Round.fold``); what
goes out again is compressed here:

* ``Downlink`` (the controller): the averaged delta, compressed with the
  controller's own error feedback, goes back to every rank, which adds it to its
  copy of the consensus; the controller adds the same decoded bytes to its own
  copy, so both stay bit-equal. A round that carries a source new to the run (a
  joiner, whose first average must hand it the values whole) goes out
  uncompressed instead, as the consensus' new values: every rank takes them.
  The first round of a run (the broadcast of rank 0's values) always travels
  whole, and sets the copy.
* ``Uplink`` (a host relay): the host's averaged delta goes upstream compressed,
  the relay's residual kept only once the controller's average of the slice
  comes back (an aborted round's content is sent again by the ranks themselves).
"""

from __future__ import annotations

import logging

import torch

from ..wire.quant import BY_WIRE_NAME, compress
from .rounds import Round

log = logging.getLogger("flodl.averaging")

#: What a compressed bucket of a round that must hand out values whole travels as.
WHOLE = "float32"


class Downlink:
    """The controller's copy of the consensus, and the residual of what its compressed averages left out."""

    def __init__(self) -> None:
        self.consensus: dict[int, torch.Tensor] = {}  # bucket -> float32 values every rank holds as its anchor
        self.residual: dict[int, torch.Tensor] = {}
        # sources admitted that not every compressed bucket reached whole yet, and the buckets that
        # did (``--sync-fragments``: a round carries one fragment's, so a joiner's take several)
        self.fresh: dict[int, set[int]] = {}

    def admitted(self, source: int) -> None:
        """``source`` joins: the averages it takes part in hand out the values whole, until every
        compressed bucket went out whole to it once."""
        self.fresh[source] = set()

    def dtypes(self, rnd: Round) -> list[str]:
        """The layout round ``rnd``'s averages go out in (decided once, at its first slice): its own,
        or, with a fresh source among the expected ones, every compressed bucket whole."""
        out = rnd.out_dtypes
        if out is None:
            whole = bool(rnd.expected & self.fresh.keys())
            encoded = [i for i, d in enumerate(rnd.dtypes) if d in BY_WIRE_NAME]
            if whole and any(i not in self.consensus for i in encoded):
                log.error("round %d: a rank joined, but no whole average was seen to take its values from; it gets deltas", rnd.number)
                whole = False
            out = rnd.out_dtypes = [WHOLE if whole and i in encoded else d for i, d in enumerate(rnd.dtypes)]
        return out

    def done(self, rnd: Round) -> None:
        """Round ``rnd``'s average went out: its sources hold the consensus of its buckets now (a
        source holds the whole consensus once every compressed bucket came to it)."""
        encoded = {i for i, d in enumerate(rnd.dtypes) if d in BY_WIRE_NAME}
        carried = {i for i in encoded if rnd.numels[i] > 0}
        for source in rnd.expected & self.fresh.keys():
            self.fresh[source] |= carried
            if self.fresh[source] >= encoded:
                del self.fresh[source]

    def seen(self, rnd: Round, bucket: int, start: int, out: torch.Tensor) -> None:
        """A slice of parameter values went out (a round of values: the first broadcast): as the
        ranks read it (``out``, in the bucket's dtype), it is the consensus."""
        if rnd.groups[bucket] == "p" and rnd.dtypes[bucket] not in BY_WIRE_NAME:
            self._copy(bucket, rnd.numels[bucket])[start : start + out.numel()].copy_(out)

    def out(self, rnd: Round, bucket: int, start: int, count: int, acc: torch.Tensor) -> torch.Tensor:
        """What goes out of one averaged slice ``acc`` (float32) of a compressed bucket: in a round
        that hands out values whole, the consensus' new values; else the encoded delta (added to
        the consensus, as every rank adds it)."""
        seg = slice(start, start + count)
        codec = BY_WIRE_NAME[rnd.dtypes[bucket]]
        with torch.no_grad():
            if self.dtypes(rnd)[bucket] == WHOLE:
                values = self.consensus[bucket][seg]
                values.add_(acc)
                residual = self.residual.get(bucket)
                if residual is not None:  # what compression left out so far goes out too, now
                    values.add_(residual[seg])
                    residual[seg].zero_()
                return values.clone()
            residual = self.residual.setdefault(bucket, torch.zeros(rnd.numels[bucket]))
            payload, residual[seg] = compress(codec, acc, residual[seg])
            consensus = self.consensus.get(bucket)
            if consensus is not None:
                consensus[seg].add_(codec.decode(payload, count))  # as every rank adds it to its anchor
            return payload

    def _copy(self, bucket: int, numel: int) -> torch.Tensor:
        copy = self.consensus.get(bucket)
        if copy is None or copy.numel() != numel:
            copy = self.consensus[bucket] = torch.empty(numel)
            self.residual.pop(bucket, None)
        return copy


class Uplink:
    """A host relay's residual of the compressed averages it sends upstream, kept slice by slice
    once the controller's average of that slice is back."""

    def __init__(self) -> None:
        self.residual: dict[int, torch.Tensor] = {}
        self.pending: dict[tuple[int, int, int], torch.Tensor] = {}  # (round, bucket, start) -> its new residual

    def out(self, rnd: Round, bucket: int, start: int, count: int, acc: torch.Tensor, *, weight: float) -> torch.Tensor:
        """The host's averaged delta ``acc`` of one slice, encoded (``weight``: the host's, 0 when no
        local rank trained: the controller ignores it, so its residual stays)."""
        codec = BY_WIRE_NAME[rnd.dtypes[bucket]]
        residual = self.residual.setdefault(bucket, torch.zeros(rnd.numels[bucket]))
        payload, new = compress(codec, acc, residual[start : start + count])
        if weight > 0:
            self.pending[(rnd.number, bucket, start)] = new
        return payload

    def delivered(self, number: int, bucket: int, start: int) -> None:
        """The controller's average of this slice came back: what we sent of it counted."""
        new = self.pending.pop((number, bucket, start), None)
        if new is not None:
            self.residual[bucket][start : start + new.numel()].copy_(new)

    def closed(self, number: int) -> None:
        """Round ``number`` is over (done, or aborted): what it still holds never counted."""
        self.pending = {k: v for k, v in self.pending.items() if k[0] > number}
