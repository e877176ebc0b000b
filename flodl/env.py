"""The environment variables flodl passes from parent to child process.

The only module that reads or writes ``FLODL_*`` variables. The run secret
travels here, never on a command line (``ps`` shows command lines to every
user on a host). ``RankEnv`` is what a worker hands each rank process.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

RUN_SECRET = "FLODL_RUN_SECRET"  # hex; authenticates every control frame
RUN_ID = "FLODL_RUN_ID"
CONTROLLER = "FLODL_CONTROLLER"  # tcp://host:port of the controller's ROUTER
RANK = "FLODL_RANK"
DEVICE = "FLODL_DEVICE"
TASK = "FLODL_TASK"
LOCAL_WORLD = "FLODL_LOCAL_WORLD"  # ranks on this host, to share CPU threads
HEARTBEAT_TIMEOUT = "FLODL_HEARTBEAT_TIMEOUT"
PARENT_PID = "FLODL_PARENT_PID"  # a child exits if its parent is no longer this pid
BULK_RELAY = "FLODL_BULK_RELAY"  # "ADDR PROBE NONCE" of the host relay a rank sends snapshots to ("": the controller)


def new_run_secret() -> bytes:
    """32 random bytes from the OS CSPRNG."""
    return secrets.token_bytes(32)


def new_run_id() -> str:
    return secrets.token_hex(6)


def read_run_credentials() -> tuple[bytes | None, str | None]:
    """The run secret and id handed down by a parent or launcher, if any.

    Raises:
        ValueError: FLODL_RUN_SECRET is set but is not hex of at least 16 bytes.
    """
    raw = os.environ.get(RUN_SECRET)
    secret = parse_run_secret(raw, RUN_SECRET) if raw else None
    return secret, os.environ.get(RUN_ID) or None


def parse_run_secret(text: str, source: str) -> bytes:
    """The run secret from its hex form; ``source`` names where it came from in errors.

    The message never repeats ``text``: it is a secret, and errors end up in logs.

    Raises:
        ValueError: not hex, or fewer than 16 bytes.
    """
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{source} must be hex") from None
    if len(secret) < 16:
        raise ValueError(f"{source} must hold at least 16 bytes (32 hex digits)")
    return secret


def credentials_env(secret: bytes, run_id: str) -> dict[str, str]:
    return {RUN_SECRET: secret.hex(), RUN_ID: run_id}


@dataclass(frozen=True)
class RankEnv:
    """Everything a rank process is told at spawn."""

    controller: str
    secret: bytes
    run_id: str
    rank: int
    device: str
    task: str
    local_world: int
    heartbeat_timeout_s: float
    parent_pid: int
    bulk_relay: str = ""  # the host relay's "ADDR PROBE NONCE", or "" (snapshots go to the controller)

    def to_env(self) -> dict[str, str]:
        return {
            CONTROLLER: self.controller,
            **credentials_env(self.secret, self.run_id),
            RANK: str(self.rank),
            DEVICE: self.device,
            TASK: self.task,
            LOCAL_WORLD: str(self.local_world),
            HEARTBEAT_TIMEOUT: repr(self.heartbeat_timeout_s),
            PARENT_PID: str(self.parent_pid),
            BULK_RELAY: self.bulk_relay,
        }

    @classmethod
    def from_environ(cls) -> "RankEnv":
        """Read the rank's spawn environment.

        Raises:
            KeyError: a variable is missing (the rank was not started by a worker).
        """
        secret, run_id = read_run_credentials()
        if secret is None or run_id is None:
            raise KeyError(f"{RUN_SECRET} / {RUN_ID}")
        env = os.environ
        return cls(
            controller=env[CONTROLLER],
            secret=secret,
            run_id=run_id,
            rank=int(env[RANK]),
            device=env[DEVICE],
            task=env[TASK],
            local_world=int(env.get(LOCAL_WORLD, "1")),
            heartbeat_timeout_s=float(env[HEARTBEAT_TIMEOUT]),
            parent_pid=int(env.get(PARENT_PID, "0")),
            bulk_relay=env.get(BULK_RELAY, ""),
        )


def child_environ(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus ``extra``, for a child process."""
    return {**os.environ, **extra}


def vram_pool_disabled() -> bool:
    """FLODL_VRAM_POOL=off|0 kill-switch (read by the data plane)."""
    return os.environ.get("FLODL_VRAM_POOL", "").lower() in ("off", "0")


SIMULATE_SLOWDOWN = "FLODL_SIMULATE_SLOWDOWN"  # "1:3.0,2:1.5": rank -> compute multiplier
SIMULATE_BASE_MS = "FLODL_SIMULATE_BASE_MS"  # "1:2.5" rank -> base step ms, or "2.5" for every rank


def simulated_slowdown(rank: int) -> float:
    """This rank's simulated compute multiplier (1.0 = real speed).

    SIMULATION ONLY, for tests and benchmarks on one machine: a rank with
    factor f is paced as a device f times slower (``paced_step``), from its
    second step on (the first is set-up and warm-up, which a slower device
    would not multiply). Never set on real mixed hardware.

    Raises:
        ValueError: the variable is not ``rank:factor[,rank:factor...]`` with factors >= 1.
    """
    return parse_slowdown(os.environ.get(SIMULATE_SLOWDOWN, ""), rank)


def simulated_base_ms(rank: int) -> float | None:
    """The base step time (ms) a simulated slow rank is paced against (None: not set).

    Benchmarks set it to the rank's solo step time measured in the same set-up,
    so that factor f makes the rank's step period exactly f x that time.

    Raises:
        ValueError: the variable is not ``ms`` or ``rank:ms[,rank:ms...]`` with finite times > 0.
    """
    return parse_base_ms(os.environ.get(SIMULATE_BASE_MS, ""), rank)


def parse_slowdown(text: str, rank: int, source: str = SIMULATE_SLOWDOWN) -> float:
    """``rank``'s factor in ``rank:factor[,rank:factor...]`` (1.0 if absent); ``source`` names the text in errors.

    Raises:
        ValueError: malformed, or a factor below 1.
    """
    text = text.strip()
    if not text:
        return 1.0
    table = {}
    for item in text.split(","):
        r, sep, f = item.partition(":")
        try:
            table[int(r)] = float(f)
        except ValueError:
            raise ValueError(f"{source}={text!r}: expected rank:factor pairs, e.g. 1:3.0") from None
        if not sep or not table[int(r)] >= 1.0 or table[int(r)] == float("inf"):
            raise ValueError(f"{source}={text!r}: factors must be finite and >= 1")
    return table.get(rank, 1.0)


def parse_base_ms(text: str, rank: int, source: str = SIMULATE_BASE_MS) -> float | None:
    """``rank``'s base step ms in ``ms`` (every rank) or ``rank:ms[,rank:ms...]`` (a bare ``ms`` item
    is the default for ranks not named); None if ``text`` is empty or names neither.

    Raises:
        ValueError: malformed, or a time that is not a finite number > 0.
    """
    text = text.strip()
    if not text:
        return None
    table: dict[int | None, float] = {}
    for item in text.split(","):
        r, sep, ms = item.rpartition(":") if ":" in item else ("", "", item)
        try:
            key = int(r) if sep else None
            value = float(ms)
        except ValueError:
            raise ValueError(f"{source}={text!r}: expected milliseconds (e.g. 2.5) or rank:ms pairs (e.g. 1:2.5)") from None
        if key in table:
            raise ValueError(f"{source}={text!r}: {'rank ' + str(key) if sep else 'the default'} is given twice")
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{source}={text!r}: step times must be finite and > 0 ms")
        table[key] = value
    return table.get(rank, table.get(None))


def paced_step(compute_ms: float, factor: float, base_ms: float | None) -> tuple[float, float]:
    """How long a rank simulated ``factor`` times slower sleeps after a step, and the step time it reports.

    Pure arithmetic, ms in and out: ``(sleep_ms, step_ms)``.

    * With ``base_ms`` (the rank's solo step time, measured in the same set-up)
      the rank is *paced*: its step period is ``factor x base_ms``. It sleeps
      ``max(0, factor x base_ms - compute_ms)`` and reports
      ``max(compute_ms, factor x base_ms)``: a 4:1 pair really steps 4:1,
      whatever the step right after a sleep costs.
    * Without it, the old rule: sleep ``(factor - 1) x compute_ms`` and report
      ``factor x compute_ms``. It OVERSHOOTS: compute right after a sleep is
      slower (cold caches, a lower clock), and that inflated time is multiplied
      too; 1:4 measured 5-7x on the 2-core dev VM.

    A factor of 1 (or less) does nothing: ``(0, compute_ms)``.
    """
    if factor <= 1.0:
        return 0.0, compute_ms
    if base_ms is None:
        return compute_ms * (factor - 1.0), compute_ms * factor
    period = factor * base_ms
    return max(0.0, period - compute_ms), max(compute_ms, period)
