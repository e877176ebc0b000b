"""The monitor record stream: record shapes, the rollup law, tree shaping, alerts.

Pure logic, no I/O. Every record is a plain JSON-ready dict with ``"v": 1``.
A **node** record is one path in the tree ``root[/<host>]/rankN``: a leaf (a
rank) carries raw values, an interior node (host, root) the same fields rolled
up over its *direct* children (docs/monitor.md, "Record stream"). Because every node also carries its
summed ``work``, a hierarchical work-weighted mean equals the flat one.
An **event** record is an alert from the ``AlertLane``; a **meta** record
carries the declared reductions and the run description. ``SubEpochReporter``
decides when a sub-epoch report is due. Persistence is ``record_log``.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import OrderedDict, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import CORE_REDUCTIONS, Reduction
from ..plan.metrics import EpochStats, rank_scalar

VERSION = 1
ROOT = "root"

#: Resource fields in ``res``. Peaks roll up by Max ("was anything pegged"),
#: VRAM and RSS by Sum (what the cohort needed), utilisation by the mean.
RES_REDUCTIONS: Mapping[str, Reduction] = {
    "gpu_util": Reduction.MEAN,
    "gpu_util_max": Reduction.MAX,
    "vram_alloc": Reduction.SUM,
    "vram_alloc_max": Reduction.SUM,
    "vram_total": Reduction.SUM,
    "cpu_util": Reduction.MEAN,
    "rss_bytes": Reduction.SUM,
    # what the ranks' averages put on the network so far (docs/compression.md): bytes add up, averages do not
    "sync_sent_bytes": Reduction.SUM,
    "sync_recv_bytes": Reduction.SUM,
    "sync_averages": Reduction.MAX,
    "sync_broadcast_bytes": Reduction.SUM,
    "sync_peak_bytes": Reduction.SUM,  # each rank's most for one average, summed: what one average can put on the links
}

#: Alert classes and the severity every record of the class carries.
ALERT_SEVERITY: Mapping[str, str] = {
    "rank_lost": "critical",
    "control_drop": "critical",
    "drift": "warn",
    "overflow": "warn",
}
COLLAPSE_WINDOW_MS = 10_000
MAX_LIVE_ALERTS = 200

Reductions = Mapping[str, "Reduction | str"]


def wall_ms() -> int:
    """Milliseconds since the Unix epoch: the ``ts`` of a record."""
    return int(time.time() * 1000)


# --------------------------------------------------------------------- rollup


def reduction_for(key: str, declared: Reductions) -> Reduction:
    """Core keys keep their fixed reduction; declared keys theirs; anything else Mean."""
    if key in CORE_REDUCTIONS:
        return CORE_REDUCTIONS[key]
    return Reduction.parse(declared.get(key, Reduction.MEAN))


def reduce(reduction: Reduction, contribs: Sequence[tuple[float, float]]) -> float | None:
    """Fold ``(value, work)`` pairs of the children that reported a key (``Reduction.fold``)."""
    return reduction.fold(contribs)


def _is_number(value: object) -> bool:
    # bool is an int subclass but never a metric; None is a persisted NaN.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rollup_field(children: Sequence[Mapping], field: str, reduction_of) -> dict[str, float]:
    keys = sorted({k for c in children for k in (c.get(field) or {})})
    out: dict[str, float] = {}
    for key in keys:
        contribs = [(c[field][key], float(c.get("work") or 0.0)) for c in children if _is_number((c.get(field) or {}).get(key))]
        value = reduce(reduction_of(key), contribs)
        if value is not None:  # absent stays absent, never zero-filled
            out[key] = value
    return out


def rollup_metrics(children: Sequence[Mapping], reductions: Reductions) -> dict[str, float]:
    """Roll the children's ``metrics`` up, key by key (see ``reduce``)."""
    return _rollup_field(children, "metrics", lambda key: reduction_for(key, reductions))


def rollup_res(children: Sequence[Mapping]) -> dict[str, float]:
    """Roll the children's ``res`` up by ``RES_REDUCTIONS`` (unknown fields: Mean)."""
    return _rollup_field(children, "res", lambda key: RES_REDUCTIONS.get(key, Reduction.MEAN))


def rollup(children: Sequence[Mapping], reductions: Reductions) -> dict:
    """The aggregate of one interior node over its direct children (docs/monitor.md, "Record stream").

    ``children`` are node records (``metrics``, ``work``, optional ``res``).
    Returns ``{"work": Σ work, "metrics": {...}, "res"?: {...}}``, ``res`` only
    when some child reported a resource field.
    """
    out: dict = {
        "work": math.fsum(float(c.get("work") or 0.0) for c in children),
        "metrics": rollup_metrics(children, reductions),
    }
    res = rollup_res(children)
    if res:
        out["res"] = res
    return out


# ------------------------------------------------------------------- builders


def node_record(
    path: str,
    *,
    metrics: Mapping[str, float],
    work: float,
    alive: bool | int,
    ts_ms: int,
    epoch: int | None = None,
    tick: int | None = None,
    epoch_complete: bool = False,
    label: str | None = None,
    res: Mapping[str, float | None] | None = None,
    device: int | None = None,
    children: int | None = None,
    sev: str = "info",
) -> dict:
    """A ``kind: node`` record (docs/monitor.md, "Record stream").

    A leaf passes ``alive`` as a bool and may pass ``device``; an interior node
    passes ``children`` (its direct-child count) and ``alive`` as the number of
    alive children, truthy iff any child is alive. Optional fields are left
    out when unset, and ``res`` keeps only the fields that were sampled.
    """
    rec: dict = {"v": VERSION, "ts": int(ts_ms), "sev": sev, "path": path, "kind": "node"}
    if tick is not None:
        rec["tick"] = tick
    if epoch is not None:
        rec["epoch"] = epoch
    if epoch_complete:
        rec["epoch_complete"] = True
    if label is not None:
        rec["label"] = label
    rec["metrics"] = dict(metrics)
    rec["work"] = float(work)
    present = {k: v for k, v in (res or {}).items() if v is not None}
    if present:
        rec["res"] = present
    if children is None:
        if device is not None:
            rec["device"] = device
        rec["alive"] = bool(alive)
    else:
        rec["children"] = children
        rec["alive"] = int(alive)
    return rec


def event_record(path: str, cls: str, detail: str, *, sev: str, count: int = 1, ts_ms: int) -> dict:
    """A ``kind: event`` (alert) record; ``count`` = occurrences it stands for."""
    return {"v": VERSION, "ts": int(ts_ms), "sev": sev, "path": path, "kind": "event", "class": cls, "detail": detail, "count": count}


def meta_record(reductions: Reductions, *, ts_ms: int, run: Mapping) -> dict:
    """The ``kind: meta`` record, first in every stream and every subscriber's replay.

    ``reductions`` are the non-core declarations (core keys are implicit and
    dropped here). ``run`` describes the run for readers: run_id, mode, task,
    world_size, epochs, dataset_len, batch_size, eval_metric.
    """
    declared = {k: Reduction.parse(r).value for k, r in sorted(reductions.items()) if k not in CORE_REDUCTIONS}
    return {"v": VERSION, "ts": int(ts_ms), "kind": "meta", "reductions": declared, "run": dict(run)}


def encode(record: Any) -> str:
    """A record (or any JSON value) as one compact, strictly valid JSON line (no newline).

    The one encoding of the stream, for the log files and the dashboard alike.
    Non-finite floats (a diverged loss is NaN) become null: browsers'
    JSON.parse rejects the NaN/Infinity tokens Python would otherwise write.
    Numbers JSON does not know (numpy/torch scalars) become floats, anything
    else its str(): a user scalar of an odd type must not fail training.
    """
    try:
        return json.dumps(record, separators=(",", ":"), allow_nan=False, default=_plain)
    except ValueError:
        return json.dumps(_finite(record), separators=(",", ":"), allow_nan=False, default=_plain)


def _plain(value: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def _finite(value: Any) -> Any:
    """A copy of ``value`` with every non-finite float replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -------------------------------------------------------------- tree shaping


def is_multi_host(hosts: Iterable[str | None]) -> bool:
    """A host tier exists only when the cohort spans more than one named host."""
    return len({h for h in hosts if h}) > 1


def node_path(rank: int, host: str | None, hosts: Collection[str | None], *, world_size: int | None = None) -> str:
    """The path of ``rank``'s leaf: ``root/rankN``, or ``root/<host>/rankN`` when
    ``hosts`` (the whole cohort's, dead ranks included) spans more than one host.

    A lone rank (``world_size == 1``) is the root itself. An unknown host
    (``None``/empty) stays flat. Every producer must shape paths through this
    function: two tierings would split one rank's stream in two.
    """
    if world_size == 1:
        return ROOT
    if host and is_multi_host(hosts):
        return f"{ROOT}/{host}/rank{rank}"
    return f"{ROOT}/rank{rank}"


def rank_paths(hosts_by_rank: Mapping[int, str | None]) -> dict[int, str]:
    """``node_path`` for every rank of the cohort at once (index: global rank)."""
    hosts = set(hosts_by_rank.values())
    world = len(hosts_by_rank)
    return {r: node_path(r, h, hosts, world_size=world) for r, h in hosts_by_rank.items()}


def natural_key(path: str) -> list:
    """Sort key putting ``rank2`` before ``rank10``."""
    # re.split keeps str/int alternating, so two keys always compare.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def tree_records(leaves: Sequence[Mapping], reductions: Reductions) -> list[dict]:
    """All records of one report: the interior nodes rolled up from ``leaves``.

    ``leaves`` are the leaf node records of one report, one per rank (dead ranks
    with ``alive: False``), their paths shaped by ``node_path``. Interior nodes
    (each host when there is a host tier, then the root) aggregate their direct
    children only and copy ``ts``/``epoch``/``tick``/``epoch_complete``/``sev``
    from the first leaf. Returned in pre-order (root first, children in natural
    path order), which is also the order to write them in.

    Raises:
        ValueError: two leaves share a path, a leaf sits where another leaf's
            ancestor is, or a path is not under ``root`` (a tiering bug).
    """
    if not leaves:
        return []
    by_path = _index_leaves(leaves)
    if list(by_path) == [ROOT]:
        return [dict(by_path[ROOT])]
    kids = _children_index(by_path)
    return _build(ROOT, by_path, kids, leaves[0], reductions)[1]


def _index_leaves(leaves: Sequence[Mapping]) -> dict[str, Mapping]:
    by_path: dict[str, Mapping] = {}
    for leaf in leaves:
        path = leaf["path"]
        if path in by_path:
            raise ValueError(f"two leaves share the record path {path!r}")
        if path != ROOT and not path.startswith(ROOT + "/"):
            raise ValueError(f"record path {path!r} is not under {ROOT!r}")
        by_path[path] = leaf
    if ROOT in by_path and len(by_path) > 1:
        raise ValueError("a root-only leaf cannot share a report with other ranks")
    return by_path


def _children_index(by_path: Mapping[str, Mapping]) -> dict[str, set[str]]:
    kids: dict[str, set[str]] = defaultdict(set)
    for path in by_path:
        while path != ROOT:
            parent = path.rsplit("/", 1)[0]
            kids[parent].add(path)
            path = parent
    clash = set(kids) & set(by_path)
    if clash:
        raise ValueError(f"{sorted(clash)[0]!r} is both a leaf and an interior node")
    return kids


def _build(path, by_path, kids, template, reductions) -> tuple[dict, list[dict]]:
    """(this node's record, the records of its whole subtree in pre-order)."""
    if path in by_path:
        leaf = dict(by_path[path])
        return leaf, [leaf]
    built = [_build(c, by_path, kids, template, reductions) for c in sorted(kids[path], key=natural_key)]
    direct = [node for node, _ in built]
    agg = rollup(direct, reductions)
    node = node_record(
        path,
        metrics=agg["metrics"],
        work=agg["work"],
        res=agg.get("res"),
        alive=sum(1 for c in direct if c.get("alive")),
        children=len(direct),
        ts_ms=template["ts"],
        epoch=template.get("epoch"),
        tick=template.get("tick"),
        epoch_complete=bool(template.get("epoch_complete")),
        sev=template.get("sev", "info"),
    )
    return node, [node] + [rec for _, subtree in built for rec in subtree]


# ------------------------------------------------------------- epoch records


def epoch_leaf_metrics(stats: EpochStats, rank: int, reductions: Reductions | None = None) -> tuple[dict[str, float], float]:
    """One rank's epoch-record metrics and work (its realized samples).

    Keys a rank did not measure stay absent: no batches ⇒ no loss, no wall
    time ⇒ no throughput. A user scalar is the rank's mean over the epoch,
    except a key declared ``sum`` (a count, e.g. tokens seen): its total.
    ``data_starve`` is the share of the rank's step time spent waiting for data.
    """
    part = stats.per_rank.get(rank)
    if part is None:
        return {}, 0.0
    declared = reductions or {}
    metrics: dict[str, float] = {
        key: rank_scalar(total, count, reduction_for(key, declared)) for key, (total, count) in part.scalars.items() if count > 0
    }
    if part.batches > 0:
        metrics["loss"] = part.loss_sum / part.batches
    if part.wall_ms > 0:
        metrics["throughput"] = part.throughput
    metrics["batch_share"] = stats.batch_share[rank]
    metrics["compute_only_ms"] = part.compute_ms / part.batches if part.batches else 0.0
    busy_ms = part.compute_ms + part.data_ms
    metrics["data_starve"] = part.data_ms / busy_ms if busy_ms > 0 else 0.0
    return metrics, float(part.samples)


def epoch_records(
    stats: EpochStats,
    paths: Mapping[int, str],
    reductions: Reductions,
    *,
    ts_ms: int,
    alive: Collection[int] | None = None,
    res: Mapping[int, Mapping[str, float | None]] | None = None,
    labels: Mapping[int, str] | None = None,
    devices: Mapping[int, int] | None = None,
    extra: Mapping[int, Mapping[str, float]] | None = None,
) -> list[dict]:
    """Every record of one epoch boundary, root first, all ``epoch_complete``.

    ``paths`` maps each rank of the cohort (dead ones too) to its leaf path
    (``rank_paths``); ``alive`` defaults to the ranks present in ``stats``.
    The root additionally gets the controller's own numbers where the rollup
    produced no such key: ``loss`` = avg_loss, the aggregated scalars, and
    always ``eval`` (when evaluated) and ``syncs``. ``extra`` adds per-rank
    metrics measured elsewhere (the data plane's hit rates), rolled up like the rest.
    """
    live = set(stats.per_rank) if alive is None else set(alive)
    leaves = []
    for rank, path in sorted(paths.items()):
        metrics, work = epoch_leaf_metrics(stats, rank, reductions)
        metrics.update((extra or {}).get(rank, {}))
        leaves.append(
            node_record(
                path,
                metrics=metrics,
                work=work,
                alive=rank in live,
                ts_ms=ts_ms,
                epoch=stats.epoch,
                epoch_complete=True,
                label=(labels or {}).get(rank),
                res=(res or {}).get(rank),
                device=(devices or {}).get(rank),
            )
        )
    records = tree_records(leaves, reductions)
    if records:
        _inject_root(records[0]["metrics"], stats)
        if stats.first_epoch != stats.epoch:  # one average closed several epochs: one boundary for them all
            records[0]["first_epoch"] = stats.first_epoch
    return records


def _inject_root(metrics: dict, stats: EpochStats) -> None:
    # The rollup is the measured tree and wins where both exist; the injected
    # batch-weighted loss equals it exactly when batches are uniformly full.
    if stats.avg_loss is not None:
        metrics.setdefault("loss", stats.avg_loss)
    for key, value in stats.scalars.items():
        metrics.setdefault(key, value)
    if stats.eval_value is not None:
        metrics["eval"] = stats.eval_value
    metrics["syncs"] = stats.syncs


# ----------------------------------------------------------------- alert lane


@dataclass
class _Alert:
    cls: str
    path: str
    detail: str
    ts_ms: int
    window_start_ms: int  # the last emission: opens the collapse window
    total: int = 1  # every occurrence so far: the live view's count
    pending: int = 0  # absorbed since the last emission: the stream still owes them

    def record(self, count: int) -> dict:
        return event_record(self.path, self.cls, self.detail, sev=ALERT_SEVERITY[self.cls], count=count, ts_ms=self.ts_ms)


class AlertLane:
    """The bounded, collapsing alert feed (docs/monitor.md, "Record stream": alerts). Time is passed in, never read.

    ``record`` returns the event records to append to the stream. The first
    occurrence of a ``(class, path)`` emits at once; repeats within
    ``window_ms`` of the last emission are absorbed and ride the ``count`` of
    the next emitted record, so counts summed over the stream equal the true
    number of occurrences. The live view keeps at most ``max_live`` entries,
    least recently active evicted first; evictions surface as one collapsed
    ``overflow`` record at ``root``. The caller also prints alerts to stdout.
    """

    def __init__(self, *, window_ms: int = COLLAPSE_WINDOW_MS, max_live: int = MAX_LIVE_ALERTS) -> None:
        self.window_ms = window_ms
        self.max_live = max(1, max_live)
        self._live: OrderedDict[tuple[str, str], _Alert] = OrderedDict()
        self.dropped = 0  # live entries evicted over the run
        self._dropped_pending = 0  # evictions no overflow record has reported yet
        self._dropped_ts = 0
        self._overflow_window_start: int | None = None

    def record(self, cls: str, path: str, detail: str, *, now_ms: int) -> list[dict]:
        """One occurrence; returns the records to append (empty when absorbed).

        Raises:
            ValueError: ``cls`` is not one of ``ALERT_SEVERITY``.
        """
        if cls not in ALERT_SEVERITY:
            raise ValueError(f"unknown alert class {cls!r}; known: {', '.join(ALERT_SEVERITY)}")
        out: list[dict] = []
        alert = self._live.get((cls, path))
        if alert is None:
            alert = _Alert(cls, path, detail, now_ms, window_start_ms=now_ms)
            self._evict_for_one(now_ms, out)  # owed repeats of the evicted go first
            self._live[(cls, path)] = alert
            out.append(alert.record(1))
        else:
            self._repeat(alert, detail, now_ms, out)
            self._live.move_to_end((cls, path))  # order = last activity
        self._maybe_overflow(now_ms, out)
        return out

    def _repeat(self, alert: _Alert, detail: str, now_ms: int, out: list[dict]) -> None:
        alert.ts_ms, alert.detail = now_ms, detail  # the latest occurrence describes the record
        alert.total += 1
        if now_ms - alert.window_start_ms < self.window_ms:
            alert.pending += 1
            return
        out.append(alert.record(alert.pending + 1))
        alert.pending, alert.window_start_ms = 0, now_ms

    def _evict_for_one(self, now_ms: int, out: list[dict]) -> None:
        while len(self._live) >= self.max_live:
            _, old = self._live.popitem(last=False)
            if old.pending:
                out.append(old.record(old.pending))  # the cap bounds memory, not history
            self.dropped += 1
            self._dropped_pending += 1
            self._dropped_ts = now_ms

    def _maybe_overflow(self, now_ms: int, out: list[dict]) -> None:
        start = self._overflow_window_start
        if self._dropped_pending and (start is None or now_ms - start >= self.window_ms):
            out.append(self._overflow_record())
            self._dropped_pending, self._overflow_window_start = 0, now_ms

    def _overflow_record(self) -> dict:
        detail = f"{self.dropped} alert(s) dropped by the {self.max_live}-entry live cap"
        return event_record(ROOT, "overflow", detail, sev=ALERT_SEVERITY["overflow"], count=self._dropped_pending, ts_ms=self._dropped_ts)

    def flush(self, now_ms: int) -> list[dict]:
        """Emit every absorbed repeat and owed overflow count (call at teardown)."""
        out = []
        for alert in self._live.values():
            if alert.pending:
                out.append(alert.record(alert.pending))
                alert.pending, alert.window_start_ms = 0, now_ms
        if self._dropped_pending:
            out.append(self._overflow_record())
            self._dropped_pending, self._overflow_window_start = 0, now_ms
        return out

    def live(self) -> list[dict]:
        """The current feed: one entry per (class, path), count = running total."""
        return [a.record(a.total) for a in self._live.values()]


# ------------------------------------------------------------ sub-epoch cadence


class SubEpochReporter:
    """Decides when a sub-epoch report is due (docs/monitor.md, "Sub-epoch reports"; ``reports_per_epoch = x``).

    ``epoch_work`` is the epoch's steps (total_samples // batch_size). Call
    ``on_sync`` at each reduce boundary with the work done so far this epoch:
    it fires at most once per call even when the window crossed several
    thresholds, so reports never come mid-window and never in bursts.
    """

    def __init__(self, reports_per_epoch: int, epoch_work: int) -> None:
        self.reports_per_epoch = max(0, reports_per_epoch)
        self.epoch_work = max(0, epoch_work)
        self.fired = 0  # thresholds already reported this epoch; also the window tick

    def on_sync(self, in_epoch_work: float) -> bool:
        """True iff a report is due now (then it counts as fired)."""
        x, total = self.reports_per_epoch, self.epoch_work
        if x == 0 or total == 0:
            return False
        # floor(w / (total / x)) as floor(w * x / total): exact for integer steps
        due = min(int(in_epoch_work * x // total), x)
        if due <= self.fired:
            return False
        self.fired = due
        return True

    def new_epoch(self, epoch_work: int | None = None) -> None:
        """Reset at the epoch boundary; ``epoch_work`` changes with the dataset."""
        self.fired = 0
        if epoch_work is not None:
            self.epoch_work = max(0, epoch_work)
