"""The monitor hub: the controller's one door to everything a user watches.

The controller tells the hub facts as they happen (the run began, a window's
report came in, an epoch closed, a rank was lost or joined, the anchor moved,
an eval or a checkpoint took this long) and the hub turns each into the forms
that want it: monitor records (``records.py``) into the live ``Feed`` the
dashboard serves and, with ``record_log_dir``, into the JSONL ring per node;
events into the alert lane; spans, instants and counters into the
``timeline`` (Chrome trace). At teardown ``close`` writes the archive and the
trace. Nothing here may fail a run: file errors are logged and training goes
on. All calls come from the controller's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import DdpRunConfig, Reduction
from ..plan.metrics import EpochCounters, EpochStats
from ..wire import messages as m
from .archive import write_archive
from .dashboard import DashboardServer
from .feed import Feed
from .loggers import Loggers
from .record_log import RecordLog
from .records import (
    ALERT_SEVERITY,
    ROOT,
    AlertLane,
    SubEpochReporter,
    epoch_records,
    event_record,
    meta_record,
    node_record,
    rank_paths,
    tree_records,
    wall_ms,
)
from .timeline import NullTimeline, Timeline

log = logging.getLogger("flodl.monitor")

CONTROLLER = "controller"


def rank_track(rank: int) -> str:
    return f"rank {rank}"


class Monitor:
    """Records, dashboard feed, alerts and timeline of one run."""

    def __init__(
        self,
        config: DdpRunConfig,
        *,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        dashboard: tuple[str, int] | None = None,
    ) -> None:
        self.config = config
        self.say = say
        # the engine's own non-core keys, then the user's declarations (which win)
        self.reductions = {"staged_bytes": Reduction.SUM, **config.scalar_reduction_map}
        self.feed = Feed()
        self.log = RecordLog(config.record_log_dir, config.effective_max_log_size) if config.record_log_dir else None
        self.timeline: Timeline = Timeline(clock=clock) if config.timeline else NullTimeline(clock=clock)
        self.timeline.sort_process(CONTROLLER, -1)
        self.alerts = AlertLane()
        self.server = DashboardServer(self.feed, *dashboard, theme=config.dashboard_theme) if dashboard else None
        self.paths: dict[int, str] = {}
        self.hosts: dict[int, str] = {}
        self.res: dict[int, dict] = {}  # rank -> its latest resource summary
        self.data: dict[int, list[int]] = {}  # rank -> [tier hits, source fetches, bytes held] since the last epoch record
        self.data_rates: dict[int, dict[str, float]] = {}  # rank -> the tiers' last per-epoch rates (see epoch_done)
        self.reporter: SubEpochReporter | None = None
        self.epoch_batches: dict[int, int] = {}  # epoch -> batches trained so far (sub-epoch reports)
        self.report_epoch = -1
        self.anchor: int | None = None
        self.loggers = Loggers(config)  # TensorBoard, CSV, W&B and the user's own, when asked for
        self.metric: str | None = None  # the eval's name, once the run begins

    # ------------------------------------------------------------- lifetime

    async def start(self, run_info: Mapping[str, Any] | None = None) -> str | None:
        """Open the dashboard port and start making the loggers (``run_info``: what a logger's
        factory is told: run id, task, config); returns the dashboard's URL (None when off)."""
        self.loggers.start(run_info or {})
        if self.server is None:
            return None
        await self.server.start()
        return self.server.url

    def begin(self, run: Mapping[str, Any], ranks: Mapping[int, tuple[str, str]], *, steps_per_epoch: int) -> None:
        """The run trains: its description first (every reader replays it first)."""
        self._set_ranks(ranks)
        self.metric = run.get("eval_metric")
        self._emit(meta_record(self.reductions, ts_ms=wall_ms(), run=dict(run)))
        if self.config.reports_per_epoch:
            self.reporter = SubEpochReporter(self.config.reports_per_epoch, steps_per_epoch)

    def _set_ranks(self, ranks: Mapping[int, tuple[str, str]]) -> None:
        self.hosts.update({rank: host for rank, (host, _) in ranks.items()})
        self.paths = rank_paths(self.hosts)
        for rank in ranks:
            self.timeline.sort_process(rank_track(rank), rank)

    async def close(self) -> list[str]:
        """Flush alerts, write the timeline and the archive, stop serving; returns what was written."""
        written = []
        for record in self.alerts.flush(wall_ms()):
            self._emit(record)
        if self.config.timeline:
            try:
                written.append(str(self.timeline.write(self.config.timeline)))
            except OSError as exc:
                log.warning("could not write the timeline to %s: %s", self.config.timeline, exc)
        if self.config.dashboard_html:
            try:
                written.append(str(write_archive(self.config.dashboard_html, self.feed, theme=self.config.dashboard_theme)))
            except OSError as exc:
                log.warning("could not write the dashboard archive to %s: %s", self.config.dashboard_html, exc)
        written += await self.loggers.close()
        if self.log is not None:
            self.log.close()
        if self.server is not None:
            await self.server.close()
        self.feed.close()
        return written

    # ---------------------------------------------------------------- facts

    def window_done(self, report: m.WindowDone, *, started_s: float | None, arrived_s: float) -> None:
        """A rank's window report: its spans on the timeline, its resources kept."""
        if report.res:  # each key's latest: a report may carry the wire tallies without a resource sample
            self.res.setdefault(report.rank, {}).update(report.res)
        if report.data:
            acc = self.data.setdefault(report.rank, [0, 0, 0])
            hits, fetches, held = _tier_totals(report.data)
            acc[0] += hits
            acc[1] += fetches
            acc[2] = held
        track = (rank_track(report.rank), "train")
        sync_s = report.sync_ms / 1000.0
        if started_s is not None and arrived_s - sync_s > started_s:
            self.timeline.span(
                f"window {report.window}",
                track=track,
                start_s=started_s,
                end_s=arrived_s - sync_s,
                args={"batches": report.batches, "samples": report.consumed, "data_ms": round(report.data_ms, 3)},
            )
        if sync_s > 0:
            self.timeline.span(
                "average",
                track=(rank_track(report.rank), "average"),
                start_s=arrived_s - sync_s,
                end_s=arrived_s,
                args={"ms": round(report.sync_ms, 3)},
            )
        if report.batches:
            self.timeline.counter(
                "data wait share",
                track=track,
                at_s=arrived_s,
                values={"share": report.data_ms / max(1e-9, report.compute_ms + report.data_ms)},
            )

    def window_settled(self, number: int, reports: Mapping[int, m.WindowDone], *, now_s: float) -> None:
        """A window's reports are folded in: a sub-epoch report if one is due.

        The report belongs to the latest epoch the window trained (a window
        that straddles an epoch edge reports into the new epoch).
        """
        touched = []
        for report in reports.values():
            for epoch, counters in map(EpochCounters.from_row, report.epochs):
                touched.append(epoch)
                self.epoch_batches[epoch] = self.epoch_batches.get(epoch, 0) + counters.batches
        if self.reporter is None or not touched:
            return
        epoch = max(touched)
        if epoch != self.report_epoch:
            self.report_epoch = epoch
            self.reporter.new_epoch()
        if not self.reporter.on_sync(self.epoch_batches.get(epoch, 0)):
            return
        total = sum(r.batches for r in reports.values()) or 1
        ts = wall_ms()
        leaves = [self._window_leaf(r, total, tick=number, epoch=epoch, ts=ts) for _, r in sorted(reports.items()) if r.rank in self.paths]
        for record in tree_records(leaves, self.reductions):
            self._emit(record)

    def _window_leaf(self, report: m.WindowDone, total_batches: int, *, tick: int, epoch: int, ts: int) -> dict:
        busy_ms = report.compute_ms + report.data_ms
        metrics: dict[str, float] = {"batch_share": report.batches / total_batches}
        if report.batches:
            metrics.update(
                loss=report.loss_sum / report.batches,
                compute_only_ms=report.compute_ms / report.batches,
                data_starve=report.data_ms / busy_ms if busy_ms > 0 else 0.0,
            )
        if report.data:
            metrics.update(_data_metrics(*_tier_totals(report.data)))
        if busy_ms > 0:
            metrics["throughput"] = report.consumed * 1000.0 / busy_ms
        return node_record(
            self.paths[report.rank],
            metrics=metrics,
            work=float(report.batches),
            alive=True,
            ts_ms=ts,
            epoch=epoch,
            tick=tick,
            res=self.res.get(report.rank),
        )

    def epoch_done(self, stats: EpochStats, *, alive: set[int], now_s: float, root: Mapping[str, float] | None = None) -> None:
        """An epoch is trained, averaged and (if due) scored: its records, one per node; ``root``: the
        controller's own figures for the root's record (goodput and lost work so far)."""
        extra = {}
        for rank, acc in self.data.items():
            if acc[0] + acc[1]:
                self.data_rates[rank] = _data_metrics(*acc)
            # two epochs closed by one window (epochs flow into each other): the second has no reads of
            # its own since the first took the window's; it shows the rates of the window that closed both
            extra[rank] = {**self.data_rates.get(rank, {}), "staged_bytes": float(acc[2])}
            acc[0] = acc[1] = 0  # hit rates are per epoch; bytes held carry on
        records = epoch_records(stats, self.paths, self.reductions, ts_ms=wall_ms(), alive=alive, res=self.res, extra=extra)
        if records and self.anchor is not None:
            records[0]["metrics"]["anchor"] = self.anchor
        if records and root:
            records[0]["metrics"].update(root)
        for record in records:
            self._emit(record)
        self.loggers.row(stats, self.metric)
        which = f"epoch {stats.epoch + 1}" if stats.first_epoch == stats.epoch else f"epochs {stats.first_epoch + 1}-{stats.epoch + 1}"
        self.timeline.instant(
            f"{which} done",
            track=(CONTROLLER, "epochs"),
            at_s=now_s,
            scope="g",
            args={"loss": stats.avg_loss, "samples": stats.samples, "eval": stats.eval_value},
        )

    def anchor_changed(self, anchor: int, *, now_s: float, counts: list[int]) -> None:
        if anchor == self.anchor:
            return
        first = self.anchor is None
        self.anchor = anchor
        self.timeline.counter("anchor", track=(CONTROLLER, "cadence"), at_s=now_s, values={"anchor": anchor})
        if not first:
            self.event("anchor", f"anchor now {anchor} batches; batches per rank {counts}", now_s=now_s)

    def event(self, cls: str, detail: str, *, rank: int | None = None, now_s: float, sev: str = "info") -> None:
        """A membership change, checkpoint, anchor move ...: an event record and a timeline instant."""
        path = self.paths.get(rank, ROOT) if rank is not None else ROOT
        if cls in ALERT_SEVERITY:
            records = self.alerts.record(cls, path, detail, now_ms=wall_ms())
            for record in records:
                if record["class"] != "rank_lost":  # the controller already says that one in its own words
                    self.say(f"alert [{record['sev']}] {record['class']} at {record['path']}: {record['detail']} (x{record['count']})")
        else:
            records = [event_record(path, cls, detail, sev=sev, ts_ms=wall_ms())]
        for record in records:
            self._emit(record)
        if cls != "sync":  # every window: the ranks' "average" spans already show them
            self.timeline.instant(cls, track=(CONTROLLER, "events"), at_s=now_s, scope="g", args={"detail": detail, "path": path})

    def throttled(self, window: int, ranks: list[int], *, now_s: float) -> None:
        """``max_batch_diff`` held fast ranks back in this window's plan."""
        self.timeline.instant("throttle", track=(CONTROLLER, "cadence"), at_s=now_s, args={"window": window, "ranks": ranks})

    def ranks_joined(self, ranks: Mapping[int, tuple[str, str]], *, now_s: float) -> None:
        self._set_ranks(ranks)
        for rank, (host, device) in sorted(ranks.items()):
            self.event("rank_joined", f"rank {rank} ({device} on {host}) joined", rank=rank, now_s=now_s)

    def span(self, name: str, *, start_s: float, end_s: float, rank: int | None = None, args: dict | None = None) -> None:
        """Something that took a while (an eval, a checkpoint): one bar on the timeline."""
        track = (rank_track(rank), "callbacks") if rank is not None else (CONTROLLER, "callbacks")
        self.timeline.span(name, track=track, start_s=start_s, end_s=end_s, args=args)

    # -------------------------------------------------------------- output

    def _emit(self, record: dict) -> None:
        self.feed.publish(record)
        if self.log is not None:
            self.log.write(record)


def _tier_totals(data: Mapping[str, Any]) -> tuple[int, int, int]:
    """A window's ``WindowDone.data``: (hits over every tier, dataset reads, bytes held in every tier)."""
    tiers = ("vram", "ram", "disk")
    return (
        sum(int(data.get(f"{t}_hits", 0)) for t in tiers),
        int(data.get("source_fetches", 0)),
        sum(int(data.get(f"{t}_bytes", 0)) for t in tiers),
    )


def _data_metrics(hits: int, fetches: int, held: int) -> dict[str, float]:
    """The staging tiers as metrics: the share of samples served from a tier, and bytes staged."""
    out: dict[str, float] = {"staged_bytes": float(held)}
    if hits + fetches:
        out["cache_hit_rate"] = hits / (hits + fetches)
    return out
