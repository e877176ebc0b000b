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

What the columns mean (every number comes from the kept run summaries):

* final loss: the last epoch's mean training loss over all ranks' batches;
* eval: the final held-out accuracy (per character for the language models);
* train wall: ``wall_s - eval_s``: first dispatched batch to the end, evals
  taken out (process start-up is never counted; "process" is the whole
  command, start-up included);
* syncs: averaging rounds (flodl's ``syncs``; torchrun DDP: one all-reduce per
  step; post-local SGD: its DDP warm-up steps plus its model averages);
* idle r0 / r1: the share of the train wall a rank was not computing (waiting
  on the average, on its peer, on the controller, on data), from the per-epoch
  ``compute_ms`` of each rank (a simulated slow rank's sleep counts as compute);
* wall / DDP, eval - DDP: against torchrun DDP on the same ranks (equal, or 4:1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import Row
from bench.matrix import (BASELINE, BASELINE_POSTLOCAL, CASES, DOC, GOAL_EVAL_POINTS, GOAL_SPEEDUP, IMG_DIR, MODEL_ORDER, RATIO,
                          TARGETS, Target)


def markers(name: str) -> tuple[str, str]:
    """The comments that fence a suite's section of the doc."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers("matrix")
MANIFEST = "suite.json"
GOAL_CASES = tuple(f"{m}-{RATIO}to1" for m in ("nccl-cadence", "nccl-async", "cpu-cadence", "cpu-async"))


class MissingMatplotlib(SystemExit):
    """Raised (the message on stderr, exit status 1) when the plots are asked for and matplotlib is not installed."""


# ------------------------------------------------------------------ reading


def load(results: Path) -> tuple[dict, dict[str, dict[str, dict]]]:
    """``(manifest, {model: {case id: summary}})`` from a results directory."""
    manifest = {}
    if (results / MANIFEST).exists():
        manifest = json.loads((results / MANIFEST).read_text())
    runs: dict[str, dict[str, dict]] = {}
    for path in sorted(results.glob("*__*.json")):
        summary = json.loads(path.read_text())
        meta = summary.get("matrix", {})
        model, case = meta.get("model"), meta.get("case")
        if model is None or case is None:
            model, _, case = path.stem.partition("__")
        runs.setdefault(model, {})[case] = summary
    return manifest, runs


def train_wall(s: dict) -> float:
    return max(1e-9, s["wall_s"] - (s.get("eval_s") or 0.0))


def idle_shares(s: dict) -> list[float]:
    """Per rank: the share of the train wall not spent computing."""
    compute: dict[int, float] = {}
    for h in s.get("history", []):
        for r, part in (h.get("per_rank") or {}).items():
            compute[int(r)] = compute.get(int(r), 0.0) + part.get("compute_ms", 0.0)
    wall_ms = train_wall(s) * 1000.0
    return [max(0.0, 1.0 - compute[r] / wall_ms) for r in sorted(compute)]


def step_ms(s: dict) -> list[float]:
    """Per rank: mean ms per batch of compute (a simulated slow rank's sleep included: the speed it ran at)."""
    acc: dict[int, list[float]] = {}
    for h in s.get("history", []):
        for r, part in (h.get("per_rank") or {}).items():
            a = acc.setdefault(int(r), [0.0, 0.0])
            a[0] += part.get("compute_ms", 0.0)
            a[1] += part.get("batches", 0)
    return [acc[r][0] / acc[r][1] if acc[r][1] else 0.0 for r in sorted(acc)]


def effective_ratio(s: dict) -> float | None:
    """How much slower rank 1 stepped than rank 0 (4.0 when the simulation is exactly 4:1)."""
    ms = step_ms(s)
    return ms[1] / ms[0] if len(ms) > 1 and ms[0] > 0 else None


def ok(s: dict | None) -> bool:
    return s is not None and not s.get("matrix", {}).get("error") and s.get("wall_s") is not None


def eval_pct(s: dict) -> float | None:
    return None if s.get("final_eval") is None else s["final_eval"] * 100.0


def _delta(a: dict, b: dict) -> float | None:
    ea, eb = eval_pct(a), eval_pct(b)
    return None if ea is None or eb is None else ea - eb


def _ordered(cases: dict[str, dict]) -> list[str]:
    known = [c for c in CASES if c in cases]
    return known + sorted(c for c in cases if c not in CASES)


def _models(runs: dict) -> list[str]:
    return [m for m in MODEL_ORDER if m in runs] + sorted(m for m in runs if m not in MODEL_ORDER)


def _ratio_of(case_id: str) -> int:
    case = CASES.get(case_id)
    return case.ratio if case else (RATIO if case_id.endswith(f"-{RATIO}to1") else 1)


def _is_flodl_pair(case_id: str) -> bool:
    case = CASES.get(case_id)
    return case is not None and case.kind == "flodl" and case.nproc > 1


# ------------------------------------------------------------------- rows


def rows(runs: dict[str, dict[str, dict]]) -> list[Row]:
    """The common results rows (``bench/results/matrix.json``): per model x case, then the ratios and goals."""
    out: list[Row] = []
    for model in _models(runs):
        cases = runs[model]
        for cid in _ordered(cases):
            s, label = cases[cid], f"{model} {CASES[cid].label if cid in CASES else cid}"
            if not ok(s):
                out.append(Row(label, "failed", 0.0, "-", None, False))
                continue
            out.append(Row(label, "train wall", train_wall(s), "s"))
            if eval_pct(s) is not None:
                out.append(Row(label, "final eval", eval_pct(s), "%"))
            if s.get("final_loss") is not None:
                out.append(Row(label, "final loss", s["final_loss"], "loss"))
            out.append(Row(label, "syncs", float(s.get("syncs") or 0), "rounds"))
            if _ratio_of(cid) > 1 and effective_ratio(s) is not None:
                out.append(Row(label, "rank 1 / rank 0 step time", effective_ratio(s), "x"))
            if not _is_flodl_pair(cid):
                continue
            ratio = _ratio_of(cid)
            for base_id, name in ((BASELINE[ratio], "torchrun DDP"), (BASELINE_POSTLOCAL[ratio], "torchrun post-local")):
                base = cases.get(base_id)
                if not ok(base):
                    continue
                wr = train_wall(s) / train_wall(base)
                d = _delta(s, base)
                goal = cid in GOAL_CASES and base_id == BASELINE[ratio]
                if goal:
                    speedup = 1.0 / wr
                    out.append(Row(label, f"speed-up vs {name} {ratio}:1", speedup, "x", f">= {GOAL_SPEEDUP:g}x", speedup >= GOAL_SPEEDUP))
                    if d is not None:
                        out.append(Row(label, f"eval - {name} {ratio}:1", d, "points", f">= -{GOAL_EVAL_POINTS:g} point",
                                       d >= -GOAL_EVAL_POINTS))
                else:
                    out.append(Row(label, f"wall / {name}", wr, "x"))
                    if d is not None:
                        out.append(Row(label, f"eval - {name}", d, "points"))
    return out


# ----------------------------------------------------------------- tables


def _f(v: float | None, fmt: str, dash: str = "—") -> str:
    return dash if v is None else format(v, fmt)


def _mark(met: bool) -> str:
    return "✔" if met else "✘"


def model_table(model: str, cases: dict[str, dict]) -> str:
    lines = ["| case | final loss | eval | train wall | samples/s | syncs | step r0 / r1 | idle r0 / r1 | wall / DDP | eval − DDP "
             "| process | others' CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cid in _ordered(cases):
        s = cases[cid]
        label = CASES[cid].label if cid in CASES else cid
        if not ok(s):
            err = s.get("matrix", {}).get("error", "no summary") if s else "no summary"
            lines.append(f"| {label} | failed: {str(err).splitlines()[0][:80]} |  |  |  |  |  |  |  |  |  |  |")
            continue
        idle = " / ".join(f"{v * 100:.0f}%" for v in idle_shares(s)) or "—"
        steps = " / ".join(f"{v:.1f}" for v in step_ms(s)) + " ms" if step_ms(s) else "—"
        base = cases.get(BASELINE[_ratio_of(cid)])
        case = CASES.get(cid)
        vs = d = None
        if case is not None and case.nproc > 1 and cid != BASELINE[case.ratio] and ok(base):
            vs, d = train_wall(s) / train_wall(base), _delta(s, base)
        proc = s.get("matrix", {}).get("process_s")
        others = s.get("matrix", {}).get("others_cpu")
        lines.append(f"| {label} | {_f(s.get('final_loss'), '.4f')} | {_f(eval_pct(s), '.2f')}% | {train_wall(s):.2f} s "
                     f"| {s.get('train_samples_per_s', 0):,.0f} | {s.get('syncs', 0):,} | {steps} | {idle} "
                     f"| {_f(vs, '.2f')}{'×' if vs is not None else ''} | {_f(d, '+.2f')} | {_f(proc, '.1f')} s "
                     f"| {_f(None if others is None else others * 100, '.0f')}{'%' if others is not None else ''} |")
    return "\n".join(lines)


def goal_table(runs: dict[str, dict[str, dict]]) -> str:
    lines = [f"| model | flodl case | train wall | torchrun DDP {RATIO}:1 | speed-up (goal ≥ {GOAL_SPEEDUP:g}×) "
             f"| eval − DDP (goal ≥ −{GOAL_EVAL_POINTS:g}) | post-local {RATIO}:1 | speed-up vs post-local "
             f"| slow/fast step, flodl / DDP | DDP eval, {RATIO}:1 − equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in _models(runs):
        cases = runs[model]
        base, post = cases.get(BASELINE[RATIO]), cases.get(BASELINE_POSTLOCAL[RATIO])
        equal = cases.get(BASELINE[1])
        spread = _delta(base, equal) if ok(base) and ok(equal) else None
        for cid in GOAL_CASES:
            s = cases.get(cid)
            if not ok(s) or not ok(base):
                continue
            sp = train_wall(base) / train_wall(s)
            d = _delta(s, base)
            dtext = "—" if d is None else f"{d:+.2f} {_mark(d >= -GOAL_EVAL_POINTS)}"
            ptext = f"{train_wall(post):.2f} s" if ok(post) else "—"
            pspeed = f"{train_wall(post) / train_wall(s):.2f}×" if ok(post) else "—"
            ef, eb = effective_ratio(s), effective_ratio(base)
            lines.append(f"| {model} | {CASES[cid].label} | {train_wall(s):.2f} s | {train_wall(base):.2f} s "
                         f"| {sp:.2f}× {_mark(sp >= GOAL_SPEEDUP)} | {dtext} | {ptext} | {pspeed} "
                         f"| {_f(ef, '.1f')}× / {_f(eb, '.1f')}× | {_f(spread, '+.2f')} |")
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
        head = (f"Plans: **`--device cuda --quick`**: {one(PLANS['gpu-quick'])}. **`--device cuda`**: {one(PLANS['gpu'])}. "
                "Both need 2 GPUs. The")
    else:
        head = (f"Plans: **`--quick`** (under 10 minutes here): {one(PLANS['quick'])}. **Full** (no flag; about 30 "
                f"minutes here): {one(PLANS['full'])}. The")
    return (f"{head} {len(CASES)} cases: `solo`, the six flodl modes on 2 equal "
            f"ranks, `torchrun-ddp`, `torchrun-postlocal`, and at {RATIO}:1 `nccl-cadence`, `nccl-async`, `cpu-cadence`, "
            f"`cpu-async`, `torchrun-ddp`, `torchrun-postlocal`.")


_RANKS = {
    "cpu": ("2 CPU ranks of one intra-op thread each (solo: 1)", "flodl `Nccl*` modes average through gloo on CPU ranks. "
            "torchrun runs `bench/matrix/ddp.py` (gloo)", "its gradient all-reduce wait excluded from the compute it scales"),
    "cuda": ("2 CUDA ranks, one H200 each (solo: 1), the training set held on the GPU (flodl's VRAM pool; the DDP script "
             "copies it there once)", "flodl `Nccl*` modes average through NCCL; `Cpu*` modes on the controller's CPU. "
             "torchrun runs `bench/matrix/ddp.py --device cuda` (NCCL)",
             "its compute and its all-reduce wait told apart by CUDA events in the compute stream"),
}


def render(manifest: dict, runs: dict[str, dict[str, dict]], *, plots: bool, target: Target = TARGETS["cpu"]) -> str:
    """The markdown between the markers."""
    budget = manifest.get("budget", "?")
    begin, end = markers(target.name)
    ranks, backends, excluded = _RANKS[target.device]
    flags = (" --device cuda" if target.device == "cuda" else "") + (" --quick" if budget.endswith("quick") else "")
    heading = "Model × mode matrix" + (" on GPUs" if target.device == "cuda" else "")
    out = [begin, "", f"### {heading} (`bench/results/{target.name}/`, `bench/results/{target.name}.json`)", "",
           f"Generated by `python -m bench.matrix.report{' --device cuda' if target.device == 'cuda' else ''}` from a "
           f"`python -m bench.matrix{flags}` run ({budget} budget, {manifest.get('when', '?')}; the suite took "
           f"{_f(manifest.get('elapsed_s'), '.0f')} s).",
           f"Machine: {manifest.get('machine', '?')}; torch {manifest.get('torch', '?')}.", "",
           f"Each cell is one real run: {ranks}, batch 32 per rank, the same "
           f"seeded data, initial weights and sample budget in every case. {backends}: DistributedDataParallel, and PyTorch's post-local SGD "
           "(`post_localSGD_hook` + `PeriodicModelAverager`, period 4, DDP for the first 10% of an epoch). In the 4:1 "
           "cases rank 1 sleeps 3× its measured compute after every step but its first (set-up and warm-up; flodl's `FLODL_SIMULATE_SLOWDOWN=1:4`, and "
           f"the same rule in the DDP script, {excluded}).", "",
           "Columns: final loss = last epoch's mean training loss; eval = final held-out accuracy (per character for "
           "the language models); train wall = first batch to the end with evals taken out (start-up excluded; "
           "*process* is the whole command with start-up); syncs = averaging rounds (DDP: one all-reduce per step); "
           "step r0 / r1 = each rank's mean compute per batch (a simulated slow rank's sleep included: the pace it "
           "actually ran at); idle = share of the train wall a rank was not computing (that sleep counts as compute); "
           "wall / DDP and eval − DDP compare with torchrun DDP on the same ranks (equal or 4:1); *others' CPU* = the "
           "share of the machine's CPU that processes outside the run used while it ran (this VM is shared: read rows "
           "with a high share as slowed down).", "",
           plans_text(target), ""]
    goals = goal_table(runs)
    if goals:
        out += [f"**Unequal ranks, {RATIO}:1** (issue 9's goal: Cadence/Async beat torchrun DDP by ≥ {GOAL_SPEEDUP:g}× "
                f"with eval within {GOAL_EVAL_POINTS:g} point; read as not more than {GOAL_EVAL_POINTS:g} point below DDP). "
                f"*slow/fast step* is how much slower rank 1 actually stepped than rank 0 in each run ({RATIO}.0× when the "
                f"simulation is exact); above {RATIO}× the slow rank's measured compute, which the simulation multiplies, "
                f"was itself inflated, and that side faced a harsher ratio than {RATIO}:1. DDP reads about 1× for models with "
                f"BatchNorm (ResNet-20): DDP broadcasts buffers at the start of every forward, so its fast rank's step "
                f"absorbs the wait for the slow one (the slow rank's own step, which the simulation scales, is right). "
                f"The last column is the noise floor: DDP trains exactly the same steps on the same data at {RATIO}:1 as "
                f"on equal ranks, so any gap between its two evals is run-to-run variation (nondeterministic kernels on "
                f"GPUs; zero where the run is deterministic); eval gaps of that size say nothing.",
                "", goals, ""]
    for model in _models(runs):
        cases = runs[model]
        meta = next((s.get("matrix", {}) for s in cases.values() if s.get("matrix")), {})
        title = meta.get("title", model)
        out += [f"#### {title}", "",
                f"{meta.get('samples', '?')} samples × {meta.get('epochs', '?')} epochs; eval metric: "
                f"{meta.get('metric', 'accuracy')}.", "", model_table(model, cases), ""]
        if plots:
            out += [f"![{model}: loss vs time per mode](img/{target.name}_{model}.png)", ""]
    if plots:
        out += ["In the plots, flodl's points are its sub-epoch window reports (`--reports-per-epoch 8`): the loss of "
                "the window just folded in. Sync and solo runs report one window per epoch, so they get one point per "
                "epoch (the epoch's mean loss, at its end). torchrun's points are the mean loss over each eighth of an "
                "epoch across ranks.", ""]
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
            "or pass --no-plots to write the tables alone.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {"solo": "0.55", "nccl-sync": "tab:blue", "nccl-cadence": "tab:orange", "nccl-async": "tab:green",
          "cpu-sync": "tab:purple", "cpu-cadence": "tab:red", "cpu-async": "tab:olive", "ddp": "black", "postlocal": "tab:brown"}


def plot(model: str, cases: dict[str, dict], path: Path) -> Path:
    """Loss vs seconds since the first batch: equal ranks on the left, 4:1 on the right (if there are such runs).

    flodl's points are its sub-epoch window reports (``--reports-per-epoch``):
    the loss of the window just reported, at the time it was folded in. Sync
    and solo runs report one window per epoch, so they get one point per epoch
    (that epoch's mean loss at its end). torchrun's points are the mean loss of
    each eighth of an epoch, across ranks, at its end.
    """
    plt = require_matplotlib()
    ratios = [r for r in (1, RATIO) if any(ok(s) and _ratio_of(c) == r for c, s in cases.items())] or [1]
    fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios) + 0.5, 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, ratio in zip(axes, ratios):
        drawn = 0
        for cid in _ordered(cases):
            s = cases[cid]
            if not ok(s) or _ratio_of(cid) != ratio:
                continue
            curve = s.get("matrix", {}).get("curve") or s.get("curve") or []
            if not curve:
                continue
            t, loss = zip(*curve)
            case = CASES.get(cid)
            mode = "solo" if case is not None and case.nproc == 1 else (case.mode if case else cid)
            ax.plot(t, loss, linestyle="--" if case is not None and case.kind == "torchrun" else "-", marker="o", markersize=3,
                    color=COLORS.get(mode), label=case.label if case else cid)
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
        print(f"no matrix runs in {results}: run python -m bench.matrix{' --device cuda' if target.device == 'cuda' else ''} "
              f"[--quick] first", file=sys.stderr)
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
