"""Launch options: what to run and where, as opposed to how it trains.

``DdpRunConfig`` (``flodl/config/run.py``) says how a run trains; ``LaunchOptions``
says which task, for how long, on which ranks, and where the controller
listens. The CLI reads both the same way: flags, then a TOML file
(``--config``), then defaults; flags win. Flags are the field names in
kebab-case and TOML keys are the field names.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from .. import scriptspec
from ..config import DdpRunConfig
from ..config.cli import BriefParser
from ..config.options import HELP_GROUPS, add_run_options, load_toml, resolve_run_config
from ..errors import ConfigError, TaskError
from ..plan.schedule import DEFAULT_SEED
from ..taskspec import check_spec


@dataclass(frozen=True)
class LaunchOptions:
    """Where and what to run. Every field has a ``--kebab-case`` flag and a TOML key."""

    task: str = ""
    script: str = ""
    script_args: tuple[str, ...] = ()
    epochs: int = 1
    nproc_per_node: int | None = None
    devices: str | None = None
    workers: int = 0
    bind: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    seed: int = DEFAULT_SEED
    summary_json: str | None = None
    join_timeout_secs: float = 120.0
    eval_timeout_secs: float = 600.0
    step_timeout_secs: float | None = None
    max_restarts: int = 0
    progress: bool | None = None
    dashboard_port: int = 0
    join_file: str | None = None

    def validate(self) -> None:
        """Raises: ConfigError naming the first bad field."""
        if self.script or self.script_args:
            scriptspec.check(self.task, self.script, self.script_args)
        elif not self.task or ":" not in self.task:
            raise ConfigError("task", "needs a task spec such as examples/digits.py:task or mypkg.train:task")
        if self.epochs < 1:
            raise ConfigError("epochs", f"must be >= 1, got {self.epochs}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        if self.workers < 0:
            raise ConfigError("workers", f"must be >= 0, got {self.workers}")
        if self.workers and (self.nproc_per_node is not None or self.devices):
            raise ConfigError("workers", "external workers choose their own devices; drop --nproc-per-node / --devices")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be a TCP port, got {self.port}")
        if not -1 <= self.dashboard_port <= 65535:
            raise ConfigError("dashboard_port", f"must be a TCP port, 0 (pick a free one) or -1 (off), got {self.dashboard_port}")
        for name in ("join_timeout_secs", "eval_timeout_secs", "step_timeout_secs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(name, f"must be a positive number of seconds, got {value:g}")
        if self.embedded and not (self.script or self.script_args):  # a script is checked above (scriptspec)
            # the local ranks import the spec from here: a typo is found now, not after their start-up
            # (external workers may hold the task where this host does not: theirs to check)
            try:
                check_spec(self.task)
            except TaskError as exc:
                raise ConfigError("task", str(exc)) from None

    @property
    def spec(self) -> str:
        """What the ranks are told to run (``WorkerWelcome.task``): the task spec, or the script's."""
        return scriptspec.encode(self.script, self.script_args) if self.script else self.task

    @property
    def label(self) -> str:
        """The run's work as the console and the dashboard name it."""
        return scriptspec.label(self.task, self.script, self.script_args)

    @property
    def embedded(self) -> bool:
        """No external workers: the controller starts a local worker itself."""
        return self.workers == 0

    @property
    def advertise_host(self) -> str:
        """The address peers dial: ``advertise``, else the bind address (loopback for 0.0.0.0)."""
        if self.advertise:
            return self.advertise
        return "127.0.0.1" if self.bind in ("0.0.0.0", "*", "") else self.bind


_HELP = {
    "task": "task factory to train: path/to/file.py:function or package.module:function",
    "script": "your own training script, run on every rank as torchrun runs it (python -m flodl.controller "
    "--script train.py [options] -- SCRIPT_ARGS); it calls flodl.init(): docs/script-mode.md",
    "script_args": "the script's own arguments: everything after --",
    "epochs": "number of epochs (passes over the dataset). Default: 1; with --script, the script's own --epochs N "
    "after -- when it takes one (give it once)",
    "nproc_per_node": "ranks on this host for the embedded worker (default: one per GPU, else 1 CPU rank)",
    "devices": "explicit devices for the embedded worker, e.g. cuda:0,cuda:1 or cpu,cpu",
    "workers": "number of external workers to wait for (python -m flodl.worker); 0 starts one locally",
    "bind": "address the controller listens on (default loopback; use an interface address for multi-host)",
    "port": "control port (0 picks a free one and prints it)",
    "advertise": "address workers and ranks use to reach the controller (default: the bind address)",
    "seed": "the run's seed: epoch e's shuffle is seeded seed + e, and every rank's random generators (torch, numpy, random) "
    "are seeded from it, alike while the task builds its model and data, then from (seed, rank) for training",
    "summary_json": "write the run summary (the dict run() returns) to this JSON file",
    "join_timeout_secs": "seconds to wait for every worker and rank to join",
    "eval_timeout_secs": "seconds an eval, a user callback or a checkpoint write may go without finishing before its rank is declared hung",
    "max_restarts": "healing: restart a rank that died up to this many times (per rank; at once, then in a crash loop back-off 1, 2, 4 ... 30 s); "
    "the new rank joins the running world at a window boundary (0: go on without it)",
    "step_timeout_secs": "seconds a training step may take before its rank is declared hung (default: heartbeat timeout + 3x the rank's slowest recent step; its first step: join_timeout_secs)",
    "progress": "live progress line (default: on when stdout is a terminal)",
    "join_file": "write the run's join file here (run id, secret, control address; mode 0600, removed at the end) "
    "once the controller listens: a worker started by hand joins with python -m flodl.worker --join-file PATH. Default: none.",
    "dashboard_port": "live dashboard port, served read-only on the bind address (0 picks a free one and prints it; -1 turns it off)",
}
LAUNCH_KEYS = frozenset(f.name for f in dataclasses.fields(LaunchOptions))


#: The ``--help`` group of each launch option not in "launch" (see ``HELP_GROUPS``).
_LAUNCH_GROUP = {
    "join_timeout_secs": "fault tolerance and checkpoints",
    "eval_timeout_secs": "fault tolerance and checkpoints",
    "step_timeout_secs": "fault tolerance and checkpoints",
    "max_restarts": "fault tolerance and checkpoints",
    "summary_json": "monitoring",
    "progress": "monitoring",
    "dashboard_port": "monitoring",
}


def _with_default(help_text: str, default: Any) -> str:
    """Every flag says its default: appended unless the help already explains it."""
    if "default" in help_text.lower() or "required" in help_text:
        return help_text
    if default == "":  # --task / --script: one of them names what to run
        return f"{help_text}. Give --task or --script."
    shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
    return f"{help_text.rstrip('.')}. Default: {shown}."


def build_parser() -> argparse.ArgumentParser:
    """The controller's CLI: launch options, run options, and ``--config``, in ``HELP_GROUPS``."""
    parser = BriefParser(
        prog="python -m flodl.controller",
        usage="%(prog)s (--task FILE.py:FUNCTION | --script TRAIN.py) [--epochs N] [--nproc-per-node N] [options] [-- SCRIPT_ARGS]",
        description="Train a flodl task on local or remote ranks. Flags win over --config TOML, which wins over "
        "defaults; docs/options.md explains every option.",
    )
    groups = {title: parser.add_argument_group(title) for title in HELP_GROUPS}
    launch = groups["launch"]
    launch.add_argument("--config", default=None, help="TOML file of options (keys are the option names). Default: none.")
    launch.add_argument("--log-level", default="WARNING", help="logging level: DEBUG, INFO, WARNING. Default: WARNING.")
    launch.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt the control and bulk planes with ZeroMQ CURVE, keys derived from the run secret "
        "(FLODL_ENCRYPT=1 does the same); external workers need --encrypt too. Default: off.",
    )
    for f in dataclasses.fields(LaunchOptions):
        if f.name == "script_args":  # not a flag: the words after --
            launch.add_argument(f.name, nargs="*", default=argparse.SUPPRESS, help=_HELP[f.name])
            continue
        flag = "--" + f.name.replace("_", "-")
        group = groups[_LAUNCH_GROUP.get(f.name, "launch")]
        help_text = _with_default(_HELP[f.name], f.default).replace("%", "%%")
        if f.type in ("bool | None",):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            kind = _parser_of(f)
            metavar = {int: "N", float: "X"}.get(kind, "PATH" if f.name in ("summary_json", "join_file") else None)
            group.add_argument(flag, dest=f.name, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=help_text)
    add_run_options(parser, groups)
    return parser


def _parser_of(f: dataclasses.Field) -> Any:
    text = str(f.type)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def resolve(args: argparse.Namespace) -> tuple[LaunchOptions, DdpRunConfig]:
    """Flags > TOML > defaults, for both launch and run options.

    Raises:
        ConfigError: a bad value or an unknown TOML key, naming it.
    """
    toml_values = load_toml(args.config) if args.config else {}
    launch: dict[str, Any] = {}
    for name in LAUNCH_KEYS:
        if hasattr(args, name):
            launch[name] = tuple(getattr(args, name)) if name == "script_args" else getattr(args, name)
        elif name in toml_values:
            launch[name] = _coerce(name, toml_values[name])
    if launch.get("script"):  # a script's own --epochs N is the run's, unless flodl's says otherwise
        epochs = scriptspec.one_epochs(launch.get("epochs"), launch.get("script_args", ()))
        if epochs is not None:
            launch["epochs"] = epochs
    options = LaunchOptions(**launch)
    options.validate()
    config = resolve_run_config(args, toml_values, LAUNCH_KEYS, source=args.config or "config.toml")
    return options, config


def _coerce(name: str, value: Any) -> Any:
    if name == "script_args":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(name, f"must be a list of strings, got {value!r}")
        return tuple(value)
    field = {f.name: f for f in dataclasses.fields(LaunchOptions)}[name]
    want = _parser_of(field)
    if "bool" in str(field.type):
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be true or false, got {value!r}")
        return value
    if want is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if want is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if want is str and not isinstance(value, str):
        raise ConfigError(name, f"must be a string, got {value!r}")
    return float(value) if want is float else value
