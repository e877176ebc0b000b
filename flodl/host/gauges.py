"""gauges.py: gauges of the machine a process runs on, summarized per interval.

A ``ResourceSampler`` reads host CPU use, the process's resident memory and,
for ``cuda:N`` devices, GPU utilization and VRAM through NVML (``pynvml``).
Gauges are sampled about every 500 ms and ``summary()`` condenses the
readings since its last call into the record stream's ``res`` keys
(``gpu_util``, ``gpu_util_max``, ``vram_alloc``, ``vram_alloc_max``,
``vram_total``) plus ``cpu_util`` and ``rss_bytes``. Missing NVML or GPUs
degrade to host-only gauges; sampling never raises. Absent keys mean "not
measured", never zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from ..config.env import cuda_visible_devices

log = logging.getLogger(__name__)

Reading = Mapping[str, float]
"""One instant's gauges: any of cpu_util, rss_bytes, gpu_util, vram_alloc, vram_total."""

# How summary() condenses each gauge: (output key, statistic).
_SUMMARY: dict[str, tuple[tuple[str, str], ...]] = {
    "gpu_util": (("gpu_util", "mean"), ("gpu_util_max", "max")),
    "vram_alloc": (("vram_alloc", "mean"), ("vram_alloc_max", "max")),
    "vram_total": (("vram_total", "last"),),
    "cpu_util": (("cpu_util", "mean"),),
    "rss_bytes": (("rss_bytes", "last"),),
}
_BYTES = frozenset({"vram_alloc", "vram_alloc_max", "vram_total", "rss_bytes"})


# ---- device mapping --------------------------------------------------------


def nvml_target(device: str, visible: str | None) -> int | str | None:
    """Where ``cuda:N`` lives in NVML: an index, a ``GPU-…`` UUID, or None.

    CUDA numbers only the devices in ``CUDA_VISIBLE_DEVICES``; NVML sees all.
    A plain comma list of integers maps N to its N-th entry and a UUID entry
    is returned as is. Anything else (MIG ids, "-1", N past the list) gives
    None: better no GPU gauges than another GPU's.
    """
    if not device.startswith("cuda:") or not device[5:].isdigit():
        return None
    n = int(device[5:])
    if visible is None:
        return n
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if n >= len(entries):
        return None
    entry = entries[n]
    if entry.isdigit():
        return int(entry)
    return entry if entry.startswith("GPU-") else None


# ---- the real reader -------------------------------------------------------


class _Failed:
    """Sentinel: a gauge call raised (distinct from a call that returned None)."""

    def __repr__(self) -> str:
        return "<failed>"


_FAILED: Any = _Failed()


class MachineReader:
    """Reads this machine's gauges now; the default ``read`` of a sampler.

    Host CPU is computed from ``psutil.cpu_times()`` deltas held here,
    because ``psutil.cpu_percent(None)`` keeps its baseline per calling
    thread and would read 0.0 on every fresh ``asyncio.to_thread`` worker.
    """

    def __init__(
        self, devices: list[str], *, process_cpu: bool = False, include_children: bool = False, visible: str | None = None
    ) -> None:
        self._process = psutil.Process()
        self._process_cpu = process_cpu
        self._include_children = include_children
        self._last_times = psutil.cpu_times()
        if process_cpu:
            self._process.cpu_percent(None)  # prime: the first call has no baseline
        self._noted: set[str] = set()
        self._nvml_up = False
        self._handles = self._open_gpus([d for d in devices if d.startswith("cuda:")], visible)

    def __call__(self) -> dict[str, float]:
        reading = self._host()
        if self._handles:
            reading.update(self._gpus())
        return reading

    def close(self) -> None:
        """Release NVML (reference-counted by the library, so pairs are safe)."""
        if self._nvml_up:
            self._nvml_up = False
            self._handles = []
            self._quiet(_nvml().nvmlShutdown, "nvml shutdown")

    # -- host --

    def _host(self) -> dict[str, float]:
        out: dict[str, float] = {}
        cpu = self._quiet(self._cpu_util, "cpu")
        if isinstance(cpu, float):  # None: no time passed since the last reading
            out["cpu_util"] = cpu
        rss = self._quiet(self._rss, "rss")
        if isinstance(rss, float):
            out["rss_bytes"] = rss
        return out

    def _cpu_util(self) -> float | None:
        if self._process_cpu:
            return float(self._process.cpu_percent(None))
        now = psutil.cpu_times()
        busy = _busy_fraction(self._last_times, now)
        self._last_times = now
        return None if busy is None else 100.0 * busy

    def _rss(self) -> float:
        rss = self._process.memory_info().rss
        if self._include_children:
            for child in self._process.children(recursive=True):
                try:
                    rss += child.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass  # a child that exits mid-walk is simply not counted
        return float(rss)

    # -- gpu --

    def _open_gpus(self, devices: list[str], visible: str | None) -> list[Any]:
        if not devices:
            return []
        nv = self._quiet(_nvml, "import pynvml")
        if nv is _FAILED or self._quiet(nv.nvmlInit, "nvml init") is _FAILED:
            return []
        self._nvml_up = True
        handles = [h for h in (self._handle(nv, d, visible) for d in devices) if h is not None]
        if not handles:
            self.close()
        return handles

    def _handle(self, nv: Any, device: str, visible: str | None) -> Any:
        target = nvml_target(device, visible)
        if target is None:
            self._note(device, f"no NVML device for {device} (CUDA_VISIBLE_DEVICES={visible!r})")
            return None
        get = nv.nvmlDeviceGetHandleByUUID if isinstance(target, str) else nv.nvmlDeviceGetHandleByIndex
        handle = self._quiet(lambda: get(target), f"handle {device}")
        return None if handle is _FAILED else handle

    def _gpus(self) -> dict[str, float]:
        """Across this process's GPUs: mean utilization, summed memory."""
        nv = _nvml()
        utils, used, total = [], 0.0, 0.0
        for h in self._handles:
            got = self._quiet(
                lambda: (nv.nvmlDeviceGetUtilizationRates(h), nv.nvmlDeviceGetMemoryInfo(h)),  # noqa: B023 - called in this iteration
                "gpu read",
            )
            if got is _FAILED:
                return {}  # one GPU unreadable ⇒ no GPU gauges this time rather than partial sums
            rates, mem = got
            utils.append(float(rates.gpu))
            used, total = used + float(mem.used), total + float(mem.total)
        return {"gpu_util": sum(utils) / len(utils), "vram_alloc": used, "vram_total": total}

    # -- never raise --

    def _quiet(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``, or ``_FAILED`` after logging its error once at debug."""
        try:
            return fn()
        except Exception as exc:  # NVML/psutil failures all mean "gauge unavailable"
            self._note(what, f"{what} unavailable: {exc!r}")
            return _FAILED

    def _note(self, key: str, message: str) -> None:
        """Log at debug once per key: a missing GPU is normal, not news every 500 ms."""
        if key not in self._noted:
            self._noted.add(key)
            log.debug("resource sampler: %s", message)


def _nvml() -> Any:
    import pynvml  # imported lazily: a host without the package still samples CPU

    return pynvml


def _busy_fraction(t1: Any, t2: Any) -> float | None:
    """Share of CPU time spent busy between two ``psutil.cpu_times()``."""
    total = _cpu_total(t2) - _cpu_total(t1)
    idle = _cpu_idle(t2) - _cpu_idle(t1)
    if total <= 0:
        return None
    return min(1.0, max(0.0, (total - idle) / total))


def _cpu_total(t: Any) -> float:
    # On Linux guest time is already inside user/nice; don't count it twice.
    return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _cpu_idle(t: Any) -> float:
    return t.idle + getattr(t, "iowait", 0.0)


# ---- the sampler -----------------------------------------------------------


class _Stat:
    """Running count/sum/max/last of one gauge over an interval."""

    __slots__ = ("n", "total", "max", "last")

    def __init__(self) -> None:
        self.n, self.total, self.max, self.last = 0, 0.0, -math.inf, 0.0

    def add(self, v: float) -> None:
        self.n, self.total, self.max, self.last = self.n + 1, self.total + v, max(self.max, v), v

    def get(self, statistic: str) -> float:
        return {"mean": self.total / self.n, "max": self.max, "last": self.last}[statistic]


class ResourceSampler:
    """Samples gauges every ``interval_s`` and summarizes them per interval.

    ``read`` is the gauge source (default: a ``MachineReader`` for
    ``devices``); tests inject one to feed numbers. Drive it with
    ``run_in_thread()``/``stop()`` in processes without an event loop, or
    ``await run()`` inside a TaskGroup; ``sample()`` and ``summary()`` are
    safe to call from any thread.
    """

    def __init__(
        self,
        devices: list[str],
        *,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], Reading] | None = None,
        process_cpu: bool = False,
        include_children: bool = False,
        visible_devices: str | None = None,
    ) -> None:
        """``visible_devices`` is ``CUDA_VISIBLE_DEVICES``; None reads it from the environment."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.devices = list(devices)
        self.interval_s = interval_s
        self.clock = clock
        self.last_sample_s: float | None = None
        self._owned: MachineReader | None = None
        if read is None:
            visible = visible_devices if visible_devices is not None else cuda_visible_devices()
            read = self._owned = MachineReader(self.devices, process_cpu=process_cpu, include_children=include_children, visible=visible)
        self._read = read
        self._read_lock = threading.Lock()  # one reading at a time (NVML and cpu_times baselines)
        self._lock = threading.Lock()  # guards the interval's stats
        self._stats: dict[str, _Stat] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read_failed = False

    # ---- readings ----

    def sample(self) -> None:
        """Take one reading now and fold it into the current interval. Never raises."""
        with self._read_lock:
            reading = self._safe_read()
        with self._lock:
            for key, value in reading.items():
                if key in _SUMMARY and _finite(value):
                    self._stats.setdefault(key, _Stat()).add(float(value))
            self.last_sample_s = self.clock()

    def _safe_read(self) -> Reading:
        try:
            return self._read()
        except Exception as exc:  # a broken gauge must never take the process down
            if not self._read_failed:
                self._read_failed = True
                log.debug("resource sampler: read failed: %r", exc)
            return {}

    def summary(self) -> dict[str, float | int]:
        """Summary of the readings since the last call, then a fresh interval.

        Keys: gpu_util (mean), gpu_util_max, vram_alloc (mean),
        vram_alloc_max, vram_total, cpu_util (mean), rss_bytes (last); only
        those measured. Byte gauges are ints. Empty when no reading arrived,
        so callers can tell "no fresh sample" from a zero.
        """
        with self._lock:
            stats, self._stats = self._stats, {}
        out: dict[str, float | int] = {}
        for gauge, stat in stats.items():
            for key, statistic in _SUMMARY[gauge]:
                value = stat.get(statistic)
                out[key] = int(round(value)) if key in _BYTES else value  # noqa: RUF046 - int() whatever numeric type a gauge source hands back
        return out

    # ---- drivers ----

    def run_in_thread(self) -> threading.Thread:
        """Sample every ``interval_s`` on a daemon thread until ``stop()``.

        Raises:
            RuntimeError: a sampling thread is already running.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("resource sampler thread already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._thread_loop, name="flodl-resources", daemon=True)
        self._thread.start()
        return self._thread

    def _thread_loop(self) -> None:
        next_at = self.clock()
        while not self._stop.is_set():
            self.sample()
            next_at = self._next_deadline(next_at)
            # Event.wait, not sleep: stop() wakes the thread at once.
            self._stop.wait(max(0.0, next_at - self.clock()))

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled or ``stop()``.

        Each reading runs in a worker thread (``asyncio.to_thread``) so a
        slow NVML call never blocks the loop. Cancelling while a reading is
        in flight abandons the wait; the reading finishes harmlessly.
        """
        self._stop.clear()
        next_at = self.clock()
        while not self._stop.is_set():
            await asyncio.to_thread(self.sample)
            next_at = self._next_deadline(next_at)
            await asyncio.sleep(max(0.0, next_at - self.clock()))

    def _next_deadline(self, previous: float) -> float:
        """The next tick on a fixed grid; after a stall, restart from now instead of bursting."""
        nxt = previous + self.interval_s
        return nxt if nxt > self.clock() else self.clock() + self.interval_s

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop sampling; join the thread (if any) for up to ``timeout_s``.

        Returns True when no sampling thread is left running. A thread stuck
        in a hung NVML call is a daemon and won't block interpreter exit.
        """
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            log.debug("resource sampler: thread did not stop within %.1fs", timeout_s)
            return False
        self._thread = None
        return True

    def close(self) -> None:
        """Stop sampling and release NVML. Safe to call twice."""
        self.stop()
        # Bounded: a reading hung in NVML holds the lock; leave NVML up rather than hang here.
        if self._owned is not None and self._read_lock.acquire(timeout=2.0):
            try:
                self._owned.close()
            finally:
                self._read_lock.release()

    def __enter__(self) -> ResourceSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
