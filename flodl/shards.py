"""Streaming data: a dataset of shards, each opened into an iterable of samples.

``Shards(shard_ids, open_shard=fn)`` is the iterable counterpart of a
map-style dataset. The controller never sees a sample index: one shard is
one position of the coverage ledger, so progressive dispatch grants shards,
windows count shards, and resume continues with the shards not yet trained.
A rank calls ``open_shard(shard_id)`` for each shard it is granted and
streams its samples through ``collate_fn`` into batches (docs/data.md,
"Streaming shards"). A shard may hold any number of samples, unknown ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .errors import TaskError

#: ``open_shard(shard_id) -> iterable of samples`` (a generator reading a file, a list, ...).
OpenShard = Callable[[Any], Iterable[Any]]


class Shards:
    """A dataset of ``shard_ids`` (file paths, URLs, integers: anything ``open_shard`` takes).

    Every rank must build the same list in the same order, as it must a
    map-style dataset's samples: the ranks rebuild each epoch's shard order
    from the run's seed, and the controller compares the counts and a
    digest of the ids at a few positions (rank/dataset_digest.py).

    Raises:
        TaskError: ``shard_ids`` is empty, not a sequence (a generator or a
            bare string), or ``open_shard`` is not callable.
    """

    def __init__(self, shard_ids: Sequence[Any], open_shard: OpenShard) -> None:
        if isinstance(shard_ids, (str, bytes)) or not isinstance(shard_ids, Sequence):
            raise TaskError(f"Shards.shard_ids must be a list of shard ids (file paths, numbers), got {type(shard_ids).__name__}")
        if len(shard_ids) == 0:
            raise TaskError("Shards.shard_ids is empty: give at least one shard")
        if not callable(open_shard):
            raise TaskError(f"Shards.open_shard must be callable as open_shard(shard_id) -> iterable of samples, got {open_shard!r}")
        self.shard_ids = list(shard_ids)
        self.open_shard = open_shard

    def __len__(self) -> int:
        """Shards, not samples: the number of positions the ledger keeps per pass."""
        return len(self.shard_ids)

    def __repr__(self) -> str:
        return f"Shards({len(self.shard_ids)} shards, open_shard={getattr(self.open_shard, '__name__', self.open_shard)!r})"

    def samples(self, index: int) -> Iterator[Any]:
        """The samples of shard ``index`` (its place in ``shard_ids``), as ``open_shard`` yields them.

        Raises:
            TaskError: ``open_shard`` raised, or returned something that is not iterable.
        """
        shard = self.shard_ids[index]
        try:
            opened = self.open_shard(shard)
        except Exception as exc:
            raise TaskError(f"open_shard({shard!r}) raised {type(exc).__name__}: {exc}") from exc
        return iter(_iterable(opened, shard))

    def check(self) -> None:
        """Fail before training when ``open_shard`` does not give an iterable: the first shard is
        opened (a generator only starts; a function that reads the whole shard reads it once).

        Raises:
            TaskError: as ``samples``.
        """
        self.samples(0)


def _iterable(opened: Any, shard: Any) -> Iterable[Any]:
    """``opened`` when it can be iterated (a str or bytes is one sample, not a shard of characters)."""
    if isinstance(opened, (str, bytes)) or not isinstance(opened, Iterable):
        raise TaskError(
            f"open_shard({shard!r}) returned {type(opened).__name__}, not an iterable of samples "
            "(return a list, or yield the samples from a generator)"
        )
    return opened
