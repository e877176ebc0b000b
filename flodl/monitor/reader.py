"""Read a record-log directory back: the run's epoch table and its alerts.

``python -m flodl.monitor.reader LOGDIR [--path root] [--json]`` prints the
epoch rows of one node (default the root) from its ``epoch_complete`` records,
with a throughput column per rank below it, then every alert. The functions
(``load``, ``epoch_table``, ``events``, ``run_meta``) are what tests and tools
call; the table is built from the same records a live dashboard saw.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .record_log import ACTIVE_SUFFIX, ROTATED_SUFFIX, read_node
from .records import ROOT, natural_key

LOG_SUFFIXES = (ACTIVE_SUFFIX, ROTATED_SUFFIX)


class NoLogsError(Exception):
    """The directory holds no record logs (wrong path, or the run wrote none)."""


def node_files(logdir: str | Path) -> dict[str, Path]:
    """Record path → its active segment path, for every node ring under ``logdir``."""
    root = Path(logdir)
    found: dict[str, Path] = {}
    for suffix in LOG_SUFFIXES:
        for file in root.rglob("*" + suffix):
            rel = file.relative_to(root).as_posix()[: -len(suffix)]
            found[rel] = file.with_name(file.name[: -len(suffix)] + ACTIVE_SUFFIX)
    return found


def load(logdir: str | Path) -> dict[str, list[dict]]:
    """Every node's records, oldest first (``.log.1`` before ``.log``).

    Raises:
        NoLogsError: ``logdir`` is missing or holds no ``*.log`` files.
    """
    if not Path(logdir).is_dir():
        raise NoLogsError(f"{logdir} is not a directory")
    files = node_files(logdir)
    if not files:
        raise NoLogsError(f"no record logs (*.log) under {logdir}")
    return {path: read_node(active) for path, active in sorted(files.items(), key=lambda kv: natural_key(kv[0]))}


def run_meta(records: dict[str, list[dict]]) -> dict | None:
    """The latest ``meta`` record (it lives in the root's log), if any."""
    metas = [r for r in records.get(ROOT, []) if r.get("kind") == "meta"]
    return metas[-1] if metas else None


def events(records: dict[str, list[dict]]) -> list[dict]:
    """Every alert record in the directory, in time order."""
    found = [r for recs in records.values() for r in recs if r.get("kind") == "event"]
    return sorted(found, key=lambda r: r.get("ts", 0))


def _epoch_rows(recs: list[dict]) -> dict[int, dict]:
    # A resumed run may rewrite an epoch; the later record is the one that stuck.
    rows: dict[int, dict] = {}
    for r in recs:
        if r.get("kind") == "node" and r.get("epoch_complete") and r.get("epoch") is not None:
            rows[r["epoch"]] = r
    return rows


def _leaves_under(records: dict[str, list[dict]], path: str) -> list[str]:
    prefix = path + "/"
    return [p for p, recs in records.items() if p.startswith(prefix) and any(r.get("kind") == "node" and "children" not in r for r in recs)]


def epoch_table(logdir: str | Path | dict[str, list[dict]], path: str = ROOT) -> list[dict]:
    """One row per completed epoch of node ``path``, in epoch order.

    Row keys: ``epoch`` (counted from 1, as the console prints it; the records store the 0-based
    index), ``first_epoch`` (the same, or the first of the epochs one average closed with it: the
    row is theirs, as the console's "epochs 3-5" line), ``loss``, ``eval``, ``throughput`` (samples/s, Σ over
    ranks), ``samples`` (the node's ``work``: realized samples), ``syncs``, ``goodput`` (the run's
    so far, on the root: docs/fault-tolerance.md, *Goodput*), and
    ``ranks`` (leaf name → that rank's throughput, for every rank below the
    node). A value the records do not carry is None.

    Raises:
        NoLogsError: ``logdir`` holds no record logs.
    """
    records = logdir if isinstance(logdir, dict) else load(logdir)
    rows = _epoch_rows(records.get(path, []))
    leaves = {leaf: _epoch_rows(records[leaf]) for leaf in _leaves_under(records, path)}
    return [_row(epoch, rec, leaves) for epoch, rec in sorted(rows.items())]


def _row(epoch: int, rec: dict, leaves: dict[str, dict[int, dict]]) -> dict:
    metrics = rec.get("metrics", {})
    return {
        "epoch": epoch + 1,
        "first_epoch": int(rec.get("first_epoch", epoch)) + 1,
        "loss": metrics.get("loss"),
        "eval": metrics.get("eval"),
        "throughput": metrics.get("throughput"),
        "samples": rec.get("work"),
        "syncs": metrics.get("syncs"),
        "goodput": metrics.get("goodput"),
        "ranks": {
            leaf.rsplit("/", 1)[-1]: by_epoch[epoch].get("metrics", {}).get("throughput")
            for leaf, by_epoch in leaves.items()
            if epoch in by_epoch
        },
    }


# ------------------------------------------------------------------ printing


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, (int, float)) else str(value)


def format_table(rows: list[dict]) -> str:
    """The epoch rows as an aligned text table."""
    ranks = sorted({r for row in rows for r in row["ranks"]}, key=natural_key)
    goodput = any(row.get("goodput") is not None for row in rows)  # logs from before goodput have none: no empty column
    head = ["epoch", "loss", "eval", "samples/s", "samples", "syncs", *(["goodput"] if goodput else []), *(f"{r} s/s" for r in ranks)]
    body = [
        [
            _cell(row["epoch"], "d") if row.get("first_epoch", row["epoch"]) == row["epoch"] else f"{row['first_epoch']}-{row['epoch']}",
            _cell(row["loss"], ".4f"),
            _cell(row["eval"], ".4f"),
            _cell(row["throughput"], ".1f"),
            _cell(row["samples"], ".0f"),
            _cell(row["syncs"], "d"),
            *([_cell(row.get("goodput"), ".3f")] if goodput else []),
            *(_cell(row["ranks"].get(r), ".1f") for r in ranks),
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=False)) for line in [head, *body])


def format_events(found: list[dict]) -> str:
    """Every event but the per-window ``sync`` ones, which are counted instead."""
    syncs = sum(1 for e in found if e.get("class") == "sync")
    shown = [e for e in found if e.get("class") != "sync"]
    lines = [f"events ({len(shown)}" + (f", plus {syncs} sync" if syncs else "") + "):"]
    for e in shown:
        lines.append(
            f"  ts={e.get('ts')} {e.get('sev', '?'):<8} {e.get('class', '?'):<12} "
            f"{e.get('path', '?')} x{e.get('count', 1)}: {e.get('detail', '')}"
        )
    return "\n".join(lines)


def _header(meta: dict | None) -> str:
    run = (meta or {}).get("run") or {}
    if not run:
        return ""
    return "run " + " ".join(f"{k}={v}" for k, v in run.items() if v is not None) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flodl.monitor.reader", description="Print a run's epoch table and alerts from its record logs."
    )
    parser.add_argument("logdir", help="the run's record_log_dir")
    parser.add_argument("--path", default=ROOT, help="node whose epochs to show (default: root)")
    parser.add_argument("--json", action="store_true", help="print {meta, epochs, events} as JSON")
    parser.add_argument("--tail", type=int, metavar="N", default=None, help="only the last N epoch rows (and events)")
    parser.add_argument("--epochs", metavar="A-B", default=None, help="only the rows of epochs A to B (counted from 1; A- or -B)")
    args = parser.parse_args(argv)
    try:
        records = load(args.logdir)
    except NoLogsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.path not in records:
        print(f"error: no log for node {args.path!r}; nodes: {', '.join(records)}", file=sys.stderr)
        return 2
    rows = epoch_table(records, args.path)
    found = events(records)
    try:
        rows = _in_range(rows, args.epochs)
    except ValueError as exc:
        print(f"error: --epochs {args.epochs}: {exc}", file=sys.stderr)
        return 2
    if args.tail is not None:
        if args.tail < 0:
            print(f"error: --tail must be >= 0, got {args.tail}", file=sys.stderr)
            return 2
        rows, found = rows[len(rows) - args.tail :] if args.tail else [], found[len(found) - args.tail :] if args.tail else []
    if args.json:
        print(json.dumps({"meta": run_meta(records), "epochs": rows, "events": found}, indent=2))
        return 0
    print(_header(run_meta(records)) + f"node {args.path}: {len(rows)} epoch(s)")
    if rows:
        print(format_table(rows))
    print(format_events(found))
    return 0


def _in_range(rows: list[dict], spec: str | None) -> list[dict]:
    """The rows of epochs ``A-B`` (1-based, inclusive; ``A-`` or ``-B`` open; ``N`` one epoch): a row
    of several epochs is in when it overlaps the range.

    Raises:
        ValueError: ``spec`` is not such a range.
    """
    if spec is None:
        return rows
    low, dash, high = spec.partition("-")
    try:
        first = int(low) if low else 1
        last = (int(high) if high else None) if dash else first
    except ValueError:
        raise ValueError("a range of epochs such as 3-7, 10- or -5") from None
    return [r for r in rows if r["epoch"] >= first and (last is None or r.get("first_epoch", r["epoch"]) <= last)]


def _main() -> int:
    try:
        return main()
    except BrokenPipeError:  # piped into head: the reader left, nothing went wrong
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(_main())
