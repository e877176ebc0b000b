"""The CPU averaging round core on its own: no socket, a fake endpoint and egress, a hand-driven clock."""

from __future__ import annotations

from collections import Counter

import torch

from flodl.averaging.rounds import Round, Rounds
from flodl.wire import messages as m

NUMELS = [4, 2]


class Endpoint:
    """Two sources on the wire; what goes out is recorded."""

    def __init__(self) -> None:
        self.live = lambda: {0, 1}
        self.sent: list[m.Update] = []

    def counted(self) -> set[int]:
        return self.live()

    def expected(self, number: int) -> set[int]:
        return {0, 1}

    def lane_ranks(self) -> set[int] | None:
        return None

    def accumulators(self, number: int, numels: list[int]) -> list[torch.Tensor]:
        return [torch.empty(n, dtype=torch.float32) for n in numels]

    def broadcast(self, header: m.Update, frames: list, *, lane: m.Update | None = None) -> None:
        self.sent.append(header)


class Egress:
    """Records the averages; ``done`` says whether a ready round ends here or is handed over."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.averages: dict[tuple[int, int], torch.Tensor] = {}
        self.overdue: list[int] = []

    async def slice_ready(self, rnd: Round, bucket: int, start: int, count: int) -> None:
        out, _ = rnd.averaged(bucket, start, count)
        self.averages[(bucket, start)] = out.clone()
        rnd.streamed.add((bucket, start))

    async def round_ready(self, rnd: Round) -> bool:
        for bucket, start, count in rnd.slices():  # what was not streamed goes out now, as SendBack's
            if (bucket, start) not in rnd.streamed:
                await self.slice_ready(rnd, bucket, start, count)
        return self.done

    def round_overdue(self, rnd: Round) -> None:
        self.overdue.append(rnd.number)


def snapshot(source: int, weight: float, bucket: int) -> m.Snapshot:
    return m.Snapshot(
        rank=source,
        round=0,
        weight=weight,
        ranks=1,
        folded=[],
        groups=["p", "b"],
        dtypes=["float32", "float32"],
        numels=NUMELS,
        bucket=bucket,
        start=0,
        count=NUMELS[bucket],
        shm="",
        shm_offset=0,
    )


def core(done: bool) -> tuple[Rounds, Endpoint, Egress, list[float]]:
    now = [0.0]
    endpoint, egress = Endpoint(), Egress(done)
    rounds = Rounds(
        endpoint=endpoint, egress=egress, timeout_s=5.0, clock=lambda: now[0], drops=Counter(), on_round=lambda number, ms: None
    )
    return rounds, endpoint, egress, now


async def feed(rounds: Rounds) -> None:
    for source, weight in ((0, 3.0), (1, 1.0)):
        for bucket in (0, 1):
            await rounds.take(source, snapshot(source, weight, bucket), torch.full((NUMELS[bucket],), float(source + 1)))


async def test_a_round_is_weighted_streamed_and_done():
    rounds, _, egress, _ = core(done=True)
    await feed(rounds)
    # parameters weigh by batches trained, buffers equally among the sources that trained
    assert torch.allclose(egress.averages[(0, 0)], torch.full((4,), (3 * 1 + 1 * 2) / 4))
    assert torch.allclose(egress.averages[(1, 0)], torch.full((2,), 1.5))
    assert rounds.rounds_done == 1 and rounds.current is None and rounds.next_round == 1


async def test_a_handed_over_round_waits_for_its_egress_and_is_given_up_after_the_timeout():
    rounds, endpoint, egress, now = core(done=False)
    await feed(rounds)
    rnd = rounds.current
    assert rnd is not None and rnd.handed_over and rounds.rounds_done == 0
    now[0] = 4.0
    await rounds.check()  # the core neither finishes nor aborts it: the egress owns its clock
    assert rounds.current is rnd and not egress.overdue and not endpoint.sent
    now[0] = 6.0
    await rounds.check()
    assert egress.overdue == [0]
    assert rounds.close(0, rnd, aborted=True) and endpoint.sent[-1].aborted and rounds.aborted == 1 and rounds.next_round == 1
    assert not rounds.close(0, rnd, aborted=True)  # a round already passed: nothing waits on it


async def test_a_source_that_dies_mid_snapshot_leaves_every_slice_a_true_average():
    # three sources, every weight known before the second bucket's folds (so they are pre-normalised
    # by the three's total); source 2 sends its first bucket, then dies: the second bucket must be
    # the average of the two that sent it, not that sum over the three's total (shrunk by a third)
    rounds, endpoint, egress, _ = core(done=True)
    live = {0, 1, 2}
    endpoint.live = lambda: set(live)
    endpoint.expected = lambda number: {0, 1, 2}  # type: ignore[method-assign]
    for source in (0, 1, 2):
        await rounds.take(source, snapshot(source, 1.0, 0), torch.full((4,), float(source + 1)))
    for source in (0, 1):
        await rounds.take(source, snapshot(source, 1.0, 1), torch.full((2,), float(source + 1)))
    live.discard(2)
    await rounds.check()
    assert rounds.rounds_done == 1
    assert torch.allclose(egress.averages[(0, 0)], torch.full((4,), 2.0))  # streamed with all three
    assert torch.allclose(egress.averages[(1, 0)], torch.full((2,), 1.5))  # the two that sent it


async def test_a_slice_goes_out_only_once_every_expected_source_folded_it():
    # source 2 is not expected in the round (it died after sending this round's snapshot ahead, its
    # slices held at the round's gate): its folds must not stand in for an expected source's, or a
    # slice would go out before rank 1's part of it is in (and rank 1's part would be lost)
    rounds, endpoint, egress, _ = core(done=True)
    order = [(2, 0), (0, 0), (1, 0), (2, 1), (0, 1)]
    for source, bucket in order:
        await rounds.take(source, snapshot(source, 1.0, bucket), torch.full((NUMELS[bucket],), float(source + 1)))
    assert (1, 0) not in egress.averages  # rank 1's part of bucket 1 is not in yet
    await rounds.take(1, snapshot(1, 1.0, 1), torch.full((2,), 2.0))
    assert rounds.rounds_done == 1
    # every slice is the average of what it holds: source 2's complete snapshot included
    assert torch.allclose(egress.averages[(0, 0)], torch.full((4,), 2.0))
    assert torch.allclose(egress.averages[(1, 0)], torch.full((2,), 2.0))
