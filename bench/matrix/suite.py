"""Run the matrix: every planned (model, case, seed) as a real run, one after another.

    python -m bench.matrix            # the full plan (PLANS["full"]: every model x every case, 3 seeds)
    python -m bench.matrix --quick    # PLANS["quick"], 1 seed (about 10 minutes on the 2-core dev VM)
    python -m bench.matrix --models lenet --cases solo,nccl-cadence --results /tmp/m   # a slice, elsewhere
    python -m bench.matrix --device cuda [--quick]   # 2 GPUs, NCCL: PLANS["gpu"] / PLANS["gpu-quick"]

Each flodl case is ``python -m flodl.controller --task bench.matrix.tasks:<model>``
with ``--summary-json`` and a record log (for the sub-epoch loss curve); each
torchrun case is ``python -m torch.distributed.run --standalone ... bench/matrix/ddp.py``.
Results: ``bench/results/matrix/<model>__<case>__seed<k>.json`` per run,
``suite.json`` (budget, seeds, machine, time taken), and
``bench/results/matrix.json`` (the common format; written only when the results
go to the default directory). With ``--device cuda`` every rank gets a GPU of
its own (flodl ``--devices cuda:0,cuda:1``, torchrun with NCCL) and everything
goes to ``matrix_gpu`` instead of ``matrix``.

The protocol (issue 22):

* every case is timed twice: *train wall* (the summary's ``wall_s - eval_s``,
  start-up excluded) and *command* (``process_s``: process start to exit, the
  controller's or torchrun's, timed here around the subprocess); both go into
  each run's ``matrix`` block (``train_s``, ``command_s``) and the rows;
* the 4:1 cases are *paced*: rank 1's step period is 4 x the base step time,
  the mean step time of the same seed's ``solo`` run (``FLODL_SIMULATE_BASE_MS``
  for flodl, ``--base-ms`` for the DDP script: the same rule,
  ``flodl.config.env.paced_step``): one base, the model's step alone, for
  every system, so the slow "device" is the same in flodl's pairs and
  torchrun's. ``--live-pace`` paces against the fast rank's running mean step
  in the pair instead (``FLODL_SIMULATE_PACE_FILE``, ``--pace-file``;
  flodl.testing.pace_board), within 1.5x of the base either way. Not the
  default: a fast rank's step that holds DDP's own overhead (or a wait for its
  peer: DDP's buffer broadcast) would make torchrun's slow device slower than
  flodl's. A plan with a 4:1 case and no ``solo`` gets ``solo``
  added (it calibrates), unless ``--base-ms`` gives the base. Every 4:1 run
  records its ``measured_ratio`` (rank 1's mean step time over rank 0's) and,
  for flodl, ``of_ideal``: train samples/s over the same seed's ``side-by-side-4to1``
  run's (two solo runs started together, one paced 4:1: each rank beside the
  other's process as in a pair, with no averaging; its rate is the two rates
  added up; added to any plan with a flodl 4:1 case), and ``of_ideal_solo``:
  over solo rate x (1 + 1 / measured ratio), the solo rank alone on the machine;
* torchrun runs with the linear LR scaling rule (``--lr-scaling``; see ddp.py);
* each case runs once per seed (``--seeds``): evals reported as mean and
  lowest..highest seed, timings as medians (bench/matrix/report.py);
* before and after every run the machine's pace is probed (bench/pace_probe.py,
  about 0.5 s): each run records ``pace_probe_ms`` and ``pace_probe_after_ms``,
  and the report states the spread and names the runs that read slow (a
  shared VM's speed drifts, and a ratio taken across a drift is wrong);
  ``--steady-ms MS`` waits before each run (up to ``--steady-wait-s``) until
  the probe reads at most MS, so a slow patch is waited out, not measured, and
  runs a case again (up to ``--steady-reruns``) when the probe after it reads
  over MS: a patch that began during the run took part of its timing.

Options:

--quick             the quick plan, 1 seed by default
--models M,...      a subset of the plan's models
--cases C,...       a subset of case ids (e.g. solo,nccl-cadence-4to1)
--device cpu|cuda   CPU ranks (gloo), or one GPU per rank (NCCL) and the gpu plans
--results DIR       where the runs go (cleared first; default bench/results/matrix[_gpu]); anywhere
                    else leaves bench/results/matrix.json alone (tests and slices use it)
--seeds N           runs per case, seeds 0..N-1 (default 3; 1 with --quick)
--resume            keep the finished runs already in --results (an interrupted suite) and run the rest
--lr-scaling linear|none   torchrun's LR rule (default linear: LR x world size for the all-reduced steps)
--base-ms MS        the 4:1 base step time in ms for every model (default: measured by each seed's solo run)
--samples N, --epochs N    override every model's budget (smoke tests)
--timeout S         seconds per run (default 240 quick, 1200 full)
--steady-ms MS      wait before each run until the pace probe reads at most MS (--steady-wait-s S, default 1800),
                    and run a case again when the probe after it reads over MS (--steady-reruns N, default 2)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import pace_probe
from bench.common import RunFailed, controller_command, machine, output_tail, report
from bench.matrix import CASES, MODEL_ORDER, PLANS, ROOT, SIDE_BY_SIDE, TARGETS, Budget, Case, Target
from bench.matrix import report as matrix_report
from bench.matrix.reach import Goal, RecordWatch
from bench.matrix.tasks import SAMPLES_ENV, SEED_ENV, SPECS
from flodl.config.env import SIMULATE_BASE_MS, SIMULATE_PACE_FILE, SIMULATE_SLOWDOWN, SUMMARY_HISTORY_BYTES
from flodl.errors import EXIT_INTERRUPTED

DDP_SCRIPT = ROOT / "bench" / "matrix" / "ddp.py"
SCRIPT = ROOT / "bench" / "matrix" / "script.py"  # the script-mode cases' training loop
REPORTS_PER_EPOCH = 8
#: extra controller flags every flodl run of a suite takes (an options study; empty: none)
EXTRA_ARGS_ENV = "FLODL_BENCH_FLODL_ARGS"


@dataclass(frozen=True)
class Setup:
    """How one run is made, beyond its model, case and budget."""

    seed: int = 0
    base_ms: float | None = None  # the 4:1 cases' base step time (None: the old, overshooting rule)
    lr_scaling: str = "linear"  # torchrun's LR rule
    live_pace: bool = False  # --live-pace: the 4:1 cases' base follows the fast rank's step as it runs
    # time to target (bench/matrix/target.py): stop the run once a row meets this goal (flodl: SIGINT
    # when its root record log says so; the DDP script: --target-eval/--target-loss)
    stop_at: Goal | None = None
    score_epochs: bool = False  # script mode scores every epoch (--eval-every-epoch), not the last only


def _env(samples: int, seed: int = 0) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"  # one core per rank: two ranks side by side on two cores
    env["PYTHONUNBUFFERED"] = "1"
    env[SAMPLES_ENV] = str(samples)
    env[SEED_ENV] = str(seed)
    env[SUMMARY_HISTORY_BYTES] = "0"  # every epoch's row whole: time to target reads each (flodl/controller/history.py)
    env.pop(SIMULATE_SLOWDOWN, None)
    env.pop(SIMULATE_BASE_MS, None)
    env.pop(SIMULATE_PACE_FILE, None)
    return env


def pace_board(tmp: Path, setup: Setup) -> str | None:
    """The live base's board for one run (a fresh file in its directory), or None (the default: a fixed base)."""
    return str(tmp / "pace.board") if setup.live_pace else None


def _cpu_busy_s() -> float:
    """Seconds of CPU the whole machine has been busy (all cores, /proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(v) for v in fh.readline().split()[1:9]]
        return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    except (OSError, ValueError, IndexError):
        return 0.0


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_run(
    cmd: list[str], env: dict[str, str], log: Path, timeout: float, stop: RecordWatch | None = None
) -> tuple[float, float | None]:
    """Run one command; returns its wall time and the share of the machine's CPU that
    other processes (not this command's tree) used meanwhile (None where /proc/stat is missing).
    ``stop``: polled while it runs; once it says True the command gets SIGINT (``timed_runs``)."""
    return timed_runs([(cmd, env, log)], timeout, stop)


#: how often a stop condition is polled (a row of the smallest models takes about 20 ms; a poll reads a few lines)
STOP_POLL_S = 0.2


def timed_runs(
    runs: list[tuple[list[str], dict[str, str], Path]], timeout: float, stop: RecordWatch | None = None
) -> tuple[float, float | None]:
    """Start every ``(command, environment, log)`` together and wait for all of them: their wall
    time (until the last exits) and the share of the machine's CPU that other processes used
    meanwhile. Any that fails, or outlives ``timeout``, fails the whole (the rest are killed).
    ``stop``: polled every ``STOP_POLL_S`` while they run; once it says True the first command
    gets SIGINT (flodl's controller then stops its ranks and writes its summary, exit status
    130), which is then no failure."""
    busy0, ours0 = _cpu_busy_s(), _children_cpu_s()
    start = time.perf_counter()
    procs: list[tuple[subprocess.Popen, Path]] = []
    interrupted = False
    try:
        for cmd, env, log in runs:
            with open(log, "w") as fh:  # the child keeps its own copy of the descriptor
                procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT), log))
        codes = []
        for proc, log in procs:
            while True:
                left = max(0.1, timeout - (time.perf_counter() - start))
                polling = stop is not None and not interrupted
                try:
                    codes.append(proc.wait(timeout=min(left, STOP_POLL_S) if polling else left))
                    break
                except subprocess.TimeoutExpired:
                    if time.perf_counter() - start >= timeout:
                        raise RunFailed(f"timed out after {timeout:.0f} s; log tail:\n{output_tail(log)}") from None
                if polling and stop():
                    procs[0][0].send_signal(signal.SIGINT)
                    interrupted = True
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    took = time.perf_counter() - start
    # whatever the machine did that this run's process trees did not (other users' jobs on a shared VM)
    others = (_cpu_busy_s() - busy0) - (_children_cpu_s() - ours0)
    share = max(0.0, others / (took * (os.cpu_count() or 1))) if busy0 else None
    for i, (code, (_, log)) in enumerate(zip(codes, procs, strict=True)):
        if code != 0 and not (interrupted and i == 0 and code == EXIT_INTERRUPTED):
            raise RunFailed(f"exit {code}; log tail:\n{output_tail(log)}")
    return took, share


def flodl_curve(logdir: Path) -> list[list[float]]:
    """[seconds since the first batch, loss] from the root's sub-epoch records (epoch records if there are none)."""
    from flodl.monitor.reader import load

    recs = load(logdir).get("root", [])
    meta = next((r for r in recs if r.get("kind") == "meta"), None)
    if meta is None:
        return []
    nodes = [r for r in recs if r.get("kind") == "node" and "loss" in r.get("metrics", {})]
    ticks = [r for r in nodes if "tick" in r] or [r for r in nodes if r.get("epoch_complete")]
    return [[(r["ts"] - meta["ts"]) / 1000.0, r["metrics"]["loss"]] for r in ticks]


def flodl_command(
    model: str,
    nproc: int,
    mode: str,
    epochs: int,
    seed: int,
    out: Path,
    target: Target,
    *,
    script: bool = False,
    score_epochs: bool = False,
) -> list[str]:
    """The controller's command line for one flodl run; its summary and record log go under ``out``.
    ``script``: the model in script mode (``SCRIPT``, its arguments after ``--``) instead of its Task;
    ``score_epochs``: the script scores every epoch, not the last only."""
    cmd = controller_command(
        f"bench.matrix.tasks:{model}",
        nproc_per_node=nproc,
        mode=mode,
        epochs=epochs,
        seed=seed,
        summary_json=out / "summary.json",
        no_progress=True,
        dashboard_port=-1,
        record_log_dir=out / "logs",
        reports_per_epoch=REPORTS_PER_EPOCH,
        devices=target.devices(nproc),
    )
    # a study of flodl's options (docs/benchmarks.md): FLODL_BENCH_FLODL_ARGS="--average-weights equal ..."
    # goes on every flodl command (before a script's own arguments)
    cmd += shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    if script:
        at = cmd.index("--task")
        cmd[at : at + 2] = ["--script", str(SCRIPT)]
        cmd += ["--", "--model", model, "--epochs", str(epochs)] + (["--eval-every-epoch"] if score_epochs else [])
    return cmd


def read_flodl_summary(out: Path, stopped: bool = False) -> dict:
    """The summary a finished flodl run left under ``out``, with its loss curve; RunFailed if it did not complete
    (``stopped``: the bench stopped it on purpose, with SIGINT: an interrupted run is what it wanted)."""
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise RunFailed(f"no summary written; log tail:\n{output_tail(out / 'run.log')}")
    summary = json.loads(summary_path.read_text())
    if summary.get("exit_reason") != "completed" and not (stopped and summary.get("exit_code") == EXIT_INTERRUPTED):
        raise RunFailed(f"exit_reason {summary.get('exit_reason')!r}")
    summary.setdefault("matrix", {})["curve"] = flodl_curve(out / "logs")
    if summary.get("final_eval") is None and summary.get("history"):
        # script mode: no controller-driven eval; the ranks report their replicas' after the last epoch
        scores = summary["history"][-1].get("scalars") or {}
        metric = next(iter(scores), None)
        if metric is not None:
            summary["final_eval"], summary["eval_metric_name"] = scores[metric], metric
    return summary


def flodl_case(
    model: str, case: Case, budget: Budget, tmp: Path, timeout: float, target: Target, setup: Setup = Setup()
) -> tuple[dict, tuple, str]:
    """One flodl run: its summary, ``(process_s, others_cpu)`` and the command line (environment included)."""
    cmd = flodl_command(
        model, case.nproc, case.mode, budget.epochs, setup.seed, tmp, target, script=case.script, score_epochs=setup.score_epochs
    )
    env = _env(budget.samples, setup.seed)
    prefix = [f"{SEED_ENV}={setup.seed}"]
    if case.ratio > 1:
        env[SIMULATE_SLOWDOWN] = f"1:{case.ratio}"
        prefix.append(f"{SIMULATE_SLOWDOWN}=1:{case.ratio}")
        if setup.base_ms:
            env[SIMULATE_BASE_MS] = f"1:{setup.base_ms:.4f}"
            prefix.append(f"{SIMULATE_BASE_MS}={env[SIMULATE_BASE_MS]}")
        board = pace_board(tmp, setup)
        if board:
            env[SIMULATE_PACE_FILE] = board
            prefix.append(f"{SIMULATE_PACE_FILE}={board}")
    watch = RecordWatch(tmp / "logs", setup.stop_at) if setup.stop_at else None
    launched = time.time()
    took = timed_run(cmd, env, tmp / "run.log", timeout, watch)
    summary = read_flodl_summary(tmp, stopped=bool(watch and watch.fired))
    # from the process start to the start of training, on the clock the summary's trained_unix uses
    summary["matrix"].update(launched_unix=launched, stopped=bool(watch and watch.fired))
    return summary, took, " ".join([*prefix, "python", *cmd[1:]])


#: the paced run of the side-by-side case trains this much longer than its fast partner (in
#: wall time), so the fast run has a paced process beside it from its first batch to its last
SIDE_BY_SIDE_MARGIN = 1.25


def side_by_side_case(
    model: str, case: Case, budget: Budget, tmp: Path, timeout: float, target: Target, setup: Setup = Setup()
) -> tuple[dict, tuple, str]:
    """The 4:1 cases' ideal in their own conditions: two solo runs started together, the second
    paced ``case.ratio``:1 (as rank 1 of a pair is) on fewer epochs so that it outlasts the first.
    Returns the fast run's summary with ``train_samples_per_s`` = the two runs' rates added up,
    the paced run's per-epoch records as rank 1's (so step times and the measured ratio read as
    a pair's), and both rates under ``side_by_side``."""
    if not setup.base_ms:
        raise RunFailed("the side-by-side case paces its second run from the solo run's step time; the solo run failed")
    fast_dir, slow_dir = tmp / "fast", tmp / "slow"
    fast_dir.mkdir()
    slow_dir.mkdir()
    slow_epochs = max(1, math.ceil(budget.epochs * SIDE_BY_SIDE_MARGIN / case.ratio))
    fast_cmd = flodl_command(model, 1, case.mode, budget.epochs, setup.seed, fast_dir, target)
    slow_cmd = flodl_command(model, 1, case.mode, slow_epochs, setup.seed, slow_dir, target)
    slow_env = _env(budget.samples, setup.seed)
    slow_env[SIMULATE_SLOWDOWN] = f"0:{case.ratio}"
    slow_env[SIMULATE_BASE_MS] = f"0:{setup.base_ms:.4f}"
    fast_env = _env(budget.samples, setup.seed)
    board = pace_board(tmp, setup)
    if board:  # the paced run follows the fast run's step, as rank 1 of a pair follows rank 0's
        fast_env[SIMULATE_PACE_FILE] = slow_env[SIMULATE_PACE_FILE] = board
    took = timed_runs([(fast_cmd, fast_env, fast_dir / "run.log"), (slow_cmd, slow_env, slow_dir / "run.log")], timeout)
    fast, slow = read_flodl_summary(fast_dir), read_flodl_summary(slow_dir)
    fast_rate, slow_rate = fast.get("train_samples_per_s") or 0.0, slow.get("train_samples_per_s") or 0.0
    summary = dict(fast)
    summary["train_samples_per_s"] = fast_rate + slow_rate
    summary["history"] = [
        *fast.get("history", []),
        # the paced run's only rank (0) reads as rank 1
        *({**h, "per_rank": {"1": (h.get("per_rank") or {}).get("0", {})}} for h in slow.get("history", [])),
    ]
    summary["side_by_side"] = {
        "fast_samples_per_s": fast_rate,
        "paced_samples_per_s": slow_rate,
        "paced_epochs": slow_epochs,
        "paced_train_s": matrix_report.train_wall(slow),
    }
    shared = f"{SEED_ENV}={setup.seed}" + (f" {SIMULATE_PACE_FILE}={board}" if board else "")  # both runs' variables
    pace = f"{SIMULATE_SLOWDOWN}={slow_env[SIMULATE_SLOWDOWN]} {SIMULATE_BASE_MS}={slow_env[SIMULATE_BASE_MS]}"
    return summary, took, f"{shared} python {' '.join(fast_cmd[1:])} & {shared} {pace} python {' '.join(slow_cmd[1:])}"


def torchrun_case(
    model: str, case: Case, budget: Budget, tmp: Path, timeout: float, target: Target, setup: Setup = Setup()
) -> tuple[dict, tuple, str]:
    """One torchrun run: its summary, ``(process_s, others_cpu)`` and the command line."""
    out = tmp / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(case.nproc),
        str(DDP_SCRIPT),
        "--model",
        model,
        "--algo",
        case.mode,
        "--epochs",
        str(budget.epochs),
        "--samples",
        str(budget.samples),
        "--out",
        str(out),
        "--device",
        target.device,
        "--seed",
        str(setup.seed),
        "--lr-scaling",
        setup.lr_scaling,
    ]
    if case.ratio > 1:
        cmd += ["--slowdown", f"1:{case.ratio}"]
        if setup.base_ms:
            cmd += ["--base-ms", f"1:{setup.base_ms:.4f}"]
        board = pace_board(tmp, setup)
        if board:
            cmd += ["--pace-file", board]
    if setup.stop_at:  # the script stops itself after the first epoch that meets it
        cmd += ["--target-eval", repr(setup.stop_at.eval), "--target-loss", repr(setup.stop_at.loss)]
    launched = time.time()
    took = timed_run(cmd, _env(budget.samples, setup.seed), tmp / "run.log", timeout)
    if not out.exists():
        raise RunFailed(f"no summary written; log tail:\n{output_tail(tmp / 'run.log')}")
    summary = json.loads(out.read_text())
    summary.setdefault("matrix", {}).update(
        curve=summary.pop("curve", []), launched_unix=launched, stopped=bool(summary.get("stopped_at_target"))
    )
    return summary, took, " ".join(["python", *cmd[1:]])


def run_one(
    model: str,
    case: Case,
    budget: Budget,
    budget_name: str,
    timeout: float,
    target: Target = TARGETS["cpu"],
    setup: Setup = Setup(),
    solo: dict | None = None,
    side_by_side: dict | None = None,
) -> dict:
    """One run; its summary with a ``matrix`` block (or only that block, with ``error``, if it failed).

    ``solo`` and ``side_by_side``: the same seed's solo and side-by-side runs, for the two
    ``of_ideal`` figures of a flodl 4:1 case.
    """
    spec = SPECS[model]
    meta = {
        "model": model,
        "title": spec.title,
        "case": case.id,
        "label": case.label,
        "kind": case.kind,
        "mode": case.mode,
        "nproc": case.nproc,
        "ratio": case.ratio,
        "seed": setup.seed,
        "samples": budget.samples,
        "epochs": budget.epochs,
        "batch": spec.batch,
        "metric": spec.metric,
        "budget": budget_name,
        "device": target.device,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if case.ratio > 1:
        meta["base_ms"] = setup.base_ms  # None: uncalibrated (the old rule, which overshoots)
        meta["pace"] = "live" if setup.live_pace else "fixed"  # live: the base follows the fast rank's step
    if case.kind == "torchrun":
        meta["lr_scaling"] = setup.lr_scaling
    with tempfile.TemporaryDirectory(prefix=f"flodl-matrix-{model}-") as td:
        try:
            runner = {"flodl": flodl_case, "side-by-side": side_by_side_case, "torchrun": torchrun_case}[case.kind]
            summary, (process_s, others), cmd = runner(model, case, budget, Path(td), timeout, target, setup)
        except RunFailed as exc:
            meta["error"] = str(exc)
            return {"matrix": meta}
    ran = summary.get("matrix", {})
    meta.update(process_s=process_s, others_cpu=others, command=cmd, curve=ran.get("curve", []))
    meta.update({k: ran[k] for k in ("launched_unix", "stopped") if k in ran})
    summary["matrix"] = meta
    meta.update(train_s=matrix_report.train_wall(summary), command_s=process_s)
    if case.kind == "torchrun":
        meta.update(lr=summary.get("config", {}).get("lr"), lr_ddp=summary.get("config", {}).get("lr_ddp"))
    if case.nproc > 1:
        meta["measured_ratio"] = matrix_report.measured_ratio(summary)
    if case.kind == "side-by-side":
        meta["measured_ratio"] = matrix_report.measured_ratio(summary)
    if case.kind == "flodl" and case.ratio > 1:
        ideal = matrix_report.of_ideal(summary, solo)
        meta.update(of_ideal_solo=ideal[0] if ideal else None, ideal_solo_samples_per_s=ideal[1] if ideal else None)
        ideal = matrix_report.of_ideal_side_by_side(summary, side_by_side)
        meta.update(of_ideal=ideal[0] if ideal else None, ideal_samples_per_s=ideal[1] if ideal else None)
    return summary


def solo_base_ms(solo: dict | None) -> float | None:
    """The base step time (ms) of the 4:1 cases: the solo run's mean step time (None if it failed)."""
    if not matrix_report.ok(solo):
        return None
    ms = matrix_report.step_ms(solo)
    return ms[0] if ms and ms[0] > 0 else None


def with_calibration(cases: tuple[str, ...], base_given: bool) -> tuple[str, ...]:
    """The cases to run: ``solo`` added in front when a 4:1 case needs it to calibrate its pace,
    and the side-by-side case when a flodl 4:1 case needs it for its ideal."""
    if any(CASES[c].kind == "flodl" and CASES[c].ratio > 1 for c in cases) and SIDE_BY_SIDE.id not in cases:
        cases = (SIDE_BY_SIDE.id, *cases)
    if base_given or "solo" in cases or not any(CASES[c].ratio > 1 for c in cases):
        return cases
    return ("solo", *cases)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def covers(plan: dict[str, tuple[Budget, tuple[str, ...]]]) -> str:
    parts = []
    for model in [m for m in MODEL_ORDER if m in plan]:
        budget, cases = plan[model]
        what = f"all {len(CASES)} cases" if set(cases) == set(CASES) else ", ".join(cases)
        parts.append(f"{model} ({budget.samples} samples × {budget.epochs} epochs): {what}")
    return "; ".join(parts) + "."


def commit() -> str:
    """The checkout's short commit (``+`` when it has uncommitted changes): recorded in a suite's manifest, so
    an amend names the code that ran, not the code that folded it in, or ``unknown``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty.strip() else "")


def suite_note(manifest: dict, target: Target) -> str:
    """The conditions of a suite's run, for ``bench/results/matrix[_gpu].json`` (and what re-ran since)."""
    ranks = "2 GPU ranks (NCCL), 1 intra-op thread each" if target.device == "cuda" else "2 CPU ranks x 1 thread"
    note = (
        f"{manifest['budget']} budget, {manifest['seeds']} seed(s), {manifest['runs']} runs in {manifest['elapsed_s']:.0f} s "
        f"({manifest['failed']} failed); {ranks} (solo: 1), "
        f"batch 32 per rank; train wall = wall_s - eval_s (start-up excluded), command wall = process start to exit; "
        f"medians over seeds, evals mean/min/max; 4:1 = rank 1 paced to 4 x "
        f"{'--base-ms' if manifest.get('base_ms') else 'the solo run' + chr(39) + 's step time'}"
        f"{', then live: 4 x the fast rank' + chr(39) + 's running mean step' if manifest.get('pace') == 'live' else ''}"
        f" (measured ratio reported); "
        f"of ideal = train samples/s / the side-by-side case's two rates added up (of ideal, solo alone = over "
        f"solo rate x (1 + 1/measured ratio)); torchrun LR scaling: {manifest['lr_scaling']}. "
        f"Covers: {manifest['covers']}"
    )
    probe = manifest.get("pace_probe_ms")
    if probe:  # bench/pace_probe.py around every run: how steady the machine was
        note += (
            f" Machine pace probe (1-thread MLP step) around each run, the slower of before and after: {probe['median']:.3f} ms median "
            f"({probe['min']:.3f}-{probe['max']:.3f}), {probe['slow']} run(s) over {pace_probe.SLOW_FACTOR:g}x the median."
        )
    for amended in manifest.get("amended", []):
        note += f" {'Added' if amended.get('added') else 'Re-run'} {amended['when']} (code of {amended['commit']}): {amended['covers']}"
        if amended.get("pace_probe_ms"):
            note += f" Its pace probe: {amended['pace_probe_ms']['median']:.3f} ms median, {amended['pace_probe_ms']['slow']} run(s) slow."
        if amended.get("kept"):
            note += f" Kept from before that re-run: {', '.join(amended['kept'])}."
    return note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick plan: lenet in every case, three other models in three (~10 min here)")
    ap.add_argument("--models", default="", help="comma-separated subset of the plan's models")
    ap.add_argument("--cases", default="", help="comma-separated subset of case ids (e.g. solo,nccl-cadence-4to1)")
    ap.add_argument(
        "--device",
        choices=sorted(TARGETS),
        default="cpu",
        help="cpu: CPU ranks (gloo); cuda: one GPU per rank (NCCL; needs 2 GPUs) and the gpu plans",
    )
    ap.add_argument("--results", type=Path, default=None, help="where the runs go (cleared first; default bench/results/matrix[_gpu])")
    ap.add_argument("--seeds", type=int, default=None, help="runs per case, seeds 0..N-1 (default 3; 1 with --quick)")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --results that finished without error and run only the rest (an interrupted suite)",
    )
    ap.add_argument(
        "--lr-scaling",
        choices=("linear", "none"),
        default="linear",
        help="torchrun's LR: linear = LR x world size for the all-reduced steps (default); none = the task's LR",
    )
    ap.add_argument(
        "--base-ms", type=float, default=None, help="the 4:1 cases' base step time in ms (default: each seed's solo run's mean step time)"
    )
    ap.add_argument(
        "--live-pace",
        action="store_true",
        help="pace the 4:1 cases live, against the fast rank's running mean step in the pair (within 1.5x of the base), "
        "not against the base alone",
    )
    ap.add_argument(
        "--steady-ms",
        type=float,
        default=None,
        help="before each run, wait until the machine's pace probe (python -m bench.pace_probe) reads at most MS "
        "(a shared VM's slow patches waited out, not measured; default: no wait, the probe only recorded)",
    )
    ap.add_argument(
        "--steady-wait-s",
        type=float,
        default=1800.0,
        help="the longest wait for --steady-ms before a run goes on anyway (default 1800)",
    )
    ap.add_argument(
        "--steady-reruns",
        type=int,
        default=2,
        help="with --steady-ms: run a case again when the probe after it reads over MS, up to N times (default 2)",
    )
    ap.add_argument("--samples", type=int, default=None, help="override every model's sample budget (smoke tests)")
    ap.add_argument("--epochs", type=int, default=None, help="override every model's epochs (smoke tests)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default 240 quick, 1200 full)")
    args = ap.parse_args(argv)
    target = TARGETS[args.device]
    results = args.results or target.results_dir
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    if args.steady_ms is not None and args.steady_ms <= 0:
        ap.error(f"--steady-ms must be a positive pace in ms (python -m bench.pace_probe reads one), not {args.steady_ms}")
    if args.steady_reruns < 0:
        ap.error(f"--steady-reruns must be 0 or more, not {args.steady_reruns}")
    if seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.base_ms is not None and not args.base_ms > 0:
        ap.error("--base-ms must be > 0")
    if target.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            ap.error(
                f"--device cuda needs 2 GPUs (one per rank: NCCL refuses two ranks on one GPU); "
                f"this machine has {torch.cuda.device_count()}"
            )
        budget_name = "gpu-quick" if args.quick else "gpu"
    else:
        budget_name = "quick" if args.quick else "full"
    plan = dict(PLANS[budget_name])
    if args.models:
        wanted = args.models.split(",")
        unknown = [m for m in wanted if m not in SPECS]
        if unknown:
            ap.error(f"unknown model(s) {unknown}; known: {', '.join(SPECS)}")
        plan = {m: plan.get(m, (PLANS["full"][m][0], tuple(CASES))) for m in wanted}
    if args.cases:
        wanted = args.cases.split(",")
        unknown = [c for c in wanted if c not in CASES]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        plan = {m: (b, tuple(c for c in wanted)) for m, (b, _) in plan.items()}
    if args.samples or args.epochs:
        budget_name += " (overridden)"
        plan = {m: (Budget(args.samples or b.samples, args.epochs or b.epochs), c) for m, (b, c) in plan.items()}
    plan = {m: (b, with_calibration(c, args.base_ms is not None)) for m, (b, c) in plan.items()}
    timeout = args.timeout or (240.0 if args.quick else 1200.0)

    results.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        for old in [*results.glob("*__*.json"), results / matrix_report.MANIFEST]:
            old.unlink(missing_ok=True)
    # per model, seed by seed, solo first: each seed's 4:1 cases are paced against that seed's solo run
    todo = [
        (m, seed, CASES[c])
        for m in MODEL_ORDER + tuple(m for m in plan if m not in MODEL_ORDER)
        if m in plan
        for seed in range(seeds)
        for c in CASES
        if c in plan[m][1]
    ]
    print(f"bench.matrix ({budget_name}, {seeds} seed{'s' if seeds > 1 else ''}): {len(todo)} runs -> {results}", flush=True)
    start = time.perf_counter()
    failed = 0
    solos: dict[tuple[str, int], dict] = {}
    side_by_sides: dict[tuple[str, int], dict] = {}
    probes: list[float] = []
    for i, (model, seed, case) in enumerate(todo, 1):
        budget = plan[model][0]
        done = _finished_run(results / matrix_report.run_file(model, case.id, seed)) if args.resume else None
        if done is not None:  # --resume: a run an interrupted suite finished stands (a failed one runs again)
            if case.id == "solo":
                solos[(model, seed)] = done
            if case.id == SIDE_BY_SIDE.id:
                side_by_sides[(model, seed)] = done
            print(f"[{i}/{len(todo)}] {model} {case.id} seed {seed}: kept from the interrupted suite", flush=True)
            continue
        solo = solos.get((model, seed))
        base = args.base_ms if args.base_ms is not None else solo_base_ms(solo)
        setup = Setup(seed=seed, base_ms=base if case.ratio > 1 else None, lr_scaling=args.lr_scaling, live_pace=args.live_pace)
        # the machine's pace just before and just after: a drift shows in the report (bench/pace_probe.py);
        # with --steady-ms a slow patch is waited out, and a run it overtook is run again, rather than measured
        result, pace = pace_probe.steady_run(
            functools.partial(run_one, model, case, budget, budget_name, timeout, target, setup, solo, side_by_sides.get((model, seed))),
            args.steady_ms,
            args.steady_wait_s,
            reruns=args.steady_reruns,
        )
        result["matrix"].update(pace)
        probe, after = pace["pace_probe_ms"], pace["pace_probe_after_ms"]
        probes.append(max(probe, after))
        if case.id == "solo":
            solos[(model, seed)] = result
        if case.id == SIDE_BY_SIDE.id:
            side_by_sides[(model, seed)] = result
        (results / matrix_report.run_file(model, case.id, seed)).write_text(json.dumps(result, indent=1) + "\n")
        took = time.perf_counter() - start
        head = f"[{i}/{len(todo)} {took:5.0f} s] {model} {case.id} seed {seed} (probe {probe:.3f}/{after:.3f} ms)"
        meta = result["matrix"]
        if "error" in meta:
            failed += 1
            print(f"{head}: FAILED {meta['error']}", flush=True)
            continue
        ev = result.get("final_eval")
        extra = ""
        if case.ratio > 1:
            extra = f", base {_num(meta.get('base_ms'), '.2f')} ms, measured ratio {_num(meta.get('measured_ratio'), '.2f')}"
            if case.kind == "flodl":
                extra += f", of ideal {_num(meta.get('of_ideal'), '.2f')} (solo alone: {_num(meta.get('of_ideal_solo'), '.2f')})"
        print(
            f"{head}: train wall {meta['train_s']:.2f} s, command {meta['command_s']:.1f} s, "
            f"eval {'-' if ev is None else f'{ev * 100:.2f}%'}, loss {result.get('final_loss') or 0:.4f}, "
            f"syncs {result.get('syncs')}{extra}, others' CPU {_pct(meta.get('others_cpu'))}",
            flush=True,
        )
    elapsed = time.perf_counter() - start
    import torch

    manifest = {
        "budget": budget_name,
        "device": target.device,
        "machine": machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit(),
        "elapsed_s": elapsed,
        "runs": len(todo),
        "failed": failed,
        "seeds": seeds,
        "lr_scaling": args.lr_scaling,
        "base_ms": args.base_ms,
        "pace": "live" if args.live_pace else "fixed",
        "pace_probe_ms": pace_probe.spread(probes),  # bench/pace_probe.py, around every run (the slower of the two)
        "steady_ms": args.steady_ms,
        "steady_reruns": args.steady_reruns if args.steady_ms else 0,
        "covers": covers(plan),
        "plan": {m: {"samples": b.samples, "epochs": b.epochs, "cases": list(c)} for m, (b, c) in plan.items()},
    }
    (results / matrix_report.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    _, runs = matrix_report.load(results)
    rows = matrix_report.rows(runs)
    if results.resolve() == target.results_dir.resolve():
        report(target.name, rows, note=suite_note(manifest, target))
    else:
        for r in rows:
            print(f"{r.case:<34}{r.metric:<40}{r.value:>10.3f} {r.unit:<9} {r.goal or ''} {'' if r.met is None else r.met}")
    print(f"suite took {elapsed:.0f} s")
    return 1 if failed else 0


def _finished_run(path: Path) -> dict | None:
    """A run file an earlier suite wrote and finished without error, else None (it runs again)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if "error" not in result.get("matrix", {"error": None}) else None
