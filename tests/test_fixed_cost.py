"""A window's fixed cost (issue 22) as the cadence loop keeps it and hands it to ElChe (pure logic):
what the controller spends planning and settling a window, whatever the model, held to 2% of the
window (ElChe's own side: tests/test_elche.py)."""

from __future__ import annotations

import pytest

from flodl.config import DdpRunConfig
from flodl.plan.cadence import FIXED_COST_WINDOWS, CadenceLoop
from tests.helpers.windows import fold_window

pytestmark = pytest.mark.timeout(30)


def test_the_loop_reads_the_median_fixed_cost_and_the_summary_holds_it():
    """One GC pause among the windows' fixed costs must not grow every window after it."""
    loop = CadenceLoop(DdpRunConfig().with_mode("cpu-cadence"), [0, 1], dataset_len=4000, batch_size=10, epochs=2, seed=3)
    assert loop.fixed_ms == 0.0
    for ms in (0.8, 0.9, 120.0, 0.7, 1.0):
        loop.note_fixed(ms)
    assert loop.fixed_ms == pytest.approx(0.9)
    assert loop.telemetry()["fixed_ms"] == pytest.approx(0.9)
    for _ in range(FIXED_COST_WINDOWS):
        loop.note_fixed(2.0)
    assert loop.fixed_ms == 2.0  # only the last FIXED_COST_WINDOWS count


def test_the_loop_hands_elche_the_fixed_cost_of_full_windows():
    """Windows of 1 ms batches with 10 ms of fixed cost each: the anchor grows past its start."""
    loop = CadenceLoop(DdpRunConfig().with_mode("nccl-cadence"), [0, 1], dataset_len=40_000, batch_size=10, epochs=4, seed=3)
    start = loop.elche.anchor
    for _ in range(8):
        number = loop.window
        assert loop.next_windows(now=float(number)) is not None
        loop.note_fixed(10.0)
        fold_window(loop, number, {0: 1.0, 1: 1.0})
    assert loop.elche.anchor > start or loop.elche.pending_anchor is not None
