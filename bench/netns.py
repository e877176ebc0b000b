"""Fake hosts made of Linux network namespaces, for ``bench/network.py`` and the multi-host tests.

A host is a network namespace with its own address, joined to a bridge in the
root namespace by a veth pair (``eth0`` inside, ``NsHost.veth`` outside).
``NsHost.as_machine`` runs a command there as on a machine of its own: its own
host name (a UTS namespace) and its own ``/dev/shm`` (a mount namespace), so no
same-host shortcut sees through the fake network; the tests' sshd
(tests/netns.py) and the bench's workers both start that way. The namespaces
share the filesystem, so every host runs this interpreter from this checkout.
Everything here needs root and iproute2; nothing imports pytest or flodl, and
the tests import it from here.

``Shaper`` adds delay, jitter, loss and a bandwidth cap to the hosts' links,
like ``tc netem``, and undoes it on exit (errors and Ctrl-C included). It uses
``tc netem`` when the kernel has it. Kernels built without ``CONFIG_NET_SCH_NETEM`` (small VM
kernels, e.g. Firecracker's) get the same effect from a userspace relay: each
host's outer veth end is moved into a relay namespace, and a process there
copies every frame between it and a second veth pair whose other end sits in
the bridge, holding each frame for its delay (plus a uniform jitter, order
kept) or dropping it with the loss probability. The relay reads and writes
with ``PACKET_VNET_HDR``, so the kernel's segmentation and checksum offloads
pass through untouched (a TSO super-frame is delayed, or lost, as one). The
bandwidth cap there is the kernel's token bucket (``tc tbf``, which such
kernels keep): on the host's ``eth0`` for what it sends, ahead of the relay,
and on the bridge's end of the relay pair for what it receives, so a frame
waits its turn on the wire first, then travels its delay, as on a real link.

``link_probe`` measures what a link does (a TCP round trip, a bulk transfer's
rate) with a small client and server run in two hosts' namespaces.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PY = sys.executable
#: Each host's own ``/dev/shm``: enough for a few ranks' segments of a small model.
SHM_SIZE = "512m"


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@dataclass(frozen=True)
class NsHost:
    """One fake host: a network namespace with an address, a hostname and (optionally) an sshd."""

    name: str  # namespace name and hostname
    addr: str
    veth: str  # the root-namespace end of its link: set it down to cut the host off

    def netns_exec(self) -> list[str]:
        """The command prefix that runs a program in this host's network namespace (and nothing more)."""
        return ["ip", "netns", "exec", self.name]

    def as_machine(self, command: str) -> list[str]:
        """The argv that runs the shell ``command`` as a program of this host would run: in its network
        namespace, under its host name, with a ``/dev/shm`` of its own (separate machines share no memory)."""
        own = f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && hostname {self.name}"
        return [*self.netns_exec(), "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", f"{own} && exec {command}"]

    def pids(self) -> list[int]:
        res = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=10)
        return [int(p) for p in res.stdout.split()]

    def flodl_procs(self) -> list[str]:
        """Command lines of flodl workers and ranks running in this namespace."""
        found = []
        for pid in self.pids():
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and ("flodl.worker" in cmdline(p) or "flodl.rank" in cmdline(p)):
                    found.append(f"{pid}: {cmdline(p)}")
            except psutil.Error:
                pass
        return found


# ------------------------------------------------------------ plumbing


def run(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def must(*argv: str) -> None:
    res = run(*argv)
    if res.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip() or res.returncode}")


def unusable_reason(*, sshd: bool = True) -> str | None:
    """Why namespace hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    tools = ("ip", "unshare", "hostname") + (("ssh", "ssh-keygen") if sshd else ())
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if sshd and not os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd not found (apt-get install -y openssh-server)"
    return None


def relay_namespace(bridge: str) -> str:
    """The namespace ``Shaper``'s userspace relay runs in, for hosts on ``bridge``."""
    return f"{bridge}-relay"


def _relay_ends(h: NsHost) -> tuple[str, str]:
    """(relay end, bridge end) of the extra veth pair the userspace relay uses for ``h``."""
    return f"{h.veth}r", f"{h.veth}b"


def remove_host(h: NsHost) -> None:
    """Kill everything in ``h``'s namespace and delete it with its link; safe on a half-built or missing host."""
    if run("ip", "netns", "pids", h.name).returncode == 0:
        for pid in h.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # the pair goes with the namespace, but only once the kernel's async netns clean-up runs: delete it now
    run("ip", "link", "del", h.veth)
    run("ip", "link", "del", _relay_ends(h)[1])  # a relay pair a killed Shaper left behind
    run("ip", "netns", "del", h.name)


def teardown_hosts(hosts: list[NsHost], bridge: str) -> None:
    """Kill everything in each namespace, delete them and the bridge; safe to call on a half-built set-up."""
    for h in hosts:
        remove_host(h)
    relay = relay_namespace(bridge)
    if run("ip", "netns", "pids", relay).returncode == 0:
        for pid in run("ip", "netns", "pids", relay).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run("ip", "netns", "del", relay)
    run("ip", "link", "del", bridge)


def make_hosts(hosts: list[NsHost], bridge: str, gateway: str | None) -> None:
    """The bridge (with ``gateway`` as its address, if given) and one namespace per host on it."""
    must("ip", "link", "add", bridge, "type", "bridge")
    if gateway:
        must("ip", "addr", "add", f"{gateway}/24", "dev", bridge)
    must("ip", "link", "set", bridge, "up")
    for h in hosts:
        add_host(h, bridge)


def add_host(h: NsHost, bridge: str) -> None:
    """A namespace for ``h`` with its address on ``eth0``, linked into ``bridge`` (which must exist).

    Whatever a killed earlier run left under ``h``'s names goes first: CI machines are reused.
    """
    remove_host(h)
    must("ip", "netns", "add", h.name)
    must("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
    must("ip", "link", "set", h.veth, "master", bridge, "up")
    must("ip", "-n", h.name, "addr", "add", f"{h.addr}/24", "dev", "eth0")
    must("ip", "-n", h.name, "link", "set", "eth0", "up")
    must("ip", "-n", h.name, "link", "set", "lo", "up")


# ------------------------------------------------------------ link shaping


#: how long a frame may wait in a rate-capped link's queue before it is dropped (``tc tbf latency``): about
#: a WAN router's buffer; a host's own TCP seldom fills it (TCP small queues hold a socket back first)
TBF_QUEUE_MS = 100
#: the token bucket's depth: at least this many bytes (several full frames), else a millisecond at the rate
TBF_MIN_BURST = 16 * 1024


@dataclass(frozen=True)
class Netem:
    """What a link does to each frame in one direction, as ``tc netem delay D J loss L% rate R``
    (``rate_mbit`` 0: no cap)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss_pct", "rate_mbit"):
            if getattr(self, name) < 0:
                raise ValueError(f"Netem.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def idle(self) -> bool:
        return not (self.delay_ms or self.jitter_ms or self.loss_pct or self.rate_mbit)

    def tc_args(self) -> list[str]:
        args = ["delay", f"{self.delay_ms:g}ms"] if self.delay_ms or self.jitter_ms or not self.rate_mbit else []
        args += [f"{self.jitter_ms:g}ms"] if self.jitter_ms else []
        args += ["loss", f"{self.loss_pct:g}%"] if self.loss_pct else []
        return args + (["rate", f"{self.rate_mbit:g}mbit"] if self.rate_mbit else [])

    def tbf_args(self) -> list[str]:
        """``tc qdisc ... tbf`` arguments for the rate cap (the relay backend's; ``rate_mbit`` must be set)."""
        burst = max(TBF_MIN_BURST, int(self.rate_mbit * 1e6 / 8 / 1000))  # a millisecond's bytes at the rate
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", f"{TBF_QUEUE_MS}ms"]

    def spec(self) -> str:
        """The relay's part of it (delay, jitter, loss: the rate cap is not the relay's)."""
        return f"{self.delay_ms:g},{self.jitter_ms:g},{self.loss_pct:g}"

    @classmethod
    def parse(cls, text: str) -> Netem:
        d, j, loss = (float(x) for x in text.split(","))
        return cls(d, j, loss)

    def __str__(self) -> str:
        return "none" if self.idle else " ".join(self.tc_args())


_netem_probe: bool | None = None


def netem_in_kernel() -> bool:
    """Whether ``tc qdisc ... netem`` works here (probed once, in a scratch namespace)."""
    global _netem_probe
    if _netem_probe is None:
        ns = f"flodl-netem-probe-{os.getpid()}"
        try:
            must("ip", "netns", "add", ns)
            res = run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
            _netem_probe = res.returncode == 0
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            _netem_probe = False
        finally:
            run("ip", "netns", "del", ns)
    return _netem_probe


class Shaper:
    """Shape every host link of ``hosts`` (on ``bridge``) while in the ``with`` block.

    ``egress`` applies to what a host sends, ``ingress`` to what it receives
    (None or an idle ``Netem``: untouched). ``backend`` is ``"tc"``,
    ``"relay"`` or ``"auto"`` (tc netem when the kernel has it). Everything is
    undone on exit, whatever ended the block; ``teardown_hosts`` also clears
    what a killed process left.
    """

    def __init__(
        self,
        hosts: list[NsHost],
        bridge: str,
        *,
        egress: Netem | None = None,
        ingress: Netem | None = None,
        backend: str = "auto",
        seed: int = 0,
    ) -> None:
        self.hosts = hosts
        self.bridge = bridge
        self.egress = egress or Netem()
        self.ingress = ingress or Netem()
        if backend == "auto":
            backend = "tc" if netem_in_kernel() else "relay"
        if backend not in ("tc", "relay"):
            raise ValueError(f"backend must be tc, relay or auto, got {backend!r}")
        self.backend = backend
        self.seed = seed
        self.relay: subprocess.Popen | None = None
        self._moved: list[NsHost] = []

    def __str__(self) -> str:
        how = (
            "tc netem"
            if self.backend == "tc"
            else "userspace relay" + (", tc tbf" if self.egress.rate_mbit or self.ingress.rate_mbit else "")
        )
        return f"egress {self.egress}, ingress {self.ingress} ({how})"

    def __enter__(self) -> Shaper:
        try:
            self._apply()
        except BaseException:
            self._undo()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._undo()

    def _apply(self) -> None:
        if self.backend == "tc":
            for h in self.hosts:
                if not self.egress.idle:
                    must("tc", "-n", h.name, "qdisc", "replace", "dev", "eth0", "root", "netem", *self.egress.tc_args())
                if not self.ingress.idle:
                    must("tc", "qdisc", "replace", "dev", h.veth, "root", "netem", *self.ingress.tc_args())
            return
        for h in self.hosts:  # rate caps in the kernel: the host's sends queue before the relay delays them
            if self.egress.rate_mbit:
                must("tc", "-n", h.name, "qdisc", "replace", "dev", "eth0", "root", *self.egress.tbf_args())
        ns = relay_namespace(self.bridge)
        must("ip", "netns", "add", ns)
        for key in ("all", "default"):  # no addresses, no chatter of its own: the relay namespace only carries frames
            run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
        links = []
        for h in self.hosts:
            r, b = _relay_ends(h)
            must("ip", "link", "add", b, "type", "veth", "peer", "name", r, "netns", ns)
            must("ip", "link", "set", h.veth, "netns", ns)  # leaves the bridge; the host now reaches it through the relay
            self._moved.append(h)
            must("ip", "-n", ns, "link", "set", h.veth, "up")
            must("ip", "-n", ns, "link", "set", r, "up")
            must("ip", "link", "set", b, "master", self.bridge, "up")
            if self.ingress.rate_mbit:  # what the bridge sends the host queues here, before the relay delays it
                must("tc", "qdisc", "replace", "dev", b, "root", *self.ingress.tbf_args())
            links += ["--link", f"{h.veth}:{r}:{self.egress.spec()}:{self.ingress.spec()}"]
        self.relay = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                PY,
                str(Path(__file__).resolve()),
                "relay",
                "--seed",
                str(self.seed),
                "--parent",
                str(os.getpid()),
                *links,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.relay.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the link relay did not start: {line}{self.relay.stderr.read() if self.relay.poll() is not None else ''}")

    def _undo(self) -> None:
        if self.backend == "tc":
            for h in self.hosts:
                run("tc", "-n", h.name, "qdisc", "del", "dev", "eth0", "root")
                run("tc", "qdisc", "del", "dev", h.veth, "root")
            return
        for h in self.hosts:
            if self.egress.rate_mbit:
                run("tc", "-n", h.name, "qdisc", "del", "dev", "eth0", "root")
        if self.relay is not None:
            if self.relay.poll() is None:
                self.relay.terminate()
                try:
                    self.relay.wait(5)
                except subprocess.TimeoutExpired:
                    self.relay.kill()
                    self.relay.wait(5)
            self.relay = None
        ns = relay_namespace(self.bridge)
        for h in self._moved:
            run("ip", "-n", ns, "link", "set", h.veth, "netns", str(os.getpid()))
            run("ip", "link", "set", h.veth, "master", self.bridge, "up")
        self._moved = []
        for h in self.hosts:
            run("ip", "link", "del", _relay_ends(h)[1])
        run("ip", "netns", "del", ns)


# --------------------------------------------------- the userspace relay

_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_PACKET_IGNORE_OUTGOING = 23
_ETH_P_ALL = 0x0003
_MAX_FRAME = 1 << 18  # a TSO super-frame plus the virtio header


def _packet_socket(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)  # offload metadata in and out: frames pass unchanged
    s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)  # not our own sends
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def relay_main(argv: list[str]) -> int:
    """``python bench/netns.py relay --link HOSTIF:NETIF:EGRESS:INGRESS ...``: the userspace netem.

    Frames read on HOSTIF (sent by the host) go out on NETIF after EGRESS
    (``delay,jitter,loss``); frames read on NETIF go out on HOSTIF after
    INGRESS. Runs until SIGTERM or until the process ``--parent`` is gone.
    """
    p = argparse.ArgumentParser(prog="bench/netns.py relay")
    p.add_argument("--link", action="append", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parent", type=int, default=0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner undoes the shaping on Ctrl-C, then stops us
    rng = random.Random(args.seed)
    routes: dict[socket.socket, tuple[socket.socket, Netem]] = {}
    for spec in args.link:
        host_if, net_if, egress, ingress = spec.split(":")
        a, b = _packet_socket(host_if), _packet_socket(net_if)
        routes[a] = (b, Netem.parse(egress))
        routes[b] = (a, Netem.parse(ingress))
    last_due = dict.fromkeys(routes, 0.0)  # per direction: jitter never reorders frames
    heap: list[tuple[float, int, socket.socket, bytes]] = []
    order = 0
    print("ready", flush=True)
    readers = list(routes)
    while True:
        wait = 0.5 if not heap else min(0.5, max(0.0, heap[0][0] - time.monotonic()))
        ready, _, _ = select.select(readers, [], [], wait)
        now = time.monotonic()
        for s in ready:
            out, nm = routes[s]
            for _ in range(512):
                try:
                    frame = s.recv(_MAX_FRAME)
                except BlockingIOError:
                    break
                if nm.loss_pct and rng.random() * 100.0 < nm.loss_pct:
                    continue
                delay = nm.delay_ms + (rng.uniform(-nm.jitter_ms, nm.jitter_ms) if nm.jitter_ms else 0.0)
                due = max(now + max(0.0, delay) / 1000.0, last_due[s])
                last_due[s] = due
                if due <= now and not heap:
                    _send(out, frame)
                else:
                    order += 1
                    heapq.heappush(heap, (due, order, out, frame))
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, out, frame = heapq.heappop(heap)
            _send(out, frame)
        if args.parent and not psutil.pid_exists(args.parent):
            return 0


def _send(out: socket.socket, frame: bytes) -> None:
    try:
        out.send(frame)
    except OSError:  # the link went down (a test cut it), or a full queue: the frame is lost, as on a wire
        pass


# ------------------------------------------------------- measuring a link

PROBE_PORT = 29999
PROBE_PINGS = 5


@dataclass(frozen=True)
class LinkProbe:
    """What ``link_probe`` measured: the fastest TCP round trip of a byte, and a bulk transfer's rate."""

    rtt_ms: float
    mbit: float

    def __str__(self) -> str:
        return f"round trip {self.rtt_ms:.1f} ms, {self.mbit:.1f} Mbit/s"


def link_probe(src: NsHost, dst: NsHost, nbytes: int = 4 << 20, *, timeout: float = 60) -> LinkProbe:
    """Measure the path ``src`` -> ``dst``: ``PROBE_PINGS`` one-byte TCP round trips (the fastest kept), then
    ``nbytes`` sent in bulk, its rate timed by the receiver from the first quarter on (TCP's slow start
    left out), so a capped link reads its cap."""
    server = subprocess.Popen(
        [*dst.netns_exec(), PY, str(Path(__file__).resolve()), "probe-server", dst.addr, str(PROBE_PORT), str(nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stderr is not None
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the probe server did not start: {server.stderr.read() if server.poll() is not None else ''}")
        client = run(
            *src.netns_exec(), PY, str(Path(__file__).resolve()), "probe-client", dst.addr, str(PROBE_PORT), str(nbytes), timeout=timeout
        )
        if client.returncode:
            raise RuntimeError(f"the probe client failed: {client.stderr.strip()}")
        out, err = server.communicate(timeout=timeout)
        if server.returncode:
            raise RuntimeError(f"the probe server failed: {err.strip()}")
        return LinkProbe(rtt_ms=float(client.stdout.split()[0]), mbit=float(out.split()[0]))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)


def probe_server(addr: str, port: int, nbytes: int) -> int:
    """Echo ``PROBE_PINGS`` bytes, then read ``nbytes`` and print their rate (Mbit/s) past the first quarter."""
    with socket.create_server((addr, port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(PROBE_PINGS):
                conn.sendall(conn.recv(1))
            got, mark, t0 = 0, nbytes // 4, 0.0
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    raise SystemExit(f"probe: the sender stopped at {got} of {nbytes} bytes")
                got += len(chunk)
                if not t0 and got >= mark:
                    t0, mark = time.perf_counter(), got
            took = time.perf_counter() - t0
            conn.sendall(b"k")
    print(f"{(got - mark) * 8 / 1e6 / max(took, 1e-9):.3f}", flush=True)
    return 0


def probe_client(addr: str, port: int, nbytes: int) -> int:
    """The other end of ``probe_server``: prints the fastest round trip (ms)."""
    with socket.create_connection((addr, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        best = float("inf")
        for _ in range(PROBE_PINGS):
            start = time.perf_counter()
            conn.sendall(b"p")
            if conn.recv(1) != b"p":
                raise SystemExit("probe: the echo went wrong")
            best = min(best, (time.perf_counter() - start) * 1000)
        conn.sendall(bytes(nbytes))
        conn.recv(1)  # the receiver has it all
    print(f"{best:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        sys.exit(relay_main(sys.argv[2:]))
    if sys.argv[1:2] in (["probe-server"], ["probe-client"]) and len(sys.argv) == 5:
        probe = probe_server if sys.argv[1] == "probe-server" else probe_client
        sys.exit(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    sys.exit("usage: bench/netns.py relay --link HOSTIF:NETIF:EGRESS:INGRESS ... | probe-server|probe-client ADDR PORT BYTES")
