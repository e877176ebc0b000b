"""docs/migrating.md's claims, with real processes: the torchrun DDP script of
examples/migrate/ and its script-mode port train the same data to the same eval,
both save and resume, and the port changes no more lines than the doc says.

The kill-a-rank-mid-epoch half of the proof (exact coverage in script mode) is
tests/test_script_mode.py::test_a_rank_killed_mid_epoch_costs_nothing.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
from pathlib import Path

import pytest

from .conftest import PY, ROOT, process_env
from .helpers.history import epoch_samples

pytest.importorskip("sklearn", reason="the digits data needs scikit-learn (pip install 'flodl[examples]')")

MIGRATE = ROOT / "examples" / "migrate"
ORIGINAL, PORT = MIGRATE / "ddp_train.py", MIGRATE / "flodl_script.py"
#: docs/migrating.md: the port writes this many lines and removes or changes this many of the original's.
WRITTEN, REMOVED = 14, 28
#: The scripts' defaults (10 epochs, AdamW at 1e-2): both converge, so the evals are comparable.
#: At 3 epochs both are still underfit and a run's eval swings by several points.
EPOCHS = 10
#: One point of accuracy (the issue's bar); the 297 test images make it a gap of at most 2 images.
TOLERANCE = 0.01
EVAL = re.compile(r"eval accuracy ([0-9.]+)")


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring (the docstring says what the file is; it is no port)."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def port_diff() -> tuple[int, int]:
    """(lines the port writes, lines of the original it removes or changes), by difflib."""
    a, b = code_lines(ORIGINAL), code_lines(PORT)
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    return sum(j2 - j1 for *_, j1, j2 in ops), sum(i2 - i1 for _, i1, i2, _, _ in ops)


#: torch 2.13's gloo can abort a DDP process as it exits, after the script's last line and its
#: ``destroy_process_group`` (seen once in CI: the run printed every epoch, then a rank died of
#: SIGABRT). The baseline's own crash at exit is retried once; any other failure stands.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def torchrun(*args: str) -> str:
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(ORIGINAL), *args]
    for attempt in (1, 2):
        done = subprocess.run(cmd, env=process_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
        if done.returncode == 0 or TORCH_EXIT_ABORT not in done.stderr or attempt == 2:
            break
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def flodl(tmp: Path, *run_options: str, epochs: int = EPOCHS) -> tuple[str, dict]:
    summary = tmp / f"summary{len(list(tmp.glob('summary*')))}.json"
    # the epochs given once, to the script as torchrun's command gives them: the run trains the script's --epochs
    cmd = [PY, "-m", "flodl.controller", "--script", str(PORT), "--nproc-per-node", "2"]
    cmd += ["--lr-scale-ratio", "0", "--summary-json", str(summary), *run_options, "--", "--epochs", str(epochs)]
    done = subprocess.run(cmd, env=process_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(summary.read_text())


def accuracy(output: str) -> float:
    [value] = EVAL.findall(output)
    return float(value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Both scripts trained once, 2 ranks each at 1:1 on the same data, each saving its state."""
    tmp = tmp_path_factory.mktemp("migrate")
    ddp = torchrun("--save", str(tmp / "ddp.pt"))
    # --deterministic: averages at fixed batch counts, not the clock, so the port's eval repeats run
    # after run (0.9933 here, as DDP's). By default it moves with timing (0.983-0.997 in five runs on
    # this machine), and a one-point bar on 297 images would then fail now and then for no fault.
    port, summary = flodl(tmp, "--deterministic", "--save-path", str(tmp / "ck" / "run"))
    return {"tmp": tmp, "ddp": ddp, "port": port, "summary": summary}


def test_the_port_changes_no_more_lines_than_the_doc_says():
    assert port_diff() == (WRITTEN, REMOVED)  # equal, not <=: a smaller diff should update the doc
    assert f"writes {WRITTEN} lines" in (ROOT / "docs" / "migrating.md").read_text()


@pytest.mark.timeout(240)
def test_the_original_and_the_port_reach_the_same_eval(trained):
    ddp, port, summary = accuracy(trained["ddp"]), accuracy(trained["port"]), trained["summary"]
    assert summary["exit_reason"] == "completed" and summary["world_size"] == 2 and summary["deaths"] == []
    assert epoch_samples(summary["history"]) == [1500] * EPOCHS  # DDP's epochs: every sample once
    assert ddp > 0.9, trained["ddp"]  # both converged, so a gap means something
    assert abs(ddp - port) <= TOLERANCE + 1e-9, (ddp, port)


@pytest.mark.timeout(240)
def test_both_save_and_resume(trained):
    tmp = trained["tmp"]
    resumed = torchrun("--resume", str(tmp / "ddp.pt"), "--epochs", str(EPOCHS + 1))
    assert re.findall(r"^epoch (\d+):", resumed, re.M) == [str(EPOCHS + 1)]  # only the epoch it had not trained
    assert accuracy(resumed) > 0.9
    out, summary = flodl(tmp, "--resume-from", str(tmp / "ck" / "run"), epochs=EPOCHS + 1)
    assert summary["resumed_from"] and summary["exit_reason"] == "completed"
    assert [h["epoch"] for h in summary["history"]] == [EPOCHS] and summary["history"][0]["samples"] == 1500
    assert re.findall(r"^\[rank 0\] epoch (\d+):", out, re.M) == [str(EPOCHS + 1)]  # ranks' lines come out named
    assert accuracy(out) > 0.9


@pytest.mark.timeout(120)
def test_the_task_version_trains(tmp_path):
    """flodl_task.py: the cosine scheduler, accumulation 2 and precision fields build and train."""
    summary_path = tmp_path / "task.json"
    cmd = [PY, "-m", "flodl.controller", "--task", f"{MIGRATE / 'flodl_task.py'}:task", "--nproc-per-node", "2"]
    cmd += ["--epochs", "3", "--lr-scale-ratio", "0", "--summary-json", str(summary_path)]
    done = subprocess.run(cmd, env=process_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["exit_reason"] == "completed" and epoch_samples(summary["history"]) == [1500] * 3
    assert summary["final_eval"] > 0.8, summary["history"]
