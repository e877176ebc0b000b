"""Checkpoint bundles: file formats, sidecar checks, coverage restore, and real runs
that save on failure and resume exactly where they stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import psutil
import pytest
import torch

from flodl.checkpoint import safetensors_io
from flodl.checkpoint.bundle import (
    CheckpointBundle,
    CheckpointError,
    check_model_file,
    file_sha256,
    load_model,
    load_optimizer,
    read_meta,
    save_model,
    save_optimizer,
    stem_of,
    write_meta,
)
from flodl.config import DdpRunConfig
from flodl.controller.checkpoints import Checkpointer
from flodl.plan.cadence import CadenceLoop
from flodl.rank.saving import checkpoint, emergency_save

from .conftest import process_env, task_spec
from .helpers.procs import Run, assert_all_gone

pytestmark = pytest.mark.timeout(120)


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    net(torch.randn(5, 4))  # move the BatchNorm running stats off their defaults
    return net


def adam(net, steps=3):
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(6, 4)).sum().backward()
        opt.step()
    return opt


META = {"epoch": 0, "global_step": 5, "world_at_save": 1, "coverage": {}}


def _checkpointer(stem):
    return Checkpointer(DdpRunConfig().with_save_path(str(stem)), say=lambda line: None)


def _write(ck, net, opt, rank=0):
    """The controller asks, the rank writes its files: the save up to, not including, the commit."""
    msg = ck.request(rank=rank, reason="checkpoint", epoch=0, meta=META, call_fn=False)
    return checkpoint(rank=rank, model=net, optimizer=opt, stem=msg.stem, tag=msg.tag, version=msg.version, call_fn=None, handle=None)


def _save(ck, net, opt):
    done = _write(ck, net, opt)
    assert done.error is None and ck.on_done(done)
    return done


def _committed(tmp_path):
    """A bundle ``run`` with one committed save of a trained model, and the checkpointer that made it."""
    bundle = CheckpointBundle.at(tmp_path / "run")
    ck, net = _checkpointer(bundle.stem), model()
    opt = adam(net)
    _save(ck, net, opt)
    return bundle, ck, net, opt


def _files(bundle):
    meta = json.loads(bundle.meta.read_text())
    return {kind: bundle.stem.with_name(meta[f"{kind}_file"]) for kind in ("model", "optim")}


def _params(net):
    return [t.clone() for t in net.state_dict().values()]


# ------------------------------------------------------------------ files


def test_safetensors_round_trip_every_dtype_and_the_reference_library_agrees(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "f64": torch.randn(2, dtype=torch.float64),
        "bf16": torch.randn(5).bfloat16(),
        "i64": torch.arange(7),
        "u8": torch.arange(4, dtype=torch.uint8),
        "b": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
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
    with pytest.raises(CheckpointError, match=r"m\.fdl"):
        load_model(model(), path)
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="too short"):
        load_model(model(), path)


def test_model_round_trip_includes_buffers_and_refuses_another_model(tmp_path):
    src = model()
    save_model(src, tmp_path / "m.fdl")
    dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    load_model(dst, tmp_path / "m")  # a stem works too
    for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=False):
        assert torch.equal(a, b)
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.BatchNorm1d(9), torch.nn.Linear(9, 2))
    with pytest.raises(CheckpointError, match=r"0.weight is torch.float32 \[8, 4\] in the file"):
        load_model(wrong, tmp_path / "m.fdl")
    with pytest.raises(CheckpointError, match="the model's weight, bias not in the file"):
        check_model_file(torch.nn.Linear(4, 2), tmp_path / "m.fdl")


def test_a_bundles_model_file_is_a_plain_state_dict_anyone_loads(proc_env, tmp_path, finished_bundle):
    """The .fdl of a real run loads with the safetensors library into a fresh model with
    ``load_state_dict(strict=True)``: no flodl needed for inference."""
    from safetensors.torch import load_file

    from tests.tasks import tiny

    meta = read_meta(finished_bundle / "run")
    fresh = tiny.make_model()
    fresh.load_state_dict(load_file(str(finished_bundle / meta["model_file"])))  # strict: every key, no other
    ours = tiny.make_model()
    load_model(ours, finished_bundle / "run")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ours.state_dict().values(), strict=True))


def test_a_model_file_of_the_earlier_format_still_loads(tmp_path):
    """Bundles written before the state-dict format (keys p0.., b0.., names in the metadata) resume as before."""
    src = model()
    tensors = {f"p{i}": p for i, (_, p) in enumerate(src.named_parameters())}
    tensors.update({f"b{j}": b for j, (_, b) in enumerate(src.named_buffers())})
    names = [n for n, _ in src.named_parameters()] + [n for n, _ in src.named_buffers()]
    safetensors_io.save(tmp_path / "old.fdl", tensors, {"format": "flodl-consensus", "names": json.dumps(names)})
    dst = model()
    load_model(dst, tmp_path / "old.fdl")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))


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
    ck, net, opt = _checkpointer(bundle.stem), model(), adam(model())
    _save(ck, net, opt)
    assert read_meta(bundle.stem)["global_step"] == 5
    files = _files(bundle)
    save_model(torch.nn.Sequential(torch.nn.Linear(4, 8)), files["model"])  # the file swapped after the commit
    with pytest.raises(CheckpointError, match="sha256 differs"):
        read_meta(bundle.stem)
    bundle.meta.write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_meta(bundle.stem)
    bundle.meta.write_text(json.dumps({**META, "schema_version": 99}))
    with pytest.raises(CheckpointError, match="newer"):
        read_meta(bundle.stem)
    with pytest.raises(ValueError, match="save_reason"):
        write_meta(bundle, {**META, "save_reason": "whim"})


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


# ------------------------------------------- crash safety and integrity


def _restored(bundle):
    """A fresh model and optimizer loaded from the bundle."""
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    load_model(net, bundle.stem)
    load_optimizer(opt, bundle.stem)
    return net, opt


def _moved(net):
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)


def test_a_save_the_controller_never_commits_leaves_the_previous_bundle_whole(tmp_path):
    bundle, ck, net, opt = _committed(tmp_path)
    committed = _params(net)
    _moved(net)
    done = _write(ck, net, opt)  # the rank wrote new files; the controller dies before the sidecar
    assert done.model_sha256 and done.optim_sha256
    read_meta(bundle.stem)  # still complete and consistent
    back, _ = _restored(bundle)
    assert all(torch.equal(a, b) for a, b in zip(_params(back), committed, strict=False))
    assert len(list(tmp_path.glob("run.*.fdl"))) == 2  # the uncommitted file is garbage, not the bundle


def test_a_crash_while_the_sidecar_is_written_leaves_the_old_sidecar(tmp_path, monkeypatch):
    bundle, ck, net, opt = _committed(tmp_path)
    committed, before = _params(net), bundle.meta.read_text()
    _moved(net)
    done = _write(ck, net, opt)
    real_replace = os.replace

    def crash(src, dst):
        if str(dst).endswith(".meta.json"):
            raise KeyboardInterrupt("killed between the sidecar's fsync and its rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.on_done(done)
    monkeypatch.undo()
    assert bundle.meta.read_text() == before and not list(tmp_path.glob("run.meta.json*.tmp"))  # its temporary went with it
    back, _ = _restored(bundle)
    assert all(torch.equal(a, b) for a, b in zip(_params(back), committed, strict=False))


def test_a_commit_deletes_superseded_files_but_not_a_save_in_flight_or_other_bundles(tmp_path):
    """A commit deletes the files of the sidecar it replaced (here a schema-1 bundle's) and of this
    writer's older saves; never a save still in flight, another bundle's, or another writer's."""
    bundle = CheckpointBundle.at(tmp_path / "run")
    ck, net = _checkpointer(bundle.stem), model()
    opt = adam(net)
    legacy = {**META, "schema_version": 1, "save_reason": "final", "model_sha256": save_model(net, bundle.model)}
    save_optimizer(opt, bundle.optim)  # the replaced sidecar names these two
    bundle.meta.write_text(json.dumps(legacy))
    foreign = {"run.0123456789ab.fdl", "run.0123456789ab.fdl.4242.0badcafe.tmp"}  # another run's save, never committed
    for name in foreign:
        (tmp_path / name).write_bytes(b"not ours")
    emergency_save(model=net, optimizer=opt, stem=str(bundle.stem), rank=0, reason="controller_lost", why="test", epoch=0, global_step=1)
    others = {"run.v2.meta.json", "run.v2.fdl", "run.rank0.meta.json", *(p.name for p in tmp_path.glob("run.rank0.*")), *foreign}
    for name in ("run.v2.meta.json", "run.v2.fdl"):  # another bundle whose stem starts like this one
        (tmp_path / name).write_text("{}")
    _save(ck, net, opt)
    first = set(_files(bundle).values())
    second, third = _write(ck, net, opt), _write(ck, net, opt)  # two saves asked and written, none committed
    in_flight = {p for p in tmp_path.iterdir() if p.name.startswith("run.") and p not in first} - {tmp_path / n for n in others}
    assert ck.on_done(second)
    now = set(tmp_path.iterdir())
    assert not first & now  # superseded by the commit
    assert {bundle.model, bundle.optim}.isdisjoint(now)
    assert set(_files(bundle).values()) < in_flight <= now  # the third save's files stay until it commits
    assert {tmp_path / n for n in others} <= now
    assert ck.on_done(third)
    assert {p.name for p in tmp_path.iterdir()} == {"run.meta.json", *others, *(p.name for p in _files(bundle).values())}
    load_model(model(), bundle.rank_file(0, ".fdl"))  # the rank bundle is untouched


def test_a_rank_refuses_to_save_nan_and_the_previous_bundle_stays(tmp_path):
    bundle, ck, net, opt = _committed(tmp_path)
    before = bundle.meta.read_text()
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    done = _write(ck, net, opt)
    assert not done.model_sha256 and "0.weight holds NaN or Inf" in done.error and "previous bundle is kept" in done.error
    assert not ck.on_done(done) and bundle.meta.read_text() == before
    net = model()
    opt = adam(net)
    next(iter(opt.state.values()))["exp_avg_sq"][0] = float("inf")
    done = _write(ck, net, opt)
    assert not done.model_sha256 and "optimizer state 0.weight's exp_avg_sq holds NaN or Inf" in done.error
    assert len(list(tmp_path.glob("run.*.fdl"))) == 1  # nothing written
    emergency_save(model=net, optimizer=opt, stem=str(bundle.stem), rank=1, reason="controller_lost", why="test", epoch=0, global_step=1)
    assert not bundle.rank_file(1, ".meta.json").exists()


def test_resume_refuses_nan_in_either_file_naming_it(tmp_path):
    bundle, ck, net, opt = _committed(tmp_path)
    files = _files(bundle)
    tensors, metadata = safetensors_io.load(files["optim"])
    tensors["state.1.exp_avg"][0] = float("nan")
    safetensors_io.save(files["optim"], tensors, metadata)
    with pytest.raises(CheckpointError, match=r"run\.\w+\.optim: optimizer state tensor state.1.exp_avg holds NaN"):
        load_optimizer(torch.optim.Adam(model().parameters()), bundle.stem)
    tensors, metadata = safetensors_io.load(files["model"])
    tensors["1.bias"][1] = float("-inf")  # the BatchNorm bias
    safetensors_io.save(files["model"], tensors, metadata)
    with pytest.raises(CheckpointError, match=r"run\.\w+\.fdl: 1.bias holds NaN or Inf"):
        load_model(model(), bundle.stem)


def test_every_file_is_required_and_checksummed(tmp_path):
    bundle, ck, net, opt = _committed(tmp_path)
    files, meta = _files(bundle), json.loads(bundle.meta.read_text())
    files["optim"].write_bytes(files["optim"].read_bytes() + b" ")
    with pytest.raises(CheckpointError, match=r"\.optim is not the file run.meta.json was written with"):
        read_meta(bundle.stem)
    files["optim"].unlink()
    with pytest.raises(CheckpointError, match=r"\.optim: missing.*--resume-weights-only"):
        read_meta(bundle.stem)
    assert read_meta(bundle.stem, weights_only=True)["epoch"] == 0
    for key in ("model_sha256", "optim_sha256", "optim_file"):
        bundle.meta.write_text(json.dumps({k: v for k, v in meta.items() if k != key}))
        with pytest.raises(CheckpointError, match=f"field '{key}' is missing; a sidecar must name and checksum"):
            read_meta(bundle.stem, weights_only=True)
    with pytest.raises(ValueError, match="model_file"):
        write_meta(bundle, {**META, "save_reason": "final", "model_sha256": "ab"})  # a commit names its files


def test_a_schema_1_bundle_still_loads_and_one_without_a_checksum_is_refused(tmp_path):
    bundle = CheckpointBundle.at(tmp_path / "old")
    net = model()
    opt = adam(net)
    legacy = {**META, "schema_version": 1, "save_reason": "final", "model_sha256": save_model(net, bundle.model)}
    save_optimizer(opt, bundle.optim)
    bundle.meta.write_text(json.dumps(legacy))
    assert read_meta(tmp_path / "old.fdl")["save_reason"] == "final"
    back, _ = _restored(bundle)
    assert all(torch.equal(a, b) for a, b in zip(_params(back), _params(net), strict=False))
    bundle.meta.write_text(json.dumps({**legacy, "model_sha256": ""}))
    with pytest.raises(CheckpointError, match="'model_sha256' is missing"):
        read_meta(bundle.stem)


def test_an_emergency_save_replaces_its_previous_one_crash_safely(tmp_path, monkeypatch):
    stem = tmp_path / "lost"
    rank = CheckpointBundle.at(stem).rank(3)
    net = model()
    opt = adam(net)
    save = dict(model=net, optimizer=opt, stem=str(stem), rank=3, reason="controller_lost", why="test", epoch=1, global_step=2)
    emergency_save(**save)
    first = _params(net)
    _moved(net)
    monkeypatch.setattr(
        os,
        "replace",
        lambda src, dst: (_ for _ in ()).throw(OSError("disk gone")) if str(dst).endswith(".meta.json") else os.rename(src, dst),
    )
    emergency_save(**save)  # logged, not raised: the previous replica must still load
    monkeypatch.undo()
    back = model()
    load_model(back, rank.stem)
    assert all(torch.equal(a, b) for a, b in zip(_params(back), first, strict=False))
    emergency_save(**save)
    assert len(list(tmp_path.glob("lost.rank3.*.fdl"))) == 1 and len(list(tmp_path.glob("lost.rank3.*.optim"))) == 1
    load_model(back, rank.stem)
    load_optimizer(torch.optim.Adam(back.parameters()), rank.stem)
    assert all(torch.equal(a, b) for a, b in zip(_params(back), _params(net), strict=False))


# ---------------------------------------------------------- real processes


def _run(proc_env, tmp_path, *args, epochs=30, nproc=2, func="task", name="s.json"):
    path = tmp_path / name
    run = Run(
        [
            "--task",
            task_spec("tiny.py", func),
            "--nproc-per-node",
            str(nproc),
            "--epochs",
            str(epochs),
            "--heartbeat-timeout-secs",
            "4",
            "--summary-json",
            str(path),
            *args,
        ],
        proc_env,
    )
    return run, path


def test_a_death_past_max_failure_saves_and_the_resume_trains_exactly_the_rest(proc_env, tmp_path):
    stem = tmp_path / "ck" / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_INJECT_FAULT": "1:average:9"}
    run, path = _run(env, tmp_path, "--mode", "nccl-cadence", "--max-failure", "1", "--save-path", str(stem), func="big_data_task")
    assert run.wait(90) == 6, run.output
    assert f"--resume-from {stem}" in run.output
    meta = read_meta(stem)  # complete and consistent: the sidecar names this .fdl
    assert meta["save_reason"] == "max_failure_exceeded" and _files(CheckpointBundle.at(stem))["optim"].exists()
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
    assert second["history"][0]["first_epoch"] == meta["epoch"]
    assert second["final_eval"] > 0.8


def test_max_failure_on_the_cpu_backend_saves_from_a_survivor(proc_env, tmp_path):
    stem = tmp_path / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.005", "FLODL_INJECT_FAULT": "2:epoch:3"}
    run, _ = _run(env, tmp_path, "--mode", "cpu-cadence", "--max-failure", "1", "--save-path", str(stem), nproc=3)
    assert run.wait(90) == 6, run.output
    assert "reaches max_failure 1" in run.output
    assert read_meta(stem)["save_reason"] == "max_failure_exceeded"


@pytest.fixture(scope="module")
def finished_bundle(tmp_path_factory):
    """The final save of a finished 2-epoch run of the momentum task (its .optim holds state tensors),
    in a folder of its own (the same first run three tests below each made): a test copies the
    folder (a bundle moves as one folder) and resumes or spoils the copy."""
    folder = tmp_path_factory.mktemp("finished")
    stem = folder / "bundle" / "run"
    run, _ = _run(process_env(), folder, "--save-path", str(stem), epochs=2, func="momentum_task")
    assert run.wait(60) == 0, run.output
    assert read_meta(stem)["save_reason"] == "final"
    return stem.parent


def _copy_of(folder, tmp_path):
    """The stem of a copy of ``finished_bundle``'s bundle in ``tmp_path``."""
    shutil.copytree(folder, tmp_path / folder.name)
    return tmp_path / folder.name / "run"


def test_corrupt_or_foreign_bundles_are_refused_before_training(proc_env, tmp_path, finished_bundle):
    stem = _copy_of(finished_bundle, tmp_path)
    assert read_meta(stem)["save_reason"] == "final"
    foreign, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3, func="other_model_task")
    assert foreign.wait(60) == 2, foreign.output
    assert "does not fit this model" in foreign.output and not foreign.closed(3)
    model_file = _files(CheckpointBundle.at(stem))["model"]
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) // 2])
    corrupt, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3, func="momentum_task")
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
    run, _ = _run(
        proc_env, tmp_path, "--mode", "cpu-async", "--save-path", str(stem), "--checkpoint-at-epoch", "2", epochs=3, func="big_data_task"
    )
    assert run.wait(60) == 0, run.output
    # epoch 2 as the console counts: the checkpoint falls once the second epoch trains (one complete, at most)
    assert re.search(r"checkpoint \(checkpoint\): [01] of 3 epoch\(s\) complete, continues in epoch [12]/3 -> ", run.output), run.output
    assert f"checkpoint (final): all 3 epoch(s) complete -> {stem}" in run.output, run.output


def test_resuming_a_complete_bundle_trains_nothing_scores_it_and_ends(proc_env, tmp_path, finished_bundle):
    """The final save of a finished run, resumed: no window to plan, one eval, exit 0 (it waited for an eval nobody asked for)."""
    stem = _copy_of(finished_bundle, tmp_path)
    again, path = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=2, func="momentum_task", name="again.json")
    assert again.wait(60) == 0, again.output
    assert f"resuming {stem}: all 2 epoch(s) complete, global step" in again.output, again.output  # counted as the console does
    assert "0 samples left to train" in again.output
    summary = json.loads(path.read_text())
    assert summary["samples"] == 0 and summary["final_eval"] is not None


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
        load_model(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
            CheckpointBundle.at(stem).rank_file(rank, ".fdl"),
        )
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(180)
def test_resume_needs_every_file_of_the_bundle_and_finite_values(proc_env, tmp_path, finished_bundle):
    stem = _copy_of(finished_bundle, tmp_path)
    bundle = CheckpointBundle.at(stem)
    files, sidecar = _files(bundle), bundle.meta.read_text()
    tensors, metadata = safetensors_io.load(files["optim"])
    assert "state.0.momentum_buffer" in tensors
    good = files["optim"].read_bytes()
    tensors["state.0.momentum_buffer"][0, 0] = float("nan")  # as a diverged run would have saved it
    safetensors_io.save(files["optim"], tensors, metadata)
    bundle.meta.write_text(sidecar.replace(json.loads(sidecar)["optim_sha256"], file_sha256(files["optim"])))
    nan, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3, func="momentum_task")
    assert nan.wait(60) == 2, nan.output
    assert f"{files['optim']}: optimizer state tensor state.0.momentum_buffer holds NaN" in nan.output
    assert not nan.closed(3)
    files["optim"].unlink()
    bundle.meta.write_text(sidecar)
    missing, _ = _run(proc_env, tmp_path, "--resume-from", str(stem), epochs=3, func="momentum_task")
    assert missing.wait(60) == 2, missing.output
    assert f"{files['optim']}: missing" in missing.output and "--resume-weights-only" in missing.output
    weights, path = _run(
        proc_env, tmp_path, "--resume-from", str(stem), "--resume-weights-only", epochs=3, func="momentum_task", name="weights.json"
    )
    assert weights.wait(60) == 0, weights.output
    assert [h["epoch"] for h in json.loads(path.read_text())["history"]] == [2]  # the trajectory resumed too
    files["optim"].write_bytes(good)


def _status(proc):
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return None


@pytest.mark.timeout(180)
def test_killing_the_controller_while_a_rank_saves_leaves_the_last_committed_bundle(proc_env, tmp_path):
    """SIGKILL the controller after a rank wrote a checkpoint's files and before the sidecar names them."""
    stem = tmp_path / "run"
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.002", "FLODL_INJECT_FAULT": "0:save:2:stop,1:save:2:stop"}
    run, _ = _run(env, tmp_path, "--save-path", str(stem), "--checkpoint-every", "1", epochs=50, func="momentum_task")
    ranks = run.ranks(2)
    deadline = time.monotonic() + 90
    stopped = []
    while not stopped and time.monotonic() < deadline and run.proc.poll() is None:
        stopped = [p for p in ranks if _status(p) == psutil.STATUS_STOPPED]
        time.sleep(0.02)
    assert stopped, run.output
    committed = json.loads(CheckpointBundle.at(stem).meta.read_text())
    tree = run.tree()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait(10)
    for rank in stopped:  # it finishes its save, finds no controller, and goes (SIGTERM was pending)
        rank.resume()
    assert_all_gone(tree, timeout=30)
    bundle = CheckpointBundle.at(stem)
    meta = read_meta(stem)  # complete and consistent: every file it names is there, with its sha256
    assert meta == committed
    uncommitted = {p.name for p in tmp_path.glob("run.*.fdl")} - {meta["model_file"]} - {p.name for p in tmp_path.glob("run.rank*.fdl")}
    assert uncommitted, "the stopped rank's files were written before the kill"
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    load_model(net, bundle.stem)
    load_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), bundle.stem)
