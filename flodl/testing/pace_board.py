"""SIMULATION only: the live base a simulated slow rank is paced against.

``FLODL_SIMULATE_BASE_MS`` paces a slow rank against a fixed base, the solo
step time measured before the run. With ``FLODL_SIMULATE_PACE_FILE`` set,
every rank at full speed publishes a running mean of its step time in that
file, and every paced rank reads it before each step as its base
(``flodl.config.env.live_base_ms`` keeps it within 1.5x of the fixed base):
the pair steps ``factor``:1 against the partner's step as it runs beside it,
not as it ran alone. The fixed base (or the old rule) stands until the first
value is published. The benchmarks pace against the fixed base unless asked
(``bench.matrix --live-pace``): a baseline's fast step may hold its own
overhead or a wait for its peer, which a live base would pass on to its slow
rank. (The MLP pairs that once stepped 3.3:1 against a fixed base were slowed
by subnormal floats, not by their partner: bench/matrix/tasks.py.)

The board is one float64 in a shared memory map: publishing and reading cost a
store and a load, no system call. Several publishers (two fast ranks) write
the same slot, the last one wins: ranks at full speed on one machine step at
about the same pace, and this is a benchmark's simulation, not a measurement.
"""

from __future__ import annotations

import mmap
import os
import struct

__all__ = ["PaceBoard"]

_SLOT = struct.Struct("<d")
#: the running mean's weight on a new step: about the last 32 steps (20 ms of the
#: sub-ms MLP, a second of ResNet-20) - long enough to smooth a GC pause or a
#: landing average, short enough to follow the partner's pace as it changes
_WEIGHT = 1.0 / 32.0


class PaceBoard:
    """One shared step time, in ms: ``publish`` (ranks at full speed), ``base_ms`` (paced ranks)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SLOT.size:
                os.ftruncate(fd, _SLOT.size)  # a new file reads 0.0: nothing published yet
            self._map = mmap.mmap(fd, _SLOT.size)
        finally:
            os.close(fd)  # the map keeps the file
        self._mean: float | None = None

    def publish(self, step_ms: float) -> None:
        """Fold one step's time into this publisher's running mean and post the mean."""
        if not step_ms > 0.0:
            return
        self._mean = step_ms if self._mean is None else self._mean + _WEIGHT * (step_ms - self._mean)
        _SLOT.pack_into(self._map, 0, self._mean)

    def base_ms(self) -> float | None:
        """The step time last posted (None: nothing posted yet)."""
        (value,) = _SLOT.unpack_from(self._map, 0)
        return value if value > 0.0 else None

    def close(self) -> None:
        self._map.close()
