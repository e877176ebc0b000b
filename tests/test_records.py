"""The monitor record stream: rollup law, tree shaping, alerts, sub-epoch cadence,
the on-disk ring and the reader. Pure or tmp_path-only; no sockets, no sleeps."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from collections import Counter

import pytest

from flodl.config import Reduction
from flodl.monitor import reader
from flodl.monitor.record_log import RecordLog
from flodl.monitor.records import (
    AlertLane,
    SubEpochReporter,
    encode,
    epoch_records,
    event_record,
    meta_record,
    node_path,
    node_record,
    rank_paths,
    reduce,
    rollup,
    tree_records,
)
from flodl.plan.metrics import EpochReport, aggregate

pytestmark = pytest.mark.timeout(60)

TS = 1_700_000_000_000


def leaf(path, work, metrics, *, alive=True, res=None, **kw):
    return node_record(path, metrics=metrics, work=work, alive=alive, ts_ms=TS, res=res, **kw)


# ------------------------------------------------------------------ reductions


def _children():
    a = leaf(
        "root/rank0",
        3,
        {"loss": 1.0, "throughput": 100.0, "acc": 0.5, "lr": 0.1, "peak": 7.0, "low": 2.0, "tokens": 30.0, "gn": 4.0},
        res={"gpu_util": 50.0, "gpu_util_max": 90.0, "vram_alloc": 1e9, "vram_total": 8e9, "cpu_util": 20.0, "rss_bytes": 100.0},
    )
    b = leaf(
        "root/rank1",
        1,
        {"loss": 2.0, "throughput": 50.0, "acc": 0.9, "lr": 0.2, "peak": 9.0, "low": 1.0, "tokens": 10.0},
        res={"gpu_util": 100.0, "gpu_util_max": 100.0, "vram_alloc": 2e9, "vram_total": 8e9},
    )
    c = leaf("root/rank2", 0, {"loss": 100.0, "throughput": 10.0, "acc": 0.0, "only_zero_work": 5.0})
    return [a, b, c]


DECLARED = {"lr": Reduction.LAST, "peak": "max", "low": Reduction.MIN, "tokens": "sum"}


def test_mean_is_work_weighted_and_zero_work_children_weigh_nothing():
    m = rollup(_children(), DECLARED)["metrics"]
    assert m["loss"] == pytest.approx((1.0 * 3 + 2.0 * 1) / 4)  # 1.25; the zero-work 100.0 ignored
    assert m["acc"] == pytest.approx((0.5 * 3 + 0.9 * 1) / 4)  # 0.6, undeclared ⇒ mean
    assert m["gn"] == pytest.approx(4.0)  # b did not report it: not averaged in as a zero


def test_declared_user_reductions():
    m = rollup(_children(), DECLARED)["metrics"]
    assert m["tokens"] == pytest.approx(40.0)
    assert m["peak"] == 9.0
    assert m["low"] == 1.0
    assert m["lr"] == 0.1  # last = the highest-work child's value, not the latest in order


def test_absent_stays_absent():
    out = rollup(_children(), DECLARED)
    assert "only_zero_work" not in out["metrics"]  # mean over Σw = 0 is absent, not 0
    assert "never_reported" not in out["metrics"]
    assert "vram_alloc_max" not in out["res"]
    assert rollup([leaf("root/rank0", 1, {})], {}) == {"work": 1.0, "metrics": {}}  # no res key at all
    for red in Reduction:
        assert reduce(red, []) is None


def test_core_keys_are_not_overridable():
    m = rollup(_children(), {**DECLARED, "loss": "sum", "throughput": "mean"})["metrics"]
    assert m["loss"] == pytest.approx(1.25)
    assert m["throughput"] == pytest.approx(160.0)  # sum includes the zero-work child


def test_resource_reductions():
    out = rollup(_children(), {})
    assert out["work"] == 4.0
    assert out["res"] == pytest.approx(
        {
            "gpu_util": (50 * 3 + 100 * 1) / 4,
            "gpu_util_max": 100.0,
            "vram_alloc": 3e9,
            "vram_total": 16e9,
            "cpu_util": 20.0,
            "rss_bytes": 100.0,
        }
    )


def test_last_takes_the_highest_work_child_wherever_it_sits():
    assert reduce(Reduction.LAST, [(1.0, 5.0), (2.0, 9.0), (3.0, 1.0)]) == 2.0


def test_hierarchical_mean_equals_flat_mean():
    rng = random.Random(3)
    hosts = {r: f"h{r % 3}.lan" for r in range(7)}
    paths = rank_paths(hosts)
    leaves = [leaf(paths[r], rng.randint(0, 50), {"loss": rng.random()}) for r in range(7)]
    root = tree_records(leaves, {})[0]
    flat = sum(lf["metrics"]["loss"] * lf["work"] for lf in leaves) / sum(lf["work"] for lf in leaves)
    assert root["metrics"]["loss"] == pytest.approx(flat, rel=1e-12)


# --------------------------------------------------------------- tree shaping


def test_paths_single_host_multi_host_lone_rank_and_unknown_host():
    assert rank_paths({0: "a", 1: "a"}) == {0: "root/rank0", 1: "root/rank1"}
    assert rank_paths({0: "a.lan", 1: "b.lan", 2: None}) == {0: "root/a.lan/rank0", 1: "root/b.lan/rank1", 2: "root/rank2"}
    assert rank_paths({0: "a"}) == {0: "root"}
    assert node_path(3, "x", {"x"}) == "root/rank3"
    assert node_path(3, "x", {"x", "y"}) == "root/x/rank3"


def test_one_host_tree_with_a_dead_rank():
    paths = rank_paths({0: "h", 1: "h", 2: "h"})
    leaves = [
        leaf(paths[0], 2, {"loss": 1.0, "throughput": 10.0}),
        leaf(paths[1], 0, {}, alive=False),
        leaf(paths[2], 2, {"loss": 3.0, "throughput": 30.0}),
    ]
    recs = tree_records(leaves, {})
    assert [r["path"] for r in recs] == ["root", "root/rank0", "root/rank1", "root/rank2"]
    root = recs[0]
    assert root["children"] == 3 and root["alive"] == 2 and root["work"] == 4.0
    assert root["metrics"] == pytest.approx({"loss": 2.0, "throughput": 40.0})
    assert recs[2]["alive"] is False and "children" not in recs[2]


def test_two_host_tree_aggregates_direct_children_only():
    paths = rank_paths({0: "a.lan", 1: "a.lan", 2: "b.lan", 3: "b.lan"})
    leaves = [
        leaf(paths[0], 1, {"throughput": 1.0, "loss": 1.0}),
        leaf(paths[1], 1, {"throughput": 2.0, "loss": 3.0}),
        leaf(paths[2], 2, {"throughput": 4.0, "loss": 5.0}),
        leaf(paths[3], 0, {}, alive=False),
    ]
    recs = tree_records(leaves, {})
    assert [r["path"] for r in recs] == [
        "root",
        "root/a.lan",
        "root/a.lan/rank0",
        "root/a.lan/rank1",
        "root/b.lan",
        "root/b.lan/rank2",
        "root/b.lan/rank3",
    ]
    root, host_a, host_b = recs[0], recs[1], recs[4]
    assert (host_a["children"], host_a["alive"], host_a["work"]) == (2, 2, 2.0)
    assert (host_b["children"], host_b["alive"], host_b["work"]) == (2, 1, 2.0)
    assert (root["children"], root["alive"], root["work"]) == (2, 2, 4.0)  # two hosts, not four ranks
    assert host_a["metrics"] == pytest.approx({"throughput": 3.0, "loss": 2.0})
    assert root["metrics"] == pytest.approx({"throughput": 7.0, "loss": (2.0 * 2 + 5.0 * 2) / 4})


def test_a_host_with_every_rank_dead_is_dead():
    paths = rank_paths({0: "a", 1: "b"})
    recs = tree_records([leaf(paths[0], 1, {"loss": 1.0}), leaf(paths[1], 0, {}, alive=False)], {})
    by_path = {r["path"]: r for r in recs}
    assert by_path["root/b"]["alive"] == 0 and by_path["root"]["alive"] == 1
    assert by_path["root/b"]["metrics"] == {}


def test_interior_records_copy_the_report_stamp_and_lone_rank_is_root():
    leaves = [leaf(p, 1, {"loss": 1.0}, tick=3, epoch=2) for p in rank_paths({0: "h", 1: "h"}).values()]
    root = tree_records(leaves, {})[0]
    assert (root["ts"], root["tick"], root["epoch"], root["kind"], root["v"]) == (TS, 3, 2, "node", 1)
    lone = leaf("root", 5, {"loss": 1.0})
    assert tree_records([lone], {}) == [lone]


def test_children_sort_naturally_and_tiering_bugs_are_refused():
    paths = rank_paths({r: "h" for r in range(12)})
    recs = tree_records([leaf(p, 1, {}) for p in paths.values()], {})
    assert [r["path"] for r in recs][1:4] == ["root/rank0", "root/rank1", "root/rank2"]
    assert recs[-1]["path"] == "root/rank11"
    with pytest.raises(ValueError, match="share"):
        tree_records([leaf("root/rank0", 1, {}), leaf("root/rank0", 1, {})], {})
    with pytest.raises(ValueError, match="both a leaf and an interior"):
        tree_records([leaf("root/h", 1, {}), leaf("root/h/rank1", 1, {})], {})


def test_record_shapes():
    n = leaf(
        "root/rank0", 2, {"loss": 1.0}, device=1, label="GP106", epoch=4, epoch_complete=True, res={"gpu_util": 5.0, "vram_total": None}
    )
    assert list(n) == ["v", "ts", "sev", "path", "kind", "epoch", "epoch_complete", "label", "metrics", "work", "res", "device", "alive"]
    assert n["res"] == {"gpu_util": 5.0}  # present fields only
    e = event_record("root/rank1", "rank_lost", "stale 34 s", sev="critical", count=2, ts_ms=TS)
    assert e == {
        "v": 1,
        "ts": TS,
        "sev": "critical",
        "path": "root/rank1",
        "kind": "event",
        "class": "rank_lost",
        "detail": "stale 34 s",
        "count": 2,
    }
    m = meta_record({"lr": "last", "loss": "sum", "acc": Reduction.MAX}, ts_ms=TS, run={"run_id": "r1"})
    assert m == {"v": 1, "ts": TS, "kind": "meta", "reductions": {"acc": "max", "lr": "last"}, "run": {"run_id": "r1"}}
    assert json.loads(encode(leaf("root", 1, {"loss": float("nan")})))["metrics"] == {"loss": None}


# ------------------------------------------------------------------ alert lane


def test_first_alert_emits_at_once_and_repeats_ride_the_next_count():
    lane = AlertLane()
    first = lane.record("drift", "root", "d=0.1", now_ms=0)
    assert [(r["class"], r["sev"], r["count"]) for r in first] == [("drift", "warn", 1)]
    for t in (100, 200, 9_999):
        assert lane.record("drift", "root", "d", now_ms=t) == []
    out = lane.record("drift", "root", "d=0.4", now_ms=10_000)
    assert [(r["count"], r["ts"], r["detail"]) for r in out] == [(4, 10_000, "d=0.4")]
    assert lane.record("drift", "root", "d", now_ms=10_500) == []
    assert [r["count"] for r in lane.flush(now_ms=11_000)] == [1]
    assert lane.flush(now_ms=12_000) == []
    assert lane.live()[0]["count"] == 6


def test_classes_and_paths_collapse_separately_with_their_severity():
    lane = AlertLane()
    assert lane.record("rank_lost", "root/rank0", "a", now_ms=0)[0]["sev"] == "critical"
    assert lane.record("rank_lost", "root/rank1", "b", now_ms=1)[0]["count"] == 1
    assert lane.record("control_drop", "root/rank0", "c", now_ms=2)[0]["sev"] == "critical"
    with pytest.raises(ValueError, match="unknown alert class"):
        lane.record("oops", "root", "x", now_ms=3)


@pytest.mark.parametrize("max_live", [200, 3])
def test_emitted_counts_sum_exactly_to_occurrences(max_live):
    rng = random.Random(11)
    lane = AlertLane(max_live=max_live)
    keys = [(c, f"root/rank{r}") for c in ("drift", "rank_lost", "control_drop") for r in range(3)]
    occurred, emitted = Counter(), Counter()
    now = 0
    for _ in range(3_000):
        now += rng.choice((1, 50, 700, 4_000))
        key = rng.choice(keys)
        occurred[key] += 1
        for r in lane.record(*key, "x", now_ms=now):
            emitted[(r["class"], r["path"])] += r["count"]
    for r in lane.flush(now_ms=now + 1):
        emitted[(r["class"], r["path"])] += r["count"]
    overflow = emitted.pop(("overflow", "root"), 0)
    assert emitted == occurred
    assert overflow == lane.dropped and (lane.dropped > 0) == (max_live < len(keys))
    assert len(lane.live()) <= max_live


def test_eviction_reports_a_collapsed_overflow_at_root():
    lane = AlertLane(max_live=2)
    lane.record("drift", "root/rank0", "a", now_ms=0)
    lane.record("drift", "root/rank0", "a", now_ms=1)  # absorbed, owed by the stream
    lane.record("drift", "root/rank1", "b", now_ms=2)
    out = lane.record("drift", "root/rank2", "c", now_ms=3)
    assert [(r["class"], r["path"], r["count"]) for r in out] == [
        ("drift", "root/rank0", 1),
        ("drift", "root/rank2", 1),
        ("overflow", "root", 1),
    ]
    assert out[-1]["sev"] == "warn"
    assert [r["class"] for r in lane.record("drift", "root/rank3", "d", now_ms=4)] == ["drift"]  # collapsed
    assert [(r["class"], r["count"]) for r in lane.flush(now_ms=5)] == [("overflow", 1)]


# --------------------------------------------------------------- sub-epoch


def test_sub_epoch_reports_fire_once_per_window_even_across_thresholds():
    rep = SubEpochReporter(4, 100)  # thresholds at 25, 50, 75, 100 steps
    fired = [w for w in (10, 25, 30, 80, 90, 100, 120) if rep.on_sync(w)]
    assert fired == [25, 80, 100]  # 80 crossed 50 and 75: one report
    assert rep.fired == 4
    rep.new_epoch()
    assert not rep.on_sync(24) and rep.on_sync(25)


def test_sub_epoch_threshold_arithmetic_is_exact():
    rep = SubEpochReporter(3, 10)  # float 10 / (10 / 3) is 2.999…, which would miss the last report
    assert [w for w in range(1, 11) if rep.on_sync(w)] == [4, 7, 10]


def test_sub_epoch_reporter_off_when_x_or_epoch_work_is_zero():
    assert not any(SubEpochReporter(0, 100).on_sync(w) for w in range(0, 200, 10))
    assert not any(SubEpochReporter(4, 0).on_sync(w) for w in range(0, 200, 10))
    rep = SubEpochReporter(2, 0)
    rep.new_epoch(epoch_work=10)
    assert rep.on_sync(5)


# ------------------------------------------------------------------ record log


def _rec(path, seq):
    return {"v": 1, "kind": "node", "path": path, "seq": seq}


def _node_bytes(tmp_path, name):
    files = [tmp_path / f"{name}.log", tmp_path / f"{name}.log.1"]
    return [f.stat().st_size if f.exists() else 0 for f in files]


def test_ring_cap_holds_under_a_flood(tmp_path):
    log = RecordLog(tmp_path, 4096)
    for seq in range(50_000):
        log.write(_rec("root", seq))
        if seq % 10 == 0:
            log.write(_rec("root/rank0", seq))
    log.close()
    for name in ("root", "root/rank0"):
        active, rotated = _node_bytes(tmp_path, name)
        assert active <= 2048 and rotated <= 2048 and active + rotated <= 4096
    kept = [r["seq"] for r in RecordLog(tmp_path, 4096).tail("root", 10_000)]
    assert kept[-1] == 49_999 and 0 not in kept and len(kept) < 200
    assert kept == list(range(kept[0], 50_000))  # a ring, contiguous and ordered
    assert [r["seq"] for r in log.tail("root/rank0", 3)] == [49_970, 49_980, 49_990]


def test_tail_reads_rotated_then_active(tmp_path):
    with RecordLog(tmp_path, 400) as log:
        for seq in range(12):
            log.write(_rec("root", seq))
        assert (tmp_path / "root.log.1").exists()
        assert [r["seq"] for r in log.tail("root", 4)] == [8, 9, 10, 11]
        assert log.tail("root", 0) == [] and log.tail("root/none", 5) == []


def test_reopen_resumes_the_byte_count(tmp_path):
    with RecordLog(tmp_path, 400) as log:
        for seq in range(3):
            log.write(_rec("root", seq))
    before = _node_bytes(tmp_path, "root")[0]
    assert 0 < before <= 200
    with RecordLog(tmp_path, 400) as log:
        for seq in range(3, 60):
            log.write(_rec("root", seq))
            active, rotated = _node_bytes(tmp_path, "root")
            assert active <= 200 and rotated <= 200  # an uncounted start would overshoot
        assert [r["seq"] for r in log.tail("root", 1)] == [59]


def test_dotted_hostnames_keep_their_own_files(tmp_path):
    with RecordLog(tmp_path) as log:
        log.write(_rec("root/10.0.0.5/rank0", 1))
        log.write(_rec("root/10.0.0.6/rank1", 2))
        log.write(_rec("root/10.0.0.5", 3))
    assert (tmp_path / "root/10.0.0.5/rank0.log").is_file()
    assert (tmp_path / "root/10.0.0.6/rank1.log").is_file()
    assert (tmp_path / "root/10.0.0.5.log").is_file()


def test_unsafe_paths_are_skipped_never_raised(tmp_path, caplog):
    target = tmp_path / "logs"
    caplog.set_level(logging.WARNING, logger="flodl.monitor.record_log")
    with RecordLog(target) as log:
        for path in ("", "root/../escape", "/abs/path", "root//rank0", "root/./x", "..", None):
            log.write(_rec(path, 1))
        log.write({"v": 1, "kind": "node"})  # no path at all
        log.write(_rec("root/../escape", 2))
    assert not (tmp_path / "escape.log").exists()
    assert not target.exists() or list(target.rglob("*")) == []
    assert len(caplog.records) == 7  # once per distinct path, not per record


def test_io_errors_warn_once_per_node_and_never_raise(tmp_path, caplog):
    (tmp_path / "root").write_text("a file where the node dir should be")
    caplog.set_level(logging.WARNING, logger="flodl.monitor.record_log")
    with RecordLog(tmp_path) as log:
        for seq in range(5):
            log.write(_rec("root/rank0", seq))
        log.write(_rec("root/rank1", 0))
        log.write(_rec("root", 0))  # a healthy node is unaffected
    assert len(caplog.records) == 2
    assert [r["seq"] for r in RecordLog(tmp_path).tail("root", 5)] == [0]


def test_bounded_open_files_and_writes_after_close(tmp_path):
    log = RecordLog(tmp_path, 1000, max_open=2)
    for seq in range(200):
        log.write(_rec(f"root/rank{seq % 5}", seq))
        assert len(log._open) <= 2
    log.close()
    log.write(_rec("root/rank0", 999))  # a late producer: ignored, no error
    for r in range(5):
        assert sum(_node_bytes(tmp_path, f"root/rank{r}")) <= 1000
        assert RecordLog(tmp_path).tail(f"root/rank{r}", 1)[0]["seq"] == 195 + r


def test_meta_heads_every_root_segment(tmp_path):
    with RecordLog(tmp_path, 2000) as log:
        log.write(meta_record({"acc": "max"}, ts_ms=TS, run={"run_id": "abc"}))
        for seq in range(500):
            log.write(_rec("root", seq))
    first = json.loads((tmp_path / "root.log").read_text().splitlines()[0])
    assert first["kind"] == "meta" and first["run"] == {"run_id": "abc"}
    assert reader.run_meta(reader.load(tmp_path))["reductions"] == {"acc": "max"}


# ------------------------------------------------------------------ reader


HOSTS = {0: "a.lan", 1: "a.lan", 2: "b.lan", 3: "b.lan"}


def _synthetic_run(logdir):
    """Three epochs on two hosts; rank 3 dies after epoch 0; one alert flood."""
    paths = rank_paths(HOSTS)
    lane = AlertLane()
    history = []
    with RecordLog(logdir, 64 * 1024) as log:
        log.write(meta_record({"acc": "mean"}, ts_ms=TS, run={"run_id": "syn", "world_size": 4}))
        for epoch in range(3):
            ranks = range(4) if epoch == 0 else range(3)
            reports = [
                EpochReport(
                    rank=r,
                    epoch=epoch,
                    batches=10 + r,
                    samples=(10 + r) * 32,
                    loss_sum=(10 + r) * (1.0 / (epoch + 1) + 0.1 * r),
                    wall_ms=1000.0 + 50 * r,
                    compute_ms=800.0,
                    data_ms=5.0 * r,
                    sync_ms=50.0,
                    syncs=4,
                    scalars={"acc": [0.5 + 0.1 * r, 1.0]},
                )
                for r in ranks
            ]
            stats = aggregate(epoch, reports)
            stats.eval_value = 0.9 - 0.1 * epoch
            window = [node_record(paths[r], metrics={"loss": 9.9}, work=5, alive=True, ts_ms=TS, tick=1, epoch=epoch) for r in ranks]
            log.write_all(tree_records(window, {}))  # sub-epoch rows: not in the epoch table
            log.write_all(epoch_records(stats, paths, {"acc": "mean"}, ts_ms=TS + epoch))
            history.append(stats.to_dict())
            if epoch == 1:
                for t in range(5):
                    log.write_all(lane.record("rank_lost", paths[3], "silent", now_ms=TS + t))
        log.write_all(lane.flush(TS + 100))
    return history


def test_reader_reproduces_the_epoch_table(tmp_path):
    history = _synthetic_run(tmp_path)
    table = reader.epoch_table(tmp_path)
    assert [row["epoch"] for row in table] == [1, 2, 3]  # the records' index 0, 1, 2, as the console prints it
    for row, want in zip(table, history, strict=False):
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-12)
        assert row["eval"] == pytest.approx(want["eval"])
        assert row["samples"] == want["samples"]
        assert row["syncs"] == want["syncs"]
        per_rank = {f"rank{r}": v["samples_per_s"] for r, v in want["per_rank"].items()}
        measured = {k: v for k, v in row["ranks"].items() if v is not None}
        assert measured == pytest.approx(per_rank)
        assert row["throughput"] == pytest.approx(sum(per_rank.values()))
    assert table[1]["ranks"]["rank3"] is None  # the dead rank keeps its column, unmeasured
    host_rows = reader.epoch_table(tmp_path, "root/b.lan")
    assert set(host_rows[0]["ranks"]) == {"rank2", "rank3"}
    found = reader.events(reader.load(tmp_path))
    assert sum(e["count"] for e in found) == 5 and {e["path"] for e in found} == {"root/b.lan/rank3"}


def test_dead_rank_still_has_an_epoch_record(tmp_path):
    _synthetic_run(tmp_path)
    recs = RecordLog(tmp_path).tail("root/b.lan/rank3", 10)
    epoch2 = [r for r in recs if r.get("epoch") == 2 and r.get("epoch_complete")]
    assert epoch2 and epoch2[0]["alive"] is False and epoch2[0]["work"] == 0.0
    host = [r for r in RecordLog(tmp_path).tail("root/b.lan", 10) if r.get("epoch_complete")][-1]
    assert (host["children"], host["alive"]) == (2, 1)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flodl.monitor.reader", *map(str, args)], capture_output=True, text=True, timeout=60)


def test_cli_prints_the_table_and_events(tmp_path):
    _synthetic_run(tmp_path)
    done = _cli(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "run run_id=syn world_size=4"
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "loss"])
    assert lines[header].split()[6:] == ["rank0", "s/s", "rank1", "s/s", "rank2", "s/s", "rank3", "s/s"]
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["1", "2", "3"]  # as the console numbers them
    assert "events (2):" in done.stdout  # the first occurrence, then the four it absorbed
    assert "rank_lost" in done.stdout and "x4: silent" in done.stdout
    assert "-" in lines[header + 2].split()[-1]  # rank3 died: no throughput in epoch 1


def test_cli_json_output(tmp_path, capsys):
    _synthetic_run(tmp_path)
    assert reader.main([str(tmp_path), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert [row["epoch"] for row in as_json["epochs"]] == [1, 2, 3]
    assert as_json["meta"]["run"]["run_id"] == "syn"


def test_cli_shows_the_last_rows_or_a_range_of_epochs(tmp_path, capsys):
    """A long run's table need not be printed whole: --tail N, --epochs A-B (1-based, as the console counts)."""
    _synthetic_run(tmp_path)
    assert reader.main([str(tmp_path), "--json", "--tail", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["epoch"] for row in out["epochs"]] == [2, 3] and len(out["events"]) <= 2
    for spec, want in (("2-3", [2, 3]), ("3-", [3]), ("-1", [1]), ("2", [2])):
        assert reader.main([str(tmp_path), "--json", "--epochs", spec]) == 0
        assert [row["epoch"] for row in json.loads(capsys.readouterr().out)["epochs"]] == want, spec
    assert reader.main([str(tmp_path), "--epochs", "x-y"]) == 2
    assert "--epochs x-y" in capsys.readouterr().err
    assert reader.main([str(tmp_path), "--tail", "-1"]) == 2


def test_cli_refuses_a_dir_without_logs(tmp_path, capsys):
    assert reader.main([str(tmp_path)]) == 2
    assert "no record logs" in capsys.readouterr().err
    assert reader.main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    _synthetic_run(tmp_path)
    assert reader.main([str(tmp_path), "--path", "root/nope"]) == 2
    assert "root/b.lan" in capsys.readouterr().err


@pytest.mark.parametrize("reduction", ["sum", "max", "min", "last"])
def test_the_summary_rows_fold_declared_scalars_as_the_record_stream_does(reduction):
    """A key declared in ``scalar_reductions`` reads the same in the summary's history
    (``aggregate``) and at the record tree's root: ``tokens=sum`` is the total in both."""
    reports = [
        EpochReport(
            rank=r,
            epoch=0,
            batches=10 + r,
            samples=(10 + r) * 32,
            loss_sum=1.0,
            wall_ms=100.0,
            compute_ms=80.0,
            data_ms=1.0,
            sync_ms=5.0,
            syncs=2,
            scalars={"tokens": [500.0 * (r + 1), 10.0 + r]},
        )
        for r in range(4)
    ]
    stats = aggregate(0, reports, {"tokens": Reduction.parse(reduction)})
    root = epoch_records(stats, rank_paths(HOSTS), {"tokens": reduction}, ts_ms=TS)[0]
    assert root["metrics"]["tokens"] == pytest.approx(stats.scalars["tokens"])
    per_rank = [500.0 * (r + 1) if reduction == "sum" else 500.0 * (r + 1) / (10 + r) for r in range(4)]
    want = {"sum": sum(per_rank), "max": max(per_rank), "min": min(per_rank), "last": per_rank[3]}[reduction]
    assert stats.scalars["tokens"] == pytest.approx(want)
    assert stats.to_dict()["scalars"]["tokens"] == pytest.approx(want)  # what the summary's history[] carries
    # undeclared, the key keeps the reference's batch-weighted mean of per-rank means
    assert aggregate(0, reports).scalars["tokens"] == pytest.approx(sum(500.0 * (r + 1) for r in range(4)) / sum(10 + r for r in range(4)))
