"""The hosts of a multi-host run: the TOML hostfile, ``--host`` flags, and each host's ssh command.

Pure: parses, validates and builds argv lists; never starts a process
(``launcher.py`` does). A ``Host`` is one worker: where to ssh, which
devices, which interpreter and directory, which extra environment. Nothing
here sees the run secret: the launcher writes it on the ssh session's stdin,
never into the command built here (``ps`` shows command lines to every user).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.env import RUN_ID, RUN_SECRET
from ..errors import ConfigError

#: ssh gives up connecting after this many seconds (overridable with ssh_options ConnectTimeout=N).
DEFAULT_CONNECT_TIMEOUT_S = 10
#: ssh options the launcher depends on: BatchMode (a password prompt would hang the run) and
#: RequestTTY (a tty would echo the secret and hide stdin's end-of-file from the worker).
RESERVED_SSH_OPTIONS = frozenset({"batchmode", "requesttty"})
#: Credentials travel on stdin, never as environment on a remote command line.
RESERVED_ENV = frozenset({RUN_SECRET, RUN_ID})

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SSH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*=\S.*$")
_STR_KEYS = ("host", "devices", "python", "workdir", "ssh_user", "identity_file", "nccl_socket_ifname", "gloo_socket_ifname")
HOST_KEYS = frozenset({*_STR_KEYS, "env", "ssh_port", "ssh_options"})


@dataclass(frozen=True)
class Host:
    """One worker host: how to reach it over ssh and how to start its worker there."""

    host: str
    devices: str | None = None  # None: the worker's default (one rank per GPU, else one CPU rank)
    python: str | None = None  # None: --python, else python3
    workdir: str | None = None  # None: the launcher's working directory
    env: dict[str, str] = field(default_factory=dict)
    ssh_user: str | None = None
    ssh_port: int | None = None
    identity_file: str | None = None
    ssh_options: tuple[str, ...] = ()
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None


# ------------------------------------------------------------------ parsing


def load_hostfile(path: str | Path) -> list[Host]:
    """The ``[[hosts]]`` tables of a TOML hostfile, validated.

    Raises:
        ConfigError: unreadable or invalid TOML, an unknown or mistyped key; the message
            names the file, the ``[[hosts]]`` table's line, and the key.
    """
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(str(path), str(exc)) from None
    extra = sorted(set(data) - {"hosts"})
    if extra:
        raise ConfigError(str(path), f"unknown top-level key(s) {extra}; hosts are [[hosts]] tables")
    tables = data.get("hosts")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(str(path), "needs at least one [[hosts]] table with a 'host' key")
    lines = _table_lines(text)
    return [_host_from_table(t, f"{path} line {lines[i] if i < len(lines) else '?'} (hosts[{i}])") for i, t in enumerate(tables)]


def _table_lines(text: str) -> list[int]:
    """1-based line of each ``[[hosts]]`` header, to name it in errors (tomllib gives no positions)."""
    return [n for n, line in enumerate(text.splitlines(), 1) if line.strip().replace(" ", "").startswith("[[hosts]]")]


def _host_from_table(table: Any, where: str) -> Host:
    """One ``[[hosts]]`` table as a ``Host``. Raises: ConfigError naming ``where`` and the key."""
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table")
    unknown = sorted(set(table) - HOST_KEYS)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; valid keys are {sorted(HOST_KEYS)}")
    if "host" not in table:
        raise ConfigError(f"{where}.host", "missing: the ssh target or address of this host")
    values: dict[str, Any] = {k: _string(table[k], f"{where}.{k}") for k in _STR_KEYS if k in table}
    if "ssh_port" in table:
        values["ssh_port"] = _port(table["ssh_port"], f"{where}.ssh_port")
    if "env" in table:
        values["env"] = _env(table["env"], f"{where}.env")
    if "ssh_options" in table:
        values["ssh_options"] = _ssh_options(table["ssh_options"], f"{where}.ssh_options")
    return Host(**values)


def parse_host_flag(text: str) -> Host:
    """``--host HOST[:DEVICES]``, e.g. ``gpu-a`` or ``root@10.0.0.2:cuda:0,cuda:1``.

    The first ``:`` splits host from devices (use the hostfile for IPv6 literals).

    Raises:
        ConfigError: an empty host or device list.
    """
    host, sep, devices = text.partition(":")
    if not host.strip() or (sep and not devices.strip()):
        raise ConfigError("--host", f"expected HOST or HOST:DEVICES (e.g. gpu-a:cuda:0,cuda:1), got {text!r}")
    return Host(host=host.strip(), devices=devices.strip() or None)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(where, f"must be a non-empty string, got {value!r}")
    return value


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(where, f"must be a TCP port 1-65535, got {value!r}")
    return value


def _env(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(where, f'must be a table of NAME = "value", got {value!r}')
    for name, v in value.items():
        if not _ENV_NAME.match(name):
            raise ConfigError(f"{where}.{name}", "is not a valid environment variable name")
        if name in RESERVED_ENV:
            raise ConfigError(f"{where}.{name}", "the run's credentials are generated by the launcher and sent on stdin; remove it")
        if not isinstance(v, str):
            raise ConfigError(f"{where}.{name}", f"must be a string (quote it), got {v!r}")
    return dict(value)


def _ssh_options(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(where, f'must be a list of "Key=Value" strings, got {value!r}')
    return tuple(check_ssh_option(v, where) for v in value)


def check_ssh_option(value: Any, where: str) -> str:
    """One ``Key=Value`` ssh option. Raises: ConfigError on a bad form or a launcher-owned key."""
    if not isinstance(value, str) or not _SSH_OPTION.match(value):
        raise ConfigError(where, f'each option must be "Key=Value" (as for ssh -o), got {value!r}')
    if value.partition("=")[0].lower() in RESERVED_SSH_OPTIONS:
        raise ConfigError(where, f"{value!r}: BatchMode and RequestTTY are set by the launcher and cannot be changed")
    return value


def with_defaults(host: Host, *, python: str, workdir: str, nccl: str | None, gloo: str | None) -> Host:
    """``host`` with the launcher-wide values filled in where the hostfile left a key out."""
    return dataclasses.replace(
        host,
        python=host.python or python,
        workdir=host.workdir or workdir,
        nccl_socket_ifname=host.nccl_socket_ifname or nccl,
        gloo_socket_ifname=host.gloo_socket_ifname or gloo,
    )


# ---------------------------------------------------------------- commands


def worker_environment(host: Host) -> dict[str, str]:
    """The non-secret environment of the host's worker (its ranks inherit it)."""
    env = {"PYTHONUNBUFFERED": "1"}  # lines reach the launcher as they are printed
    if host.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = host.nccl_socket_ifname
    if host.gloo_socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = host.gloo_socket_ifname
    return {**env, **host.env}


def remote_command(host: Host, controller: str, *, encrypt: bool = False) -> str:
    """The shell command ssh runs on the host: cd, then exec the worker reading its secret from stdin."""
    argv = [
        "env",
        *(f"{k}={v}" for k, v in worker_environment(host).items()),
        host.python or "python3",
        "-m",
        "flodl.worker",
        "--controller",
        controller,
        "--secret-from-stdin",
    ]
    if encrypt:
        argv.append("--encrypt")
    if host.devices:
        argv += ["--devices", host.devices]
    return f"cd {shlex.quote(host.workdir or '.')} && exec {shlex.join(argv)}"


def ssh_argv(
    host: Host,
    controller: str,
    *,
    extra_options: tuple[str, ...] = (),
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S,
    encrypt: bool = False,
) -> list[str]:
    """The full ssh command line for one host (no secret in it).

    ssh keeps the *first* value it is given for an option, so the order is:
    the launcher's own options (not overridable), the host's ``ssh_options``,
    the launcher-wide ``extra_options``, then the launcher's defaults.
    """
    argv = ["ssh", "-T", "-o", "BatchMode=yes"]
    for option in (*host.ssh_options, *extra_options, f"ConnectTimeout={connect_timeout_s}"):
        argv += ["-o", option]
    if host.ssh_port:
        argv += ["-p", str(host.ssh_port)]
    if host.identity_file:
        argv += ["-i", host.identity_file]
    if host.ssh_user:
        argv += ["-l", host.ssh_user]
    # "--" ends ssh's options: a host named "-oProxyCommand=..." stays a host name
    return [*argv, "--", host.host, remote_command(host, controller, encrypt=encrypt)]


def labels(hosts: list[Host]) -> list[str]:
    """The output prefix of each host: its name, with ``#i`` where a name repeats."""
    names = [h.host for h in hosts]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
