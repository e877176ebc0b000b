"""``Task.compile``: the model's forward compiled on every rank, valid across averages.

On a CPU the tests compile with the ``aot_eager`` backend (dynamo's capture and
autograd's tracing, no C++ build); on a GPU (the device machine) with inductor,
CUDA graphs included.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from flodl.errors import TaskError
from flodl.rank.compiling import compile_model
from flodl.rank.flat import FlatModel
from flodl.task import compile_kwargs

from .conftest import task_spec
from .helpers.history import epoch_samples
from .helpers.procs import Run

CUDA = torch.cuda.is_available()


def test_compile_spec_is_checked_and_normalised():
    assert compile_kwargs(False) is None and compile_kwargs(True) == {}
    assert compile_kwargs("reduce-overhead") == {"mode": "reduce-overhead"}
    assert compile_kwargs({"backend": "aot_eager", "dynamic": False}) == {"backend": "aot_eager", "dynamic": False}
    for bad in ("fastest", {"mode": "turbo"}, 3):
        with pytest.raises(TaskError, match=r"Task\.compile"):
            compile_kwargs(bad)


@pytest.mark.timeout(120)
def test_an_average_written_in_place_reaches_the_compiled_forward_without_recompiling():
    """What an average does to a compiled replica: new values land in the flat buckets in place;
    the compiled forward must compute with them (not with values captured at compile time), and
    must not compile again (an average per window would otherwise cost a compilation)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    flat = FlatModel(model)
    assert compile_model(model, {"backend": "aot_eager"}, torch.device("cpu")) is False  # no CUDA graphs on a CPU
    x = torch.randn(4, 8)
    model(x).sum().backward()  # compiles forward and backward
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for bucket in flat.buckets:  # an "average": every value replaced, in the same memory
            bucket.flat.mul_(0.5).add_(0.25)
    out = model(x)
    eager = torch.func.functional_call(model._orig_mod if hasattr(model, "_orig_mod") else model, dict(model.named_parameters()), (x,))
    torch.testing.assert_close(out, eager)
    assert counters["stats"]["unique_graphs"] == graphs, "an in-place average made dynamo compile again"
    assert all("_orig_mod" not in key for key in model.state_dict())  # saved bundles keep the plain keys


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
def test_a_compiled_model_trains_across_averages_with_exact_coverage(proc_env, tmp_path, mode):
    """Two real ranks, the model compiled on each, averaged every window: the run covers every
    sample, learns, and its bundle loads into the plain (uncompiled) model."""
    traces = tmp_path / "traces"
    traces.mkdir()
    env = {**proc_env, "FLODL_TEST_TRACES": str(traces)}
    devices = ["--nproc-per-node", "2"]
    if CUDA:  # the device machine: inductor with CUDA graphs on the GPU rank, beside a CPU rank
        env["FLODL_TEST_COMPILE"] = json.dumps("reduce-overhead")
        devices = ["--devices", "cuda:0,cpu"]
        if not mode.startswith("cpu"):
            pytest.skip("one GPU: a GPU beside a CPU rank averages through the CPU backend only")
    path, bundle = tmp_path / "s.json", tmp_path / "run"
    args = ["--task", task_spec("compiled.py"), *devices, "--epochs", "3", "--mode", mode]
    run = Run([*args, "--summary-json", str(path), "--save-path", str(bundle)], env)
    assert run.wait(170) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [1024] * 3
    assert summary["syncs"] >= 2 and summary["final_eval"] > 0.85, summary["final_eval"]
    # every forward ran compiled (eagerly, the task counts each one)
    counts = [int(p.read_text()) for p in traces.iterdir()]
    assert counts and max(counts) == 0, counts
    from flodl.checkpoint.bundle import load_model
    from tests.tasks.compiled import make_model

    saved = [p for p in tmp_path.iterdir() if p.name.startswith("run")]
    assert saved, os.listdir(tmp_path)
    load_model(make_model(), str(saved[0]))


@pytest.mark.timeout(180)
def test_bf16_autocast_under_a_compiled_model_trains_across_averages(proc_env, tmp_path):
    """``precision="bf16-mixed"`` with the model compiled: autocast wraps the compiled forward and
    the averages that write the parameters in place leave the compiled code valid. On the device
    machine the GPU rank runs inductor with CUDA graphs; here both ranks run aot_eager on the CPU,
    where bf16 autocast works too."""
    env = {**proc_env, "FLODL_TEST_PRECISION": "bf16-mixed", "FLODL_TEST_TRACES": str(tmp_path)}
    devices = ["--nproc-per-node", "2"]
    if CUDA:
        env["FLODL_TEST_COMPILE"] = json.dumps("reduce-overhead")
        devices = ["--devices", "cuda:0,cpu"]
    path = tmp_path / "s.json"
    args = ["--task", task_spec("compiled.py"), *devices, "--epochs", "3", "--mode", "cpu-async"]
    run = Run([*args, "--summary-json", str(path)], env)
    assert run.wait(170) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [1024] * 3
    assert summary["syncs"] >= 2 and summary["final_eval"] > 0.85, summary["final_eval"]
    counts = [int(p.read_text()) for p in tmp_path.iterdir() if p.suffix == ".txt"]
    assert counts and max(counts) == 0, counts
