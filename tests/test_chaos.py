"""The chaos benchmark's pure parts: the fault plan, percentiles and goal checks.

The benchmark itself (``python bench/chaos.py``) starts real runs and is run on purpose, never here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.chaos import CPU_MODES, KINDS, MODES, Plan, Result, make_plans, percentile, plans_for, rows_for, traceback_in  # noqa: E402


def test_percentile_interpolates_like_numpy():
    xs = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(xs, 50) == 5.5
    assert percentile(xs, 100) == 10.0
    assert percentile(xs, 0) == 1.0
    assert math.isclose(percentile(xs, 99), 9.91)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_one_plan_per_kind_and_mode_covers_every_pair_and_repeats_with_the_seed():
    plans = make_plans(len(KINDS) * len(MODES), seed=4, epochs=6)
    # a death halfway through a snapshot is the CPU backend's: a collective has no snapshot slices
    assert {(p.kind, p.mode) for p in plans} == {(k, m) for k in KINDS for m in (CPU_MODES if k == "slice" else MODES)}
    assert all(2 <= p.batch <= 6 for p in plans if p.kind in ("reported", "slice"))  # a window every mode reaches
    assert all(p.victim != 0 and 0 < p.at < 1 and p.batch >= 2 for p in plans)
    assert make_plans(len(plans), seed=4, epochs=6) == plans
    assert make_plans(len(plans), seed=5, epochs=6) != plans


def _result(kind, *, detect=None, again=None, failures=(), landed=True):
    return Result(Plan(0, kind, "cpu-sync", 1, 0.5, 10), landed=landed, failures=list(failures), detect_s=detect, again_s=again)


def _row(rows, case, metric):
    [row] = [r for r in rows if r.case == case and r.metric == metric]
    return row


def test_rows_check_each_goal():
    results = [
        _result("kill", detect=0.05, again=0.2),
        _result("kill", detect=0.08, again=4.0),
        _result("stop", detect=3.4, again=0.1, failures=["samples per epoch [512, 500], want 512 x 2"]),
        _result("stuck", detect=3.3, again=None),  # the run ended before every survivor averaged
        _result("stuck", landed=False),
        _result("ctl-kill", failures=["bundle not loadable: CheckpointError: x"]),
        _result("slow-build"),
        _result("reported", again=0.3),
        _result("slice", again=0.2),
    ]
    rows = rows_for(results)
    assert _row(rows, "kill", "detection max").met is True
    assert _row(rows, "kill", "averaging again max").value == 4.0
    assert _row(rows, "kill", "averaging again max").met is True  # <= 5 s
    assert _row(rows, "kill", "averaging again p99").met is False  # > 3 s
    assert _row(rows, "kill", "averaging again p50").goal is None
    assert _row(rows, "kill", "runs lost").met is True
    assert _row(rows, "stop", "detection p99").met is True  # <= heartbeat 3 s + 1 s
    assert _row(rows, "stop", "runs losing samples").value == 1 and _row(rows, "stop", "runs lost").met is False
    assert _row(rows, "stuck", "faults landed").value == 1
    assert _row(rows, "stuck", "again not measured").value == 1
    assert _row(rows, "stuck", "averaging again p99").met is None  # nothing measured: no verdict
    assert _row(rows, "ctl-kill", "no loadable bundle").met is False
    assert not [r for r in rows if r.case == "slow-build" and r.metric.startswith("detection")]
    # the rank kills itself: no outside clock to time detection by, but the survivors' recovery is timed
    assert not [r for r in rows if r.case == "reported" and r.metric.startswith("detection")]
    assert _row(rows, "reported", "averaging again p99").met is True
    assert not [r for r in rows if r.case == "slice" and r.metric.startswith("detection")]
    assert _row(rows, "slice", "averaging again p99").met is True
    assert _row(rows, "all", "runs lost").value == 2


def test_every_other_kill_heals_and_the_quick_set_has_one():
    plans = make_plans(6 * len(KINDS), seed=4, epochs=6)
    kills = sorted((p for p in plans if p.kind == "kill"), key=lambda p: p.index)
    assert [p.heal for p in kills] == [True, False] * 3
    assert not [p for p in plans if p.heal and p.kind != "kill"]
    hosts = sorted((p for p in plans if p.kind == "host"), key=lambda p: p.index)
    assert [p.whole for p in hosts] == [True, False] * 3  # every other lost host loses every process at once
    assert {p.victim for p in hosts} <= {1, 2} and not [p for p in plans if p.whole and p.kind != "host"]
    assert [p for p in make_plans(len(KINDS), seed=0, epochs=4) if p.heal]
    assert sorted(p.kind for p in make_plans(len(KINDS), seed=0, epochs=4)) == sorted(KINDS)  # --quick: one of each kind


def test_kinds_pick_their_runs_of_the_whole_plan():
    whole = make_plans(20 * len(KINDS), seed=1, epochs=8)
    hosts = plans_for(("host",), 20, 20, seed=1, epochs=8)
    assert hosts == [p for p in whole if p.kind == "host"] and len(hosts) == 20
    assert plans_for(("host", "kill"), 5, 20, seed=1, epochs=8) == [p for p in whole if p.kind in ("host", "kill")][:5]
    assert plans_for(KINDS, 3, 20, seed=1, epochs=8) == make_plans(3, seed=1, epochs=8)


def test_heal_rows_count_only_runs_back_at_full_size():
    healed = Result(Plan(5, "kill", "cpu-sync", 1, 0.5, 10, heal=True), detect_s=0.02, again_s=0.3, healed_s=4.5)
    too_late = Result(Plan(15, "kill", "cpu-async", 2, 0.7, 10, heal=True), detect_s=0.03, again_s=0.2)
    rows = rows_for([healed, too_late, _result("kill", detect=0.05, again=0.2)])
    assert _row(rows, "kill", "healing runs").value == 2
    assert _row(rows, "kill", "healed (world back to full size)").value == 1
    assert _row(rows, "kill", "back to full size max").value == 4.5


def test_a_traceback_in_a_log_is_found_with_its_exception_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        'epoch 8/8  loss 0.08\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\nRuntimeError: boom\ndone in 4.8 s\n'
    )
    assert traceback_in(log) == "RuntimeError: boom"
    log.write_text("epoch 8/8  loss 0.08\ndone in 4.8 s\n")
    assert traceback_in(log) is None


# ---------------------------------------------------------------- the soak (bench/soak.py)


def test_a_soak_fault_is_timed_on_the_outside_clock_from_the_summary():
    from bench.soak import Hit, match

    start = 1000.0  # training began (Unix time)
    summary = {
        "trained_unix": [start, start + 100.0],
        "faults": [  # at_s: the controller's estimate of the moment, seconds into training
            {"rank": 1, "at_s": 9.9, "detect_s": 0.2, "recovered_s": 0.6, "full_size_s": 2.1, "lost_samples": 32},
            {"rank": 4, "at_s": 30.0, "detect_s": 3.0, "recovered_s": 3.5, "full_size_s": None, "lost_samples": 0},
            {"rank": 5, "at_s": 30.1, "detect_s": 3.1, "recovered_s": 3.4, "full_size_s": None, "lost_samples": 16},
        ],
    }
    kill, host, missed = Hit(0, "kill", [1], start + 10.0), Hit(1, "host", [4, 5], start + 29.9), Hit(2, "kill", [7], start + 50.0)
    match([kill, host, missed], summary)
    assert kill.found and math.isclose(kill.detect_s, 0.1) and math.isclose(kill.recovered_s, 0.5) and math.isclose(kill.full_s, 2.0)
    assert kill.lost == 32 and math.isclose(kill.at_s, 10.0)
    # a host: its last rank found and back, every rank's lost work; never whole again (nothing restarted there)
    assert (
        host.found and math.isclose(host.detect_s, 3.3) and math.isclose(host.recovered_s, 3.6) and host.full_s is None and host.lost == 16
    )
    assert not missed.found and missed.detect_s is None


def test_soak_rows_hold_goodput_to_the_goal_and_count_every_unrecovered_fault():
    from bench.soak import GOAL, SAMPLES, Hit, soak_rows

    hits = [Hit(0, "kill", [1], 0.0, detect_s=0.05, recovered_s=0.5, full_s=3.0, lost=32), Hit(1, "stop", [2], 0.0, detect_s=3.1)]
    summary = {
        "goodput": 0.985,
        "history": [
            {"epoch": 0, "samples": SAMPLES, "epoch_samples": {"0": SAMPLES}},
            {"epoch": 1, "samples": SAMPLES - 16, "epoch_samples": {"1": SAMPLES - 16}},
        ],
        "goodput_detail": {"training_s": 60.0, "lost_samples": 32},
        "wall_s": 61.0,
        "final_eval": 0.99,
    }
    rows = soak_rows(hits, summary, [], epochs=2)
    assert _row(rows, "soak", "goodput").met is True and _row(rows, "soak", "goodput").goal == GOAL
    assert _row(rows, "soak", "samples lost or repeated").value == 16 and _row(rows, "soak", "samples lost or repeated").met is False
    assert _row(rows, "soak", "faults without a recovery").value == 1  # the stop: the run ended before its survivors averaged
    assert _row(rows, "kill", "lost work").value == 32 and _row(rows, "stop", "detection max").value == 3.1
    assert _row(soak_rows(hits, {**summary, "goodput": 0.9}, ["exit code 1"], epochs=2), "soak", "runs lost").met is False


def test_a_soak_checks_each_epoch_of_a_row_that_one_average_closed_and_no_merged_row_passes():
    """A row of epochs one average closed (``first_epoch`` to ``epoch``) keeps each epoch's samples; a
    long run's merged middle rows keep none: the soak reads the first and counts the second as wrong
    (before, a 5-minute soak's merged rows of 9,600 samples read as two epochs' worth in one: run lost)."""
    from bench.chaos import epoch_samples
    from bench.soak import SAMPLES, soak_rows

    grouped = {"epoch": 2, "first_epoch": 1, "samples": 2 * SAMPLES, "epoch_samples": {"1": SAMPLES, "2": SAMPLES}}
    history = [{"epoch": 0, "samples": SAMPLES, "epoch_samples": {"0": SAMPLES}}, grouped]
    assert epoch_samples(history) == [SAMPLES] * 3
    summary = {"goodput": 0.99, "history": history, "goodput_detail": {"training_s": 60.0}, "wall_s": 61.0, "final_eval": 0.99}
    assert _row(soak_rows([], summary, [], epochs=3), "soak", "samples lost or repeated").value == 0
    merged = {**grouped, "merged_rows": 2}
    del merged["epoch_samples"]
    assert epoch_samples([history[0], merged]) == [SAMPLES, None, None]
