"""Script mode's wire form: the user's own training script as the thing every rank runs.

``--script train.py -- ARGS`` travels to the workers in ``WorkerWelcome.task``
(no new protocol field) as ``script:`` followed by the JSON list ``[path,
*args]``; a task spec never starts so (``module:function`` names a module, and
no module is called ``script``... unless written ``script.py:fn``, which is a
path). A worker that reads one spawns ``python PATH ARGS`` instead of
``python -m flodl.rank``, with the rank's usual environment plus torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. The
script's ``flodl.init()`` (``flodl/script.py``) then runs the rank inside it.

The path travels as given, like a task file: every host must have the script
at that path relative to its worker's working directory. No torch here: the
worker and the controller's CLI import this module.

A rank process runs ``python -m flodl.rank.script_start PATH ARGS``
(``rank/script_start.py``), which runs the script as ``python PATH ARGS``
would. A script that fails before it calls ``flodl.init()`` (a missing data
file, an argparse error) has no link to the controller yet: it leaves its
error in the file its worker named (``FLODL_SCRIPT_REPORT``) and exits, and
the worker reports it (``RankError`` of stage ``BEFORE_INIT``) before the
exit itself. The controller then stops the run as the user's error, printing
the traceback once for every rank that failed the same way.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .config.env import SCRIPT_REPORT, pythonpath_with, torchrun_env
from .errors import ConfigError
from .taskspec import compile_problem

PREFIX = "script:"
#: The module a script rank runs: it runs the script, and reports a failure before ``flodl.init()``.
START_MODULE = "flodl.rank.script_start"
#: The ``RankError.stage`` a worker reports for its script rank that failed before ``flodl.init()``.
BEFORE_INIT = "before init"
#: How much of a report a worker reads: a rank's own ``RankError`` carries at most this much traceback.
REPORT_CHARS = 8000


def encode(path: str, args: Sequence[str]) -> str:
    """The ``WorkerWelcome.task`` text that runs ``path`` with ``args`` on every rank."""
    return PREFIX + json.dumps([path, *args])


def decode(spec: str) -> list[str] | None:
    """``[path, *args]`` of a script spec; None for a task spec.

    Raises:
        ValueError: it starts with ``script:`` but is not a JSON list of strings.
    """
    if not spec.startswith(PREFIX):
        return None
    try:
        argv = json.loads(spec[len(PREFIX) :])
    except ValueError:
        argv = None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"malformed script spec {spec[:200]!r}: expected script: and a JSON list [path, *args]")
    return argv


def check(task: str, script: str, script_args: Sequence[str]) -> None:
    """The launch options of script mode: exactly one of ``--task`` / ``--script``, the script a file
    here that compiles (it is not run).

    Raises:
        ConfigError: naming the field.
    """
    if not script:
        raise ConfigError("script_args", "arguments after -- go to a --script; give --script PATH")
    if task:
        raise ConfigError("script", "give --task or --script, not both")
    if not Path(script).is_file():
        raise ConfigError("script", f"{script!r} is not a file (resolved to {Path(script).resolve()})")
    problem = compile_problem(Path(script))  # a syntax error: refused now, not after every rank started
    if problem is not None:
        raise ConfigError("script", problem)


def script_epochs(script_args: Sequence[str]) -> int | None:
    """The number the script's own ``--epochs`` takes (``--epochs N`` or ``--epochs=N``, the last
    one given, as argparse keeps it), up to a ``--`` of its own; None when it takes none, or not a number."""
    found: int | None = None
    for i, arg in enumerate(script_args):
        if arg == "--":
            break
        text = None
        if arg.startswith("--epochs="):
            text = arg.partition("=")[2]
        elif arg == "--epochs" and i + 1 < len(script_args):
            text = script_args[i + 1]
        if text is not None and text.strip().isdigit():
            found = int(text)
    return found


def one_epochs(flodl_epochs: int | None, script_args: Sequence[str]) -> int | None:
    """The run's epochs, given once: flodl's ``--epochs``, else the script's own (after ``--``);
    None when neither says (the default).

    Raises:
        ConfigError: both say, and differently: the script would size its schedule (a cosine's
            length) for other epochs than the run trains.
    """
    theirs = script_epochs(script_args)
    if flodl_epochs is None or theirs is None or flodl_epochs == theirs:
        return flodl_epochs if flodl_epochs is not None else theirs
    raise ConfigError(
        "epochs",
        f"flodl's --epochs {flodl_epochs} and the script's --epochs {theirs} (after --) differ: the run would train "
        f"{flodl_epochs} epochs while the script sizes its schedule for {theirs}. Give the number once, after -- "
        "(flodl then trains the script's --epochs), or the same number to both",
    )


def label(task: str, script: str, script_args: Sequence[str]) -> str:
    """What the console and the dashboard call the run's work."""
    return " ".join(["script", script, *script_args]) if script else task


def rank_command(
    task: str, *, rank: int, world_size: int, local_rank: int, local_world: int, report: str = ""
) -> tuple[list[str], dict[str, str]]:
    """The argv of a rank process and the variables it gets beyond ``RankEnv``'s.

    A task spec: ``python -m flodl.rank``. A script spec: ``python -m
    flodl.rank.script_start PATH ARGS`` (the script run as ``python PATH ARGS``)
    with torchrun's four variables, as they stand at this spawn (a restarted
    rank's number is new, so ``WORLD_SIZE`` is at least ``RANK + 1``), and
    ``report``: the file where it leaves a failure before ``flodl.init()``.

    Raises:
        ValueError: a malformed script spec.
    """
    argv = decode(task)
    if argv is None:
        return [sys.executable, "-m", "flodl.rank"], {}
    env = torchrun_env(rank=rank, world_size=max(world_size, rank + 1), local_rank=local_rank, local_world_size=local_world)
    # ``python -m flodl.rank`` finds flodl on the working directory when it is not installed; a
    # script's sys.path starts at the script's folder instead: hand it the worker's flodl
    env["PYTHONPATH"] = pythonpath_with(str(Path(__file__).resolve().parent.parent))
    if report:
        env[SCRIPT_REPORT] = report
    return [sys.executable, "-m", START_MODULE, *argv], env


def write_report(path: str, error: str, detail: str) -> bool:
    """The script rank's side: leave ``error`` (one line) and ``detail`` (its traceback) for the
    worker; False when it could not (the rank then fails as any process does)."""
    try:
        Path(path).write_text(json.dumps({"error": error[:2000], "detail": detail[-REPORT_CHARS:]}))
    except OSError:
        return False
    return True


def take_report(path: str) -> tuple[str, str] | None:
    """The worker's side, once the rank exited: ``(error, detail)`` it left, the file removed; None
    when it left none (it failed after ``flodl.init()``, or not at all) or an unreadable one."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4 * REPORT_CHARS)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            Path(path).unlink()
    try:
        report = json.loads(text)
    except ValueError:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("error"), str) or not isinstance(report.get("detail"), str):
        return None
    return report["error"], report["detail"]
