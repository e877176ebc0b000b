"""The simulated slow rank of benchmarks and tests: FLODL_SIMULATE_SLOWDOWN paced by FLODL_SIMULATE_BASE_MS,
or live by the step time full-speed ranks post on FLODL_SIMULATE_PACE_FILE's board."""

from __future__ import annotations

import pytest

from flodl.config.env import (
    SIMULATE_BASE_MS,
    SIMULATE_PACE_FILE,
    SIMULATE_SLOWDOWN,
    live_base_ms,
    paced_step,
    pacing_late_ms,
    parse_base_ms,
    parse_slowdown,
    simulated_base_ms,
    simulated_pace_file,
    simulated_slowdown,
)
from flodl.testing.pace_board import PaceBoard

pytestmark = pytest.mark.timeout(30)


def test_paced_step_makes_the_period_factor_times_the_base():
    assert paced_step(1.0, 4.0, 2.5) == (9.0, 10.0)  # sleeps the rest of 4 x 2.5 ms
    assert paced_step(3.0, 4.0, 2.5) == (7.0, 10.0)  # a slow step after a sleep only shortens the next sleep
    assert paced_step(12.0, 4.0, 2.5) == (0.0, 12.0)  # never a negative sleep; the real time is reported
    assert paced_step(2.0, 1.0, 2.5) == (0.0, 2.0)  # factor 1: untouched


def test_a_sleep_that_overshoots_is_taken_off_the_next_one_so_the_mean_period_is_exact():
    # a VM's sleep overshoots by a steady 0.25 ms: without the carry every paced step would take
    # 4.25 ms instead of 4.0 (a 4.25:1 pair); with it the overruns cancel out
    base, factor, compute, overshoot = 1.0, 4.0, 1.0, 0.25
    late, total = 0.0, 0.0
    for _ in range(400):
        sleep, _ = paced_step(compute, factor, base, late)
        step = compute + sleep + overshoot
        late = pacing_late_ms(late, step, factor, base)
        total += step
    assert total / 400 == pytest.approx(4.0, abs=0.01)
    assert pacing_late_ms(0.0, 30.0, 4.0, 1.0) == 4.0  # a long stall (an average) is not caught up beyond one period
    assert pacing_late_ms(0.0, 3.0, 4.0, None) == 0.0 and pacing_late_ms(0.0, 3.0, 1.0, 1.0) == 0.0  # not paced


def test_paced_step_without_a_base_keeps_the_old_rule():
    # sleep (f - 1) x compute, report f x compute (the docstring says it overshoots)
    assert paced_step(2.0, 4.0, None) == (6.0, 8.0)
    assert paced_step(2.0, 1.0, None) == (0.0, 2.0)


def test_base_ms_syntax():
    assert parse_base_ms("", 1) is None
    assert parse_base_ms("2.5", 1) == 2.5 and parse_base_ms("2.5", 0) == 2.5  # one number: every rank
    assert parse_base_ms("1:2.5", 1) == 2.5 and parse_base_ms("1:2.5", 0) is None
    assert parse_base_ms("1:2.5,3", 0) == 3.0 and parse_base_ms(" 1:2.5 , 2:4 ", 2) == 4.0  # a bare number: the default
    for bad in ("x", "1:", "1:-2", "0", "1:nan", "1:inf", "a:2", "1:2,1:3", "2,3"):
        with pytest.raises(ValueError, match=SIMULATE_BASE_MS):
            parse_base_ms(bad, 1)
    with pytest.raises(ValueError, match="--base-ms"):
        parse_base_ms("oops", 1, "--base-ms")


def test_slowdown_syntax():
    assert parse_slowdown("", 1) == 1.0 and parse_slowdown("1:4", 1) == 4.0 and parse_slowdown("1:4", 0) == 1.0
    for bad in ("4", "1:0.5", "1:x", "1:nan", "1:inf"):
        with pytest.raises(ValueError, match=SIMULATE_SLOWDOWN):
            parse_slowdown(bad, 1)


def test_the_variables_are_read(monkeypatch):
    monkeypatch.setenv(SIMULATE_SLOWDOWN, "1:4")
    monkeypatch.setenv(SIMULATE_BASE_MS, "1:2.5")
    assert simulated_slowdown(1) == 4.0 and simulated_base_ms(1) == 2.5 and simulated_base_ms(0) is None
    monkeypatch.setenv(SIMULATE_BASE_MS, "1:zero")
    with pytest.raises(ValueError, match=SIMULATE_BASE_MS):
        simulated_base_ms(1)


def test_the_pace_board_carries_a_running_mean_from_its_publisher_to_its_readers(tmp_path):
    path = str(tmp_path / "pace.board")
    reader = PaceBoard(path)  # a paced rank may open the board before anyone posts
    assert reader.base_ms() is None
    writer = PaceBoard(path)
    writer.publish(2.0)
    assert reader.base_ms() == 2.0  # the first step is the mean
    for _ in range(400):
        writer.publish(4.0)
    assert reader.base_ms() == pytest.approx(4.0, rel=1e-4)  # it follows the publisher's pace
    writer.publish(400.0)  # one long step (a GC pause, an average landing) moves it by 1/32 of the gap
    assert 4.0 < reader.base_ms() < 20.0
    writer.publish(0.0)  # a step with no time is no reading
    writer.publish(float("nan"))
    assert 4.0 < reader.base_ms() < 20.0
    again = PaceBoard(path)  # a late opener sees what is posted, and does not reset it
    assert again.base_ms() == reader.base_ms()
    for board in (reader, writer, again):
        board.close()


def test_the_pace_file_variable_is_read(monkeypatch):
    monkeypatch.delenv(SIMULATE_PACE_FILE, raising=False)
    assert simulated_pace_file() is None
    monkeypatch.setenv(SIMULATE_PACE_FILE, "/tmp/x.board")
    assert simulated_pace_file() == "/tmp/x.board"


def test_a_live_base_stays_within_its_band_of_the_fixed_one():
    assert live_base_ms(None, 2.0) == 2.0 and live_base_ms(None, None) is None  # nothing posted: the fixed base
    assert live_base_ms(2.4, 2.0) == 2.4 and live_base_ms(3.0, None) == 3.0  # the partner's pace, as posted
    # a fast step that holds a wait for the paced rank would feed back into the pace: it is capped
    assert live_base_ms(80.0, 2.0) == pytest.approx(3.0) and live_base_ms(0.1, 2.0) == pytest.approx(2.0 / 1.5)
