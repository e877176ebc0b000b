"""One epoch's samples as ranges handed out, trained, or given back: the coverage ledger.

Pure logic. An ``EpochPool`` owns the positions ``[0, total)`` of one
epoch's global permutation. Positions are *free* (not granted), *granted* to
one rank, or *trained*. A rank trains a prefix of what it was granted; the
rest is given back and granted again later, possibly to another rank (the
same path reclaims a dead rank's grants). The ledger refuses to mark a
position trained twice and can prove at any time that every position is in
exactly one state, so "each sample trained exactly once per pass" is checked,
not hoped for.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

Range = tuple[int, int]  # (start, size)


class LedgerError(AssertionError):
    """The coverage ledger was asked to do something that would lose or repeat samples (a bug)."""


def _merge_into(ranges: list[Range], start: int, size: int) -> None:
    """Insert ``[start, start+size)`` into sorted disjoint ``ranges``, merging neighbours."""
    if size <= 0:
        return
    i = bisect.bisect_left(ranges, (start, 0))
    if i > 0:
        ps, pz = ranges[i - 1]
        if ps + pz > start:
            raise LedgerError(f"range [{start}, {start + size}) overlaps [{ps}, {ps + pz})")
    if i < len(ranges) and ranges[i][0] < start + size:
        ns, nz = ranges[i]
        raise LedgerError(f"range [{start}, {start + size}) overlaps [{ns}, {ns + nz})")
    # merge with the left and right neighbours where they touch
    if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == start:
        ps, pz = ranges.pop(i - 1)
        i -= 1
        start, size = ps, pz + size
    if i < len(ranges) and ranges[i][0] == start + size:
        ns, nz = ranges.pop(i)
        size += nz
    ranges.insert(i, (start, size))


@dataclass
class EpochPool:
    """The positions of one epoch and where each of them stands."""

    epoch: int
    total: int
    free: list[Range] = field(default_factory=list)
    granted: dict[int, list[Range]] = field(default_factory=dict)
    trained: list[Range] = field(default_factory=list)
    reserved: dict[int, list[Range]] = field(default_factory=dict)  # non-progressive partitions

    def __post_init__(self) -> None:
        if self.total < 0:
            raise ValueError("total must be >= 0")
        if not self.free and not self.trained and not self.granted and not self.reserved and self.total:
            self.free = [(0, self.total)]

    @classmethod
    def from_uncovered(cls, epoch: int, total: int, uncovered: list[Range]) -> EpochPool:
        """An epoch resumed from a checkpoint: ``uncovered`` is free, everything else trained."""
        pool = cls(epoch, total, free=list(uncovered))
        at = 0
        for start, size in uncovered:
            if start > at:
                pool.trained.append((at, start - at))
            at = start + size
        if at < total:
            pool.trained.append((at, total - at))
        pool.check()
        return pool

    # ----------------------------------------------------------------- views

    @property
    def remaining(self) -> int:
        """Positions not yet granted (free or reserved)."""
        return sum(s for _, s in self.free) + sum(s for rs in self.reserved.values() for _, s in rs)

    def remaining_for(self, rank: int) -> int:
        """Positions ``rank`` may still be granted (its partition, or the shared free list)."""
        if rank in self.reserved:
            return sum(s for _, s in self.reserved[rank])
        return sum(s for _, s in self.free)

    @property
    def outstanding(self) -> int:
        return sum(s for rs in self.granted.values() for _, s in rs)

    @property
    def trained_count(self) -> int:
        return sum(s for _, s in self.trained)

    @property
    def done(self) -> bool:
        return self.trained_count == self.total

    def uncovered(self) -> list[Range]:
        """Every position not yet trained, merged (what a resume must still train)."""
        out: list[Range] = []
        for start, size in self.free + [r for rs in self.reserved.values() for r in rs] + [r for rs in self.granted.values() for r in rs]:
            _merge_into(out, start, size)
        return out

    def check(self) -> None:
        """Prove every position is in exactly one state.

        Raises:
            LedgerError: a position is missing or in two states.
        """
        every: list[Range] = []
        for start, size in self.uncovered():
            _merge_into(every, start, size)
        for start, size in self.trained:
            _merge_into(every, start, size)  # raises on overlap
        if self.total and every != [(0, self.total)]:
            raise LedgerError(f"epoch {self.epoch}: positions {every} do not tile [0, {self.total})")

    # ------------------------------------------------------------ operations

    def partition(self, shares: dict[int, float], batch_size: int) -> None:
        """Reserve contiguous batch-aligned partitions per rank (non-progressive dispatch)."""
        if self.granted or self.trained:
            raise LedgerError("partition a pool before granting from it")
        ranks = sorted(shares)
        total_share = sum(shares.values()) or 1.0
        batches = -(-self.total // batch_size)
        counts = [int(batches * shares[r] / total_share) for r in ranks]
        for i in sorted(range(len(ranks)), key=lambda i: -shares[ranks[i]])[: batches - sum(counts)]:
            counts[i] += 1
        offset = 0
        self.free = []
        for rank, count in zip(ranks, counts, strict=False):
            size = min(count * batch_size, self.total - offset)
            self.reserved[rank] = [(offset, size)] if size > 0 else []
            offset += size

    def share_free(self, ranks: list[int], batch_size: int) -> None:
        """Partitioned pool: hand free positions (a dead rank's partition, work
        given back) to ``ranks`` as equal batch-aligned extensions of their
        partitions, so nothing is stranded outside every partition."""
        if not self.reserved or not self.free or not ranks:
            return
        free, self.free = self.free, []
        left = sum(size for _, size in free)
        base, extra = divmod(-(-left // batch_size), len(ranks))
        for i, rank in enumerate(sorted(ranks)):
            want = min(left, (base + (1 if i < extra else 0)) * batch_size)
            left -= want
            own = self.reserved.setdefault(rank, [])
            while want > 0:  # cut the lowest free ranges off into this rank's partition
                start, size = free[0]
                n = min(size, want)
                _merge_into(own, start, n)
                free[0] = (start + n, size - n)
                if n == size:
                    free.pop(0)
                want -= n

    def take(self, rank: int, size: int) -> list[Range]:
        """Grant up to ``size`` positions to ``rank``, lowest first; returns the ranges."""
        source = self.reserved.get(rank, self.free)
        out: list[Range] = []
        while size > 0 and source:
            start, avail = source[0]
            n = min(avail, size)
            out.append((start, n))
            if n == avail:
                source.pop(0)
            else:
                source[0] = (start + n, avail - n)
            size -= n
        for start, n in out:
            _merge_into(self.granted.setdefault(rank, []), start, n)
        return out

    def settle(self, rank: int, ranges: list[Range], consumed: int) -> int:
        """``rank`` trained the first ``consumed`` positions of ``ranges`` (in order); the rest go back.

        Returns the number of positions newly marked trained.

        Raises:
            LedgerError: a range was not granted to ``rank``, or is trained already.
        """
        newly = 0
        for start, size in ranges:
            self._ungrant(rank, start, size)
            used = max(0, min(size, consumed))
            consumed -= used
            _merge_into(self.trained, start, used)
            newly += used
            self._give_back(rank, start + used, size - used)
        return newly

    def untrain(self, start: int, size: int) -> None:
        """``[start, start+size)``, marked trained, is in no replica after all: free again.

        Raises:
            LedgerError: the range is not trained.
        """
        if size <= 0:
            return
        for i, (s, z) in enumerate(self.trained):
            if s <= start and start + size <= s + z:
                del self.trained[i]
                _merge_into(self.trained, s, start - s)
                _merge_into(self.trained, start + size, s + z - start - size)
                _merge_into(self.free, start, size)
                return
        raise LedgerError(f"epoch {self.epoch}: [{start}, {start + size}) is not trained")

    def reclaim(self, rank: int) -> int:
        """Give back everything granted to ``rank`` (it died); returns how many positions."""
        ranges = self.granted.pop(rank, [])
        for start, size in ranges:
            _merge_into(self.free, start, size)
        if rank in self.reserved:  # its partition is now anyone's
            for start, size in self.reserved.pop(rank):
                _merge_into(self.free, start, size)
        return sum(s for _, s in ranges)

    def _ungrant(self, rank: int, start: int, size: int) -> None:
        held = self.granted.get(rank, [])
        for i, (s, z) in enumerate(held):
            if s <= start and start + size <= s + z:
                del held[i]
                _merge_into(held, s, start - s)
                _merge_into(held, start + size, s + z - start - size)
                return
        raise LedgerError(f"epoch {self.epoch}: [{start}, {start + size}) was not granted to rank {rank}")

    def _give_back(self, rank: int, start: int, size: int) -> None:
        if size <= 0:
            return
        _merge_into(self.reserved.get(rank, self.free), start, size)
