"""What the ledger counts of a rank that died inside a window it never reported (pure logic).

Its batches count as trained only if they are in the consensus. A window averaged once at its
end (Cadence, Async) is reported right after that average is launched: a rank that died before
reporting never took part in it, so every grant of that window goes back to the survivors, however
many TimingMsgs it sent (they count batches trained on a replica that is gone). In Sync every
TimingMsg follows its round's average, which the survivors finished with it: those batches are in.
"""

from __future__ import annotations

import pytest

from flodl.config import DdpRunConfig
from flodl.plan.cadence import CadenceLoop
from tests.helpers.windows import fold_window

pytestmark = pytest.mark.timeout(30)


def _loop_with_a_death(mode: str, trained_before_death: int) -> tuple[CadenceLoop, int, int]:
    """Two ranks, a few windows timed; then rank 1 dies in the next window after
    ``trained_before_death`` batches. Returns the loop, rank 1's samples in that window, and the
    samples the loop gave back to the pool for it."""
    loop = CadenceLoop(DdpRunConfig().with_mode(mode), [0, 1], dataset_len=4000, batch_size=10, epochs=6, seed=3)
    for _ in range(3):
        number = loop.window
        assert loop.next_windows(now=float(number)) is not None
        fold_window(loop, number, {0: 1.0, 1: 2.0})
    number = loop.window
    assert loop.next_windows(now=float(number)) is not None
    held = loop.plans[number][1].samples
    before = loop.regranted
    loop.remove_ranks({1})
    fold_window(loop, number, {0: 1.0}, dead_batches={1: trained_before_death})
    return loop, held, loop.regranted - before


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async"])
def test_a_rank_dead_before_its_window_average_gives_back_all_of_that_window(mode):
    loop, held, regranted = _loop_with_a_death(mode, trained_before_death=3)
    assert held > 30 and regranted == held  # not held - 3 batches: those 30 samples never reached an average


def test_in_sync_the_rounds_a_dead_rank_finished_with_the_survivors_stay_trained():
    loop, held, regranted = _loop_with_a_death("nccl-sync", trained_before_death=2)
    assert held > 20 and regranted == held - 2 * 10  # Sync's window is an epoch of one-batch rounds
