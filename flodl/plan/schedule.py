"""Epoch permutations: the global shuffle every rank derives on its own.

Pure logic; torch is imported only to draw a permutation (the controller,
which never draws one, starts without it). Every epoch has one global
permutation of the dataset, seeded ``seed + epoch``; the controller grants
ranges of positions in it (``dispatch.py``) and ranks turn a range back into
sample indices, so only a few integers cross the network.
``shuffle_signature`` lets the controller prove at join time that every rank
derives the same permutations (same torch RNG algorithm); ``digest_positions``
names the samples whose hash shows that every rank permutes the same dataset.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Default shuffle seed (the reference runtime's SHUFFLE_BASE_SEED).
DEFAULT_SEED = 42


def epoch_permutation(dataset_len: int, seed: int, epoch: int) -> torch.Tensor:
    """The global permutation of an epoch (identical on every rank)."""
    import torch  # here, not at the top: the controller uses only the pure parts and starts without torch

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


#: How many dataset positions the ranks' dataset digest hashes (rank/dataset_digest.py).
DIGEST_POSITIONS = 8


def digest_positions(dataset_len: int) -> list[int]:
    """The positions whose samples every rank hashes to show it holds the same dataset: the first,
    the last and the others spread evenly between (all of them in a dataset this short)."""
    count = min(DIGEST_POSITIONS, dataset_len)
    if count <= 1:
        return [0] if count == 1 else []
    return sorted({k * (dataset_len - 1) // (count - 1) for k in range(count)})


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer (stable across runs and hosts)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class PickKey:
    """One pick of one pass: which sample, which of its ``augment`` copies, in which pass.

    A delivery transform seeds its randomness from ``seed(run_seed)``, so a
    pick is transformed the same way on whichever rank trains it, in every
    run with the same seed, and differently from the sample's other copies.
    """

    pass_index: int
    pick: int  # position in the pass's pick space [0, dataset_len * augment)
    sample: int  # dataset index: pick % dataset_len
    copy: int  # which of the sample's augment copies: pick // dataset_len

    def seed(self, run_seed: int = DEFAULT_SEED) -> int:
        """A 63-bit seed for ``torch.Generator().manual_seed``, unique to this pick."""
        return _mix64(_mix64(_mix64(run_seed) ^ self.pass_index) ^ self.pick) >> 1


@dataclass(frozen=True)
class Schedule:
    """Passes, epochs and picks of a run.

    A pass is one seeded shuffle of the pick space ``dataset_len * augment``
    (each sample ``augment`` times); ``epoch_splits`` slices a pass into that
    many epochs, so a run of ``passes`` passes has ``passes * epoch_splits``
    epochs and sees every sample ``passes * augment`` times. Eval,
    checkpoints and the averaging window follow the epoch edges. With
    ``augment = epoch_splits = 1`` an epoch is a pass of the dataset.
    """

    dataset_len: int
    augment: int = 1
    epoch_splits: int = 1
    passes: int = 1

    def __post_init__(self) -> None:
        for name in ("dataset_len", "augment", "epoch_splits", "passes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.epoch_splits > self.pass_len:
            raise ValueError(f"epoch_splits {self.epoch_splits} is more than the {self.pass_len} picks of a pass")

    @property
    def pass_len(self) -> int:
        return self.dataset_len * self.augment

    @property
    def epochs(self) -> int:
        """Epochs the run trains."""
        return self.passes * self.epoch_splits

    def bounds(self, epoch: int) -> tuple[int, int, int]:
        """``(pass_index, start, size)``: the epoch's range of its pass's shuffled picks."""
        pass_index, part = divmod(epoch, self.epoch_splits)
        start = self.pass_len * part // self.epoch_splits
        end = self.pass_len * (part + 1) // self.epoch_splits
        return pass_index, start, end - start

    def epoch_len(self, epoch: int) -> int:
        return self.bounds(epoch)[2]

    def span(self, epoch: int, start: int, size: int) -> tuple[int, int]:
        """``(pass_index, at)`` of a grant ``[epoch, start, size]``, ``at`` its first pick's place in the pass.

        Raises:
            ValueError: the grant reaches outside the epoch.
        """
        pass_index, epoch_start, length = self.bounds(epoch)
        if start < 0 or size < 0 or start + size > length:
            raise ValueError(f"grant [{start}, {start + size}) outside epoch {epoch} of {length} picks")
        return pass_index, epoch_start + start

    def share_problem(self, batch_size: int, world: int) -> tuple[str | None, str | None]:
        """``(refusal, warning)`` for ``world`` ranks training batches of ``batch_size`` (None: fine).

        Refused: an epoch has fewer samples than ranks, so a rank trains nothing at all. Warned:
        a rank's share of an epoch is smaller than one batch, so each rank takes one partial
        batch (one step) per epoch; training still means something, at one step per epoch.
        """
        samples = min(self.epoch_len(e) for e in range(self.epoch_splits))
        if samples < world:
            return (
                f"an epoch has {samples} sample(s) for {world} ranks: {world - samples} rank(s) would train nothing; "
                f"run at most {samples} rank(s) or give the task more data",
                None,
            )
        share = samples // world
        if batch_size > share:
            return None, (
                f"batch_size {batch_size} is more than a rank's share of an epoch (~{share} of {samples} samples "
                f"over {world} ranks): each rank takes one partial batch, one step, per epoch; "
                f"a batch_size of at most {share} gives more steps"
            )
        return None, None

    def picks(self, seed: int, epoch: int, offset: int, size: int) -> tuple[int, torch.Tensor]:
        """``(pass_index, picks)`` of positions ``[offset, offset + size)`` of ``epoch``."""
        pass_index, start, length = self.bounds(epoch)
        if offset < 0 or size < 0 or offset + size > length:
            raise ValueError(f"slice [{offset}, {offset + size}) outside epoch {epoch} of {length} picks")
        perm = epoch_permutation(self.pass_len, seed, pass_index)
        return pass_index, perm[start + offset : start + offset + size]

    def keys(self, pass_index: int, picks: torch.Tensor) -> list[PickKey]:
        n = self.dataset_len
        return [PickKey(pass_index, p, p % n, p // n) for p in picks.tolist()]
