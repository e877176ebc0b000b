"""Turning granted shards into batches: the rank's data path for a ``flodl.Shards`` dataset.

The controller grants ``[epoch, start, size]`` positions as it does for a
map-style dataset, but a position is a *shard*: this module rebuilds the
epoch's shard order from the same seeded shuffle (``schedule.Schedule``),
opens each granted shard with the task's ``open_shard`` and streams its
samples through ``collate_fn`` into batches of ``batch_size``.

A batch never crosses a shard's end (a shard's last batch may be short), so
every batch belongs to one shard and one epoch, and the rank can stop a
window exactly where a shard ends: ``ShardPicks.ends`` says that a batch
completes its shard, and the runner stops (quota, time, ``EndWindow``) and
counts coverage only there. An empty shard is one item with no batch.
Nothing is staged: a stream is read once per grant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate

from ..errors import TaskError
from ..plan.schedule import Schedule
from ..shards import Shards
from .data import PassShuffles


@dataclass(frozen=True)
class ShardPicks:
    """What one batch of a shard is: which shard, how many samples, and whether it ends the shard."""

    shard: int  # the shard's place in ``Shards.shard_ids``
    samples: int
    ends: int  # 1: the shard's last batch (the shard is then trained whole); 0: more of it follows

    def __len__(self) -> int:
        return self.samples


class ShardSource:
    """Streams batches of granted shards (the ``BatchSource`` counterpart for ``Shards``)."""

    in_memory = False  # nothing to place on the device, nothing to prefetch from memory
    tiers = None  # streams are read once per grant: no staging tiers, no cache warmer
    device = None

    def __init__(
        self,
        shards: Shards,
        batch_size: int,
        seed: int,
        collate_fn: Callable[[list], Any] | None = None,
        *,
        schedule: Schedule | None = None,
    ) -> None:
        self.shards = shards
        self.batch_size = batch_size
        self.seed = seed
        self.collate = collate_fn or default_collate
        self.length = len(shards)
        self.schedule = schedule or Schedule(self.length)
        self._shuffles = PassShuffles(self.schedule.pass_len, seed)

    def batches(self, epoch: int, offset: int, size: int) -> Iterator[tuple[ShardPicks, Any]]:
        """Yield ``(picks, batch)`` for the shards at positions ``[offset, offset + size)`` (lazily:
        a consumer that stops early opens no more shards)."""
        for _, picks, batch in self.window_batches([[epoch, offset, size]]):
            if batch is not None:
                yield picks, batch

    def window_batches(self, grants: list[list[int]], *, places: bool = True) -> Iterator[tuple[int, ShardPicks, Any]]:
        """Yield ``(epoch, picks, batch)`` over the shards of ``[epoch, start, size]`` grants, in order;
        an empty shard yields one item whose batch is None (``places``: BatchSource's; a shard's
        picks are always made)."""
        for epoch, start, size in grants:
            pass_index, at = self.schedule.span(epoch, start, size)
            perm = self._shuffles[pass_index]
            for place in range(at, at + size):
                index = int(perm[place]) % self.length
                for samples, last in self._chunks(index):
                    picks = ShardPicks(index, len(samples), 1 if last else 0)
                    yield epoch, picks, self._collate(samples, index) if samples else None

    def _chunks(self, index: int) -> Iterator[tuple[list[Any], bool]]:
        """A shard's samples in lists of ``batch_size``, each with whether it is the shard's last.
        One sample is read ahead, so the last chunk is known as such when it is handed out."""
        chunk: list[Any] = []
        shard = self.shards.shard_ids[index]
        samples = self.shards.samples(index)
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                break
            except Exception as exc:
                raise TaskError(f"reading shard {shard!r} raised {type(exc).__name__}: {exc}") from exc
            if len(chunk) == self.batch_size:
                yield chunk, False
                chunk = []
            chunk.append(sample)
        yield chunk, True

    def _collate(self, samples: list[Any], index: int) -> Any:
        try:
            return self.collate(samples)
        except Exception as exc:
            raise TaskError(f"collating samples of shard {self.shards.shard_ids[index]!r} raised {type(exc).__name__}: {exc}") from exc
