"""The simulated slow rank of benchmarks and tests: FLODL_SIMULATE_SLOWDOWN paced by FLODL_SIMULATE_BASE_MS."""

from __future__ import annotations

import pytest

from flodl.config.env import (
    SIMULATE_BASE_MS,
    SIMULATE_SLOWDOWN,
    paced_step,
    parse_base_ms,
    parse_slowdown,
    simulated_base_ms,
    simulated_slowdown,
)

pytestmark = pytest.mark.timeout(30)


def test_paced_step_makes_the_period_factor_times_the_base():
    assert paced_step(1.0, 4.0, 2.5) == (9.0, 10.0)  # sleeps the rest of 4 x 2.5 ms
    assert paced_step(3.0, 4.0, 2.5) == (7.0, 10.0)  # a slow step after a sleep only shortens the next sleep
    assert paced_step(12.0, 4.0, 2.5) == (0.0, 12.0)  # never a negative sleep; the real time is reported
    assert paced_step(2.0, 1.0, 2.5) == (0.0, 2.0)  # factor 1: untouched


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
