"""``python -m flodl.rank.script_start PATH ARGS``: a script-mode rank process, running the user's script.

The worker starts every script rank through this module (``scriptspec.rank_command``;
forked by the zygote like any ``python -m``): it runs ``PATH`` as ``python PATH
ARGS`` would (``sys.argv``, the script's folder first on ``sys.path``, ``__main__``),
and watches for one thing the script cannot report itself: a failure before it
calls ``flodl.init()``. Until then the rank has no link to the controller, so
such a failure (a missing data file, an argparse error, any exception) would be
only a process that died: the run took it for a lost rank, went on without it
and printed the traceback once per rank, with flodl's and runpy's frames in it.

Here, an exception that escapes the script before ``flodl.init()`` (or a
``SystemExit`` with an error code) is written, with the user's frames only, to
the file the worker named (``FLODL_SCRIPT_REPORT``), and the process exits 2
without printing it. The worker reports it before the exit; the controller
prints it once for every rank that failed the same way and stops the run as the
user's error (exit 2, ``controller/before_init.py``). After ``flodl.init()``
nothing changes: the script's ``Run`` reports its own errors.

Before the script's first line it seeds every random generator from the run seed, the
same on every rank (determinism.py): whatever the script draws while it builds its data
and model is equal on every rank; ``run.prepare()`` gives each rank its own stream.

It also makes the commonest leftover of a torchrun script fail with a reason:
``torch.distributed.init_process_group()`` rendezvousing through ``env://``
needs ``MASTER_ADDR``, which a flodl rank does not have, because flodl registers
no default process group (docs/script-mode.md says why); torch's own error
("environment variable MASTER_ADDR expected") says nothing of that.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path
from typing import Any

from .. import scriptspec
from ..config.env import has_master_addr, probes_requested, rank_number, script_report
from ..errors import EXIT_CONFIG
from .outcomes import user_traceback
from .output import prefix_output


def run_script(path: str, args: list[str]) -> int:
    """Run the script as ``python PATH ARGS``; its exit code, or 2 once a failure before
    ``flodl.init()`` was left for the worker.

    Raises:
        BaseException: what the script raised, where it is not reported here (after
            ``flodl.init()``, ``KeyboardInterrupt``, a clean ``SystemExit``, no report file):
            the caller (the interpreter, or the zygote's child) handles it as for any script.
    """
    sys.argv = [path, *args]
    sys.path[0] = str(Path(path).resolve().parent)  # ``python PATH``: the script's folder, not the working directory
    guard_default_group()
    _seed_alike()
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException as exc:
        failure = _before_init(exc)
        report = script_report()
        if failure is None or not report or not scriptspec.write_report(report, *failure):
            raise
        return EXIT_CONFIG
    return 0


def _seed_alike() -> None:
    """Every RNG seeded from the run seed, the same on every rank, before the script's first line:
    what it draws while it builds its data and model (before ``flodl.init()`` too) is the same on
    every rank; ``run.prepare()`` gives each rank its own stream (determinism.py)."""
    from ..config.env import RankEnv
    from .determinism import enter_build_phase

    try:
        env = RankEnv.from_environ()
    except (KeyError, ValueError):
        return  # not started by a worker: flodl.init() says so with its own line
    enter_build_phase(env)


def _before_init(exc: BaseException) -> tuple[str, str] | None:
    """``(error, traceback)`` of a failure before ``flodl.init()``; None for anything else: the
    script is past ``init()`` (its ``Run`` reports), stopped (``KeyboardInterrupt``) or exits cleanly."""
    from .. import script

    if script.initialised() or isinstance(exc, KeyboardInterrupt):
        return None
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code == 0:
            return None
        if isinstance(code, int):  # argparse and sys.exit(N) said why themselves, on stderr
            return f"it exited with code {code} (its own message is above)", ""
        return str(code), f"{code}\n"  # sys.exit("message"): the message is what Python would print
    return f"{type(exc).__name__}: {exc}", user_traceback(exc)


#: Why ``init_process_group`` fails in a script rank (raised in the script, which reports it).
NO_DEFAULT_GROUP = (
    "flodl: a --script does not call torch.distributed.init_process_group(): flodl averages the replicas "
    "itself, through process groups of its own, and its ranks do not step in lockstep (a faster rank trains "
    "more batches), so the collectives of a default group would not match across ranks; remove "
    "init_process_group and DistributedDataParallel (docs/script-mode.md#torchdistributed-in-a-script)"
)


def guard_default_group() -> None:
    """``init_process_group`` rendezvousing through the environment (no ``init_method``, or
    ``env://``, and no ``store``) without ``MASTER_ADDR`` raises ``NO_DEFAULT_GROUP`` instead of
    torch's error; any other call (a store or an address of the script's own) goes through."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        store = kwargs.get("store", args[5] if len(args) > 5 else None)
        by_env = store is None and (init_method is None or str(init_method).startswith("env://"))
        if by_env and not has_master_addr():
            raise RuntimeError(NO_DEFAULT_GROUP)
        return original(*args, **kwargs)

    dist.init_process_group = distributed_c10d.init_process_group = init_process_group


def main() -> int:
    if len(sys.argv) < 2:
        print(f"usage: python -m {scriptspec.START_MODULE} SCRIPT.py [ARGS]", file=sys.stderr)
        return EXIT_CONFIG
    rank = rank_number()
    if rank is not None:
        prefix_output(rank)  # "[rank N] " on every line the script prints, as torchrun --tee does
    if probes_requested():  # tests and benchmarks: faults, a simulated pace (flodl/probes.py)
        from ..testing.probes import install_from_environment

        install_from_environment()
    return run_script(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
