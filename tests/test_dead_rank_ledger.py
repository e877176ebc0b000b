"""What the ledger counts of a rank that died inside a window: one it never reported, or one it reported (pure logic).

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


# ---------------------------------------------------------------- a rank that reported, then died
# Cadence and Async report a window right after launching its average, which lands while the next
# window trains. A rank that dies after its report is counted by it; the next window's reports say
# whether any survivor kept that average (``WindowDone.dropped``): if none did, the dead rank's
# samples of that window are in no replica and go back to the pool.


def _closing_loop(mode: str, timed: int = 3) -> tuple[CadenceLoop, list]:
    """Two ranks, ``timed`` windows trained; every epoch the loop closes is collected."""
    loop = CadenceLoop(DdpRunConfig().with_mode(mode), [0, 1], dataset_len=4000, batch_size=10, epochs=3, seed=3)
    closed: list = []
    settle = loop.on_reports

    def collecting(*args, **kwargs):
        out = settle(*args, **kwargs)
        closed.extend(out)
        return out

    loop.on_reports = collecting  # type: ignore[method-assign]
    for _ in range(timed):
        _plan_and_fold(loop, {0: 1.0, 1: 2.0})
    return loop, closed


def _plan_and_fold(loop: CadenceLoop, speeds: dict[int, float], **kwargs) -> int:
    number = loop.window
    assert loop.next_windows(now=float(number)) is not None
    fold_window(loop, number, speeds, **kwargs)
    return number


def _finish(loop: CadenceLoop, closed: list) -> None:
    """Rank 0 alone trains what is left: every epoch closes (its ledger proved every position trained
    exactly once), and the rows count each sample once (the helper's rows put a window's samples in
    its first epoch, so only the run's total is exact)."""
    while not loop.finished:
        _plan_and_fold(loop, {0: 1.0})
    assert [e for s in closed for e in s.epochs] == [0, 1, 2]  # one row per close, a group's covering several
    assert sum(s.samples for s in closed) == 3 * 4000


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async"])
@pytest.mark.parametrize("kept", [True, False], ids=["a-survivor-kept-it", "every-survivor-gave-it-up"])
def test_a_rank_that_reported_then_died_is_counted_unless_no_survivor_kept_its_average(mode, kept):
    loop, closed = _closing_loop(mode)
    # window n: both train and report, but rank 1 dies before n settles (its report is in hand)
    n = loop.window
    assert loop.next_windows(now=float(n)) is not None
    loop.remove_ranks({1})
    before = loop.regranted
    fold_window(loop, n, {0: 1.0, 1: 2.0})
    assert loop.regranted == before  # counted by its report: not granted again yet
    assert loop.landing[1].window == n
    # window n + 1 (planned without it): rank 0's report says whether its average of n landed
    _plan_and_fold(loop, {0: 1.0}, dropped={} if kept else {0: n})
    assert 1 not in loop.landing
    assert (loop.regranted > before) is not kept  # given back only when no replica holds it
    _finish(loop, closed)
    assert loop.late == 0


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async"])
def test_a_settled_window_whose_average_every_survivor_gave_up_goes_back(mode):
    loop, closed = _closing_loop(mode)
    n = _plan_and_fold(loop, {0: 1.0, 1: 2.0})  # settled with rank 1's report: counted
    m1 = loop.window
    assert loop.next_windows(now=float(m1)) is not None
    granted = loop.plans[m1][1].samples
    consumed = loop.landing[1].consumed
    loop.remove_ranks({1})  # it dies in window n + 1, while n's average runs: rank 0's fails
    before = loop.regranted
    fold_window(loop, m1, {0: 1.0}, dead_batches={1: 2}, dropped={0: n})
    assert loop.regranted - before == granted + consumed  # its unreported window, and n's work too
    _finish(loop, closed)


def test_a_give_up_found_after_the_epoch_closed_reopens_it_for_those_samples():
    """A window that closed its epoch, whose average every survivor then gave up: the epoch is
    reopened for the dead rank's positions alone; they are trained again before any later epoch
    closes, and the epoch's close is not reported twice (``late`` counts them for the summary)."""
    loop, closed = _closing_loop("nccl-cadence")
    while True:  # a window that closes an epoch with some of rank 1's samples of it
        n = _plan_and_fold(loop, {0: 1.0, 1: 2.0})
        landing = loop.landing[1]
        plan, consumed = landing.plan, landing.consumed
        assert landing.window == n
        late = sum(used for g, used in plan.consumed_per_grant(consumed) if g.epoch not in loop.dispatcher.pools)
        if late:
            break
        assert not loop.finished
    reopened = min(g.epoch for g in plan.grants)
    m1 = loop.window
    assert loop.next_windows(now=float(m1)) is not None
    before = loop.regranted
    loop.remove_ranks({1})
    fold_window(loop, m1, {0: 1.0}, dead_batches={1: 0}, dropped={0: n})
    assert loop.late == late and loop.regranted - before >= consumed
    assert loop.dispatcher.pools[reopened].remaining == late  # only those positions are open again
    _finish(loop, closed)  # each epoch closed once, every position trained
    assert reopened not in loop.dispatcher.reopened


# ------------------------------------------------------------- the CPU backend: the server knows


class _Server:
    """The averaging server's record of rounds (averaging/server.py ``landed``), as a test sets it."""

    def __init__(self) -> None:
        self.rounds: dict[int, set[int]] = {}  # round -> ranks whose snapshot it folded whole

    def landed(self, number: int, rank: int) -> bool | None:
        done = self.rounds.get(number)
        return None if done is None else rank in done


@pytest.mark.parametrize("folded", [True, False], ids=["its-snapshot-folded", "the-round-went-on-without-it"])
def test_cpu_a_rank_that_reported_then_died_is_settled_by_the_servers_round(folded):
    loop, closed = _closing_loop("cpu-cadence")
    server = loop.snapshots = _Server()
    n = loop.window
    assert loop.next_windows(now=float(n)) is not None
    round_n = loop.end_round[n]
    loop.remove_ranks({1})
    before = loop.regranted
    fold_window(loop, n, {0: 1.0, 1: 2.0})  # its report is in: counted for now
    assert loop.regranted == before and loop.landing[1].round == round_n
    _plan_and_fold(loop, {0: 1.0})  # the round is still open: not known yet
    assert 1 in loop.landing
    server.rounds[round_n] = {0, 1} if folded else {0}
    _plan_and_fold(loop, {0: 1.0})
    assert 1 not in loop.landing
    assert (loop.regranted > before) is not folded
    _finish(loop, closed)


def test_a_reopened_epoch_stays_closed_once_across_a_resume():
    """A checkpoint taken while an epoch is reopened for a dead rank's positions: the resumed run
    trains those positions and every later epoch, and reports no epoch it had closed again."""
    loop, closed = _closing_loop("nccl-cadence")
    while True:  # as above: a window that closed an epoch with some of rank 1's samples of it
        n = _plan_and_fold(loop, {0: 1.0, 1: 2.0})
        landing = loop.landing[1]
        if any(g.epoch not in loop.dispatcher.pools and used for g, used in landing.plan.consumed_per_grant(landing.consumed)):
            break
    m1 = loop.window
    assert loop.next_windows(now=float(m1)) is not None
    loop.remove_ranks({1})
    fold_window(loop, m1, {0: 1.0}, dead_batches={1: 0}, dropped={0: n})
    assert loop.dispatcher.reopened
    meta = {"coverage": loop.coverage(), "global_step": loop.global_step}
    done = [s.epoch for s in closed]
    resumed, after = _closing_loop("nccl-cadence", timed=0)  # a fresh loop, as a resumed run builds it
    resumed.restore(meta)
    assert resumed.dispatcher.reopened == loop.dispatcher.reopened
    while not resumed.finished:
        _plan_and_fold(resumed, {0: 1.0, 1: 1.0})
    assert sorted(done + [s.epoch for s in after]) == [0, 1, 2]  # each epoch closed once over both runs
