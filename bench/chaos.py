"""Chaos: one fault per real run, at a uniformly random moment, across the six modes.

    python bench/chaos.py [--quick | --smoke] [--faults N] [--seed S] [--parallel P] [--kinds K,...] [--flodl-args '...']

Every run is ``python -m flodl.controller --task tests/tasks/tiny.py:task``
with 3 local ranks and ``--heartbeat-timeout-secs 3``. Fault kinds (run ``i``
gets kind ``k = i mod 8`` and mode ``(k + i div 8) mod 6``, so 48 runs cover every
pair; ``slice`` takes the CPU modes only, ``(k + i div 8) mod 3`` of them; the
order is shuffled with the seed):

* ``kill``        SIGKILL of a random non-zero rank from outside, at a random moment of training;
                  every other kill run has healing on (``--max-restarts 1``): the killed rank is
                  restarted and must rejoin (world back to full size) when the run has time left
* ``stop``        SIGSTOP of a random non-zero rank from outside (a hang: found by heartbeat)
* ``stuck``       ``FLODL_INJECT_FAULT=<rank>:batch:<random n>:hang`` (the training thread
                  blocks for good, heartbeats go on)
* ``reported``    ``FLODL_INJECT_FAULT=<rank>:reported:<random n>``: the rank SIGKILLs itself the
                  moment its n-th window report has left, that window's average still in flight
                  (the ledger must then count the window only if some replica holds it)
* ``slice``       ``FLODL_INJECT_FAULT=<rank>:slice:<random n>`` with ``FLODL_TEST_BIG_MODEL``: the
                  rank SIGKILLs itself once the first 8 MiB slice of its n-th snapshot has left, the
                  rest never sent (CPU modes). The model carries a parameter of ones nothing trains,
                  and the eval is its mean: it must end exactly 1 (no average shrank it)
* ``host``        a whole host lost: the run has two workers started by hand (``--workers 2``
                  ``--join-file``; one with two ranks, one with one, each relaying its ranks'
                  snapshots as a remote host's does) and one of them goes at a random moment,
                  either every process of that host SIGKILLed at once (a host powered off) or
                  the worker alone (its ranks must die with it); found by silence, the other
                  host's ranks finish the run. In the CPU modes with ``FLODL_TEST_BIG_MODEL``: a
                  relay may go halfway through a round's slices, and the eval must end exactly 1
* ``slow-build``  ``FLODL_TEST_BUILD_SLEEP`` > heartbeat timeout: the run must simply start and finish
* ``ctl-kill``    SIGKILL of the controller at a random moment after the first checkpoint
                  (``--save-path`` + ``--checkpoint-every 1``); a loadable bundle must be left
                  (``read_meta`` + ``load_model`` into the task's model; an earlier epoch's is fine),
                  and a run resumed from it (``--resume-from``) must finish, training exactly what
                  the bundle had not, with a good eval

Every run is checked: exit code 0 (ctl-kill: none), every epoch's samples ==
the dataset length, final eval > 0.7, exactly the expected death, the whole
process tree gone, no ``flodl`` segment of the run left in /dev/shm, no Python
traceback in any of its processes' output (a survivor that crashed while the run
still ended 0 is a lost run too). A run
failing any check is *lost*. From the summary: detection (the recovery's
``unix_time`` minus our kill/stop time; for a stuck thread the stall the death
reason names, which starts mid-batch at the fault) and ``training_again_s``
(seconds from the recovery until every survivor completed an average in the
new membership; a ``reported`` rank kills itself, so its detection has no outside
clock and only the averaging again is timed). Goals (issue: faults at any moment): 0 runs lost, 0 samples
lost or repeated, detection <= 1 s for exits and <= heartbeat + 1 s for hangs
and stuck threads, all survivors averaging again <= 3 s after detection at p99
(max <= 5 s), a loadable bundle after every controller kill. Full mode also
runs torchrun's elastic restart on the same SIGKILL (``bench/faults.py``'s case).
Run logs stay in a temporary folder printed at the end.

``--smoke``: one ``kill`` fault (``nccl-sync``) in a 2-epoch run, no torchrun,
results in a temporary folder (does the bench still run?).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, RunFailed, report, run_controller, size_parser, smoke_results, start_controller  # noqa: E402

TASK = f"{ROOT / 'tests' / 'tasks' / 'tiny.py'}:task"
NPROC = 3
HEARTBEAT_S = 3
DATASET = 512  # tiny.py's samples per epoch
BATCHES_PER_RANK_EPOCH = DATASET // 16 // NPROC  # about 10 batches of 16 per rank per epoch
MODES = ("nccl-sync", "nccl-cadence", "nccl-async", "cpu-sync", "cpu-cadence", "cpu-async")
KINDS = ("kill", "stop", "stuck", "reported", "slice", "host", "slow-build", "ctl-kill")
CPU_MODES = tuple(m for m in MODES if m.startswith("cpu-"))
SELF_KILLS = ("reported", "slice")  # the rank kills itself: no outside clock to time detection by
SHM = Path(os.environ.get("FLODL_SHM_DIR", "/dev/shm"))
RUN_TIMEOUT_S = 240
EVAL_MIN = 0.7

#: kind -> (the detection goal in seconds, its text); slow-build and ctl-kill have no detection
DETECT_GOAL = {
    "kill": (1.0, "<= 1 s"),
    "stop": (HEARTBEAT_S + 1.0, f"<= heartbeat {HEARTBEAT_S} s + 1 s"),
    "stuck": (HEARTBEAT_S + 1.0, f"<= heartbeat {HEARTBEAT_S} s + 1 s"),
    "host": (HEARTBEAT_S + 1.0, f"<= heartbeat {HEARTBEAT_S} s + 1 s"),  # a host that is gone says nothing: silence
}
AGAIN_P99_S = 3.0
AGAIN_MAX_S = 5.0


@dataclass
class Plan:
    index: int
    kind: str
    mode: str
    victim: int  # the rank hit (non-zero; host: the host's rank count); unused by slow-build and ctl-kill
    at: float  # fraction of the nominal training time at which the fault fires
    batch: int  # stuck: the victim's batch that hangs; reported: its window report after which it dies; slice: its snapshot
    heal: bool = False  # kill: run with --max-restarts 1 and check the restarted rank rejoins
    whole: bool = False  # host: every process of the host SIGKILLed at once (else the worker alone)


@dataclass
class Result:
    plan: Plan
    landed: bool = True  # the fault hit a run still training
    failures: list[str] = field(default_factory=list)
    detect_s: float | None = None
    again_s: float | None = None
    exit_code: int | None = None
    wall_s: float = 0.0
    start_s: float | None = None  # from launch to the controller's header (every rank joined)
    log: str = ""
    note: str = ""
    healed_s: float | None = None  # heal: seconds from detection until the restarted rank joined

    @property
    def lost(self) -> bool:
        return bool(self.failures)


# ---------------------------------------------------------------- pure aggregation


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); nan if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _under(value: float, limit: float) -> bool | None:
    return None if math.isnan(value) else value <= limit


def rows_for(results: list[Result]) -> list[Row]:
    """The table: per fault kind, counts, runs lost, detection and averaging-again percentiles, with goals."""
    rows: list[Row] = []
    for kind in KINDS:
        mine = [r for r in results if r.plan.kind == kind]
        if not mine:
            continue
        landed = [r for r in mine if r.landed or r.lost]
        lost = [r for r in mine if r.lost]
        coverage = [r for r in mine if any(f.startswith("samples") for f in r.failures)]
        rows += [
            Row(kind, "faults", len(mine), "runs"),
            Row(kind, "faults landed", len(landed), "runs"),
            Row(kind, "runs lost", len(lost), "runs", "0", not lost),
        ]
        if kind != "ctl-kill":
            rows.append(Row(kind, "runs losing samples", len(coverage), "runs", "0 lost or repeated", not coverage))
        else:
            unloadable = [r for r in mine if any(f.startswith("bundle") for f in r.failures)]
            rows.append(Row(kind, "no loadable bundle", len(unloadable), "runs", "0 (bundle after every kill)", not unloadable))
        if kind in DETECT_GOAL or kind in SELF_KILLS:  # a rank that kills itself has no outside clock to detect against
            again = [r.again_s for r in mine if r.again_s is not None]
            if kind in DETECT_GOAL:
                limit, text = DETECT_GOAL[kind]
                detect = [r.detect_s for r in mine if r.detect_s is not None]
                for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
                    v = percentile(detect, q)
                    rows.append(Row(kind, f"detection {name}", v, "s", text, _under(v, limit)))
            for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
                v = percentile(again, q)
                goal = {"p99": (f"<= {AGAIN_P99_S:g} s", AGAIN_P99_S), "max": (f"<= {AGAIN_MAX_S:g} s", AGAIN_MAX_S)}.get(name)
                rows.append(Row(kind, f"averaging again {name}", v, "s after det.", goal and goal[0], goal and _under(v, goal[1])))
            unmeasured = sum(1 for r in mine if r.landed and not r.lost and r.again_s is None)
            rows.append(Row(kind, "again not measured", unmeasured, "runs"))
        heals = [r for r in mine if r.plan.heal]
        if heals:
            healed = [r.healed_s for r in heals if r.healed_s is not None]
            rows += [
                Row(kind, "healing runs", len(heals), "runs"),
                Row(kind, "healed (world back to full size)", len(healed), "runs"),
                Row(kind, "back to full size p50", percentile(healed, 50), "s after det."),
                Row(kind, "back to full size max", percentile(healed, 100), "s after det."),
            ]
    lost = [r for r in results if r.lost]
    rows += [Row("all", "faults", len(results), "runs"), Row("all", "runs lost", len(lost), "runs", "0", not lost)]
    return rows


def make_plans(count: int, seed: int, epochs: int) -> list[Plan]:
    """Run i: kind k = i mod 8, mode (k + i div 8) mod 6 (every pair in 48 runs; ``slice``: the CPU
    modes, (k + i div 8) mod 3); moments drawn uniformly; order shuffled."""
    rng = random.Random(seed)
    plans = []
    last_batch = max(2, int(0.8 * BATCHES_PER_RANK_EPOCH * epochs))
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        modes = CPU_MODES if kind == "slice" else MODES
        mode = modes[(i % len(KINDS) + i // len(KINDS)) % len(modes)]
        heal = kind == "kill" and (i // len(KINDS)) % 2 == 0  # every other kill run heals (the quick set's one)
        whole = kind == "host" and (i // len(KINDS)) % 2 == 0  # every other host run loses every process at once
        # reported, slice: a window (a snapshot) every mode reaches (Sync has one window an epoch); stuck: a batch
        nth = rng.randint(2, epochs) if kind in SELF_KILLS else rng.randint(2, last_batch)
        plans.append(Plan(i, kind, mode, rng.randrange(1, NPROC), rng.uniform(0.05, 0.8), nth, heal, whole))
    rng.shuffle(plans)
    return plans


def plans_for(kinds: tuple[str, ...], count: int, per_kind: int, seed: int, epochs: int) -> list[Plan]:
    """``count`` plans of ``kinds`` only: the whole plan's, filtered, so a kind's runs are the same
    with or without ``--kinds``."""
    whole = count if kinds == KINDS else max(count, per_kind) * len(KINDS)
    return [p for p in make_plans(whole, seed, epochs) if p.kind in kinds][:count]


# ---------------------------------------------------------------- one run


def _env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["FLODL_SUMMARY_HISTORY_BYTES"] = "0"  # every epoch's row whole (a long soak's would be merged): each is checked
    env.pop("FLODL_INJECT_FAULT", None)
    env.update(extra)
    return env


class Tree:
    """Every process of the run's trees seen while the run lasted (ranks start late): the
    controller's, and those of workers started by hand (``add``)."""

    def __init__(self, pid: int) -> None:
        self.roots = [psutil.Process(pid)]
        self.seen: dict[int, psutil.Process] = {pid: self.roots[0]}
        self.under: dict[int, set[int]] = {pid: set()}  # root -> every pid seen below it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        """Watch the tree of a process the run did not start itself (a worker started by hand)."""
        root = psutil.Process(pid)
        self.under[pid] = set()
        self.seen.setdefault(pid, root)
        self.roots.append(root)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(0.1)

    def poll(self) -> None:
        for root in list(self.roots):
            try:
                for p in root.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
                    self.under[root.pid].add(p.pid)
            except psutil.Error:
                pass

    def ranks(self, under: int | None = None) -> list[psutil.Process]:
        """The ranks running now (only those below the root ``under``, if given)."""
        out = []
        for pid, p in list(self.seen.items()):
            if under is not None and pid not in self.under.get(under, ()):
                continue
            try:
                if "flodl.rank" in " ".join(p.cmdline()) and _running(p):
                    out.append(p)
            except psutil.Error:
                pass
        return sorted(out, key=lambda p: p.pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def leftovers(self, timeout: float) -> list[str]:
        """Processes of the tree still running after ``timeout`` s (then killed, so nothing stays)."""
        deadline = time.monotonic() + timeout
        alive = [p for p in self.seen.values() if _running(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in alive if _running(p)]
        left = []
        for p in alive:
            try:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.Error:
                pass
        return left


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rank_of(p: psutil.Process) -> int | None:
    try:
        return int(p.environ().get("FLODL_RANK", ""))
    except (psutil.Error, ValueError):
        return None


def _shm_names() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if "flodl" in p.name}
    except OSError:
        return set()


def _run_id(log: Path) -> str | None:
    m = re.search(r"flodl run (\S+)", log.read_text(errors="replace"))
    return m.group(1) if m else None


def _wait_for(log: Path, needle: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def traceback_in(log: Path) -> str | None:
    """The exception line of the first Python traceback in ``log``, or None."""
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            return next((x.strip() for x in lines[i + 1 :] if x and not x.startswith((" ", "\t"))), "Traceback")[:300]
    return None


def bundle_check(stem: Path) -> str | None:
    """None when ``stem`` is a loadable bundle (sidecar and checksums, model into tiny's model), else why not."""
    from flodl.checkpoint import load_model, read_meta

    sys.path.insert(0, str(ROOT / "tests" / "tasks"))
    from tiny import make_model

    try:
        meta = read_meta(stem)
        load_model(make_model(), stem)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return f"{type(exc).__name__}: {exc}"
    return None if meta else "empty sidecar"


def stray_files(stem: Path) -> list[str]:
    """Data files of the run's bundle (``<stem>.<hash>.fdl/.optim``) its sidecar does not name: a save cut short."""
    try:
        meta = json.loads(stem.with_name(stem.name + ".meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    named = {Path(str(meta.get(k, ""))).name for k in ("model_file", "optim_file")}
    pattern = re.compile(re.escape(stem.name) + r"\.[0-9a-f]{8,}\.(fdl|optim)$")
    return sorted(p.name for p in stem.parent.iterdir() if pattern.match(p.name) and p.name not in named)


def exact_model(plan: Plan) -> bool:
    """Runs whose snapshots span several slices and whose eval must end exactly 1
    (``FLODL_TEST_BIG_MODEL``): a rank dying mid-snapshot, and a lost host on the CPU backend
    (its relay may go halfway through a round's slices)."""
    return plan.kind == "slice" or (plan.kind == "host" and plan.mode.startswith("cpu-"))


def start_hosts(join_file: Path, proc: subprocess.Popen, env: dict, tmp: Path, tag: str) -> list[subprocess.Popen]:
    """The ``host`` kind's two workers, started by hand through the controller's join file: two
    ranks on one, one on the other (each in a session of its own, like a process of another host)."""
    deadline = time.monotonic() + 60
    while not join_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not join_file.exists():
        return []
    hosts = []
    for n, devices in enumerate(("cpu,cpu", "cpu")):
        with open(tmp / f"{tag}.host{n}.log", "w") as log:
            argv = [sys.executable, "-m", "flodl.worker", "--join-file", str(join_file), "--devices", devices]
            hosts.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
    return hosts


def lose_host(worker: subprocess.Popen, tree: Tree, whole: bool) -> None:
    """A host gone: every process of it SIGKILLed at once (``whole``: powered off), or its worker alone."""
    victims = [worker.pid]
    if whole:
        tree.poll()
        victims += sorted(tree.under.get(worker.pid, ()))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def resume_check(plan: Plan, stem: Path, epochs: int, step_s: float, tmp: Path, tag: str) -> list[str]:
    """Resume the killed run from its bundle: it must finish, training exactly what the bundle
    had not (the uncovered part of its open epochs and every later epoch), with a good eval."""
    from flodl.checkpoint import read_meta

    meta = read_meta(stem)
    args = ["--task", TASK, "--nproc-per-node", str(NPROC), "--epochs", str(epochs), "--mode", plan.mode]
    args += ["--heartbeat-timeout-secs", str(HEARTBEAT_S), "--no-progress", "--resume-from", str(stem)]
    try:
        s = run_controller(
            args, workdir=tmp, name=f"{tag}.resumed", env=_env({"FLODL_TEST_STEP_SLEEP": str(step_s)}), timeout_s=RUN_TIMEOUT_S
        )
    except RunFailed as exc:
        return [f"the resumed run: {exc.why}"]
    failures = []
    covered_open = sum(item["total"] - sum(size for _, size in item["uncovered"]) for item in meta["coverage"].get("open", []))
    trained = sum(h["samples"] for h in s["history"])
    if covered_open + trained != (epochs - meta["epoch"]) * DATASET:
        failures.append(
            f"resumed from epoch {meta['epoch']}: {covered_open} samples in the bundle's open epochs + {trained} trained, "
            f"want {(epochs - meta['epoch']) * DATASET}"
        )
    if s["history"] and s["history"][0]["epoch"] != meta["epoch"]:
        failures.append(f"the resumed run began at epoch {s['history'][0]['epoch']}, the bundle at {meta['epoch']}")
    if s.get("final_eval") is None or s["final_eval"] <= EVAL_MIN:
        failures.append(f"the resumed run's final eval {s.get('final_eval')}")
    return failures


def run_one(plan: Plan, epochs: int, step_s: float, tmp: Path, flodl_args: tuple[str, ...] = ()) -> Result:
    """Start a run, inject the plan's fault at its moment, wait, and check everything.
    ``flodl_args``: options every run takes too (``--flodl-args``: a compressed exchange, say)."""
    res = Result(plan)
    tag = f"{plan.index:03d}-{plan.kind}{'-heal' if plan.heal else ''}-{plan.mode}"
    log_path, stem = tmp / f"{tag}.log", tmp / tag / "ckpt"  # the controller's output: start_controller's log of ``tag``
    res.log = str(log_path)
    extra = {"FLODL_TEST_STEP_SLEEP": str(step_s)}
    args = [
        "--task",
        TASK,
        "--nproc-per-node",
        str(NPROC),
        "--epochs",
        str(epochs),
        "--mode",
        plan.mode,
        "--heartbeat-timeout-secs",
        str(HEARTBEAT_S),
        "--no-progress",
        *flodl_args,
    ]
    if plan.heal:
        args += ["--max-restarts", "1"]
    if plan.kind == "stuck":
        extra["FLODL_INJECT_FAULT"] = f"{plan.victim}:batch:{plan.batch}:hang"
    elif plan.kind in SELF_KILLS:
        extra["FLODL_INJECT_FAULT"] = f"{plan.victim}:{plan.kind}:{plan.batch}"
    elif plan.kind == "slow-build":
        extra["FLODL_TEST_BUILD_SLEEP"] = str(HEARTBEAT_S + 2)
    elif plan.kind == "ctl-kill":
        args += ["--save-path", str(stem), "--checkpoint-every", "1"]
    if exact_model(plan):
        extra["FLODL_TEST_BIG_MODEL"] = "1"
    join_file = tmp / f"{tag}.join.json"
    if plan.kind == "host":  # two hosts' workers started by hand instead of the local one
        at = args.index("--nproc-per-node")
        args[at : at + 2] = ["--workers", "2", "--join-file", str(join_file)]
        # each relays its ranks' snapshots, as a worker on a host other than the controller's does
        extra["FLODL_BULK_RELAY"] = "always"
    shm_before = _shm_names()
    started = time.monotonic()
    run = start_controller(args, workdir=tmp, name=tag, env=_env(extra), session=True)
    proc = run.proc
    tree = Tree(proc.pid)
    hosts = start_hosts(join_file, proc, _env(extra), tmp, tag) if plan.kind == "host" else []
    for host in hosts:
        tree.add(host.pid)
    lost_ranks: list[int] = []  # host: the ranks of the host lost
    hit_at: float | None = None
    nominal = epochs * BATCHES_PER_RANK_EPOCH * step_s  # a lower bound of the training time
    try:
        if _wait_for(log_path, "samples, batch", proc, 120):
            res.start_s = time.monotonic() - started
        if plan.kind in ("kill", "stop"):
            if res.start_s is not None:
                time.sleep(plan.at * nominal)
                tree.poll()
                ranks = tree.ranks()
                victim = next((r for r in ranks if _rank_of(r) == plan.victim), None)
                if proc.poll() is None and victim is not None:
                    hit_at = time.time()
                    os.kill(victim.pid, signal.SIGKILL if plan.kind == "kill" else signal.SIGSTOP)
                else:
                    res.landed = False
        elif plan.kind == "host":
            if res.start_s is not None:
                time.sleep(plan.at * nominal)
                tree.poll()
                carried = {h.pid: sorted(r for p in tree.ranks(under=h.pid) if (r := _rank_of(p)) is not None) for h in hosts}
                victim = next((h for h in hosts if len(carried[h.pid]) == plan.victim), None)
                if proc.poll() is None and victim is not None:
                    lost_ranks = carried[victim.pid]
                    hit_at = time.time()
                    lose_host(victim, tree, plan.whole)
                else:
                    res.landed = False
        elif plan.kind == "ctl-kill":
            meta = stem.parent / "ckpt.meta.json"
            deadline = time.monotonic() + 120
            while not meta.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None and meta.exists():
                time.sleep(plan.at * nominal * (epochs - 1) / epochs)
                if proc.poll() is None:
                    tree.poll()
                    hit_at = time.time()
                    os.kill(proc.pid, signal.SIGKILL)
                else:
                    res.landed = False
            else:
                res.landed = False
        try:
            res.exit_code = run.wait(RUN_TIMEOUT_S - (time.monotonic() - started))
        except RunFailed:  # killed, its process group with it
            res.failures.append(f"still running after {RUN_TIMEOUT_S} s")
            res.exit_code = proc.returncode
    finally:
        for host in hosts:  # the surviving host's worker leaves when the run ends
            try:
                host.wait(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                res.failures.append(f"worker {host.pid} still running after the run")
                os.killpg(host.pid, signal.SIGKILL)
        tree.stop()
    res.wall_s = time.monotonic() - started
    for log in [log_path, *(tmp / f"{tag}.host{n}.log" for n in range(len(hosts)))]:
        if crash := traceback_in(log):  # a process of the run crashed, whatever the exit code says
            res.failures.append(f"a traceback in {log.name}: {crash}")
    left = tree.leftovers(20 if plan.kind == "ctl-kill" else 10)
    if left:
        res.failures.append(f"processes left: {left}")
    run_id = _run_id(log_path)
    pids = {str(p) for p in tree.seen}
    new_shm = [n for n in _shm_names() - shm_before if (run_id and run_id in n) or any(f"-{pid}." in n for pid in pids)]
    if new_shm:
        res.failures.append(f"shm left: {sorted(new_shm)}")
        for n in new_shm:  # do not let one lost run pollute the next
            (SHM / n).unlink(missing_ok=True)
    if plan.kind == "ctl-kill":
        if hit_at is None:
            res.note = "the run ended before the kill"
            if res.exit_code != 0:
                res.failures.append(f"exit code {res.exit_code}")
        why = bundle_check(stem) if stem.parent.exists() else "no bundle folder"
        stray = stray_files(stem) if stem.parent.exists() else []
        if stray:
            res.note = f"left unreferenced by the sidecar: {', '.join(stray)}"
        if why is not None and (hit_at is not None or res.exit_code == 0):
            res.failures.append(f"bundle not loadable: {why}")
        elif why is None and hit_at is not None:  # nothing lost: the run resumed from it finishes the rest exactly
            res.failures += resume_check(plan, stem, epochs, step_s, tmp, tag)
        return res
    if res.exit_code != 0:
        res.failures.append(f"exit code {res.exit_code}")
    s = checked_summary(run, DATASET, epochs, res.failures)
    if s is None:
        return res
    if exact_model(plan):  # the eval is the mean of a parameter nothing trains: exactly 1 unless an average shrank it
        if s.get("final_eval") is None or abs(s["final_eval"] - 1.0) > 1e-6:
            res.failures.append(f"untrained parameter's mean {s.get('final_eval')}, want 1")
    elif s.get("final_eval") is None or s["final_eval"] <= EVAL_MIN:
        res.failures.append(f"final eval {s.get('final_eval')}")
    deaths, recoveries = s["deaths"], s["recoveries"]
    if plan.kind == "slow-build":
        if deaths:
            res.failures.append(f"deaths in a slow build: {deaths}")
        return res
    if plan.kind in ("kill", "stop", "host") and hit_at is None:
        res.landed = False
        res.note = "the run ended before the fault"
    if plan.kind == "stuck" and not deaths and res.exit_code == 0:
        res.landed = False  # the victim never reached that batch (a hung thread cannot finish a run)
        res.note = f"rank {plan.victim} never reached batch {plan.batch}"
    if plan.kind in SELF_KILLS and not deaths and res.exit_code == 0:
        res.landed = False
        res.note = f"rank {plan.victim} never reached {'window' if plan.kind == 'reported' else 'snapshot'} {plan.batch}"
    if not res.landed:
        if deaths:
            res.failures.append(f"deaths without a fault: {deaths}")
        return res
    if plan.kind == "host":  # every rank of the host lost, and only those
        if sorted(d["rank"] for d in deaths) != lost_ranks:
            res.failures.append(f"deaths {[d['rank'] for d in deaths]}, want the lost host's ranks {lost_ranks}")
        res.note = f"{'host powered off' if plan.whole else 'worker killed'}: ranks {lost_ranks} lost"
    elif len(deaths) != 1:
        res.failures.append(f"{len(deaths)} deaths, want 1: {deaths}")
    if plan.kind in ("stuck", *SELF_KILLS) and deaths and deaths[0]["rank"] != plan.victim:
        res.failures.append(f"rank {deaths[0]['rank']} died, rank {plan.victim} was the victim")
    if not recoveries:
        res.failures.append("no recovery")
        return res
    rec = recoveries[0]
    if plan.kind == "stuck":
        m = re.search(r"for ([0-9.]+) s", deaths[0]["reason"]) if deaths else None
        res.detect_s = float(m.group(1)) if m else None
    elif hit_at is not None:
        res.detect_s = rec["unix_time"] - hit_at
    res.again_s = recoveries[-1].get("training_again_s")  # a host's ranks may fall silent a beat apart: the last recovery
    if plan.kind in SELF_KILLS:  # what the ledger did with the window whose average was in flight
        res.note = f"{s.get('regranted_samples', 0)} samples granted again, {s.get('late_samples', 0)} late"
    if plan.heal:
        _check_heal(res, s, rec)
    return res


def checked_summary(run, dataset: int, epochs: int, failures: list[str]) -> dict | None:
    """The run's summary (None, a failure noted, if it wrote none), every epoch checked to have trained
    exactly its ``dataset`` samples, once (``failures`` names each epoch that did not)."""
    if not run.summary_path.exists():
        failures.append("no summary")
        return None
    summary: dict = run.summary()
    samples = epoch_samples(summary["history"])
    if samples != [dataset] * epochs:
        wrong = [f"epoch {e + 1}: {n}" for e, n in enumerate(samples) if n != dataset]
        failures.append(f"samples per epoch: {', '.join(wrong[:10]) or 'none wrong'} of {len(samples)} epochs, want {dataset} x {epochs}")
    return summary


def epoch_samples(history: list[dict]) -> list[int | None]:
    """Each epoch's own samples, in order, from the summary's rows: a row of epochs one average closed
    keeps each one's (``epoch_samples``); a long run's merged rows keep none (None: the runs set
    ``FLODL_SUMMARY_HISTORY_BYTES=0`` so that every row stays whole)."""
    out: list[int | None] = []
    for row in history:
        own = row.get("epoch_samples")
        out += [own.get(str(e)) if own else None for e in range(row.get("first_epoch", row["epoch"]), row["epoch"] + 1)]
    return out


def _check_heal(res: Result, s: dict, rec: dict) -> None:
    """Healing: exactly one restart, of the dead rank; when it joined, the world was back to full size."""
    restarts = s.get("restarts", [])
    if len(restarts) != 1 or (s["deaths"] and restarts[0]["replaces"] != s["deaths"][0]["rank"]):
        res.failures.append(f"restarts {restarts}, want one of the dead rank")
        return
    new = restarts[0]["rank"]
    joined = next((j for j in s.get("joins", []) if new in j["ranks"]), None)
    if joined is None:
        res.note = f"rank {new} (restarting rank {restarts[0]['replaces']}) had not joined when the run ended"
    elif joined["world"] != NPROC:
        res.failures.append(f"after the heal the world is {joined['world']}, want {NPROC}")
    else:
        res.healed_s = joined["unix_time"] - rec["unix_time"]


def torchrun_rows(runs: int, tmp: Path) -> list[Row]:
    """bench/faults.py's torchrun + DDP ``--max-restarts 3`` case, the same kill -9 of a worker."""
    from bench.faults import NPROC as TR_NPROC
    from bench.faults import torchrun_case

    again, restarted = [], []
    for i in range(runs):
        sub = tmp / f"torchrun-{i}"
        sub.mkdir()
        t = torchrun_case(4, sub)
        again.append(t["again_s"])
        restarted.append(t["restarted"])
        print(f"torchrun {i}: {t}", flush=True)
    case = "torchrun DDP kill"
    return [
        Row(case, "runs", runs, "runs"),
        Row(case, "kill to all again p50", percentile(again, 50), "s"),
        Row(case, "kill to all again max", percentile(again, 100), "s"),
        Row(case, "processes restarted", max(restarted), "processes", "whole world", min(restarted) == TR_NPROC),
    ]


def main() -> None:
    parser = size_parser(
        __doc__, f"{len(KINDS)} faults, one of each kind, shorter runs (under two minutes)", "one kill fault in a 2-epoch run"
    )
    parser.add_argument(
        "--faults", type=int, default=None, help=f"faults (runs) to inject (default {20 * len(KINDS)}: 20 of each kind; quick {len(KINDS)})"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault plan")
    parser.add_argument(
        "--kinds", default=None, help=f"comma-separated fault kinds to run, the others' runs left out of the plan (of {', '.join(KINDS)})"
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument(
        "--torchrun", type=int, default=None, help="torchrun elastic-restart runs on the same SIGKILL, side by side (default 1; quick 0)"
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes; report the runs done")
    parser.add_argument(
        "--name",
        default=None,
        help="results file name (bench/results/<name>.json; default chaos, chaos_<kinds> with --kinds, + _quick with --quick)",
    )
    parser.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="MINUTES",
        help="one run kept going about MINUTES with faults at random moments (bench/soak.py)",
    )
    parser.add_argument(
        "--mtbf", type=float, default=None, metavar="SECONDS", help="--soak: the mean time between faults (default 30; quick 10)"
    )
    parser.add_argument("--soak-mode", default="nccl-cadence", help="--soak: the run's --mode (default nccl-cadence)")
    parser.add_argument(
        "--flodl-args",
        default="",
        help="controller options every fault's run takes too, one shell-quoted string (e.g. '--sync-compression int8'): "
        "the faults then strike mid-compressed exchange",
    )
    a = parser.parse_args()
    if a.soak is not None or a.mtbf is not None:
        if a.flodl_args:
            parser.error("--flodl-args: only for the fault runs, not --soak")
        return _soak(parser, a)
    flodl_args = tuple(shlex.split(a.flodl_args))
    kinds = KINDS if a.kinds is None else tuple(k for k in a.kinds.split(",") if k)
    if unknown := sorted(set(kinds) - set(KINDS)):
        parser.error(f"--kinds: no fault kind {', '.join(unknown)} (the kinds: {', '.join(KINDS)})")
    per_kind = 1 if a.smoke or a.quick else 20
    if a.torchrun is None:
        a.torchrun = 0 if a.quick or a.smoke else 1
    epochs, step_s = (2, 0.05) if a.smoke else (4, 0.05) if a.quick else (8, 0.05)
    out_dir = smoke_results() if a.smoke else None
    tmp = Path(tempfile.mkdtemp(prefix="flodl-chaos-", dir=out_dir))  # a smoke's logs go with its results
    plans = plans_for(kinds, a.faults or (1 if a.smoke else per_kind * len(kinds)), per_kind, a.seed, epochs)
    count = len(plans)
    if a.smoke:  # the smoke's one kill stays a plain one (no restart to wait for)
        plans = [replace(p, heal=False) for p in plans]
    print(
        f"{count} faults, seed {a.seed}, {epochs} epochs x {DATASET} samples, {step_s * 1000:.0f} ms/step, "
        f"{a.parallel} at a time; logs in {tmp}",
        flush=True,
    )
    results: list[Result] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    stop_at = t0 + a.max_minutes * 60 if a.max_minutes else math.inf

    def one(plan: Plan) -> Result | None:
        if time.monotonic() > stop_at:
            return None
        try:
            r = run_one(plan, epochs, step_s, tmp, flodl_args)
        except Exception as exc:  # noqa: BLE001 - a bench bug must not hide the other runs
            r = Result(plan, failures=[f"bench error: {type(exc).__name__}: {exc}"])
        with lock:
            results.append(r)
            state = "LOST " + "; ".join(r.failures) if r.lost else ("ok" if r.landed else "not landed")
            state += f" ({r.note})" if r.note else ""
            det = "-" if r.detect_s is None else f"{r.detect_s:.2f}"
            again = "-" if r.again_s is None else f"{r.again_s:.2f}"
            print(
                f"[{len(results):3d}/{count} {time.monotonic() - t0:6.0f} s] {plan.kind:<10} {plan.mode:<12} "
                f"victim {plan.victim} at {plan.at:.2f} batch {plan.batch:3d}  detect {det:>5}  again {again:>5}  "
                f"start {r.start_s or 0:5.1f} wall {r.wall_s:5.1f}  {state}",
                flush=True,
            )
        return r

    with ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
        list(pool.map(one, plans))
    results.sort(key=lambda r: r.plan.index)
    cut = f" (stopped after {a.max_minutes:g} min: {len(results)} of {count} done)" if len(results) < count else ""
    rows = rows_for(results)
    if a.torchrun:
        try:
            rows += torchrun_rows(a.torchrun, tmp)
        except Exception as exc:  # noqa: BLE001
            print(f"torchrun comparison failed: {exc}", flush=True)
    lost = [f"#{r.plan.index} {r.plan.kind} {r.plan.mode}: {'; '.join(r.failures)} (log {r.log})" for r in results if r.lost]
    note = (
        f"{'smoke' if a.smoke else 'quick' if a.quick else 'full'}: {len(results)} faults{cut}, seed {a.seed}, {NPROC} CPU ranks, tiny task "
        f"{DATASET} samples x {epochs} epochs, {step_s * 1000:.0f} ms/step, heartbeat {HEARTBEAT_S} s, "
        f"{a.parallel} runs at a time; {time.monotonic() - t0:.0f} s" + (f"; every run with {' '.join(flodl_args)}" if flodl_args else "")
    )
    if lost:
        note += "\nlost runs:\n" + "\n".join(lost)
    # a quick check or a few kinds never replaces the committed full run
    name = "chaos" + ("" if kinds == KINDS else "_" + "_".join(k.replace("-", "_") for k in kinds))
    name += "_" + re.sub(r"[^a-z0-9]+", "_", " ".join(flodl_args).lower()).strip("_") if flodl_args else ""
    name += "_quick" if a.quick else ""
    report(a.name or name, rows, note=note, results=out_dir)
    print(f"logs in {tmp}")


def _soak(parser, a) -> None:
    """``--soak``: bench/soak.py's one long run (``--quick``: 45 s planned, a fault every 10 s on average)."""
    from bench.soak import SOAK_KINDS, soak_main

    if a.smoke:
        parser.error("--soak has no --smoke size: --quick is its short one")
    minutes = a.soak if a.soak is not None else 1.0
    mtbf = a.mtbf if a.mtbf is not None else 10.0 if a.quick else 30.0
    if a.quick:  # 45 s of training planned: with its faults and start-up, under two minutes in all
        minutes = min(minutes, 0.75)
    if minutes <= 0 or mtbf <= 0:
        parser.error(f"--soak {minutes:g} --mtbf {mtbf:g}: both must be positive")
    kinds = SOAK_KINDS if a.kinds is None else tuple(k for k in a.kinds.split(",") if k)
    if unknown := sorted(set(kinds) - set(SOAK_KINDS)):
        parser.error(f"--kinds: no soak fault kind {', '.join(unknown)} (the soak's kinds: {', '.join(SOAK_KINDS)})")
    soak_main(minutes, mtbf, kinds, a.seed, a.soak_mode, a.quick, a.name)


if __name__ == "__main__":
    main()
