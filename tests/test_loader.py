"""DataLoader-style loading (``Task.num_workers``, ``prefetch_factor``, ``pin_memory``): worker
processes read the granted batches' samples without changing what is trained; real processes."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import default_collate

from flodl import Task
from flodl.errors import TaskError
from flodl.plan.schedule import digest_positions
from flodl.rank.data import BatchSource, pinned
from flodl.rank.loader import WorkerReads
from flodl.rank.staging import RamCache, TieredSamples

from .conftest import TASKS, task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run, assert_all_gone

EPOCHS = 3
SAMPLES = 512


class Logged(torch.utils.data.Dataset):
    """``(x, i)`` samples; every read appends ``i`` to ``<dir>/<pid>``; ``bad`` raises."""

    def __init__(self, where: Path, n: int = 200, bad: int = -1) -> None:
        self.where, self.n, self.bad = where, n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        with open(self.where / str(os.getpid()), "a") as f:
            f.write(f"{i}\n")
        return torch.full((3,), float(i)), i


def reads(where: Path) -> dict[int, list[int]]:
    return {int(p.name): [int(x) for x in p.read_text().split()] for p in where.iterdir()}


def with_pid(samples: list):
    """A collate that says which process collated the batch."""
    return (*default_collate(samples), os.getpid())


def source(dataset, *, workers: int = 0, tiers=None, collate=None) -> BatchSource:
    src = BatchSource(dataset, batch_size=16, seed=5, collate_fn=collate)
    if tiers is not None:
        src.stage(tiers)
    if workers:
        src.read_with(WorkerReads(dataset, workers=workers, prefetch_factor=2, seed=5, collate_fn=collate), pin=False)
    return src


def flat(batches) -> list[tuple[int, list[int], list[int]]]:
    return [(epoch, picks.tolist(), batch[1].tolist()) for epoch, picks, batch in batches]


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"num_workers": -1}, "Task.num_workers must be an int >= 0, got -1"),
        ({"num_workers": True}, "Task.num_workers must be an int >= 0"),
        ({"prefetch_factor": 2}, "Task.prefetch_factor is how many batches each worker reads ahead: it needs num_workers > 0"),
        ({"num_workers": 2, "prefetch_factor": 0}, "Task.prefetch_factor must be an int >= 1 or None, got 0"),
        ({"pin_memory": "yes"}, "Task.pin_memory must be True or False"),
    ],
)
def test_bad_loader_options_fail_naming_the_field(fields, says):
    with pytest.raises(TaskError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Task(model=torch.nn.Linear, optimizer=torch.optim.SGD, dataset=[1], batch_size=1, loss_fn=torch.nn.functional.mse_loss, **fields)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_pins_every_host_tensor_and_keeps_the_structure():
    batch = {"x": torch.ones(2), "meta": ("a", [torch.zeros(1)]), "on": torch.ones(1, device="cuda")}
    out = pinned(batch)
    assert out["x"].is_pinned() and out["meta"][1][0].is_pinned() and out["meta"][0] == "a"
    assert out["on"] is batch["on"] and torch.equal(out["x"], batch["x"])


# ---------------------------------------------------------------- the rank's data path, in process


@pytest.fixture
def cached(tmp_path):
    """A source with 2 loader workers over a RAM cache big enough for all: ``(source, tiers, reads dir)``."""
    seen = tmp_path / "w"
    seen.mkdir()
    tiers = TieredSamples(Logged(seen).__getitem__, vram=None, ram=RamCache(1 << 24), disk=None)
    loaded = source(Logged(seen), workers=2, tiers=tiers)
    yield loaded, tiers, seen
    loaded.workers.close()


@pytest.mark.timeout(60)
def test_worker_reads_give_the_in_process_batches_and_fill_the_tiers(tmp_path, cached):
    loaded, tiers, seen = cached
    grants = [[0, 0, 120], [0, 150, 50]]
    got = flat(loaded.loaded_batches(grants))
    assert got == flat(source(Logged(tmp_path)).window_batches(grants))
    workers = set(loaded.workers.pids)
    assert len(workers) == 2 and os.getpid() not in workers
    read = reads(seen)
    assert set(read) <= workers and sorted(i for ids in read.values() for i in ids) == sorted(i for _, _, b in got for i in b)
    assert tiers.stats()["source"]["fetches"] == 170 and all(tiers.holds(i) for _, _, b in got for i in b)
    # the next window's samples are all held: the workers read nothing, the tiers serve them
    again = flat(loaded.loaded_batches([[1, 0, 200]]))
    assert sorted(i for _, _, b in again for i in b) == list(range(200))
    assert sum(map(len, reads(seen).values())) == 170 + 30  # only the 30 never granted before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tiers", ["none", "full"])
def test_without_room_in_the_tiers_a_worker_collates_whole_batches(tmp_path, tiers):
    """No tier (sample_cache off), or tiers that refused a sample: each batch is read and collated
    in one worker, as torch's DataLoader does it, with the batches the rank would have made."""
    staged = TieredSamples(Logged(tmp_path).__getitem__, vram=None, ram=RamCache(0) if tiers == "full" else None, disk=None)
    if tiers == "full":
        staged.offer(0, (torch.zeros(3), 0))  # refused: a full tier
        assert staged.full()
    loaded = source(Logged(tmp_path), workers=2, tiers=staged, collate=with_pid)
    try:
        got = list(loaded.loaded_batches([[0, 0, 120], [0, 150, 50]]))
        reference = source(Logged(tmp_path), collate=with_pid).window_batches([[0, 0, 120], [0, 150, 50]])
        assert flat(got) == flat(reference)
        assert {batch[2] for _, _, batch in got} == set(loaded.workers.pids)  # collated there, by both
        assert staged.stats()["source"]["fetches"] == 170 + (tiers == "full")
    finally:
        loaded.workers.close()


@pytest.mark.timeout(60)
def test_discarded_workers_are_gone_and_the_next_window_starts_new_ones(tmp_path):
    loaded = source(Logged(tmp_path), workers=2)
    try:
        first = flat(loaded.loaded_batches([[0, 0, 64]]))
        old = [psutil.Process(pid) for pid in loaded.workers.pids]
        loaded.workers.discard()
        assert_all_gone(old, timeout=10)
        rest = flat(loaded.loaded_batches([[0, 64, 136]]))
        assert not {p.pid for p in old} & set(loaded.workers.pids)
        assert first + rest == flat(source(Logged(tmp_path)).window_batches([[0, 0, 200]]))
    finally:
        loaded.workers.close()


@pytest.mark.timeout(60)
def test_a_window_cut_short_drops_its_read_ahead_and_the_next_window_gets_only_its_own(tmp_path):
    """What the workers read ahead of a window's last trained batch is never delivered: the next
    window (which the dispatcher gives the untrained rest) starts exactly where it says."""
    loaded = source(Logged(tmp_path), workers=2)
    reference = source(Logged(tmp_path))
    try:
        window = loaded.loaded_batches([[0, 0, 200]])
        first = flat([next(window) for _ in range(3)])  # a quota: 3 batches trained, more read ahead
        window.close()
        rest = flat(loaded.loaded_batches([[0, 48, 152]]))
        assert first + rest == flat(reference.window_batches([[0, 0, 200]]))
    finally:
        loaded.workers.close()


@pytest.mark.timeout(60)
def test_what_a_cut_short_window_read_ahead_stays_in_the_tiers_and_is_not_read_again(tmp_path, cached):
    loaded, tiers, seen = cached
    window = loaded.loaded_batches([[0, 0, 200]])
    trained = flat([next(window) for _ in range(3)])
    window.close()  # the window ends: reads stop, those in flight land in the tiers
    ahead = sum(map(len, reads(seen).values()))
    assert 48 < ahead < 200 and tiers.stats()["source"]["fetches"] == ahead
    rest = flat(loaded.loaded_batches([[0, 48, 152]]))
    assert trained + rest == flat(source(Logged(tmp_path)).window_batches([[0, 0, 200]]))
    assert sorted(i for ids in reads(seen).values() for i in ids) == list(range(200))  # each sample read once


@pytest.mark.timeout(60)
def test_a_failing_getitem_in_a_worker_is_named_by_its_index(tmp_path):
    loaded = source(Logged(tmp_path, bad=7), workers=2)
    try:
        with pytest.raises(TaskError, match=r"dataset\[7\] raised ValueError: sample 7 is corrupt"):
            list(loaded.loaded_batches([[0, 0, 200]]))
    finally:
        loaded.workers.close()


# ---------------------------------------------------------------- real runs


def start(
    tmp_path: Path, name: str, env: dict, *, script: bool = False, epochs: int = EPOCHS, cache: bool = False, extra=()
) -> tuple[Run, Path, Path]:
    logs = tmp_path / name
    logs.mkdir()
    summary = tmp_path / f"{name}.json"
    what = ["--script", str(TASKS / "script.py")] if script else ["--task", task_spec("loaded.py")]
    args = [*what, "--nproc-per-node", "2", "--epochs", str(epochs), "--summary-json", str(summary), *extra]
    args += [] if cache else ["--no-sample-cache"]
    return Run(args, {**env, "FLODL_TEST_LOG_DIR": str(logs)}), logs, summary


def pids_of(logs: Path, kind: str) -> set[int]:
    return {int(p.name.split(".")[1]) for p in logs.glob(f"{kind}.*")}


def loader_readers(logs: Path, ranks: set[int]) -> set[int]:
    """The processes that read samples besides the ranks, whose only reads must be the dataset
    digest's at the start (its positions, read twice: rank/dataset_digest.py)."""
    for pid in ranks:
        assert (logs / f"reads.{pid}").read_text().split() == [str(i) for i in digest_positions(SAMPLES)] * 2, pid
    return pids_of(logs, "reads") - ranks


def trained_counts(logs: Path) -> Counter:
    return Counter(int(i) for p in logs.glob("trained.*") for i in p.read_text().split())


def finished(run: Run, summary: Path, epochs: int = EPOCHS) -> dict:
    assert run.wait(120) == 0, run.output
    out = json.loads(summary.read_text())
    assert epoch_samples(out["history"]) == [SAMPLES] * epochs  # the ledger: every sample once an epoch
    return out


@pytest.mark.timeout(180)
def test_two_workers_train_every_sample_once_and_reach_the_in_process_result(proc_env, tmp_path):
    """A deterministic run with num_workers=2 trains what num_workers=0 trains, to the same
    weights; every sample once an epoch, each read in a loader worker, never in a rank (but
    for the dataset digest's few reads at the start)."""
    runs = {}
    for workers in (0, 2):
        run, logs, summary = start(tmp_path, f"w{workers}", {**proc_env, "FLODL_TEST_NUM_WORKERS": str(workers)}, extra=["--deterministic"])
        runs[workers] = (finished(run, summary), logs)
    for _, logs in runs.values():
        assert trained_counts(logs) == Counter({i: EPOCHS for i in range(SAMPLES)})
    (plain, plain_logs), (loaded, loaded_logs) = runs[0], runs[2]
    ranks = pids_of(loaded_logs, "trained")
    readers = loader_readers(loaded_logs, ranks)
    assert len(ranks) == 2 and len(readers) == 4  # two workers per rank read it all
    assert pids_of(plain_logs, "reads") == pids_of(plain_logs, "trained")  # without workers the ranks read
    assert loaded["final_eval"] == plain["final_eval"] and loaded["final_loss"] == plain["final_loss"]
    assert loaded["final_digests"] == plain["final_digests"]


@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA (on a host with a CUDA GPU these run)")
def test_a_gpu_rank_reads_through_pinned_loader_workers_and_trains_every_sample_once(proc_env, tmp_path):
    """A CUDA rank beside a CPU rank, each with two loader workers and pin_memory: the GPU rank's
    batches arrive pinned (copied to the device without a host stall), the CPU rank's are left
    alone, and the ledger still counts every sample once an epoch."""
    env = {**proc_env, "FLODL_TEST_NUM_WORKERS": "2", "FLODL_TEST_PIN_MEMORY": "1"}
    run, logs, summary = start(tmp_path, "pinned", env, extra=["--devices", "cuda:0,cpu", "--mode", "cpu-cadence"])
    finished(run, summary)
    assert trained_counts(logs) == Counter({i: EPOCHS for i in range(SAMPLES)})
    pinned = pids_of(logs, "pinned")
    assert len(pinned) == 1 and pinned <= pids_of(logs, "trained")  # the GPU rank, every batch of it
    gpu_batches = sum(1 for p in logs.glob("pinned.*") for _ in p.read_text().split())
    assert gpu_batches > 0


@pytest.mark.timeout(150)
def test_a_rank_killed_mid_epoch_takes_its_loader_workers_with_it(proc_env, tmp_path):
    env = {**proc_env, "FLODL_TEST_NUM_WORKERS": "2", "FLODL_TEST_STEP_SLEEP": "0.03"}
    run, logs, summary = start(tmp_path, "kill", env, epochs=6)
    victim = run.ranks(2)[1]

    def reading() -> list[psutil.Process]:
        """The victim's loader workers once both have read (they start with its first window)."""
        workers = victim.children()
        return workers if len(workers) == 2 and {w.pid for w in workers} <= pids_of(logs, "reads") else []

    deadline = time.monotonic() + 60
    while not (workers := reading()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers, run.output
    tree = run.tree()  # every rank and every loader worker
    os.kill(victim.pid, signal.SIGKILL)
    # gone at once (the kernel's parent-death signal), not after torch's 5 s watchdog interval
    assert_all_gone(workers, timeout=2)
    out = finished(run, summary, epochs=6)
    assert [d["pid"] for d in out["deaths"]] == [victim.pid]
    assert_all_gone(tree)  # the survivor's workers end with it


@pytest.mark.timeout(120)
def test_script_mode_reads_with_workers_into_the_sample_cache(proc_env, tmp_path):
    """The RAM cache on: the workers' reads fill it, and nothing reads in the ranks but the dataset
    digest at the start (the cache warmer, whose reads would hold the rank's GIL, stays off with workers)."""
    run, logs, summary = start(tmp_path, "script", {**proc_env, "FLODL_TEST_NUM_WORKERS": "2"}, script=True, cache=True)
    out = finished(run, summary)
    assert trained_counts(logs) == Counter({i: EPOCHS for i in range(SAMPLES)})
    ranks = pids_of(logs, "trained")
    readers = loader_readers(logs, ranks)
    assert len(ranks) == 2 and len(readers) == 4
    reads = sum(len((logs / f"reads.{pid}").read_text().split()) for pid in readers)
    assert reads == sum(rank["source_fetches"] for rank in out["data"].values()) < EPOCHS * SAMPLES  # later epochs hit the cache


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("script", "says"), [(False, "Task.num_workers must be an int >= 0, got -1"), (True, "run.prepare(..., num_workers=...)")]
)
def test_a_negative_num_workers_stops_the_run_naming_it(proc_env, tmp_path, script, says):
    run, _, _ = start(tmp_path, "bad", {**proc_env, "FLODL_TEST_NUM_WORKERS": "-1"}, script=script)
    assert run.wait(60) != 0
    assert says in run.output, run.output
