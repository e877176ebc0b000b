"""The probes of tests and benchmarks: faults injected, a slower device simulated.

``flodl/probes.py`` is the interface product code calls (no-op there); this is
what a process's entry point installs when ``FLODL_INJECT_FAULT`` or a
``FLODL_SIMULATE_*`` variable is set (``install_from_environment``):

* ``reach`` fires this rank's armed faults (``FaultPlan``, faults.py);
* ``observe`` writes the state a rank holds at a point (a joiner's optimizer
  state and its donor's) to ``FLODL_PROBE_DIR``, for a test to compare;
* ``pace`` makes a rank of slowdown ``f`` (``FLODL_SIMULATE_SLOWDOWN``) step
  ``f`` times as slowly as the base (``FLODL_SIMULATE_BASE_MS``, or the live one
  a full-speed rank posts on the pace board, pace_board.py), from its second
  step on (the first is set-up and warm-up, no device's pace); it reports the
  time the step really took, sleep included. A full-speed rank with a pace
  board posts its own step time there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.env import (
    live_base_ms,
    paced_step,
    pacing_late_ms,
    probe_dir,
    simulated_base_ms,
    simulated_pace_file,
    simulated_slowdown,
)
from ..probes import Probes, install
from .faults import FaultPlan
from .pace_board import PaceBoard


class Pacer:
    """One rank's simulated pace: slower than its device (``slowdown`` > 1), or posting the live base."""

    def __init__(self, slowdown: float, base_ms: float | None, board: PaceBoard | None) -> None:
        self.slowdown = slowdown
        self.base_ms = base_ms if slowdown > 1.0 else None
        self.board = board
        self.late_ms = 0.0  # how far behind its paced schedule this rank is (env.pacing_late_ms)

    @classmethod
    def from_env(cls, rank: int) -> Pacer:
        path = simulated_pace_file()
        return cls(simulated_slowdown(rank), simulated_base_ms(rank), PaceBoard(path) if path else None)

    @property
    def active(self) -> bool:
        return self.slowdown > 1.0 or self.board is not None

    def pace(self, record: Any, started: float) -> Any:
        """Sleep what makes this step a slower device's (re-timed: sleep included), or post its time."""
        if record.step <= 1:  # the first step is set-up and warm-up: no device's pace
            return record
        if self.slowdown <= 1.0:  # a full-speed rank posts the pace paced ranks follow
            if self.board is not None:
                self.board.publish(record.compute_ms)
            return record
        base_ms = live_base_ms(self.board.base_ms() if self.board else None, self.base_ms)
        pause_ms, _ = paced_step(record.compute_ms, self.slowdown, base_ms, self.late_ms)
        if pause_ms > 0.0:
            time.sleep(pause_ms / 1000.0)
            record = dataclasses.replace(record, compute_ms=(time.perf_counter() - started) * 1000.0)
        self.late_ms = pacing_late_ms(self.late_ms, record.compute_ms, self.slowdown, base_ms)
        return record


class Injected(Probes):
    """Rank ``rank``'s armed faults and simulated pace, and where it writes the states it observes."""

    def __init__(self, faults: FaultPlan, pacer: Pacer | None = None, *, rank: int = -1, observed: str | None = None) -> None:
        self.faults = faults
        self.pacer = pacer
        self.rank = rank
        self.observed = observed  # FLODL_PROBE_DIR
        self.paces = pacer is not None and pacer.active
        # a paced rank's steps are each measured on their own, even on a GPU (step_meter.py)
        self.paced_alone = pacer is not None and pacer.slowdown > 1.0

    @classmethod
    def from_env(cls, rank: int, *, pace: bool = True) -> Injected:
        """From ``FLODL_INJECT_FAULT`` and (with ``pace``) ``FLODL_SIMULATE_*``.

        Raises:
            ValueError: a variable is malformed (names it and the bad item).
        """
        return cls(FaultPlan.from_env(rank), Pacer.from_env(rank) if pace else None, rank=rank, observed=probe_dir())

    def armed(self, point: str) -> bool:
        return point in self.faults.armed

    def reach(self, point: str, *, index: int | None = None, before: Callable[[], object] | None = None) -> str | None:
        return self.faults.reach(point, index=index, before=before)

    def pace(self, record: Any, started: float) -> Any:
        return self.pacer.pace(record, started) if self.pacer is not None else record

    def spawn_delay_s(self) -> float:
        return self.faults.spawn_delay_s()

    def observe(self, point: str, state: Callable[[], dict[str, Any]]) -> None:
        """Write ``state()`` to ``<FLODL_PROBE_DIR>/<point>.rank<N>.<k>.safetensors`` (k counts this
        rank's observations of the point from 0): a test reads and compares them. Its metadata says
        when (``t0``: the point reached, ``t1``: written; Unix time), so a benchmark can time the
        point and take the write's own cost out (not fsynced: nothing here must survive a crash)."""
        if not self.observed:
            return
        from ..checkpoint import safetensors_io  # torch: only a rank observes

        t0 = time.time()
        folder = Path(self.observed)
        k = sum(1 for _ in folder.glob(f"{point}.rank{self.rank}.*.safetensors"))
        data = safetensors_io.dumps(state(), {"t0": repr(t0)})
        path = folder / f"{point}.rank{self.rank}.{k}.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
        (folder / f"{path.name}.t1").write_text(repr(time.time()))


def install_from_environment(*, pace: bool = True) -> None:
    """An entry point's call, once ``config.env.probes_requested()`` said the environment asks for
    faults or a simulation: this process's ranks get them (``flodl.probes.for_rank``). A process
    that trains nothing (the worker: its ``spawn`` point) takes the faults only (``pace=False``)."""
    install(lambda rank: Injected.from_env(rank, pace=pace))
