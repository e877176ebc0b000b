"""``python -m flodl.worker``: one per host; spawns and supervises the host's ranks.

The worker says hello with the devices it will use, gets a global rank for
each, and spawns one ``python -m flodl.rank`` per device: forked by its zygote
(``host/zygote.py``), which imports torch while the controller answers the
hello, else (``FLODL_ZYGOTE=off``, or a zygote that cannot fork) exec'd. It is the fast path
of failure detection: the moment a rank process ends, the worker reports its
exit status to the controller (milliseconds, not a heartbeat timeout).

It never leaves an orphan: ranks die with their worker (PDEATHSIG; a forked
rank with its zygote, which dies with the worker), SIGTERM
and SIGINT are forwarded to them (SIGTERM, a grace period, SIGKILL), and if
the controller falls silent for the heartbeat timeout the worker stops its
ranks and exits.

On the CPU averaging backend, a worker on another host than the controller
with two ranks or more runs the host relay (``averaging/relay.py``) on its event loop:
its ranks send their snapshots to it, and it sends their weighted average
upstream, one snapshot per round for the whole host.

Started by the ssh launcher (``--secret-from-stdin``), it reads the run's
credentials from the first stdin line and then watches stdin: end-of-file
means the launcher or its ssh session went away, and the worker stops its
ranks and exits, the same as on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import zmq

from . import __version__, probes
from .config.cli import BriefParser
from .config.deadlines import Deadlines
from .config.env import (
    PARENT_PID,
    RankEnv,
    child_environ,
    cpu_pinning,
    local_store_request,
    parent_pid,
    parse_run_secret,
    probes_requested,
    read_run_credentials,
    request_encryption,
    strict,
    zygote_enabled,
    zygote_server,
)
from .config.joinfile import read_join_file
from .errors import EXIT_CONFIG, EXIT_CONTROLLER_LOST, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, ConfigError
from .host.cores import core_plan, format_cores
from .host.devices import choose_devices
from .host.proc import ChildProcess, die_with_parent, nap, terminate_then_kill
from .host.rank_logs import RankLogs
from .host.store_server import write_port
from .host.zygote import Zygote
from .scriptspec import BEFORE_INIT, decode, rank_command, take_report
from .wire import curve
from .wire import messages as m
from .wire.codec import Envelope
from .wire.messages import PROTOCOL_VERSION
from .wire.shm_sweep import sweep_stale
from .wire.transport import HANDLER_ERRORS, ControlEndpoint, host_name, make_dealer

if TYPE_CHECKING:
    from .averaging.relay import HostRelay

log = logging.getLogger("flodl.worker")

HEARTBEAT_INTERVAL_S = 1.0
#: Before the welcome, how long to wait for a controller at all.
DEFAULT_JOIN_TIMEOUT_S = 120.0
#: After an abort, how long ranks get to exit on their own before SIGTERM.
ABORT_GRACE_S = 3.0
#: After a clean Shutdown, how long ranks get to finish and exit on their own.
CLEAN_GRACE_S = 30.0
#: Between SIGTERM and SIGKILL.
KILL_GRACE_S = 3.0
#: After SIGTERM, a rank with save_path writes its replica before exiting: give it time.
SAVE_KILL_GRACE_S = 15.0
#: With --secret-from-stdin, how long to wait for the credentials line.
DEFAULT_SECRET_TIMEOUT_S = 30.0
#: The credentials line is ~80 bytes; anything this long is not one.
_MAX_CREDENTIALS_LINE = 4096


class Worker:
    """Supervises this host's rank processes on behalf of the controller."""

    def __init__(
        self,
        controller: str,
        devices: list[str],
        secret: bytes,
        run_id: str,
        *,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        watch_stdin: bool = False,
    ) -> None:
        self.controller = controller
        self.devices = devices
        self._core_plan: list[list[int]] | None = None  # the host's core layout (host/cores.py), made at the first spawn
        self.local_ranks: dict[int, int] = {}  # global rank -> its place on this host (torchrun's LOCAL_RANK)
        self.secret = secret
        self.run_id = run_id
        self.join_timeout_s = join_timeout_s
        self.watch_stdin = watch_stdin  # stdin EOF = the launcher is gone: stop
        self.sender = f"worker.{host_name()}.{os.getpid()}"
        self.endpoint: ControlEndpoint | None = None
        self.procs: dict[int, ChildProcess] = {}
        # ranks the controller gave up on before their process existed (a Fence that overtook a
        # slow spawn): they are killed the moment they are started, or not started at all
        self.fenced: set[int] = set()
        self.store_proc: ChildProcess | None = None  # the run's store, when this worker hosts it (_host_store)
        self.store_task: asyncio.Task[None] | None = None
        self.zygote: Zygote | None = None  # forks the ranks pre-imported (host/zygote.py); None: exec each
        self.reports: str | None = None  # a folder of ours where script ranks leave a failure before flodl.init()
        self.rank_logs: RankLogs | None = None  # --log-dir: each rank's output also in files (host/rank_logs.py)
        self.welcome: m.WorkerWelcome | None = None
        self.shutdown: m.Shutdown | m.ShutdownWithSave | None = None
        self.reject: m.Reject | None = None
        self.last_heard = time.monotonic()
        self.relay: HostRelay | None = None
        self.relay_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._interrupted = False
        self._tg: asyncio.TaskGroup | None = None  # owns the reapers and respawns once ranks run
        self._relay_addr = ""  # what ranks are told of this host's relay ("" when none)

    # ---------------------------------------------------------------- wire

    def _on_message(self, identity: bytes, env: Envelope) -> None:
        self.last_heard = time.monotonic()
        msg = env.msg
        if isinstance(msg, m.WorkerWelcome) and self.welcome is None:
            self.welcome = msg
        elif isinstance(msg, m.Reject):
            self.reject = msg
        elif isinstance(msg, (m.Shutdown, m.ShutdownWithSave)):
            self.shutdown = msg
        elif isinstance(msg, m.Fence):
            self._fence(msg)
        elif isinstance(msg, m.Respawn) and self._tg is not None and self.shutdown is None:
            self._tg.create_task(self._respawn(msg))
        self._wake.set()

    def _fence(self, msg: m.Fence) -> None:
        """The controller gave this rank up: SIGKILL it (SIGTERM cannot reach a stopped process)."""
        proc = self.procs.get(msg.rank)
        if proc is None:
            self.fenced.add(msg.rank)  # still being spawned (the zygote forks it): killed on arrival
            return
        if proc.returncode is None:
            # after the run's Shutdown the kill is part of the stop, not a death
            log.log(logging.INFO if self.shutdown else logging.WARNING, "%s: killing rank %d: %s", self.sender, msg.rank, msg.reason)
            try:
                proc.kill()
            except ProcessLookupError:
                pass

    def _send(self, msg: Any) -> None:
        assert self.endpoint is not None  # run() makes it before anything sends
        self.endpoint.send(msg)

    @property
    def _welcomed(self) -> m.WorkerWelcome:
        """``welcome`` on the paths that run once it came (the relay, spawning ranks)."""
        assert self.welcome is not None, "no WorkerWelcome yet"
        return self.welcome

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self.endpoint = ControlEndpoint(
            make_dealer(ctx, self.controller),
            secret=self.secret,
            run_id=self.run_id,
            sender=self.sender,
            on_message=self._on_message,
        )
        self.endpoint.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.watch_stdin:
            loop.add_reader(sys.stdin.fileno(), self._on_stdin)
        try:
            async with asyncio.TaskGroup() as tg:
                beat = tg.create_task(self._heartbeats())
                code = await self._supervise(tg)
                beat.cancel()
                if self.store_task is not None:
                    self.store_task.cancel()  # a stop before the zygote answered: nothing waits for its store
                if self.relay_task is not None:
                    self.relay_task.cancel()
            return code
        finally:
            if self.watch_stdin:
                loop.remove_reader(sys.stdin.fileno())
            await terminate_then_kill(list(self.procs.values()), KILL_GRACE_S)
            if self.rank_logs is not None:  # the ranks are gone: their last lines, then the pipes
                await self.rank_logs.close()
            if self.store_proc is not None:  # after the ranks: they may still leave their group through it
                await terminate_then_kill([self.store_proc], KILL_GRACE_S)
            if self.zygote is not None:
                await self.zygote.close(KILL_GRACE_S)
            if self.relay is not None:
                self.relay.close()
            if self.reports is not None:
                shutil.rmtree(self.reports, ignore_errors=True)
            # a controller killed outright on this host left its shared-memory segments (so may a
            # rank): its ranks are gone now, so sweep what no live process owns
            sweep_stale()
            self.endpoint.io.sock.setsockopt(zmq.LINGER, 500)  # let the goodbye frames out
            self.endpoint.close()

    def _on_signal(self, sig: int) -> None:
        log.warning("%s received %s: stopping ranks", self.sender, signal.Signals(sig).name)
        self._interrupted = True
        self._wake.set()

    def _on_stdin(self) -> None:
        """stdin is readable: EOF means the launcher (or its ssh session) went away."""
        try:
            data = os.read(sys.stdin.fileno(), 4096)
        except OSError:
            data = b""
        if data:
            return  # nothing else is sent after the credentials; ignore it
        asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        log.warning("%s: stdin closed (the launcher went away): stopping ranks", self.sender)
        self._interrupted = True
        self._wake.set()

    async def _supervise(self, tg: asyncio.TaskGroup) -> int:
        self._send(
            m.WorkerHello(
                host=host_name(), pid=os.getpid(), devices=self.devices, versions={"flodl": __version__, "protocol": str(PROTOCOL_VERSION)}
            )
        )
        if zygote_enabled():  # it imports torch while the controller answers (a server's has already)
            server = zygote_server()
            if server:
                self.zygote = await Zygote.connect(server, devnull_stdin=self.watch_stdin)
            if self.zygote is None:
                self.zygote = await Zygote.start(devnull_stdin=self.watch_stdin)
        store = local_store_request()
        if store is not None:  # before any rank: the zygote forks in the order asked
            self.store_task = tg.create_task(self._host_store(*store))
        deadline = time.monotonic() + self.join_timeout_s
        while self.welcome is None:
            if self.reject or self.shutdown or self._interrupted:
                return self._finish_early()
            if time.monotonic() > deadline:
                log.error(
                    "no answer from the controller at %s within %.0f s: a controller never answers a worker with "
                    "another run's secret or id (FLODL_RUN_SECRET/FLODL_RUN_ID or --join-file)%s",
                    self.controller,
                    self.join_timeout_s,
                    " (is it running with --encrypt too?)" if curve.enabled() else " (if it runs with --encrypt, so must this worker)",
                )
                return EXIT_CONTROLLER_LOST
            await self._wait(0.5)
        heartbeat_timeout_s = self.welcome.heartbeat_timeout_s  # the run's, from the welcome (the join timeout bounded the wait for it)
        await self._spawn(tg)
        while True:
            if self._interrupted:
                await self._stop_ranks(grace_s=0.0, kill_grace_s=SAVE_KILL_GRACE_S)
                self._send(m.Exiting(rank=-1, reason="interrupted", digest=""))
                return EXIT_INTERRUPTED
            if self.shutdown is not None:
                # a rank saving the bundle on the way out gets the clean grace
                await self._stop_ranks(ABORT_GRACE_S if self.shutdown.abort and isinstance(self.shutdown, m.Shutdown) else CLEAN_GRACE_S)
                self._send(m.Exiting(rank=-1, reason="shutdown", digest=""))
                return EXIT_OK
            silent = time.monotonic() - self.last_heard
            if silent > heartbeat_timeout_s:
                log.error("heard nothing from the controller for %.1f s: stopping ranks", silent)
                # the ranks notice too and save what they hold (with save_path) before exiting
                await self._stop_ranks(grace_s=CLEAN_GRACE_S)
                return EXIT_CONTROLLER_LOST
            await self._wait(0.5)

    def _finish_early(self) -> int:
        """Leave before any rank was spawned (refused, shut down, or interrupted)."""
        if self.reject:
            log.error("the controller refused this worker: %s", self.reject.reason)
            self._send(m.Exiting(rank=-1, reason="refused", digest=""))
            return EXIT_CONFIG
        self._send(m.Exiting(rank=-1, reason="interrupted" if self._interrupted else "shutdown", digest=""))
        return EXIT_INTERRUPTED if self._interrupted else EXIT_OK

    async def _wait(self, timeout_s: float) -> None:
        await nap(self._wake, timeout_s)

    async def _heartbeats(self) -> None:
        while True:
            self._send(m.Heartbeat(step=0, sent_at=time.time(), busy="", busy_s=0.0, step_ms=0.0, averaged=-1))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    # ---------------------------------------------------------------- ranks

    def _start_relay(self, tg: asyncio.TaskGroup) -> str:
        """Start the host relay; returns what the ranks are told of it ("ADDR PROBE NONCE")."""
        from .averaging.relay import HostRelay  # it averages with torch: only a relaying worker pays torch's import

        welcome = self._welcomed
        host = self.controller.rsplit(":", 1)[0]  # tcp://HOST
        self.relay = HostRelay(
            secret=self.secret,
            run_id=self.run_id,
            upstream=f"{host}:{welcome.bulk_port}",
            identity=f"{self.sender}/bulk",
            ranks=list(welcome.ranks),
            timeout_s=Deadlines(heartbeat_timeout_s=welcome.heartbeat_timeout_s).relay_round_s,
        )
        self.relay.start()
        self.relay_task = tg.create_task(self.relay.run())
        log.info("%s relays the snapshots of ranks %s (one upstream per round)", self.sender, welcome.ranks)
        return f"tcp://127.0.0.1:{self.relay.port} {self.relay.probe_path} {self.relay.probe_nonce}"

    async def _spawn(self, tg: asyncio.TaskGroup) -> None:
        welcome = self._welcomed
        self._tg = tg
        self._relay_addr = self._start_relay(tg) if welcome.bulk_relay and welcome.bulk_port else ""
        for local, (rank, device) in enumerate(zip(welcome.ranks, self.devices, strict=False)):
            self.local_ranks[rank] = local
            if self.shutdown is not None or self._interrupted or rank in self.fenced:
                continue  # the run stopped while earlier ranks were forked: this one would only be killed
            await self._start_rank(rank, device)
        log.info("%s spawned ranks %s on %s", self.sender, welcome.ranks, self.devices)

    async def _host_store(self, path: str, bind: str) -> None:
        """The embedded controller's request: the run's store in a process forked from the zygote
        (torch imported there already: the controller need not import it). Without a zygote, or
        when it cannot fork, the file says 0 and the controller opens the store itself."""
        child = None
        if self.zygote is not None:
            argv = [sys.executable, "-m", "flodl.host.store_server", path, bind]
            child = await self.zygote.spawn(argv, child_environ({PARENT_PID: str(self.zygote.pid)}))
        if child is None:
            write_port(path, 0)
            return
        # not awaited here: this task must end for the worker's task group to, and the store
        # serves until the worker stops it on its way out (after the ranks: run's finally)
        self.store_proc = child

    async def _start_rank(self, rank: int, device: str) -> None:
        """Start one rank process (forked by the zygote, else exec'd) and its reaper."""
        welcome = self._welcomed
        env = RankEnv(
            controller=self.controller,
            secret=self.secret,
            run_id=self.run_id,
            rank=rank,
            device=device,
            task=welcome.task,
            local_world=len(self.devices),
            heartbeat_timeout_s=welcome.heartbeat_timeout_s,
            parent_pid=os.getpid(),
            relay_addr=self._relay_addr,
            seed=welcome.seed,
            deterministic=welcome.deterministic,
            cpu_set=self._cores_of(self.local_ranks.get(rank, 0)),
        )
        # python -m flodl.rank, or in script mode the user's script (scriptspec.py)
        report = self._report_path(rank) if decode(welcome.task) is not None else ""
        argv, extra = rank_command(
            welcome.task,
            rank=rank,
            world_size=welcome.world_size,
            local_rank=self.local_ranks.get(rank, 0),
            local_world=len(self.devices),
            report=report,
        )
        proc: ChildProcess | None = None
        await asyncio.sleep(_spawn_delay_s(rank))  # tests only (FLODL_INJECT_FAULT): a slow fork on a loaded host
        if welcome.log_dir and self.rank_logs is None:
            self.rank_logs = RankLogs(welcome.log_dir, self.run_id)
        piped = await self.rank_logs.open(rank) if self.rank_logs is not None else None  # None: the console only
        if self.zygote is not None:  # the rank's parent is the zygote: it dies with it, as the zygote with us
            forked_env = dataclasses.replace(env, parent_pid=self.zygote.pid)
            proc = await self.zygote.spawn(argv, child_environ({**forked_env.to_env(), **extra}), piped.fifos if piped else None)
        if proc is None:
            # with --secret-from-stdin, stdin is the launcher's line: ranks must not hold or read it
            stdin = asyncio.subprocess.DEVNULL if self.watch_stdin else None
            out, err = (piped.keep["stdout"], piped.keep["stderr"]) if piped else (None, None)
            proc = await asyncio.create_subprocess_exec(
                *argv, env=child_environ({**env.to_env(), **extra}), stdin=stdin, stdout=out, stderr=err
            )
        self.procs[rank] = proc
        if rank in self.fenced:  # the Fence came while the zygote forked it
            self._fence(m.Fence(rank=rank, reason="the run stopped before it joined"))
        if self.relay is not None:
            self.relay.admit(f"rank{rank}.{proc.pid}".encode(), rank)  # the rank's bulk identity, as it will connect
        assert self._tg is not None  # _spawn set it; a respawn comes only once it is
        self._tg.create_task(self._reap(rank, proc, report))

    def _cores_of(self, local: int) -> str:
        """The cores the host's ``local``-th rank pins itself to: on a host shared by GPU and CPU ranks
        each GPU rank keeps cores of its own (host/cores.py); "" leaves it unpinned."""
        if self._core_plan is None:
            available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            pin = cpu_pinning()  # benches compare both
            self._core_plan = (core_plan(list(self.devices), available) or []) if pin else []
            if self._core_plan:
                layout = ", ".join(f"{d} on cores {format_cores(c)}" for d, c in zip(self.devices, self._core_plan, strict=True))
                log.info("%s pins its ranks: %s", self.sender, layout)
        if not self._core_plan or not 0 <= local < len(self._core_plan):
            return ""
        return format_cores(self._core_plan[local])

    def _report_path(self, rank: int) -> str:
        """Where script rank ``rank`` leaves a failure before ``flodl.init()`` (scriptspec.py): in a folder of this worker's."""
        if self.reports is None:
            self.reports = tempfile.mkdtemp(prefix="flodl-worker-")
        return os.path.join(self.reports, f"rank{rank}.json")

    async def _respawn(self, msg: m.Respawn) -> None:
        """Healing: once the dead rank's process is surely gone (its device free), wait the
        back-off and start the new rank in its place."""
        old = self.procs.get(msg.replaces)
        if old is not None and old.returncode is None:
            try:
                async with asyncio.timeout(KILL_GRACE_S):
                    await old.wait()
            except TimeoutError:
                old.kill()  # declared dead: it must not hold the device the new rank needs
                await old.wait()
        await asyncio.sleep(max(0.0, msg.delay_s))
        if self.shutdown is not None or self._interrupted:
            return
        log.warning("%s: restarting rank %d as rank %d on %s (attempt %d)", self.sender, msg.replaces, msg.rank, msg.device, msg.attempt)
        self.local_ranks[msg.rank] = self.local_ranks.get(msg.replaces, 0)
        await self._start_rank(msg.rank, msg.device)

    async def _reap(self, rank: int, proc: ChildProcess, report: str) -> None:
        code = await proc.wait()
        if self.rank_logs is not None:
            self.rank_logs.reaped(rank)  # its log ends once what it started is gone too
        # a script that failed before flodl.init() left its error here: said first, so the
        # controller reads the exit that follows as the script's error, not as a lost rank
        failed = take_report(report) if report else None
        if failed is not None:
            self._send(m.RankError(rank=rank, stage=BEFORE_INIT, error=failed[0], detail=failed[1], generation=0))
        # the fast path of failure detection: report before anything else happens
        self._send(m.RankExited(rank=rank, pid=proc.pid, code=code))
        if self.relay is not None:
            self.relay.rank_ended(rank)
        self._wake.set()

    async def _stop_ranks(self, grace_s: float, kill_grace_s: float = 3.0) -> None:
        """Let ranks exit on their own for ``grace_s``, then SIGTERM, then SIGKILL after ``kill_grace_s``."""
        live = [p for p in self.procs.values() if p.returncode is None]
        if live and grace_s > 0:
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.gather(*(p.wait() for p in live))
            except TimeoutError:
                log.warning("ranks still running %.0f s after shutdown: terminating", grace_s)
        await terminate_then_kill(list(self.procs.values()), kill_grace_s)
        await asyncio.sleep(0)  # let the reapers report the last exits


def _spawn_delay_s(rank: int) -> float:
    try:
        return probes.for_rank(rank).spawn_delay_s()
    except ValueError:
        return 0.0  # a malformed plan is the rank's to report, once, with the field named


def build_parser() -> argparse.ArgumentParser:
    p = BriefParser(prog="python -m flodl.worker", description="Run one host's ranks for a flodl controller.")
    p.add_argument("--controller", default=None, help="controller address, tcp://HOST:PORT (required unless --join-file gives it)")
    p.add_argument(
        "--join-file",
        default=None,
        metavar="PATH",
        help="read the run id, secret, controller address and encryption from the join file a controller run with "
        "--join-file PATH wrote (mode 0600); --controller, if given, overrides its address",
    )
    p.add_argument("--nproc", type=int, default=None, help="number of ranks (default: one per visible GPU, else 1 CPU rank)")
    p.add_argument("--devices", default=None, help="explicit comma-separated devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    p.add_argument("--join-timeout-secs", type=float, default=DEFAULT_JOIN_TIMEOUT_S, help="seconds to wait for the controller's welcome")
    p.add_argument(
        "--secret-from-stdin",
        action="store_true",
        help="read 'SECRET_HEX RUN_ID' from the first stdin line instead of FLODL_RUN_SECRET/FLODL_RUN_ID, "
        "then stop the ranks and exit when stdin closes (how python -m flodl.launcher starts workers over ssh)",
    )
    p.add_argument(
        "--secret-timeout-secs",
        type=float,
        default=DEFAULT_SECRET_TIMEOUT_S,
        help="with --secret-from-stdin: seconds to wait for the credentials line",
    )
    p.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt the planes with ZeroMQ CURVE (as a controller run with --encrypt does; FLODL_ENCRYPT=1 too)",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING)")
    return p


def read_stdin_credentials(fd: int, timeout_s: float) -> tuple[bytes, str]:
    """The run secret and id from the first line on ``fd``: ``SECRET_HEX RUN_ID``.

    Reads one byte at a time, unbuffered, so nothing after the newline is
    consumed: the rest of stdin is watched for end-of-file afterwards.

    Raises:
        ConfigError: no full line within ``timeout_s``, EOF first, or a malformed line
            (the message never repeats the line: it holds the secret).
        ValueError: the secret is not hex of at least 16 bytes.
    """
    deadline = time.monotonic() + timeout_s
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ConfigError("secret_from_stdin", f"no 'SECRET_HEX RUN_ID' line on stdin within {timeout_s:g} s")
        byte = os.read(fd, 1)
        if not byte:
            raise ConfigError("secret_from_stdin", "stdin closed before the 'SECRET_HEX RUN_ID' line was complete")
        line += byte
        if len(line) > _MAX_CREDENTIALS_LINE:
            raise ConfigError("secret_from_stdin", "the first stdin line is too long to be 'SECRET_HEX RUN_ID'")
    fields = line.decode("ascii", "replace").split()
    if len(fields) != 2:
        raise ConfigError("secret_from_stdin", f"the first stdin line must be 'SECRET_HEX RUN_ID', got {len(fields)} field(s)")
    return parse_run_secret(fields[0], "the stdin secret"), fields[1]


def _credentials(args: argparse.Namespace) -> tuple[bytes, str]:
    """From a join file, stdin (launcher) or the environment (controller, hand-started worker).
    A join file also fills in ``args.controller`` (unless given) and asks for encryption if the run has it.

    Raises:
        ConfigError, ValueError: missing or malformed credentials, or no controller address.
    """
    if args.join_file and args.secret_from_stdin:
        raise ConfigError("join_file", "give --join-file or --secret-from-stdin, not both")
    if args.join_file:
        info = read_join_file(args.join_file)
        args.controller = args.controller or info.controller
        args.encrypt = args.encrypt or info.encrypt
        return info.secret, info.run_id
    if not args.controller:
        raise ConfigError("controller", "needs --controller tcp://HOST:PORT (or --join-file PATH)")
    if args.secret_from_stdin:
        return read_stdin_credentials(sys.stdin.fileno(), args.secret_timeout_secs)
    secret, run_id = read_run_credentials()
    if secret is None or run_id is None:
        raise ConfigError(
            "FLODL_RUN_SECRET",
            "the worker needs FLODL_RUN_SECRET (hex) and FLODL_RUN_ID in its environment, the same as the controller's, "
            "or --join-file PATH (a controller run with --join-file PATH writes it)",
        )
    return secret, run_id


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if probes_requested():  # tests: a rank's start held back (the ``spawn`` fault point, flodl/probes.py)
        from .testing.probes import install_from_environment

        install_from_environment(pace=False)
    logging.basicConfig(level=args.log_level.upper(), format="[worker] %(levelname)s %(message)s", stream=sys.stderr)
    try:
        secret, run_id = _credentials(args)
        devices = choose_devices(args.nproc, args.devices)
        if args.encrypt or curve.requested():
            request_encryption()  # the ranks inherit it
            curve.enable(secret)
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"flodl.worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    parent = parent_pid()
    if parent:
        die_with_parent(parent)  # embedded in a controller: go when it goes
    worker = Worker(args.controller, devices, secret, run_id, join_timeout_s=args.join_timeout_secs, watch_stdin=args.secret_from_stdin)
    return _checked_exit(_run_loop(worker.run()))


def _checked_exit(code: int) -> int:
    """A message handler that raised in this process (a flodl bug, survived) is said at exit;
    under ``FLODL_STRICT`` (the test suite) it turns a clean exit into a failed one."""
    if HANDLER_ERRORS.count:
        log.error(
            "%d message handler error(s) in this worker: a flodl bug (tracebacks above); the first: %s",
            HANDLER_ERRORS.count,
            HANDLER_ERRORS.first[0],
        )
        if strict() and code == EXIT_OK:
            return EXIT_FAILED
    return code


def _run_loop(coro: Any) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
