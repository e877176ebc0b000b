"""The training features of update.py (gradient accumulation, torch LR schedulers, mixed
precision, several optimizers): the pure logic against hand-written torch loops, then real
runs through the controller whose parameters a hand loop must reproduce, across a resume."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from flodl import DdpRunConfig, Trainer
from flodl.checkpoint import safetensors_io
from flodl.checkpoint.bundle import CheckpointBundle, CheckpointError, load_model, load_optimizer, save_optimizer
from flodl.errors import TaskError
from flodl.rank.handle import LrState
from flodl.rank.step_meter import StepMeter
from flodl.rank.update import Update, build_optimizer, check_precision, train_state

from .conftest import task_spec
from .helpers.history import epoch_samples, epochs
from .tasks import features

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


def _task(**fields):
    return features.base(**fields)


def _update(task, model=None, *, factor=1.0):
    """An Update as a rank builds one at join (a model, its optimizer(s), the LR state)."""
    model = model if model is not None else task.model()
    opt, opts = build_optimizer(task, model)
    lr = LrState(opt, factor, task.lr_schedule)
    update = Update(task, opt, opts, CPU, lr, forward=lambda b: task.loss_fn(model(b[0]), b[1]), grads_ready=lambda: None)
    return update, model


def _batches(n, size=features.BATCH):
    """``n`` batches, round the 64 samples again and again."""
    x, y = features.data()
    per = len(x) // size
    return [(x[i % per * size : (i % per + 1) * size], y[i % per * size : (i % per + 1) * size]) for i in range(n)]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _close(a, b, tol=1e-6):
    return all(torch.allclose(p, q, atol=tol, rtol=0) for p, q in zip(a, b, strict=True))


# ------------------------------------------------------------------ fields


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"precision": "16"}, "Task.precision"),
        ({"precision": "bf16"}, "Task.precision"),
        ({"accumulate_grad_batches": 0}, "Task.accumulate_grad_batches"),
        ({"accumulate_grad_batches": True}, "Task.accumulate_grad_batches"),
        ({"accumulate_grad_batches": 2.0}, "Task.accumulate_grad_batches"),
        ({"scheduler_interval": "epoch"}, "Task.scheduler_interval"),
        ({"scheduler": "cosine"}, "Task.scheduler"),
        ({"scheduler": features.step_lr, "lr_schedule": lambda step: 1.0}, "Task.scheduler and Task.lr_schedule"),
    ],
)
def test_invalid_fields_fail_fast_naming_the_field(fields, named):
    with pytest.raises(TaskError, match=named):
        _task(**fields)


def test_what_the_factories_return_is_checked_naming_the_field():
    model = features.make_model()
    for bad, why in (([], "non-empty list"), ([torch.optim.SGD(model.parameters(), lr=0.1)] * 2, "same parameter")):
        t = _task()
        t.optimizer = lambda m, bad=bad: bad
        with pytest.raises(TaskError, match=f"Task.optimizer.*{why}"):
            build_optimizer(t, model)
    plateau = _task(scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TaskError, match=r"Task\.scheduler: ReduceLROnPlateau"):
        _update(plateau)
    with pytest.raises(TaskError, match=r"Task\.scheduler must return"):
        _update(_task(scheduler=lambda opt: object()))
    # an autocast torch cannot do is refused at build, naming the field (here: a device with none)
    with pytest.raises(TaskError, match=r"Task\.precision 'bf16-mixed' is not supported on meta"):
        check_precision("bf16-mixed", torch.device("meta"))
    check_precision("fp16-mixed", CPU)  # torch 2.13 autocasts float16 on a CPU: accepted


# ------------------------------------------------------------ accumulation


def test_accumulation_equals_a_hand_loop_and_a_flush_steps_the_mean():
    task = _task(accumulate_grad_batches=3)
    update, model = _update(task)
    hand = features.make_model()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    batches = _batches(4)
    for step in range(2):  # two full accumulations of 3 batches: batches 0-2, then 1-3
        chunk = batches[step : step + 3]
        for i, b in enumerate(chunk):
            update.batch(b, global_step=3 * step + i)
        opt.zero_grad()
        (sum(F.mse_loss(hand(x), y) for x, y in chunk) / 3).backward()
        opt.step()
        assert _close(_params(model), _params(hand))
    assert update.steps == 2 and update.pending == 0
    # a window whose grants end after 2 batches, before an average: flushed as the mean of those 2
    for i, b in enumerate(batches[:2]):
        update.batch(b, global_step=6 + i)
    before = _params(model)
    update.window_end(8, flush=False)  # a solo rank carries it: nothing stepped
    assert update.pending == 2 and _close(_params(model), before, tol=0)
    update.window_end(8, flush=True)
    opt.zero_grad()
    (sum(F.mse_loss(hand(x), y) for x, y in batches[:2]) / 2).backward()
    opt.step()
    assert update.pending == 0 and update.steps == 3 and _close(_params(model), _params(hand))


def test_lr_schedule_sees_optimizer_steps_not_batches():
    """lr_schedule(global_step) under accumulation: the step counts all ranks' optimizer steps."""
    seen = []
    task = _task(accumulate_grad_batches=4, lr_schedule=lambda step: seen.append(step) or 1.0)
    update, _ = _update(task)
    seen.clear()  # LrState's own apply(0) at construction
    for g in range(12):
        update.batch(_batches(1)[0], global_step=100 + g)  # the window started at 100 global batches
    assert seen == [25, 26, 27]


# --------------------------------------------------------------- schedulers


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)  # chainable: each LR computed from the last


def _reference_lrs(n):
    """A single process's LRs: the scheduler stepped once per optimizer step."""
    opt = torch.optim.SGD(features.make_model().parameters(), lr=0.1)
    sched, lrs = _cosine(opt), []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _spy_lrs(update):
    """The LR of each optimizer step ``update`` takes, as it takes it."""
    used, step = [], update.optimizer.step

    def spy():
        used.append(update.optimizer.param_groups[0]["lr"])
        step()

    update.optimizer.step = spy
    return used


def test_global_scheduler_follows_every_ranks_steps_and_ranks_agree_at_each_window():
    """Two ranks, 2 batches an optimizer step, windows planned a window ahead (the controller's
    global step lags by the window in flight): at every window start both stand at the global
    step, and every step uses the LR a single process's scheduler has at that step's place."""
    reference = _reference_lrs(60)
    ranks = [_update(_task(accumulate_grad_batches=2, scheduler=_cosine))[0] for _ in range(2)]
    used = [_spy_lrs(u) for u in ranks]
    expected: list[list[float]] = [[], []]
    own = [[6, 2], [4, 8], [10, 4], [2, 2], [8, 6]]  # each window's batches per rank (uneven, as cadence grants)
    settled, lagged = 0, 0  # all ranks' batches through the last window, and what the controller knew
    for window in own:
        starts = []
        for r, (update, batches) in enumerate(zip(ranks, window, strict=True)):
            update.window_start(lagged)
            starts.append(update.optimizer.param_groups[0]["lr"])
            assert starts[-1] == pytest.approx(reference[lagged // 2], abs=1e-12)
            for g in range(batches):
                update.batch(_batches(1)[0], global_step=lagged + g)
                if g % 2 == 1:  # this batch ended an accumulation: its place is where the accumulation began
                    expected[r].append(reference[(lagged + g - 1) // 2])
            update.window_end(lagged + batches, flush=True)
        assert starts[0] == starts[1]
        lagged, settled = settled, settled + sum(window)
    assert used == [pytest.approx(e, abs=1e-12) for e in expected]
    assert ranks[0].at != ranks[1].at  # each ran on past the lagging count on its own steps, and came back


def test_global_scheduler_steps_with_the_lr_a_single_process_uses():
    """One rank alone, windows back to back: the LR of every optimizer step is the reference's."""
    reference = _reference_lrs(20)
    update, model = _update(_task(accumulate_grad_batches=1, scheduler=_cosine, precision="bf16-mixed"))
    used = _spy_lrs(update)
    g = 0
    for size in (3, 5, 4):
        update.window_start(g)
        for _ in range(size):
            update.batch(_batches(1)[0], global_step=g)
            g += 1
        update.window_end(g, flush=True)
    assert used == pytest.approx(reference[:12], abs=1e-12)


def test_rank_interval_steps_once_per_own_step_whatever_the_global_step():
    reference = _reference_lrs(10)
    update, _ = _update(_task(accumulate_grad_batches=1, scheduler=_cosine, scheduler_interval="rank"))
    update.window_start(1000)  # other ranks' steps do not move it
    for g in range(4):
        update.batch(_batches(1)[0], global_step=1000 + g)
    assert update.at == 3 and update.optimizer.param_groups[0]["lr"] == pytest.approx(reference[3], abs=1e-12)


# -------------------------------------------------------------- precision


def test_fp16_skipped_steps_are_counted_and_a_finite_loss_is_no_divergence():
    task = _task(precision="fp16-mixed")
    task.loss_fn = features.loud_loss
    update, model = _update(task)
    meter = StepMeter(CPU)
    before = _params(model)
    for g, b in enumerate(_batches(8)):  # 2 optimizer steps, both overflowing float16 at the scaler's 65536
        t0 = meter.begin()
        loss = update.batch(b, global_step=g)
        meter.measured(t0, loss, epoch=0, step=g + 1, samples=16, data_ms=0.0)  # raises NonFiniteLoss on inf/NaN
    update.window_end(8, flush=True)
    assert update.scaler.get_scale() == 65536.0 / 4
    assert _close(_params(model), before, tol=0)  # skipped: nothing stepped
    scalars, data = {}, {}
    update.report(scalars, data)
    assert data == {"amp_skipped_steps": 2} and scalars == {"amp_skip_rate": [2.0, 2.0]}
    update.report(scalars, data)  # counted per window: the next report starts from zero
    assert data == {"amp_skipped_steps": 0}


def test_bf16_runs_the_forward_under_autocast():
    seen = []
    task = _task(precision="bf16-mixed", accumulate_grad_batches=1)
    model = task.model()
    update, _ = _update(task, model)
    update.forward = lambda b: seen.append(model(b[0]).dtype) or F.mse_loss(model(b[0]).float(), b[1])
    update.batch(_batches(1)[0], global_step=0)
    assert seen == [torch.bfloat16] and update.scaler is None


# ------------------------------------------------------- several optimizers


def test_several_optimizers_step_and_save_as_one(tmp_path):
    task = _task(scheduler=features.step_lr, precision="fp16-mixed")
    task.optimizer = features.two_optimizers
    update, model = _update(task)
    assert len(update.optimizers) == 2 and len(update.schedulers) == 2
    before = _params(model)
    for g, b in enumerate(_batches(8)):
        update.batch(b, global_step=g)
    update.window_end(8, flush=True)
    moved = [not torch.equal(a, b) for a, b in zip(before, _params(model), strict=True)]
    assert moved == [True] * 4  # both optimizers stepped (the scaler skips none here)
    path = tmp_path / "x.optim"
    save_optimizer(update.optimizer, path, train_state(update.optimizers, update))
    fresh, fresh_model = _update(task)
    fresh_model.load_state_dict(model.state_dict())
    saved = load_optimizer(fresh.optimizer, path, fits=[1, 1])
    fresh.load_state_dict(saved)
    for a, b in zip(update.optimizers, fresh.optimizers, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for pid in sa["state"]:
            for key, value in sa["state"][pid].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][pid][key]))
    assert fresh.scaler.state_dict() == update.scaler.state_dict() and fresh.at == update.at
    assert [s.state_dict() for s in fresh.schedulers] == [s.state_dict() for s in update.schedulers]
    with pytest.raises(CheckpointError, match=r"optimizers of \[1, 1\] parameter groups, this task's have \[2\]"):
        load_optimizer(torch.optim.SGD([{"params": fresh_model[0].parameters()}, {"params": fresh_model[2].parameters()}]), path, fits=[2])


def test_parameter_groups_keep_their_own_lr_under_the_factor_and_a_scheduler():
    task = _task(scheduler=features.step_lr, accumulate_grad_batches=1)
    task.optimizer = lambda m: torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters()}], lr=0.01)
    update, _ = _update(task, factor=2.0)
    for g, b in enumerate(_batches(4)):
        update.window_start(g)
        update.batch(b, global_step=g)
    # StepLR(2, 0.5) after 3 steps (the 4th's LR is set before it): x0.5 once; the factor 2 on both
    assert [g["lr"] for g in update.optimizer.param_groups] == pytest.approx([0.2 * 2 * 0.5, 0.01 * 2 * 0.5])


# ------------------------------------------------------------ real runs


def _run(func, tmp_path, *, epochs, nproc=1, name="run", resume=None, config=None):
    config = (config or DdpRunConfig()).with_save_path(str(tmp_path / name))
    if resume is not None:
        config = config.with_resume_from(str(tmp_path / resume))
    summary = Trainer.builder(task_spec("features.py", func)).nproc_per_node(nproc).epochs(epochs).progress(False).config(config).run()
    assert summary["exit_reason"] == "completed", summary
    model = features.make_model()
    load_model(model, tmp_path / name)
    return summary, model


def _hand(optimizer, epochs, scheduler=None):
    """Full-batch descent: one accumulation of the 4 batches of an epoch is one step on all 64 samples."""
    x, y = features.data()
    model = features.make_model()
    opt = optimizer(model)
    sched = scheduler(opt) if scheduler else None
    for _ in range(epochs):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
    return model


def _train_state(stem):
    meta = json.loads(CheckpointBundle.at(stem).meta.read_text())
    _, metadata = safetensors_io.load(stem.with_name(meta["optim_file"]))
    return json.loads(metadata["train_state"]), meta


def test_a_solo_run_with_accumulation_ends_where_a_hand_loop_does(tmp_path):
    summary, model = _run("accumulate_task", tmp_path, epochs=6)
    assert epoch_samples(summary["history"]) == [64] * 6  # every batch counted
    assert _close(_params(model), _params(_hand(features.sgd, 6)))


def test_scheduler_adam_and_scaler_states_survive_a_resume(tmp_path):
    """6 epochs straight, or 3 then a resume of 3: the same parameters as a hand loop with Adam and
    StepLR, which a resume that lost the Adam moments or the scheduler's step would not reach."""
    _, straight = _run("scheduled_task", tmp_path, epochs=6, name="straight")
    hand = _hand(features.adam, 6, features.step_lr)
    assert _close(_params(straight), _params(hand), tol=1e-5)
    _run("scheduled_task", tmp_path, epochs=3, name="first")
    state, meta = _train_state(tmp_path / "first")
    assert meta["global_step"] == 12 and state["optimizers"] == [1]
    assert state["schedulers"]["states"][0]["last_epoch"] <= 3
    summary, resumed = _run("scheduled_task", tmp_path, epochs=6, name="second", resume="first")
    assert epochs(summary["history"]) == [3, 4, 5]
    assert _close(_params(resumed), _params(hand), tol=1e-5)
    state, _ = _train_state(tmp_path / "second")
    assert state["schedulers"]["lrs"][0] == pytest.approx(0.05 * 0.5 ** (state["schedulers"]["at"] // 2))


def test_fp16_runs_count_skipped_steps_in_the_summary_and_keep_the_scale(tmp_path):
    summary, _ = _run("overflowing_fp16_task", tmp_path, epochs=3)
    assert summary["data"]["0"]["amp_skipped_steps"] == 3  # float16 overflowed at 65536, 32768 and 16384
    assert summary["history"][0]["scalars"]["amp_skip_rate"] == 1.0
    state, _ = _train_state(tmp_path / "run")
    assert state["scaler"]["scale"] == 65536.0 / 8  # the backed-off scale is saved ...
    summary, _ = _run("overflowing_fp16_task", tmp_path, epochs=4, name="again", resume="run")
    assert _train_state(tmp_path / "again")[0]["scaler"]["scale"] == 65536.0 / 16  # ... and resumed from


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-sync", "cpu-async"])
def test_two_ranks_accumulate_schedule_and_cover_every_sample(tmp_path, mode):
    """Two ranks, 2 batches a step, StepLR on the global step, two optimizers: every sample once
    per epoch in each policy, and the saved scheduler stands at a global step the run reached."""
    summary, _ = _run("unplain_task", tmp_path, epochs=3, nproc=2, config=DdpRunConfig().with_mode(mode))
    assert epoch_samples(summary["history"]) == [512] * 3
    state, meta = _train_state(tmp_path / "run")
    assert 0 < state["schedulers"]["at"] <= meta["global_step"] // 2
    assert state["optimizers"] == [1, 1]


def test_handle_refuses_to_set_the_lr_under_a_scheduler():
    from types import SimpleNamespace

    from flodl.rank.handle import WorkerHandle

    replica = SimpleNamespace(update=_update(_task(scheduler=features.step_lr))[0], lr=None)
    windows = SimpleNamespace(replica=replica, steps=SimpleNamespace(lr_step=0))
    with pytest.raises(TaskError, match=r"worker\.set_lr: the task's Task\.scheduler sets the LR"):
        WorkerHandle(windows).set_lr(0.1)


def test_a_rank_killed_inside_an_accumulation_leaves_exact_coverage(tmp_path, monkeypatch):
    """Rank 1 of 3 SIGKILLs itself at its 5th optimizer step, gradients accumulated, step not
    taken: the survivors finish, and every sample of every epoch is trained exactly once."""
    monkeypatch.setenv("FLODL_INJECT_FAULT", "1:batch:5")
    summary, _ = _run("unplain_task", tmp_path, epochs=3, nproc=3)
    assert [d["rank"] for d in summary["deaths"]] == [1]
    assert epoch_samples(summary["history"]) == [512] * 3
