"""Epoch plans: which positions of each epoch's global shuffle each rank trains.

Pure logic, shared by the controller (which hands out ``(offset, size)``
slices) and the ranks (which turn a slice back into sample indices). Every
epoch has one global permutation of the dataset, seeded ``seed + epoch``;
ranks derive it locally, so only two integers per rank cross the network, and
``shuffle_signature`` lets the controller prove at join time that every rank
derives the same permutations (same torch RNG algorithm).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

#: Default shuffle seed (the reference runtime's SHUFFLE_BASE_SEED).
DEFAULT_SEED = 42


@dataclass(frozen=True, slots=True)
class Slice:
    """A contiguous run of positions in an epoch's permutation, owned by one rank."""

    rank: int
    offset: int
    size: int

    def batches(self, batch_size: int) -> int:
        """Optimizer steps this slice takes (the last batch may be partial)."""
        return -(-self.size // batch_size)


def equal_slices(total: int, world_size: int) -> list[Slice]:
    """Split ``total`` positions into contiguous slices, remainder to the first ranks.

    Golden: 100 positions over 3 ranks → sizes [34, 33, 33].
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    base, extra = divmod(total, world_size)
    out, offset = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        out.append(Slice(rank, offset, size))
        offset += size
    return out


def sync_rounds(slices: list[Slice], batch_size: int, sync_every: int = 1) -> int:
    """Averaging rounds every rank joins in a plan: enough for the rank with most batches.

    A rank that runs out of batches still joins the remaining rounds with zero
    weight, so no rank waits forever on a collective its peer never enters.
    """
    most = max((s.batches(batch_size) for s in slices), default=0)
    return -(-most // sync_every)


def epoch_permutation(dataset_len: int, seed: int, epoch: int) -> torch.Tensor:
    """The global permutation of an epoch (identical on every rank)."""
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=gen)


def slice_indices(dataset_len: int, seed: int, epoch: int, offset: int, size: int) -> torch.Tensor:
    """Sample indices of one slice of an epoch's permutation."""
    if offset < 0 or size < 0 or offset + size > dataset_len:
        raise ValueError(f"slice [{offset}, {offset + size}) outside a dataset of {dataset_len}")
    return epoch_permutation(dataset_len, seed, epoch)[offset : offset + size]


def shuffle_signature() -> str:
    """Hash of a reference permutation: equal on two ranks iff their shuffles agree."""
    perm = epoch_permutation(4096, 12345, 0)
    return hashlib.sha256(perm.numpy().tobytes()).hexdigest()[:16]
