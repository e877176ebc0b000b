"""Streamed fragments (``--sync-fragments F``, docs/fragments.md): the cut of a model into
fragments, the collective backend's fragment averages between real gloo processes (one fragment
moves, the others stay each rank's own; after F averages everything was averaged; compressed
anchors and the outer optimizer's state move only with their fragment), and real runs on both
backends: they train, end on one consensus, send about 1/F of the bytes per average, compose
with int8, and a resumed run goes on with the rotation where the bundle's stopped."""

from __future__ import annotations

import json

import pytest
import torch

from flodl.checkpoint.bundle import SavedOptimizer
from flodl.config import DdpRunConfig
from flodl.errors import ConfigError

from .conftest import task_spec
from .helpers.gloo import gloo_ranks
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ the cut


def test_the_parameters_are_cut_in_equal_runs_and_the_model_is_unchanged():
    """F=3 on a model whose largest tensor outweighs the rest: three parameter buckets of equal
    length (a cut may go through a tensor), the buffers in one bucket every average takes, the
    model's values the same, and writing one bucket back changes only its run of the parameters."""
    from flodl.rank.flat import EVERY, PARAMS, FlatModel, model_digest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 10), torch.nn.BatchNorm1d(10))
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    digest = model_digest(model)
    flat = FlatModel(model, 3)
    params = [b for b in flat.buckets if b.group == PARAMS]
    assert [b.fragment for b in params] == [0, 1, 2] and max(b.numel for b in params) - min(b.numel for b in params) <= 1
    assert sum(b.numel for b in params) == before.numel()
    assert [b.fragment for b in flat.buckets if b.group != PARAMS] == [EVERY]
    assert model_digest(model) == digest
    assert flat.chosen(1) == [False, True, False, True] and flat.chosen(None) == [True] * 4
    with torch.no_grad():
        params[1].copy_in()
        params[1].values.add_(1.0)
        params[1].copy_out()
    moved = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before).nonzero().reshape(-1)
    assert moved.min().item() == params[0].numel and moved.max().item() + 1 == params[0].numel + params[1].numel


def test_the_rotation_goes_on_from_a_bundle_for_the_resumed_ranks_and_a_joiner_alike():
    """Fragment k = (n + base) mod F. A resumed run's first average (n = 0) takes the fragment the
    bundle's run would have averaged next; a rank joining it later reads the same stem: the
    earlier run's bundle gives it the same base, and so does one this run saved over it since
    (which names this run and holds its base, not its next fragment)."""
    from flodl.rank.fragments import Rotation, position_counter

    first = Rotation(3)
    assert [first.of(n) for n in range(5)] == [0, 1, 2, 0, 1] and first.of(-1) is None
    saved = first.state("run-a")
    assert saved["sync_fragment_next"] == 2
    resumed, joiner = Rotation(3), Rotation(3)
    resumed.take(saved, "run-b")
    joiner.take(saved, "run-b")  # joined before run-b saved: the stem still holds run-a's bundle
    assert resumed.of(0) == joiner.of(0) == 2
    assert resumed.of(7) == joiner.of(7) == 0
    later = Rotation(3)
    later.take(resumed.state("run-b"), "run-b")  # joined after run-b saved over the stem
    assert later.of(7) == resumed.of(7) and later.of(8) == resumed.of(8)
    assert Rotation(1).of(5) is None and Rotation(1).state("x") == {}
    assert position_counter(3 << 16 | 2) == 5 and position_counter(-1) == -1


# ------------------------------------------------------------------ real gloo ranks


def _fragment_rank(rank, world, port, kind, out):
    import datetime

    import torch.distributed as dist

    from flodl.config.outer import OuterConfig
    from flodl.rank.collective import CollectiveAverager
    from flodl.rank.flat import PARAMS, FlatModel
    from flodl.rank.outer import OuterStep
    from flodl.wire.quant import codec

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(dist.PrefixStore("f", store), rank, world, datetime.timedelta(seconds=30))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8), torch.nn.BatchNorm1d(8))
    flat = FlatModel(model, 2)
    avg = CollectiveAverager(flat, group, compression=codec(kind), fragments=2)
    avg.broadcast_from(0)
    avg.outer = OuterStep(
        OuterConfig(kind="sgd", lr=1.0, momentum=0.5), [b.values.clone() for b in flat.buckets], [b.group == PARAMS for b in flat.buckets]
    )
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
        model[2].running_mean.add_(torch.randn(8, generator=g))

    def params() -> list[float]:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()

    def states() -> list[list[float]]:
        """Per parameter bucket: its compressed anchor (if any), outer anchor and momentum."""
        out = []
        for i, b in enumerate(flat.buckets):
            if b.group != PARAMS:
                continue
            anchor = avg.deltas.anchor[i].tolist() if avg.deltas is not None else []
            out.append([anchor, avg.outer.anchor[i].tolist(), avg.outer.momentum[i].tolist()])
        return out

    rounds = [(params(), model[2].running_mean.tolist(), states())]
    # two averages of one window each: window 0 takes fragment 0, window 1 fragment 1; the second in the background
    for window, block in ((0, True), (1, False)):
        avg.average(float(rank + 1), block=block, tag=window << 16)
        avg.settle()
        rounds.append((params(), model[2].running_mean.tolist(), states()))
    sizes = [b.numel for b in flat.buckets if b.group == PARAMS]
    out.put((rank, rounds, sizes, avg.wire.peak))


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_a_fragment_average_moves_its_fragment_only_and_f_averages_move_all(kind):
    """Two gloo ranks, weights 1:2, F=2 (an outer SGD with momentum on, and int8 deltas in one
    case): the first average makes fragment 0 the weighted average on both ranks and leaves
    fragment 1 each rank's own, its compressed anchor and outer state untouched; the second (in the
    background) averages fragment 1, so after F averages every parameter is the weighted average of
    what the ranks held, equal on both; the BatchNorm statistics go with every average; each
    average's peak bytes are one fragment's."""
    ranks = gloo_ranks(_fragment_rank, 2, kind, result_timeout=90, store_timeout=30)
    sizes = ranks[0][2]
    edge = sizes[0]
    start = [torch.tensor(r[1][0][0], dtype=torch.float64) for r in ranks]
    want = (1.0 * start[0] + 2.0 * start[1]) / 3.0
    tolerance = 5e-4 if kind == "int8" else 1e-6  # int8: half a step of a block of deltas ~0.01, twice rounded
    after1 = [torch.tensor(r[1][1][0], dtype=torch.float64) for r in ranks]
    after2 = [torch.tensor(r[1][2][0], dtype=torch.float64) for r in ranks]
    # the first average: fragment 0 averaged and equal, fragment 1 each rank's own
    assert torch.equal(after1[0][:edge], after1[1][:edge])
    assert (after1[0][:edge] - want[:edge]).abs().max().item() < tolerance
    for mine, now in zip(start, after1, strict=True):
        assert torch.equal(now[edge:], mine[edge:])
    # fragment 1's per-bucket state did not move with fragment 0's average; fragment 0's did
    for r in ranks:
        (f0_before, f1_before), (f0_after, f1_after) = r[1][0][2], r[1][1][2]
        assert f1_after == f1_before and f0_after != f0_before
    # after F = 2 averages every parameter was averaged: one model, the weighted average
    assert torch.equal(after2[0], after2[1])
    assert (after2[0] - want).abs().max().item() < tolerance
    # the buffers go with every average (equal weights among the ranks that trained)
    means = [torch.tensor(r[1][0][1]) for r in ranks]
    for r in ranks:
        assert torch.allclose(torch.tensor(r[1][1][1]), (means[0] + means[1]) / 2, atol=1e-6)
    # the peak one average sent: a fragment's parameters (and the buffers), not the model's
    model_bytes = 4 * sum(sizes)
    assert 0 < ranks[0][3] < (0.3 if kind == "int8" else 0.6) * model_bytes, (ranks[0][3], model_bytes)


# --------------------------------------------------------------------------- real runs


def _run(proc_env, tmp_path, mode: str, fragments: int, *, env: dict | None = None, extra=(), name: str = "") -> dict:
    path = tmp_path / f"{name or mode}-{fragments}.json"
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "4", "--mode", mode, "--no-progress"]
    run = Run([*args, "--sync-fragments", str(fragments), "--summary-json", str(path), *extra], proc_env | (env or {}))
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    summary["output"] = run.output
    return summary


def _first_loss(summary: dict) -> float:
    return summary["history"][0]["loss"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "env"), [("nccl-cadence", {}), ("cpu-cadence", {"FLODL_SHM": "off"})], ids=["collective", "cpu"])
def test_a_fragmented_run_trains_ends_on_one_consensus_and_sends_a_fragment_per_average(proc_env, tmp_path, mode, env):
    """The tiny task, two real ranks, F=2 against F=1: the run completes, its loss drops, its
    eval is the F=1 run's within 3 points, every replica ends on the same values (the last
    average takes every fragment) and the final bundle holds exactly them (written on the way
    out, after that average), and an average's peak bytes are about half of F=1's."""
    from flodl.checkpoint.bundle import load_model
    from flodl.rank.flat import model_digest

    from .tasks.tiny import make_model

    stem = tmp_path / "ck"
    runs = {f: _run(proc_env, tmp_path, mode, f, env=env, extra=["--save-path", str(stem)] if f == 2 else []) for f in (1, 2)}
    two = runs[2]
    assert two["exit_reason"] == "completed" and two["config"]["sync_fragments"] == 2
    assert "averages in 2 fragments" in two["output"]  # the banner says so
    assert two["final_loss"] < 0.6 * _first_loss(two), (two["final_loss"], _first_loss(two))
    assert two["final_eval"] >= runs[1]["final_eval"] - 0.03
    assert len(set(two["final_digests"].values())) == 1 and len(two["final_digests"]) == 2
    model = make_model()
    load_model(model, stem)
    assert model_digest(model) == two["final_digests"]["0"]
    assert "checkpoint (final)" in two["output"]
    peak = {f: s["sync_bytes"]["peak_per_average"] for f, s in runs.items()}
    assert 0 < peak[2] <= 0.6 * peak[1], peak


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "env"), [("nccl-cadence", {}), ("cpu-cadence", {"FLODL_BULK_RELAY": "always"})], ids=["collective", "cpu-relay"]
)
def test_fragments_compose_with_int8(proc_env, tmp_path, mode, env):
    """F=2 with int8 deltas (on the CPU backend through a host relay): the run trains, ends on
    one consensus, and an average sends about an eighth of an uncompressed whole model's bytes."""
    plain = _run(proc_env, tmp_path, mode, 1, env=env, name="plain")
    both = _run(proc_env, tmp_path, mode, 2, env=env, extra=["--sync-compression", "int8"], name="int8")
    assert both["exit_reason"] == "completed" and both["sync_bytes"]["compression"] == "int8"
    assert both["final_loss"] < 0.6 * _first_loss(both)
    assert both["final_eval"] >= plain["final_eval"] - 0.03
    assert len(set(both["final_digests"].values())) == 1
    if mode.startswith("nccl"):  # the relay's (the CPU run's) bytes are the host's, not a rank's
        assert both["sync_bytes"]["peak_per_average"] <= 0.25 * plain["sync_bytes"]["peak_per_average"]
    else:
        assert both["averaging"]["aborted"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode", [["--mode", "nccl-cadence", "--deterministic", "--anchor", "4"], ["--mode", "cpu-sync"]], ids=["collective", "cpu"]
)
def test_a_resumed_run_goes_on_with_the_rotation(proc_env, tmp_path, mode):
    """F=3, averages of a fixed count (windows of 4 batches; Sync: every batch): the bundle
    records the fragment the next average takes (8 or 32 averages: fragment 2); a resumed run's
    averages go on from it, so its own bundle records that fragment moved on by the resumed run's
    averages (a run started afresh would have begun at fragment 0, and recorded another)."""
    from flodl.rank.fragments import NEXT_KEY

    stem = tmp_path / "ck"
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", *mode, "--sync-fragments", "3", "--no-progress"]
    first = Run([*args, "--epochs", "2", "--save-path", str(stem), "--summary-json", str(tmp_path / "a.json")], proc_env)
    assert first.wait(120) == 0, first.output
    saved = SavedOptimizer.read(stem).train_state[NEXT_KEY]
    averages = json.loads((tmp_path / "a.json").read_text())["per_rank"][0]["sync_averages"]
    assert saved == averages % 3
    assert saved != 0  # the premise: a rotation that does not start at fragment 0 again
    resumed_args = ["--summary-json", str(tmp_path / "b.json")]
    resumed = Run([*args, "--epochs", "3", "--resume-from", str(stem), "--save-path", str(tmp_path / "ck2"), *resumed_args], proc_env)
    assert resumed.wait(120) == 0, resumed.output
    more = json.loads((tmp_path / "b.json").read_text())["per_rank"][0]["sync_averages"]
    assert more % 3 != (saved + more) % 3  # the premise: afresh, the rotation would end elsewhere
    assert SavedOptimizer.read(tmp_path / "ck2").train_state[NEXT_KEY] == (saved + more) % 3


def test_a_bad_fragment_count_fails_fast_naming_the_field(proc_env, tmp_path):
    """0 fragments: refused by the builder, by from_dict, and on the command line before anything starts."""
    with pytest.raises(ConfigError, match=r"^sync_fragments: must be an integer >= 1, got 0$"):
        DdpRunConfig().with_sync_fragments(0)
    with pytest.raises(ConfigError, match=r"^sync_fragments: "):
        DdpRunConfig.from_dict({"sync_fragments": "2"})
    run = Run(["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--sync-fragments", "0"], proc_env)
    assert run.wait(30) != 0
    assert "sync_fragments" in run.output


# ------------------------------------------------------------------ joins and deaths


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "env", "fault"),
    [
        ("nccl-cadence", {}, ""),  # the admitting regroup broadcasts the whole consensus
        ("nccl-cadence", {}, "1:regroup:1"),  # a member dies before that broadcast: the joiner adopts fragment by fragment
        ("cpu-cadence", {}, ""),  # the joiner adopts fragment by fragment from the controller's rounds
    ],
    ids=["collective", "collective-adopting", "cpu"],
)
def test_a_joiner_takes_every_fragment_of_the_consensus_and_trains(proc_env, tmp_path, mode, env, fault):
    """A worker joins a running F=2 run: it holds the consensus of no fragment, so it trains only
    once every fragment came to it (whole, or one average per fragment); then it trains, the run
    covers every sample, and every replica ends on one consensus."""
    from .test_growing import grown

    summary = grown(proc_env, tmp_path, mode, env, fault, ["--sync-fragments", "2"])
    assert summary["final_eval"] > 0.7
    digests = summary["final_digests"]
    assert len(set(digests.values())) == 1 and len(digests) == (2 if fault else 4 if mode.startswith("cpu") else 3), digests


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "fault"), [("nccl-cadence", "average:6"), ("cpu-cadence", "average:6")])
def test_a_rank_killed_mid_fragment_average_loses_nothing(proc_env, tmp_path, mode, fault):
    """Rank 1 of three SIGKILLs itself in its 6th fragment average (with int8 deltas): the survivors
    go on (the collective's average redone in the new group at its place, so of its fragment; the
    CPU round without it), every sample trained exactly once, the survivors on one consensus."""
    from .test_elastic import finish, start

    extra = ["--sync-fragments", "2", "--sync-compression", "int8"]
    run, path = start(proc_env | {"FLODL_INJECT_FAULT": f"1:{fault}"}, tmp_path, mode, extra=extra)
    summary = finish(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1] and summary["recoveries"][0]["survivors"] == [0, 2]
    digests = summary["final_digests"]
    assert set(digests) >= {"0", "2"} and digests["0"] == digests["2"], digests
    assert summary["final_eval"] > 0.7
