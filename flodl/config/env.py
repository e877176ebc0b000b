"""The process environment: every ``FLODL_*`` name, its parser, and what flodl hands its children.

The only module in ``flodl/`` that reads or writes ``os.environ``, so that
what a variable means, its default and what it accepts are written once
(docs/options.md lists them for users). Three kinds:

* **Spawn variables** (``RankEnv``, the run credentials): what a launcher,
  controller or worker hands the process it starts. The run secret travels
  here, never on a command line (``ps`` shows command lines to every user on
  a host).
* **Switches** a user or a benchmark sets: ``FLODL_ENCRYPT``,
  ``FLODL_BULK_RELAY``, ``FLODL_SHM``, ``FLODL_SHM_DIR``, ``FLODL_VRAM_POOL``,
  ``FLODL_BULK_SLICE_BYTES``, ``FLODL_ZYGOTE``, ``FLODL_ZYGOTE_SERVER``, ``FLODL_PURE_CODEC``. On/off switches share one vocabulary
  (``_switch``).
* **Simulation, fault injection and strictness** for tests and benchmarks
  only: ``FLODL_SIMULATE_*``, ``FLODL_INJECT_FAULT``, ``FLODL_PROBE_DIR``, ``FLODL_STRICT``.

A few variables of other programs are read here too (``CUDA_VISIBLE_DEVICES``,
``OMP_NUM_THREADS``, ``WANDB_MODE``), one is set for torch (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), two for the
zygote's own imports (``zygote_environ``),
children's ``PYTHONPATH`` is extended with this process's import roots (``child_environ``),
and torchrun's four (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) are
set for a script-mode rank.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from ..plan.schedule import DEFAULT_SEED

log = logging.getLogger(__name__)

# ---- spawn variables: parent -> child
RUN_SECRET = "FLODL_RUN_SECRET"  # hex; authenticates every control frame
RUN_ID = "FLODL_RUN_ID"
CONTROLLER = "FLODL_CONTROLLER"  # tcp://host:port of the controller's ROUTER
RANK = "FLODL_RANK"
DEVICE = "FLODL_DEVICE"
TASK = "FLODL_TASK"
LOCAL_WORLD = "FLODL_LOCAL_WORLD"  # ranks on this host, to share CPU threads
HEARTBEAT_TIMEOUT = "FLODL_HEARTBEAT_TIMEOUT"
PARENT_PID = "FLODL_PARENT_PID"  # a child exits if its parent is no longer this pid
# "ADDR PROBE NONCE" of the host relay a rank sends snapshots to ("": the controller). Worker -> rank
# only. It was spelled FLODL_BULK_RELAY, the name of the user's relay switch below: now one name, one meaning.
RELAY_ADDR = "FLODL_RELAY_ADDR"
ZYGOTE_ROOM = "FLODL_ZYGOTE_ROOM"  # worker -> zygote only: blanks that make room for a forked rank's /proc environ
SEED = "FLODL_SEED"  # the run seed: a rank seeds its RNGs from it (rank/determinism.py)
DETERMINISTIC = "FLODL_DETERMINISTIC"  # 1: a deterministic run (torch's deterministic algorithms from the start)
CPU_PINNING = "FLODL_CPU_PINNING"  # off: a host shared by GPU and CPU ranks leaves them unpinned (host/cores.py)
RANK_PREFIX = "FLODL_RANK_PREFIX"  # off: a script rank's printed lines come out without "[rank N] "
CPU_SET = "FLODL_CPU_SET"  # worker -> rank: the cores the rank pins itself to ("2-7"; empty: unpinned; host/cores.py)
# worker -> script rank only: the file where a script that fails before flodl.init() leaves its error
# for the worker to report (scriptspec.py), instead of printing a traceback of its own
SCRIPT_REPORT = "FLODL_SCRIPT_REPORT"

# ---- switches a user (or a benchmark) sets
ENCRYPT = "FLODL_ENCRYPT"  # 1|on|yes|true: CURVE-encrypt every plane (as --encrypt); children inherit it
BULK_RELAY = "FLODL_BULK_RELAY"  # on (default) | off | always: do workers pre-average their ranks' snapshots
SHM = "FLODL_SHM"  # on (default) | off: same-host snapshots through shared memory, else the bulk socket
SHM_DIR = "FLODL_SHM_DIR"  # where shared-memory segments live (default /dev/shm)
VRAM_POOL = "FLODL_VRAM_POOL"  # on (default) | off: kill-switch of the data plane's VRAM pool
SUMMARY_HISTORY_BYTES = "FLODL_SUMMARY_HISTORY_BYTES"  # the summary history's size cap (0: every row whole; benchmarks)
BULK_SLICE_BYTES = "FLODL_BULK_SLICE_BYTES"  # a model travels in slices of at most this many bytes (tuning)
ZYGOTE = "FLODL_ZYGOTE"  # on (default) | off: a worker forks its ranks from a pre-imported process, else execs each
PURE_CODEC = "FLODL_PURE_CODEC"  # on | off (default): frames by the pure-Python codec even where the compiled one is built
ZYGOTE_SERVER = "FLODL_ZYGOTE_SERVER"  # a Unix socket: a zygote server shared by this host's workers (rank/zygote.py --serve)
# controller -> its embedded worker only: open the run's TCPStore in a process the zygote forks (torch is
# imported there already, so the controller need not import it) and write its port to this file ("0": could not)
STORE_FILE = "FLODL_STORE_FILE"
STORE_BIND = "FLODL_STORE_BIND"  # ... and the address that store listens on (the controller's --bind)

# ---- other programs' variables
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
WANDB_MODE = "WANDB_MODE"  # Weights & Biases' own: flodl's W&B logger runs offline unless it is set
# numpy's OpenBLAS starts its thread pool when numpy is imported; torch asks NVML, not the CUDA
# driver, whether CUDA is there: the zygote sets both for itself (zygote_environ)
OPENBLAS_NUM_THREADS = "OPENBLAS_NUM_THREADS"
NVML_BASED_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
PYTHONPATH = "PYTHONPATH"  # children get the import roots of their parent (child_environ)
# torchrun's, set for a script-mode rank (docs/script-mode.md): the values at its spawn, never updated
TORCHRUN_RANK, TORCHRUN_WORLD_SIZE = "RANK", "WORLD_SIZE"
TORCHRUN_LOCAL_RANK, TORCHRUN_LOCAL_WORLD_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
# torchrun's too, and torch's env:// rendezvous: a script-mode rank has no default group to rendezvous
# for, so it is never set (docs/script-mode.md#torchdistributed-in-a-script)
TORCHRUN_MASTER_ADDR = "MASTER_ADDR"

_ON = ("1", "on", "yes", "true")
_OFF = ("0", "off", "no", "false")
_warned: set[str] = set()


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
    relay_addr: str = ""  # the host relay's "ADDR PROBE NONCE", or "" (snapshots go to the controller)
    seed: int = DEFAULT_SEED  # the run seed (WorkerWelcome.seed): the rank's RNGs derive from it (rank/determinism.py)
    deterministic: bool = False  # the run's ``deterministic`` option (WorkerWelcome.deterministic)
    cpu_set: str = ""  # the cores this rank runs on, when GPU and CPU ranks share the host (host/cores.py)

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
            RELAY_ADDR: self.relay_addr,
            SEED: str(self.seed),
            DETERMINISTIC: "1" if self.deterministic else "0",
            CPU_SET: self.cpu_set,
        }

    @classmethod
    def from_environ(cls) -> RankEnv:
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
            relay_addr=env.get(RELAY_ADDR, ""),
            seed=int(env.get(SEED) or DEFAULT_SEED),
            deterministic=env.get(DETERMINISTIC) == "1",
            cpu_set=env.get(CPU_SET, ""),
        )


def fixed_cublas_workspace() -> None:
    """Deterministic runs: cuBLAS repeats its results only with a fixed workspace, which it reads
    from ``CUBLAS_WORKSPACE_CONFIG`` when its handle is made (a value the user set wins)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def torchrun_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int) -> dict[str, str]:
    """torchrun's variables for a script-mode rank, so libraries that read them behave."""
    return {
        TORCHRUN_RANK: str(rank),
        TORCHRUN_WORLD_SIZE: str(world_size),
        TORCHRUN_LOCAL_RANK: str(local_rank),
        TORCHRUN_LOCAL_WORLD_SIZE: str(local_world_size),
    }


def script_report() -> str:
    """Where this script rank leaves a failure before ``flodl.init()`` ("": nowhere, fail as any process)."""
    return os.environ.get(SCRIPT_REPORT, "")


def has_master_addr() -> bool:
    """Is ``MASTER_ADDR`` set (a script's own rendezvous address for torch's ``env://``)?"""
    return TORCHRUN_MASTER_ADDR in os.environ


def pythonpath_with(directory: str) -> str:
    """``PYTHONPATH`` with ``directory`` first: a script-mode rank imports the flodl its worker runs."""
    rest = os.environ.get("PYTHONPATH", "")
    return directory + (os.pathsep + rest if rest else "")


def child_environ(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus ``extra``, for a child process.

    ``PYTHONPATH`` gains what a fresh ``python -m flodl.*`` started elsewhere
    would miss (``import_path``), so the child imports what this process can.
    """
    env = {**os.environ}
    env[PYTHONPATH] = os.pathsep.join(_unique([*import_path(), *filter(None, env.get(PYTHONPATH, "").split(os.pathsep))]))
    return {**env, **extra}


def import_path() -> list[str]:
    """The import roots a child needs: flodl's own parent directory (flodl may be on ``sys.path``
    without being installed), then this process's ``sys.path`` entries a fresh interpreter lacks:
    the launching script's directory and whatever it added. A task imported from the user's own
    module (``Trainer.builder(task)`` in ``~/proj/train.py``) is then importable by ranks started
    from any working directory. The interpreter's own directories are left out (a child of the same
    ``sys.executable`` has them, in their own order)."""
    own = str(Path(__file__).resolve().parents[2])
    system = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    roots = [own]
    for entry in sys.path:
        path = str(Path(entry or os.getcwd()).resolve())
        if Path(path).is_dir() and not any(path == s or path.startswith(s + os.sep) for s in system):
            roots.append(path)
    return _unique(roots)


def pythonpath() -> str:
    """This process's ``PYTHONPATH`` ("" when unset)."""
    return os.environ.get(PYTHONPATH, "")


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def local_store_request() -> tuple[str, str] | None:
    """``(port file, bind address)`` when this worker's controller asked it to host the run's
    store (``FLODL_STORE_FILE``, ``FLODL_STORE_BIND``), else None."""
    path = os.environ.get(STORE_FILE, "")
    return (path, os.environ.get(STORE_BIND, "") or "127.0.0.1") if path else None


def parent_pid() -> int:
    """The pid this process must not outlive (``FLODL_PARENT_PID``; 0: none)."""
    return int(os.environ.get(PARENT_PID, "0") or 0)


def _switch(name: str, default: bool) -> bool:
    """An on/off switch: ``1|on|yes|true`` or ``0|off|no|false`` (any case); unset or empty: ``default``.

    Anything else keeps the default, with one warning per variable (a typo must
    not pass for a choice, nor stop a run that only tunes).
    """
    text = os.environ.get(name, "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    if text and name not in _warned:
        _warned.add(name)
        log.warning("%s=%r is neither on nor off: using its default (%s)", name, text, "on" if default else "off")
    return default


def cpu_pinning() -> bool:
    """``FLODL_CPU_PINNING`` (default on): pin GPU ranks to cores of their own on a shared host."""
    return _switch(CPU_PINNING, True)


def rank_prefix() -> bool:
    """``FLODL_RANK_PREFIX`` (default on): a script rank's printed lines start ``[rank N] ``."""
    return _switch(RANK_PREFIX, True)


def rank_number() -> int | None:
    """This process's rank (``FLODL_RANK``) when a worker started it, else None."""
    text = os.environ.get(RANK, "")
    return int(text) if text.isdigit() else None


def encryption_requested() -> bool:
    """``FLODL_ENCRYPT`` asks for CURVE encryption in this process (default off)."""
    return _switch(ENCRYPT, False)


def request_encryption() -> None:
    """Turn ``FLODL_ENCRYPT`` on in this process, so that every process it starts encrypts too."""
    os.environ[ENCRYPT] = "1"


def bulk_relay_setting() -> str:
    """``FLODL_BULK_RELAY``: ``on`` (relay on hosts other than the controller's), ``off`` (every
    rank's snapshot to the controller) or ``always`` (on the controller's host too: tests, benchmarks)."""
    if os.environ.get(BULK_RELAY, "").strip().lower() == "always":
        return "always"
    return "on" if _switch(BULK_RELAY, True) else "off"


def pure_codec_requested() -> bool:
    """``FLODL_PURE_CODEC`` keeps this process on the pure-Python frame codec (default off: the compiled
    one where it is built; the two write the same bytes, so peers may differ)."""
    return _switch(PURE_CODEC, False)


def shm_lane_allowed() -> bool:
    """``FLODL_SHM`` lets same-host snapshots use shared memory (default on; benchmarks compare both)."""
    return _switch(SHM, True)


def shm_dir() -> Path:
    """Where shared-memory segments live (``FLODL_SHM_DIR``, default /dev/shm)."""
    return Path(os.environ.get(SHM_DIR) or "/dev/shm")


def vram_pool_disabled() -> bool:
    """``FLODL_VRAM_POOL=off`` kill-switch (read by the data plane)."""
    return not _switch(VRAM_POOL, True)


def summary_history_bytes(default: int) -> int | None:
    """``FLODL_SUMMARY_HISTORY_BYTES``: the summary history's cap in bytes of JSON; 0: none (every
    row whole, as benchmarks that read each epoch's row want). Unset or not a whole number: ``default``."""
    text = os.environ.get(SUMMARY_HISTORY_BYTES, "").strip()
    if not text.isdigit():
        return default
    return int(text) or None


def bulk_slice_bytes(default: int = 8 << 20) -> int:
    """``FLODL_BULK_SLICE_BYTES``: the largest slice a model travels in (benchmarks and tuning only).

    Raises:
        ValueError: not a whole number of bytes > 0.
    """
    text = os.environ.get(BULK_SLICE_BYTES, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{BULK_SLICE_BYTES}={text!r}: expected a whole number of bytes > 0")
    return value


def zygote_enabled() -> bool:
    """``FLODL_ZYGOTE``: a worker forks its ranks from one pre-imported process (default on);
    ``off`` starts each rank as a fresh interpreter (host/zygote.py)."""
    return _switch(ZYGOTE, True)


def zygote_server() -> str:
    """``FLODL_ZYGOTE_SERVER``: the socket of a zygote server a worker forks its ranks from instead of
    starting its own ("" when unset; host/zygote.py ``Zygote.connect``)."""
    return os.environ.get(ZYGOTE_SERVER, "")


def zygote_environ() -> None:
    """The zygote's own environment, set before it imports torch: no BLAS thread pool that a fork
    would leave behind (numpy's OpenBLAS starts one at import unless told one thread; a value the
    user set wins, and above 1 the zygote then declines to fork), and no CUDA driver loaded to answer
    ``torch.cuda.is_available()`` (a forked child cannot use a driver its parent initialised)."""
    os.environ.setdefault(OPENBLAS_NUM_THREADS, "1")
    os.environ[NVML_BASED_CUDA_CHECK] = "1"


def environ_copy() -> dict[str, str]:
    """This process's environment, as it stands."""
    return dict(os.environ)


def replace_environ(env: dict[str, str]) -> None:
    """Make ``env`` this process's whole environment (a forked rank takes the one its spawn asked for)."""
    os.environ.clear()
    os.environ.update(env)


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (None: unset, every device visible)."""
    return os.environ.get(CUDA_VISIBLE_DEVICES)


def wandb_mode() -> str:
    """The mode flodl's W&B logger runs in (``--wandb-project``): ``WANDB_MODE`` when set
    (``online``, ``offline``, ``disabled``), else ``offline`` (``wandb sync`` uploads it later)."""
    return os.environ.get(WANDB_MODE, "").strip() or "offline"


def omp_threads_set() -> bool:
    """Did the user choose the intra-op thread count (``OMP_NUM_THREADS``)? Then a rank leaves it alone."""
    return bool(os.environ.get(OMP_NUM_THREADS))


def nccl_errors_raise() -> None:
    """Make a collective NCCL gives up on raise in this process instead of killing it
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: clean up only), unless the user chose otherwise."""
    os.environ.setdefault(TORCH_NCCL_ASYNC_ERROR_HANDLING, "2")


# ---- simulation and fault injection: tests and benchmarks only
SIMULATE_SLOWDOWN = "FLODL_SIMULATE_SLOWDOWN"  # "1:3.0,2:1.5": rank -> compute multiplier
SIMULATE_BASE_MS = "FLODL_SIMULATE_BASE_MS"  # "1:2.5" rank -> base step ms, or "2.5" for every rank
SIMULATE_PACE_FILE = "FLODL_SIMULATE_PACE_FILE"  # a path: the live base (testing/pace_board.py)
INJECT_FAULT = "FLODL_INJECT_FAULT"  # "rank:point:n[:action],...": faults.FaultPlan parses it
PROBE_DIR = "FLODL_PROBE_DIR"  # a directory: ranks write the states tests compare there (testing/probes.py)
STRICT = "FLODL_STRICT"  # on: a flodl bug the run would survive (a message handler raising) fails it


def strict() -> bool:
    """``FLODL_STRICT``: turn a bug flodl survives in production into a failed run (default off).

    The test suite sets it for every process it starts (tests/conftest.py): a
    message handler that raised (``transport.HandlerErrors``) then fails the
    controller's run at its end and a worker's exit, so no test passes over it.
    """
    return _switch(STRICT, False)


def probes_requested() -> bool:
    """Does this process's environment ask for injected faults or a simulated pace? An entry point
    then installs ``flodl.testing``'s probes (flodl/probes.py); otherwise it never imports them."""
    return any(os.environ.get(name) for name in (INJECT_FAULT, SIMULATE_SLOWDOWN, SIMULATE_BASE_MS, SIMULATE_PACE_FILE, PROBE_DIR))


def probe_dir() -> str | None:
    """``FLODL_PROBE_DIR``: where a rank writes the states a test compares (a joiner's optimizer
    state and its donor's: ``Probes.observe``), or None."""
    return os.environ.get(PROBE_DIR) or None


def injected_faults() -> str:
    """The text of ``FLODL_INJECT_FAULT`` ("" when unset); ``faults.FaultPlan.from_env`` parses it."""
    return os.environ.get(INJECT_FAULT, "")


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


def simulated_pace_file() -> str | None:
    """``FLODL_SIMULATE_PACE_FILE``: where ranks at full speed publish their step time and paced
    ranks read it as their base, live (``flodl.testing.pace_board``); None when unset."""
    return os.environ.get(SIMULATE_PACE_FILE) or None


#: how far a live base (FLODL_SIMULATE_PACE_FILE) may stray from the fixed one, either way
LIVE_BASE_BAND = 1.5


def live_base_ms(posted_ms: float | None, base_ms: float | None) -> float | None:
    """The base a paced rank steps against: the live base ``posted_ms`` (None: nothing posted),
    kept within ``LIVE_BASE_BAND`` of the fixed ``base_ms`` when there is one, else ``base_ms``.

    Why the band: a full-speed rank whose step holds a wait for the paced one (a lockstep
    collective inside the step: DDP's buffer broadcast, a Sync all-reduce) posts that wait as its
    pace, the paced rank sleeps 4x as long, the wait grows, and the pace runs away (DDP's
    ResNet-20 pair once slept minutes a step)."""
    if posted_ms is None:
        return base_ms
    if base_ms is None:
        return posted_ms
    return min(base_ms * LIVE_BASE_BAND, max(base_ms / LIVE_BASE_BAND, posted_ms))


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


def paced_step(compute_ms: float, factor: float, base_ms: float | None, late_ms: float = 0.0) -> tuple[float, float]:
    """How long a rank simulated ``factor`` times slower sleeps after a step, and the step time it reports.

    Pure arithmetic, ms in and out: ``(sleep_ms, step_ms)``.

    * With ``base_ms`` (the rank's solo step time, measured in the same set-up)
      the rank is *paced*: its step period is ``factor x base_ms``. It sleeps
      ``max(0, factor x base_ms - compute_ms - late_ms)`` and reports
      ``max(compute_ms, factor x base_ms)``: a 4:1 pair really steps 4:1,
      whatever the step right after a sleep costs. ``late_ms`` is how far the
      rank is behind its schedule (``pacing_late_ms``): a sleep
      overshoots by 0.1-0.3 ms on a VM, which at sub-ms periods made a 4:1 pair
      step 4.9:1; taking the accumulated overrun off the next sleep keeps the
      *mean* period exact.
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
    return max(0.0, period - compute_ms - late_ms), max(compute_ms, period)


def pacing_late_ms(late_ms: float, step_ms: float, factor: float, base_ms: float | None) -> float:
    """How far a paced rank is behind its schedule after a step (sleep included) that took
    ``step_ms``, ``late_ms`` being how far it was behind before it: the next ``paced_step`` takes
    this off its sleep. Kept within one period either way, so a longer stall (an average, a
    regroup) is not caught up by steps run back to back. 0 when not paced."""
    if factor <= 1.0 or base_ms is None:
        return 0.0
    period = factor * base_ms
    return min(period, max(-period, late_ms + step_ms - period))
