"""The coverage ledger: grants, partial settles, give-backs, reclaims; never a sample lost or repeated."""

from __future__ import annotations

import random

import pytest

from flodl.plan.pool import EpochPool, LedgerError

pytestmark = pytest.mark.timeout(30)


def test_take_is_monotonic_and_disjoint():
    pool = EpochPool(0, 100)
    a = pool.take(0, 30)
    b = pool.take(1, 30)
    c = pool.take(0, 100)
    assert a == [(0, 30)] and b == [(30, 30)] and c == [(60, 40)]
    assert pool.take(1, 10) == [] and pool.remaining == 0 and pool.outstanding == 100
    pool.check()


def test_partial_settle_gives_the_rest_back_and_it_is_granted_again():
    pool = EpochPool(0, 100)
    grant = pool.take(0, 40)
    assert pool.settle(0, grant, 25) == 25
    assert pool.free == [(25, 75)]
    assert pool.take(1, 20) == [(25, 20)]
    pool.check()


def test_settle_refuses_ranges_not_granted_or_already_trained():
    pool = EpochPool(0, 10)
    grant = pool.take(0, 10)
    with pytest.raises(LedgerError):
        pool.settle(1, grant, 10)
    pool.settle(0, grant, 10)
    with pytest.raises(LedgerError):
        pool.settle(0, grant, 10)
    assert pool.done


def test_reclaim_returns_a_dead_ranks_grants():
    pool = EpochPool(0, 64)
    pool.take(0, 16)
    g1 = pool.take(1, 16)
    pool.settle(1, g1, 8)
    pool.take(1, 8)
    assert pool.reclaim(1) == 8  # only what it still held; its trained 8 stay trained
    assert pool.remaining == 64 - 16 - 8 and pool.outstanding == 16
    pool.check()


def test_non_progressive_partitions_are_proportional_and_private():
    pool = EpochPool(0, 900)
    pool.partition({0: 3.0, 1: 2.0, 2: 1.0}, batch_size=1)
    assert [pool.remaining_for(r) for r in range(3)] == [450, 300, 150]
    assert pool.take(2, 1000) == [(750, 150)]
    assert pool.take(2, 1) == []
    pool.check()


def test_uncovered_is_what_a_resume_must_train():
    pool = EpochPool(3, 50)
    g = pool.take(0, 20)
    pool.settle(0, g, 10)
    pool.take(1, 5)
    assert pool.uncovered() == [(10, 40)]


def test_random_schedules_cover_every_position_exactly_once():
    rng = random.Random(5)
    for trial in range(200):
        total = rng.randint(0, 500)
        pool = EpochPool(trial, total)
        held: dict[int, list] = {}
        seen = [0] * total
        steps = 0
        while not pool.done:
            steps += 1
            assert steps < 10_000
            rank = rng.randrange(4)
            if rank in held and rng.random() < 0.6:
                ranges = held.pop(rank)
                granted = sum(s for _, s in ranges)
                consumed = rng.randint(0, granted)
                left = consumed
                for start, size in ranges:
                    for p in range(start, start + min(size, left)):
                        seen[p] += 1
                    left -= min(size, left)
                pool.settle(rank, ranges, consumed)
            elif rank in held and rng.random() < 0.05:
                held.pop(rank)
                pool.reclaim(rank)
            elif rank not in held:
                ranges = pool.take(rank, rng.randint(1, 64))
                if ranges:
                    held[rank] = ranges
            pool.check()
        assert seen == [1] * total


def test_share_free_extends_partitions_batch_aligned_and_loses_nothing():
    pool = EpochPool(0, 100)
    pool.partition({0: 1.0, 1: 1.0, 2: 1.0}, 10)
    pool.reclaim(1)  # rank 1 died before training: its partition is free
    pool.share_free([0, 2], 10)
    assert pool.free == []
    assert pool.remaining_for(0) + pool.remaining_for(2) == 100
    assert pool.remaining_for(0) - 40 in (0, 10, 20) and pool.remaining_for(0) % 10 == 0
