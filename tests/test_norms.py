"""BatchNorm statistics re-estimated after averaging (flodl/rank/norms.py), alone and in real runs."""

import json

import pytest
import torch

from flodl import Task, TaskError
from flodl.rank.norms import norm_layers, recalibrate

from .conftest import task_spec
from .helpers.procs import Run

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
