"""Fold a re-run of some models into a matrix's results: their runs replace the old ones.

    python -m bench.matrix --models logreg --cases ... --results /tmp/m   # the re-run, elsewhere
    python -m bench.matrix.amend /tmp/m                                    # into bench/results/matrix
    python -m bench.matrix.report                                          # the tables, from both

A full matrix takes about 90 minutes here; a change that moves one model (or a
budget made longer for one) is measured again for that model alone. Every
run file of a model the re-run covers is replaced (a case the re-run did not
run is gone for that model, not left from the older code), except the cases
named with ``--keep``: baselines the change under test cannot reach (torchrun's
DDP and post-local SGD run no flodl code), kept from the suite and said so in
the manifest; the other models' runs stay. ``suite.json`` keeps the suite's own record and gains an
``amended`` entry per re-run (when, the code's commit: the re-run's own where its
manifest has one, else this checkout's; what it covered, which models it added), which
the report and ``matrix.json`` state beside the suite's date. The re-run must
match the suite's device, seeds and torchrun LR scaling (and, if it ran a 4:1
case, its pace: live or fixed), and have no failed run: otherwise the tables
would mix protocols.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bench.common import report
from bench.matrix import ALL_CASES, CASES, TARGETS, Budget
from bench.matrix import report as matrix_report
from bench.matrix.suite import commit, covers, suite_note

#: What a re-run must share with the suite it joins.
MUST_MATCH = ("device", "seeds", "lr_scaling", "base_ms")


def amend(source: Path, into: Path, *, code: str, keep: tuple[str, ...] = ()) -> dict:
    """Replace ``into``'s runs of the models ``source`` covers with ``source``'s (but those of the cases in
    ``keep``, which stay); the updated manifest.

    Raises:
        SystemExit: either folder is not a finished suite, the re-run failed a run, the two differ in protocol,
            or a kept case is one the re-run ran too.
    """
    if source.resolve() == into.resolve():
        raise SystemExit(f"bench.matrix.amend: {source} is the folder it would amend")
    theirs = _manifest(source)
    ours = _manifest(into)
    if theirs.get("failed"):
        raise SystemExit(f"bench.matrix.amend: {source} has {theirs['failed']} failed run(s); re-run them first")
    differ = [f"{key} {theirs.get(key)!r} vs {ours.get(key)!r}" for key in MUST_MATCH if theirs.get(key) != ours.get(key)]
    paced = any(CASES[c].ratio > 1 for p in theirs["plan"].values() for c in p["cases"] if c in CASES)
    if paced and _pace(theirs) != _pace(ours):  # equal-rank cases pace nothing: those may join either suite
        differ.append(f"pace {_pace(theirs)!r} vs {_pace(ours)!r}")
    if differ:
        raise SystemExit(f"bench.matrix.amend: {source} does not match {into}'s protocol: {'; '.join(differ)}")
    models = list(theirs["plan"])
    added = [m for m in models if m not in ours["plan"]]  # models the suite had not run: added, not replaced
    both = sorted({c for model in models for c in theirs["plan"][model]["cases"]} & set(keep))
    if both:
        raise SystemExit(f"bench.matrix.amend: {source} ran {', '.join(both)}: a case it ran replaces the suite's, it cannot be kept")
    kept: dict[str, list[str]] = {}
    for model in models:
        old_cases = ours["plan"].get(model, {}).get("cases", [])
        kept[model] = [c for c in old_cases if c in keep]
        for old in into.glob(f"{model}__*.json"):
            if old.name.split("__")[1] not in kept[model]:
                old.unlink()
        for new in sorted(source.glob(f"{model}__*.json")):
            shutil.copy2(new, into / new.name)
    for model in models:
        plan = dict(theirs["plan"][model])
        ran = set(plan["cases"]) | set(kept[model])  # disjoint: a kept case the re-run ran was refused above
        plan["cases"] = [c.id for c in ALL_CASES if c.id in ran]  # in the suite's order
        ours["plan"][model] = plan
    ours["covers"] = covers({m: (Budget(p["samples"], p["epochs"]), tuple(p["cases"])) for m, p in ours["plan"].items()})
    ours.setdefault("amended", []).append(
        {
            "when": theirs["when"],
            "commit": theirs.get("commit") or code,  # the re-run's own checkout, where it recorded one
            "models": models,
            "covers": theirs["covers"],
            "runs": theirs["runs"],
            "elapsed_s": theirs["elapsed_s"],
            "machine": theirs.get("machine", "?"),  # the report names it where it is not the suite's
            "pace": _pace(theirs),
        }
        | ({"pace_probe_ms": theirs["pace_probe_ms"]} if theirs.get("pace_probe_ms") else {})  # its machine's pace
        | ({"kept": sorted({c for cs in kept.values() for c in cs})} if any(kept.values()) else {})
        | ({"added": added} if added else {})
    )
    (into / matrix_report.MANIFEST).write_text(json.dumps(ours, indent=1) + "\n")
    return ours


def _pace(manifest: dict) -> str:
    """How a suite paced its 4:1 cases: ``live`` or ``fixed`` (suites from before the live pace)."""
    return str(manifest.get("pace", "fixed"))


def _manifest(folder: Path) -> dict:
    path = folder / matrix_report.MANIFEST
    if not path.exists():
        raise SystemExit(f"bench.matrix.amend: {folder} has no {matrix_report.MANIFEST}: not a finished bench.matrix run")
    manifest: dict = json.loads(path.read_text())
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="the re-run's results folder (a bench.matrix --results run)")
    ap.add_argument(
        "--into", type=Path, default=None, help="the suite's folder (default bench/results/matrix, or matrix_gpu with --device cuda)"
    )
    ap.add_argument("--device", choices=sorted(TARGETS), default="cpu")
    ap.add_argument(
        "--keep",
        default="",
        help="comma-separated cases whose runs stay from the suite (baselines the change cannot reach, e.g. torchrun-ddp-4to1)",
    )
    args = ap.parse_args(argv)
    target = TARGETS[args.device]
    into = args.into or target.results_dir
    manifest = amend(args.source, into, code=commit(), keep=tuple(c for c in args.keep.split(",") if c))
    print(f"{into}: {', '.join(manifest['amended'][-1]['models'])} replaced by {args.source}'s runs")
    if into.resolve() == target.results_dir.resolve():  # the common-format file goes with the default folder
        _, runs = matrix_report.load(into)
        report(target.name, matrix_report.rows(runs), note=suite_note(manifest, target))
    print("now: python -m bench.matrix.report" + (" --device cuda" if target.device == "cuda" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
