"""Rank-side building blocks: task specs, batches, flat averaging over real gloo groups."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from flodl import Task, TaskError, record_scalar, scalars
from flodl.plan.schedule import slice_indices
from flodl.rank.collective import CollectiveAverager, Superseded, build_group
from flodl.rank.data import BatchSource, to_device
from flodl.rank.flat import FlatModel
from flodl.taskspec import load_task, spec_of

from .conftest import task_spec
from .helpers.gloo import gloo_ranks

pytestmark = pytest.mark.timeout(60)


def _model():
    return torch.nn.Linear(2, 1)


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_task_validation_names_the_field():
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(TaskError, match="batch_size"):
        Task(model=_model, optimizer=_opt, dataset=ds, batch_size=0, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(TaskError, match="exactly one of loss_fn or train_step"):
        Task(model=_model, optimizer=_opt, dataset=ds, batch_size=2)
    with pytest.raises(TaskError, match=r"Task\.model"):
        Task(model=None, optimizer=_opt, dataset=ds, batch_size=2, loss_fn=torch.nn.functional.mse_loss)
    t = Task(model=_model, optimizer=_opt, dataset=lambda: ds, batch_size=2, loss_fn=torch.nn.functional.mse_loss)
    assert t.build_dataset() is ds


def test_load_task_by_file_and_module():
    task = load_task(task_spec("tiny.py"))
    assert isinstance(task, Task) and task.batch_size == 16
    assert load_task("examples.quickstart:task").batch_size == 64


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nocolon", "must be 'module:function'"),
        ("/no/such/file.py:task", "not found"),
        ("no_such_module_xyz:task", "cannot import"),
        ("examples.quickstart:nope", "has no attribute"),
        ("examples.quickstart:make_model", "expected a flodl.Task"),
    ],
)
def test_bad_task_specs(spec, match):
    with pytest.raises(TaskError, match=match):
        load_task(spec)


def test_spec_of():
    from examples.quickstart import task

    assert spec_of(task) == "examples.quickstart:task"
    with pytest.raises(TaskError, match="top level"):
        spec_of(lambda: None)
    with pytest.raises(TaskError, match="not a Task instance"):
        spec_of(task())


def test_batch_source_fast_path_and_generic_path_agree():
    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    tensor_ds = torch.utils.data.TensorDataset(x, y)

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return x[i], y[i]

    fast = list(BatchSource(tensor_ds, 4, seed=3).batches(1, 2, 7))
    slow = list(BatchSource(Plain(), 4, seed=3).batches(1, 2, 7))
    assert [len(i) for i, _ in fast] == [4, 3]
    for (ia, (xa, ya)), (ib, (xb, yb)) in zip(fast, slow, strict=False):
        assert torch.equal(ia, ib) and torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(torch.cat([i for i, _ in fast]), slice_indices(10, 3, 1, 2, 7))


def test_batch_source_names_the_broken_index():
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise KeyError("corrupt record")
            return torch.tensor([float(i)])

    with pytest.raises(TaskError, match=r"dataset\[5\] raised KeyError"):
        for _ in BatchSource(Broken(), 8, seed=0).batches(0, 0, 8):
            pass


def test_to_device_nested():
    batch = {"a": (torch.ones(1), [torch.zeros(1)]), "b": 3}
    out = to_device(batch, torch.device("cpu"))
    assert out["b"] == 3 and torch.equal(out["a"][1][0], torch.zeros(1))


def test_record_scalar_accumulates_and_drains():
    scalars.drain()
    record_scalar("acc", 0.5)
    record_scalar("acc", 1.0)
    record_scalar("acc", float("nan"))
    assert scalars.drain() == {"acc": [1.5, 2.0]}
    assert scalars.drain() == {}
    with pytest.raises(TypeError):
        record_scalar("", 1.0)


def _solo_group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))


def test_averager_without_group_touches_nothing():
    model = torch.nn.Linear(3, 4)
    storage = model.weight.data_ptr()
    avg = CollectiveAverager(None, None)  # one rank: the runner does not even flatten
    assert avg.average(1.0).ms == 0.0
    assert model.weight.data_ptr() == storage


def test_flat_averager_views_and_rnn_copies():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    rnn = torch.nn.GRU(4, 5)
    model.append(torch.nn.Identity())
    holder = torch.nn.ModuleDict({"mlp": model, "rnn": rnn})
    before = [p.detach().clone() for p in holder.parameters()]
    rnn_storage = rnn.weight_ih_l0.data_ptr()
    flat = FlatModel(holder)
    avg = CollectiveAverager(flat, _solo_group())
    n_rnn = sum(p.numel() for p in rnn.parameters())
    assert flat.numel == sum(p.numel() for p in holder.parameters()) + 8  # + running mean/var
    assert [b.group for b in flat.buckets] == ["p", "b"]
    for a, p in zip(before, holder.parameters(), strict=False):
        assert torch.equal(a, p)
    assert rnn.weight_ih_l0.data_ptr() == rnn_storage  # cuDNN keeps its own packed weights
    # non-RNN params are views into the flat buffer: an optimizer step shows up there
    opt = torch.optim.SGD(holder.parameters(), lr=1.0)
    (model(torch.randn(5, 3)).sum() + rnn(torch.randn(2, 1, 4))[0].sum()).backward()
    opt.step()
    packed = flat.snapshot()[0]
    assert torch.equal(packed[:12], model[0].weight.detach().reshape(-1))
    assert n_rnn > 0
    values = [p.detach().clone() for p in holder.parameters()]
    avg.average(1.0)  # a one-rank average is the identity, copied tensors included
    for a, p in zip(values, holder.parameters(), strict=False):
        assert torch.allclose(a, p)
    assert len(flat.snapshot()[0]) == len(packed)


def _averager_rank(rank, world, port, weights, out):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
    group = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, world, datetime.timedelta(seconds=20))
    torch.manual_seed(100 + rank)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.GRU(7, 3))
    model[1].running_mean.add_(rank)
    model[1].num_batches_tracked.fill_(rank + 1)
    values = [t.detach().double().clone() for t in [*list(model.parameters()), model[1].running_mean, model[1].running_var]]
    avg = CollectiveAverager(FlatModel(model), group)
    avg.average(weights[rank])
    result = [t.detach().double().clone() for t in [*list(model.parameters()), model[1].running_mean, model[1].running_var]]
    # plain lists: torch tensors through a queue share memory with a child that is about to exit
    out.put((rank, [v.tolist() for v in values], [r.tolist() for r in result], int(model[1].num_batches_tracked)))


def test_weighted_average_is_exact_against_float64_reference():
    """Three real gloo ranks, unequal weights (one zero): parameters the float64 weighted
    mean, floating buffers the plain mean of the ranks that trained."""
    weights = [3.0, 1.0, 0.0]
    got = gloo_ranks(_averager_rank, 3, weights)
    n_buffers = 2  # running_mean, running_var: averaged with equal weight among ranks that trained
    for i in range(len(got[0][1])):
        ws = weights if i < len(got[0][1]) - n_buffers else [1.0 if w > 0 else 0.0 for w in weights]
        want = sum(w * torch.tensor(g[1][i], dtype=torch.float64) for w, g in zip(ws, got, strict=False)) / sum(ws)
        for g in got:
            assert torch.allclose(torch.tensor(g[2][i], dtype=torch.float64), want, atol=1e-6), i
    assert [g[3] for g in got] == [1, 2, 3]  # integer buffers stay local


def _members(port: int, prefix: str, delays: list[float], **kw) -> dict[int, object]:
    """Each member (a thread with its own gloo group) starts after its delay, then all-reduces its rank + 1."""
    out: dict[int, object] = {}

    def member(rank: int) -> None:
        time.sleep(delays[rank])
        try:
            group = build_group(
                store_host="127.0.0.1",
                store_port=port,
                prefix=prefix,
                rank=rank,
                world_size=len(delays),
                device=torch.device("cpu"),
                timeout_s=0.5,
                **kw,
            )
            value = torch.full((3,), float(rank + 1))
            group.allreduce([value]).wait()
            out[rank] = value.tolist()
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(len(delays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_a_member_later_than_the_group_timeout_still_joins():
    """A survivor can reach a new generation a whole collective timeout after the others
    (it sat in the failed collective): gathering first lets the group form anyway."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    late = [0.0, 1.5]  # three times the 0.5 s group timeout
    without = _members(store.port, "bare/gen1", late)
    assert isinstance(without[0], Exception)  # torch's own rendezvous gives up first
    gathered = _members(store.port, "run/gen1", late, gather_s=10.0)
    assert gathered == {0: [3.0] * 3, 1: [3.0] * 3}


def test_gathering_gives_up_for_a_newer_generation_and_names_who_never_came():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    newer = threading.Event()
    threading.Timer(0.3, newer.set).start()
    started = time.monotonic()
    with pytest.raises(Superseded):
        build_group(
            store_host="127.0.0.1",
            store_port=store.port,
            prefix="run/gen2",
            rank=0,
            world_size=3,
            device=torch.device("cpu"),
            timeout_s=0.5,
            gather_s=30.0,
            give_up=newer.is_set,
        )
    assert time.monotonic() - started < 5  # at once, not after the 30 s wait
    with pytest.raises(RuntimeError, match=r"member\(s\) \[1, 2\] of 3 never arrived within 0.3 s"):
        build_group(
            store_host="127.0.0.1",
            store_port=store.port,
            prefix="run/gen3",
            rank=0,
            world_size=3,
            device=torch.device("cpu"),
            timeout_s=0.5,
            gather_s=0.3,
        )


def _background_pair(port: int, prefix: str, script) -> dict[int, object]:
    """Two members (threads, each with its own gloo group and model) run ``script(rank, averager, model)``."""
    out: dict[int, object] = {}

    def member(rank: int) -> None:
        try:
            group = build_group(
                store_host="127.0.0.1",
                store_port=port,
                prefix=prefix,
                rank=rank,
                world_size=2,
                device=torch.device("cpu"),
                timeout_s=2.0,
                gather_s=10.0,
            )
            torch.manual_seed(7 + rank)  # the replicas start different
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
            out[rank] = script(rank, CollectiveAverager(FlatModel(model), group), model)
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _values(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), model[1].running_mean, model[1].running_var]]


def test_a_background_average_keeps_the_progress_made_meanwhile_and_lands_exactly():
    """Cadence/Async window ends on the collective backend: the launch returns while the peer
    is still 0.4 s away; the average lands as (local − snapshot) + average; an eval of that
    window scores the average itself while the live values are kept; with no step in between,
    both replicas end bit-identical."""
    weights = [3.0, 1.0]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def script(rank, avg, model):
        before = _values(model)
        if rank == 1:
            time.sleep(0.4)  # the slow rank reaches the window end late
        started = time.perf_counter()
        avg.average(weights[rank], block=False, tag=5 << 16)
        launch_s = time.perf_counter() - started
        with torch.no_grad():
            model[0].weight.add_(rank + 1.0)  # progress made while the average runs
        assert avg.settle()
        landed = _values(model)
        with torch.no_grad():
            model[0].bias.add_(10.0)  # the next window's training, before an eval of window 5 comes
        trained = _values(model)
        with avg.scoring(5 << 16) as exact:  # the eval of window 5 scores its average, exactly
            scored = _values(model)
        assert exact and all(torch.equal(a, b) for a, b in zip(trained, _values(model), strict=False))  # live values back
        with avg.scoring(4 << 16) as exact:
            assert not exact  # an average no longer held: the model as it is
        with torch.no_grad():
            model[0].bias.sub_(10.0)
        avg.average(1.0, block=False)  # nobody steps now: this one must land exactly
        with avg.scoring(5 << 16) as exact:
            assert not exact  # a later average launched: window 5's result is gone
        avg.settle()
        return before, landed, _values(model), launch_s, scored

    got = _background_pair(store.port, "bg/1", script)
    assert not any(isinstance(g, Exception) for g in got.values()), got
    assert got[0][3] < 0.2  # rank 0 did not wait for its slow peer
    (b0, l0, e0, _, s0), (b1, l1, e1, _, s1) = got[0], got[1]
    n_params = 4  # weight, bias of Linear, weight, bias of BatchNorm; then two buffers (equal weights)
    for i, (x, y) in enumerate(zip(b0, b1, strict=False)):
        w = weights if i < n_params else [1.0, 1.0]
        mean = (w[0] * x + w[1] * y) / (w[0] + w[1])
        progress = [1.0, 2.0] if i == 0 else [0.0, 0.0]
        assert torch.allclose(l0[i], mean + progress[0], atol=1e-5), i
        assert torch.allclose(l1[i], mean + progress[1], atol=1e-5), i
        assert torch.allclose(s0[i], mean, atol=1e-5) and torch.equal(s0[i], s1[i]), i  # the average itself
    for x, y in zip(e0, e1, strict=False):
        assert torch.equal(x, y)  # bit-identical replicas after an average nobody trained past


def test_a_background_average_a_peer_never_joins_is_dropped_and_the_values_kept():
    """A peer lost before the window end: the average is given up on the regroup (``abort``),
    the live values stay as trained, and the next average allocates fresh buffers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gone = threading.Event()

    def script(rank, avg, model):
        if rank == 1:
            gone.wait(20)  # never reaches the average
            return None
        avg.average(1.0, block=False)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        trained = _values(model)
        threading.Timer(0.3, avg.abort).start()  # the link thread, on the controller's Regroup
        try:
            with pytest.raises(RuntimeError, match="collective aborted"):
                avg.settle()
        finally:
            gone.set()
        return trained, _values(model), avg.dropped, avg._sends

    got = _background_pair(store.port, "bg/2", script)
    trained, after, dropped, sends = got[0]
    assert dropped == 1 and sends is None
    for x, y in zip(trained, after, strict=False):
        assert torch.equal(x, y)


def _runner(tmp_path):
    """A rank whose entry point installed the testing probes (FLODL_SIMULATE_* as the test set them)."""
    from flodl.config.env import RankEnv
    from flodl.rank.runner import RankRunner
    from flodl.testing.probes import Injected

    env = RankEnv(
        controller="tcp://127.0.0.1:1",
        secret=b"k" * 32,
        run_id="r",
        rank=0,
        device="cpu",
        task=task_spec("tiny.py"),
        local_world=1,
        heartbeat_timeout_s=5.0,
        parent_pid=0,
    )
    return RankRunner(env, probes=Injected.from_env(0))


def _joined(runner, lr=0.01):
    """``runner`` joined alone with the tiny task (SGD at ``lr``), as its build and welcome make it."""
    import dataclasses

    from flodl.testing.solo import solo_welcome

    task = load_task(task_spec("tiny.py"))
    runner.task = dataclasses.replace(task, optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=lr))
    runner.model = runner.task.model()
    runner.join(solo_welcome())
    return runner.joined


def _close(runner):
    runner.link._pipe_out.close(linger=0)
    runner.link._pipe_in.close(linger=0)


def test_step_clips_gradients_to_max_grad_norm(tmp_path):
    runner = _runner(tmp_path)
    try:
        joined = _joined(runner, lr=0.0)  # lr 0: grads survive the step
        replica, steps = joined.replica, joined.windows.steps
        x = torch.randn(16, 8) * 100  # huge inputs, huge gradients
        y = torch.randint(0, 2, (16,))
        replica.max_grad_norm = None
        steps.step((x, y), epoch=0, samples=16, data_ms=0.0)
        raw = torch.norm(torch.stack([p.grad.norm() for p in replica.model.parameters()]))
        replica.max_grad_norm = 0.5
        [record] = steps.step((x, y), epoch=0, samples=16, data_ms=0.0)
        ms = record.compute_ms
        clipped = torch.norm(torch.stack([p.grad.norm() for p in replica.model.parameters()]))
        assert raw > 1.0 and clipped == pytest.approx(0.5, rel=1e-4)
        assert ms > 0 and steps.count == 2
    finally:
        _close(runner)


def test_every_average_is_applied_in_one_place_and_its_listeners_hear_it(tmp_path):
    """The averaging step's seam (regroup.py ``Group._took``): each average a window's rounds take
    moves the position on and reaches every part subscribed with ``on_average`` (the evaluator now;
    an outer optimizer next) in the order taken, with the position it leaves behind."""
    runner = _runner(tmp_path)
    try:
        joined = _joined(runner)
        heard = []
        runner.group.on_average(heard.append)
        stats = joined.windows.run_rounds([[0, 0, 64]], rounds=3, sync_every=1, window=5)
        assert stats.batches == 3  # one batch a round, then its average
        assert [at.position for at in heard] == [(5 << 16) | r for r in (1, 2, 3)]
        assert runner.group.at.position == (5 << 16) | 3 and not any(at.redoing for at in heard)
        assert not joined.evaluator.norms_stale  # alone, an average changes nothing: no BatchNorm refresh
    finally:
        _close(runner)


def test_rank_thread_counts():
    from flodl.rank.building import ACCELERATOR_THREADS, cpu_threads

    assert cpu_threads(16, 2, staged=False) == 8  # CPU ranks share the host's cores
    assert cpu_threads(16, 1, staged=True) == 14  # and leave the data threads a core or two
    assert cpu_threads(16, 1, staged=False, accelerator=True) == ACCELERATOR_THREADS  # a GPU rank needs few
    assert cpu_threads(16, 8, staged=False, accelerator=True) == 2
    assert cpu_threads(1, 4, staged=True) == 1


def test_a_simulated_slow_rank_is_paced_to_factor_times_base(tmp_path, monkeypatch):
    monkeypatch.setenv("FLODL_SIMULATE_SLOWDOWN", "0:4")
    monkeypatch.setenv("FLODL_SIMULATE_BASE_MS", "0:5")
    runner = _runner(tmp_path)
    try:
        steps = _joined(runner).windows.steps
        batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
        steps.step(batch, epoch=0, samples=len(batch[0]), data_ms=0.0)  # set-up and warm-up: not paced
        paced = [steps.step(batch, epoch=0, samples=len(batch[0]), data_ms=0.0)[0].compute_ms for _ in range(3)]
        # each later step takes 4 x 5 ms, the sleep included, and reports the time it really took; a
        # sleep that overshot is taken back from the next one (the pacing carry), so a single step may
        # end well short of 20 ms (two 24 ms steps under load left the third 12) while the steps
        # together keep the pace; unpaced, they take well under a millisecond each. No upper bound:
        # on a loaded machine a 5 ms sleep can take 150 (what pacing asks for is paced_step's)
        assert sum(paced) / len(paced) >= 19.8, paced
    finally:
        _close(runner)


def test_a_slow_rank_paces_against_the_live_base_and_a_full_speed_rank_posts_it(tmp_path, monkeypatch):
    from flodl.testing.pace_board import PaceBoard

    board = tmp_path / "pace.board"
    monkeypatch.setenv("FLODL_SIMULATE_PACE_FILE", str(board))
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))

    def steps(runner, n):
        joined = _joined(runner).windows.steps
        return [joined.step(batch, epoch=0, samples=len(batch[0]), data_ms=0.0)[0].compute_ms for _ in range(n)]

    fast = _runner(tmp_path)  # no slowdown: it posts its own step time, from its second step
    try:
        took = steps(fast, 4)
        posted = PaceBoard(str(board)).base_ms()
        assert posted is not None and min(took[1:]) <= posted <= max(took[1:])
    finally:
        _close(fast)
    PaceBoard(str(board)).publish(6.0)  # the partner's pace, as posted: 6 ms a step
    monkeypatch.setenv("FLODL_SIMULATE_SLOWDOWN", "0:4")
    monkeypatch.setenv("FLODL_SIMULATE_BASE_MS", "0:5")  # the solo base, which the live one overrides
    slow = _runner(tmp_path)
    try:
        paced = steps(slow, 4)[1:]  # the first step is set-up and warm-up: not paced
        # 4 x 6 ms a step, not 4 x 5 ms (no upper bound: a loaded machine may oversleep; the pacing
        # carry takes an overshoot off the next sleep, so the mean is what holds)
        assert sum(paced) / len(paced) >= 23.8, paced
        assert PaceBoard(str(board)).base_ms() == 6.0  # a paced rank only reads the board
    finally:
        _close(slow)


@pytest.mark.parametrize(
    "mine,redo,adopting,top,top_redo,expected",
    [
        (0x50000, True, False, 0x50000, 0x50000, (False, False)),  # survivors repeat the lost average together
        (0x50000, True, False, 0x50001, 0x50000, (True, False)),  # another survivor has it behind it: skip, adopt next
        (0, False, True, 0x50000, 0x50000, (False, True)),  # a joiner takes part in the survivors' repeat, weight 0
        (0, False, True, 0x50001, 0x50000, (False, False)),  # nobody repeats (one is ahead): the joiner waits for its first
        (0, False, True, 0x50000, -1, (False, False)),  # nothing was lost: nothing to take part in
        (0x50000, False, False, 0x50000, 0x50000, (False, False)),  # a survivor not there yet does the average in turn
    ],
)
def test_redo_roles_keep_every_member_on_the_same_collectives(mine, redo, adopting, top, top_redo, expected):
    from flodl.rank.regroup import redo_roles

    assert redo_roles(mine, redo=redo, adopting=adopting, top=top, top_redo=top_redo) == expected


def test_only_a_regroup_that_leaves_out_a_peer_breaks_the_group():
    from types import SimpleNamespace

    from flodl.config.deadlines import Deadlines
    from flodl.rank.position import GroupPosition
    from flodl.rank.regroup import Group

    link = SimpleNamespace(regroup=None)
    group = Group(SimpleNamespace(link=link, rank=0), Deadlines(heartbeat_timeout_s=5.0))
    group.at = GroupPosition(generation=3, peers=frozenset({0, 1}))
    assert not group.group_broken()
    link.regroup = SimpleNamespace(generation=4, members=[0, 1, 2])  # a joiner: every collective can still finish
    assert not group.group_broken()
    link.regroup = SimpleNamespace(generation=4, members=[0, 2])  # rank 1 is gone
    assert group.group_broken()
    group.at = GroupPosition(generation=4, peers=frozenset({0, 1}))  # ... but that is the generation this rank is in now
    assert not group.group_broken()


def test_a_resumed_lr_is_base_times_factor_times_schedule_once():
    """The loaded optimizer's groups hold the saved run's applied LR (base x factor x schedule);
    restoring must not take it as a new base, or the factor and the schedule apply twice."""
    from flodl.rank.handle import LrState

    def halve_every_10(step):
        return 0.5 ** (step // 10)

    def fresh():
        return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    saved_run = LrState(fresh(), 2.0, halve_every_10)
    saved_run.apply(20)
    state = saved_run.optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.05)
    for saved_base in ([0.1], None):  # a bundle that kept its base, and one from before it did
        resumed = LrState(fresh(), 2.0, halve_every_10)
        resumed.optimizer.load_state_dict(state)
        resumed.restore(saved_base, 20)
        assert resumed.current == pytest.approx(0.05)
        resumed.apply(30)
        assert resumed.current == pytest.approx(0.025)


def test_step_reports_add_up_the_steps_of_one_epoch_into_one_timing_msg(clock):
    from flodl.rank.step_meter import StepRecord
    from flodl.rank.step_reports import REPORT_INTERVAL_S, StepReports

    reports = StepReports(3, clock=clock)
    assert reports.take() is None and not reports.due()
    reports.add(StepRecord(1, 5, 32, 0.5, 2.0, 0.125))
    clock.advance(REPORT_INTERVAL_S / 2)
    reports.add(StepRecord(1, 6, 16, 1.5, 4.0, 0.25))
    assert not reports.due()  # the oldest step held is what ages a report
    clock.advance(REPORT_INTERVAL_S)
    assert reports.due()
    assert not reports.fits(StepRecord(2, 7, 32, 1.0, 1.0, 0.0))  # a report holds one epoch's steps
    msg = reports.take(sync_ms=3.0)
    assert msg is not None
    assert (msg.rank, msg.epoch, msg.step, msg.samples, msg.batches) == (3, 1, 6, 48, 2)
    assert (msg.loss, msg.batch_ms, msg.data_ms, msg.sync_ms) == (1.0, 6.0, 0.375, 3.0)
    assert reports.take() is None and not reports.due() and reports.fits(StepRecord(2, 7, 32, 1.0, 1.0, 0.0))
