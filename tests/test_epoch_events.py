"""The epochs a user's code sees: every rank sees every epoch, in order, even one it trains no batch
of (docs/script-mode.md), and each row of the run's history is its epochs' own (docs/cadence.md,
*Epoch tails*): real runs whose epochs are short enough that windows span several."""

from __future__ import annotations

import itertools
import json

import pytest

from .conftest import TASKS
from .helpers.procs import Run

EPOCHS = 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
def test_every_script_rank_sees_every_epoch_and_steps_its_scheduler_once_per_epoch(proc_env, tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    args = ["--script", str(TASKS / "epochs_script.py"), "--nproc-per-node", "2", "--epochs", str(EPOCHS), "--mode", mode]
    args += ["--lr-scale-ratio", "0", "--summary-json", str(tmp_path / "s.json"), "--no-progress"]  # the script's LR as written
    # rank 1 paced as a device 20x slower: its speed share of a 16-batch epoch rounds to nothing
    run = Run(args, {**proc_env, "FLODL_TEST_OUT": str(out), "FLODL_SIMULATE_SLOWDOWN": "1:20"})
    assert run.wait(90) == 0, run.output
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in ranks:
        assert record["seen"] == list(range(EPOCHS))  # the last epoch too
    # a StepLR stepped once per epoch leaves every rank at the same LR
    assert ranks[0]["lr"] == pytest.approx(ranks[1]["lr"]) == pytest.approx(0.1 * 0.9**EPOCHS)
    # together they trained every sample of the run, once (a batch an earlier window gave back may
    # be trained inside a later epoch's loop: docs/script-mode.md)
    assert sum(n for r in ranks for n in r["samples"].values()) == 256 * EPOCHS
    # what the runs are about: some rank had an epoch with no batch of its own (the slow one's share
    # of short epochs); if this ever fails the test no longer tests anything
    assert any(n == 0 for r in ranks for n in r["batches"].values()), ranks
    # each epoch's end-of-epoch report reached the controller from every rank
    summary = json.loads((tmp_path / "s.json").read_text())
    assert sorted(e for h in summary["history"] for e in _epochs(h)) == list(range(EPOCHS))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_every_task_rank_runs_epoch_fn_for_every_epoch(proc_env, tmp_path, mode):
    logs = tmp_path / "epochs"
    logs.mkdir()
    args = ["--task", f"{TASKS / 'tiny.py'}:epoch_logging_task", "--nproc-per-node", "2", "--epochs", str(EPOCHS), "--mode", mode]
    # rank 1 paced 20x slower: epochs whose speed share for it rounds to no batch at all
    env = {**proc_env, "FLODL_TEST_EPOCH_LOG": str(logs), "FLODL_TEST_SAMPLES": "256", "FLODL_SIMULATE_SLOWDOWN": "1:20"}
    run = Run([*args, "--no-progress", "--eval-every-epochs", "0"], env)
    assert run.wait(90) == 0, run.output
    for r in (0, 1):
        assert [int(e) for e in (logs / f"rank{r}.epochs").read_text().split()] == list(range(EPOCHS))


def _epochs(entry: dict) -> list[int]:
    """The epochs a summary history entry covers (one, or a group one average closed)."""
    return list(range(entry.get("first_epoch", entry["epoch"]), entry["epoch"] + 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_an_average_that_closes_several_epochs_is_one_row_and_no_figure_is_copied(proc_env, tmp_path, mode):
    """Epochs too short to average each one: one row, one line and one eval for the epochs one average
    closes ("epochs 3-5 ... (after epoch 5)"); every epoch is in exactly one row; no two rows share an
    eval, a wall time or a rate by copy."""
    path = tmp_path / "s.json"
    args = ["--task", f"{TASKS / 'tiny.py'}:task", "--nproc-per-node", "2", "--epochs", str(EPOCHS), "--mode", mode]
    run = Run([*args, "--no-progress", "--summary-json", str(path)], {**proc_env, "FLODL_TEST_SAMPLES": "256"})
    assert run.wait(90) == 0, run.output
    history = json.loads(path.read_text())["history"]
    assert [e for h in history for e in _epochs(h)] == list(range(EPOCHS))
    groups = [h for h in history if h["first_epoch"] < h["epoch"]]
    assert groups, "no average closed several epochs: the test tests nothing"
    assert all(h["eval"] is not None for h in history)  # one eval per row, the group's own
    assert all(sorted(map(int, h["epoch_losses"])) == _epochs(h) for h in history)
    assert all(h["ahead_samples"] == 0 for h in history)  # every average closed its epochs on their edge
    for a, b in itertools.pairwise(history):
        assert (a["wall_s"], a["samples_per_s"]) != (b["wall_s"], b["samples_per_s"])  # never copied
    lines = [line for line in run.output.splitlines() if line.startswith("epoch")]
    assert len(lines) == len(history)
    for h, line in zip(history, lines, strict=True):
        which = f"epoch {h['epoch'] + 1}/" if h["first_epoch"] == h["epoch"] else f"epochs {h['first_epoch'] + 1}-{h['epoch'] + 1}/"
        assert line.startswith(which), line
        if h["first_epoch"] < h["epoch"]:
            assert f"(after epoch {h['epoch'] + 1})" in line


@pytest.mark.timeout(120)
def test_eval_every_epochs_set_scores_each_of_those_epochs_on_its_own(proc_env, tmp_path):
    """``--eval-every-epochs 1``: no window runs past an epoch's end, so every epoch is its own row and eval."""
    path = tmp_path / "s.json"
    args = ["--task", f"{TASKS / 'tiny.py'}:task", "--nproc-per-node", "2", "--epochs", "12", "--eval-every-epochs", "1"]
    run = Run([*args, "--no-progress", "--summary-json", str(path)], {**proc_env, "FLODL_TEST_SAMPLES": "256"})
    assert run.wait(90) == 0, run.output
    history = json.loads(path.read_text())["history"]
    assert [(h["first_epoch"], h["epoch"]) for h in history] == [(e, e) for e in range(12)]
    assert all(h["eval"] is not None for h in history)
