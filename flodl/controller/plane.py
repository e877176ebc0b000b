"""The controller's sockets: the ROUTER every peer dials, the ranks' TCPStore, and the CPU averaging plane.

``ControlPlane`` opens and closes them and is the one way out for a message:
to one peer, to a few ranks or to many peers, a frame signed once for all.

The TCPStore is torch's, and importing torch costs the controller seconds
on a small machine. With an embedded worker, a process its zygote forks opens
the store (torch is imported there already: ``host/store_server.py``) and the
controller reads its port. Otherwise: ranks need the store only once they are welcomed,
after seconds of importing torch themselves, so on the collective backends
``open`` binds the ROUTER at once and opens the store on a thread while the
worker and its ranks start; the conductor awaits ``store_open`` before the
first ``RankWelcome``. The CPU backend's averaging plane is part of every
``WorkerWelcome`` and of the run's tasks, so there both open at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ..config import AverageBackend
from ..config.env import zygote_enabled
from ..host.store_server import open_store
from ..wire import curve
from ..wire.codec import Envelope
from ..wire.transport import ControlEndpoint, make_router
from .setting import RunSetting

if TYPE_CHECKING:
    from ..averaging.server import CpuAveraging  # torch: imported in open, only when the CPU backend averages

log = logging.getLogger("flodl.controller")

#: Called with every frame the ROUTER accepts (the sender's connection, the verified envelope).
OnMessage = Callable[[bytes, Envelope], None]


class ControlPlane:
    """Binds, sends, closes; knows ranks only to find their connections."""

    def __init__(self, ctx: RunSetting) -> None:
        self.ctx = ctx
        self.endpoint: ControlEndpoint | None = None
        self.port: int | None = None
        self.store: Any = None  # torch.distributed.TCPStore, once open
        self._opening: concurrent.futures.Future | None = None  # the store, opening on a thread
        self.store_file: Path | None = None  # where the embedded worker writes its store's port (store_open)
        self.averaging: CpuAveraging | None = None  # the CPU backend's bulk plane, when used
        self.fd_limit = 0  # the soft limit on open files once open lifted it (0: unknown)

    @property
    def address(self) -> str:
        return f"tcp://{self.ctx.launch.advertise_host}:{self.port}"

    @property
    def live_endpoint(self) -> ControlEndpoint:
        """``endpoint`` on the paths that run only once ``open`` made it (sends, handlers)."""
        assert self.endpoint is not None, "the control plane is not open"
        return self.endpoint

    def open(self, on_message: OnMessage) -> None:
        """Bind the ROUTER; start opening the store (on a thread: ``store_open``), or, on the CPU
        backend, open it and the averaging plane now."""
        ctx: zmq.Context[Any] = zmq.Context.instance()
        if curve.requested():
            curve.enable(self.ctx.secret)
        if not _is_loopback(self.ctx.launch.bind):
            if curve.enabled():
                self.ctx.console.line(
                    f"note: serving on {self.ctx.launch.bind}: frames are authenticated and encrypted (CURVE); "
                    "torch's store and any nccl/gloo collectives are not"
                )
            else:
                # every frame is signed (a keyed BLAKE2b tag with the run secret), but nothing is encrypted
                self.ctx.console.line(
                    f"note: serving on {self.ctx.launch.bind} beyond loopback: frames are authenticated, not encrypted; "
                    "keep the network trusted, tunnel it, or run with --encrypt"
                )
        self.fd_limit = _lift_fd_limit()
        sock, self.port = make_router(ctx, self.ctx.launch.bind, self.ctx.launch.port)
        # a Ping is answered by the endpoint itself, once the reader accepted it: a round trip waits on no dispatch
        self.endpoint = ControlEndpoint(
            sock, secret=self.ctx.secret, run_id=self.ctx.run_id, sender="controller", on_message=on_message, answer_pings=True
        )
        self.endpoint.start()
        if self.ctx.config.elche.mode.backend is not AverageBackend.CPU:
            if self.ctx.launch.embedded and zygote_enabled():
                # the embedded worker's zygote imports torch anyway: a process it forks opens the
                # store (host/store_server.py), and this one never imports torch (about 2 s of CPU)
                self.store_file = Path(tempfile.mkdtemp(prefix="flodl-store-")) / "port"
                log.info("controller listening on tcp://%s:%d (the local worker opens the store)", self.ctx.launch.bind, self.port)
                return
            self._start_store_thread()
            log.info("controller listening on tcp://%s:%d (the store opens meanwhile)", self.ctx.launch.bind, self.port)
            return
        self.store = open_store(self.ctx.launch.bind)
        from ..averaging.server import CpuAveraging  # the averaging plane: torch, shm, bulk; only the CPU backend needs them

        assert self.ctx.deadlines.snapshot_s is not None  # the controller's deadlines come from_config: it is set

        self.averaging = CpuAveraging(
            secret=self.ctx.secret,
            run_id=self.ctx.run_id,
            bind=self.ctx.launch.bind,
            timeout_s=self.ctx.deadlines.snapshot_s,
            clock=self.ctx.clock,
            compressed=self.ctx.config.sync_compression != "none",
        )
        self.averaging.live = lambda: {r.rank for r in self.ctx.members.live_ranks()}
        self.averaging.start()
        log.info("controller listening on tcp://%s:%d (store port %d)", self.ctx.launch.bind, self.port, self.store.port)

    def _start_store_thread(self) -> None:
        self._opening = concurrent.futures.Future()
        threading.Thread(target=self._open_store, name=STORE_THREAD, daemon=True).start()

    def _open_store(self) -> None:
        """The store thread: import torch, open the store, hand it over (or what went wrong).
        A daemon: a run that ends meanwhile does not wait for torch's import."""
        assert self._opening is not None
        try:
            self._opening.set_result(open_store(self.ctx.launch.bind))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting conductor, raised there
            self._opening.set_exception(exc)

    async def store_open(self) -> None:
        """Wait (if need be) for the store: the local worker's (its port file), or the one opening
        on this process's thread (also where the local worker could not open it)."""
        if self.store is not None:
            return
        if self.store_file is not None and self._opening is None:
            port = await self._hosted_store_port(self.store_file, self.ctx.launch.join_timeout_secs)
            if port:
                self.store = HostedStore(port)
                log.info("store open on port %d (in a process of the local worker's)", port)
                return
            log.warning("the local worker did not open the run's store: opening it here")
            self._start_store_thread()
        if self._opening is None:
            return
        self.store = await asyncio.wrap_future(self._opening)
        # torch's objects live as long as the run: out of the collector's full passes, as the rest (core.py)
        gc.freeze()
        log.info("store open on port %d", self.store.port)

    @staticmethod
    async def _hosted_store_port(path: Path, timeout_s: float) -> int:
        """The port the local worker's store wrote to ``path`` (0: it could not open, or said
        nothing within ``timeout_s``: its zygote imports torch first, as its ranks wait for)."""
        try:
            async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                while not path.exists():
                    await asyncio.sleep(HOSTED_STORE_POLL_S)
        except TimeoutError:
            return 0
        try:
            return int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        if self.store_file is not None:
            shutil.rmtree(self.store_file.parent, ignore_errors=True)
        if self.endpoint is not None:
            self.endpoint.close()
        if self.averaging is not None:
            self.averaging.close()
        self.store = None

    # ============================================================ sending

    def send(self, msg: Any, identity: bytes) -> None:
        self.live_endpoint.send(msg, identity)

    def send_rank(self, rank: int, msg: Any) -> None:
        self.live_endpoint.send(msg, self.ctx.members.ranks[rank].identity)

    def send_all(self, msg: Any, identities: Iterable[bytes]) -> None:
        """The same message to many peers, signed once (a Regroup lists every
        member: signing it per rank made each death cost O(world²))."""
        endpoint = self.live_endpoint
        frame = endpoint.writer.encode(msg)
        for identity in identities:
            endpoint.send_frame(frame, identity)

    def send_ranks(self, ranks: list[int], msg: Any) -> None:
        self.send_all(msg, [self.ctx.members.ranks[rank].identity for rank in ranks])

    def broadcast_ranks(self, msg: Any) -> None:
        """To every live rank."""
        self.send_all(msg, [info.identity for info in self.ctx.members.live_ranks()])


STORE_THREAD = "flodl-store"
#: How often the controller looks for the port of the store its local worker opens.
HOSTED_STORE_POLL_S = 0.02


@dataclass(frozen=True)
class HostedStore:
    """The run's store as the embedded worker's store process opened it: only its port is ours."""

    port: int


def store_still_opening() -> bool:
    """Whether a store thread is still importing torch or starting the TCPStore: the process
    must not finalise under it (``flodl.controller.exit_process`` says why)."""
    return any(t.name == STORE_THREAD and t.is_alive() for t in threading.enumerate())


def wait_store_opened(timeout_s: float) -> None:
    """Wait (bounded) for a store thread still opening; for a process that lives on after its run."""
    for thread in threading.enumerate():
        if thread.name == STORE_THREAD:
            thread.join(timeout_s)


def _lift_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit
    in force (0 if unknown). Every rank and worker holds a TCP connection to the controller,
    so the common default of 1024 caps a run at a few hundred ranks: past it, connections
    fail in ZeroMQ's I/O thread (which then spins on accept) and ranks look silent."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):  # e.g. macOS caps the soft limit below an unlimited hard one
            pass
    return soft


def _is_loopback(address: str) -> bool:
    """``127.x``, ``::1`` or ``localhost``: reachable from this host only."""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name or "*": assume it reaches beyond this machine
