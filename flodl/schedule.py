"""Epoch permutations: the global shuffle every rank derives on its own.

Pure logic. Every epoch has one global permutation of the dataset, seeded
``seed + epoch``; the controller grants ranges of positions in it
(``dispatch.py``) and ranks turn a range back into sample indices, so only a
few integers cross the network. ``shuffle_signature`` lets the controller
prove at join time that every rank derives the same permutations (same torch
RNG algorithm).
"""

from __future__ import annotations

import hashlib
import torch

#: Default shuffle seed (the reference runtime's SHUFFLE_BASE_SEED).
DEFAULT_SEED = 42


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
