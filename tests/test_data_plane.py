"""The data plane: schedule (augment, epoch_splits, pick keys), delivery transform, errors, real runs."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from flodl.config import ApplyPolicy
from flodl.errors import TaskError
from flodl.plan.dispatch import Dispatcher
from flodl.plan.elche import ElChe
from flodl.plan.schedule import PickKey, Schedule
from flodl.rank.data import BatchSource

from .conftest import task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run
from .tasks.tiny import jitter

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ schedule


@pytest.mark.parametrize(("n", "augment", "splits", "passes"), [(10, 1, 1, 3), (10, 2, 3, 2), (97, 3, 4, 2), (5, 4, 7, 1)])
def test_every_sample_is_picked_augment_times_per_pass(n, augment, splits, passes):
    schedule = Schedule(n, augment, splits, passes)
    assert schedule.epochs == passes * splits
    assert sum(schedule.epoch_len(e) for e in range(schedule.epochs)) == n * augment * passes
    seen: Counter = Counter()
    copies: Counter = Counter()
    for epoch in range(schedule.epochs):
        pass_index, picks = schedule.picks(7, epoch, 0, schedule.epoch_len(epoch))
        for key in schedule.keys(pass_index, picks):
            seen[key.sample] += 1
            copies[(key.pass_index, key.sample, key.copy)] += 1
    assert seen == {i: augment * passes for i in range(n)}
    assert set(copies.values()) == {1}  # each copy of each sample once per pass


def test_a_plain_schedule_is_the_old_epoch_permutation():
    from flodl.plan.schedule import epoch_permutation

    schedule = Schedule(50)
    assert torch.equal(schedule.picks(42, 3, 0, 50)[1], epoch_permutation(50, 42, 3))


def test_pick_seeds_differ_per_pick_copy_and_pass_but_not_per_call():
    a, b = PickKey(0, 3, 3, 0), PickKey(0, 13, 3, 1)
    assert a.seed(42) == PickKey(0, 3, 3, 0).seed(42)
    assert len({a.seed(42), b.seed(42), PickKey(1, 3, 3, 0).seed(42), a.seed(43)}) == 4
    assert 0 <= a.seed(42) < 2**63


def test_splits_beyond_the_pick_space_are_refused():
    with pytest.raises(ValueError, match="epoch_splits"):
        Schedule(3, 1, 4)


@pytest.mark.parametrize("policy", [ApplyPolicy.CADENCE, ApplyPolicy.SYNC])
def test_dispatch_over_split_augmented_epochs_trains_each_sample_exactly_k_times_epochs(policy):
    """Windows granted, partly trained and given back, over 3 splits of an augment-2 pass, twice."""
    n, bs = 230, 8
    schedule = Schedule(n, augment=2, epoch_splits=3, passes=2)
    d = Dispatcher(policy, [0, 1, 2], n, bs, schedule.epochs, epoch_len=schedule.epoch_len)
    che = ElChe(3, anchor=4, gate_growth=False)
    che.report_timing([4.0, 8.0, 12.0], [4, 4, 4], 0.0)
    source = BatchSource(TensorDataset(torch.arange(n)), bs, seed=5, schedule=schedule)
    rng = random.Random(3)
    seen: Counter = Counter()
    while (plans := d.plan(che)) is not None:
        for plan in plans.values():
            used = min(plan.samples, rng.randrange(0, plan.samples // bs + 2) * bs)
            trained, left = [], used
            for g in plan.grants:
                take = min(g.size, left)
                if take:
                    trained.append([g.epoch, g.start, take])
                left -= take
            for _, _, (ids,) in source.window_batches(trained):
                seen.update(ids.tolist())
            d.settle(plan, used)
    assert seen == {i: 2 * 2 for i in range(n)}


@pytest.mark.parametrize(
    ("grants", "augment", "splits"),
    [
        ([[0, 0, 100]], 1, 1),  # one grant: runs of CHUNK_BATCHES batches, then a short batch
        ([[0, 0, 30], [0, 30, 41], [1, 0, 7]], 1, 1),  # a batch cut across grants, then another epoch
        ([[0, 0, 80], [1, 0, 80], [2, 0, 80], [3, 0, 21]], 2, 3),  # augmented passes split into epochs: a pass edge inside
    ],
)
def test_in_memory_batches_gathered_in_chunks_are_the_per_batch_paths_exactly(grants, augment, splits):
    """The training loop's in-memory path (``places=False``) gathers runs of batches at once
    (``_chunked``): every batch, its epoch and its sample count must be those of the per-batch path."""
    n = 120
    ds = TensorDataset(torch.randn(n, 5), torch.arange(n))
    schedule = Schedule(n, augment, splits, 2)
    source = BatchSource(ds, 4, seed=3, schedule=schedule)
    per_batch = [(epoch, len(picks), batch) for epoch, picks, batch in source.window_batches(grants)]
    chunked = list(source.window_batches(grants, places=False))
    assert [(e, k) for e, k, _ in chunked] == [(e, k) for e, k, _ in per_batch]
    for (_, _, (x, y)), (_, _, (px, py)) in zip(chunked, per_batch, strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)
    # consecutive batches of one grant share one gather (views of one tensor): fewer gathers than batches
    storages = {x.untyped_storage().data_ptr() for _, _, (x, _) in chunked}
    assert len(storages) < len(chunked)


def test_a_chunk_holds_at_most_chunk_bytes_of_samples(monkeypatch):
    import flodl.rank.data as data

    monkeypatch.setattr(data, "CHUNK_BYTES", 4 * 4 * 8 * 3)  # three batches of 4 rows of 8 floats (and the 4-byte label)
    ds = TensorDataset(torch.randn(64, 8), torch.zeros(64, dtype=torch.int32))
    source = BatchSource(ds, 4, seed=1)
    assert source._chunk_batches() == 2  # 144 bytes a batch: 384 // 144
    # every batch held at once: a freed chunk's memory may be handed to the next (one address, two chunks)
    batches = list(source.window_batches([[0, 0, 64]], places=False))
    sizes = Counter(x.untyped_storage().data_ptr() for _, _, (x, _) in batches)
    assert max(sizes.values()) == 2


# ----------------------------------------------------------------- transform


def _rows(source, grants):
    """pick -> delivered x row, over ``grants``."""
    out = {}
    for _, picks, (x, _) in source.window_batches(grants):
        for p, row in zip(picks.tolist(), x, strict=False):
            out[p] = row
    return out


def test_the_transform_is_deterministic_per_pick_across_ranks_and_runs():
    x = torch.randn(40, 8)
    ds = TensorDataset(x, torch.zeros(40, dtype=torch.long))
    schedule = Schedule(40, augment=2, epoch_splits=2)
    one = BatchSource(ds, 6, seed=9, schedule=schedule, transform=jitter)
    two = BatchSource(ds, 4, seed=9, schedule=schedule, transform=jitter)  # another rank, other batch cuts
    a = _rows(one, [[0, 0, 40]])
    b = {**_rows(two, [[0, 0, 17]]), **_rows(two, [[0, 17, 23]])}
    assert set(a) == set(b) and all(torch.equal(a[p], b[p]) for p in a)
    again = _rows(BatchSource(ds, 6, seed=9, schedule=schedule, transform=jitter), [[0, 0, 40]])
    assert all(torch.equal(a[p], again[p]) for p in a)
    # the two copies of one sample are jittered differently, both close to the raw sample
    first = {p: row for p, row in a.items()}
    pairs = [(p, p + 40) for p in range(40) if p in first and p + 40 in first]
    for p, q in pairs:
        assert not torch.equal(first[p], first[q])
        assert torch.allclose(first[p], x[p], atol=0.1) and torch.allclose(first[q], x[p], atol=0.1)


def test_a_failing_transform_names_the_samples():
    ds = TensorDataset(torch.zeros(10, 2), torch.zeros(10))

    def broken(rows, keys):
        raise ValueError("bad crop")

    source = BatchSource(ds, 4, seed=1, transform=broken)
    with pytest.raises(TaskError, match="the transform raised ValueError: bad crop"):
        next(source.batches(0, 0, 4))


class _Flaky(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 13:
            raise OSError("corrupt record")
        return torch.tensor([float(i)]), i


def test_a_dataset_that_raises_on_one_index_is_named():
    source = BatchSource(_Flaky(), 20, seed=1)
    with pytest.raises(TaskError, match=r"dataset\[13\] raised OSError: corrupt record"):
        next(source.batches(0, 0, 20))


# ------------------------------------------------------------- real processes


def test_a_run_with_augment_splits_and_a_transform_covers_every_pick(proc_env, tmp_path):
    path = tmp_path / "s.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "2",
            "--epochs",
            "2",
            "--augment",
            "2",
            "--epoch-splits",
            "3",
            "--transform",
            "tests.tasks.tiny:jitter",
            "--dashboard-port",
            "-1",
            "--summary-json",
            str(path),
        ],
        proc_env,
    )
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    assert summary["epochs"] == 6 and summary["epochs_completed"] == 6
    assert epoch_samples(summary["history"]) == [341, 341, 342, 341, 341, 342]  # 2 x 512 picks per pass, 3 epochs each
    assert "2 pass(es) of 1024 picks (each sample x2), 3 epoch(s) per pass" in run.output
    assert summary["final_eval"] > 0.7


def test_a_transform_that_cannot_be_imported_stops_the_run_naming_it(proc_env):
    run = Run(
        [
            "--task",
            task_spec("tiny.py"),
            "--nproc-per-node",
            "1",
            "--epochs",
            "1",
            "--transform",
            "tests.tasks.tiny:nope",
            "--dashboard-port",
            "-1",
        ],
        proc_env,
    )
    assert run.wait(60) == 2, run.output
    assert "transform" in run.output and "nope" in run.output


def _slow_run(proc_env, tmp_path, *extra, func="slow_data_task", epochs=4):
    path = tmp_path / "s.json"
    run = Run(
        [
            "--task",
            task_spec("tiny.py", func),
            "--nproc-per-node",
            "2",
            "--epochs",
            str(epochs),
            "--dashboard-port",
            "-1",
            "--summary-json",
            str(path),
            *extra,
        ],
        {**proc_env, "FLODL_TEST_ITEM_MS": "0.2"},
    )
    code = run.wait(90)
    return code, run, json.loads(path.read_text()) if path.exists() else None


def _trained(summary, rank):
    return next(r["samples"] for r in summary["per_rank"] if r["rank"] == rank)


def test_the_ram_cache_reads_each_sample_once_per_rank(proc_env, tmp_path):
    code, run, summary = _slow_run(proc_env, tmp_path, "--record-log-dir", str(tmp_path / "logs"))
    assert code == 0, run.output
    from flodl.monitor.reader import load

    leaf = [r for r in load(tmp_path / "logs")["root/rank0"] if r.get("epoch_complete")]
    # it warms up (not strictly: a rank the cadence gave no batch after its first epoch keeps its rate)
    last, first = leaf[-1]["metrics"]["cache_hit_rate"], leaf[0]["metrics"].get("cache_hit_rate", 0.0)
    assert last > 0 and last >= first
    assert leaf[-1]["metrics"]["staged_bytes"] > 0
    for rank in ("0", "1"):
        row = summary["data"][rank]
        assert 0 < row["source_fetches"] <= 512  # never the same sample twice from the dataset
        assert row["ram_hits"] + row["source_fetches"] >= _trained(summary, int(rank))  # every sample trained came from somewhere
        assert row["ram_hits"] > 0 and row["ram_bytes"] > 0 and row["disk_hits"] == 0


def test_the_disk_stage_serves_when_ram_retention_is_off(proc_env, tmp_path):
    code, run, summary = _slow_run(proc_env, tmp_path, "--ram-max-usage", "0", "--disk-stage-gb", "1", "--disk-stage-dir", str(tmp_path))
    assert code == 0, run.output
    for rank in ("0", "1"):
        row = summary["data"][rank]
        assert row["ram_hits"] == 0 and row["ram_bytes"] == 0
        assert row["disk_hits"] > 0 and row["disk_bytes"] > 0 and row["source_fetches"] <= 512
    assert not list(tmp_path.glob("flodl-stage-*"))  # the pack files went with their ranks


def test_without_the_sample_cache_every_sample_comes_from_the_dataset(proc_env, tmp_path):
    code, run, summary = _slow_run(proc_env, tmp_path, "--no-sample-cache", epochs=2)
    assert code == 0, run.output
    for rank in (0, 1):
        row = summary["data"][str(rank)]
        assert row["ram_hits"] == row["disk_hits"] == 0
        assert row["source_fetches"] >= _trained(summary, rank)


def test_a_sample_that_cannot_be_read_stops_the_run_naming_its_index(proc_env, tmp_path):
    code, run, _ = _slow_run(proc_env, tmp_path, func="broken_data_task", epochs=1)
    assert code == 4, run.output
    assert "dataset[77] raised OSError: corrupt record 77" in run.output


# ---------------------------------------------------------------- cache warmer


def test_the_warmer_reads_what_is_not_held_until_the_tiers_are_full():
    from flodl.rank.prefetch import CacheWarmer
    from flodl.rank.staging import RamCache, TieredSamples

    reads: list[int] = []

    def read(i):
        reads.append(i)
        return torch.full((256,), float(i))  # 1 KiB each

    tiers = TieredSamples(read, vram=None, ram=RamCache(40 * 1024), disk=None)
    tiers.get(3)  # already read by training
    warmer = CacheWarmer(tiers.get, range(100), held=tiers.holds, full=tiers.full, threads=2)
    warmer.start()
    for thread in warmer._threads:
        thread.join(10.0)
    assert reads.count(3) == 1  # held samples are not read again
    assert tiers.full() and 0 < tiers.stats()["ram"]["bytes"] <= 40 * 1024
    assert len(reads) < 100  # it stopped once the cache refused more


def test_the_warmer_stops_quietly_at_a_broken_sample_and_on_request():
    from flodl.rank.prefetch import CacheWarmer

    seen: list[int] = []

    def read(i):
        if i == 5:
            raise OSError("corrupt")
        seen.append(i)

    warmer = CacheWarmer(read, range(50), held=lambda i: False, full=lambda: False, threads=1)
    warmer.start()
    warmer._threads[0].join(5.0)
    assert seen == [0, 1, 2, 3, 4] and warmer.warmed == 5
    endless = CacheWarmer(lambda i: None, iter(int, 1), held=lambda i: False, full=lambda: False, threads=2)
    endless.start()
    endless.stop(timeout_s=5.0)
    assert not any(t.is_alive() for t in endless._threads)
