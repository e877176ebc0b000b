"""Progressive dispatch: what each rank trains in the next averaging window.

Pure logic. The run is a sequence of windows; every rank trains its window's
grants, then all ranks average together through the collective. Before each
window the ``Dispatcher`` turns the policy and ElChe's measured speeds into
one ``WindowPlan`` per rank: which positions of which epoch (grants, drawn
from the epoch's ``EpochPool``), and when to stop:

* **Sync** — every rank the same number of batches, averaging after each.
* **Cadence** — a wall-time quota: every rank trains until the slow rank's
  ``anchor`` batches' worth of time has passed (``ElChe.anchor_wall_ms``), so
  a fast rank does proportionally more batches instead of waiting. With
  ``max_overshoot`` auto, epochs flow into each other: the window that reaches
  an epoch's end finishes it and takes the following epochs whole while its
  size allows, ending on an edge (no short tail window, and every epoch
  closes exactly at an average: ``_plan_to_edge``).
* **Async** — a batch quota per rank (ElChe's counts). With ``max_overshoot``
  auto, epochs flow as in Cadence; with an explicit value, at an epoch's tail
  a rank may stream into the next epoch, at most ``max_overshoot`` batches.

``fixed`` (the ``deterministic`` option): no probe, and Cadence's stop rule
is its batch count, not the clock; with counts that never change, every plan
is then a function of batch counts alone.

Cold start (no timing yet): an open-ended probe window in which every rank
trains as fast as it can until the controller has timed a few batches of the
slowest, so nobody idles while speeds are measured. Tail
(the run's last epoch, Sync, Async, or Cadence with an explicit
``max_overshoot``): when an epoch has less left than a full window, the rest
is split in proportion to speed so the ranks finish together. Grants not consumed go back
to the pool, so coverage stays exact whatever the ranks actually did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import ApplyPolicy
from .elche import ElChe
from .pool import EpochPool, LedgerError

#: The cold-start probe ends once every rank has timed this many batches ...
PROBE_BATCHES = 3
#: ... and at least this much time has passed (first batches carry warm-up costs).
PROBE_MIN_MS = 300.0
#: Cadence grants this much more than the expected batches, so a rank that
#: speeds up does not run dry before its time quota; the rest is given back.
CADENCE_HEADROOM = 1.25
OVERSHOOT_CEILING = 15
#: Cadence with epochs flowing: a window may span up to this many epochs' batches
#: (short epochs: otherwise every window pays an average per epoch, whatever its length).
FLOW_MAX_EPOCHS = 4
#: Epochs flowing: a window whose epoch has less than this many windows' worth left ends on the
#: epoch's edge (it takes the rest, and the following epochs whole while its size allows), so an
#: epoch closes exactly at an average: its eval scores the model of its close, nothing of the next.
#: 1.5: the window before the edge stretches to take what would be a short tail.
EDGE_STRETCH = 1.5


@dataclass(frozen=True)
class Grant:
    """Positions ``[start, start + size)`` of ``epoch``'s permutation."""

    epoch: int
    start: int
    size: int


@dataclass
class WindowPlan:
    """One rank's part of one window."""

    rank: int
    grants: list[Grant] = field(default_factory=list)
    quota_batches: int = 0  # stop after this many batches (0: no batch limit)
    quota_ms: float = 0.0  # stop at the first batch boundary after this much time (0: no time limit)
    sync_every: int = 0  # also average every this many batches inside the window (0: only at its end)
    rounds: int = 1  # collectives this window; equal on every rank (a rank out of batches joins with weight 0)
    open_ended: bool = False  # no quota: trains until the grant runs out or the controller ends the window
    kind: str = "sync"  # "probe", "full" or "tail": only full windows teach ElChe what averaging costs
    dead: bool = False  # its rank died while the window was in flight

    def consumed_per_grant(self, consumed: int) -> list[tuple[Grant, int]]:
        """Each grant with how much of it the rank trained, when it trained the first ``consumed`` samples."""
        out = []
        for grant in self.grants:
            used = max(0, min(grant.size, consumed))
            consumed -= used
            out.append((grant, used))
        return out

    @property
    def samples(self) -> int:
        return sum(g.size for g in self.grants)


class Dispatcher:
    """Plans windows over ``epochs`` passes of a dataset of ``dataset_len`` samples."""

    def __init__(
        self,
        policy: ApplyPolicy,
        ranks: list[int],
        dataset_len: int,
        batch_size: int,
        epochs: int,
        *,
        progressive: bool = True,
        max_overshoot: int | None = None,
        max_batch_diff: int | None = None,
        start_epoch: int = 0,
        epoch_len: Callable[[int], int] | None = None,
        fixed: bool = False,
        accumulate: int = 1,
        hard_edge: Callable[[int], bool] | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("no ranks")
        # epochs no window may continue past (a checkpoint keeps the model of their end)
        self.hard_edge: Callable[[int], bool] = hard_edge or (lambda epoch: False)
        self.policy = policy
        self.ranks = sorted(ranks)
        self.dataset_len = dataset_len
        # epoch e's size: the dataset, unless augment/epoch_splits reshape epochs (schedule.Schedule)
        self.epoch_len: Callable[[int], int] = epoch_len or (lambda epoch: dataset_len)
        self.batch_size = batch_size
        self.epochs = epochs
        self.progressive = progressive
        # ``deterministic``: no probe, and Cadence stops on a batch quota (its counts) instead of the
        # clock, so every plan is a function of batch counts alone (the counts stay fixed: CadenceLoop)
        self.fixed = fixed
        # batches per optimizer step (the ranks' hellos): Sync averages at its multiples, not per batch,
        # so a rank never spends a round inside an accumulation (it would wait for it to complete)
        self.accumulate = max(1, accumulate)
        self.max_batch_diff = max_batch_diff
        self.pools: dict[int, EpochPool] = {}
        self.next_epoch = start_epoch  # the next pool to create
        self.completed: list[int] = []  # epochs fully trained, in order
        self.reopened: set[int] = set()  # closed epochs holding positions to train again (``unsettle``)
        # epoch -> (its pool, positions not yet trained): settling a window is then O(ranks),
        # where asking each pool ``done`` (a sum over its trained ranges) after every rank's settle was O(ranks²)
        self._untrained: dict[int, tuple[EpochPool, int]] = {}
        self.throttled: list[int] = []  # ranks max_batch_diff held back in the last plan (for the timeline)
        total_batches = max(1, dataset_len // batch_size)
        # Cadence and Async with max_overshoot auto: epochs flow into each other. A window that
        # reaches an epoch's end is still about a full window: each rank's share of the old epoch's
        # rest, then whole following epochs while the window's size allows, ending on an edge (no
        # short tail window, no extra average at every short epoch's edge: at sub-ms steps Async's
        # tails were a fifth of its windows and cost 0.08 of ideal)
        self.flows = policy in (ApplyPolicy.CADENCE, ApplyPolicy.ASYNC) and max_overshoot is None and progressive
        # the overshoot bound shapes tails that stream into the next epoch: flowing, the only tail
        # is the run's last, with nothing after it, so only Async that cannot flow (fixed
        # partitions) auto-tunes it
        self.overshoot_auto = max_overshoot is None and policy is ApplyPolicy.ASYNC and not self.flows
        self.overshoot_initial = min(5, max(2, total_batches // 100))
        self.overshoot_cap = min(10, max(3, total_batches // 50))
        self.max_overshoot = self.overshoot_initial if max_overshoot is None else max_overshoot
        if policy is not ApplyPolicy.ASYNC:
            self.max_overshoot = 0  # Sync (and Cadence with an explicit 0) are barrier-paced at epoch edges

    # ----------------------------------------------------------------- pools

    @property
    def finished(self) -> bool:
        return self.next_epoch >= self.epochs and not self.pools

    def _current(self, shares: dict[int, float]) -> EpochPool | None:
        """The lowest epoch with positions left to grant (created on demand, never re-created)."""
        for epoch in sorted(self.pools):
            if self.pools[epoch].remaining:
                return self.pools[epoch]
        return self._open_next(shares)

    def _open_next(self, shares: dict[int, float]) -> EpochPool | None:
        if self.next_epoch >= self.epochs:
            return None
        pool = EpochPool(self.next_epoch, self.epoch_len(self.next_epoch))
        if not self.progressive:
            pool.partition(shares, self.batch_size)
        self.pools[self.next_epoch] = pool
        self.next_epoch += 1
        return pool

    def remove_rank(self, rank: int) -> None:
        """A rank left: whatever it held, or had reserved, is anyone's again."""
        self.ranks = [r for r in self.ranks if r != rank]
        self.reclaim(rank)

    def reclaim(self, rank: int) -> None:
        """Give back everything ``rank`` still holds or has reserved, in every open epoch."""
        for pool in self.pools.values():
            pool.reclaim(rank)

    # ------------------------------------------------------------------ plan

    def plan(self, elche: ElChe) -> dict[int, WindowPlan] | None:
        """The next window, or None when every epoch has been granted and trained."""
        shares = self._shares(elche)
        self.throttled = []
        pool = self._current(shares)
        if pool is None:
            return None
        pool.share_free(self.ranks, self.batch_size)  # a dead rank's partition goes to the survivors
        plans = {r: WindowPlan(r) for r in self.ranks}
        if self.policy is ApplyPolicy.SYNC:
            self._plan_sync(pool, plans)
        elif not elche.calibrated and not self.fixed:
            self._plan_probe(pool, plans)
        else:
            self._plan_cadence_or_async(pool, plans, elche, shares)
        if not any(p.grants for p in plans.values()):
            # positions left that no rank may take would loop on empty windows forever
            raise LedgerError(f"epoch {pool.epoch}: {pool.remaining} positions left but none grantable to ranks {self.ranks}")
        return plans

    def _shares(self, elche: ElChe) -> dict[int, float]:
        if self.policy is ApplyPolicy.SYNC and not elche.partition_ratios:
            return {r: 1.0 for r in self.ranks}  # lockstep: equal work, whatever the speeds
        counts = elche.batch_counts
        return {r: float(counts[i]) for i, r in enumerate(self.ranks)} if len(counts) == len(self.ranks) else {r: 1.0 for r in self.ranks}

    def _batches(self, n: int) -> int:
        return -(-n // self.batch_size)

    def _grant(self, pool: EpochPool, plan: WindowPlan, batches: int) -> None:
        for start, size in pool.take(plan.rank, batches * self.batch_size):
            plan.grants.append(Grant(pool.epoch, start, size))

    def _plan_sync(self, pool: EpochPool, plans: dict[int, WindowPlan]) -> None:
        """Equal batches per rank, averaged after each optimizer step (every ``accumulate``
        batches); the tail split as evenly as it goes."""
        n = self.accumulate
        per_rank = -(-max(4, self._batches(pool.total) // (len(self.ranks) * 10)) // n) * n  # whole accumulations
        if pool.reserved:
            # non-progressive Sync: each rank's whole partition in one window per epoch,
            # one averaging round per batch; the controller is off the per-batch path
            split = {r: self._batches(pool.remaining_for(r)) for r in self.ranks}
        else:
            left = self._batches(pool.remaining)
            base, extra = divmod(min(left, per_rank * len(self.ranks)), len(self.ranks))
            split = {r: base + (1 if i < extra else 0) for i, r in enumerate(self.ranks)}
        for r, plan in plans.items():
            self._grant(pool, plan, split[r])
            plan.sync_every = n
            plan.quota_batches = self._batches(plan.samples)
        # every rank enters the same number of collectives; one out of batches joins with weight 0
        rounds = max(-(-p.quota_batches // n) for p in plans.values())
        for plan in plans.values():
            plan.rounds = max(1, rounds)

    def _plan_probe(self, pool: EpochPool, plans: dict[int, WindowPlan]) -> None:
        """Cold start: every rank trains flat out on an equal share until the
        controller ends the window, once the slowest rank has a few batches timed
        (see ``PROBE_BATCHES``): nobody idles while speeds are unknown."""
        share = self._batches(pool.remaining) // len(self.ranks) if not pool.reserved else None
        for plan in plans.values():
            batches = share if share is not None else self._batches(pool.remaining_for(plan.rank))
            self._grant(pool, plan, max(1, batches))
            plan.open_ended = True
            plan.kind = "probe"

    def _counts(self, shares: dict[int, float]) -> tuple[dict[int, int], int | None]:
        """Each rank's batches for a full window (ElChe's counts, throttled by ``max_batch_diff``), and the throttle's cap."""
        counts = {r: max(1, int(shares[r])) for r in self.ranks}
        if self.max_batch_diff is None:
            return counts, None
        cap = min(counts.values()) + self.max_batch_diff  # the throttle: nobody leads by more
        return {r: min(c, cap) for r, c in counts.items()}, cap

    def _reaches_edge(self, pool: EpochPool, counts: dict[int, int]) -> bool:
        """Flowing: does the next window reach ``pool``'s end (then it ends on the edge: ``_plan_to_edge``)?"""
        return self.flows and not pool.reserved and self._batches(pool.remaining) < EDGE_STRETCH * sum(counts.values())

    def must_settle_first(self, elche: ElChe) -> bool:
        """Is the next window one that ends on an epoch's edge while windows in flight hold positions of
        that epoch? It must then wait for them to settle: what they leave untrained goes back to the
        epoch, and the window that closes the epoch must take it too (else that average would close
        the epoch with positions still to train, and a later one, trained into the next epoch, close it)."""
        if not self.flows or (not elche.calibrated and not self.fixed):
            return False
        pool = next((self.pools[e] for e in sorted(self.pools) if self.pools[e].remaining), None)
        if pool is None or not pool.outstanding:
            return False
        counts, _ = self._counts(self._shares(elche))
        return self._reaches_edge(pool, counts)

    def _plan_cadence_or_async(self, pool: EpochPool, plans: dict[int, WindowPlan], elche: ElChe, shares: dict[int, float]) -> None:
        counts, cap = self._counts(shares)
        if cap is not None:
            self.throttled = [r for r in self.ranks if int(shares[r]) > cap]
        if self._reaches_edge(pool, counts):
            self._plan_to_edge(pool, plans, counts)
            return
        if pool.reserved:
            tail = any(counts[r] > self._batches(pool.remaining_for(r)) for r in self.ranks)
        else:
            tail = sum(counts.values()) > self._batches(pool.remaining)
        if tail:
            self._plan_tail(pool, plans, counts)
            return
        for r, plan in plans.items():
            plan.kind = "full"
            self._grant(pool, plan, counts[r])
            if self.policy is ApplyPolicy.CADENCE and not self.fixed:
                plan.quota_ms = elche.anchor_wall_ms()
                plan.quota_batches = cap or 0
            else:
                plan.quota_batches = counts[r]
        if self.policy is ApplyPolicy.CADENCE:
            # headroom only after everyone has their share: a fast rank must never starve a slow one
            for r, plan in plans.items():
                self._grant(pool, plan, int(counts[r] * (CADENCE_HEADROOM - 1.0)) + 1)

    def _plan_to_edge(self, pool: EpochPool, plans: dict[int, WindowPlan], counts: dict[int, int]) -> None:
        """Epochs flowing, a window that reaches ``pool``'s end: it takes the rest of the epoch and then
        the following epochs whole while the window's size allows (each at least half taken by it,
        at most ``FLOW_MAX_EPOCHS`` in all, never past a hard edge), each epoch's part split in
        proportion to speed, and stops on the last one's edge. Its quotas are the batches its grants
        make: no time quota and no headroom, so it trains every position granted and its average
        closes those epochs exactly where they end."""
        budget = sum(counts.values()) - self._batches(pool.remaining)
        parts = [pool]
        while len(parts) < FLOW_MAX_EPOCHS and not self.hard_edge(parts[-1].epoch):
            after = parts[-1].epoch + 1
            nxt = self.pools.get(after)
            if nxt is None and (self.next_epoch != after or after >= self.epochs):
                break  # the run's last epoch
            left = nxt.remaining if nxt is not None else self.epoch_len(after)
            if (nxt is not None and nxt.outstanding) or 2 * budget < self._batches(left) or not left:
                break
            nxt = nxt or self._open_next({r: float(c) for r, c in counts.items()})
            assert nxt is not None  # next_epoch == after < epochs
            parts.append(nxt)
            budget -= self._batches(left)
        for part in parts:
            split = self._split_by_speed(self._batches(part.remaining), counts)
            for r, plan in plans.items():
                self._grant(part, plan, split[r])
        for plan in plans.values():
            plan.kind = "full"
            plan.quota_batches = self.batches_of(plan.grants)

    def batches_of(self, grants: list[Grant]) -> int:
        """The batches a rank makes of ``grants``: a batch may span two grants of one epoch, never
        two epochs (rank/data.py ``_plan``), so each run of one epoch's grants is cut on its own."""
        total, run, epoch = 0, 0, None
        for grant in grants:
            if grant.epoch != epoch:
                total += self._batches(run)
                run, epoch = 0, grant.epoch
            run += grant.size
        return total + self._batches(run)

    def _split_by_speed(self, batches: int, counts: dict[int, int]) -> dict[int, int]:
        """``batches`` shared in proportion to ``counts``; what rounding leaves goes to the fastest."""
        total = sum(counts.values()) or 1
        split = {r: batches * counts[r] // total for r in self.ranks}
        for r in sorted(self.ranks, key=lambda r: -counts[r])[: batches - sum(split.values())]:
            split[r] += 1
        return split

    def _plan_tail(self, pool: EpochPool, plans: dict[int, WindowPlan], counts: dict[int, int]) -> None:
        """Less than a window left: split it by speed so everyone finishes together."""
        if pool.reserved:
            for r, plan in plans.items():
                self._grant(pool, plan, min(counts[r], self._batches(pool.remaining_for(r))))
        else:
            split = self._split_by_speed(self._batches(pool.remaining), counts)
            for r, plan in plans.items():
                self._grant(pool, plan, split[r])
        for r, plan in plans.items():
            plan.kind = "tail"
            plan.quota_batches = self._batches(plan.samples)
            stream = min(self.max_overshoot, counts[r] - plan.quota_batches)
            if stream > 0:  # Async: top the window up from the next epoch
                nxt = self.pools.get(pool.epoch + 1) or (
                    self._open_next({x: float(c) for x, c in counts.items()}) if self.next_epoch == pool.epoch + 1 else None
                )
                if nxt is not None:
                    self._grant(nxt, plan, stream)
                    plan.quota_batches = self._batches(plan.samples)

    # ---------------------------------------------------------------- settle

    def settle(self, plan: WindowPlan, consumed: int) -> None:
        """The rank trained the first ``consumed`` samples of its grants; the rest go back."""
        for grant, used in plan.consumed_per_grant(consumed):
            pool = self.pools[grant.epoch]
            left = self._untrained_in(pool)
            self._untrained[pool.epoch] = (pool, left - pool.settle(plan.rank, [(grant.start, grant.size)], used))
        self._close_done()

    def unsettle(self, plan: WindowPlan, consumed: int) -> tuple[int, int]:
        """The first ``consumed`` samples of ``plan``, settled as trained, are in no replica after all
        (its rank died with the window's average in flight, and every survivor gave that average
        up): back to their epochs' pools, for the survivors to train again. An epoch that closed
        meanwhile is reopened for those positions alone (``reopened``: its close is not reported
        twice). Returns (given back, of which in epochs that had closed)."""
        given = late = 0
        for grant, used in plan.consumed_per_grant(consumed):
            if not used:
                continue
            pool = self.pools.get(grant.epoch)
            if pool is None:  # closed: a pool of these positions alone, trained before any later epoch closes
                total = self.epoch_len(grant.epoch)
                pool = self.pools[grant.epoch] = EpochPool(grant.epoch, total, trained=[(0, total)])
                self.reopened.add(grant.epoch)
            if grant.epoch in self.reopened:  # every grant of it, not only the one that reopened it
                late += used
            left = self._untrained_in(pool)
            pool.untrain(grant.start, used)
            pool.share_free(self.ranks, self.batch_size)  # partitioned: to the survivors' partitions
            self._untrained[pool.epoch] = (pool, left + used)
            given += used
        return given, late

    def _untrained_in(self, pool: EpochPool) -> int:
        """Positions of ``pool`` not yet trained (``pool.done`` is this being 0), kept up to date by ``settle``."""
        cached = self._untrained.get(pool.epoch)
        if cached is None or cached[0] is not pool:  # first sight, or a pool put in from outside (resume)
            cached = self._untrained[pool.epoch] = (pool, pool.total - pool.trained_count)
        return cached[1]

    def _close_done(self) -> None:
        """Retire finished pools in epoch order (a later epoch never closes before an earlier one)."""
        for epoch in sorted(self.pools):
            pool = self.pools[epoch]
            if self._untrained_in(pool):
                return
            pool.check()
            del self.pools[epoch]
            self._untrained.pop(epoch, None)
            if epoch in self.reopened:  # its close was reported when it first closed
                self.reopened.discard(epoch)
                continue
            self.completed.append(epoch)

    def take_completed(self) -> list[int]:
        """Epochs that finished since the last call, in order."""
        out, self.completed = self.completed, []
        return out

    def on_verdict(self, stable: bool, nudged: bool) -> None:
        """Async overshoot auto-tune: +1 per Stable up to the cap; back to the start on a nudge."""
        if not self.overshoot_auto:
            return
        if nudged:
            self.max_overshoot = self.overshoot_initial
        elif stable:
            self.max_overshoot = min(self.max_overshoot + 1, self.overshoot_cap)
        self.max_overshoot = min(self.max_overshoot, OVERSHOOT_CEILING)
