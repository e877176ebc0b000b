"""Streaming data over shards (flodl.Shards): the rank's shard batches, and real runs whose ledger
grants shards: every shard once per epoch, across a death and a resume; bad input fails fast."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from flodl import Shards
from flodl.checkpoint.bundle import read_meta
from flodl.errors import EXIT_CONFIG, TaskError
from flodl.plan.schedule import Schedule
from flodl.rank.shard_source import ShardSource
from flodl.task import Task

from .conftest import ROOT, TASKS, task_spec
from .helpers.history import epoch_samples, epochs
from .helpers.procs import Run
from .tasks.shards import write_shards

COUNT = 12


# ---------------------------------------------------------------- the rank's shard batches


def _source(sizes: list[int], batch_size: int = 4) -> ShardSource:
    shards = Shards(list(range(len(sizes))), open_shard=lambda i: ((i, k) for k in range(sizes[i])))
    return ShardSource(shards, batch_size, seed=3, collate_fn=list)


def test_batches_end_where_a_shard_ends_and_an_empty_shard_is_one_item():
    sizes = [6, 0, 4, 9]
    items = list(_source(sizes).window_batches([[0, 0, 4]]))
    per_shard: dict[int, list[int]] = {}
    for epoch, picks, batch in items:
        assert epoch == 0
        rows = batch or []
        assert len(rows) == picks.samples <= 4 and {s for s, _ in rows} <= {picks.shard}  # one shard a batch
        per_shard.setdefault(picks.shard, []).append(picks.ends)
    # each shard: its batches, only the last saying it ends the shard (the empty one: one item)
    assert {s: ends for s, ends in per_shard.items()} == {0: [0, 1], 1: [1], 2: [1], 3: [0, 0, 1]}
    assert sum(p.samples for _, p, _ in items) == sum(sizes)


def test_every_rank_rebuilds_the_same_shard_order_from_the_seed():
    sizes = [3] * 10
    order = [p.shard for _, p, _ in _source(sizes).window_batches([[1, 0, 10]])]
    assert order == [p.shard for _, p, _ in _source(sizes).window_batches([[1, 0, 4], [1, 4, 6]])]
    assert sorted(order) == list(range(10)) and order != list(range(10))  # a shuffle, each shard once


def test_a_shard_that_raises_while_read_is_named():
    def broken(i):
        yield 1
        raise OSError("disk gone")

    source = ShardSource(Shards(["a.bin"], open_shard=broken), 4, seed=0)
    with pytest.raises(TaskError, match=r"reading shard 'a.bin' raised OSError: disk gone"):
        list(source.window_batches([[0, 0, 1]]))


@pytest.mark.parametrize(
    ("ids", "opener", "says"),
    [
        ([], lambda i: [], "Shards.shard_ids is empty"),
        ("abc", lambda i: [], "Shards.shard_ids must be a list"),
        ([1], 5, "Shards.open_shard must be callable"),
    ],
)
def test_bad_shards_are_refused_naming_the_field(ids, opener, says):
    with pytest.raises(TaskError, match=says):
        Shards(ids, open_shard=opener)


def test_an_opener_that_gives_no_iterable_fails_when_the_task_builds_its_dataset():
    task = Task(
        model=lambda: torch.nn.Linear(1, 1),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        dataset=Shards([1], open_shard=lambda i: 42),
        batch_size=2,
        loss_fn=torch.nn.functional.mse_loss,
    )
    with pytest.raises(TaskError, match=r"open_shard\(1\) returned int, not an iterable of samples"):
        task.build_dataset()


# ---------------------------------------------------------------- real runs


@pytest.fixture
def shards(tmp_path):
    sizes = write_shards(tmp_path / "shards", COUNT)
    out = tmp_path / "out"
    out.mkdir()
    return sizes, out


def _run(tmp_path, env, *args, epochs=3, mode="nccl-cadence", name="s.json", script=False):
    path = tmp_path / name
    what = ["--script", str(TASKS / "shard_script.py")] if script else ["--task", task_spec("shards.py")]
    argv = [*what, "--nproc-per-node", "2", "--epochs", str(epochs), "--mode", mode, "--summary-json", str(path), *args]
    env = {**env, "FLODL_TEST_SHARDS": str(tmp_path / "shards"), "FLODL_TEST_OUT": str(tmp_path / "out")}
    return Run(argv, env), path


def _seen(out: Path) -> dict[str, Counter]:
    """Per rank process (pid): how often it trained each (shard, sample)."""
    return {f.stem: Counter(tuple(line.split()[1:]) for line in f.read_text().splitlines()) for f in out.glob("seen-*.txt")}


def _all_samples(sizes: list[int]) -> set[tuple[str, str]]:
    return {(str(s), str(k)) for s, n in enumerate(sizes) for k in range(n)}


def _exactly_once(summary: dict, sizes: list[int], epochs: int) -> None:
    assert summary["exit_reason"] == "completed", summary["exit_reason"]
    assert summary["coverage"] == {"grain": "shard", "positions_per_epoch": COUNT, "guarantee": "exactly-once", "maybe_repeated": 0}
    assert epoch_samples(summary["history"]) == [sum(sizes)] * epochs


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "script"), [("nccl-cadence", False), ("nccl-sync", False), ("cpu-async", False), ("cpu-cadence", True)])
def test_every_shard_is_trained_once_per_epoch(proc_env, tmp_path, shards, mode, script):
    sizes, out = shards
    run, path = _run(tmp_path, proc_env, mode=mode, script=script)
    assert run.wait(90) == 0, run.output
    assert f"{COUNT} shards, batch 8 per rank" in run.output
    summary = json.loads(path.read_text())
    _exactly_once(summary, sizes, 3)
    seen = _seen(out)
    assert len(seen) == 2  # both ranks trained
    total = sum(seen.values(), Counter())
    assert set(total) == _all_samples(sizes) and set(total.values()) == {3}  # what the task saw: each sample once an epoch
    if mode == "nccl-sync":
        assert summary["syncs"] == 3 * COUNT // 2  # Sync averages once per shard a rank trains


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_a_rank_killed_mid_epoch_still_covers_every_shard(proc_env, tmp_path, shards, mode):
    sizes, out = shards
    # rank 1 dies as its 3rd window reaches it (the shards of it, and of the window it may still be
    # training, in hand): not at its Nth batch, which a loaded machine can keep it from reaching
    # (beside a CPU hog ElChe once planned it 5 batches of 84, and a fault at its 14th never fired)
    env = {**proc_env, "FLODL_INJECT_FAULT": "1:window:3", "FLODL_TEST_STEP_SLEEP": "0.01"}
    run, path = _run(tmp_path, env, mode=mode, epochs=4)
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    assert [d["rank"] for d in summary["deaths"]] == [1] and summary["exit_reason"] == "completed", summary["per_rank"]
    assert epochs(summary["history"]) == [0, 1, 2, 3]  # the ledger closed every epoch: each shard trained (granted, settled) once
    cov = summary["coverage"]
    assert cov["grain"] == "shard" and (cov["guarantee"] == "exactly-once") == (cov["maybe_repeated"] == 0)
    seen = _seen(out)
    assert len(seen) == 2
    total = sum(seen.values(), Counter())
    assert set(total) == _all_samples(sizes) and min(total.values()) >= 4  # nothing lost
    # the survivor trains a shard once an epoch: only what the dead rank had in hand is trained again
    survivor = max(seen.values(), key=lambda c: sum(c.values()))
    assert max(survivor.values()) <= 4
    assert summary["regranted_samples"] > 0  # the dead rank's shards went back whole


def _samples_of_positions(sizes: list[int], seed: int, epoch: int, ranges: list[list[int]]) -> int:
    """Samples in the shards at ``ranges`` of ``epoch``'s shard order (the ranks' own rebuild)."""
    schedule = Schedule(len(sizes))
    return sum(sizes[int(p) % len(sizes)] for start, size in ranges for p in schedule.picks(seed, epoch, start, size)[1])


@pytest.mark.timeout(180)
def test_a_resume_after_a_stop_trains_the_rest_exactly_once(proc_env, tmp_path, shards):
    sizes, _ = shards
    stem = tmp_path / "ck" / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.01", "FLODL_INJECT_FAULT": "1:average:2"}
    run, path = _run(tmp_path, env, "--max-failure", "1", "--save-path", str(stem), epochs=6)
    assert run.wait(90) == 6, run.output  # a death past max_failure: the bundle is saved, the run stops
    meta = read_meta(stem)
    cov = meta["coverage"]
    assert cov["grain"] == "shard" and cov["dataset_len"] == COUNT and cov["batch_size"] == 8
    first = json.loads(path.read_text())
    run2, path2 = _run(tmp_path, proc_env, "--resume-from", str(stem), epochs=6, name="s2.json")
    assert run2.wait(90) == 0, run2.output
    second = json.loads(path2.read_text())
    assert second["coverage"]["guarantee"] == "exactly-once"
    left = sum(_samples_of_positions(sizes, cov["seed"], item["epoch"], item["uncovered"]) for item in cov["open"])
    assert cov["open"] and left > 0  # it stopped mid-epoch: part of an epoch is left
    later = (6 - cov["next_epoch"]) * sum(sizes)
    assert sum(h["samples"] for h in second["history"]) == left + later  # exactly the shards not yet trained
    # the first run's closed epochs are whole; with its open epochs' trained part and the rest, every sample once
    assert epoch_samples(first["history"]) == [sum(sizes)] * len(epochs(first["history"]))
    assert len(epochs(first["history"])) + len(cov["open"]) + 6 - cov["next_epoch"] == 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bad", "script", "says"),
    [
        ("empty", False, "Shards.shard_ids is empty"),
        ("opener", False, "returned int, not an iterable of samples"),
        ("empty", True, "Shards.shard_ids is empty"),
    ],
)
def test_bad_shards_fail_fast_with_exit_2(proc_env, tmp_path, shards, bad, script, says):
    run, _ = _run(tmp_path, {**proc_env, "FLODL_TEST_BAD": bad}, mode="cpu-cadence" if script else "nccl-cadence", script=script)
    assert run.wait(45) == EXIT_CONFIG, run.output
    assert says in run.output


@pytest.mark.timeout(60)
def test_a_transform_with_shards_is_refused_naming_it(proc_env, tmp_path, shards):
    run, _ = _run(tmp_path, proc_env, "--transform", f"{TASKS / 'tiny.py'}:jitter")
    assert run.wait(45) == EXIT_CONFIG, run.output
    assert "transform: not available with a flodl.Shards dataset" in run.output


@pytest.mark.timeout(120)
def test_the_shipped_example_runs_as_documented(proc_env, tmp_path):
    path = tmp_path / "s.json"
    env = {**proc_env, "FLODL_EXAMPLE_SHARDS": str(tmp_path / "data")}
    run = Run(["--task", "examples/shards.py:task", "--nproc-per-node", "2", "--epochs", "2", "--summary-json", str(path)], env)
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    assert len(list((tmp_path / "data").glob("train-*.pt"))) == 16 and not list((tmp_path / "data").glob(".*"))
    assert summary["coverage"]["guarantee"] == "exactly-once" and summary["coverage"]["positions_per_epoch"] == 16
    per_epoch = sum(len(torch.load(p)["y"]) for p in (tmp_path / "data").glob("train-*.pt"))
    assert epoch_samples(summary["history"]) == [per_epoch] * 2
    assert summary["final_eval"] > 0.8
    assert (ROOT / "examples" / "shards.py").read_text().count("flodl.controller --task examples/shards.py:task") == 1
