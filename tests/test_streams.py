"""Every rank's random streams (rank/determinism.py) and the dataset digest (rank/dataset_digest.py).

In every run the ranks build alike (their RNGs seeded from --seed, the same on every rank: an
unseeded dataset comes out equal) and train on their own streams (seeded from (seed, rank): their
own dropout masks and draws), whether their worker forks them from a zygote or execs them, in a
Task and in script mode; a dataset that still differs across ranks is refused at the start.
Real runs of two CPU ranks (tests/tasks/streams.py records what each rank drew).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy
import pytest
import torch

from flodl.errors import EXIT_CONFIG
from flodl.plan.schedule import digest_positions
from flodl.rank.dataset_digest import dataset_digest
from flodl.rank.determinism import seed_everything
from flodl.shards import Shards

from .conftest import TASKS, task_spec
from .helpers.procs import Run
from .tasks import streams

SEED = 5
#: how a worker starts its ranks: forked from a zygote (the suite's server, else the worker's own), or exec'd
STARTS = {"forked": {}, "exec": {"FLODL_ZYGOTE": "off"}}


def expected(stream: int) -> dict:
    """What a rank draws first from the stream ``stream`` of the run seed (0: the build phase)."""
    seed_everything(SEED, stream)
    return streams.draws()


def expected_data_sum(*, script: bool = False) -> float:
    """The sum of the dataset a rank builds from the run seed (a script draws ``draws()`` first)."""
    seed_everything(SEED)
    if script:
        streams.draws()
    x, _ = streams.make_data()
    return float(x.double().sum())


def records(out: Path, ranks=(0, 1)) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


def start(proc_env, tmp_path, what: list[str], env: dict, extra=()) -> tuple[Run, Path]:
    out = tmp_path / "out"
    out.mkdir()
    args = [*what, "--nproc-per-node", "2", "--epochs", "1", "--seed", str(SEED), *extra]
    return Run(args, {**proc_env, **env, "FLODL_TEST_OUT": str(out)}), out


def assert_own_streams(ranks: list[dict], numbers: list[int]) -> None:
    """Each rank trained on its own stream, derived from (seed, rank): draws and dropout masks differ."""
    for rank, record in zip(numbers, ranks, strict=True):
        assert record["train"] == expected(rank + 1), rank
    first, second = ranks[0], ranks[1]
    for kind in ("torch", "numpy", "random"):
        assert first["train"][kind] != second["train"][kind], kind
    assert first["mask"] != second["mask"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", list(STARTS))
def test_task_ranks_build_alike_and_train_on_streams_of_their_own(proc_env, tmp_path, how):
    run, out = start(proc_env, tmp_path, ["--task", task_spec("streams.py")], STARTS[how])
    assert run.wait(60) == 0, run.output
    ranks = records(out)
    # the build phase: data drawn from all three global generators, unseeded, equal on both ranks
    assert ranks[0]["data"] == ranks[1]["data"] == expected_data_sum()
    assert_own_streams(ranks, [0, 1])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", list(STARTS))
def test_script_ranks_build_alike_until_prepare_returns_then_draw_their_own(proc_env, tmp_path, how):
    run, out = start(proc_env, tmp_path, ["--script", str(TASKS / "streams.py")], STARTS[how])
    assert run.wait(60) == 0, run.output
    ranks = records(out)
    assert ranks[0]["build"] == ranks[1]["build"] == expected(0)  # between flodl.init() and run.prepare()
    assert ranks[0]["data"] == ranks[1]["data"] == expected_data_sum(script=True)
    assert_own_streams(ranks, [0, 1])


@pytest.mark.timeout(120)
def test_a_restarted_rank_trains_on_a_stream_of_its_own(proc_env, tmp_path):
    """Rank 1 dies; rank 2, started in its place, builds the same dataset and draws its own stream."""
    hold = tmp_path / "joined"
    env = {"FLODL_INJECT_FAULT": "1:batch:3", "FLODL_TEST_HOLD_FILE": str(hold)}
    run, out = start(proc_env, tmp_path, ["--task", task_spec("streams.py")], env, extra=["--max-restarts", "1", "--epochs", "4"])
    run.wait_for_line("training with 2 rank(s)", timeout=90)
    hold.touch()
    assert run.wait(60) == 0, run.output
    ranks = records(out, (0, 1, 2))
    assert ranks[0]["data"] == ranks[2]["data"]
    assert_own_streams([ranks[0], ranks[2]], [0, 2])
    assert ranks[1]["train"] != ranks[2]["train"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", list(STARTS))
def test_a_dataset_that_differs_across_ranks_is_refused_naming_them(proc_env, tmp_path, how):
    run, _ = start(proc_env, tmp_path, ["--task", task_spec("streams.py")], {**STARTS[how], "FLODL_TEST_DATA_RANK": "1"})
    assert run.wait(60) == EXIT_CONFIG, run.output
    found = re.search(
        r"rank (\d) on host .* cannot join: its dataset differs from rank (\d)'s \(the samples at positions ([\d, ]+) ", run.output
    )
    assert found and {found[1], found[2]} == {"0", "1"}, run.output
    assert found[3] == ", ".join(map(str, digest_positions(streams.SAMPLES)))
    assert "every rank must build the same samples in the same order; seed what makes them" in run.output
    assert "Traceback" not in run.output


# ---------------------------------------------------------------- the digest, in this process


class Augmented(torch.utils.data.Dataset):
    """Samples of several kinds; ``noise``: drawn from the global generators (a random transform),
    or from a generator of the dataset's own, unseeded (``private``)."""

    def __init__(self, n: int = 100, noise: str = "", values=None) -> None:
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) if values is None else values
        self.noise = noise
        self.own = numpy.random.default_rng()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.noise == "global":
            x = x + torch.rand(3) + numpy.random.rand() + random.random()
        elif self.noise == "private":
            x = x + float(self.own.random())
        return {"x": x, "pair": (i, f"id{i}", numpy.float32(i / 2)), "none": None}


def test_the_digest_positions_run_from_the_first_sample_to_the_last():
    assert digest_positions(1000) == [0, 142, 285, 428, 570, 713, 856, 999]
    assert digest_positions(5) == [0, 1, 2, 3, 4]
    assert digest_positions(1) == [0] and digest_positions(0) == []


def test_the_digest_tells_datasets_apart_at_its_positions_only():
    base = Augmented()
    assert dataset_digest(base) == dataset_digest(Augmented()) != ""
    changed = Augmented(values=base.x.clone())
    changed.x[digest_positions(100)[3]] += 1.0
    assert dataset_digest(changed) != dataset_digest(base)
    elsewhere = Augmented(values=base.x.clone())
    elsewhere.x[digest_positions(100)[3] + 1] += 1.0  # a cheap digest: a few positions, not every sample
    assert dataset_digest(elsewhere) == dataset_digest(base)


def test_a_random_transform_from_the_global_generators_hashes_alike_and_leaves_them_as_they_were():
    data = Augmented(noise="global")
    torch.manual_seed(1)
    one = dataset_digest(data)
    before = (torch.random.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate())
    torch.manual_seed(2)  # another rank's state: the digest's reads draw from their own seed
    two = dataset_digest(data)
    assert one == two != ""
    torch.manual_seed(1)
    dataset_digest(data)
    after = (torch.random.get_rng_state(), numpy.random.get_state()[1], random.getstate())
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]


def test_what_cannot_be_hashed_the_same_way_twice_leaves_the_digest_empty():
    class Opaque(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return object()

    class Failing(Opaque):
        def __getitem__(self, i):
            raise OSError(f"corrupt record {i}")

    assert dataset_digest(Augmented(noise="private")) == ""  # augmentation from the dataset's own generator
    assert dataset_digest(Opaque()) == ""  # not plain data (an image object)
    assert dataset_digest(Failing()) == ""  # training will say so


def test_shards_are_hashed_by_their_ids_never_opened():
    opened = []

    def open_shard(shard):
        opened.append(shard)
        return [shard]

    ids = [Path(f"/data/shard-{i:03}.bin") for i in range(40)]
    digest = dataset_digest(Shards(ids, open_shard))
    assert digest == dataset_digest(Shards([os.fspath(p) for p in ids], open_shard)) != ""
    assert digest != dataset_digest(Shards(ids[::-1], open_shard))
    assert opened == []
