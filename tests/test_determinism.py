"""``deterministic``: plans fixed by batch counts (pure), evals that leave no trace (unit), and two
real runs with the same seed, one of them with a rank slowed 3x, ending bit-identical."""

from __future__ import annotations

import json
import random

import pytest
import torch

from flodl.config import DdpRunConfig
from flodl.plan.cadence import CadenceLoop
from flodl.rank.determinism import seed_everything, traceless

from .conftest import task_spec
from .helpers.procs import Run
from .helpers.windows import fold_window

pytestmark = pytest.mark.timeout(120)

UNEQUAL = {0: 1.0, 1: 4.0}  # ms per batch: rank 1 is 4x slower


def _loop(mode: str, deterministic: bool) -> CadenceLoop:
    config = DdpRunConfig().with_mode(mode).with_deterministic(deterministic)
    return CadenceLoop(config, [0, 1], dataset_len=960, batch_size=16, epochs=3, seed=7)


def _run_plans(loop: CadenceLoop) -> list[list]:
    """Every window's plans, as (rank, grants, quotas), with the ranks at unequal speeds."""
    seen = []
    while (windows := loop.next_windows(now=float(loop.window))) is not None:
        number = loop.window - 1
        seen.append([(r, w.grants, w.quota_batches, w.quota_ms) for r, w in sorted(windows.items())])
        fold_window(loop, number, UNEQUAL)
    return seen


@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async", "nccl-sync"])
def test_deterministic_plans_are_fixed_by_batch_counts_not_speeds(mode):
    plans = _run_plans(_loop(mode, True))
    assert plans == _run_plans(_loop(mode, True))
    for window in plans:
        assert all(quota_ms == 0.0 for *_, quota_ms in window)  # no clock in any stop rule
        assert all(quota > 0 for _, _, quota, _ in window)  # no open-ended probe for EndWindow to close
    if mode != "nccl-sync":
        # equal quotas whatever the speeds: the anchor preset, 10 batches each, until the last tail
        assert {q for _, _, q, _ in plans[0]} == {10}
        default = _run_plans(_loop(mode, False))
        assert default[0][0][2] == 0  # the default starts with an open-ended, controller-ended probe
        assert any(q != 10 for window in default[1:] for _, _, q, _ in window)  # and follows the speeds


def test_an_eval_leaves_no_trace():
    """RNG draws and BatchNorm statistics changed inside ``traceless`` are put back."""
    seed_everything(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = [b.clone() for b in model.buffers()]
    with traceless(model):
        model.train()
        model(torch.randn(8, 4))  # updates the running statistics
        random.random()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))
    after = (torch.rand(3), random.random())
    seed_everything(3)
    torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # the same draws as above
    assert torch.equal(after[0], torch.rand(3)) and after[1] == random.random()


def _summary(proc_env, tmp_path, mode: str, name: str, slow: bool) -> dict:
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.002"}
    if slow:
        env["FLODL_SIMULATE_SLOWDOWN"] = "1:3"
    path = tmp_path / f"{name}.json"
    args = ["--task", task_spec("tiny.py", "noisy_task"), "--nproc-per-node", "2", "--epochs", "2", "--mode", mode]
    run = Run([*args, "--deterministic", "--seed", "11", "--summary-json", str(path)], env)
    assert run.wait(100) == 0, run.output
    return json.loads(path.read_text())


# Sync's per-batch schedule never followed the clock (the pure test above covers its plans)
@pytest.mark.parametrize("mode", ["nccl-cadence", "nccl-async"])
def test_two_runs_with_the_same_seed_end_bit_identical_at_any_speed(proc_env, tmp_path, mode):
    """Same seed, CPU, 2 ranks in real processes: one run at equal speeds, one with rank 1 made
    3x slower; the final parameters (digests) are the same bits, and every rank trained as much."""
    even = _summary(proc_env, tmp_path, mode, "even", slow=False)
    uneven = _summary(proc_env, tmp_path, mode, "uneven", slow=True)
    digests = set(even["final_digests"].values()) | set(uneven["final_digests"].values())
    assert len(even["final_digests"]) == 2 and len(digests) == 1, (even["final_digests"], uneven["final_digests"])
    shares = [r["samples"] for r in uneven["per_rank"]]
    assert shares == [r["samples"] for r in even["per_rank"]]  # the same schedule at any speed
    # equal quotas, whatever the speeds: the fast rank waited (tails split by rounding, a batch or two)
    assert abs(shares[0] - shares[1]) <= 0.05 * sum(shares), shares
    assert even["syncs"] == uneven["syncs"]
    # every epoch's eval scored the same model (the average that closed it) with the same draws
    assert [h["eval"] for h in even["history"]] == [h["eval"] for h in uneven["history"]]
    assert None not in [h["eval"] for h in even["history"]]
