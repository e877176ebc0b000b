"""``python -m flodl.launcher``: start a multi-host run over ssh, stream it, and tear it all down.

Runs the controller here (``python -m flodl.controller --workers N``) and one
``python -m flodl.worker --secret-from-stdin`` per host over ssh. The run
secret reaches the controller in its environment and each worker on its ssh
session's stdin, never on a command line. That stdin stays open for the whole
run: when it closes (this launcher or its ssh session went away) the worker
stops its ranks and exits, which is how a teardown reaches remote hosts
without a tty.

Every child's output is streamed line by line as ``[host] line``
(``[controller] line``). The run ends when the controller exits (its exit code
is the launcher's), on SIGINT/SIGTERM, or when a host fails at start; then
``_teardown`` closes every ssh stdin, SIGTERMs local processes, waits a grace
period and SIGKILLs what is left. Hostfile parsing and ssh command lines live
in ``hostfile.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from .config.cli import BriefParser
from .config.env import child_environ, credentials_env, new_run_id, new_run_secret
from .errors import EXIT_CONFIG, EXIT_LAUNCH_FAILED, ConfigError
from .host.hostfile import (
    DEFAULT_CONNECT_TIMEOUT_S,
    Host,
    check_ssh_option,
    labels,
    load_hostfile,
    parse_host_flag,
    ssh_argv,
    with_defaults,
)
from .host.proc import nap, pdeathsig_preexec

log = logging.getLogger("flodl.launcher")

#: Each teardown step (hosts finishing, SIGTERM, SIGKILL) waits at most this long.
DEFAULT_GRACE_S = 5.0
#: A host whose ssh exits non-zero this soon after launch failed to start: the run is torn down.
#: Later, a lost host is the controller's business (the elastic path), not the launcher's.
DEFAULT_START_WINDOW_S = 30.0
#: How long writing the credentials into an ssh session's stdin may take.
STDIN_WRITE_TIMEOUT_S = 10.0
_POLL_S = 0.2
_LINE_LIMIT = 1 << 20
#: Controller flags the launcher derives itself (from the hosts and its own options).
LAUNCHER_OWNED_FLAGS = ("--workers", "--bind", "--port", "--advertise")


@dataclass(frozen=True)
class LauncherConfig:
    """Everything the launcher needs, resolved and validated; see ``build_parser`` for each."""

    hosts: tuple[Host, ...]
    advertise: str
    bind: str
    port: int
    controller_args: tuple[str, ...]
    encrypt: bool = False
    ssh_options: tuple[str, ...] = ()
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S
    grace_s: float = DEFAULT_GRACE_S
    start_window_s: float = DEFAULT_START_WINDOW_S

    @property
    def controller_address(self) -> str:
        """What the workers dial (an IPv6 advertise address is bracketed)."""
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"tcp://{host}:{self.port}"


@dataclass
class Child:
    """One process the launcher started and owns: the controller, or one host's ssh session."""

    name: str
    proc: asyncio.subprocess.Process
    started_at: float
    reported: bool = False  # its exit was logged / judged
    termed: bool = False  # SIGTERM sent

    @property
    def done(self) -> bool:
        return self.proc.returncode is not None


@dataclass(frozen=True)
class Verdict:
    """Why the run ends; ``code`` overrides the controller's exit code (None: use it)."""

    reason: str
    code: int | None = None


class Launcher:
    """Owns the controller and the ssh sessions from start to teardown."""

    def __init__(self, cfg: LauncherConfig, *, out: TextIO | None = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stdout
        self.controller: Child | None = None
        self.hosts: list[Child] = []
        # the pumps end with their pipes; _drain_pumps awaits (or cancels) every one before run() returns
        self.pumps: list[asyncio.Task] = []
        self._signals: list[str] = []
        self._stopping = False
        self._hurry = False  # a signal during teardown: skip the remaining grace periods
        self._wake = asyncio.Event()
        self._preexec = pdeathsig_preexec()  # children go when the launcher goes, even on SIGKILL

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Start everything, wait for the end, tear down; return the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            verdict = await self._start(new_run_secret(), new_run_id())
            if verdict is None:
                verdict = await self._watch()
            await self._teardown(verdict)
            return self._exit_code(verdict)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self._kill_leftovers()
            await self._drain_pumps()

    async def _start(self, secret: bytes, run_id: str) -> Verdict | None:
        """Controller first, then one ssh session per host; a Verdict if something failed to start."""
        self.controller = await self._spawn("controller", self._controller_argv(), env=self._controller_env(secret, run_id))
        if self.controller is None:
            return Verdict("the controller could not be started", EXIT_LAUNCH_FAILED)
        credentials = f"{secret.hex()} {run_id}\n".encode()
        for label, host in zip(labels(list(self.cfg.hosts)), self.cfg.hosts, strict=False):
            argv = ssh_argv(
                host,
                self.cfg.controller_address,
                extra_options=self.cfg.ssh_options,
                connect_timeout_s=self.cfg.connect_timeout_s,
                encrypt=self.cfg.encrypt,
            )
            child = await self._spawn(label, argv, stdin=asyncio.subprocess.PIPE)
            if child is None:
                return Verdict(f"host {label}: ssh could not be started", EXIT_LAUNCH_FAILED)
            self.hosts.append(child)
            await self._send_credentials(child, credentials)
        log.info("started the controller and %d host(s); run id %s", len(self.hosts), run_id)
        return None

    def _controller_argv(self) -> list[str]:
        cfg = self.cfg
        return [
            sys.executable,
            "-m",
            "flodl.controller",
            "--workers",
            str(len(cfg.hosts)),
            "--bind",
            cfg.bind,
            "--advertise",
            cfg.advertise,
            "--port",
            str(cfg.port),
            *(["--encrypt"] if cfg.encrypt else []),
            *cfg.controller_args,
        ]

    @staticmethod
    def _controller_env(secret: bytes, run_id: str) -> dict[str, str]:
        # the secret goes in the environment (readable only by its owner), never in argv
        return child_environ({**credentials_env(secret, run_id), "PYTHONUNBUFFERED": "1"})

    async def _spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, stdin: int | None = None) -> Child | None:
        """Start one child with its output pumped to ours; None (logged) if it cannot start."""
        try:
            # a new session: a terminal's Ctrl-C reaches only the launcher, which tears down in order
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self._preexec,
                limit=_LINE_LIMIT,
            )
        except OSError as exc:
            log.error("%s: could not start %s: %s", name, argv[0], exc)
            return None
        child = Child(name, proc, time.monotonic())
        self.pumps.append(asyncio.create_task(self._pump(child), name=f"pump-{name}"))
        return child

    async def _send_credentials(self, child: Child, line: bytes) -> None:
        """Write ``SECRET_HEX RUN_ID`` into the ssh session; keep stdin open (its EOF means: stop)."""
        stdin = child.proc.stdin
        assert stdin is not None  # a host's ssh session is spawned with stdin=PIPE
        try:
            stdin.write(line)
            async with asyncio.timeout(STDIN_WRITE_TIMEOUT_S):
                await stdin.drain()
        except (OSError, TimeoutError) as exc:
            # ssh already exited or hangs: the watch loop sees the exit, the teardown the rest
            log.warning("%s: could not hand over the credentials: %s", child.name, exc or type(exc).__name__)

    # ---------------------------------------------------------------- watch

    def _on_signal(self, sig: int) -> None:
        self._signals.append(signal.Signals(sig).name)
        if self._stopping:
            log.warning("%s during teardown: skipping the grace periods", self._signals[-1])
            self._hurry = True
        self._wake.set()

    async def _watch(self) -> Verdict:
        """Wait for the end: a signal, the controller's exit, or a host failing at start."""
        assert self.controller is not None  # _start gave no verdict: the controller started
        while True:
            if self._signals:
                return Verdict(f"received {self._signals[0]}")
            if self.controller.done:
                return Verdict(f"the controller exited with code {self.controller.proc.returncode}")
            for child in self.hosts:
                if child.done and not child.reported:
                    child.reported = True
                    verdict = self._host_exited(child)
                    if verdict is not None:
                        return verdict
            await self._wait(_POLL_S)

    def _host_exited(self, child: Child) -> Verdict | None:
        """A host's ssh ended: fatal only inside the start window and with a failure code."""
        code = child.proc.returncode
        age = time.monotonic() - child.started_at
        if code != 0 and age < self.cfg.start_window_s:
            why = "ssh could not connect or log in" if code == 255 else "the worker failed"
            return Verdict(f"host {child.name} failed at start ({why}, exit code {code})", EXIT_LAUNCH_FAILED)
        log.log(logging.INFO if code == 0 else logging.WARNING, "host %s: worker ended with exit code %d", child.name, code)
        return None

    async def _wait(self, timeout_s: float) -> None:
        await nap(self._wake, timeout_s)

    async def _wait_all(self, children: list[Child], timeout_s: float) -> bool:
        """Until every child has exited, ``timeout_s`` passed, or a signal hurries the teardown."""
        deadline = time.monotonic() + timeout_s
        while any(not c.done for c in children):
            if time.monotonic() > deadline or self._hurry:
                return False
            await self._wait(_POLL_S)
        return True

    # ------------------------------------------------------------- teardown

    async def _teardown(self, verdict: Verdict) -> None:
        """Stop the run through the controller, close every ssh stdin, SIGTERM, grace, SIGKILL.

        The controller goes first: its abort stops every rank between two steps,
        while ranks SIGTERMed one by one may sit in a collective with a peer that
        is already gone until their worker SIGKILLs them. Closing stdin is what
        reaches a host whatever the controller managed. Each wait is ``grace_s``.
        """
        log.info("stopping: %s", verdict.reason)
        self._stopping = True
        everyone = [c for c in (self.controller, *self.hosts) if c is not None]
        grace = self.cfg.grace_s
        if self.controller is not None and not self.controller.done:
            self._signal([self.controller], signal.SIGTERM)  # it tells every worker to stop its ranks
        await self._wait_all(everyone, grace)
        for child in self.hosts:
            self._close_stdin(child)  # a worker still up stops its ranks on EOF; its ssh session then ends
        if await self._wait_all(everyone, grace):
            return
        # still alive: an ssh session to a host we cannot reach, or a stuck controller
        self._signal(everyone, signal.SIGTERM)
        if await self._wait_all(everyone, grace):
            return
        self._signal(everyone, signal.SIGKILL)
        await self._wait_all(everyone, grace)

    def _close_stdin(self, child: Child) -> None:
        stdin = child.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()

    def _signal(self, children: list[Child], sig: int) -> None:
        """Send ``sig`` to each live child, SIGTERM at most once (a second one may skip its clean-up)."""
        for child in children:
            if sig == signal.SIGTERM and child.termed:
                continue
            child.termed = child.termed or sig == signal.SIGTERM
            if not child.done:
                log.info("%s: sending %s to pid %d", child.name, signal.Signals(sig).name, child.proc.pid)
                try:
                    child.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _kill_leftovers(self) -> None:
        """Last resort (an error or cancellation mid-run): SIGKILL anything still running."""
        for child in (self.controller, *self.hosts):
            if child is not None and not child.done:
                try:
                    child.proc.kill()
                except ProcessLookupError:
                    pass

    def _exit_code(self, verdict: Verdict) -> int:
        if verdict.code is not None:
            return verdict.code
        assert self.controller is not None  # a controller that failed to start gave a verdict with a code
        code = self.controller.proc.returncode
        if code is None:
            return EXIT_LAUNCH_FAILED
        return 128 - code if code < 0 else code  # killed by a signal: the shell's 128+N

    # --------------------------------------------------------------- output

    async def _pump(self, child: Child) -> None:
        """Copy one child's output to ours, line by line, as ``[name] line``."""
        stream = child.proc.stdout
        assert stream is not None  # every child is spawned with stdout=PIPE
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # one line over the limit: asyncio dropped it; say so, go on
                self._emit(child.name, f"(a line longer than {_LINE_LIMIT} bytes was dropped)")
                continue
            if not line:
                break
            self._emit(child.name, line.decode(errors="replace").rstrip("\r\n"))
        self._wake.set()

    def _emit(self, name: str, text: str) -> None:
        self.out.write(f"[{name}] {text}\n")
        self.out.flush()

    async def _drain_pumps(self) -> None:
        """Let the pumps print what is left; a pipe some grandchild still holds is cut off."""
        if self.pumps:
            _, pending = await asyncio.wait(self.pumps, timeout=self.cfg.grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


# ------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own options; the controller's come after ``--``."""
    p = BriefParser(
        prog="python -m flodl.launcher",
        usage="python -m flodl.launcher (--hostfile FILE | --host HOST[:DEVICES] ...) --advertise ADDR [options] -- CONTROLLER_OPTIONS",
        description="Run the controller here and one worker per host over ssh; everything after -- goes to "
        "python -m flodl.controller (e.g. -- --task train.py:task --epochs 5).",
    )
    p.add_argument("--hostfile", help="TOML file of [[hosts]] tables (keys: docs/multihost.md)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="HOST[:DEVICES]",
        help="a host to ssh to, e.g. gpu-a or gpu-b:cuda:0,cuda:1 (repeat; after the hostfile's)",
    )
    p.add_argument("--advertise", help="this machine's address as the hosts reach it (required unless --bind is a specific address)")
    p.add_argument("--bind", help="address the controller listens on (default: the --advertise address)")
    p.add_argument("--port", type=int, default=0, help="controller port (default 0: a free one, picked here)")
    p.add_argument("--python", default="python3", help="interpreter on the hosts, where the hostfile does not say")
    p.add_argument("--workdir", default=None, help="directory to cd to on the hosts, where the hostfile does not say (default: this one)")
    p.add_argument("--nccl-socket-ifname", help="NCCL_SOCKET_IFNAME for every host's ranks (a host's nccl_socket_ifname wins)")
    p.add_argument("--gloo-socket-ifname", help="GLOO_SOCKET_IFNAME for every host's ranks (a host's gloo_socket_ifname wins)")
    p.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="ssh -o option for every host, after each host's own (repeat)",
    )
    p.add_argument("--connect-timeout-secs", type=int, default=DEFAULT_CONNECT_TIMEOUT_S, help="ssh ConnectTimeout")
    p.add_argument(
        "--grace-secs", type=float, default=DEFAULT_GRACE_S, help="teardown: seconds for each step (hosts finishing, SIGTERM, SIGKILL)"
    )
    p.add_argument(
        "--start-window-secs",
        type=float,
        default=DEFAULT_START_WINDOW_S,
        help="a host whose ssh fails this soon after launch stops the run",
    )
    p.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt the control and bulk planes (ZeroMQ CURVE, keys derived from the run secret): passed to the controller and every worker",
    )
    p.add_argument("--log-level", default="INFO", help="launcher logging level: DEBUG, INFO, WARNING")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, controller options): split at the first ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def resolve(args: argparse.Namespace, controller_args: list[str]) -> LauncherConfig:
    """Validate the options and gather the hosts.

    Raises:
        ConfigError: naming the option, hostfile line or key at fault.
    """
    hosts = load_hostfile(args.hostfile) if args.hostfile else []
    hosts += [parse_host_flag(text) for text in args.host]
    if not hosts:
        raise ConfigError("--hostfile", "no hosts: give --hostfile FILE or --host HOST[:DEVICES]")
    workdir = args.workdir or os.getcwd()
    hosts = [
        with_defaults(h, python=args.python, workdir=workdir, nccl=args.nccl_socket_ifname, gloo=args.gloo_socket_ifname) for h in hosts
    ]
    advertise = args.advertise or (args.bind if args.bind not in (None, "", "0.0.0.0", "::", "*") else None)
    if not advertise:
        raise ConfigError("--advertise", "needed: the address of this machine that every host can reach")
    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", f"must be a TCP port, got {args.port}")
    if args.grace_secs <= 0 or args.start_window_secs < 0 or args.connect_timeout_secs < 1:
        raise ConfigError("--grace-secs", "grace and timeouts must be positive")
    check_controller_args(controller_args)
    bind = args.bind or advertise
    return LauncherConfig(
        hosts=tuple(hosts),
        advertise=advertise,
        bind=bind,
        port=args.port or pick_port(bind),
        controller_args=tuple(controller_args),
        encrypt=args.encrypt,
        ssh_options=tuple(check_ssh_option(o, "--ssh-option") for o in args.ssh_option),
        connect_timeout_s=args.connect_timeout_secs,
        grace_s=args.grace_secs,
        start_window_s=args.start_window_secs,
    )


def check_controller_args(controller_args: list[str]) -> None:
    """Raises: ConfigError if nothing is to run, or a flag the launcher sets itself is given."""
    if not controller_args:
        raise ConfigError("--", "nothing to run: give the controller's options after --, e.g. -- --task train.py:task --epochs 5")
    for arg in controller_args:
        if arg == "--":  # what follows is a --script's own arguments
            break
        flag = arg.split("=", 1)[0]
        if flag in LAUNCHER_OWNED_FLAGS:
            raise ConfigError(flag, "is set by the launcher (from the hosts, --bind, --port, --advertise); remove it after --")


def pick_port(bind: str) -> int:
    """A free TCP port on ``bind``, chosen here because the hosts must know it before the controller starts.

    Another process could take it between this probe and the controller's bind;
    pass --port to rule that out.

    Raises:
        ConfigError: ``bind`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind, 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise ConfigError("--bind", f"cannot listen on {bind!r}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    own, controller_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    logging.basicConfig(level=args.log_level.upper(), format="[launcher] %(message)s", stream=sys.stderr)
    try:
        cfg = resolve(args, controller_args)
    except ConfigError as exc:
        print(f"flodl.launcher: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    log.info(
        "controller at %s (bind %s); hosts: %s",
        cfg.controller_address,
        cfg.bind,
        ", ".join(f"{h.host}[{h.devices or 'default'}]" for h in cfg.hosts),
    )
    return asyncio.run(Launcher(cfg).run())


if __name__ == "__main__":
    sys.exit(main())
