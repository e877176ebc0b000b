"""Compressed syncs (``--sync-compression``, docs/compression.md): the codecs and their error
feedback (pure), the collective backend's compressed exchange between real gloo processes, and
real runs on both backends (through a host relay too): they learn as the uncompressed run does,
end with equal replicas, and say in their summary how many bytes each average sent."""

from __future__ import annotations

import json

import pytest
import torch

from flodl.wire.quant import BLOCK, codec, compress

from .conftest import task_spec
from .helpers.gloo import gloo_ranks
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ the codecs


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 7])
def test_a_delta_decodes_to_within_its_encodings_step(kind, n):
    c = codec(kind)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = c.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == c.nbytes(n)
    err = (c.decode(payload, n) - x).abs()
    if kind == "int8":  # half a step of its block's scale (absmax / 127)
        scale = torch.nn.functional.pad(x.abs(), (0, -n % BLOCK)).view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[:n] / 127
        assert bool((err <= scale / 2 + 1e-7).all())
    else:  # bfloat16 keeps 8 bits of mantissa
        assert bool((err <= x.abs() * 2**-8).all())
    assert c.decode(c.encode(torch.zeros(n)), n).count_nonzero() == 0  # a block of zeros: no division by zero


def test_the_codec_of_a_kind_and_a_bad_kind_named():
    assert codec("none") is None and codec("int8").nbytes(BLOCK + 1) == BLOCK + 1 + 8
    with pytest.raises(ValueError, match="none, bf16, int8, got 'fp8'"):
        codec("fp8")


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_error_feedback_keeps_the_sum_of_what_was_sent_on_the_sum_of_what_was_meant(kind):
    """Each round's delta has a large value per block and many small ones that compression rounds
    away (int8: below half the block's step; bf16: under 1.0's last bit). Without error feedback
    those are lost every round and the sum drifts; with it, what was sent over the rounds sums to
    what was meant, less only the residual still held (one step at most)."""
    c = codec(kind)
    n, rounds = 4 * BLOCK, 400
    meant = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    plain = torch.zeros(n, dtype=torch.float64)
    residual = None
    g = torch.Generator().manual_seed(1)
    for _ in range(rounds):
        x = 1e-3 * (1 + 0.1 * torch.rand(n, generator=g))
        x[::BLOCK] = 1.0
        if kind == "bf16":
            x += 1.0  # every value near 1: 1e-3 sits under bfloat16's step there
        payload, residual = compress(c, x, residual)
        meant += x.double()
        sent += c.decode(payload, n).double()
        plain += c.decode(c.encode(x), n).double()
    ef, no_ef = (meant - sent).abs().max().item(), (meant - plain).abs().max().item()
    assert torch.allclose(meant - sent, residual.double(), atol=1e-4)  # nothing lost: only late
    assert ef < 0.01 and no_ef > 0.3 and no_ef > 30 * ef, (ef, no_ef)


# ------------------------------------------- the collective backend, real gloo processes


def _compressed_rank(rank, world, port, kind, out):
    import datetime

    import torch.distributed as dist

    from flodl.rank.collective import CollectiveAverager
    from flodl.rank.flat import FlatModel

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(dist.PrefixStore("z", store), rank, world, datetime.timedelta(seconds=30))
    torch.manual_seed(rank)  # unlike starts: the broadcast makes them one
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.BatchNorm1d(96))
    avg = CollectiveAverager(FlatModel(model), group, compression=codec(kind))
    avg.broadcast_from(0)
    bn = model[1]
    g = torch.Generator().manual_seed(100 + rank)
    rounds = []
    for step, block in enumerate([True, False, True, False]):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
            bn.running_mean.add_(torch.randn(96, generator=g))
            bn.num_batches_tracked.fill_(10 * rank + step)  # a counter: never averaged, never compressed
        if step == 3 and rank == 2 and avg.deltas is not None:
            avg.deltas.anchor[0][0] += 1e-4  # one value unlike the others' anchors: the exchange must notice
        mine = [t.detach().double().reshape(-1).tolist() for t in (*model.parameters(), bn.running_mean)]
        avg.average(float(rank + 1), block=block)
        avg.settle()
        got = [t.detach().double().reshape(-1).tolist() for t in (*model.parameters(), bn.running_mean)]
        rounds.append((mine, got, int(bn.num_batches_tracked), avg.wire.gauges()["sync_sent_bytes"]))
    out.put((rank, rounds))


def _gloo_ranks(kind: str, world: int = 3) -> list:
    return gloo_ranks(_compressed_rank, world, kind, result_timeout=90, store_timeout=30)


@pytest.fixture(scope="module")
def uncompressed_ranks() -> list:
    """The same averages uncompressed: the bytes to compare with (once for the module's tests)."""
    return _gloo_ranks("none")


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_compressed_collective_average_is_the_weighted_average_and_leaves_equal_replicas(kind, uncompressed_ranks):
    """Three gloo ranks, weights 1:2:3, blocking and background averages: every replica holds the
    same bits after each (an anchor made unlike the others' included: the values then go out whole),
    near the exact weighted average; BatchNorm's running mean is averaged exactly (buffers go
    whole) and its counter stays each rank's own; int8 sends about a quarter of none's bytes."""
    got = {kind: _gloo_ranks(kind), "none": uncompressed_ranks}
    tolerance = 5e-4 if kind == "int8" else 2e-4  # the deltas are ~0.01 a step, a few steps
    for compression, ranks in got.items():
        for index in range(4):
            mines = [[torch.tensor(t, dtype=torch.float64) for t in r[1][index][0]] for r in ranks]
            results = [[torch.tensor(t, dtype=torch.float64) for t in r[1][index][1]] for r in ranks]
            for tensors in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(results[0], tensors, strict=True)), (compression, index)
            weights = [1.0, 2.0, 3.0]
            *params, mean = results[0]
            for i, p in enumerate(params):
                want = sum(w * m[i] for w, m in zip(weights, mines, strict=True)) / sum(weights)
                assert (p - want).abs().max().item() < (tolerance if compression != "none" else 1e-6), (compression, index, i)
            assert torch.allclose(mean, sum(m[-1] for m in mines) / 3, atol=1e-5), (compression, index)
            assert [r[1][index][2] for r in ranks] == [10 * r + index for r in range(3)]
    # bytes per average, before the one whose anchors disagreed (its values then went out whole too)
    sent = {c: [r[3] for r in ranks[0][1]] for c, ranks in got.items()}
    assert sent["none"][2] >= (3.5 if kind == "int8" else 1.9) * sent[kind][2], sent
    assert sent[kind][3] - sent[kind][2] > sent["none"][3] - sent["none"][2], sent


# --------------------------------------------------------------------------- real runs


def _run(proc_env, tmp_path, mode: str, compression: str, env: dict, extra=()) -> dict:
    path = tmp_path / f"{mode}-{compression}.json"
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "4", "--mode", mode, "--no-progress"]
    run = Run([*args, "--sync-compression", compression, "--summary-json", str(path), *extra], proc_env | env)
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    summary["output"] = run.output
    return summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "env", "extra"),
    [
        ("nccl-cadence", {}, ["--deterministic"]),
        ("cpu-sync", {"FLODL_SHM": "off"}, []),  # every snapshot on the socket, as across hosts
        ("cpu-sync", {"FLODL_BULK_RELAY": "always", "FLODL_SHM": "off"}, []),  # through a host relay
    ],
    ids=["collective", "cpu", "cpu-relay"],
)
def test_a_compressed_run_learns_as_the_uncompressed_one_with_equal_replicas_and_fewer_bytes(proc_env, tmp_path, mode, env, extra):
    """The tiny task, two real ranks, each compression: the final loss within 2% of the
    uncompressed run's, the same eval, the replicas equal at the end, and the summary's bytes per
    average (per rank, and summed) a quarter of none's for int8, a half for bf16."""
    runs = {c: _run(proc_env, tmp_path, mode, c, env, extra) for c in ("none", "bf16", "int8")}
    for compression, summary in runs.items():
        assert summary["exit_reason"] == "completed" and summary["config"]["sync_compression"] == compression
        assert (f"{compression}-compressed averages" in summary["output"]) == (compression != "none")  # the banner says so
        assert abs(summary["final_loss"] - runs["none"]["final_loss"]) <= 0.02 * runs["none"]["final_loss"], compression
        assert summary["final_eval"] >= runs["none"]["final_eval"] - 0.02, compression
        assert len(set(summary["final_digests"].values())) == 1, compression
        wire = summary["sync_bytes"]
        assert wire["compression"] == compression and wire["per_average"] > 0 and wire["broadcast"] > 0
        for row in summary["per_rank"]:
            assert row["sync_averages"] > 0 and row["sync_bytes_per_average"] == row["sync_sent_bytes"] / row["sync_averages"]
    per_average = {c: s["sync_bytes"]["per_average"] for c, s in runs.items()}
    assert per_average["none"] >= 3.5 * per_average["int8"] and per_average["none"] >= 1.9 * per_average["bf16"], per_average
    if mode.startswith("cpu"):
        averaging = {c: s["averaging"] for c, s in runs.items()}
        assert all(a["aborted"] == 0 for a in averaging.values()), averaging
        # what the controller received and sent back on its socket: compressed both ways
        assert averaging["none"]["ingress_bytes"] >= 3 * averaging["int8"]["ingress_bytes"] > 0, averaging
        assert averaging["none"]["egress_bytes"] >= 3 * averaging["int8"]["egress_bytes"] > 0, averaging


# ------------------------------------------------------------------ joiners


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "env", "fault"),
    [
        ("nccl-cadence", {}, ""),  # the admitting regroup broadcasts the consensus: the anchor
        ("nccl-cadence", {}, "1:regroup:1"),  # a member dies before that broadcast: the joiner adopts through an average
        ("cpu-cadence", {"FLODL_BULK_RELAY": "always"}, ""),  # a relayed joiner: its first round goes out whole
    ],
    ids=["collective", "collective-adopting", "cpu-relayed"],
)
def test_a_joiner_takes_the_consensus_under_int8_and_trains(proc_env, tmp_path, mode, env, fault):
    """A worker joins a running int8 run: it holds no anchor, so its first consensus must come
    whole (a broadcast, a collective average whose anchors disagree, a CPU round with a fresh
    source); it then trains, the run covers every sample, and the collective's replicas end equal."""
    from .test_growing import grown

    summary = grown(proc_env, tmp_path, mode, env, fault, ["--sync-compression", "int8"])
    assert summary["final_eval"] > 0.7 and summary["sync_bytes"]["compression"] == "int8"
    digests = summary["final_digests"]  # one consensus on either backend (the CPU one lands its last round)
    assert len(set(digests.values())) == 1 and len(digests) == (4 if mode.startswith("cpu") else 2 if fault else 3)
    if not mode.startswith("nccl"):
        assert summary["averaging"]["aborted"] == 0


# ------------------------------------------------------------------ deaths


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "fault"), [("nccl-cadence", "average:6"), ("nccl-sync", "average:6"), ("cpu-cadence", "average:6")])
def test_a_rank_killed_mid_compressed_average_loses_nothing(proc_env, tmp_path, mode, fault):
    """Rank 1 of three SIGKILLs itself in its 6th compressed average: the survivors go on (the
    collective's exchange given up and redone in the new group, its owners' residuals started
    over; the CPU round without it), every sample trained exactly once, the collective's
    survivors on one consensus."""
    from .test_elastic import finish, start

    run, path = start(proc_env | {"FLODL_INJECT_FAULT": f"1:{fault}"}, tmp_path, mode, extra=["--sync-compression", "int8"])
    summary = finish(run, path)
    assert [d["rank"] for d in summary["deaths"]] == [1] and summary["recoveries"][0]["survivors"] == [0, 2]
    assert summary["final_digests"]["0"] == summary["final_digests"]["2"]  # one consensus, either backend
    assert summary["final_eval"] > 0.7
