"""Namespace hosts with sshd, for the multi-host tests: the launcher reaches them over ssh.

The hosts themselves (namespaces on a bridge, link shaping) are ``bench/netns.py``'s, which the
benchmarks use too; here each gets an sshd started as a program of that host (``NsHost.as_machine``),
so everything it starts reports the host's name, and a key to reach it with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.netns import PY, NsHost, make_hosts, must, run, teardown_hosts, unusable_reason

ROOT = Path(__file__).resolve().parent.parent
SSH_OPTIONS = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]


class Unavailable(RuntimeError):
    """Namespace hosts cannot be built here (the message says why)."""


@dataclass(frozen=True)
class Cluster:
    """Namespace hosts with sshd, reachable with ``key``; ``gateway`` is the bridge's address (the controller's)."""

    hosts: list[NsHost]
    key: Path
    gateway: str = ""
    bridge: str = ""

    def hostfile(
        self,
        path: Path,
        *,
        env: dict[str, str],
        per_host_ifname: bool = True,
        ssh_port: int | None = None,
        devices: str = "cpu",
        hosts: int | None = None,
    ) -> Path:
        """A hostfile for the cluster's hosts (``hosts``: only the first that many)."""
        blocks = []
        for h in self.hosts[:hosts]:
            lines = [
                f'host = "{h.addr}"',
                f'devices = "{devices}"',
                f'python = "{PY}"',
                f'workdir = "{ROOT}"',
                'ssh_user = "root"',
                f'identity_file = "{self.key}"',
                f"ssh_options = {json.dumps(SSH_OPTIONS)}",
                "env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }",
            ]
            if per_host_ifname:
                lines.append('gloo_socket_ifname = "eth0"')
            if ssh_port:
                lines.append(f"ssh_port = {ssh_port}")
            blocks.append("[[hosts]]\n" + "\n".join(lines))
        path.write_text("\n\n".join(blocks) + "\n")
        return path


def start_sshd(h: NsHost, tmp: Path) -> subprocess.Popen:
    config = tmp / f"sshd_{h.name}.conf"
    config.write_text(
        "\n".join(
            [
                "Port 22",
                f"ListenAddress {h.addr}",
                f"HostKey {tmp / 'host_key'}",
                f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "StrictModes no",
                "UsePAM no",
                f"PidFile {tmp / ('sshd_' + h.name + '.pid')}",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    must("/usr/sbin/sshd", "-t", "-f", str(config))
    log = open(tmp / f"sshd_{h.name}.log", "w")
    # its own host name and /dev/shm: workers and ranks report this host's name, as on a real cluster,
    # and the same-host lane does not work across "hosts"
    return subprocess.Popen(h.as_machine(f"/usr/sbin/sshd -D -e -f {config}"), stdout=log, stderr=subprocess.STDOUT)


def ssh_ready(h: NsHost, key: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        res = run(
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=2",
            *[arg for o in SSH_OPTIONS for arg in ("-o", o)],
            "-i",
            str(key),
            f"root@{h.addr}",
            "hostname",
            timeout=10,
        )
        if res.returncode == 0 and res.stdout.strip() == h.name:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {h.name} ({h.addr}) not reachable: {res.stderr.strip()}")
        time.sleep(0.2)


def stop_all(sshds: list[subprocess.Popen], hosts: list[NsHost], bridge: str) -> None:
    for p in sshds:
        p.kill()
        p.wait(10)
    teardown_hosts(hosts, bridge)


@contextmanager
def ssh_cluster(tmp: Path, hosts: list[NsHost], bridge: str, gateway: str) -> Iterator[Cluster]:
    """Hosts with sshd on ``bridge``, torn down on exit even on failure.

    Raises:
        Unavailable: before yielding, when they cannot be built (the reason says why).
    """
    reason = unusable_reason()
    if reason:
        raise Unavailable(reason)
    sshds: list[subprocess.Popen] = []
    teardown_hosts(hosts, bridge)  # a previous run killed mid-way may have left them
    try:
        must("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key"))
        must("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "client_key"))
        shutil.copy(tmp / "client_key.pub", tmp / "authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        make_hosts(hosts, bridge, gateway)
        sshds = [start_sshd(h, tmp) for h in hosts]
        for h in hosts:
            ssh_ready(h, tmp / "client_key")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        stop_all(sshds, hosts, bridge)
        raise Unavailable(str(exc)) from None
    try:
        yield Cluster(hosts, tmp / "client_key", gateway, bridge)
    finally:
        stop_all(sshds, hosts, bridge)
