"""Timeline: Chrome-trace output, bounded ring, thread safety, clock alignment, validator."""

from __future__ import annotations

import json
import math
import threading

import pytest

from flodl.monitor.timeline import ClockAlign, NullTimeline, Timeline, validate_chrome_trace

CTRL = ("controller", "cadence")
RANK1 = ("rank 1 (cuda:0@hostA)", "train")


def _roundtrip(tl: Timeline) -> dict:
    return json.loads(json.dumps(tl.to_chrome_trace(), allow_nan=False))


def _body(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] != "M"]


def _sample_timeline(clock) -> Timeline:
    tl = Timeline(clock=clock)
    t0 = clock()
    tl.span("sync", track=CTRL, start_s=t0 + 0.5, end_s=t0 + 0.75, args={"round": 3})
    tl.instant("epoch 1", track=CTRL, at_s=t0 + 0.1, scope="g")
    tl.counter("anchor", track=CTRL, at_s=t0 + 0.2, values={"anchor": 12, "share_r1": 0.4})
    tl.span("window", track=RANK1, start_s=t0 + 0.3, end_s=t0 + 0.9)
    clock.advance(1.0)
    with tl.measure("eval", track=CTRL):
        clock.advance(0.25)
    return tl


def test_trace_validates_and_roundtrips(clock):
    trace = _roundtrip(_sample_timeline(clock))
    assert validate_chrome_trace(trace) == []
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"]["dropped_events"] == 0
    names = [e["name"] for e in _body(trace)]
    assert names == ["epoch 1", "anchor", "window", "sync", "eval"]


def test_times_are_microseconds_from_start(clock):
    by_name = {e["name"]: e for e in _body(_roundtrip(_sample_timeline(clock)))}
    assert by_name["sync"]["ts"] == pytest.approx(500_000)
    assert by_name["sync"]["dur"] == pytest.approx(250_000)
    assert by_name["eval"]["ts"] == pytest.approx(1_000_000)
    assert by_name["eval"]["dur"] == pytest.approx(250_000)
    assert by_name["epoch 1"]["s"] == "g"
    assert by_name["anchor"]["args"] == {"anchor": 12, "share_r1": 0.4}


def test_events_sorted_by_ts(clock):
    tl = Timeline(clock=clock)
    for t in (5.0, 1.0, 3.0, 2.0, 4.0):
        tl.instant(f"at {t}", track=CTRL, at_s=clock() + t)
    ts = [e["ts"] for e in tl.to_chrome_trace()["traceEvents"]]
    assert ts == sorted(ts)


def test_metadata_names_every_track(clock):
    trace = _sample_timeline(clock).to_chrome_trace()
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["args"]["name"]: e["pid"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    sorted_pids = {e["pid"] for e in meta if e["name"] == "process_sort_index"}
    assert set(processes) == {CTRL[0], RANK1[0]}
    assert threads == {(processes[CTRL[0]], CTRL[1]), (processes[RANK1[0]], RANK1[1])}
    assert sorted_pids == set(processes.values())


def test_track_ids_are_stable_and_distinct(clock):
    tl = Timeline(clock=clock)
    tracks = [("controller", "cadence"), ("controller", "io"), ("rank 0", "train"), ("controller", "cadence")]
    for i, track in enumerate(tracks):
        tl.instant(str(i), track=track, at_s=clock())
    ids = {e["name"]: (e["pid"], e["tid"]) for e in _body(tl.to_chrome_trace())}
    assert ids["0"] == ids["3"]
    assert len({ids["0"], ids["1"], ids["2"]}) == 3
    assert ids["0"][0] == ids["1"][0] != ids["2"][0]


def test_sort_process_overrides_order(clock):
    tl = Timeline(clock=clock)
    tl.instant("x", track=("rank 1", "train"), at_s=clock())
    tl.sort_process("controller", -1)
    meta = {(e["pid"], e["name"]): e["args"] for e in tl.to_chrome_trace()["traceEvents"] if e["ph"] == "M"}
    names = {a["name"]: pid for (pid, n), a in meta.items() if n == "process_name"}
    assert meta[(names["controller"], "process_sort_index")] == {"sort_index": -1}


def test_bounded_buffer_drops_oldest_and_counts(clock):
    tl = Timeline(clock=clock, max_events=3)
    for i in range(5):
        tl.instant(f"e{i}", track=CTRL, at_s=clock() + i)
    trace = tl.to_chrome_trace()
    assert [e["name"] for e in _body(trace)] == ["e2", "e3", "e4"]
    assert tl.dropped == 2 and trace["otherData"]["dropped_events"] == 2
    assert validate_chrome_trace(trace) == []


def test_concurrent_recording_keeps_every_event(clock):
    tl = Timeline(clock=clock)
    threads_n, per_thread = 8, 2_000
    start = threading.Barrier(threads_n)

    def record(k: int) -> None:
        start.wait()
        track = (f"rank {k}", "train")
        for i in range(per_thread):
            tl.span("step", track=track, start_s=clock(), end_s=clock() + 0.001, args={"i": i})

    workers = [threading.Thread(target=record, args=(k,)) for k in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    trace = tl.to_chrome_trace()
    assert len(_body(trace)) == threads_n * per_thread == len(tl)
    assert tl.dropped == 0
    assert len({e["pid"] for e in _body(trace)}) == threads_n


def test_nan_and_infinity_are_sanitized(clock, tmp_path):
    tl = Timeline(clock=clock)
    tl.span("sync", track=CTRL, start_s=clock(), end_s=clock() + 1, args={"loss": math.nan, "nested": [math.inf, 1.0], "obj": object()})
    tl.counter("anchor", track=CTRL, at_s=clock(), values={"ok": 1.5, "bad": math.nan, "flag": True})
    tl.instant("lost", track=CTRL, at_s=math.nan)
    path = tl.write(tmp_path / "a" / "b" / "trace.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    trace = json.loads(text)
    assert validate_chrome_trace(trace) == []
    by_name = {e["name"]: e for e in _body(trace)}
    assert by_name["sync"]["args"]["loss"] is None
    assert by_name["sync"]["args"]["nested"] == [None, 1.0]
    assert by_name["anchor"]["args"] == {"ok": 1.5}
    assert "lost" not in by_name and tl.invalid == 1


def test_write_is_atomic_and_leaves_no_temp(clock, tmp_path):
    tl = _sample_timeline(clock)
    target = tmp_path / "trace.json"
    target.write_text("old")
    tl.write(target)
    assert validate_chrome_trace(json.loads(target.read_text())) == []
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_measure_records_errors_and_reraises(clock):
    tl = Timeline(clock=clock)
    with pytest.raises(KeyError), tl.measure("checkpoint", track=CTRL):
        clock.advance(0.5)
        raise KeyError("x")
    (ev,) = _body(tl.to_chrome_trace())
    assert ev["args"] == {"error": "KeyError"} and ev["dur"] == pytest.approx(500_000)


def test_offset_and_early_events_never_go_negative(clock):
    tl = Timeline(clock=clock)
    # A rank event that, after its offset, lands 2 s before the timeline started.
    tl.span("window", track=RANK1, start_s=100.0, end_s=101.0, offset_s=clock() - 102.0)
    tl.span("backwards", track=RANK1, start_s=clock() + 2, end_s=clock() + 1)
    trace = tl.to_chrome_trace()
    assert validate_chrome_trace(trace) == []
    by_name = {e["name"]: e for e in _body(trace)}
    assert by_name["window"]["ts"] == 0 and by_name["backwards"]["dur"] == 0
    assert trace["otherData"]["origin_s"] == pytest.approx(clock() - 2.0)


def test_instant_rejects_unknown_scope(clock):
    with pytest.raises(ValueError, match="scope"):
        Timeline(clock=clock).instant("x", track=CTRL, scope="q")


def test_null_timeline_records_nothing(clock):
    tl = NullTimeline(clock=clock)
    tl.span("sync", track=CTRL, start_s=0, end_s=1)
    with tl.measure("eval", track=CTRL):
        pass
    trace = tl.to_chrome_trace()
    assert trace["traceEvents"] == [] and validate_chrome_trace(trace) == []


# ---- ClockAlign --------------------------------------------------------------


def test_clock_align_takes_the_least_delayed_pair():
    align = ClockAlign()
    true_offset = 5000.0
    for sent, delay in [(1.0, 0.004), (2.0, 0.0007), (3.0, 0.010), (4.0, 0.002)]:
        align.observe(sent, sent + true_offset + delay)
    assert align.offset_s == pytest.approx(true_offset + 0.0007)
    assert align.to_local(10.0) == pytest.approx(10.0 + true_offset + 0.0007)


def test_clock_align_window_follows_drift():
    align = ClockAlign(window=2)
    align.observe(0.0, 1.0)  # offset 1.0, then the remote clock drifts
    align.observe(1.0, 2.5)
    align.observe(2.0, 3.6)
    assert align.offset_s == pytest.approx(1.5)


def test_clock_align_needs_a_pair():
    align = ClockAlign()
    align.observe(math.nan, 1.0)
    assert align.offset_s is None
    with pytest.raises(LookupError):
        align.to_local(1.0)


# ---- validator -------------------------------------------------------------


def _trace(*events: dict) -> dict:
    return {"traceEvents": list(events)}


def _ev(**kw) -> dict:
    return {"name": "e", "ph": "i", "pid": 1, "tid": 1, "ts": 0, **kw}


def test_validator_accepts_balanced_b_e_and_nameless_e():
    trace = _trace(
        _ev(ph="B", name="a"), _ev(ph="B", name="b", ts=1), {"ph": "E", "pid": 1, "tid": 1, "ts": 2}, _ev(ph="E", name="a", ts=3)
    )
    assert validate_chrome_trace(trace) == []


@pytest.mark.parametrize(
    ("trace", "expected"),
    [
        ([], "top level must be an object"),
        ({"events": []}, "'traceEvents' missing or not a list"),
        (_trace({"name": "e", "pid": 1, "tid": 1, "ts": 0}), "event 0: missing 'ph'"),
        (_trace(_ev(ph="Z")), "event 0: unknown ph 'Z'"),
        (_trace(_ev(ph="X", dur=-1)), "'dur' must be a non-negative number, got -1"),
        (_trace(_ev(ph="X")), "'dur' must be a non-negative number, got None"),
        (_trace(_ev(ts=-5)), "'ts' must be a non-negative number, got -5"),
        (_trace(_ev(pid="1")), "'pid' missing or not an int"),
        (_trace(_ev(name=3)), "'name' missing or not a string"),
        (_trace(_ev(s="x")), "scope 's' must be g, p or t, got 'x'"),
        (_trace(_ev(ph="C", args={"v": "high"})), "counter arg 'v' is not a number ('high')"),
        (_trace(_ev(ph="C")), "'args' must be an object of numbers"),
        (_trace(_ev(ph="M", name="process_title", args={})), "unknown metadata name 'process_title'"),
        (_trace(_ev(ph="M", name="thread_name")), "M 'thread_name': 'args' missing"),
        (_trace(_ev(ph="B", name="sync")), "'B' 'sync' on pid=1 tid=1 never ended"),
        (_trace(_ev(ph="E", name="sync")), "'E' 'sync' on pid=1 tid=1 has no open 'B'"),
    ],
)
def test_validator_names_each_problem(trace, expected):
    problems = validate_chrome_trace(trace)
    assert len(problems) == 1, problems
    assert expected in problems[0]


def test_validator_b_e_balance_is_per_thread():
    trace = _trace(_ev(ph="B", name="a", tid=1), _ev(ph="E", name="a", tid=2, ts=1))
    problems = validate_chrome_trace(trace)
    assert any("tid=2 has no open 'B'" in p for p in problems)
    assert any("tid=1 never ended" in p for p in problems)


def test_validator_metadata_may_omit_ts():
    meta = {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "controller"}}
    assert validate_chrome_trace(_trace(meta)) == []
