"""The matrix's report: tables into docs/benchmarks.md, loss-vs-time plots into docs/img/.

    python -m bench.matrix.report [--device cuda] [--results DIR] [--doc FILE] [--img DIR] [--no-plots]

Reads the runs a suite left in ``bench/results/matrix/`` (``python -m bench.matrix``)
and rewrites the part of ``docs/benchmarks.md`` between ``<!-- matrix:begin -->``
and ``<!-- matrix:end -->`` (appended at the end, markers included, if the
markers are absent; the rest of the file is left as it is), and draws
``docs/img/matrix_<model>.png`` (loss vs time, one line per case). ``--device
cuda`` does the same for a GPU suite (``python -m bench.matrix --device cuda``):
``bench/results/matrix_gpu/``, the ``matrix_gpu`` markers, ``matrix_gpu_<model>.png``. The plots need
matplotlib (``pip install 'flodl[bench]'``); without it the report stops with a
message saying so, unless ``--no-plots`` asks for the tables alone.

A case ran once per seed (``--seeds N``: ``<model>__<case>__seed<k>.json``;
an older single run, ``<model>__<case>.json``, reads as seed 0). What the
columns mean (every number comes from the kept run summaries):

* eval: the final held-out accuracy (per character for the language models),
  mean over the seeds, with the lowest..highest seed after it;
* final loss: the last epoch's mean training loss over all ranks' batches (median);
* train wall: ``wall_s - eval_s``: first dispatched batch to the end, evals
  taken out (start-up excluded); command: the whole command's wall time,
  process start to exit (flodl's controller, or ``torchrun``), measured by the
  suite around the subprocess; samples/s: training samples per train-wall
  second. All three are medians over the seeds;
* syncs: averaging rounds (flodl's ``syncs``; torchrun DDP: one all-reduce per
  step; post-local SGD: its DDP warm-up steps plus its model averages);
* step r0 / r1: each rank's mean step time (a simulated slow rank's sleep
  included: the pace it really ran at); slow/fast: the measured ratio, rank 1's
  mean step time over rank 0's (the 4:1 cases);
* idle r0 / r1: the share of the train wall a rank was not stepping (waiting
  on the average, on its peer, on the controller, on data);
* of ideal (4:1 flodl cells): train samples/s over the same seed's
  ``side-by-side-4to1`` rate: two solo runs started together, one paced 4:1,
  their rates added up (the ideal in the pair's own conditions: each rank with
  the other's process beside it, nothing averaged, nobody waiting); *of ideal,
  solo alone*: over solo rate x (1 + 1 / measured ratio), the solo rate being
  the same seed's ``solo`` run (one rank alone on the machine: stricter on a
  2-core VM, where a second process slows the first);
* train / DDP, command / DDP, eval − DDP: against torchrun DDP on the same
  ranks (equal, or 4:1), medians and means over seeds as above.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import pace_probe
from bench.common import Row
from bench.matrix import (
    BASELINE,
    BASELINE_POSTLOCAL,
    CASES,
    DOC,
    GOAL_EVAL_POINTS,
    GOAL_OF_IDEAL,
    GOAL_SPEEDUP,
    IMG_DIR,
    MODEL_ORDER,
    RATIO,
    SCRIPT_4TO1,
    SIDE_BY_SIDE,
    TARGETS,
    Target,
)


def markers(name: str) -> tuple[str, str]:
    """The comments that fence a suite's section of the doc."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers("matrix")
MANIFEST = "suite.json"
GOAL_CASES = (*(f"{m}-{RATIO}to1" for m in ("nccl-cadence", "nccl-async", "cpu-cadence", "cpu-async")), SCRIPT_4TO1.id)


class MissingMatplotlib(SystemExit):
    """Raised (the message on stderr, exit status 1) when the plots are asked for and matplotlib is not installed."""


# ------------------------------------------------------------------ reading


def run_file(model: str, case: str, seed: int) -> str:
    """The file name of one run in a results directory."""
    return f"{model}__{case}__seed{seed}.json"


def load(results: Path) -> tuple[dict, dict[str, dict[str, list[dict]]]]:
    """``(manifest, {model: {case id: [summary per seed, by seed]}})`` from a results directory."""
    manifest = {}
    if (results / MANIFEST).exists():
        manifest = json.loads((results / MANIFEST).read_text())
    runs: dict[str, dict[str, list[dict]]] = {}
    for path in sorted(results.glob("*__*.json")):
        summary = json.loads(path.read_text())
        meta = summary.setdefault("matrix", {})
        parts = path.stem.split("__")
        model, case = meta.get("model") or parts[0], meta.get("case") or parts[1]
        if "seed" not in meta:
            meta["seed"] = int(parts[2][4:]) if len(parts) > 2 and parts[2].startswith("seed") else 0
        runs.setdefault(model, {}).setdefault(case, []).append(summary)
    for cases in runs.values():
        for summaries in cases.values():
            summaries.sort(key=seed_of)
    return manifest, runs


def seed_of(s: dict) -> int:
    return int(s.get("matrix", {}).get("seed") or 0)


def train_wall(s: dict) -> float:
    return max(1e-9, s["wall_s"] - (s.get("eval_s") or 0.0))


def command_wall(s: dict) -> float | None:
    """The whole command, process start to exit (None where the suite did not time it)."""
    return s.get("matrix", {}).get("process_s")


def _per_rank_sums(s: dict) -> dict[int, list[float]]:
    acc: dict[int, list[float]] = {}
    for h in s.get("history", []):
        for r, part in (h.get("per_rank") or {}).items():
            a = acc.setdefault(int(r), [0.0, 0.0])
            a[0] += part.get("compute_ms", 0.0)
            a[1] += part.get("batches", 0)
    return acc


def idle_shares(s: dict) -> list[float]:
    """Per rank: the share of the train wall not spent stepping."""
    acc = _per_rank_sums(s)
    wall_ms = train_wall(s) * 1000.0
    return [max(0.0, 1.0 - acc[r][0] / wall_ms) for r in sorted(acc)]


def step_ms(s: dict) -> list[float]:
    """Per rank: mean ms per batch of compute (a simulated slow rank's sleep included: the speed it ran at)."""
    acc = _per_rank_sums(s)
    return [acc[r][0] / acc[r][1] if acc[r][1] else 0.0 for r in sorted(acc)]


def measured_ratio(s: dict) -> float | None:
    """How much slower rank 1 stepped than rank 0: its mean step time over rank 0's (4.0 at an exact 4:1)."""
    ms = step_ms(s)
    return ms[1] / ms[0] if len(ms) > 1 and ms[0] > 0 else None


def ideal_rate(solo: dict, ratio: float) -> float:
    """Samples/s an ideal pair would train: the solo rank's rate plus a rank ``ratio`` times slower."""
    return solo["train_samples_per_s"] * (1.0 + 1.0 / ratio)


def of_ideal(s: dict, solo: dict | None) -> tuple[float, float] | None:
    """``(fraction of ideal, ideal samples/s)`` of a pair's run against the solo run of the same set-up
    (None without a solo run or a measured ratio)."""
    ratio = measured_ratio(s)
    if not ok(solo) or not ratio or not solo.get("train_samples_per_s"):
        return None
    ideal = ideal_rate(solo, ratio)
    return s["train_samples_per_s"] / ideal, ideal


def of_ideal_side_by_side(s: dict, side_by_side: dict | None) -> tuple[float, float] | None:
    """``(fraction of ideal, ideal samples/s)`` of a pair's run against the side-by-side run of the
    same seed (two solo runs started together, one paced: their rates added up); None without it."""
    if not ok(side_by_side) or not side_by_side.get("train_samples_per_s"):
        return None
    ideal = side_by_side["train_samples_per_s"]
    return s["train_samples_per_s"] / ideal, ideal


def fast_step_vs_solo(s: dict, solo: dict | None) -> float | None:
    """Rank 0's (the fast rank's) mean compute per batch in a pair over the solo run's: how much
    slower the same step ran with a second rank and its traffic on the machine (1.0 = as fast as
    alone). Below 1 / this, no schedule can reach the ideal, which assumes the solo speed."""
    if not ok(solo):
        return None
    pair, alone = step_ms(s), step_ms(solo)
    return pair[0] / alone[0] if pair and alone and alone[0] > 0 else None


def ok(s: dict | None) -> bool:
    return s is not None and not s.get("matrix", {}).get("error") and s.get("wall_s") is not None


def eval_pct(s: dict) -> float | None:
    return None if s.get("final_eval") is None else s["final_eval"] * 100.0


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio_of(case_id: str) -> int:
    case = CASES.get(case_id)
    return case.ratio if case else (RATIO if case_id.endswith(f"-{RATIO}to1") else 1)


def _is_flodl_pair(case_id: str) -> bool:
    case = CASES.get(case_id)
    return case is not None and case.kind == "flodl" and case.nproc > 1


@dataclass
class Cell:
    """One (model, case) over its seeds: medians of the timings, the evals' mean and range."""

    runs: list[dict]  # the successful runs, by seed
    errors: list[str] = field(default_factory=list)  # one per failed run
    solo: list[dict] = field(default_factory=list)  # the model's solo runs (for "of ideal, solo alone")
    side_by_side: list[dict] = field(default_factory=list)  # the model's side-by-side runs (for "of ideal")

    @classmethod
    def of(cls, summaries: list[dict] | None, solo: list[dict] | None = None, side_by_side: list[dict] | None = None) -> Cell:
        summaries = summaries or []
        return cls(
            [s for s in summaries if ok(s)],
            [str(s.get("matrix", {}).get("error", "no summary")) for s in summaries if not ok(s)],
            [s for s in solo or [] if ok(s)],
            [s for s in side_by_side or [] if ok(s)],
        )

    @property
    def ok(self) -> bool:
        return bool(self.runs)

    @property
    def first(self) -> dict:
        return self.runs[0]

    def median(self, fn) -> float | None:
        return _median(fn(s) for s in self.runs)

    @property
    def train_s(self) -> float | None:
        return self.median(train_wall)

    @property
    def command_s(self) -> float | None:
        return self.median(command_wall)

    @property
    def rate(self) -> float | None:
        return self.median(lambda s: s.get("train_samples_per_s"))

    @property
    def evals(self) -> list[float]:
        return [e for e in map(eval_pct, self.runs) if e is not None]

    @property
    def eval_mean(self) -> float | None:
        return statistics.fmean(self.evals) if self.evals else None

    @property
    def ratio(self) -> float | None:
        return self.median(measured_ratio)

    def steps(self) -> list[float]:
        per = [step_ms(s) for s in self.runs]
        return [statistics.median(col) for col in zip(*per, strict=False)] if per and all(per) else []

    def idle(self) -> list[float]:
        per = [idle_shares(s) for s in self.runs]
        return [statistics.median(col) for col in zip(*per, strict=False)] if per and all(per) else []

    def _solo_for(self, s: dict) -> dict | None:
        """The solo run of the same seed (else the first solo run)."""
        return _same_seed(self.solo, s)

    def fast_step(self) -> float | None:
        """Median over the seeds of ``fast_step_vs_solo`` (each against its seed's solo run)."""
        got = [v for v in (fast_step_vs_solo(s, self._solo_for(s)) for s in self.runs) if v is not None]
        return statistics.median(got) if got else None

    def of_ideal_solo(self) -> tuple[float, float] | None:
        """Median ``(fraction of ideal, ideal samples/s)`` over the seeds, each against its seed's solo run."""
        return _medians([of_ideal(s, self._solo_for(s)) for s in self.runs])

    def of_ideal(self) -> tuple[float, float] | None:
        """Median ``(fraction of ideal, ideal samples/s)`` over the seeds, each against its seed's
        side-by-side run (where the results have none, older suites: against the solo run)."""
        if not self.side_by_side:
            return self.of_ideal_solo()
        return _medians([of_ideal_side_by_side(s, _same_seed(self.side_by_side, s)) for s in self.runs])


def _same_seed(runs: list[dict], s: dict) -> dict | None:
    """The run of ``s``'s seed among ``runs`` (else the first of them; None if there are none)."""
    same = [o for o in runs if seed_of(o) == seed_of(s)]
    return (same or runs or [None])[0]


def _medians(pairs: list[tuple[float, float] | None]) -> tuple[float, float] | None:
    got = [v for v in pairs if v is not None]
    return (statistics.median(v[0] for v in got), statistics.median(v[1] for v in got)) if got else None


def eval_delta(a: Cell, b: Cell) -> float | None:
    """Mean eval of ``a`` minus mean eval of ``b``, in points."""
    return None if a.eval_mean is None or b.eval_mean is None else a.eval_mean - b.eval_mean


def eval_text(c: Cell) -> str:
    """``mean%`` and, over several seeds, ``(min–max)``."""
    if c.eval_mean is None:
        return "—"
    spread = f" ({min(c.evals):.2f}–{max(c.evals):.2f})" if len(c.evals) > 1 else ""
    return f"{c.eval_mean:.2f}%{spread}"


def cells(runs: dict[str, dict[str, list[dict]]], model: str) -> dict[str, Cell]:
    cases = runs[model]
    return {cid: Cell.of(cases[cid], cases.get("solo"), cases.get(SIDE_BY_SIDE.id)) for cid in _ordered(cases)}


def _ordered(cases: dict) -> list[str]:
    known = [c for c in CASES if c in cases]
    return known + sorted(c for c in cases if c not in CASES)


def _models(runs: dict) -> list[str]:
    return [m for m in MODEL_ORDER if m in runs] + sorted(m for m in runs if m not in MODEL_ORDER)


def _label(cid: str) -> str:
    return CASES[cid].label if cid in CASES else cid


# ------------------------------------------------------------------- rows


def probes(runs: dict[str, dict[str, list[dict]]]) -> list[tuple[float, str]]:
    """Every run's machine-pace probe (bench/pace_probe.py: the slower of the one just before it
    and the one just after) with the run's name, in the suite's order; runs from before the probe have none."""
    return [
        (max(s["matrix"]["pace_probe_ms"], s["matrix"].get("pace_probe_after_ms") or 0.0), f"{model} {_label(cid)} seed {seed_of(s)}")
        for model in _models(runs)
        for cid in _ordered(runs[model])
        for s in runs[model][cid]
        if s.get("matrix", {}).get("pace_probe_ms")
    ]


def probe_text(runs: dict[str, dict[str, list[dict]]]) -> str:
    """How steady the machine was: the probes' spread and the runs that read slow (empty without probes)."""
    taken = probes(runs)
    spread = pace_probe.spread([ms for ms, _ in taken])
    if spread is None:
        return ""
    slow = [f"{name} ({ms:.3f} ms)" for ms, name in taken if ms > pace_probe.SLOW_FACTOR * spread["median"]]
    return (
        f"Machine pace: a 1-thread MLP step (`python -m bench.pace_probe`) timed before and after each of the "
        f"{len(taken)} runs (the slower of the two) read {spread['median']:.3f} ms median ({spread['min']:.3f}–{spread['max']:.3f}); "
        + (
            f"{len(slow)} run(s) read more than {pace_probe.SLOW_FACTOR:g}× the median, on a slowed machine: {', '.join(slow)}."
            if slow
            else f"none read more than {pace_probe.SLOW_FACTOR:g}× the median."
        )
    )


def rows(runs: dict[str, dict[str, list[dict]]]) -> list[Row]:
    """The common results rows (``bench/results/matrix.json``): per model x case, then the comparisons and goals."""
    out: list[Row] = []
    spread = pace_probe.spread([ms for ms, _ in probes(runs)])
    if spread is not None:  # the machine's own pace over the suite: a ratio is only as good as this
        out.append(Row("machine", "pace probe, median", spread["median"], "ms"))
        out.append(Row("machine", "pace probe, slowest / median", spread["max"] / spread["median"], "x"))
        out.append(Row("machine", f"runs probed > {pace_probe.SLOW_FACTOR:g}x median", float(spread["slow"]), "runs"))
    for model in _models(runs):
        by_case = cells(runs, model)
        for cid, c in by_case.items():
            label = f"{model} {_label(cid)}"
            if c.errors:
                out.append(Row(label, "failed runs", float(len(c.errors)), "runs", None, False))
            if not c.ok:
                continue
            out.append(Row(label, "seeds", float(len(c.runs)), "runs"))
            out.append(Row(label, "train wall (median)", c.train_s, "s"))
            if c.command_s is not None:
                out.append(Row(label, "command wall (median)", c.command_s, "s"))
            if c.rate is not None:
                out.append(Row(label, "train samples/s (median)", c.rate, "samples/s"))
            if c.evals:
                out.append(Row(label, "final eval (mean)", c.eval_mean, "%"))
                out.append(Row(label, "final eval (min)", min(c.evals), "%"))
                out.append(Row(label, "final eval (max)", max(c.evals), "%"))
            loss = c.median(lambda s: s.get("final_loss"))
            if loss is not None:
                out.append(Row(label, "final loss (median)", loss, "loss"))
            out.append(Row(label, "syncs (median)", c.median(lambda s: float(s.get("syncs") or 0)), "rounds"))
            ratio = _ratio_of(cid)
            if ratio > 1 and c.ratio is not None:
                out.append(Row(label, "measured ratio (slow/fast step)", c.ratio, "x"))
            if not _is_flodl_pair(cid):
                continue
            goal_case = cid in GOAL_CASES
            ideal = c.of_ideal() if ratio > 1 else None
            if ideal is not None:
                frac, rate = ideal
                out.append(Row(label, "ideal samples/s (median)", rate, "samples/s"))
                out.append(
                    Row(
                        label,
                        "of ideal (median)",
                        frac,
                        "fraction",
                        f">= {GOAL_OF_IDEAL:.2f} of ideal" if goal_case else None,
                        frac >= GOAL_OF_IDEAL if goal_case else None,
                    )
                )
                solo_alone = c.of_ideal_solo() if c.side_by_side else None
                if solo_alone is not None:
                    out.append(Row(label, "of ideal, solo alone (median)", solo_alone[0], "fraction"))
                fast = c.fast_step()
                if fast is not None:
                    out.append(Row(label, "fast rank's step, pair / solo (median)", fast, "x"))
            for base_id, name in ((BASELINE[ratio], "torchrun DDP"), (BASELINE_POSTLOCAL[ratio], "torchrun post-local")):
                base = by_case.get(base_id)
                if base is None or not base.ok:
                    continue
                goal = goal_case and base_id == BASELINE[ratio]
                at = f" {ratio}:1" if ratio > 1 else ""
                speedup = base.train_s / c.train_s
                out.append(
                    Row(
                        label,
                        f"train speed-up vs {name}{at}",
                        speedup,
                        "x",
                        f">= {GOAL_SPEEDUP:g}x" if goal else None,
                        speedup >= GOAL_SPEEDUP if goal else None,
                    )
                )
                if c.command_s and base.command_s:
                    out.append(Row(label, f"command speed-up vs {name}{at}", base.command_s / c.command_s, "x"))
                d = eval_delta(c, base)
                if d is not None:
                    out.append(
                        Row(
                            label,
                            f"eval - {name}{at} (means)",
                            d,
                            "points",
                            f">= -{GOAL_EVAL_POINTS:g} point" if goal else None,
                            d >= -GOAL_EVAL_POINTS if goal else None,
                        )
                    )
    return out


# ----------------------------------------------------------------- tables


def _f(v: float | None, fmt: str, dash: str = "—") -> str:
    return dash if v is None else format(v, fmt)


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _mark(met: bool) -> str:
    return "✔" if met else "✘"


def model_table(model: str, cases: dict[str, list[dict]]) -> str:
    by_case = {cid: Cell.of(cases[cid], cases.get("solo"), cases.get(SIDE_BY_SIDE.id)) for cid in _ordered(cases)}
    lines = [
        "| case | seeds | eval (min–max) | final loss | train wall | command | samples/s | syncs | step r0 / r1 | slow/fast "
        "| idle r0 / r1 | train / DDP | command / DDP | eval − DDP | others' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cid, c in by_case.items():
        label = _label(cid)
        if not c.ok:
            lines.append(
                f"| {label} | failed: {c.errors[0].splitlines()[0][:80] if c.errors else 'no summary'} "
                "|  |  |  |  |  |  |  |  |  |  |  |  |  |"
            )
            continue
        idle = " / ".join(f"{v * 100:.0f}%" for v in c.idle()) or "—"
        steps = " / ".join(f"{v:.2f}" for v in c.steps()) + " ms" if c.steps() else "—"
        seeds = f"{len(c.runs)}" + (f" ({len(c.errors)} failed)" if c.errors else "")
        case = CASES.get(cid)
        base = by_case.get(BASELINE[_ratio_of(cid)])
        tr = cr = d = None
        if case is not None and case.nproc > 1 and cid != BASELINE[case.ratio] and base is not None and base.ok:
            tr, d = c.train_s / base.train_s, eval_delta(c, base)
            cr = c.command_s / base.command_s if c.command_s and base.command_s else None
        others = [s.get("matrix", {}).get("others_cpu") for s in c.runs]
        others = max((o for o in others if o is not None), default=None)
        ratio = _x(c.ratio) if _ratio_of(cid) > 1 else "—"
        lines.append(
            f"| {label} | {seeds} | {eval_text(c)} | {_f(c.median(lambda s: s.get('final_loss')), '.4f')} "
            f"| {c.train_s:.2f} s | {_f(c.command_s, '.1f')} s | {_f(c.rate, ',.0f')} "
            f"| {_f(c.median(lambda s: float(s.get('syncs') or 0)), ',.0f')} | {steps} | {ratio} | {idle} "
            f"| {_x(tr)} | {_x(cr)} | {_f(d, '+.2f')} "
            f"| {_f(None if others is None else others * 100, '.0f')}{'%' if others is not None else ''} |"
        )
    return "\n".join(lines)


def goal_table(runs: dict[str, dict[str, list[dict]]]) -> str:
    lines = [
        f"| model | flodl case | slow/fast, flodl / DDP | of ideal (goal ≥ {GOAL_OF_IDEAL:.2f}) | of ideal, solo alone "
        f"| fast rank's step, pair / solo | train wall "
        f"| torchrun DDP {RATIO}:1 train wall | train speed-up (goal ≥ {GOAL_SPEEDUP:g}×) | command speed-up "
        f"| eval − DDP, means (goal ≥ −{GOAL_EVAL_POINTS:g}) | eval flodl / DDP (min–max) | train speed-up vs post-local |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in _models(runs):
        by_case = cells(runs, model)
        base, post = by_case.get(BASELINE[RATIO]), by_case.get(BASELINE_POSTLOCAL[RATIO])
        if base is None or not base.ok:
            continue
        for cid in GOAL_CASES:
            c = by_case.get(cid)
            if c is None or not c.ok:
                continue
            sp = base.train_s / c.train_s
            cmd = base.command_s / c.command_s if c.command_s and base.command_s else None
            d = eval_delta(c, base)
            dtext = "—" if d is None else f"{d:+.2f} {_mark(d >= -GOAL_EVAL_POINTS)}"
            ideal = c.of_ideal()
            itext = "—" if ideal is None else f"{ideal[0]:.2f} {_mark(ideal[0] >= GOAL_OF_IDEAL)}"
            alone = c.of_ideal_solo() if c.side_by_side else None
            pspeed = _x(post.train_s / c.train_s) if post is not None and post.ok else "—"
            lines.append(
                f"| {model} | {_label(cid)} | {_f(c.ratio, '.2f')}× / {_f(base.ratio, '.2f')}× | {itext} "
                f"| {_f(None if alone is None else alone[0], '.2f')} | {_f(c.fast_step(), '.2f')}× "
                f"| {c.train_s:.2f} s | {base.train_s:.2f} s | {sp:.2f}× {_mark(sp >= GOAL_SPEEDUP)} | {_x(cmd)} "
                f"| {dtext} | {eval_text(c)} / {eval_text(base)} | {pspeed} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def plans_text(target: Target = TARGETS["cpu"]) -> str:
    """What --quick and the full suite run, from PLANS."""
    from bench.matrix import PLANS

    def one(plan: dict) -> str:
        parts = []
        for model in [m for m in MODEL_ORDER if m in plan] + [m for m in plan if m not in MODEL_ORDER]:
            budget, cases = plan[model]
            what = f"all {len(CASES)} cases" if set(cases) == set(CASES) else ", ".join(f"`{c}`" for c in cases)
            parts.append(f"{model} {budget.samples:,} samples × {budget.epochs} epochs ({what})")
        return "; ".join(parts)

    if target.device == "cuda":
        head = (
            f"Plans: **`--device cuda --quick`** (1 seed): {one(PLANS['gpu-quick'])}. **`--device cuda`** (3 seeds): "
            f"{one(PLANS['gpu'])}. Both need 2 GPUs. The"
        )
    else:
        head = (
            f"Plans: **`--quick`** (1 seed; about 10 minutes here): {one(PLANS['quick'])}. **Full** (no flag; 3 seeds, "
            f"about 90 minutes here): {one(PLANS['full'])}. The"
        )
    return (
        f"{head} {len(CASES)} cases: `solo`, the six flodl modes on 2 equal "
        f"ranks, `torchrun-ddp`, `torchrun-postlocal`, and at {RATIO}:1 `{SIDE_BY_SIDE.id}` (the ideal), `nccl-cadence`, "
        f"`nccl-async`, `cpu-cadence`, `cpu-async`, `{SCRIPT_4TO1.id}` (script mode: the same training in the user's own "
        f"loop, `bench/matrix/script.py`; its eval the ranks' mean of their replicas' after the last epoch), "
        f"`torchrun-ddp`, `torchrun-postlocal`."
    )


_RANKS = {
    "cpu": (
        "2 CPU ranks of one intra-op thread each (solo: 1)",
        "flodl `Nccl*` modes average through gloo on CPU ranks. torchrun runs `bench/matrix/ddp.py` (gloo)",
        "its gradient all-reduce wait excluded from the compute it times",
    ),
    "cuda": (
        "2 CUDA ranks, one H200 each (solo: 1), the training set held on the GPU (flodl's VRAM pool; the DDP script copies it there once)",
        "flodl `Nccl*` modes average through NCCL; `Cpu*` modes on the controller's CPU. "
        "torchrun runs `bench/matrix/ddp.py --device cuda` (NCCL)",
        "its compute and its all-reduce wait told apart by CUDA events in the compute stream",
    ),
}


def protocol_text(manifest: dict, target: Target = TARGETS["cpu"]) -> list[str]:
    """The method paragraphs: how every cell was run (from the suite's manifest where it says)."""
    ranks, backends, excluded = _RANKS[target.device]
    seeds = manifest.get("seeds", 1)
    scaling = manifest.get("lr_scaling")
    base = manifest.get("base_ms")
    if scaling == "linear":
        lr = (
            "torchrun at its best reasonable setting, the linear scaling rule (`--lr-scaling linear`): DDP averages "
            "the gradients of world × batch samples, so at the task's LR it would take half of Local SGD's optimizer "
            "steps per sample; `torchrun-ddp` trains at LR × 2 (the world size) throughout (no model here has an LR "
            "schedule, so there is no schedule warm-up to keep), `torchrun-postlocal` at LR × 2 in its DDP warm-up "
            "and at the task's per-rank LR in its local phase (per-rank batches, like flodl)"
        )
    elif scaling == "none":
        lr = "torchrun at the task's LR (`--lr-scaling none`: no linear scaling)"
    else:
        lr = "torchrun at the task's LR (these runs predate `--lr-scaling`)"
    if "seeds" in manifest:
        pace = (
            f"In the {RATIO}:1 cases rank 1 is *paced* (`FLODL_SIMULATE_SLOWDOWN=1:{RATIO}` with "
            f"`FLODL_SIMULATE_BASE_MS`; `--slowdown`/`--base-ms`, the same rule, in the DDP script, {excluded}): "
            f"from its second step on, its step period is {RATIO} × the base step time, which is "
            + (
                "given on the command line (`--base-ms`)"
                if base
                else "the same seed's `solo` run's mean step time (same threads, same process launch)"
            )
            + f": it sleeps {RATIO} × base − its compute after each step, so the pair really steps {RATIO}:1 whatever "
            "a step right after a sleep costs. The *measured* ratio (rank 1's mean step time over rank 0's, sleep "
            "included) is reported for every such run."
        )
    else:
        pace = (
            f"In the {RATIO}:1 cases rank 1 sleeps {RATIO - 1}× its measured compute after every step but its first "
            f"(the protocol before issue 22, which overshoots: compute right after a sleep is slower), flodl's "
            f"`FLODL_SIMULATE_SLOWDOWN=1:{RATIO}` and the same rule in the DDP script, {excluded}."
        )
    return [
        f"Each cell: {ranks}, batch 32 per rank, the same seeded data, initial weights and sample budget in every "
        f"case, run with {seeds} seed{'s' if seeds != 1 else ''} (initial weights and shuffle; evals as mean and "
        f"lowest–highest seed, timings as medians). {backends}: DistributedDataParallel, and PyTorch's post-local "
        f"SGD (`post_localSGD_hook` + `PeriodicModelAverager`, period 4, DDP for the first 10% of an epoch), with "
        f"{lr}. {pace}",
        "",
        "Two times per run: *train wall* = first batch to the end with evals taken out (start-up excluded), and "
        "*command* = the whole command, process start to exit (flodl's controller, or `torchrun`), timed by the "
        "suite around the subprocess. Every speed-up says which of the two it divides. *of ideal* = flodl's train "
        f"samples/s over the same seed's `{SIDE_BY_SIDE.id}` run: two solo runs started together, the second paced "
        f"{RATIO}:1 like a pair's rank 1 (on fewer epochs, so that it outlasts the first), their training rates added "
        "up — what the two ranks train in the pair's own conditions (each beside the other's process on the same "
        f"cores) with nothing averaged and nobody waiting (goal ≥ {GOAL_OF_IDEAL:.2f} at {RATIO}:1 for Cadence and "
        "Async). *of ideal, solo alone* is the stricter figure: over solo rate × (1 + 1 / measured ratio), the solo "
        "rank alone on the machine, which a rank beside another process cannot match on 2 cores (*fast rank's "
        "step, pair / solo* shows by how much).",
        "",
        "Columns: eval = final held-out accuracy (per character for the language models), mean (lowest–highest "
        "seed); final loss = last epoch's mean training loss; samples/s = training samples per train-wall second; "
        "syncs = averaging rounds (DDP: one all-reduce per step); step r0 / r1 = each rank's mean step time (a "
        "simulated slow rank's sleep included: the pace it really ran at); slow/fast = the measured ratio; idle = "
        "share of the train wall a rank was not stepping; train / DDP, command / DDP and eval − DDP compare with "
        "torchrun DDP on the same ranks (equal or 4:1); *others' CPU* = the highest share of the machine's CPU "
        "that processes outside the run used while one of the case's runs ran (this VM is shared: read rows with "
        "a high share as slowed down).",
    ]


def render(manifest: dict, runs: dict[str, dict[str, list[dict]]], *, plots: bool, target: Target = TARGETS["cpu"]) -> str:
    """The markdown between the markers."""
    budget = manifest.get("budget", "?")
    begin, end = markers(target.name)
    flags = (" --device cuda" if target.device == "cuda" else "") + (" --quick" if budget.endswith("quick") else "")
    heading = "Model × mode matrix" + (" on GPUs" if target.device == "cuda" else "")
    out = [
        begin,
        "",
        f"### {heading} (`bench/results/{target.name}/`, `bench/results/{target.name}.json`)",
        "",
        f"Generated by `python -m bench.matrix.report{' --device cuda' if target.device == 'cuda' else ''}` from a "
        f"`python -m bench.matrix{flags}` run ({budget} budget, {manifest.get('when', '?')}"
        f"{', the code of ' + manifest['commit'] if manifest.get('commit') else ''}; the suite took "
        f"{_f(manifest.get('elapsed_s'), '.0f')} s).",
        f"Machine: {manifest.get('machine', '?')}; torch {manifest.get('torch', '?')}.",
        "",
    ]
    steady = probe_text(runs)
    if steady:
        if manifest.get("steady_ms"):
            steady += (
                f" The suite waited before each run until the probe read at most {manifest['steady_ms']:.3f} ms "
                f"(`--steady-ms`), so slow patches of the machine were waited out rather than measured"
            )
            reruns = sum(
                s["matrix"].get("pace_reruns", 0) for cases in runs.values() for seeds in cases.values() for s in seeds if "matrix" in s
            )
            steady += (
                f", and ran a case again when the probe after it read over that (up to {manifest['steady_reruns']} times): "
                f"{reruns} rerun(s)."
                if manifest.get("steady_reruns")
                else "."
            )
        out += [steady, ""]
    for amended in manifest.get("amended", []):  # bench/matrix/amend.py: models measured again since
        out += [
            (
                "Run since, adding those models (`python -m bench.matrix.amend`): "
                if set(amended.get("added", ())) == set(amended["models"])
                else "Re-run since, replacing those models' runs (`python -m bench.matrix.amend`): "
            )
            + f"{amended['when']}, "
            f"the code of {amended['commit']}, {amended['runs']} runs in {_f(amended.get('elapsed_s'), '.0f')} s"
            + (
                f", on another machine: {amended['machine']} (compare these models' cells with each other, not with the rest)"
                if amended.get("machine", manifest.get("machine")) != manifest.get("machine")
                else ""
            )
            + f": {amended['covers']}"
            + (
                f" Kept from before it (`--keep`: these cases run no flodl code): {', '.join(amended['kept'])}."
                if amended.get("kept")
                else ""
            ),
            "",
        ]
    if "seeds" not in manifest:
        out += [
            "**These tables predate the issue-22 protocol** (paced 4:1 with the measured ratio, torchrun with the "
            "linear LR scaling rule, several seeds, command time and of-ideal reported): regenerate them with "
            f"`python -m bench.matrix{flags}` and `python -m bench.matrix.report{' --device cuda' if target.device == 'cuda' else ''}`.",
            "",
        ]
    out += [*protocol_text(manifest, target), "", plans_text(target), ""]
    goals = goal_table(runs)
    if goals:
        out += [
            f"**Unequal ranks, {RATIO}:1.** Goals: issue 22's Cadence/Async ≥ {GOAL_OF_IDEAL:.2f} of ideal; issue 9's "
            f"Cadence/Async beat torchrun DDP by ≥ {GOAL_SPEEDUP:g}× in *train wall* with a mean eval not more than "
            f"{GOAL_EVAL_POINTS:g} point below DDP's (the *command* speed-up, start-up included, is beside it, with "
            f"no goal). *slow/fast* is the measured ratio of each side ({RATIO}.00× when the pair stepped exactly "
            f"{RATIO}:1). DDP reads about 1× for models with BatchNorm (ResNet-20): DDP broadcasts buffers at the "
            f"start of every forward, so its fast rank's step absorbs the wait for the slow one (the slow rank's "
            f"own step, which the simulation paces, is right).",
            "",
            goals,
            "",
        ]
    for model in _models(runs):
        cases = runs[model]
        meta = next((s.get("matrix", {}) for ss in cases.values() for s in ss if s.get("matrix", {}).get("title")), {})
        title = meta.get("title", model)
        out += [
            f"#### {title}",
            "",
            f"{meta.get('samples', '?')} samples × {meta.get('epochs', '?')} epochs; eval metric: {meta.get('metric', 'accuracy')}.",
            "",
            model_table(model, cases),
            "",
        ]
        if plots:
            out += [f"![{model}: loss vs time per mode](img/{target.name}_{model}.png)", ""]
    if plots:
        out += [
            "In the plots (each case's first seed), flodl's points are its sub-epoch window reports "
            "(`--reports-per-epoch 8`): the loss of the window just folded in. Sync and solo runs report one window "
            "per epoch, so they get one point per epoch (the epoch's mean loss, at its end). torchrun's points are "
            "the mean loss over each eighth of an epoch across ranks.",
            "",
        ]
    if manifest.get("covers"):
        out += [f"This run covered: {manifest['covers']}", ""]
    out.append(end)
    return "\n".join(out)


def write_section(doc: Path, section: str, name: str = "matrix") -> None:
    """Replace the text between the suite's markers (markers included); append them if absent."""
    begin, end = markers(name)
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + section + tail
    else:
        text = text + ("" if text.endswith("\n") or not text else "\n") + "\n" + section + "\n"
    doc.write_text(text)


# ------------------------------------------------------------------ plots


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(
            "bench.matrix.report: the loss-vs-time plots need matplotlib, which is not installed.\n"
            "Install it with: pip install 'flodl[bench]'  (or: pip install matplotlib)\n"
            "or pass --no-plots to write the tables alone."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {
    "solo": "0.55",
    "nccl-sync": "tab:blue",
    "nccl-cadence": "tab:orange",
    "nccl-async": "tab:green",
    "cpu-sync": "tab:purple",
    "cpu-cadence": "tab:red",
    "cpu-async": "tab:olive",
    "ddp": "black",
    "postlocal": "tab:brown",
}


def plot(model: str, cases: dict[str, list[dict]], path: Path) -> Path:
    """Loss vs seconds since the first batch: equal ranks on the left, 4:1 on the right (if there are such runs).

    flodl's points are its sub-epoch window reports (``--reports-per-epoch``):
    the loss of the window just reported, at the time it was folded in. Sync
    and solo runs report one window per epoch, so they get one point per epoch
    (that epoch's mean loss at its end). torchrun's points are the mean loss of
    each eighth of an epoch, across ranks, at its end. One run per case: its first successful seed.
    """
    plt = require_matplotlib()
    cases = {cid: next((s for s in runs if ok(s)), None) for cid, runs in cases.items()}
    ratios = [r for r in (1, RATIO) if any(ok(s) and _ratio_of(c) == r for c, s in cases.items())] or [1]
    fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios) + 0.5, 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, ratio in zip(axes, ratios, strict=False):
        drawn = 0
        for cid in _ordered(cases):
            s = cases[cid]
            if not ok(s) or _ratio_of(cid) != ratio:
                continue
            curve = s.get("matrix", {}).get("curve") or s.get("curve") or []
            if not curve:
                continue
            t, loss = zip(*curve, strict=False)
            case = CASES.get(cid)
            mode = "solo" if case is not None and case.nproc == 1 else (case.mode if case else cid)
            ax.plot(
                t,
                loss,
                linestyle="--" if case is not None and case.kind == "torchrun" else "-",
                marker="o",
                markersize=3,
                color=COLORS.get(mode),
                label=case.label if case else cid,
            )
            drawn += 1
        ax.set_title(f"{model}: {'equal ranks' if ratio == 1 else f'rank 1 {ratio}x slower'}")
        ax.set_xlabel("seconds since the first batch")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("training loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(TARGETS), default="cpu", help="which suite: CPU ranks, or GPUs (matrix_gpu)")
    ap.add_argument("--results", type=Path, default=None, help="default: bench/results/matrix[_gpu]")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--img", type=Path, default=IMG_DIR)
    ap.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    args = ap.parse_args(argv)
    if not args.no_plots:
        require_matplotlib()  # before touching anything
    target = TARGETS[args.device]
    results = args.results or target.results_dir
    manifest, runs = load(results)
    if not runs:
        print(
            f"no matrix runs in {results}: run python -m bench.matrix{' --device cuda' if target.device == 'cuda' else ''} [--quick] first",
            file=sys.stderr,
        )
        return 1
    written = []
    if not args.no_plots:
        for model in _models(runs):
            written.append(plot(model, runs[model], args.img / f"{target.name}_{model}.png"))
    write_section(args.doc, render(manifest, runs, plots=not args.no_plots, target=target), target.name)
    written.append(args.doc)
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
