"""Checkpoint bundles: file formats, sidecar checks, coverage restore, and real runs
that save on failure and resume exactly where they stopped."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch

from flodl.checkpoint import (
    CheckpointBundle, CheckpointError, check_model_file, load_model, load_optimizer, read_meta,
    save_model, save_optimizer, stem_of, write_meta,
)
from flodl.config import DdpRunConfig
from flodl.controller.cadence import CadenceLoop
from flodl import safetensors_io

from .conftest import task_spec
from .test_process import Run, assert_all_gone

pytestmark = pytest.mark.timeout(120)


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    net(torch.randn(5, 4))  # move the BatchNorm running stats off their defaults
    return net


# ------------------------------------------------------------------ files


def test_safetensors_round_trip_every_dtype_and_the_reference_library_agrees(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4), "f64": torch.randn(2, dtype=torch.float64), "bf16": torch.randn(5).bfloat16(),
        "i64": torch.arange(7), "u8": torch.arange(4, dtype=torch.uint8), "b": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "t.safetensors"
    safetensors_io.save(path, tensors, {"k": "v"})
    back, meta = safetensors_io.load(path)
    assert meta == {"k": "v"} and list(back) == list(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k])
    st = pytest.importorskip("safetensors.torch")
    theirs = st.load_file(str(path))
    assert all(torch.equal(theirs[k], tensors[k]) for k in tensors)
    st.save_file({"x": torch.randn(2, 2)}, str(tmp_path / "theirs.safetensors"))
    mine, _ = safetensors_io.load(tmp_path / "theirs.safetensors")
    assert mine["x"].shape == (2, 2)


def test_a_truncated_tensor_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "m.fdl"
    save_model(model(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="m.fdl"):
        load_model(model(), path)
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="too short"):
        load_model(model(), path)


def test_model_round_trip_includes_buffers_and_refuses_another_model(tmp_path):
    src = model()
    save_model(src, tmp_path / "m.fdl")
    dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    load_model(dst, tmp_path / "m")  # a stem works too
    for a, b in zip(src.state_dict().values(), dst.state_dict().values()):
        assert torch.equal(a, b)
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.BatchNorm1d(9), torch.nn.Linear(9, 2))
    with pytest.raises(CheckpointError, match=r"0.weight is torch.float32 \[8, 4\] in the file"):
        load_model(wrong, tmp_path / "m.fdl")
    with pytest.raises(CheckpointError, match="parameters"):
        check_model_file(torch.nn.Linear(4, 2), tmp_path / "m.fdl")


def test_optimizer_round_trip_without_pickle(tmp_path):
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(6, 4)).sum().backward()
        opt.step()
    save_optimizer(opt, tmp_path / "o.optim")
    assert b"\x80\x04" not in (tmp_path / "o.optim").read_bytes()[:200]  # no pickle header
    net2 = model()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    load_optimizer(opt2, tmp_path / "o.optim")
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for pid in a["state"]:
        for key in a["state"][pid]:
            assert torch.equal(torch.as_tensor(a["state"][pid][key]), torch.as_tensor(b["state"][pid][key]))
    with pytest.raises(CheckpointError, match="parameter groups"):
        load_optimizer(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), tmp_path / "o.optim")


def test_sidecar_checks_missing_corrupt_torn_and_future(tmp_path):
    bundle = CheckpointBundle.at(tmp_path / "run.fdl")
    assert stem_of(tmp_path / "run.meta.json") == bundle.stem
    with pytest.raises(CheckpointError, match="no such file"):
        read_meta(bundle.stem)
    digest = save_model(model(), bundle.model)
    meta = {"epoch": 1, "global_step": 5, "world_at_save": 2, "coverage": {}, "save_reason": "checkpoint", "model_sha256": digest}
    write_meta(bundle, meta)
    assert read_meta(bundle.stem)["global_step"] == 5
    save_model(torch.nn.Sequential(torch.nn.Linear(4, 8)), bundle.model)  # a newer .fdl without its sidecar
    with pytest.raises(CheckpointError, match="sha256 differs"):
        read_meta(bundle.stem)
    bundle.meta.write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_meta(bundle.stem)
    bundle.meta.write_text(json.dumps({**meta, "schema_version": 99}))
    with pytest.raises(CheckpointError, match="newer"):
        read_meta(bundle.stem)
    with pytest.raises(ValueError, match="save_reason"):
        write_meta(bundle, {**meta, "save_reason": "whim"})


def test_coverage_restore_plans_exactly_the_untrained_positions():
    config = DdpRunConfig().with_mode("nccl-cadence")
    first = CadenceLoop(config, [0, 1], dataset_len=200, batch_size=10, epochs=3, seed=7)
    plans = first.dispatcher.plan(first.elche)
    for r, plan in plans.items():
        first.dispatcher.settle(plan, plan.samples // 2 if r == 0 else 0)  # rank 0 trained half, rank 1 nothing
    cov = first.coverage()
    trained = 200 - sum(z for item in cov["open"] for _, z in item["uncovered"])
    assert trained > 0
    second = CadenceLoop(config, [0, 1, 2], dataset_len=200, batch_size=10, epochs=3, seed=7)
    second.restore({"coverage": cov, "global_step": 12, "sync_round": 3, "elche_state": first.elche.state_dict()})
    planned = 0
    while (plans := second.dispatcher.plan(second.elche)) is not None:
        for plan in plans.values():
            planned += plan.samples
            second.dispatcher.settle(plan, plan.samples)
    assert planned == 3 * 200 - trained
    assert second.global_step == 12 and second.syncs == 3


# ---------------------------------------------------------- real processes


def _run(proc_env, tmp_path, *args, epochs=30, nproc=2, func="task", name="s.json"):
    path = tmp_path / name
    run = Run(["--task", task_spec("tiny.py", func), "--nproc-per-node", str(nproc), "--epochs", str(epochs),
               "--heartbeat-timeout-secs", "4", "--summary-json", str(path), *args], proc_env)
    return run, path


def test_single_survivor_saves_and_the_resume_trains_exactly_the_rest(proc_env, tmp_path):
    stem = tmp_path / "ck" / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_INJECT_FAULT": "1:average:9"}
    run, path = _run(env, tmp_path, "--mode", "nccl-cadence", "--save-path", str(stem), func="big_data_task")
    assert run.wait(90) == 6, run.output
    assert f"--resume-from {stem}" in run.output
    meta = read_meta(stem)  # complete and consistent: the sidecar names this .fdl
    assert meta["save_reason"] == "single_survivor" and CheckpointBundle.at(stem).optim.exists()
    first = json.loads(path.read_text())
    cov = meta["coverage"]
    covered_open = sum(item["total"] - sum(z for _, z in item["uncovered"]) for item in cov["open"])
    run2, path2 = _run({**proc_env}, tmp_path, "--mode", "nccl-cadence", "--resume-from", str(stem), func="big_data_task", name="s2.json")
    assert run2.wait(90) == 0, run2.output
    second = json.loads(path2.read_text())
    closed_first = sum(h["samples"] for h in first["history"])
    # every sample of every epoch exactly once across the two runs: closed epochs of the
    # first, the covered part of its open epochs, and everything the resume trained
    assert closed_first + covered_open + sum(h["samples"] for h in second["history"]) == 30 * 2048
    assert second["history"][0]["epoch"] == meta["epoch"]
    assert second["final_eval"] > 0.8


def test_max_failure_on_the_cpu_backend_saves_from_a_survivor(proc_env, tmp_path):
    stem = tmp_path / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_INJECT_FAULT": "2:epoch:3"}
    run, _ = _run(env, tmp_path, "--mode", "cpu-cadence", "--max-failure", "1", "--save-path", str(stem), nproc=3)
    assert run.wait(90) == 6, run.output
    assert "reaches max_failure 1" in run.output
    assert read_meta(stem)["save_reason"] == "max_failure_exceeded"


def test_corrupt_or_foreign_bundles_are_refused_before_training(proc_env, tmp_path):
    stem = tmp_path / "run"
    run, _ = _run(proc_env, tmp_path, "--save-path", str(stem), epochs=2)
    assert run.wait(60) == 0, run.output
    assert read_meta(stem)["save_reason"] == "final"
    foreign, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3, func="other_model_task")
    assert foreign.wait(60) == 2, foreign.output
    assert "does not fit this model" in foreign.output and "epoch 3/3" not in foreign.output
    data = CheckpointBundle.at(stem).model.read_bytes()
    CheckpointBundle.at(stem).model.write_bytes(data[: len(data) // 2])
    corrupt, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3)
    assert corrupt.wait(60) == 2, corrupt.output
    assert "sha256 differs" in corrupt.output
    missing, _ = _run(proc_env, tmp_path, "--resume-from", str(tmp_path / "nothing"), epochs=3)
    assert missing.wait(60) == 2 and "no such file" in missing.output


def test_checkpoint_every_calls_checkpoint_fn_and_a_failing_one_is_survived(proc_env, tmp_path):
    out = tmp_path / "calls"
    out.mkdir()
    env = {**proc_env, "FLODL_TEST_CKPT_DIR": str(out)}
    run, path = _run(env, tmp_path, "--checkpoint-every", "2", epochs=6, func="checkpointing_task")
    assert run.wait(60) == 0, run.output
    calls = sorted(p.name.split(".")[0] for p in out.iterdir())
    assert calls == ["v1", "v2", "v3"]
    assert "injected checkpoint_fn failure" in run.output  # logged, and the run went on
    nothing, _ = _run(env, tmp_path, "--checkpoint-every", "2", epochs=2)  # no checkpoint_fn, no save_path
    assert nothing.wait(60) == 2 and "nothing would be saved" in nothing.output


def test_checkpoint_at_epoch_is_mid_epoch_and_resumable(proc_env, tmp_path):
    stem = tmp_path / "mid"
    run, _ = _run(proc_env, tmp_path, "--mode", "cpu-async", "--save-path", str(stem), "--checkpoint-at-epoch", "1",
                  epochs=3, func="big_data_task")
    assert run.wait(60) == 0, run.output
    assert "checkpoint (checkpoint)" in run.output


def test_losing_the_controller_saves_each_replica_and_leaves_no_process(proc_env, tmp_path):
    stem = tmp_path / "lost"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.01"}
    run, _ = _run(env, tmp_path, "--save-path", str(stem), epochs=200)
    ranks = run.ranks(2)
    run.wait_for_line("epoch 2/")
    tree = run.tree()
    lost_at = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait(10)
    assert_all_gone(tree, timeout=30)
    assert time.monotonic() - lost_at < 30  # heartbeat timeout 4 s + save + exit
    for rank in (0, 1):
        meta = json.loads(CheckpointBundle.at(stem).rank_file(rank, ".meta.json").read_text())
        assert meta["save_reason"] in ("controller_lost", "interrupted")  # embedded: the worker dies with it
        load_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                   CheckpointBundle.at(stem).rank_file(rank, ".fdl"))
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
