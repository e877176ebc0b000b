"""The controller process (``python -m flodl.controller``); see ``core.py``.

``main()`` is the CLI: parse flags (and ``--config`` TOML), configure
logging, run the ``Controller`` on uvloop, print and optionally save the
summary, and exit with a code that says how the run ended.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ..config.env import read_run_credentials, request_encryption, strict
from ..errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError, RunAborted
from .launch import LaunchOptions, build_parser, resolve

if TYPE_CHECKING:
    from .core import Controller
    from .hooks import ControllerHooks
    from .phase import Phase

__all__ = ["Controller", "ControllerHooks", "LaunchOptions", "Phase", "check_external_credentials", "main", "run_controller"]

log = logging.getLogger("flodl.controller")

# Imported on first use: `--help` and a bad flag answer without loading the runtime (uvloop, ZeroMQ,
# the codec: ~0.5 s of a 2-core machine's start-up).
_LAZY = {"Controller": ".core", "ControllerHooks": ".hooks", "Phase": ".phase"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_loop(coro: Any) -> Any:
    """Run a coroutine on uvloop where available (it is faster), else asyncio."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def write_summary(path: str | None, summary: dict) -> None:
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        tmp.replace(target)  # atomic: a reader never sees half a summary


def run_controller(controller: Controller) -> dict:
    """Run to the end; write the summary file either way; raise RunAborted on failure."""
    try:
        summary = run_loop(controller.run())
    except RunAborted as exc:
        if exc.summary:
            report_handler_errors(exc.summary)
        write_summary(controller.ctx.launch.summary_json, exc.summary)
        raise
    report_handler_errors(summary)
    write_summary(controller.ctx.launch.summary_json, summary)
    if summary.get("exit_code"):  # it ran to the end, but not as a plain success (every eval failed)
        raise RunAborted(summary.get("failure", summary["exit_reason"]), summary["exit_code"], summary)
    return summary


def report_handler_errors(summary: dict) -> None:
    """A message handler that raised is a flodl bug the run survived: say so at the end, where it
    is seen; under ``FLODL_STRICT`` (the test suite) a run that would have succeeded fails."""
    count = summary.get("handler_errors") or 0
    if not count:
        return
    log.error("%d message handler error(s) in the controller: a flodl bug (tracebacks above); please report it", count)
    if strict() and not summary.get("exit_code"):
        summary["exit_code"] = EXIT_FAILED
        summary["failure"] = f"{count} message handler error(s) in the controller (FLODL_STRICT)"


def check_external_credentials(launch: LaunchOptions, secret: bytes | None, run_id: str | None) -> None:
    """Workers started by hand must hold the run's secret and id: with ``--workers N`` they come
    from the environment (FLODL_RUN_SECRET and FLODL_RUN_ID, set for both sides) or are made here
    and written to ``--join-file``; a secret made here and shown to no one would admit no worker.

    Raises:
        ConfigError: external workers, and neither both variables nor a join file.
    """
    if launch.embedded or launch.join_file or (secret is not None and run_id is not None):
        return
    raise ConfigError(
        "workers",
        "workers started by hand need this run's secret: export FLODL_RUN_SECRET (hex, >= 16 bytes) and "
        "FLODL_RUN_ID for the controller and every worker, or give --join-file PATH and start each worker "
        "with python -m flodl.worker --join-file PATH (docs/multihost.md)",
    )


def exit_process(code: int) -> NoReturn:
    """End the controller's process with ``code``. A run that ended in its first seconds may
    leave the store thread inside torch's TCPStore constructor, and finalising the interpreter
    under it aborts the process (exit -6, "terminate called without an active exception"):
    then the streams are flushed and the process leaves without finalising."""
    plane = sys.modules.get("flodl.controller.plane")  # loaded once a run started; not for a bad option
    if plane is not None and plane.store_still_opening():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[controller] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        launch, config = resolve(args)
        config.check_available()
        from ..wire import curve  # ZeroMQ: once the options are known good

        # a launcher may hand the run's credentials down (multi-host); else we make them
        secret, run_id = read_run_credentials()
        check_external_credentials(launch, secret, run_id)
        if args.encrypt:
            request_encryption()  # the controller, and every process it starts, encrypts
        if curve.requested() and not curve.available():
            raise ConfigError("encrypt", "this libzmq has no CURVE support")
    except (ConfigError, ValueError) as exc:
        print(f"flodl: bad option {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from .core import Controller  # the runtime, once the options are known good
    from .startup import process_started_unix

    try:
        run_controller(Controller(launch, config, secret=secret, run_id=run_id, started_unix=process_started_unix()))
    except RunAborted as exc:
        return exc.exit_code
    except Exception:
        log.exception("controller failed")
        return EXIT_FAILED
    return EXIT_OK
