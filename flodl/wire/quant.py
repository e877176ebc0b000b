"""Compressed sync payloads (``--sync-compression``): how a delta travels in fewer bytes.

What is compressed is a parameter bucket's *delta*: the replica's values less the
consensus every rank already holds (its anchor), so only the progress since the
last average travels, and it travels small. Two encodings, each a flat byte
buffer (a bulk frame, or one rank's part of a collective):

* ``bf16``:  the delta rounded to bfloat16, 2 bytes a value.
* ``int8``:  the delta in blocks of ``BLOCK`` values, each an int8 per value times
  one float32 scale per block (``absmax / 127``): about 1.016 bytes a value.

A sender keeps an **error-feedback** residual (``compress``): what compression
left out of one payload is added to the next, so over rounds the sum of what was
decoded tracks the sum of what was meant (nothing is lost, only late). Decoding is
two exactly rounded IEEE operations per value (int8 × scale, then anchor + delta
where the caller adds it), so every receiver of the same bytes on the same anchor
computes the same bits, whatever its device: replicas stay bit-identical.

Pure torch, no sockets: the ranks, the controller's bulk server and a host relay
all encode and decode with it.
"""

from __future__ import annotations

import torch

#: Values per int8 block (one float32 scale each): 256 keeps the scales at 1.6% of the bytes.
BLOCK = 256
#: The ``--sync-compression`` values.
KINDS = ("none", "bf16", "int8")


def _view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (uint8) read as ``dtype``; copied first when it starts off the dtype's alignment
    (a part of a bigger buffer), which a view refuses."""
    size = torch.empty(0, dtype=dtype).element_size()
    return (data if data.storage_offset() % size == 0 else data.clone()).view(dtype)


class Codec:
    """One encoding of float32 deltas into a flat uint8 buffer (``encode``) and back (``decode``)."""

    kind = "none"
    #: the name a bulk layout gives a bucket sent in this encoding (``bulk.py``): a delta, not values
    wire_name = ""
    #: bytes a value takes (slicing sizes slices by it)
    itemsize = 4

    def nbytes(self, n: int) -> int:
        """Bytes of the encoding of ``n`` values."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32, 1-D) as a uint8 buffer of ``nbytes(x.numel())`` on ``x``'s device."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 values (``n`` of them) a buffer ``encode`` made holds, on ``data``'s device."""
        raise NotImplementedError


class Bf16(Codec):
    kind, wire_name, itemsize = "bf16", "bfloat16-delta", 2

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return _view(data[: 2 * n], torch.bfloat16).float()


class Int8(Codec):
    """Blocks of ``BLOCK`` values: one float32 scale per block first, then the int8 values."""

    kind, wire_name, itemsize = "int8", "int8-delta", 1

    @staticmethod
    def blocks(n: int) -> int:
        return -(-n // BLOCK)

    def nbytes(self, n: int) -> int:
        return n + 4 * self.blocks(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        nb = self.blocks(n)
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        if n == 0:
            return out
        padded = x if n == nb * BLOCK else torch.nn.functional.pad(x, (0, nb * BLOCK - n))
        rows = padded.view(nb, BLOCK)
        absmax = rows.abs().amax(dim=1)
        # a block of zeros sends zeros (its scale 0): the floor only keeps the reciprocal finite
        inverse = torch.reciprocal(absmax.clamp_min(1e-30)).mul_(127.0)
        q = rows.mul(inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        out[: 4 * nb].copy_(absmax.div_(127.0).view(torch.uint8))
        out[4 * nb :].copy_(q.view(-1)[:n].view(torch.uint8))
        return out

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        nb = self.blocks(n)
        scale = _view(data[: 4 * nb], torch.float32)
        q = data[4 * nb : 4 * nb + n].view(torch.int8)
        # one rounding per value (the int8 is exact in float32): the same bits on every device
        if n == nb * BLOCK:
            return (q.view(nb, BLOCK).float() * scale[:, None]).view(-1)
        return q.float() * scale.repeat_interleave(BLOCK)[:n]


_CODECS: dict[str, Codec] = {"bf16": Bf16(), "int8": Int8()}
#: Codecs by the name a bulk layout gives their buckets.
BY_WIRE_NAME: dict[str, Codec] = {c.wire_name: c for c in _CODECS.values()}


def codec(kind: str) -> Codec | None:
    """The codec of a ``--sync-compression`` value (None: ``none``, full precision).

    Raises:
        ValueError: a kind not in ``KINDS``.
    """
    if kind == "none":
        return None
    try:
        return _CODECS[kind]
    except KeyError:
        raise ValueError(f"sync compression must be one of {', '.join(KINDS)}, got {kind!r}") from None


def compress(c: Codec, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x + residual`` (error feedback); returns ``(payload, new residual)``.

    The new residual is what the payload leaves out; the caller keeps it once the
    payload was delivered (a payload that never counted, an aborted round, leaves
    the old residual in place: its content is sent again with the next).
    """
    meant = x.to(torch.float32, copy=True)
    if residual is not None:
        meant.add_(residual)
    payload = c.encode(meant)
    return payload, meant.sub_(c.decode(payload, meant.numel()))
