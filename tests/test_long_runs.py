"""A long run's summary and dashboard archive stay small (flodl/controller/history.py,
``Feed.archive_lines``): 1,500 epochs made a 1 MB summary and a 1.8 MB archive. The rows are
fed as the controller makes them (``EpochStats``, ``epoch_records``); one real run checks the
compacted summary still reads with tests/helpers/history.py and its record stream with the reader."""

from __future__ import annotations

import json
import re

import pytest

from flodl.config import Reduction
from flodl.controller.history import HISTORY_BYTES, bounded, compact, merge
from flodl.monitor import reader
from flodl.monitor.archive import archive_html
from flodl.monitor.feed import Feed, thin
from flodl.monitor.records import epoch_records, event_record, meta_record, rank_paths
from flodl.plan.metrics import EpochStats, RankEpoch

from .conftest import task_spec
from .helpers.history import epoch_samples, epochs
from .helpers.procs import Run

EPOCHS = 1_500


def stats(epoch: int, ranks: int = 2) -> EpochStats:
    """Epoch ``epoch``'s row as the controller folds it: ``ranks`` ranks, a user scalar, an eval."""
    per_rank = {
        r: RankEpoch(r, batches=10 + r, samples=320 + 32 * r, loss_sum=5.0 / (epoch + 1), wall_ms=40.0 + r, compute_ms=30.0, data_ms=2.0)
        for r in range(ranks)
    }
    samples = sum(p.samples for p in per_rank.values())
    return EpochStats(
        epoch=epoch,
        avg_loss=1.0 / (epoch + 1),
        batches=sum(p.batches for p in per_rank.values()),
        samples=samples,
        wall_ms=41.0,
        syncs=3,
        per_rank=per_rank,
        scalars={"tokens": float(samples * 7), "lr": 0.1 / (epoch + 1)},
        eval_value=epoch / EPOCHS,
        eval_ms=4.0,
        epoch_losses={epoch: 1.0 / (epoch + 1)},
        epoch_samples={epoch: samples},
    )


def summary_bytes(rows: list[dict]) -> int:
    """The history's bytes in the summary file (``write_summary``: indent=2)."""
    return len(json.dumps({"history": rows}, indent=2))


def test_a_1500_epoch_history_fits_the_budget_whole_at_both_ends():
    rows = [stats(e).to_dict() for e in range(EPOCHS)]
    assert summary_bytes(rows) > 1_000_000  # what the summary held before
    kept = bounded(rows)
    assert summary_bytes(kept) < HISTORY_BYTES < 100_000
    assert epochs(kept) == list(range(EPOCHS))  # every epoch, once, in order
    whole = [row for row in kept if "merged_rows" not in row]
    assert whole[: len(whole) // 2] == rows[: len(whole) // 2] and whole[len(whole) // 2 :] == rows[EPOCHS - len(whole) // 2 :]
    assert sum(row.get("merged_rows", 1) for row in kept) == EPOCHS
    assert sum(row["samples"] for row in kept) == sum(row["samples"] for row in rows)
    assert kept[-1] == rows[-1]  # the final epoch's own row
    with pytest.raises(ValueError, match="merged"):
        epoch_samples(kept)  # each epoch's own samples: in the record stream, not in a merged row


def test_many_ranks_keep_fewer_rows_within_the_budget():
    rows = [stats(e, ranks=16).to_dict() for e in range(EPOCHS)]
    kept = bounded(rows)
    assert summary_bytes(kept) < HISTORY_BYTES
    assert epochs(kept) == list(range(EPOCHS))


def test_a_short_history_is_left_whole():
    rows = [stats(e).to_dict() for e in range(60)]
    assert bounded(rows) == rows


def test_a_merged_row_sums_counts_weighs_the_loss_and_keeps_the_last_eval():
    rows = [stats(e).to_dict() for e in range(4)]
    rows[3]["eval"] = rows[3]["eval_s"] = None  # the last scored epoch of the four is the third
    row = merge(rows)
    assert (row["first_epoch"], row["epoch"], row["merged_rows"]) == (0, 3, 4)
    assert row["samples"] == sum(r["samples"] for r in rows) and row["syncs"] == 12
    assert row["wall_s"] == pytest.approx(4 * 0.041)
    assert row["loss"] == pytest.approx(sum(r["loss"] * r["samples"] for r in rows) / row["samples"])
    assert (row["eval"], row["eval_epoch"]) == (rows[2]["eval"], 2)
    assert row["eval_s"] == pytest.approx(3 * 0.004)  # three rows were scored
    assert row["scalars"]["lr"] == pytest.approx(sum(r["scalars"]["lr"] for r in rows) / 4)
    rank1 = row["per_rank"]["1"]
    assert rank1["samples"] == 4 * 352 and rank1["samples_per_s"] == pytest.approx(352 / 0.041)
    assert rank1["batch_share"] == pytest.approx(352 / 672)
    # a merged row merges again (a second level of compaction) into the same sums
    assert merge([row, merge(rows)])["merged_rows"] == 8


def test_each_epochs_samples_are_read_from_a_groups_row_and_a_merged_row_is_refused():
    """A row of epochs one average closed keeps each one's samples: a reader checking coverage gets one
    entry an epoch (bench/chaos.py read a group's total as one epoch's and called the run lost)."""
    rows = [
        {"epoch": 0, "samples": 512, "epoch_samples": {"0": 512}},
        {"epoch": 2, "first_epoch": 1, "samples": 1024, "epoch_samples": {"1": 512, "2": 512}},
    ]
    assert epoch_samples(rows) == [512, 512, 512]
    with pytest.raises(ValueError, match="epochs 1-2 are merged"):
        epoch_samples([{**rows[1], "merged_rows": 2}])


def test_compact_refuses_nonsense_bounds():
    with pytest.raises(ValueError, match="middle_rows"):
        compact([], keep_whole=1, middle_rows=0)


def test_thin_keeps_both_ends_and_spaces_the_middle():
    items = list(range(1000))
    out = thin(items, 100, 10)
    assert len(out) == 100 and out[:10] == items[:10] and out[-10:] == items[-10:] and out == sorted(out)
    assert thin(items[:50], 100, 10) == items[:50]
    with pytest.raises(ValueError, match="limit"):
        thin(items, 20, 10)


def test_a_1500_epoch_archive_is_bounded():
    feed, paths = Feed(), rank_paths({0: "h", 1: "h"})
    reductions = {"tokens": Reduction.SUM}
    feed.publish(meta_record(reductions, ts_ms=0, run={"epochs": EPOCHS}))
    for epoch in range(EPOCHS):
        feed.publish(event_record("root", "sync", f"window {epoch}: 672 samples averaged", sev="info", ts_ms=epoch))
        for record in epoch_records(stats(epoch), paths, reductions, ts_ms=epoch):
            feed.publish(record)
    feed.publish(event_record("root", "rank_lost", "rank 1 lost", sev="critical", ts_ms=EPOCHS))
    full = archive_html(feed.snapshot())
    html = archive_html(feed)
    assert len(full) > 1_500_000 and len(html) < 400_000
    records = json.loads(re.search(r'id="flodl-data">(.*?)</script>', html, re.S).group(1))["records"]
    root = [r["epoch"] for r in records if r.get("path") == "root" and r.get("kind") == "node"]
    assert root[0] == 0 and root[-1] == EPOCHS - 1 and root == sorted(root)
    assert records[0]["kind"] == "meta" and any(r.get("class") == "rank_lost" for r in records)


@pytest.mark.timeout(150)
def test_a_real_long_runs_summary_is_compacted_and_reads(proc_env, tmp_path):
    """150 epochs, each scored on its own (a row each): the summary compacts, the helpers read it,
    and the record stream holds every epoch."""
    summary_path, logs = tmp_path / "s.json", tmp_path / "logs"
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "150", "--eval-every-epochs", "1", "--no-progress"]
    run = Run([*args, "--summary-json", str(summary_path), "--record-log-dir", str(logs)], {**proc_env, "FLODL_TEST_SAMPLES": "64"})
    assert run.wait(120) == 0, run.output
    assert summary_path.stat().st_size < 100_000
    summary = json.loads(summary_path.read_text())
    history = summary["history"]
    assert summary["history_rows"] == 150 > len(history)
    assert any("merged_rows" in row for row in history)
    assert epochs(history) == list(range(150))
    assert sum(row["samples"] for row in history) == summary["samples"] == 150 * 64
    assert epoch_samples(history[:5]) == [64] * 5  # the whole rows keep each epoch's own
    assert history[-1]["eval"] == summary["final_eval"]
    table = reader.epoch_table(logs)
    assert [row["epoch"] for row in table] == list(range(1, 151))  # every epoch's own row, in the stream
