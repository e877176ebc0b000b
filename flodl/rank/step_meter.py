"""What a rank's steps cost and scored, learnt without stalling the device.

On a CPU a step's loss is on the host the moment the step ends, so each step
is measured on its own (``float(loss)``, ``perf_counter``): exact and free.

On a GPU that same read-back waits for the device: every step would drain the
launch queue, and the host could no longer run ahead of the kernels, which is
what keeps a fast GPU busy (an idiomatic loop reads its loss every N steps).
So a GPU rank measures steps in *groups*: the losses add up on the device, a
CUDA event closes each group, and the group's sum is copied into pinned host
memory without blocking. A group is resolved once its event has passed, which
the host asks (a non-blocking ``query``) each time it closes a group. Its GPU time
(event to event) and its mean loss are then reported for each of its steps.
Nothing per step waits for the device; a window's end does (``drain``), before
the average, so a non-finite loss is still caught before the replica is
averaged into the others.

The pace ElChe learns is the device's: a group's time is what the GPU took,
idle gaps included (a GPU starved by its host is slower, honestly).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .outcomes import NonFiniteLoss

#: A group closes after this much host time (kernels launched) ...
GROUP_MS = 50.0
#: ... or this many steps, whichever comes first: reports lag the device by about a group.
GROUP_STEPS = 64
#: Pinned slots for the groups' loss sums: allocated once (a pinned allocation per group cost
#: ~0.8 ms of host time on the H200's host); more groups than this in flight wait for the oldest.
RING = 256


@dataclass(slots=True)  # made every step: a frozen dataclass costs 5x to build
class StepRecord:
    """One step, as the controller and the window's statistics see it."""

    epoch: int
    step: int  # the rank's local step count after this step
    samples: int
    loss: float
    compute_ms: float
    data_ms: float


@dataclass
class _Group:
    """Steps launched on the device whose loss and time are not known yet."""

    start: Any  # torch.cuda.Event recorded before the group's first step
    steps: list[tuple[int, int, int, float]] = field(default_factory=list)  # (epoch, step, samples, data_ms)
    losses: list[torch.Tensor] = field(default_factory=list)  # the steps' detached losses, summed once at close
    end: Any = None
    slot: int = 0  # where the losses' sum lands in the meter's pinned ring (valid once ``end`` passed)
    loss_sum: float | None = None  # read early when its slot had to be reused
    opened: float = 0.0


class StepMeter:
    """Turns finished steps into ``StepRecord``s: at once on a CPU, in lagged groups on a GPU."""

    def __init__(self, device: torch.device, *, per_step: bool | None = None) -> None:
        # the device defers its read-backs unless told otherwise (a simulated slowdown paces each step)
        self.per_step = device.type != "cuda" if per_step is None else per_step
        self._open: _Group | None = None
        self._in_flight: collections.deque[_Group] = collections.deque()
        self._ring: torch.Tensor | None = None  # pinned loss sums, made at the first group
        self._next_slot = 0
        self._last_end: Any = None  # the previous group's end event: the next one starts there

    @property
    def pending(self) -> int:
        """Steps launched whose record is not out yet."""
        if self.per_step:  # asked every step: a CPU's records are out at once
            return 0
        return sum(len(g.steps) for g in self._in_flight) + (len(self._open.steps) if self._open else 0)

    def begin(self) -> float:
        """A step starts: its host clock (and, on a GPU, the group's start event)."""
        if not self.per_step and self._open is None:
            start = self._last_end  # groups back to back share an event: one record per group, not two
            if start is None:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            self._open = _Group(start=start, opened=time.perf_counter())
        return time.perf_counter()

    def measured(
        self, t0: float, loss: torch.Tensor, *, epoch: int, step: int, samples: int, data_ms: float, close: bool = False
    ) -> list[StepRecord]:
        """A step ended (launched, on a GPU): the records now known, this one's included on a CPU.

        ``close`` ends the step's group at once (a process's first step: warm-up, timed alone).

        Raises:
            NonFiniteLoss: a resolved step's loss is NaN or infinite.
        """
        if self.per_step:
            value = loss.item()  # also waits for the device, so the timing is honest
            if not math.isfinite(value):
                raise NonFiniteLoss(value, epoch, step)
            return [StepRecord(epoch, step, samples, value, (time.perf_counter() - t0) * 1000.0, data_ms)]
        group = self._open
        assert group is not None, "measured() without begin()"  # begin() opens a group whenever steps are grouped
        group.losses.append(loss.detach())  # no kernel per step: the group's sum is one, at close
        group.steps.append((epoch, step, samples, data_ms))
        if close or len(group.steps) >= GROUP_STEPS or (time.perf_counter() - group.opened) * 1000.0 >= GROUP_MS:
            self._close(group)
            return self._resolve(wait=False)  # earlier groups may be done: asked once per group, not per step
        return []

    def drain(self) -> list[StepRecord]:
        """Wait for every launched step (a window's end) and return their records."""
        if self._open is not None:
            self._close(self._open)
        self._last_end = None  # a window's turnaround is not the next group's time
        return self._resolve(wait=True)

    def _close(self, group: _Group) -> None:
        """End the open ``group``: its loss sum and end event are queued on the device."""
        self._open = None
        total = torch.stack(group.losses).float().sum() if len(group.losses) > 1 else group.losses[0].float()
        group.losses = []  # the steps' loss tensors are no longer needed
        if self._ring is None:
            self._ring = torch.zeros(RING, dtype=torch.float32, pin_memory=True)
        if len(self._in_flight) >= RING:  # every slot holds a sum not read yet: the one about to be reused is read now
            # (the groups ahead of it were read early already and stay in flight until resolved)
            owner = self._in_flight[len(self._in_flight) - RING]
            owner.end.synchronize()
            owner.loss_sum = self._sum_in(owner.slot)
        group.slot = self._next_slot
        self._next_slot = (self._next_slot + 1) % RING
        self._ring[group.slot].copy_(total, non_blocking=True)
        group.end = self._last_end = torch.cuda.Event(enable_timing=True)
        group.end.record()
        self._in_flight.append(group)

    def _resolve(self, *, wait: bool) -> list[StepRecord]:
        records: list[StepRecord] = []
        while self._in_flight:
            group = self._in_flight[0]
            if wait:
                group.end.synchronize()
            elif not group.end.query():
                break
            self._in_flight.popleft()
            n = len(group.steps)
            mean_loss = (group.loss_sum if group.loss_sum is not None else self._sum_in(group.slot)) / n
            step_ms = group.start.elapsed_time(group.end) / n
            if not math.isfinite(mean_loss):
                epoch, step, _, _ = group.steps[0]
                raise NonFiniteLoss(mean_loss, epoch, step)
            records.extend(StepRecord(epoch, step, samples, mean_loss, step_ms, data_ms) for epoch, step, samples, data_ms in group.steps)
        return records

    def _sum_in(self, slot: int) -> float:
        """The loss sum a closed group left in ``slot`` of the ring (its end event has passed)."""
        assert self._ring is not None, "a slot read before any group closed"  # _close makes the ring first
        return float(self._ring[slot])
