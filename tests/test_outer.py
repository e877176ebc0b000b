"""The outer optimizer's step on the averaged update (flodl/rank/outer.py): pure tensor math
checked against torch's own SGD on the pseudo-gradient."""

from __future__ import annotations

import pytest
import torch

from flodl.rank.outer import OuterConfig, OuterStep

from .helpers.gloo import gloo_ranks

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("kind", "lr", "momentum", "factor"),
    [("sgd", 1.0, 0.0, 1.0), ("sgd", 0.5, 0.0, 2.0), ("sgd", 0.7, 0.9, 1.0), ("nesterov", 0.7, 0.9, 1.0), ("nesterov", 0.5, 0.8, 3.0)],
)
def test_the_outer_step_is_torchs_sgd_on_the_pseudo_gradient(kind, lr, momentum, factor):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=g, dtype=torch.float64)
    buffer = torch.randn(7, generator=g, dtype=torch.float64)
    # the factor as the run's LR factor on the average: 1 + (ranks - 1) * ratio, ranks = 2
    outer = OuterStep(OuterConfig(kind, lr, momentum, factor - 1.0, on_average=True), [start, buffer], [True, False])
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([ref], lr=lr * factor, momentum=momentum, nesterov=kind == "nesterov")
    for _ in range(5):
        average = ref.detach() + 0.1 * torch.randn(50, generator=g, dtype=torch.float64)  # where the replicas went
        ref.grad = ref.detach() - average  # the pseudo-gradient, from the anchor
        opt.step()
        # the average lands slice by slice (the CPU backend), the buffer bucket untouched
        got = average.clone()
        outer.step_(0, got[:20], 0, ranks=2)
        outer.step_(0, got[20:], 20, ranks=2)
        buf = buffer.clone()
        outer.step_(1, buf, ranks=2)
        outer.round_done()
        assert torch.allclose(got, ref.detach(), atol=1e-12) and torch.equal(buf, buffer)
    assert outer.steps == 5


def test_the_plain_average_is_no_step_and_the_state_round_trips():
    v = [torch.arange(4.0)]
    assert not OuterConfig().active and OuterConfig("none", 1.0, 0.0, 1.0, on_average=True).active  # the LR factor on it
    assert OuterConfig("none", 1.0, 0.0, 0.5, on_average=True).rate(3) == 2.0 and OuterConfig("sgd", 0.5).rate(3) == 0.5
    outer = OuterStep(OuterConfig("nesterov", 0.7, 0.9), v, [True])
    avg = torch.ones(4)
    outer.step_(0, avg)
    other = OuterStep(OuterConfig("nesterov", 0.7, 0.9), [torch.zeros(4)], [True])
    other.load_tensors(outer.tensors())
    a, b = torch.full((4,), 2.0), torch.full((4,), 2.0)
    outer.step_(0, a)
    other.step_(0, b)
    assert torch.equal(a, b)  # the same state gives the same step: a joiner steps as its peers do
    with pytest.raises(ValueError, match="anchor of bucket 0"):
        other.load_tensors({})


def _outer_rank(rank, world, port, block, out):
    import datetime

    import torch.distributed as dist

    from flodl.rank.collective import CollectiveAverager
    from flodl.rank.flat import FlatModel

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
    group = dist.ProcessGroupGloo(dist.PrefixStore("o", store), rank, world, datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)  # every rank starts from the same anchor
    flat = FlatModel(model)
    avg = CollectiveAverager(flat, group)
    avg.outer = OuterStep(OuterConfig("sgd", 1.0, 0.0, lr_scale_ratio=1.0, on_average=True), [b.values for b in flat.buckets], [True])
    avg.equal_weights = True
    anchor = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * (rank + 1))  # each rank's own progress
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    avg.average(1.0 if rank < 2 else 0.0, block=block)  # rank 2 trained nothing this round
    avg.settle()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    out.put((rank, anchor.tolist(), mine.tolist(), got.tolist(), avg.outer.steps))


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "background"])
def test_equal_weights_with_the_lr_factor_on_the_average_sum_the_ranks_updates(block):
    """Three real gloo ranks, two that trained: ``--average-weights equal --lr-scale-on average``
    (ratio 1) lands anchor + the sum of the two ranks' updates, every sample's step counted once,
    whatever each rank's share; the rank that trained nothing lands the same."""
    got = gloo_ranks(_outer_rank, 3, block)
    anchor = torch.tensor(got[0][1], dtype=torch.float64)
    deltas = [torch.tensor(g[2], dtype=torch.float64) - anchor for g in got[:2]]
    want = anchor + deltas[0] + deltas[1]
    for rank, _, _mine, result, steps in got:
        # a background average keeps what the rank trained since its snapshot: nothing here
        assert torch.allclose(torch.tensor(result, dtype=torch.float64), want, atol=1e-5), rank
        assert steps == 1


#: outer Nesterov at DiLoCo's settings; the sum of the ranks' updates (equal weights, the factor on the average)
NESTEROV = ["--outer-optimizer", "nesterov", "--average-weights", "equal"]
SUMMED = ["--outer-optimizer", "sgd", "--average-weights", "equal", "--lr-scale-on", "average"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
@pytest.mark.parametrize(("script", "outer"), [(False, NESTEROV), (True, SUMMED)], ids=["task-nesterov", "script-summed"])
def test_a_run_with_an_outer_optimizer_trains_and_ends_with_equal_replicas(proc_env, tmp_path, mode, script, outer):
    """An outer step on equal-weight averages: both backends, a Task and a script, two real ranks;
    the run learns, every average went through the outer step alike on every rank (equal final
    replicas on the collective backend)."""
    import json

    from .conftest import TASKS
    from .helpers.procs import Run

    path = tmp_path / "s.json"
    what = ["--script", str(TASKS / "script.py")] if script else ["--task", f"{TASKS / 'tiny.py'}:task"]
    args = [*what, "--nproc-per-node", "2", "--epochs", "4", "--mode", mode, "--no-progress", "--summary-json", str(path)]
    run = Run([*args, *outer], proc_env)
    assert run.wait(90) == 0, run.output
    summary = json.loads(path.read_text())
    history = summary["history"]
    # it learned: the eval of the last row (a script reports its replica's as a scalar)
    accuracy = history[-1]["scalars"]["accuracy"] if script else summary["final_eval"]
    assert summary["exit_reason"] == "completed" and accuracy > 0.7, history
    kind = outer[1]
    assert summary["config"]["outer_optimizer"] == kind and f"outer optimizer {kind}" in run.output
    assert len(set(summary["final_digests"].values())) == 1  # one consensus, either backend


def _drift_rank(rank, world, port, block, out):
    import datetime

    import torch.distributed as dist

    from flodl.rank.collective import CollectiveAverager
    from flodl.rank.flat import FlatModel

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
    group = dist.ProcessGroupGloo(dist.PrefixStore("d", store), rank, world, datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    flat = FlatModel(model)
    avg = CollectiveAverager(flat, group)
    avg.outer = OuterStep(OuterConfig("nesterov", 0.7, 0.9), [b.values for b in flat.buckets], [True])
    readings = []
    for _ in range(3):  # the momentum warms up: the outer step moves further past the average each round
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (rank + 1))  # each rank's own progress, the same every round
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        divergence = avg.average(1.0, measure=True, block=block).divergence
        if not block:  # a background average's drift is read when it lands (the next call reports it)
            avg.settle()
            divergence = avg.last_drift[0]
        readings.append((mine.tolist(), divergence))
    out.put((rank, readings))


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "background"])
def test_the_drift_reads_the_replicas_disagreement_not_the_outer_step(block):
    """Two real gloo ranks, outer Nesterov (0.7, 0.9): the drift the guard reads is each replica's
    distance from the plain average, ‖mine − average‖ / ‖average‖, the same every round when
    the replicas disagree alike. Read against the outer step's result it grew with the momentum
    (1.33x, then 2.5x the update past the average) and the guard shrank the windows."""
    got = gloo_ranks(_drift_rank, 2, block)
    for k in range(3):
        mine = [torch.tensor(g[1][k][0], dtype=torch.float64) for g in got]
        average = (mine[0] + mine[1]) / 2
        for rank, g in enumerate(got):
            want = float((mine[rank] - average).norm() / average.norm())
            assert g[1][k][1] == pytest.approx(want, rel=1e-4), (rank, k)


async def test_the_cpu_backend_drift_reads_the_plain_average_too():
    """The same on the CPU backend (the controller's rounds over real bulk sockets): each round's
    drift is the replica's distance from the plain average, not from the outer step's result."""
    import asyncio

    from .helpers.cpu_plane import controller, rank_side, stop

    ctl, task = await controller()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(4, 3))  # one anchor for both
    avgs = [rank_side(ctl, r, mo) for r, mo in enumerate(models)]
    for a in avgs:
        a.outer = OuterStep(OuterConfig("nesterov", 0.7, 0.9), [b.values for b in a.flat.buckets], [True])
    for k in range(3):
        with torch.no_grad():
            for rank, mo in enumerate(models):
                for p in mo.parameters():
                    p.add_(0.1 * (rank + 1))
        mine = [torch.cat([p.detach().reshape(-1) for p in mo.parameters()]) for mo in models]
        results = await asyncio.gather(*(asyncio.to_thread(a.average, 1.0, measure=True) for a in avgs))
        average = (mine[0] + mine[1]) / 2
        for rank, r in enumerate(results):
            assert r.divergence == pytest.approx(float((mine[rank] - average).norm() / average.norm()), rel=1e-4), (rank, k)
    await stop(ctl, task, avgs)
