"""Time to DDP's quality: how soon each system reaches what torchrun DDP reaches, on unequal ranks.

    python -m bench.matrix.target                 # every model, every system, 4:1 and 8:1, 3 seeds (hours: docs/benchmarks.md)
    python -m bench.matrix.target --quick         # the MLP, 1 seed, 4:1, four systems (about a minute here)
    python -m bench.matrix.target --models lenet --seeds 3 --results /tmp/ttt    # a slice, elsewhere

The matrix (``python -m bench.matrix``) compares systems at equal epochs; this
bench asks what a user buys: the time to a quality. Per model and seed:

1. *calibration*: flodl on one rank (``solo``) for ``calibrate_epochs``: its
   mean step time is the paced rank's base (``FLODL_SIMULATE_BASE_MS``, the DDP
   script's ``--base-ms``), as in the matrix (``--base-ms``, or the plan's fixed
   ``base_ms`` as the quick plan has, gives it instead);
2. *target*: torchrun DDP on 2 equal ranks for the model's *plateau budget*
   (``PLATEAU``: long enough that eval and loss have levelled off); its final
   eval and final training loss are the seed's target (``bench.matrix.reach.Goal``);
   a run has reached it at the first row with eval >= target - 0.005 (lower is
   better: the mirror) and training loss <= 1.05 x target;
3. *every system* (``SYSTEMS``: flodl's Cadence and Async on both backends, the
   default mode in script mode, torchrun DDP and post-local SGD) with rank 1
   paced ``RATIOS`` times slower, for at most ``CAP`` x the plateau budget's
   epochs, stopped once it reaches the target (``--no-early-stop``: runs the
   cap; the reading is the same): flodl gets SIGINT when its root record log
   shows a row that meets it, the DDP script stops itself (``--target-eval``,
   ``--target-loss``). Every run scores every epoch (its history rows), the
   script-mode runs too (``bench/matrix/script.py --eval-every-epoch``).

Read from each run's summary history (``bench.matrix.reach.first_reach``):

* *train s to target*: from the first batch to the close of the first row that
  met the target, the evals before it taken out (flodl's rows tile its
  training time; their ``eval_s`` is each eval's; the DDP script's rows say
  when they closed and what their eval took);
* *command s to target*: the same plus start-up, from the launch of the
  process (controller, or ``torchrun``) to the start of training;
* *epochs to target*: the epochs trained by then (a flodl row that closed
  several epochs counts them all);
* *not reached*: the run never met it within the cap (its times are then the
  whole run's, a lower bound).

Medians over the seeds with the lowest..highest seed (a seed that did not
reach counts as slower than any that did); speed-ups are paired by seed, over
torchrun DDP (and post-local SGD) at the same ratio. Each run's summary is kept
as ``<results>/<name>/<model>__<case>__seed<k>.json`` with ``matrix`` (the
matrix's block: command, times, pace) and ``ttt`` (target, reach) added, the
directory cleared first, ``suite.json`` beside them; the rows go to
``<results>/<name>.json`` (``name``: ``time_to_target``, or
``time_to_target_quick``; ``--results`` defaults to bench/results), and
``--doc`` writes the table into docs/benchmarks.md between the
``time_to_target`` markers.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import pace_probe
from bench.common import RESULTS, Row, machine, report, write_results
from bench.matrix import DOC, MODEL_ORDER, SOLO, SYSTEMS, TARGETS, Budget, Case, suite, system_case
from bench.matrix import report as matrix_report
from bench.matrix.reach import EVAL_TOLERANCE, LOSS_FACTOR, Goal, Reach, first_reach
from bench.matrix.tasks import SPECS

CAP = 3  # every system trains at most CAP x the plateau budget's epochs


@dataclass(frozen=True)
class Plateau:
    """A model's time-to-target plan: DDP's budget that sets the target, and the solo calibration's length."""

    budget: Budget  # torchrun DDP at 1:1 trains this; its final eval and loss are the target
    calibrate_epochs: int  # the solo run timing the paced rank's base step (the matrix's solo case, shorter)
    base_ms: float | None = None  # a fixed base step instead (no calibration run; --base-ms overrides both)


#: per plan: model -> its plateau budget. The samples are the matrix's (``PLANS["full"]``); the epochs are
#: past where DDP's eval levels off (the matrix's 3-4 epochs are not): logreg and the MLP plateau in eval
#: by about epoch 60 and 30 of theirs (bench/results/matrix/, DDP's history) and their loss keeps falling
#: slowly, the others are guesses at 3-5x the matrix's epochs; ``plateau_loss_drop`` in the results says
#: how much DDP's loss still fell over the budget's last quarter, and the table warns past PLATEAU_WARN
PLATEAU: dict[str, dict[str, Plateau]] = {
    "full": {
        "logreg": Plateau(Budget(1500, 480), 160),
        "mlp": Plateau(Budget(1500, 120), 40),
        "lenet": Plateau(Budget(8192, 16), 1),
        "char_gru": Plateau(Budget(4096, 20), 1),
        "char_lstm": Plateau(Budget(4096, 20), 1),
        "gpt_nano": Plateau(Budget(4096, 20), 1),
        "resnet20": Plateau(Budget(4096, 10), 1),
    },
    # the CI path: one small model, its loss still falling at 30 epochs (a target that is easy to miss), paced
    # against the MLP's step on the dev VM (0.45 ms, bench/results/matrix/) rather than a calibration run: it
    # is the run's slowest part, start-up mostly, and a loaded machine's calibration paces everything slower
    "quick": {"mlp": Plateau(Budget(1500, 30), 10, base_ms=0.5)},
}
RATIOS = {"full": (4, 8), "quick": (4,)}
#: every system of the full plan, in table order; --quick runs QUICK_SYSTEMS
FULL_SYSTEMS = ("nccl-cadence", "nccl-async", "cpu-cadence", "cpu-async", "script-nccl-cadence", "torchrun-ddp", "torchrun-postlocal")
QUICK_SYSTEMS = ("nccl-cadence", "script-nccl-cadence", "torchrun-ddp", "torchrun-postlocal")
BASELINE, POSTLOCAL = "torchrun-ddp", "torchrun-postlocal"
TARGET_CASE = system_case(BASELINE)  # torchrun DDP, 1:1: the run that sets the target
TARGET_TIMEOUT_S = 3600.0  # the target run's limit (ResNet-20's 10 epochs at 1:1 take a few minutes here)
PLATEAU_WARN = 0.10  # DDP's loss fell more than this share over the budget's last quarter: not a plateau
GOAL_RATIO = 4  # the ratio the issue's goals are stated at (8:1 reported, no goal)
GOAL_VS_DDP, GOAL_VS_DDP_MEDIAN, GOAL_VS_POSTLOCAL = 2.0, 2.5, 1.5  # issue 49


def names(quick: bool) -> tuple[str, str]:
    """``(plan, results name)``: a quick run never replaces the full run's results."""
    return ("quick", "time_to_target_quick") if quick else ("full", "time_to_target")


# ------------------------------------------------------------------ running


@dataclass(frozen=True)
class Options:
    """How a suite runs, beyond its plan."""

    seeds: int = 3
    base_ms: float | None = None  # the paced rank's base step (None: each seed's calibration measures it)
    lr_scaling: str = "linear"
    early_stop: bool = True
    timeout: float | None = None  # per run (None: from the target run's pace)
    steady_ms: float | None = None
    steady_wait_s: float = 1800.0
    steady_reruns: int = 2


def startup_s(summary: dict) -> float | None:
    """Seconds from the launch (the suite's, just before the process started) to the start of training."""
    launched = summary.get("matrix", {}).get("launched_unix")
    start = summary.get("start_unix") or (summary.get("trained_unix") or [None])[0]
    return None if launched is None or start is None else max(0.0, start - launched)


def reach_of(summary: dict, goal: Goal) -> Reach | None:
    """Where a run met ``goal`` (None: the run failed)."""
    if not matrix_report.ok(summary):
        return None
    return first_reach(summary, goal, startup_s(summary))


def plateau_drop(summary: dict) -> float | None:
    """How much the target run's training loss still fell over its last quarter: (loss at 3/4 - final) / loss at 3/4."""
    history = summary.get("history") or []
    if len(history) < 4:
        return None
    at = history[(3 * len(history)) // 4 - 1].get("loss")
    end = history[-1].get("loss")
    return None if not at or end is None else (at - end) / at


def run_timeout(target: dict, epochs: int, ratio: int, opts: Options) -> float:
    """A run's time limit: generous over the target run's pace (a paced DDP epoch takes about
    ``ratio`` x a 1:1 epoch; flodl's less), plus start-up."""
    if opts.timeout:
        return opts.timeout
    per_epoch = (matrix_report.train_wall(target) + (target.get("eval_s") or 0.0)) / max(1, len(target.get("history") or [1]))
    return 300.0 + 2.0 * ratio * per_epoch * epochs


def one_run(model: str, case: Case, budget: Budget, plan: str, timeout: float, setup: suite.Setup, opts: Options) -> dict:
    """One run between two pace probes (``--steady-ms``: waited for, a slowed run run again), as the matrix does."""
    result, pace = pace_probe.steady_run(
        functools.partial(suite.run_one, model, case, budget, f"time-to-target {plan}", timeout, TARGETS["cpu"], setup),
        opts.steady_ms,
        opts.steady_wait_s,
        reruns=opts.steady_reruns,
    )
    result["matrix"].update(pace)
    return result


def run_seed(model: str, seed: int, plan: str, cases: list[Case], opts: Options, save: Callable[[str, str, int, dict], None]) -> None:
    """One model's seed: calibration, target, then every case; each run saved as it ends."""
    plateau = PLATEAU[plan][model]
    budget = plateau.budget
    base = opts.base_ms or plateau.base_ms
    if base is None:
        calib = one_run(model, SOLO, Budget(budget.samples, plateau.calibrate_epochs), plan, 600.0, suite.Setup(seed=seed), opts)
        save(model, SOLO.id, seed, calib)
        base = suite.solo_base_ms(calib)
    target = one_run(
        model, TARGET_CASE, budget, plan, opts.timeout or TARGET_TIMEOUT_S, suite.Setup(seed=seed, lr_scaling=opts.lr_scaling), opts
    )
    if not matrix_report.ok(target):
        save(model, TARGET_CASE.id, seed, target)
        return  # no target for this seed: its cases are not run (the failure is in the table)
    goal = Goal.of(target)
    target["ttt"] = {"goal": goal.to_dict(), "plateau_loss_drop": plateau_drop(target)}
    target["ttt"].update(reach=_reach_dict(reach_of(target, goal)))
    save(model, TARGET_CASE.id, seed, target)
    cap = Budget(budget.samples, CAP * budget.epochs)
    for case in cases:
        if base is None and case.ratio > 1:
            save(model, case.id, seed, {"matrix": {"model": model, "case": case.id, "seed": seed, "error": "the calibration run failed"}})
            continue
        setup = suite.Setup(
            seed=seed, base_ms=base, lr_scaling=opts.lr_scaling, stop_at=goal if opts.early_stop else None, score_epochs=True
        )
        result = one_run(model, case, cap, plan, run_timeout(target, cap.epochs, case.ratio, opts), setup, opts)
        reach = reach_of(result, goal)
        result["ttt"] = {"goal": goal.to_dict(), "cap_epochs": cap.epochs, "reach": _reach_dict(reach)}
        if reach is not None and not reach.reached and result["matrix"].get("stopped"):
            # the watch reads a row's mean loss, the reading its last epoch's: they differ when the loss rose inside a
            # group of epochs; the run was stopped on a row that does not count. Said, not hidden: rerun it with --no-early-stop
            result["ttt"]["warning"] = "stopped early on a row whose mean loss met the target but whose last epoch's own loss did not"
        save(model, case.id, seed, result)


def _reach_dict(reach: Reach | None) -> dict | None:
    return None if reach is None else reach.to_dict()


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Outcome:
    """One seed of one cell: reached or not, and the times (to the target, or the whole run's)."""

    seed: int
    reached: bool
    train_s: float
    command_s: float | None
    epochs: int
    averages: int | None = None  # replica averages to the target (flodl's runs)


@dataclass
class Cell:
    """One (model, case) over its seeds."""

    outcomes: list[Outcome]
    errors: list[str]

    def by_seed(self) -> dict[int, Outcome]:
        return {o.seed: o for o in self.outcomes}

    @property
    def reached(self) -> int:
        return sum(o.reached for o in self.outcomes)


@dataclass(frozen=True)
class Stat:
    """Median and spread over seeds; ``*_reached`` False where that seed never reached (its value a bound)."""

    median: float
    low: float
    high: float
    median_reached: bool
    low_reached: bool
    high_reached: bool


def time_stat(values: list[tuple[float, bool]]) -> Stat | None:
    """Median (the higher middle one for an even count: the cautious side) and range of times;
    a seed that did not reach ranks after every seed that did."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (not v[1], v[0]))
    mid = ordered[len(ordered) // 2]
    return Stat(mid[0], ordered[0][0], ordered[-1][0], mid[1], ordered[0][1], ordered[-1][1])


def speedup_stat(pairs: list[tuple[float, bool]]) -> Stat | None:
    """Median (the lower middle one: the cautious side) and range of per-seed speed-ups; a seed whose
    system did not reach (its speed-up an upper bound) ranks below every seed that did."""
    if not pairs:
        return None
    ordered = sorted(pairs, key=lambda v: (v[1], v[0]))
    mid = ordered[(len(ordered) - 1) // 2]
    return Stat(mid[0], ordered[0][0], ordered[-1][0], mid[1], ordered[0][1], ordered[-1][1])


def speedups(cell: Cell, base: Cell, attr: str) -> list[tuple[float, bool]]:
    """Per seed both ran: base's time over the cell's (``attr``: train_s or command_s); False where the cell did
    not reach (an upper bound). Seeds where the baseline did not reach are left out (nothing to compare with)."""
    mine, theirs = cell.by_seed(), base.by_seed()
    out = []
    for seed, o in sorted(mine.items()):
        b = theirs.get(seed)
        if b is None or not b.reached or getattr(o, attr) is None or getattr(b, attr) is None or getattr(o, attr) <= 0:
            continue
        out.append((getattr(b, attr) / getattr(o, attr), o.reached))
    return out


def load(results: Path) -> tuple[dict, dict[str, dict[str, list[dict]]]]:
    """``(manifest, {model: {case id: [run, by seed]}})`` from a results directory (the matrix's layout)."""
    return matrix_report.load(results)


def cell_of(runs: list[dict]) -> Cell:
    outcomes, errors = [], []
    for s in runs:
        reach = (s.get("ttt") or {}).get("reach")
        if not matrix_report.ok(s) or reach is None:
            errors.append(str(s.get("matrix", {}).get("error", "no reading")))
            continue
        outcomes.append(
            Outcome(
                matrix_report.seed_of(s), reach["reached"], reach["train_s"], reach["command_s"], reach["epochs"], reach.get("averages")
            )
        )
    return Cell(outcomes, errors)


def _ratio(cid: str) -> int:
    """``8`` for ``cpu-async-8to1``, 1 for an id without a ratio."""
    tail = cid.rsplit("-", 1)[-1]
    return int(tail[: -len("to1")]) if tail.endswith("to1") and tail[: -len("to1")].isdigit() else 1


def _system(cid: str) -> str:
    return cid[: -len(f"-{_ratio(cid)}to1")] if _ratio(cid) > 1 else cid


def case_order(cases: dict[str, list[dict]]) -> list[str]:
    """The target run, then by ratio, each in FULL_SYSTEMS' order (the calibration runs left out)."""
    order = {s: i for i, s in enumerate((BASELINE, *FULL_SYSTEMS))}
    ids = [c for c in cases if c != SOLO.id]
    return sorted(ids, key=lambda c: (_ratio(c), order.get(_system(c), len(order)), c))


def _label(cid: str) -> str:
    try:
        case = system_case(_system(cid), _ratio(cid))
    except ValueError:
        return cid
    return case.label + (" (the target)" if case.id == TARGET_CASE.id else "")


def _is_flodl(cid: str) -> bool:
    return not cid.startswith("torchrun-") and cid != SOLO.id


def _unit(base: str, reached: bool, bound: str) -> str:
    return base if reached else f"{base}, not reached ({bound})"


def rows(runs: dict[str, dict[str, list[dict]]]) -> list[Row]:
    """The common results rows: per (model, case) the times, epochs and speed-ups (median, min, max), the targets, the goals."""
    out: list[Row] = []
    per_system: dict[str, list[tuple[str, Stat]]] = {}  # flodl system at the goal ratio -> its models' speed-ups over DDP
    for model in [m for m in MODEL_ORDER if m in runs] + sorted(m for m in runs if m not in MODEL_ORDER):
        cases = runs[model]
        targets = [s["ttt"]["goal"] for s in cases.get(TARGET_CASE.id, []) if matrix_report.ok(s) and "ttt" in s]
        if targets:
            out.append(Row(f"{model} target", "target eval (median)", statistics.median(t["eval"] for t in targets), targets[0]["metric"]))
            out.append(Row(f"{model} target", "target loss (median)", statistics.median(t["loss"] for t in targets), "loss"))
            drops = [d for d in (s["ttt"].get("plateau_loss_drop") for s in cases[TARGET_CASE.id] if "ttt" in s) if d is not None]
            if drops:
                out.append(
                    Row(f"{model} target", "DDP loss drop over the budget's last quarter (median)", statistics.median(drops), "fraction")
                )
        cells = {cid: cell_of(cases[cid]) for cid in case_order(cases)}
        for cid in cells:
            out += _cell_rows(model, cid, cells, per_system)
    for cid, models in per_system.items():  # the issue's goals across the models
        label = f"all models {_label(cid)}"
        medians = [st.median if st.median_reached else 0.0 for _, st in models]
        out.append(
            Row(
                label,
                "speedup_train_vs_ddp (median over models)",
                statistics.median(medians),
                "x",
                f"median >= {GOAL_VS_DDP_MEDIAN:g}x over the matrix models at {GOAL_RATIO}:1",
                statistics.median(medians) >= GOAL_VS_DDP_MEDIAN,
            )
        )
        out.append(
            Row(
                label,
                "speedup_train_vs_ddp (lowest model)",
                min(medians),
                "x",
                f">= {GOAL_VS_DDP:g}x on every matrix model at {GOAL_RATIO}:1",
                min(medians) >= GOAL_VS_DDP,
            )
        )
    return out


def _cell_rows(model: str, cid: str, cells: dict[str, Cell], per_system: dict[str, list[tuple[str, Stat]]]) -> list[Row]:
    """One cell's rows: failures, seeds reached, the times and epochs, its speed-ups over the torchrun baselines
    at its ratio with the issue's goals at 4:1 (a flodl cell's speed-up over DDP also goes into ``per_system``)."""
    cell, label = cells[cid], f"{model} {_label(cid)}"
    out = [Row(label, "failed runs", float(len(cell.errors)), "runs", None, False)] if cell.errors else []
    if not cell.outcomes:
        return out
    out.append(Row(label, "seeds reached", float(cell.reached), f"of {len(cell.outcomes)}"))
    for what, unit, pick in (
        ("train_s_to_target", "s", lambda o: o.train_s),
        ("command_s_to_target", "s", lambda o: o.command_s),
        ("epochs_to_target", "epochs", lambda o: float(o.epochs)),
        ("averages_to_target", "averages", lambda o: None if o.averages is None else float(o.averages)),
    ):
        st = time_stat([(pick(o), o.reached) for o in cell.outcomes if pick(o) is not None])
        if st is not None:
            out += _stat_rows(label, what, st, unit, "ran that long")
    ratio = _ratio(cid)
    for base_system, name in ((BASELINE, "ddp"), (POSTLOCAL, "postlocal")) if ratio > 1 else ():
        base_id = system_case(base_system, ratio).id
        if base_id == cid or base_id not in cells or (name == "postlocal" and not _is_flodl(cid)):
            continue
        for attr, kind in (("train_s", "train"), ("command_s", "command")):
            st = speedup_stat(speedups(cell, cells[base_id], attr))
            if st is None:
                continue
            goal = met = None
            if _is_flodl(cid) and ratio == GOAL_RATIO and kind == "train":
                want = GOAL_VS_DDP if name == "ddp" else GOAL_VS_POSTLOCAL
                versus = "torchrun DDP" if name == "ddp" else "post-local SGD"
                goal = f">= {want:g}x sooner than {versus} at {GOAL_RATIO}:1 (train time to DDP's target)"
                met = st.median_reached and st.median >= want
                if name == "ddp":
                    per_system.setdefault(cid, []).append((model, st))
            out += _stat_rows(label, f"speedup_{kind}_vs_{name}", st, "x", "upper bound", goal, met)
    return out


def _stat_rows(label: str, what: str, st: Stat, unit: str, bound: str, goal: str | None = None, met: bool | None = None) -> list[Row]:
    return [
        Row(label, f"{what} (median)", st.median, _unit(unit, st.median_reached, bound), goal, met),
        Row(label, f"{what} (min)", st.low, _unit(unit, st.low_reached, bound)),
        Row(label, f"{what} (max)", st.high, _unit(unit, st.high_reached, bound)),
    ]


# ------------------------------------------------------------------ the table


def _fmt(st: Stat | None, fmt: str, suffix: str = "", *, speed: bool = False) -> str:
    """``median (low–high)``; a bound marked ``>`` (a time that never reached) or ``<`` (a speed-up)."""
    if st is None:
        return "—"

    def one(v: float, reached: bool) -> str:
        return ("" if reached else ("<" if speed else ">")) + format(v, fmt) + suffix

    if st.low == st.high and st.low_reached == st.high_reached:
        return one(st.median, st.median_reached)
    return f"{one(st.median, st.median_reached)} ({one(st.low, st.low_reached)}–{one(st.high, st.high_reached)})"


def table(runs: dict[str, dict[str, list[dict]]]) -> str:
    """The markdown table: per model, the target, then every case's times to it and speed-ups."""
    out = [
        "| model | system | reached | train s to target | command s to target | epochs to target | train ×DDP | command ×DDP | train ×post-local |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in [m for m in MODEL_ORDER if m in runs] + sorted(m for m in runs if m not in MODEL_ORDER):
        cases = runs[model]
        cells = {cid: cell_of(cases[cid]) for cid in case_order(cases)}
        goals = [s["ttt"]["goal"] for s in cases.get(TARGET_CASE.id, []) if "ttt" in s]
        drops = [s["ttt"].get("plateau_loss_drop") for s in cases.get(TARGET_CASE.id, []) if "ttt" in s]
        if goals:
            ev = [g["eval"] for g in goals]
            lo = [g["loss"] for g in goals]
            drop = statistics.median([d for d in drops if d is not None] or [0.0])
            warn = f"; **DDP's loss still fell {drop:.0%} over the budget's last quarter: not a plateau**" if drop > PLATEAU_WARN else ""
            epochs = next((s["matrix"].get("epochs") for s in cases[TARGET_CASE.id] if "ttt" in s), "?")
            out.append(
                f"| **{model}** | target: DDP 1:1, {epochs} epochs | | {goals[0]['metric']} {statistics.median(ev):.4f} "
                f"({min(ev):.4f}–{max(ev):.4f}), loss {statistics.median(lo):.4f} ({min(lo):.4f}–{max(lo):.4f}){warn} | | | | | |"
            )
        for cid, cell in cells.items():
            if not cell.outcomes:
                out.append(f"| {model} | {_label(cid)} | failed: {'; '.join(e.splitlines()[0] for e in cell.errors)[:120]} | | | | | | |")
                continue
            ratio = _ratio(cid)
            vs: list[str] = []
            for base_system, attr in ((BASELINE, "train_s"), (BASELINE, "command_s"), (POSTLOCAL, "train_s")):
                base_id = system_case(base_system, ratio).id
                ok = ratio > 1 and base_id != cid and base_id in cells and (base_system == BASELINE or _is_flodl(cid))
                vs.append(_fmt(speedup_stat(speedups(cell, cells[base_id], attr)), ".2f", "×", speed=True) if ok else "")
            times = [
                time_stat([(getattr(o, a), o.reached) for o in cell.outcomes if getattr(o, a) is not None])
                for a in ("train_s", "command_s")
            ]
            epochs = time_stat([(float(o.epochs), o.reached) for o in cell.outcomes])
            out.append(
                f"| {model} | {_label(cid)} | {cell.reached}/{len(cell.outcomes)} | {_fmt(times[0], '.1f')} | {_fmt(times[1], '.1f')} | "
                f"{_fmt(epochs, '.0f')} | {' | '.join(vs)} |"
            )
    return "\n".join(out)


def note(manifest: dict) -> str:
    """The conditions of a suite's run, for the JSON and the doc."""
    return (
        f"{manifest['plan']} plan, {manifest['seeds']} seed(s), {manifest['runs']} runs in {manifest['elapsed_s']:.0f} s; "
        f"2 CPU ranks x 1 thread, batch 32 per rank, rank 1 paced {' and '.join(f'{r}:1' for r in manifest['ratios'])}; "
        f"target per seed = torchrun DDP 1:1's final eval and training loss at the plateau budget; reached = eval >= target - "
        f"{EVAL_TOLERANCE:g} and loss <= {LOSS_FACTOR:g} x target, per history row; every system capped at {CAP} x the "
        f"budget's epochs{', stopped once reached' if manifest['early_stop'] else ''}; train s = first batch to the row's close, "
        f"evals out; command s = start-up + train s; medians over seeds (a seed not reached ranks last), speed-ups paired by seed. "
        f"Plan: {manifest['covers']}"
    )


def covers(plan: str, models: list[str], systems: list[str], ratios: tuple[int, ...]) -> str:
    return (
        "; ".join(
            f"{m} ({PLATEAU[plan][m].budget.samples} samples, target {PLATEAU[plan][m].budget.epochs} epochs, "
            f"cap {CAP * PLATEAU[plan][m].budget.epochs})"
            for m in models
        )
        + f"; systems {', '.join(systems)} at {', '.join(f'{r}:1' for r in ratios)}."
    )


def render(manifest: dict, runs: dict[str, dict[str, list[dict]]]) -> str:
    """The doc's section between the ``time_to_target`` markers."""
    begin, end = matrix_report.markers("time_to_target")
    return "\n".join(
        [
            begin,
            "",
            f"Generated by `python -m bench.matrix.target{' --quick' if manifest['plan'] == 'quick' else ''} --doc` "
            f"({manifest['when']}, the code of {manifest.get('commit', '?')}; {manifest['elapsed_s']:.0f} s). "
            f"Machine: {manifest['machine']}.",
            "",
            note(manifest),
            "",
            "Each cell: median (lowest–highest seed); `>` a time that never reached the target (the whole run's, a "
            "lower bound), `<` a speed-up over a run that never reached (an upper bound).",
            "",
            table(runs),
            "",
            end,
        ]
    )


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the MLP, 1 seed, 4:1, four systems (about a minute here)")
    ap.add_argument("--models", default="", help="comma-separated subset of the plan's models")
    ap.add_argument("--systems", default="", help=f"comma-separated systems (known: {', '.join(SYSTEMS)})")
    ap.add_argument("--ratios", default="", help="comma-separated slow-rank ratios (default 4,8; 4 with --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; 1 with --quick)")
    ap.add_argument("--results", type=Path, default=None, help="where the runs and the JSON go (default bench/results)")
    ap.add_argument("--no-early-stop", action="store_true", help="every run trains its whole cap (the reading is the same)")
    ap.add_argument("--base-ms", type=float, default=None, help="the paced rank's base step in ms (default: each seed's calibration)")
    ap.add_argument("--lr-scaling", choices=("linear", "none"), default="linear", help="torchrun's LR rule (bench.matrix's)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default: from the target run's pace)")
    ap.add_argument(
        "--steady-ms", type=float, default=None, help="wait before each run until the pace probe reads at most MS (bench.matrix's)"
    )
    ap.add_argument("--steady-wait-s", type=float, default=1800.0, help="the longest wait for --steady-ms")
    ap.add_argument("--steady-reruns", type=int, default=2, help="with --steady-ms: reruns of a run the probe after read slow")
    ap.add_argument(
        "--doc",
        nargs="?",
        type=Path,
        const=DOC,
        default=None,
        help="write the table into docs/benchmarks.md, or FILE (between the time_to_target markers)",
    )
    ap.add_argument("--report", action="store_true", help="run nothing: rebuild the table and JSON from the results already there")
    args = ap.parse_args(argv)
    plan, name = names(args.quick)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    if seeds < 1:
        ap.error(f"--seeds must be at least 1, not {seeds}")
    if args.base_ms is not None and not args.base_ms > 0:
        ap.error(f"--base-ms must be > 0, not {args.base_ms}")
    if args.steady_ms is not None and args.steady_ms <= 0:
        ap.error(f"--steady-ms must be a positive pace in ms, not {args.steady_ms}")
    models = args.models.split(",") if args.models else list(PLATEAU[plan])
    unknown = [m for m in models if m not in PLATEAU["full"]]
    if unknown:
        ap.error(f"--models: unknown model(s) {unknown}; known: {', '.join(SPECS)}")
    systems = args.systems.split(",") if args.systems else list(QUICK_SYSTEMS if args.quick else FULL_SYSTEMS)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    try:
        ratios = tuple(int(r) for r in args.ratios.split(",")) if args.ratios else RATIOS[plan]
    except ValueError:
        ap.error(f"--ratios must be whole numbers like 4,8, not {args.ratios!r}")
    if any(r < 2 for r in ratios):
        ap.error(f"--ratios: each must be at least 2 (rank 1 that many times slower), not {args.ratios!r}")
    where = args.results or RESULTS
    results = where / name
    if args.report:
        manifest, runs = load(results)
        if not runs:
            print(f"no runs in {results}: run python -m bench.matrix.target{' --quick' if args.quick else ''} first", file=sys.stderr)
            return 1
        return _finish(manifest, runs, name, where, args.doc)
    # the full plan's budgets for a model the quick plan does not have
    plan_of = {m: (plan if m in PLATEAU[plan] else "full") for m in models}
    opts = Options(
        seeds=seeds,
        base_ms=args.base_ms,
        lr_scaling=args.lr_scaling,
        early_stop=not args.no_early_stop,
        timeout=args.timeout,
        steady_ms=args.steady_ms,
        steady_wait_s=args.steady_wait_s,
        steady_reruns=args.steady_reruns,
    )
    cases = [system_case(s, r) for r in ratios for s in systems]
    results.mkdir(parents=True, exist_ok=True)
    for old in [*results.glob("*__*.json"), results / matrix_report.MANIFEST]:
        old.unlink(missing_ok=True)
    calibrated = sum(args.base_ms is None and PLATEAU[plan_of[m]][m].base_ms is None for m in models)
    total = seeds * (len(models) * (len(cases) + 1) + calibrated)
    print(f"bench.matrix.target ({plan}, {seeds} seed(s)): {total} runs -> {results}", flush=True)
    start = time.perf_counter()
    done = [0]

    def save(model: str, cid: str, seed: int, result: dict) -> None:
        (results / matrix_report.run_file(model, cid, seed)).write_text(json.dumps(result, indent=1) + "\n")
        done[0] += 1
        print(f"[{done[0]}/{total} {time.perf_counter() - start:5.0f} s] {model} {cid} seed {seed}: {_said(result)}", flush=True)

    import torch

    manifest = {
        "plan": plan,
        "machine": machine(),
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": suite.commit(),
        "seeds": seeds,
        "ratios": list(ratios),
        "systems": systems,
        "early_stop": opts.early_stop,
        "cap": CAP,
        "lr_scaling": args.lr_scaling,
        "base_ms": args.base_ms,
        "covers": covers(plan, models, systems, ratios)
        if all(p == plan for p in plan_of.values())
        else covers("full", models, systems, ratios),
    }
    for model in models:
        for seed in range(seeds):
            run_seed(model, seed, plan_of[model], cases, opts, save)
        manifest.update(runs=done[0], elapsed_s=time.perf_counter() - start)
        (results / matrix_report.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _, runs = load(results)
        write_results(name, rows(runs), note=note(manifest), results=where)  # a suite cut short keeps the models it finished
    manifest.update(runs=done[0], elapsed_s=time.perf_counter() - start)
    (results / matrix_report.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    _, runs = load(results)
    return _finish(manifest, runs, name, where, args.doc)


def _said(result: dict) -> str:
    """One line on a run as it ends."""
    meta = result.get("matrix", {})
    if meta.get("error"):
        return f"FAILED {meta['error'].splitlines()[0]}"
    ttt = result.get("ttt") or {}
    reach = ttt.get("reach")
    head = f"train wall {meta.get('train_s', 0):.1f} s, command {meta.get('command_s') or 0:.1f} s"
    if "goal" in ttt and meta.get("case") == TARGET_CASE.id:
        g = ttt["goal"]
        return f"{head}; target {g['metric']} {g['eval']:.4f}, loss {g['loss']:.4f} (loss drop over the last quarter {ttt.get('plateau_loss_drop') or 0:.1%})"
    if not reach:
        return head
    if ttt.get("warning"):
        return f"{head}; WARNING {ttt['warning']}"
    if reach["reached"]:
        return f"{head}; reached in {reach['train_s']:.1f} s training, {reach['command_s'] or 0:.1f} s command, {reach['epochs']} epochs"
    return f"{head}; NOT reached in {reach['epochs']} epochs ({reach['train_s']:.1f} s training)"


def _finish(manifest: dict, runs: dict, name: str, where: Path, doc: Path | None) -> int:
    print()
    print(table(runs))
    report(name, rows(runs), note=note(manifest), results=where)
    if doc is not None:
        matrix_report.write_section(doc, render(manifest, runs), "time_to_target")
        print(f"wrote {doc}")
    failed = sum(1 for cases in runs.values() for ss in cases.values() for s in ss if not matrix_report.ok(s))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
