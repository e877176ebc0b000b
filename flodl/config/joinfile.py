"""The join file: what a worker started by hand needs to join a running controller.

A controller run with ``--join-file PATH`` writes the run id, the run secret,
its control address and whether the planes are encrypted to ``PATH`` (JSON,
mode 0600, written atomically) once it listens, and removes it when the run
ends; ``python -m flodl.worker --join-file PATH`` reads it. It is the one place
the secret is written down, so it is created readable by its owner only and a
reader refuses a file that others could read (as ssh refuses a private key).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .env import parse_run_secret

_MAX_BYTES = 4096  # a join file is ~200 bytes: anything larger is not one


@dataclass(frozen=True)
class JoinInfo:
    """One run's credentials and address, as a join file holds them."""

    run_id: str
    secret: bytes
    controller: str  # tcp://HOST:PORT
    encrypt: bool = False

    def write(self, path: str) -> None:
        """Create (or replace) ``path`` with mode 0600: a temporary file made 0600 from its first
        byte, then renamed over the target, so no reader ever sees a partial or wider-open file."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        body = {"run_id": self.run_id, "secret": self.secret.hex(), "controller": self.controller, "encrypt": self.encrypt}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask can only narrow it, but a stale tmp file may be wider
            os.write(fd, (json.dumps(body) + "\n").encode())
        finally:
            os.close(fd)
        tmp.replace(target)


def read_join_file(path: str) -> JoinInfo:
    """The join file at ``path``.

    Raises:
        ConfigError: missing, readable by group or others, not a join file, or a field missing or
            malformed (the message names the field and never repeats the secret).
    """
    try:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise ConfigError("join_file", f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        if st.st_size > _MAX_BYTES:
            raise ConfigError("join_file", f"{path} is not a flodl join file ({st.st_size} bytes)")
        body = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("join_file", f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError("join_file", f"{path} is not a flodl join file (not JSON)") from None
    if not isinstance(body, dict):
        raise ConfigError("join_file", f"{path} is not a flodl join file (not a JSON object)")
    for key in ("run_id", "secret", "controller"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise ConfigError("join_file", f"{path}: '{key}' is missing or not a string")
    if not body["controller"].startswith("tcp://"):
        raise ConfigError("join_file", f"{path}: 'controller' must be tcp://HOST:PORT")
    try:
        secret = parse_run_secret(body["secret"], f"{path}: 'secret'")
    except ValueError as exc:
        raise ConfigError("join_file", str(exc)) from None
    return JoinInfo(run_id=body["run_id"], secret=secret, controller=body["controller"], encrypt=body.get("encrypt") is True)
