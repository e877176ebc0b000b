"""Goodput: how much of the world's capacity a run turned into training that counts, and what each fault cost.

Pure logic: no clock of its own (every time is the controller's clock, passed in), no I/O; tests drive
it with a fake clock. The controller tells it facts as they happen (a window settled, a rank trained a
batch, a rank died, a rank was restarted or admitted, an eval paused training) and asks for the
figures (``report``: the run summary; ``live``: the dashboard's so far). The definitions
(docs/fault-tolerance.md, *Goodput*):

* A **slot** is a place in the world: each rank the run started with, and each rank that grew the
  world later. A rank restarted in a dead rank's place (healing) takes over that rank's slot; so does
  a joiner while a dead rank's slot waits for no restart (a lost host whose worker is started again).
* The **training time** T runs from the first window (start-up is over) to the end of training,
  less the time evals paused it (evals are the run's choice, not a fault's cost). A slot that grew
  the world counts from its admission.
* An **interval** is the time between two window settlements, less the evals' pauses in it. It is
  **steady** when nothing disturbed it (no death, regroup or admission since the previous settlement,
  evals less than half of it; the first one, the calibration window, never is) and the world was
  full: every slot's rank trained in the window that settled.
* A slot's **steady rate** is its samples in steady intervals ÷ their time: what it sustained with
  the whole world training and nothing wrong. A slot never seen in a steady interval is rated over
  the undisturbed intervals in which it trained (``rated`` says which).
* **Capacity** is Σ over slots of steady rate × the slot's training time; **goodput** is the samples
  that count (each epoch's positions once: the summary's ``samples``) ÷ capacity. A dead rank's slot
  counts for the whole of T: detection, restart, rebuilding the group, a world left smaller are all
  lost; so is any wait of the survivors, and work trained and then given back.
* A fault's **lost work** is what the dead rank trained (its batch reports) that no replica kept
  (the ledger's count of its settled work): trained, then discarded and trained again by others.
  Its **moment** is the last frame heard from the rank, or, when the rank went on beating with its
  training thread stuck, the end of its last step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .progress import Progress

#: A rank whose last progress is older than its last frame by more than this went on beating while stuck
#: (heartbeats are a second apart): its fault began at that progress, not at its silence.
STALL_GAP_S = 2.0


def fault_moment(last_seen: float, progress: Progress) -> float:
    """When a rank's fault began, as the controller can know it: its last frame, or the end of its last
    step, average or eval (``progress``: its last heartbeat's word) when that is well before it (a
    training thread stuck while the link thread beat on). Idle is no stall."""
    if progress.busy and progress.busy != "idle":
        last_progress = progress.at - progress.busy_s
        if last_progress < last_seen - STALL_GAP_S:
            return last_progress
    return last_seen


@dataclass
class Fault:
    """One rank lost while training, and what became of it."""

    rank: int
    slot: int
    reason: str
    since: float  # the fault's moment (``fault_moment``)
    detected: float  # when the controller declared the rank dead
    regrouped: bool = False  # the survivors regrouped without it (the run went on)
    back_at: float | None = None  # when every survivor had averaged again in the new membership
    replaced_by: int | None = None  # healing: the rank started in its place
    full_at: float | None = None  # when that rank was admitted: the world whole again


@dataclass
class _Rate:
    """Samples and seconds of one slot over the intervals that count for its rate."""

    samples: int = 0
    seconds: float = 0.0

    def add(self, samples: int, seconds: float) -> None:
        self.samples += samples
        self.seconds += seconds

    @property
    def value(self) -> float | None:
        return self.samples / self.seconds if self.seconds > 0 else None


@dataclass
class Goodput:
    """The run's books for goodput and lost work: fed as training goes, read at any time."""

    start: float  # the first window: training time counts from here
    slots: dict[int, int] = field(default_factory=dict)  # rank -> its slot (the rank whose place it holds)
    entered: dict[int, float] = field(default_factory=dict)  # slot -> when it entered the world
    holder: dict[int, int | None] = field(default_factory=dict)  # slot -> its rank training now (None: empty)
    trained: dict[int, int] = field(default_factory=dict)  # rank -> samples its batch reports said it trained
    faults: list[Fault] = field(default_factory=list)
    paused_s: float = 0.0  # the evals' pauses so far
    paused_before: dict[int, float] = field(default_factory=dict)  # slot -> the pauses before it entered
    steady: dict[int, _Rate] = field(default_factory=dict)  # slot -> its steady intervals
    undisturbed: dict[int, _Rate] = field(default_factory=dict)  # slot -> undisturbed intervals it trained in
    steady_s: float = 0.0  # the steady intervals' time
    _settled_at: float | None = None  # the previous settlement (None: none yet)
    _disturbed: bool = True  # since then: the first interval (calibration) never counts
    _paused_in: float = 0.0  # the evals' pauses since then

    # ------------------------------------------------------------------ facts

    def begin(self, ranks: Sequence[int]) -> None:
        """The ranks the run trains with from its start: a slot each."""
        for rank in ranks:
            self.slots[rank] = self.holder[rank] = rank
            self.entered[rank] = self.start
            self.paused_before[rank] = 0.0

    def batch(self, rank: int, samples: int) -> None:
        """A rank's batch report: it trained ``samples`` more (hot path: one dict update)."""
        self.trained[rank] = self.trained.get(rank, 0) + samples

    def disturb(self) -> None:
        """A death, a regroup or an admission: the interval in progress is not steady."""
        self._disturbed = True

    def paused(self, seconds: float) -> None:
        """An eval paused training for ``seconds``: out of the training time and of its interval."""
        self.paused_s += seconds
        self._paused_in += seconds

    def settled(self, now: float, samples: Mapping[int, int]) -> None:
        """A window's reports are settled at ``now``; ``samples``: what each rank trained in it."""
        span = now - self._settled_at if self._settled_at is not None else 0.0
        # an eval whose pause is most of the interval (one that began in the interval before) would leave too
        # little time for its samples: such an interval says nothing of the rate
        if self._settled_at is not None and not self._disturbed and self._paused_in < span / 2:
            seconds = span - self._paused_in
            by_slot: dict[int, int] = {}
            for rank, n in samples.items():
                slot = self.slots.get(rank)
                if slot is not None and n > 0:
                    by_slot[slot] = by_slot.get(slot, 0) + n
            for slot, n in by_slot.items():
                self.undisturbed.setdefault(slot, _Rate()).add(n, seconds)
            if by_slot and set(by_slot) == set(self.entered):  # the whole world trained
                self.steady_s += seconds
                for slot, n in by_slot.items():
                    self.steady.setdefault(slot, _Rate()).add(n, seconds)
        self._settled_at = now
        self._disturbed = False
        self._paused_in = 0.0

    def died(self, rank: int, *, now: float, since: float, reason: str) -> Fault | None:
        """``rank`` was declared dead at ``now``; its fault began at ``since``. None for a rank the
        books do not know (a joiner never admitted: its death costs no slot anything)."""
        self._disturbed = True
        slot = self.slots.get(rank)
        if slot is None:
            return None
        fault = Fault(rank=rank, slot=slot, reason=reason, since=min(since, now), detected=now)
        self.faults.append(fault)
        if self.holder.get(slot) == rank:
            self.holder[slot] = None
        return fault

    def regrouped(self) -> None:
        """The survivors of the faults just recorded regroup without them (the run goes on)."""
        for fault in self.faults:
            fault.regrouped = fault.regrouped or fault.back_at is None

    def back(self, now: float) -> None:
        """Every survivor has averaged in the new membership: the faults it regrouped after are recovered."""
        for fault in self.faults:
            if fault.regrouped and fault.back_at is None:
                fault.back_at = now

    def restarted(self, rank: int, replaces: int) -> None:
        """Healing: ``rank`` is started in ``replaces``'s place (its slot, once admitted)."""
        slot = self.slots.get(replaces)
        if slot is None:
            return
        self.slots[rank] = slot
        for fault in self.faults:
            if fault.rank == replaces and fault.replaced_by is None:
                fault.replaced_by = rank

    def never_joined(self, rank: int) -> None:
        """A joiner was dropped before it trained (a restart whose worker went with its host): the
        slot it was to fill waits for no one, and the next joiner may take it."""
        if self.holder.get(self.slots.get(rank, -1), -1) == rank:
            return  # it was admitted once: not a joiner's drop
        self.slots.pop(rank, None)
        for fault in self.faults:
            if fault.replaced_by == rank and fault.full_at is None:
                fault.replaced_by = None

    def admitted(self, ranks: Sequence[int], now: float) -> None:
        """Joiners trained from the next window: a restart fills its slot again (its fault's world is
        whole again); another rank fills a dead rank's slot that no restart is on its way to, else
        grows the world by a slot from now."""
        self._disturbed = True
        for rank in ranks:
            if rank not in self.slots:
                waiting = {f.slot for f in self.faults if f.replaced_by is not None and f.full_at is None}
                empty = [slot for slot, held in sorted(self.holder.items()) if held is None and slot not in waiting]
                if not empty:  # grown: a place of its own
                    self.slots[rank] = self.holder[rank] = rank
                    self.entered[rank] = now
                    self.paused_before[rank] = self.paused_s
                    continue
                self.slots[rank] = empty[0]
                for fault in self.faults:
                    if fault.slot == empty[0] and fault.replaced_by is None:
                        fault.replaced_by = rank
            self.holder[self.slots[rank]] = rank
            for fault in self.faults:
                if fault.replaced_by == rank and fault.full_at is None:
                    fault.full_at = now

    # ---------------------------------------------------------------- figures

    def rate(self, slot: int) -> tuple[float | None, str]:
        """A slot's rate (samples/s) and how it was rated: ``steady``, ``undisturbed`` or ``none``."""
        steady = self.steady.get(slot, _Rate()).value
        if steady is not None:
            return steady, "steady"
        other = self.undisturbed.get(slot, _Rate()).value
        return (other, "undisturbed") if other is not None else (None, "none")

    def training_s(self, end: float, slot: int | None = None) -> float:
        """Training time to ``end`` (of ``slot``: from its entry), less the evals' pauses meanwhile."""
        since = self.start if slot is None else self.entered[slot]
        paused = self.paused_s - (0.0 if slot is None else self.paused_before.get(slot, 0.0))
        return max(0.0, end - since - paused)

    def capacity(self, end: float) -> tuple[float | None, dict[int, dict[str, Any]]]:
        """Samples the full world could have trained by ``end`` (None: a slot has no rate yet), and each
        slot's share of it."""
        total: float | None = 0.0
        per_slot: dict[int, dict[str, Any]] = {}
        for slot in sorted(self.entered):
            rate, rated = self.rate(slot)
            seconds = self.training_s(end, slot)
            per_slot[slot] = {"rate": rate, "rated": rated, "training_s": seconds}
            if rate is None or total is None:
                total = None
            else:
                total += rate * seconds
        return total, per_slot

    def lost(self, kept: Mapping[int, int], rank: int) -> int:
        """Samples ``rank`` trained that no replica kept (``kept``: the ledger's settled count per rank)."""
        return max(0, self.trained.get(rank, 0) - kept.get(rank, 0))

    def live(self, now: float, counted: int, kept: Mapping[int, int]) -> dict[str, float]:
        """The dashboard's figures so far: ``goodput`` (when every slot has a rate), ``lost_samples``."""
        capacity, _ = self.capacity(now)
        out = {"lost_samples": float(sum(self.lost(kept, r) for r in self.trained))}
        if capacity:
            out["goodput"] = counted / capacity
        return out

    def report(self, end: float, counted: int, kept: Mapping[int, int] | None) -> dict[str, Any]:
        """The summary's ``goodput`` figures at ``end``. ``counted``: the samples that count; ``kept``:
        the ledger's settled samples per rank (None where the ledger counts shards, not samples: lost
        work is then not known)."""
        capacity, per_slot = self.capacity(end)
        faults = [self._fault_row(f, kept) for f in self.faults]
        return {
            "goodput": counted / capacity if capacity else None,
            "samples": counted,
            "capacity_samples": capacity,
            "training_s": self.training_s(end),
            "paused_s": self.paused_s,
            "steady_s": self.steady_s,
            "slots": {str(slot): row for slot, row in per_slot.items()},
            "lost_samples": sum(self.lost(kept, r) for r in self.trained) if kept is not None else None,
            "why_none": None if capacity else self._why_none(per_slot),
            "faults": faults,
        }

    def _why_none(self, per_slot: Mapping[int, Mapping[str, Any]]) -> str:
        unrated = [slot for slot, row in per_slot.items() if row["rate"] is None]
        if unrated:
            return f"no undisturbed window settled with slot(s) {', '.join(map(str, unrated))} training: no rate to measure capacity by"
        return "no training time"

    def _fault_row(self, fault: Fault, kept: Mapping[int, int] | None) -> dict[str, Any]:
        detect = fault.detected - fault.since
        return {
            "rank": fault.rank,
            "slot": fault.slot,
            "reason": fault.reason,
            "at_s": fault.since - self.start,  # the fault's moment, in training time
            "detect_s": detect,  # fault -> declared dead
            "lost_samples": self.lost(kept, fault.rank) if kept is not None else None,
            # fault -> every survivor averaging again in the new membership (None: not seen before the end)
            "recovered_s": None if fault.back_at is None else fault.back_at - fault.since,
            "replaced_by": fault.replaced_by,
            "full_size_s": None if fault.full_at is None else fault.full_at - fault.since,  # fault -> the slot trains again
        }
