"""A new user's first runs (issue 19): errors at the door are found early, said once, and say what to do."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from .conftest import PY, ROOT, task_spec
from .helpers.procs import Proc, Run

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


def test_a_task_spec_is_checked_by_reading_the_module_not_running_it(tmp_path, monkeypatch):
    """``check_spec`` finds a missing file, module or attribute without executing the module (its
    import of torch, its side effects): a module that raises on import passes if it names the task."""
    from flodl.errors import TaskError
    from flodl.taskspec import check_spec

    (tmp_path / "loud.py").write_text("raise SystemExit('executed')\n\ndef task():\n    pass\n")
    (tmp_path / "star.py").write_text("from os.path import *\n")
    (tmp_path / "broken.py").write_text("def task(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_spec(f"{tmp_path / 'loud.py'}:task")
    check_spec("loud:task")
    check_spec("star:anything")  # a star import may bind it: the ranks decide
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import not_a_module_anywhere\n")
    check_spec("brokenpkg.mod:task")  # the package's own import fails: the ranks show the user's traceback
    check_spec("os.path:join")  # an imported module is looked at directly
    for spec, said in (
        (f"{tmp_path / 'nope.py'}:task", "not found"),
        (f"{tmp_path / 'loud.py'}:tsak", "defines no 'tsak'"),
        ("loud:tsak", "defines no 'tsak'"),
        ("no_such_module_here:task", "add that directory to PYTHONPATH"),
        ("os.path:nope", "has no attribute 'nope'"),
        (f"{tmp_path / 'broken.py'}:task", r"broken.py does not compile:\n  File .*, line 1\n    def task\(:\n.*\^\nSyntaxError"),
    ):
        with pytest.raises(TaskError, match=said):
            check_spec(spec)


def test_a_bad_flag_costs_one_line_and_a_hint():
    run = Proc([PY, "-m", "flodl.controller", "--task", "x.py:task", "--epochs", "abc"], _bare_env() | {"PYTHONPATH": str(ROOT)})
    assert run.wait(30) == 2
    assert len(run.lines) == 2, run.output
    assert "--epochs: invalid int value: 'abc'" in run.lines[0] and "--help" in run.lines[1], run.output
    run = Proc([PY, "-m", "flodl.controller", "--task", "x.py:task", "--hearbeat-timeout-secs=3"], _bare_env() | {"PYTHONPATH": str(ROOT)})
    assert run.wait(30) == 2
    assert "did you mean --heartbeat-timeout-secs?" in run.output, run.output


def test_help_groups_the_options_and_shows_every_default():
    from flodl.config.options import HELP_GROUPS
    from flodl.controller.launch import build_parser

    parser = build_parser()
    titles = [group.title for group in parser._action_groups if group._group_actions and group.title != "options"]
    assert titles == list(HELP_GROUPS)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            shown = action.help.lower()
            assert "default" in shown or "required" in action.help or "give --task" in shown, f"{action.option_strings} shows no default"
            assert not shown.endswith("default: .") and ".. default" not in shown, f"{action.option_strings}: {action.help}"


def test_flags_are_taken_in_full_or_in_torchruns_underscore_spelling():
    """No prefix matching: a truncated flag is an error, not another option; --nproc_per_node (torchrun's
    spelling) is --nproc-per-node; after -- everything is the script's, untouched."""
    from flodl.config.cli import BriefParser
    from flodl.controller.launch import build_parser, resolve

    launch, config = resolve(
        build_parser().parse_args(["--task", "examples/digits.py:task", "--nproc_per_node", "3", "--heartbeat_timeout_secs=7"])
    )
    assert launch.nproc_per_node == 3 and config.heartbeat_timeout_secs == 7
    args = build_parser().parse_args(["--script", "t.py", "--", "--nproc_per_node", "1", "--epochs", "2"])
    assert args.script_args == ["--nproc_per_node", "1", "--epochs", "2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--task", "x.py:task", "--nproc-per-nod", "2"])
    assert BriefParser().allow_abbrev is False


def _interrupt(proc_env, tmp_path, after: str, *extra: str) -> tuple[Run, list[float]]:
    """A 2-rank run with --save-path, SIGINT once ``after`` is printed; (the run, [sent, save line, exit] times)."""
    env = {**proc_env, "FLODL_TEST_STEP_SLEEP": "0.05"}
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--epochs", "30", "--save-path", str(tmp_path / "ck"), *extra]
    run = Run(args, env)
    run.wait_for_line(after, timeout=120)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    marks = [sent]
    if after.startswith("epoch"):
        run.wait_for_line("saved the run to the bundle", timeout=60)
        marks.append(time.monotonic())
    assert run.wait(60) == 130, run.output
    return run, [*marks, time.monotonic()]


@pytest.mark.timeout(150)
def test_ctrl_c_in_training_saves_says_so_as_information_and_exits_soon_after(proc_env, tmp_path):
    run, (sent, saved, ended) = _interrupt(proc_env, tmp_path, "epoch 1/30")
    print(f"SIGINT -> save line {saved - sent:.2f} s, save line -> exit {ended - saved:.2f} s")
    stopping = next(i for i, line in enumerate(run.lines) if "interrupted by SIGINT" in line)
    assert run.lines[stopping].endswith(f"saving the run to {tmp_path / 'ck'}"), run.output
    assert not any("ERROR" in line or "WARNING" in line for line in run.lines), run.output
    assert "continue it with --resume-from" in run.lines[-1], run.output  # the last word: what was saved
    assert (tmp_path / "ck.meta.json").exists()


@pytest.mark.timeout(150)
def test_ctrl_c_before_training_says_that_nothing_was_saved(proc_env, tmp_path):
    run, (sent, ended) = _interrupt(proc_env, tmp_path, "dashboard:")
    print(f"SIGINT -> exit {ended - sent:.2f} s")
    assert "interrupted by SIGINT before training began; nothing was saved" in run.output, run.output
    assert not any("ERROR" in line or "WARNING" in line for line in run.lines), run.output  # no rank kept it waiting
    assert not list(tmp_path.glob("ck*"))


def test_a_rank_without_samples_is_refused_and_a_batch_beyond_a_share_is_warned():
    from flodl.plan.schedule import Schedule

    refusal, warning = Schedule(3).share_problem(batch_size=1, world=4)
    assert refusal and "3 sample(s) for 4 ranks: 1 rank(s) would train nothing" in refusal and warning is None
    refusal, warning = Schedule(256).share_problem(batch_size=1000, world=4)
    assert refusal is None and warning and "batch_size 1000" in warning and "~64 of 256 samples over 4 ranks" in warning
    assert Schedule(256, epoch_splits=4).share_problem(batch_size=32, world=4)[1]  # 64 samples an epoch: 16 a rank
    assert Schedule(256).share_problem(batch_size=64, world=4) == (None, None)


@pytest.mark.timeout(90)
def test_a_world_larger_than_the_data_is_refused_before_the_group_forms(proc_env):
    run = Run(["--task", task_spec("tiny.py", "three_samples_task"), "--nproc-per-node", "4", "--epochs", "1"], proc_env)
    assert run.wait(80) == 2, run.output
    assert "an epoch has 3 sample(s) for 4 ranks: 1 rank(s) would train nothing" in run.output, run.output
    assert "Traceback" not in run.output and "epoch 1/" not in run.output


def test_a_bundle_is_described_in_the_consoles_epoch_numbers():
    """The sidecar stores the 0-based index of the first open epoch; people read 1-based numbers."""
    from flodl.checkpoint.meta import progress_text

    assert progress_text(0, 10) == "0 of 10 epoch(s) complete, continues in epoch 1/10"
    assert progress_text(2, 10) == "2 of 10 epoch(s) complete, continues in epoch 3/10"
    assert progress_text(10, 10) == "all 10 epoch(s) complete"


def test_help_and_a_bad_spec_load_neither_the_runtime_nor_torch():
    """What keeps `--help` and the door's errors under a second: they import no torch, no uvloop/ZeroMQ runtime."""
    probe = (
        "import runpy, sys\n"
        "for argv in (['--help'], ['--task', 'nope.py:task']):\n"
        "    sys.argv = ['flodl.controller', *argv]\n"
        "    try:\n"
        "        runpy.run_module('flodl.controller', run_name='__main__', alter_sys=True)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('LOADED', sorted(m for m in ('torch', 'flodl.controller.core', 'zmq') if m in sys.modules))\n"
    )
    run = Proc([PY, "-c", probe], _bare_env() | {"PYTHONPATH": str(ROOT)})
    assert run.wait(30) == 0, run.output
    assert "LOADED []" in run.output, run.output
