"""Shared benchmark plumbing: the results table and the JSON every bench writes.

Every benchmark prints a table and writes ``bench/results/<name>.json`` as
``{"bench", "machine", "when", "rows": [{"case", "metric", "value", "unit",
"goal", "met"}]}``; ``goal`` is the issue's target as text (null if none) and
``met`` is true/false/null.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    case: str
    metric: str
    value: float
    unit: str
    goal: str | None = None
    met: bool | None = None


def quick_flag(doc: str, help_text: str) -> bool:
    """Parse the one flag every benchmark takes; True for ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=help_text)
    return parser.parse_args().quick


def size_parser(doc: str, quick_help: str, smoke_help: str) -> argparse.ArgumentParser:
    """A bench's parser with its two sizes, ``--quick`` or ``--smoke`` (a toy size that only
    says the bench still runs, into ``smoke_results()``); the bench adds its own flags."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick_help)
    size.add_argument("--smoke", action="store_true", help=smoke_help + ", results in a temporary folder: does the bench still run?")
    return parser


def controller_command(task: str, **options: object) -> list[str]:
    """``python -m flodl.controller --task TASK`` with each option as its kebab-case flag
    (``summary_json=p`` -> ``--summary-json p``; ``True`` -> the bare flag, ``None``/``False`` -> left out)."""
    cmd = [sys.executable, "-m", "flodl.controller", "--task", task]
    for name, value in options.items():
        if value is None or value is False:
            continue
        cmd.append("--" + name.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd


def machine() -> str:
    """One line describing where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM{gpu}, Python {platform.python_version()}"


def smoke_results() -> Path:
    """Where a ``--smoke`` run writes: ``$FLODL_BENCH_RESULTS``, else a fresh temporary
    folder; never ``bench/results``, whose files are the committed numbers."""
    where = os.environ.get("FLODL_BENCH_RESULTS")
    return Path(where) if where else Path(tempfile.mkdtemp(prefix="flodl-bench-smoke-"))


def report(bench: str, rows: list[Row], *, note: str = "", results: Path | None = None) -> Path:
    """Print the table and write the JSON (into ``results``, default ``bench/results``); returns its path."""
    width = max(len(r.case) for r in rows) + 2
    print(f"\n{bench} on {machine()}")
    print(f"{'case':<{width}}{'metric':<22}{'value':>14}  {'unit':<10}{'goal':<26}met")
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        print(f"{r.case:<{width}}{r.metric:<22}{r.value:>14,.2f}  {r.unit:<10}{(r.goal or '-'):<26}{met}")
    if note:
        print(note)
    path = write_results(bench, rows, note=note, results=results)
    print(f"wrote {path}")
    return path


def write_results(bench: str, rows: list[Row], *, note: str = "", results: Path | None = None) -> Path:
    """Write the JSON alone (no table): a long bench calls it after each case, so a run cut short
    (a time limit, a lost machine) keeps the cases it finished, its note saying how far it got."""
    folder = RESULTS if results is None else results
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench}.json"
    payload = {"bench": bench, "machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": [asdict(r) for r in rows]}
    if note:
        payload["note"] = note
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
