"""BatchNorm statistics re-estimated after averaging (flodl/rank/norms.py), alone and in real runs."""

import json

import pytest
import torch

from flodl import Task, TaskError
from flodl.checkpoint.bundle import load_model
from flodl.rank.norms import model_input, norm_layers, recalibrate
from flodl.script import _check_prepare

from .conftest import TASKS, task_spec
from .helpers.procs import Run
from .tasks import bn_script

pytestmark = pytest.mark.timeout(180)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def test_recalibrate_gives_the_plain_mean_of_the_batches_and_restores_the_momentum():
    model = _model().eval()
    bn = model[1]
    bn.running_mean.fill_(5.0)  # statistics that belong to no model, as after averaging
    batches = [torch.randn(32, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert recalibrate(model, norm_layers(model), iter(batches)) == 3
    with torch.no_grad():
        expected = torch.stack([model[0](b).mean(0) for b in batches]).mean(0)
    assert torch.allclose(bn.running_mean, expected, atol=1e-5)
    assert bn.momentum == 0.1 and int(bn.num_batches_tracked) == 3
    assert not model.training  # left as it was found


def test_no_inputs_leave_the_statistics_alone_and_models_without_batchnorm_have_no_layers():
    model = _model()
    model[1].running_mean.fill_(5.0)
    assert recalibrate(model, norm_layers(model), iter([])) == 0
    assert torch.all(model[1].running_mean == 5.0)
    assert norm_layers(torch.nn.Linear(3, 3)) == []
    assert norm_layers(torch.nn.BatchNorm1d(3, track_running_stats=False)) == []


def test_a_forward_that_raises_puts_the_statistics_back():
    """A model that takes its input otherwise (script mode's batches are the user's) keeps the
    statistics training left, not reset ones half re-estimated."""
    model = _model()
    bn = model[1]
    bn.running_mean.fill_(5.0)
    bn.num_batches_tracked.fill_(7)
    with pytest.raises(RuntimeError):
        recalibrate(model, norm_layers(model), iter([torch.randn(8, 4), torch.randn(8, 3)]))  # the second does not fit
    assert torch.all(bn.running_mean == 5.0) and int(bn.num_batches_tracked) == 7 and bn.momentum == 0.1


def test_the_model_input_of_a_batch_is_its_first_element_or_the_tensor_itself():
    x, y = torch.randn(4, 3), torch.arange(4)
    assert model_input([x, y]) is x and model_input((x,)) is x and model_input(x) is x
    with pytest.raises(TypeError, match="dict"):
        model_input({"x": x})


def test_prepare_refuses_a_negative_batch_count_naming_the_argument():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"run.prepare\(\.\.\., bn_recalibration_batches=\.\.\.\): an int >= 0, got -1"):
        _check_prepare(model, optimizer, [1], 1, 1, -1)


def test_a_negative_batch_count_is_refused_naming_the_field():
    with pytest.raises(TaskError, match="bn_recalibration_batches"):
        Task(
            model=_model,
            optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            dataset=[1],
            batch_size=1,
            loss_fn=torch.nn.functional.cross_entropy,
            bn_recalibration_batches=-1,
        )


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
def test_evals_after_averages_score_re_estimated_statistics(proc_env, tmp_path, mode):
    """2 ranks at 1:3: every eval's model has BatchNorm statistics from exactly 8 fresh batches
    (the eval reports the layer's batch count); with the option at 0 they are the averaged ones,
    whose count keeps growing with the batches trained."""
    runs = {}
    for n in (8, 0):
        path = tmp_path / f"s{n}.json"
        # both ranks paced (5 and 15 ms steps): an epoch then outlasts the time its eval request
        # takes to reach the eval rank, so the average that closed it is still held when it is
        # scored, on a loaded machine too (sub-ms steps let the eval rank run a window further)
        env = {
            **proc_env,
            "FLODL_SIMULATE_SLOWDOWN": "0:1.001,1:3",
            "FLODL_SIMULATE_BASE_MS": "5",
            "FLODL_TEST_BN_BATCHES": str(n),
        }
        run = Run(
            [
                "--task",
                task_spec("tiny.py", "batchnorm_task"),
                "--nproc-per-node",
                "2",
                "--epochs",
                "3",
                "--mode",
                mode,
                "--summary-json",
                str(path),
                "--eval-every-epochs",  # each epoch scored on its own (no window runs past its end)
                "1",
            ],
            env,
        )
        assert run.wait(120) == 0, run.output
        runs[n] = json.loads(path.read_text())
    assert [h["eval"] for h in runs[8]["history"]] == [8.0] * 3
    counts = [h["eval"] for h in runs[0]["history"]]
    assert counts[0] > 8 and counts[-1] > counts[0], counts  # averaged counts of every batch each replica saw


def _script_run(proc_env, tmp_path, mode, batches, *extra, env=()):
    """tests/tasks/bn_script.py on 2 ranks, 3 epochs: each rank's epoch-end lines and the summary
    (``run`` added: the controller's process, for its output)."""
    out = tmp_path / f"{mode}-{batches}"
    out.mkdir()
    path = out / "s.json"
    env = {**proc_env, "FLODL_TEST_OUT": str(out), "FLODL_TEST_BN_BATCHES": str(batches), **dict(env)}
    script = str(TASKS / "bn_script.py")
    args = ["--script", script, "--nproc-per-node", "2", "--epochs", "3", "--mode", mode, "--summary-json", str(path), *extra]
    run = Run(args, env)
    assert run.wait(90) == 0, run.output
    lines = {r: [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    return lines, {**json.loads(path.read_text()), "run": run}


@pytest.mark.parametrize("mode", ["nccl-sync", "nccl-cadence", "cpu-async"])
def test_a_scripts_epoch_end_and_final_bundle_find_statistics_re_estimated_after_averages(proc_env, tmp_path, mode):
    """Script mode: the script's code after an epoch's batches (its eval, its saves) finds the
    BatchNorm statistics re-estimated under the weights it holds, here over all 32 batches of the
    epoch (the running mean is then the dataset's mean of the layer's input, and the count 32),
    in every epoch when every batch is averaged (Sync), in the last after the final average
    otherwise; the final bundle holds them too. Before, the script scored statistics as averaged
    (ResNet-20 at 4:1: 86.8% against a Task's 92.5%)."""
    stem = tmp_path / "ck" / "run"
    lines, summary = _script_run(proc_env, tmp_path, mode, 32, "--save-path", str(stem))
    for rank, ends in lines.items():
        checked = ends if mode == "nccl-sync" else ends[-1:]
        assert [(e["batches"], e["gap"] < 1e-5) for e in checked] == [(32, True)] * len(checked), (rank, ends)
    # every mode ends on the consensus, the statistics included (the CPU backend too: its last round lands)
    assert lines[0][-1]["mean"] == lines[1][-1]["mean"]
    assert len(set(summary["final_digests"].values())) == 1
    saved = bn_script.model()
    load_model(saved, stem)
    x, _ = bn_script.data()
    with torch.no_grad():
        assert float((saved[1].running_mean - saved[0](x).mean(0)).abs().max()) < 1e-5
    assert int(saved[1].num_batches_tracked) == 32


def test_a_script_with_re_estimation_off_finds_the_statistics_training_left(proc_env, tmp_path):
    """run.prepare(..., bn_recalibration_batches=0): the statistics are the averaged running ones,
    counting every batch the replica trained, and off the dataset's mean."""
    lines, _ = _script_run(proc_env, tmp_path, "nccl-sync", 0)
    for ends in lines.values():
        assert ends[-1]["batches"] > 32 and ends[-1]["gap"] > 1e-3, ends


def test_a_script_whose_batches_flodl_cannot_feed_the_model_keeps_its_statistics_warned_once(proc_env, tmp_path):
    """Dict batches: flodl cannot tell the model's input, so the statistics stay as training left
    them (not reset), each rank says so once, and the run completes."""
    lines, summary = _script_run(proc_env, tmp_path, "nccl-sync", 32, env={"FLODL_TEST_DICT_BATCHES": "1"})
    for ends in lines.values():
        assert ends[-1]["batches"] > 32 and ends[-1]["gap"] > 1e-3, ends
    said = summary["run"].output.count(
        "BatchNorm statistics not re-estimated (TypeError: cannot tell the model's input in a batch of type dict"
    )
    assert said == 2, summary["run"].output


def test_a_script_scores_what_the_same_task_scores(proc_env, tmp_path):
    """--deterministic (averages and grants fixed by batch counts): the script and the Task train
    the very same replicas, and the script's eval after the last epoch scores exactly what the
    Task's final eval scores, BatchNorm statistics re-estimated from the same batches. Before,
    the script scored the averaged statistics."""
    scored = {}
    for kind in ("--task", "--script"):
        path = tmp_path / f"{kind[2:]}.json"
        what = task_spec("bn_script.py", "task") if kind == "--task" else str(TASKS / "bn_script.py")
        args = [kind, what, "--nproc-per-node", "2", "--epochs", "2", "--mode", "nccl-cadence", "--deterministic"]
        run = Run([*args, "--summary-json", str(path)], {**proc_env, "FLODL_TEST_BN_BATCHES": "16"})
        assert run.wait(90) == 0, run.output
        last = json.loads(path.read_text())["history"][-1]
        scored[kind] = last["eval"] if kind == "--task" else last["scalars"]["accuracy"]
    assert scored["--script"] == pytest.approx(scored["--task"], abs=1e-9), scored
