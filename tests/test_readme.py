"""The README's two commands stay true: CI runs the test one verbatim, both parse."""

from __future__ import annotations

import re

import pytest

from flodl.controller.launch import build_parser, resolve

from .conftest import ROOT

pytestmark = pytest.mark.timeout(30)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## What you get")]
    return re.findall(r"```bash\n(.+?)\n```", head)


def test_readme_first_screen_has_main_job_and_tests():
    main_job, tests = readme_commands()
    assert main_job.startswith("bash launch/setup.sh && ") and "flodl.controller" in main_job
    assert (
        tests
        == "bash launch/setup.sh && python3 -m ruff check . && python3 -m ruff format --check . && python3 -m mypy && python3 -m pytest"
    )


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_main_job_options_parse():
    main_job = readme_commands()[0].split("&& ", 1)[1].split()
    args = build_parser().parse_args(main_job[3:])  # after "python3 -m flodl.controller"
    launch, config = resolve(args)
    config.check_available()
    assert launch.task == "examples/digits.py:task" and launch.nproc_per_node == 2 and launch.epochs == 5
    assert (ROOT / "examples" / "digits.py").exists()


def test_sample_output_names_the_mode_the_main_job_runs():
    text = (ROOT / "README.md").read_text()
    sample = text[text.index("## What you get") :]
    shown = re.search(r"^flodl run \w+ \| mode (\w+) \| task (\S+)$", sample, re.M)
    main_job = readme_commands()[0].split("&& ", 1)[1].split()
    _, config = resolve(build_parser().parse_args(main_job[3:]))
    assert shown and shown.group(1) == config.elche.mode.name and shown.group(2) == "examples/digits.py:task"


def test_readme_names_the_system_packages_ci_installs():
    script = (ROOT / "launch" / "system-packages.sh").read_text()
    packages = re.findall(r"missing\+=\((\S+)\)", script)
    assert packages == ["chromium", "openssh-server", "iproute2"]
    packages += [*re.search(r"for bin in ([a-z ]+); do", script).group(1).split(), *re.findall(r"lean\+=\(([a-z-]+)\)", script)]
    assert packages[3:] == ["slurmctld", "slurmd", "munge", "slurm-client"]
    readme = (ROOT / "README.md").read_text()
    head = readme[: readme.index("## What you get")]
    assert all(f"`{name}`" in head for name in packages) and "bash launch/system-packages.sh" in head
    assert "bash launch/system-packages.sh" in (ROOT / ".ci" / "run").read_text().splitlines()
