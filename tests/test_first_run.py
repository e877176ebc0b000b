"""A new user's first runs (issue 19): errors at the door are found early, said once, and say what to do."""

from __future__ import annotations

import os
import textwrap

import pytest

from .conftest import PY, ROOT
from .helpers.procs import Proc

_USER_TASK = """
import torch
import torch.nn.functional as F
from flodl import Task

def model():
    return torch.nn.Linear(8, 2)

def task():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return Task(model=model, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                dataset=torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()), batch_size=16, loss_fn=F.cross_entropy)
"""


def _bare_env() -> dict:
    """No PYTHONPATH: flodl is importable only where the script itself puts it (not installed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.timeout(90)
def test_a_task_from_the_users_own_module_runs_from_another_directory(tmp_path):
    """``cd /tmp && python3 ~/proj/train.py``: the ranks import ``mytask`` (next to the script) and
    flodl (on the script's sys.path only), though neither is under their working directory."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    (proj / "mytask.py").write_text(_USER_TASK)
    (proj / "train.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from flodl import Trainer
        from mytask import task
        summary = Trainer.builder(task).nproc_per_node(2).epochs(1).progress(False).run()
        print("TRAINED", summary["exit_code"])
        """)
    )
    run = Proc([PY, str(proj / "train.py")], _bare_env(), cwd=elsewhere)
    assert run.wait(80) == 0, run.output
    assert "TRAINED 0" in run.output, run.output
