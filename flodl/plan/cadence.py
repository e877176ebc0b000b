"""The cadence actor: a progressive run, one averaging window at a time.

Pure logic (time is passed in): no sockets, so tests step it directly. Each
window it asks the ``Dispatcher`` for the ranks' plans and turns them into
``Window`` messages; when every rank's ``WindowDone`` is in, it settles the
grants in the coverage ledger, feeds the timings to ElChe, the drift to the
convergence guard and the meta-controller, applies their verdict to the
anchor, and hands back the epochs that just completed, aggregated.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..config import ApplyPolicy, AverageBackend, DdpRunConfig
from ..wire import messages as m
from .dispatch import CADENCE_HEADROOM, FLOW_MAX_EPOCHS, Dispatcher, WindowPlan
from .elche import ElChe
from .guard import MetaController, make_guard, max_relative_delta
from .metrics import EpochCounters, EpochReport, EpochStats, aggregate
from .pool import EpochPool
from .schedule import Schedule
from .signals import Verdict

#: Windows whose fixed cost (``CadenceLoop.note_fixed``) ElChe reads the median of.
FIXED_COST_WINDOWS = 9
#: Windows after an eval whose background averaging cost ElChe leaves unread: the eval rank's peer
#: waits for its late average at its next average, in the eval's window or the one after.
PAUSE_SHADOW_WINDOWS = 2

log = logging.getLogger("flodl.cadence")


@dataclass
class _EpochAcc:
    """One epoch's numbers per rank while windows fill it in."""

    started: float
    rows: dict[int, EpochCounters] = field(default_factory=dict)  # rank -> its totals
    rounds: dict[int, int] = field(default_factory=dict)  # window -> its averaging rounds, for each window that trained this epoch
    scalars: dict[int, dict[str, list[float]]] = field(default_factory=dict)


class Landing(NamedTuple):
    """A rank's last settled window whose end average lands later (``CadenceLoop.landing``)."""

    window: int
    plan: WindowPlan
    consumed: int  # samples its report counted
    members: frozenset[int]  # the ranks of that window (whose next reports tell, collective)
    round: int  # the averaging round that ends it (CPU backend)


class SnapshotRecord(Protocol):
    """What the CPU backend's averaging server knows of a round (averaging/server.py)."""

    def landed(self, number: int, rank: int) -> bool | None: ...


class CadenceLoop:
    """Windows, ElChe, guard and coverage for one progressive run."""

    def __init__(
        self,
        config: DdpRunConfig,
        ranks: list[int],
        *,
        dataset_len: int,
        batch_size: int,
        epochs: int,
        seed: int,
        global_step: int = 0,
        schedule: Schedule | None = None,
        span_epochs: int = FLOW_MAX_EPOCHS,
        grain: str = "sample",
        accumulate: int = 1,
    ) -> None:
        elche_cfg = config.elche
        # a Shards dataset ("shard"): a position is a shard and the unit every plan counts (grants,
        # quotas, Sync's rounds, ElChe's batch counts) is one shard; its batches stay the ranks' own
        self.grain = grain
        self.batch_size = batch_size
        unit = 1 if grain == "shard" else batch_size
        self.policy = elche_cfg.mode.policy
        self.ranks = sorted(ranks)
        self.seed = seed
        # augment and epoch_splits reshape epochs: ``epochs`` is then the schedule's epoch count
        self.schedule = schedule or Schedule(dataset_len, passes=epochs)
        epochs = self.schedule.epochs
        batches_per_epoch = max(1, self.schedule.epoch_len(0) // unit)
        self.dispatcher = Dispatcher(
            self.policy,
            self.ranks,
            dataset_len,
            unit,
            epochs,
            progressive=config.effective_progressive_dispatch,
            max_overshoot=elche_cfg.max_overshoot,
            max_batch_diff=elche_cfg.max_batch_diff,
            epoch_len=self.schedule.epoch_len,
            fixed=config.deterministic,
            accumulate=accumulate,
            hard_edge=_hard_edges(config),
        )
        # a window is at most an epoch's batches, or a few epochs' when epochs flow into each other
        # (the dispatcher's ``flows``) and nothing needs every edge (``span_epochs``: evals, checkpoints)
        self.window_cap = batches_per_epoch * (max(1, min(span_epochs, FLOW_MAX_EPOCHS)) if self.dispatcher.flows else 1)
        self.elche = ElChe.from_config(elche_cfg, len(self.ranks), max_total_batches=self.window_cap)
        self.guard = make_guard(elche_cfg)
        self.meta = MetaController() if elche_cfg.meta_controller and self.policy is not ApplyPolicy.SYNC else None
        self.global_step = global_step
        self.window = 0
        self.config = config
        # deterministic: ElChe's counts stay as the config sets them (anchor, or partition_ratios);
        # no timing, verdict or saved state ever changes them, so no clock reaches a plan
        self.deterministic = config.deterministic
        self.dead: set[int] = set()
        self.regranted = 0  # samples a dead rank held that went back to the pool
        # rank -> positions of its settled work the ledger counts: its reports' ``consumed``, a dead rank's
        # share of the consensus, less what an average that went on without it gave back (goodput.py's
        # lost work: what a rank trained beyond this)
        self.kept: dict[int, int] = {}
        # shards a dead rank may have averaged in before they went back to the pool (trained twice):
        # it died after its window's last average, before saying how many shards that held
        self.maybe_repeated = 0
        self.regrouped_out: set[int] = set()  # dead ranks a regroup already left out of the consensus
        # a window averaged once at its end, in the background: each rank's last settled window until
        # it is known whether that average landed with it (``_land``): a rank that dies with it in flight
        self.landing: dict[int, Landing] = {}
        self.end_round: dict[int, int] = {}  # window -> the averaging round that ends it (CPU backend's numbering)
        # CPU backend: the averaging server, which knows whose snapshot each round folded (``SnapshotRecord``)
        self.snapshots: SnapshotRecord | None = None
        # samples a dead rank's window counted as trained, whose average every survivor gave up after
        # their epoch had closed: trained again then, but that epoch's eval and checkpoint went without them
        self.late = 0
        self.collective = elche_cfg.mode.backend is AverageBackend.NCCL
        self.plans: dict[int, dict[int, WindowPlan]] = {}  # window -> rank -> plan, while outstanding
        self.started: dict[int, float] = {}
        self.paused_ms = 0.0  # user callbacks (eval) run inside this window: not averaging overhead
        self.pause_shadow = 0  # windows after an eval whose averaging cost ElChe does not read (``note_pause``)
        self.cpu_round_ms: float | None = None  # CPU backend: the last averaging round's own time
        self.fixed_costs: deque[float] = deque(maxlen=FIXED_COST_WINDOWS)  # the controller's ms per window, latest
        self.epochs: dict[int, _EpochAcc] = {}
        # when the last epoch closed: an epoch's wall starts no earlier (with two windows in
        # flight the next epoch's first window is planned while the previous one still trains)
        self.closed_at = 0.0
        # CPU backend: every rank numbers its averaging rounds the same way (round 0 is
        # the start-of-run broadcast, then each window's ``rounds``); a rank joining
        # later must start counting at the first round of its first window
        self.round_base = 1
        # telemetry for the summary
        self.syncs = 0
        self.anchor_history: list[int] = [self.elche.anchor]
        self.verdicts: dict[str, int] = {}
        self.divergence: list[float] = []

    @property
    def measure(self) -> bool:
        """Drift is only worth a parameter copy when a guard can act on it."""
        return self.policy is not ApplyPolicy.SYNC and len(self.ranks) > 1

    # ------------------------------------------------------------------ plan

    def next_windows(self, now: float) -> dict[int, m.Window] | None:
        """The messages of the next window, or None when the run's data is done."""
        plans = self.dispatcher.plan(self.elche)
        if plans is None:
            return None
        # the global step this window starts at: the settled count, and what the windows still in
        # flight will have trained by then (exactly, where their quotas are batch counts): a
        # schedule on the global step (Task.lr_schedule, a "global" scheduler) then sees every
        # batch before this window's, where the settled count alone lagged a window behind
        start_step = self.global_step + sum(self._expected_batches(p) for ps in self.plans.values() for p in ps.values() if not p.dead)
        self.plans[self.window] = plans
        self.started[self.window] = now
        self.round_base += max(p.rounds for p in plans.values())
        self.end_round[self.window] = self.round_base - 1
        for plan in plans.values():
            for grant in plan.grants:
                if grant.epoch not in self.dispatcher.reopened:  # a closed epoch's positions trained again: closed once
                    self.epochs.setdefault(grant.epoch, _EpochAcc(started=now))
        windows = {
            rank: m.Window(
                window=self.window,
                global_step=start_step,
                grants=[[g.epoch, g.start, g.size] for g in plan.grants],
                quota_batches=plan.quota_batches,
                quota_ms=plan.quota_ms,
                sync_every=plan.sync_every,
                rounds=plan.rounds,
                measure_divergence=self.measure,
                after=-1,  # the conductor names each rank's previous window as it sends (Training.start_window)
            )
            for rank, plan in plans.items()
        }
        self.window += 1
        return windows

    def _expected_batches(self, plan: WindowPlan) -> int:
        """The batches ``plan``'s rank will train: its batch quota where that is the stop rule, else
        (Cadence's time quota) its grants less the headroom added to them."""
        granted = self.dispatcher.batches_of(plan.grants)
        if plan.quota_batches and not plan.quota_ms:
            return min(plan.quota_batches, granted)
        return int(granted / CADENCE_HEADROOM)

    def remove_ranks(self, dead: set[int]) -> None:
        """Ranks died: plan without them from now on, shrink ElChe to the survivors.

        Their grants in windows still in flight are settled when those windows'
        reports come in (``on_reports``): whatever of them the consensus already
        holds counts as trained, the rest goes back to the pool for the survivors.
        """
        keep = [i for i, r in enumerate(self.ranks) if r not in dead]
        self.dead |= dead
        self.ranks = [self.ranks[i] for i in keep]
        self.dispatcher.ranks = list(self.ranks)
        state = self.elche.state_dict()
        shrunk = ElChe.from_config(self.config.elche, len(self.ranks), max_total_batches=self.window_cap)
        anchor_rank = state["anchor_rank"]
        state.update(
            world_size=len(self.ranks),
            ms_per_batch=[state["ms_per_batch"][i] for i in keep],
            provisional=[state["provisional"][i] for i in keep],
            batch_counts=[state["batch_counts"][i] for i in keep],
            anchor_rank=keep.index(anchor_rank) if anchor_rank in keep else None,  # re-elected from the survivors
        )
        shrunk.load_state_dict(state)
        self.elche = shrunk
        for plans in self.plans.values():
            for rank in dead & set(plans):
                plans[rank].dead = True

    def settled_for(self, rank: int) -> bool:
        """Every window ``rank`` had a plan in is settled, and whether its last average landed is known:
        its ``kept`` count is final (a dead rank's lost work is known)."""
        return rank not in self.landing and not any(rank in plans for plans in self.plans.values())

    def add_ranks(self, joined: list[int]) -> None:
        """Ranks joined: plan for them from the next window on; ElChe grows to them.

        A joiner starts untimed (ElChe plans it like the anchor rank, and its
        first full window times it); the survivors keep their measured speeds
        and the anchor. Joiners are numbered above every rank the run ever had,
        so ElChe's per-rank lists only grow at the end.
        """
        if set(joined) & set(self.ranks):
            raise ValueError(f"ranks {sorted(set(joined) & set(self.ranks))} are already in the plans")
        joined = sorted(joined)
        if not joined:
            return
        if joined[0] < max(self.ranks):
            raise ValueError(f"joining ranks {joined} must be numbered above the run's ranks {self.ranks}")
        if self.config.elche.partition_ratios is not None:
            raise ValueError("partition_ratios fixes the world size; a run with them cannot grow")
        self.ranks = self.ranks + joined
        self.dispatcher.ranks = list(self.ranks)
        state = self.elche.state_dict()
        grown = ElChe.from_config(self.config.elche, len(self.ranks), max_total_batches=self.window_cap)
        slowest = min(state["batch_counts"]) if state["batch_counts"] else grown.anchor
        state.update(
            world_size=len(self.ranks),
            ms_per_batch=state["ms_per_batch"] + [0.0] * len(joined),
            provisional=state["provisional"] + [False] * len(joined),
            batch_counts=state["batch_counts"] + [slowest] * len(joined),
        )
        grown.load_state_dict(state)
        self.elche = grown

    # ------------------------------------------------------------ bundles

    def coverage(self) -> dict[str, Any]:
        """What is trained so far, for a checkpoint sidecar: per open epoch the
        positions not yet trained (in flight counts as not trained), and the
        first epoch never opened. Resuming trains exactly the rest."""
        d = self.dispatcher
        return {
            "seed": self.seed,
            "dataset_len": d.dataset_len,
            "batch_size": self.batch_size,
            "grain": self.grain,
            "epochs": d.epochs,
            "augment": self.schedule.augment,
            "epoch_splits": self.schedule.epoch_splits,
            "next_epoch": d.next_epoch,
            "open": [{"epoch": e, "total": p.total, "uncovered": [list(r) for r in p.uncovered()]} for e, p in sorted(d.pools.items())],
            # closed epochs reopened for a dead rank's positions (``_unland``): closed once, resumed or not
            "reopened": sorted(d.reopened),
        }

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue a saved run: coverage, global step, sync count, and ElChe's
        timings when the world has the same size (else ElChe re-calibrates)."""
        cov = meta["coverage"]
        d = self.dispatcher
        d.next_epoch = int(cov["next_epoch"])
        for item in cov["open"]:
            uncovered = [(int(s), int(z)) for s, z in item["uncovered"]]
            if not uncovered:
                continue
            pool = EpochPool.from_uncovered(int(item["epoch"]), int(item["total"]), uncovered)
            d.pools[pool.epoch] = pool
        d.reopened = {int(e) for e in cov.get("reopened", [])} & set(d.pools)  # sidecars before it have none
        self.global_step = int(meta["global_step"])
        self.syncs = int(meta.get("sync_round", 0))
        state = meta.get("elche_state")
        if state and state.get("world_size") == len(self.ranks) and not self.deterministic:
            self.elche.load_state_dict(state)

    @property
    def finished(self) -> bool:
        """Every epoch granted, trained and closed."""
        return self.dispatcher.finished and not self.plans

    def note_round(self, ms: float) -> None:
        """CPU backend: an averaging round took ``ms`` (what ElChe weighs against compute)."""
        self.cpu_round_ms = ms

    def note_fixed(self, ms: float) -> None:
        """The controller spent ``ms`` planning and settling one window: its fixed cost, which ElChe
        keeps to ``FIXED_COST_TARGET`` of a window (the median of the last few: one GC pause or a
        slow first plan must not grow every window after it)."""
        self.fixed_costs.append(max(0.0, ms))

    @property
    def fixed_ms(self) -> float:
        """A window's fixed cost as ElChe reads it: the median of the last ``FIXED_COST_WINDOWS`` (0: none yet)."""
        return statistics.median(self.fixed_costs) if self.fixed_costs else 0.0

    def note_pause(self, ms: float) -> None:
        """A rank spent ``ms`` in a user callback (eval) this window; ElChe must not
        read it as averaging cost (the reference's callback time exclusion)."""
        self.paused_ms += max(0.0, ms)
        # a peer of the eval rank waits for its late average in this window or the next, and
        # counts the wait as averaging (flodl/rank/regroup.py Group._waited): not read as such
        self.pause_shadow = PAUSE_SHADOW_WINDOWS

    def open_ended(self, window: int) -> bool:
        """``window`` has no quota: the controller must end it (calibration)."""
        return any(p.open_ended for p in self.plans.get(window, {}).values())

    @property
    def lowest_open_epoch(self) -> int:
        return min(self.epochs) if self.epochs else self.dispatcher.next_epoch

    # --------------------------------------------------------------- settle

    def granted_batches(self, window: int, rank: int) -> int:
        """Batches ``rank`` was granted in ``window`` (0 when it has no plan there)."""
        plan = self.plans.get(window, {}).get(rank)
        return -(-plan.samples // self.dispatcher.batch_size) if plan is not None else 0

    def waiting_on(self, window: int) -> set[int]:
        """Ranks whose report ``window`` still needs (the dead report nothing)."""
        return {r for r, p in self.plans.get(window, {}).items() if not p.dead}

    def on_reports(
        self, window: int, reports: dict[int, m.WindowDone], now: float, dead_batches: dict[int, int] | None = None
    ) -> list[EpochStats]:
        """Fold one window's reports in; return the epochs completed by it, aggregated.

        A rank that died in this window is settled from what the consensus holds
        of its work: in an every-batch (Sync) window, the rounds completed before
        the survivors regrouped (or, none regrouping, its last known batch count,
        ``dead_batches``); in a window averaged once at its end, nothing: it
        reports right after launching that average, so unreported it never took
        part (all of its grants go back to the survivors).
        """
        plans = self.plans.pop(window)
        end_round = self.end_round.pop(window, -1)
        rounds = max(p.rounds for p in plans.values())
        self.syncs += rounds
        self._land(window, reports)
        members = frozenset(plans)
        for rank in sorted(plans):
            plan = plans[rank]
            if plan.dead and not self._reported_in(plan, reports):
                consumed = self._dead_consumed(plan, reports, (dead_batches or {}).get(rank, 0))
                self.regranted += plan.samples - consumed  # back to the pool, for the survivors
                self.kept[rank] = self.kept.get(rank, 0) + consumed
                self.dispatcher.settle(plan, consumed)
                self._account_dead(rank, plan, consumed)
                continue
            report = reports[rank]
            self.kept[rank] = self.kept.get(rank, 0) + report.consumed
            self.dispatcher.settle(plan, report.consumed)
            self._account(rank, report, window, rounds, plan)
            if self._in_background(plan):
                self.landing[rank] = Landing(window, plan, report.consumed, members, end_round)
        for rank in self.dead - {r for ps in self.plans.values() for r in ps}:
            self.dispatcher.reclaim(rank)  # a dead rank's reserved partitions go to the survivors
        self.global_step += sum(r.batches for r in reports.values())
        live = {r: reports[r] for r in self.ranks if r in reports}
        started = self.started.pop(window, now)
        # a window cut short by a death says nothing about speed; a deterministic run never learns it
        if len(live) == len(self.ranks) and not any(p.dead for p in plans.values()) and not self.deterministic:
            self._tune(window, plans, live, (now - started) * 1000.0 - self.paused_ms)
        self.paused_ms = 0.0
        return self._close_all(self.dispatcher.take_completed(), now)

    def _in_background(self, plan: WindowPlan) -> bool:
        """Is ``plan``'s window averaged once at its end, in the background? Its rank reports it right
        after launching that average (a collective, or its snapshot sent), which lands later."""
        return not plan.sync_every and not self.deterministic

    def _reported_in(self, plan: WindowPlan, reports: dict[int, m.WindowDone]) -> bool:
        """A rank that died in this window had reported it first, its average launched with the ranks
        it trained with: its report counts as any other, and whether that average landed with it is
        settled later (``_land``). Collective: unless a survivor regrouped before averaging (then it
        was not in their average). CPU: when the averaging server is there to tell (a relayed rank too:
        its relay names the ranks folded into each slice)."""
        if plan.rank not in reports or not self._in_background(plan):
            return False
        if not self.collective:
            return self.snapshots is not None
        return all(r.regrouped_at < 0 for q, r in reports.items() if q != plan.rank)

    def _land(self, window: int, reports: dict[int, m.WindowDone]) -> None:
        """Dead ranks' last windows whose average was in flight when they died: settled when their
        reports came in, they are in the consensus unless that average went on without them.
        Collective: unless every survivor of that window gave it up (``WindowDone.dropped`` in
        their next reports; a survivor that completed it holds the dead rank's work, and the
        others take the consensus from it: rank/regroup.py). CPU: unless the averaging server's
        round folded no whole snapshot of it (a relayed rank: unless its relay's snapshot landed
        with the rank in every slice). Then its samples go back to the pool."""
        # only the dead: a live rank's entry is replaced by each window it settles (``on_reports``),
        # so walking every rank here, every window, was O(ranks) for nothing
        for rank in [r for r in self.landing if r in self.dead]:
            landing = self.landing[rank]
            if landing.window >= window:
                continue
            landed = self._landed(landing, reports)
            if landed is None:
                continue  # not known yet: ask at the next settle
            del self.landing[rank]
            if not landed:
                self._unland(rank, landing.window, landing.plan, landing.consumed)

    def _landed(self, landing: Landing, reports: dict[int, m.WindowDone]) -> bool | None:
        """Did the dead rank's average of ``landing``'s window land with it (None: not known yet)?"""
        if not self.collective:
            if self.snapshots is None:
                return True  # nobody can tell: counted, as its report said
            return self.snapshots.landed(landing.round, landing.plan.rank)
        survivors = [r for q, r in reports.items() if q in landing.members and q not in self.dead]
        if not survivors:
            return None  # none of its window's survivors reported this one yet
        return not all(r.dropped == landing.window for r in survivors)

    def _unland(self, rank: int, number: int, plan: WindowPlan, consumed: int) -> None:
        """``rank``'s window ``number`` counted ``consumed`` samples that no replica holds: back to their
        epochs' pools, to be trained again. An open epoch's row loses them (the survivors' reports
        add them back); a closed epoch's row keeps them, its positions trained again unreported."""
        given, late = self.dispatcher.unsettle(plan, consumed)
        self.kept[rank] = self.kept.get(rank, 0) - given
        for grant, used in plan.consumed_per_grant(consumed):
            row = self.epochs[grant.epoch].rows.get(rank) if grant.epoch in self.epochs else None
            if used and row is not None:
                row.samples -= used
        self.regranted += given
        self.late += late
        log.warning(
            "rank %d died with window %d's average in flight, which went on without it: its %d samples are trained again%s",
            rank,
            number,
            given,
            f" ({late} of them in an epoch that had closed: its eval went without them)" if late else "",
        )

    def _dead_consumed(self, plan: WindowPlan, reports: dict[int, m.WindowDone], last_batches: int) -> int:
        regrouped = [r.regrouped_at for r in reports.values() if r.regrouped_at >= 0]
        bs = self.dispatcher.batch_size
        if regrouped:
            self.regrouped_out.add(plan.rank)
            return min(plan.samples, min(regrouped) * plan.sync_every * bs) if plan.sync_every else 0
        if self.collective and reports and plan.sync_every:
            # Sync: the survivors finished every round of the window with it (none regrouped), and
            # its TimingMsgs go out after each round's average: what they count is in the consensus
            if self.grain == "shard":
                if plan.rank not in self.regrouped_out:  # its TimingMsgs count batches, not shards: all go back
                    self.maybe_repeated += plan.samples
                return 0  # (a window after the regroup that left it out: none of it is in)
            return min(plan.samples, last_batches * bs)
        # Averaged once, at the window's end (Cadence, Async): a rank reports its window right after
        # launching that average, so one that died without reporting it never took part in it (its
        # batches trained on a replica that is gone), however many TimingMsgs it sent: all go back.
        # Its survivors cannot say otherwise: they may learn of the death after their own report.
        return 0

    def _account(self, rank: int, report: m.WindowDone, window: int, rounds: int, plan: WindowPlan) -> None:
        """Per-epoch rows: a window that straddles epochs splits by what each got."""
        touched = []
        for epoch, counters in map(EpochCounters.from_row, report.epochs):
            if epoch not in self.epochs:  # a closed epoch's positions trained again (``_unland``): its row is out
                continue
            touched.append(epoch)
            self.epochs[epoch].rows.setdefault(rank, EpochCounters()).add(counters)
        if touched:
            last = self.epochs[max(touched)]
            last.rows.setdefault(rank, EpochCounters()).sync_ms += report.sync_ms
            for key, (total, count) in report.scalars.items():
                pair = last.scalars.setdefault(rank, {}).setdefault(key, [0.0, 0.0])
                pair[0] += total
                pair[1] += count
        for epoch in {g.epoch for g in plan.grants}:
            if epoch in self.epochs:
                self.epochs[epoch].rounds[window] = rounds

    def _account_dead(self, rank: int, plan: WindowPlan, consumed: int) -> None:
        """The samples a dead rank trained into the consensus count in its epochs' rows
        (its losses died with it, so only the sample count is known; for shards not even that)."""
        if self.grain == "shard":
            return
        for grant, used in plan.consumed_per_grant(consumed):
            if used and grant.epoch in self.epochs:
                self.epochs[grant.epoch].rows.setdefault(rank, EpochCounters()).samples += used

    def _tune(self, window: int, plans: dict[int, WindowPlan], reports: dict[int, m.WindowDone], window_ms: float) -> None:
        """ElChe timing, then the guard's and meta-controller's verdict on the anchor."""
        walls = [_busy_ms(reports[r]) for r in self.ranks]
        # ElChe counts the plans' unit: batches, or shards for a Shards dataset
        batches = [reports[r].consumed if self.grain == "shard" else reports[r].batches for r in self.ranks]
        if sum(batches):
            # ElChe weighs what averaging costs against the window's compute.
            # Probe and tail windows are short by construction and teach speeds only.
            full = all(p.kind == "full" for p in plans.values())
            sync_ms = 0.0
            if full and self.cpu_round_ms is not None:
                # CPU backend: ranks do not wait for the average; what must stay small
                # against a window is the round itself, or rounds would pile up
                sync_ms = self.cpu_round_ms
            elif full and self.policy is not ApplyPolicy.SYNC:
                # collective, averaging in the background: what a rank pays is what its
                # average call held it up (the launch, and any wait for the previous
                # average still in flight: a collective slower than a window, e.g. a slow
                # network, stalls here and grows the anchor). Not the controller's view of
                # the window: with two in flight a window waits queued behind the one before,
                # which read as ~50% idle and sent the anchor from 10 to 100+ at once.
                sync_ms = max(reports[r].sync_ms for r in self.ranks)
                if self.pause_shadow > 0:  # the wait may be a peer's for the eval rank: not measured
                    self.pause_shadow -= 1
                    sync_ms = 0.0
            elif full and window_ms > 0:
                # Sync: everything a rank spends not training (the collectives, waiting for the
                # slowest rank's last batch, the round trip between windows), from the
                # controller's clock as the ranks' mean idle share against the longest training
                idle = sum(max(0.0, window_ms - w) for w in walls) / len(walls)
                sync_ms = max(walls) * idle / window_ms
            # a probe, or a rank's first timed window (a joiner's), carries its warm-up
            provisional = [plans[r].kind == "probe" or self.elche.ms_per_batch[i] <= 0 for i, r in enumerate(self.ranks)]
            self.elche.report_timing(walls, batches, sync_ms, provisional, fixed_ms=self.fixed_ms if full else 0.0)
        verdict = Verdict.STABLE
        if self.measure:
            drift = max_relative_delta([reports[r].divergence for r in self.ranks])
            self.divergence.append(drift)
            verdict = self.guard.report(drift)
        if self.meta is not None:
            lr = reports[self.ranks[0]].lr
            nudge = self.meta.observe(lr, self.elche.anchor, verdict, self.elche.phase)
            if nudge is not None:
                verdict = nudge
        self.elche.apply_verdict(verdict)
        self.dispatcher.on_verdict(stable=verdict.kind == "stable", nudged=verdict.kind == "nudge_down")
        self.verdicts[verdict.kind] = self.verdicts.get(verdict.kind, 0) + 1
        if self.elche.anchor != self.anchor_history[-1]:
            self.anchor_history.append(self.elche.anchor)
        log.debug(
            "window %d (%.1f ms): train ms %s, batches %s, sync ms %s, drift %s -> %s; anchor %d, counts %s",
            window,
            window_ms,
            [round(w, 1) for w in walls],
            batches,
            [round(reports[r].sync_ms, 1) for r in self.ranks],
            self.divergence[-1] if self.divergence else None,
            verdict.kind,
            self.elche.anchor,
            self.elche.batch_counts,
        )

    def _close_all(self, epochs: list[int], now: float) -> list[EpochStats]:
        """The row of the epochs that completed at ``now``: one row for them all (empty: none).

        One average that closes several epochs closes them as a group: they share that average's
        eval and the span of time they took, so they are one row (``first_epoch`` to ``epoch``),
        never a row each with copied figures. Each epoch's own loss is kept
        (``epoch_losses``). The group's wall runs from its first window's plan or the previous
        close, whichever is later, to its own close: rows never overlap, so their walls add up to
        the run's training time (counted from the plan, with the next epoch's first window planned
        while the previous one still trains, a row's wall took in its predecessor's last window).
        ``ahead_samples``: positions of later epochs already settled when the group closed, which
        the closing average holds too (none when windows end on the group's edge, ``_plan_to_edge``).
        """
        if not epochs:
            return []
        since = max(self.epochs[epochs[0]].started, self.closed_at)
        self.closed_at = now
        accs = [(e, self.epochs.pop(e)) for e in epochs]
        rows: dict[int, EpochCounters] = {}
        scalars: dict[int, dict[str, list[float]]] = {}
        for _, acc in accs:
            for rank, counters in acc.rows.items():
                rows.setdefault(rank, EpochCounters()).add(counters)
            for rank, pairs in acc.scalars.items():
                mine = scalars.setdefault(rank, {})
                for key, (total, count) in pairs.items():
                    pair = mine.setdefault(key, [0.0, 0.0])
                    pair[0] += total
                    pair[1] += count
        wall_ms = max(0.0, now - since) * 1000.0
        syncs = sum({w: n for _, acc in accs for w, n in acc.rounds.items()}.values())  # a window counted once
        reports = [
            EpochReport(
                rank=rank,
                epoch=epochs[-1],
                batches=c.batches,
                samples=c.samples,
                loss_sum=c.loss_sum,
                wall_ms=wall_ms,
                compute_ms=c.compute_ms,
                data_ms=c.data_ms,
                sync_ms=c.sync_ms,
                syncs=syncs,
                scalars=scalars.get(rank, {}),
            )
            for rank, c in sorted(rows.items())
        ]
        stats = aggregate(epochs[-1], reports, self.config.scalar_reduction_map)
        stats.first_epoch = epochs[0]
        stats.epoch_losses = {e: _mean_loss(acc) for e, acc in accs}
        stats.epoch_samples = {e: sum(c.samples for c in acc.rows.values()) for e, acc in accs}
        stats.ahead_samples = sum(c.samples for e, acc in self.epochs.items() if e > epochs[-1] for c in acc.rows.values())
        return [stats]

    def telemetry(self) -> dict[str, Any]:
        """ElChe and guard numbers for the run summary."""
        return {
            "windows": self.window,
            "anchor": self.elche.anchor,
            "anchor_changes": len(self.anchor_history) - 1,
            "anchor_history": self.anchor_history[-50:],
            "batch_counts": list(self.elche.batch_counts),
            "phase": str(self.elche.phase.value if hasattr(self.elche.phase, "value") else self.elche.phase),
            "verdicts": dict(self.verdicts),
            "max_divergence": max(self.divergence) if self.divergence else None,
            "fixed_ms": round(self.fixed_ms, 3),  # a window's fixed cost as ElChe last read it
            "elche_state": self.elche.state_dict(),
        }


def _hard_edges(config: DdpRunConfig) -> Callable[[int], bool] | None:
    """Epoch ends no window may run past: a checkpoint's (``checkpoint_every``: it keeps the model of
    its epoch's end) and an eval's asked for by number (``eval_every_epochs`` set: its epoch is scored
    on its own). Unset, evals score whatever epochs one average closes, as one row."""
    every = [n for n in (config.checkpoint_every, config.eval_every_epochs) if n]
    if not every:
        return None
    return lambda epoch: any((epoch + 1) % n == 0 for n in every)


def _mean_loss(acc: _EpochAcc) -> float | None:
    """One epoch's batch-weighted mean loss across its ranks (None: no batch reported a loss)."""
    batches = sum(c.batches for c in acc.rows.values())
    return sum(c.loss_sum for c in acc.rows.values()) / batches if batches else None


def _busy_ms(report: m.WindowDone) -> float:
    """What the window cost the rank itself: its wall less the time it spent in (and waiting for)
    averages (and, the rank already left out, its pauses: evals, a wait for a late peer; window_stats.py). Not compute + data alone:
    the rank's own work between batches (bookkeeping, landing an average) is part of its pace; left out, a fast rank at sub-ms steps reads ~10%
    faster than it is, is planned too many batches, and its partner waits for it at every average."""
    return max(report.compute_ms + report.data_ms, report.wall_ms - report.sync_ms)
